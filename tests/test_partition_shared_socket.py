"""A partition never drops a socket that its targets share with a process outside the scope.

A parent (tagged `<x>-parent`) listens on 127.0.0.1, accepts one client connection it keeps and
echoes on, then starts a child tagged `<x>-child` that inherits both the listening socket and
that connection (the same socket inodes). Partitioning the child's tag must leave the parent
reachable (new connections answered, the kept connection echoing) and list the shared port and
connection in `left_out`, naming the parent's PID. The child that holds nothing of its own
(`sleep`, the outside tester's repro) is a partition that would drop nothing: refused, nothing
loaded. A child with a listener of its own is cut on that one only. Every process started is
proven gone afterwards, and no rule of the test's ports is left in nftables."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import require_tool
from partition_helpers import connect
from proc_helpers import alive, unique, wait_until

# the parent: listens, prints its port, accepts the first connection (kept, echoed on a thread),
# starts the child with both sockets inherited, prints "child_pid [child_port]", then answers
# every later connection with "parent\n"
PARENT = r"""
import os, socket, subprocess, sys, threading
child_tag, mode = sys.argv[1], sys.argv[2]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
kept, _ = s.accept()
env = dict(os.environ, CHAOSGPU_TAG=child_tag)
if mode == "sleep":
    argv = ["sleep", "600"]
else:  # a child with a listener of its own besides the inherited sockets
    argv = [sys.executable, "-c",
            "import socket, time\n"
            "o = socket.socket(); o.bind(('127.0.0.1', 0)); o.listen(4)\n"
            "print(o.getsockname()[1], flush=True)\n"
            "time.sleep(600)\n"]
child = subprocess.Popen(argv, pass_fds=(s.fileno(), kept.fileno()), env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
own = child.stdout.readline().strip() if mode != "sleep" else ""
print(child.pid, own, flush=True)

def echo():
    while True:
        data = kept.recv(100)
        if not data:
            return
        kept.sendall(data)

threading.Thread(target=echo, daemon=True).start()
while True:
    conn, _ = s.accept()
    conn.sendall(b"parent\n")
    conn.close()
"""


@pytest.fixture(autouse=True)
def _root_and_nft() -> None:
    require_tool("nft", install="apt-get install nftables")
    if os.geteuid() != 0:
        pytest.skip("needs root to add nftables rules")


def _ask(port: int, timeout: float = 1.5) -> str:
    """The parent's answer to a new connection, or `timeout` (dropped silently), `refused`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
            return conn.makefile("rb").readline().decode().strip() or "closed"
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"


def _echo(conn: socket.socket, timeout: float = 1.5) -> str:
    """What the kept connection echoes back, or `timeout`."""
    conn.settimeout(timeout)
    try:
        conn.sendall(b"ping\n")
        return conn.recv(100).decode().strip()
    except TimeoutError:
        return "timeout"


def _rules_for(*ports: int) -> list[str]:
    """The lines of the loaded ruleset naming one of `ports`."""
    listed = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True,
                            check=True).stdout
    return [line for line in listed.splitlines()
            if any(f" {p} " in f"{line} " for p in ports)]


def _tables() -> list[str]:
    out = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


@contextlib.contextmanager
def _family(mode: str) -> Iterator[dict[str, Any]]:
    """The parent, its client connection (kept) and its child; all killed and proven gone."""
    parent_tag, child_tag = unique("shared-parent"), unique("shared-child")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, child_tag, mode],
                              env=dict(os.environ, CHAOSGPU_TAG=parent_tag),
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    child_pid: int | None = None
    kept: socket.socket | None = None
    try:
        assert parent.stdout is not None
        port = int(parent.stdout.readline())
        kept = socket.create_connection(("127.0.0.1", port), timeout=5)
        child_line = parent.stdout.readline().split()
        child_pid = int(child_line[0])
        own = int(child_line[1]) if len(child_line) > 1 else None
        assert wait_until(lambda: _ask(port) == "parent", 5)
        yield {"parent": parent, "port": port, "kept": kept, "child_pid": child_pid,
               "child_tag": child_tag, "own": own}
    finally:
        if kept is not None:
            kept.close()
        if child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid, signal.SIGKILL)
        parent.kill()
        parent.wait(timeout=10)
        assert not alive(parent.pid)
        if child_pid is not None:  # reparented once its parent died, and reaped there
            assert wait_until(lambda: _gone(child_pid), 10), f"PID {child_pid} left behind"


def _gone(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # where this process is the subreaper
    return not os.path.exists(f"/proc/{pid}")


def test_a_listening_socket_shared_with_the_parent_is_left_out() -> None:
    """The outside tester's repro: the child (`sleep`) holds nothing of its own."""
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    with _family("sleep") as fam:
        port, parent = fam["port"], fam["parent"]
        outcome: dict[str, Any] | None = None
        error = ""
        try:
            outcome = network.partition_processes({"tag": fam["child_tag"]})
        except partitions.PartitionError as refused:
            error = str(refused)
        try:
            assert _ask(port) == "parent"  # the outside process stays reachable
            assert _echo(fam["kept"]) == "ping"  # its kept connection too
            assert not _rules_for(port), _rules_for(port)
            # nothing is the child's own: a partition that would drop nothing, refused
            assert outcome is None, outcome
            assert f"127.0.0.1:{port}" in error and f"PID {parent.pid}" in error, error
        finally:
            network.heal_all_partitions()
        assert _ask(port) == "parent"
    assert not _rules_for(port)


def test_a_child_with_a_port_of_its_own_is_cut_on_that_one_only() -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    with _family("listener") as fam:
        port, own, parent = fam["port"], fam["own"], fam["parent"]
        assert own is not None and connect("127.0.0.1", own) == "connected"  # its own listener
        cut = network.partition_processes({"tag": fam["child_tag"]})
        try:
            assert cut["pids"] == [fam["child_pid"]]
            assert _ask(port) == "parent"  # the outside process stays reachable
            assert _echo(fam["kept"]) == "ping"  # its kept connection too
            assert connect("127.0.0.1", own) == "timeout"  # the child's own port is cut
            assert cut["listening"] == [own] and cut["connections"] == [], cut
            record = partitions.read_record(partitions.KIND, cut["partition"])
            assert record["listen_rules"] == [f"ip daddr 127.0.0.1 tcp dport {own} drop"]
            assert record["connection_rules"] == [] and record["left_out"] == cut["left_out"]
            left = {x.get("listening") or tuple(x["connection"]): x for x in cut["left_out"]}
            shared = left[f"127.0.0.1:{port}"]
            assert shared["pids"] == [parent.pid], shared
            assert f"PID {parent.pid}" in shared["reason"], shared
            connection = [x for key, x in left.items() if isinstance(key, tuple)]
            assert len(connection) == 1 and connection[0]["pids"] == [parent.pid], left
            assert connection[0]["connection"][0] == f"127.0.0.1:{port}"
            assert f"PID {parent.pid}" in connection[0]["reason"]
            assert not [line for line in _rules_for(port) if "drop" in line]
        finally:
            healed = network.heal_all_partitions()
        assert [r["id"] for r in healed["removed"]] == [cut["partition"]]
        assert connect("127.0.0.1", own) == "connected" and _ask(port) == "parent"
        assert cut["table"] not in _tables()
    assert not _rules_for(port, own)
    assert cut["table"] not in _tables()
