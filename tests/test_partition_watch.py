"""A partition's listening rules end with their targets even while nothing looks: the runner's
watcher (pidfds of the targets) withdraws them as soon as every target has ended, with no probe,
observer or heal called; a stranger that binds the port then is reachable; healing stops the
watcher; a target whose PID was reused is never watched; without pidfds the record says so and
the next look withdraws them; a watcher's error is kept for active(), not lost in its thread.
Real processes, real sockets, real nftables tables; every process, table and thread is proven
gone afterwards."""

import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import require_tool
from partition_helpers import SERVER, Servers, connect

HOST = "127.0.0.1"


BOUND_S = 5.0  # how long the watcher may take to withdraw a rule (it takes milliseconds)


@pytest.fixture(autouse=True)
def _root_and_nft() -> Iterator[None]:
    require_tool("nft", install="apt-get install nftables")
    if os.geteuid() != 0:
        pytest.skip("needs root to add nftables rules")
    yield
    from chaosgpu.network import partitions

    for ident in list(partitions.list_records(partitions.KIND)):  # a failed test's leftovers
        partitions.remove(ident)
    assert _watchers() == [], "a partition watcher thread was left behind"




def _drops(table: str) -> list[str] | None:
    """The drop rules of `table` as nft lists them now (its input chain), None: no table."""
    out = subprocess.run(["nft", "list", "chain", "inet", table, "input"], capture_output=True,
                         text=True)
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip().endswith("drop")]


WATCH_THREAD = "chaosgpu-partition-watch-"  # + the partition's id (docs/faults.md)


def _watchers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(WATCH_THREAD)]


def _until(what: Any, seconds: float = BOUND_S) -> float:
    """Wait until `what()` holds (nothing else is called meanwhile); the seconds it took."""
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_the_listening_rule_goes_when_its_target_dies_with_nothing_looking(
        servers: Servers) -> None:
    """(1) killed, and with no call to active(), a probe, the observer or a heal, the listening
    rule leaves the real table while the connection rules stay; (2) a stranger that binds the
    same address and port then is reachable; the watcher has ended once its work is done."""
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    target, port = servers.start(HOST, 0, "self")  # listens, and holds a connection
    cut = network.partition_processes({"pids": [target.pid]})
    ident, table = cut["partition"], cut["table"]
    try:
        before = _drops(table)
        assert before is not None and f"ip daddr 127.0.0.1 tcp dport {port} drop" in before
        connection_drops = [r for r in before if " saddr " in r]
        assert connection_drops
        assert connect(HOST, port) == "timeout"

        servers.kill(target)  # from here on, nothing looks at the partition
        took = _until(lambda: not any(" saddr " not in r for r in _drops(table) or [""]))
        assert _drops(table) == connection_drops  # the connection rules stay (a node loss)
        record = partitions.read_record(partitions.KIND, ident)
        assert record["listen_watch"]["by"] == "pidfd", record["listen_watch"]
        assert record["listen_withdrawn_at"] is not None and record["listen_rules"] == []
        assert "listen_watch_error" not in record, record
        _until(lambda: _watchers() == [], 2.0)  # its work done, the watcher has ended

        stranger, again = servers.start(HOST, port)  # an innocent process, same address and port
        assert again == port and connect(HOST, port) == "connected", took
        assert _drops(table) == connection_drops  # the stranger is not partitioned
        assert stranger.poll() is None
    finally:
        healed = network.heal_all_partitions()
    assert [r["id"] for r in healed["removed"]] == [ident]
    assert _drops(table) is None and partitions.active() == []


def test_a_partition_with_only_a_listening_rule_is_healed_when_its_target_dies(
        servers: Servers) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    target, port = servers.start(HOST, 0)  # listens, no connection: only a listening rule
    cut = network.partition_processes({"pids": [target.pid]})
    assert connect(HOST, port) == "timeout"
    servers.kill(target)
    _until(lambda: _drops(cut["table"]) is None)  # nothing left to drop: healed, table gone
    # the watcher deletes the table, then the record: wait for both (a read right after the
    # table went could come between the two)
    _until(lambda: partitions.read_record(partitions.KIND, cut["partition"]) is None, 2.0)
    _until(lambda: _watchers() == [], 2.0)
    _, again = servers.start(HOST, port)
    assert connect(HOST, again) == "connected"
    assert network.heal_all_partitions()["removed"] == []


def test_healing_stops_the_watcher(servers: Servers) -> None:
    """(3) the target lives on; healing the partition stops its watcher before the heal
    returns: no thread is left behind."""
    from chaosgpu.network import actions as network

    target, port = servers.start(HOST, 0)
    cut = network.partition_processes({"pids": [target.pid]})
    other = network.partition_processes({"pids": [servers.start(HOST, 0)[0].pid]})
    assert sorted(_watchers()) == sorted(WATCH_THREAD + c["partition"]
                                         for c in (cut, other))
    assert network.heal_partition(cut["partition"])["removed"] is True
    assert _watchers() == [WATCH_THREAD + other["partition"]]  # at once: joined
    assert network.heal_all_partitions()["count"] == 1
    assert _watchers() == []
    assert connect(HOST, port) == "connected" and target.poll() is None  # healed, never killed


