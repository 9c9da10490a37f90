"""A partition's listening rule drops only new connections to the target's port (a SYN without
ACK), never an established connection on that port held by a process outside the scope.

The outside tester's repro, in a network namespace of its own: a fork-per-connection server
(the parent listens; its first client's connection it keeps and echoes on itself, every later
one goes to a forked child that closes the listener and echoes on the accepted connection). The
parent alone is partitioned. While partitioned: the client of a child (outside the scope) pings
every 0.5 s and is answered each time; a new connection to the port times out; the parent's
own connection is silent. After the heal, a new connection is answered by a new child and the
parent's own connection delivers what was held back. Every process is proven gone, and no
table is left in the namespace or on the host."""

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import require_tool
from proc_helpers import alive, wait_until

PORT = 45001  # the repro's port: the namespace is the test's own

# the server: listens on HOST:PORT, prints its PID; the first connection is the parent's own
# (echoed by the parent), each later one a child's (forked, the listener closed in it); every
# connection first receives the PID of the process holding it
SERVER = r"""
import os, select, signal, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port)); s.listen(16)
print(os.getpid(), flush=True)

def echo(conn):
    data = conn.recv(100)
    if data:
        conn.sendall(data)
    return bool(data)

own = None
while True:
    ready = select.select([s] + ([own] if own else []), [], [])[0]
    if own is not None and own in ready and not echo(own):
        own.close(); own = None
    if s not in ready:
        continue
    conn, _ = s.accept()
    if own is None:
        own = conn
        own.sendall(f"{os.getpid()}\n".encode())
        continue
    if os.fork() == 0:
        s.close(); own.close()
        conn.sendall(f"{os.getpid()}\n".encode())
        while echo(conn):
            pass
        os._exit(0)
    conn.close()
"""

# runs in the namespace: lo up, the server, two connections (the parent's own, a child's), the
# partition of the parent, what each client sees, the heal, everything killed; prints JSON
DRIVER = r"""
import json, os, signal, socket, subprocess, sys, time
from chaosgpu.network import actions as network
from chaosgpu.network import partitions

server_code, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
to = "127.0.0.1" if host == "0.0.0.0" else host
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
out = {"children": []}

def client(timeout=5.0):
    # a new connection and the PID of the process holding its other end
    conn = socket.create_connection((to, port), timeout=timeout)
    conn.settimeout(timeout)
    line = b""
    while not line.endswith(b"\n"):
        line += conn.recv(1)
    return conn, int(line)

def ping(conn, timeout=1.5):
    conn.settimeout(timeout)
    try:
        conn.sendall(b"ping")
        return conn.recv(100).decode()
    except TimeoutError:
        return "timeout"

def new():
    try:
        conn, holder = client(1.5)
    except TimeoutError:
        return "timeout", None
    out["children"].append(holder)
    answer = ping(conn)
    conn.close()
    return answer, holder

parent = subprocess.Popen([sys.executable, "-c", server_code, host, str(port)],
                          stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
out["parent"] = parent.pid
try:
    assert int(parent.stdout.readline()) == parent.pid
    own, out["own_holder"] = client()
    kept, out["kept_holder"] = client()
    out["children"].append(out["kept_holder"])
    out["before"] = [ping(own), ping(kept)]
    cut = network.partition_processes({"pids": [parent.pid]})
    try:
        out["cut"] = {k: cut[k] for k in ("connections", "listening", "left_out", "table")}
        record = partitions.read_record(partitions.KIND, cut["partition"])
        out["record"] = {k: record.get(k) for k in ("listen_rules", "connection_rules",
                                                     "listen_match")}
        out["ruleset"] = subprocess.run(["nft", "list", "table", "inet", cut["table"]],
                                        capture_output=True, text=True).stdout
        out["kept_during"] = []
        for _ in range(3):
            out["kept_during"].append(ping(kept))
            time.sleep(0.5)
        out["new_during"] = new()[0]
        for _ in range(3):
            out["kept_during"].append(ping(kept))
            time.sleep(0.5)
        own.sendall(b"held")
        own.settimeout(1.5)
        try:
            out["own_during"] = own.recv(100).decode()
        except TimeoutError:
            out["own_during"] = "timeout"
    finally:
        out["healed"] = [r["id"] for r in network.heal_all_partitions()["removed"]]
    out["new_after"], holder = new()
    out["new_after_holder_is_child"] = holder not in (None, parent.pid)
    out["kept_after"] = ping(kept)
    own.settimeout(15)  # the held back bytes, retransmitted once the drop is gone
    try:
        out["own_after"] = own.recv(100).decode()
    except TimeoutError:
        out["own_after"] = "timeout"
    out["records_left"] = sorted(partitions.list_records(partitions.KIND))
finally:
    for pid in out["children"]:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    parent.kill()
    parent.wait(timeout=10)
    out["tables_left"] = subprocess.run(["nft", "list", "tables"], capture_output=True,
                                        text=True, check=True).stdout.split()
    print(json.dumps(out), flush=True)
"""


@pytest.fixture(autouse=True)
def _root_and_tools() -> None:
    require_tool("nft", install="apt-get install nftables")
    require_tool("unshare", install="apt-get install util-linux")
    require_tool("ip", install="apt-get install iproute2")
    if os.geteuid() != 0:
        pytest.skip("needs root to add nftables rules and make a network namespace")


def _host_tables() -> list[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def _gone(pid: int) -> bool:
    return not alive(pid)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "0.0.0.0"])
def test_an_established_connection_held_outside_the_scope_keeps_working(host: str) -> None:
    driver = subprocess.Popen(["unshare", "--net", "--", sys.executable, "-c", DRIVER, SERVER,
                               host, str(PORT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL)
    try:
        stdout, stderr = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(timeout=10)
    assert driver.returncode == 0, stderr[-3000:]
    out: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    pids = [out["parent"], *(p for p in out["children"] if p is not None)]
    try:
        assert out["before"] == ["ping", "ping"], out
        assert out["own_holder"] == out["parent"], out  # the parent's own connection
        assert out["kept_holder"] != out["parent"], out  # a child's, outside the scope
        assert out["cut"]["connections"] and out["cut"]["listening"] == [PORT], out
        assert out["cut"]["left_out"] == [], out
        # the child's established connection on the partitioned port keeps working
        assert out["kept_during"] == ["ping"] * 6, (out["kept_during"], out["ruleset"])
        assert out["new_during"] == "timeout", out  # a new connection to the port is dropped
        assert out["own_during"] == "timeout", out  # the target's own connection too
        assert out["record"]["listen_match"] == "tcp flags & (syn | ack) == syn", out
        assert out["healed"] and out["records_left"] == [], out
        assert out["new_after"] == "ping" and out["new_after_holder_is_child"], out
        assert out["kept_after"] == "ping", out
        assert out["own_after"] == "held", out
        assert not [t for t in out["tables_left"] if t.startswith("chaosgpu_")], out
    finally:
        # the children were reparented outside this test once the parent died: proven gone
        assert wait_until(lambda: all(_gone(p) for p in pids), 10), \
            [p for p in pids if not _gone(p)]
    assert out["cut"]["table"] not in _host_tables()