# Runs as PID 1 of a PID namespace of its own, where the next PID can be chosen
# (ns_last_pid): the target is partitioned, and just as the watcher opens its pidfd the target
# dies and its PID goes to an innocent process listening on the same address and port.
REUSED = r"""
import json, os, socket, subprocess, sys, threading, time
from chaosgpu.network import partitions
from chaosgpu.node import process_starttime

server, = sys.argv[1:]
def start(port):
    proc = subprocess.Popen([sys.executable, "-c", server, "127.0.0.1", str(port)],
                            stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    return proc, int(proc.stdout.readline())

target, port = start(0)
starttime = process_starttime(target.pid)
real_open, seen = os.pidfd_open, {}
def reused_open(pid, *args):
    if pid == target.pid and not seen:
        target.kill(); target.wait()
        time.sleep(0.05)  # a later start time (clock ticks) for the one that takes the PID
        with open("/proc/sys/kernel/ns_last_pid", "w") as handle:
            handle.write(str(pid - 1))
        seen["innocent"] = start(port)
    return real_open(pid, *args)
os.pidfd_open = reused_open
record = partitions.create([{"pid": target.pid, "starttime": starttime}])
os.pidfd_open = real_open
innocent, _ = seen["innocent"]
out = {"same_pid": innocent.pid == target.pid, "other_start":
       process_starttime(innocent.pid) != starttime, "watch": record["listen_watch"],
       "rules": record["listen_rules"]}
deadline = time.monotonic() + 5
while partitions.read_record(partitions.KIND, record["id"]) is not None:
    if time.monotonic() > deadline:
        break
    time.sleep(0.02)
out["healed"] = partitions.read_record(partitions.KIND, record["id"]) is None
time.sleep(0.2)
out["watchers"] = [t.name for t in threading.enumerate() if t.name != "MainThread"]
try:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        out["innocent"] = "connected"
except OSError as error:
    out["innocent"] = repr(error)
out["innocent_alive"] = innocent.poll() is None
for ident in partitions.list_records(partitions.KIND):
    partitions.remove(ident)
innocent.kill(); innocent.wait()
print(json.dumps(out), flush=True)
"""


def test_a_target_whose_pid_was_reused_has_ended_and_is_not_watched(servers: Servers) -> None:
    """(4) the target's PID belongs to another process by the time the watcher opens its pidfd
    (a real reuse, in a PID namespace): the start time differs, so the target has ended, its
    listening rule goes at once, and the innocent process with its PID is not watched."""
    require_tool("unshare", install="apt-get install util-linux")
    from chaosgpu.network import partitions
    from chaosgpu.node import process_starttime

    done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                           REUSED, SERVER], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["same_pid"] and out["other_start"], out  # a real PID reuse
    assert out["watch"]["by"] == "pidfd" and out["rules"], out
    assert out["healed"] is True, out  # ended: its only rule, the listening one, is gone
    assert out["watchers"] == [], out  # the innocent process was never watched
    assert out["innocent"] == "connected" and out["innocent_alive"], out
    assert partitions.list_records(partitions.KIND) == {}

    # the same check on this node: a live process named with another start time is not
    # watched and no pidfd is left open
    live, _ = servers.start(HOST, 0)
    fds = len(os.listdir("/proc/self/fd"))
    opened, watch = partitions._target_pidfds(
        [{"pid": live.pid, "starttime": process_starttime(live.pid) + 1}])
    assert opened == [] and watch["by"] == "pidfd"
    assert len(os.listdir("/proc/self/fd")) == fds


def test_without_pidfds_the_record_says_so_and_the_next_look_withdraws(
        servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    def unavailable(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", unavailable)
    target, port = servers.start(HOST, 0, "self")
    cut = network.partition_processes({"pids": [target.pid]})
    monkeypatch.undo()
    assert cut["listen_watch"]["by"] == "liveness check", cut
    assert "pidfd_open is unavailable" in cut["listen_watch"]["note"]
    assert _watchers() == []
    try:
        servers.kill(target)
        time.sleep(1.0)  # no watcher: the listening rule stays until something looks
        assert any(" saddr " not in r for r in _drops(cut["table"]) or [])
        entry = next(p for p in partitions.active() if p["id"] == cut["partition"])
        assert entry["listening_withdrawn_at"] is not None, entry
        assert entry["listen_watch"]["by"] == "liveness check"
        assert all(" saddr " in r for r in _drops(cut["table"]) or ["none"])
        _, again = servers.start(HOST, port)
        assert connect(HOST, again) == "connected"
    finally:
        network.heal_all_partitions()
    assert _drops(cut["table"]) is None


def test_a_watchers_error_is_kept_for_active_not_lost_in_its_thread(
        servers: Servers, monkeypatch: pytest.MonkeyPatch) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    raised: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    target, _ = servers.start(HOST, 0, "self")
    cut = network.partition_processes({"pids": [target.pid]})
    real_run = partitions._run_nft

    def refusing(args: list[str], netns_fd: int | None, stdin: str | None = None
                 ) -> subprocess.CompletedProcess[str]:
        if args[:1] == ["-f"]:
            return subprocess.CompletedProcess(args, 1, "", "Error: refused for the test")
        return real_run(args, netns_fd, stdin)

    monkeypatch.setattr(partitions, "_run_nft", refusing)
    try:
        servers.kill(target)
        _until(lambda: "listen_watch_error" in (
            partitions.read_record(partitions.KIND, cut["partition"]) or {}))
        _until(lambda: _watchers() == [], 2.0)
        entry = next(p for p in partitions.active() if p["id"] == cut["partition"])
        assert "refused for the test" in entry["watch_error"], entry
        assert "refused for the test" in entry["liveness_error"], entry  # tried again
        assert entry["listening_withdrawn_at"] is None
        monkeypatch.setattr(partitions, "_run_nft", real_run)
        entry = next(p for p in partitions.active() if p["id"] == cut["partition"])
        assert entry["listening_withdrawn_at"] is not None and "liveness_error" not in entry
    finally:
        monkeypatch.setattr(partitions, "_run_nft", real_run)
        network.heal_all_partitions()
    assert raised == []
    assert _drops(cut["table"]) is None
