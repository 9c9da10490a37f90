"""Small process helpers shared by the tests (the package's own readings live in chaosgpu.node;
tests use these to check it from the outside)."""

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any


def alive(pid: int) -> bool:
    """Whether `pid` exists and is neither a zombie nor dead (read straight from /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def proc_state(pid: int) -> str:
    """The one-letter state of `pid` (R, S, D, T, t, Z ...) read straight from /proc; raises
    FileNotFoundError once it is gone."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()[0].decode()


def v1_freezer_cgroup(pid: int) -> str:
    """The cgroup v1 freezer path of `pid` (its /proc/PID/cgroup line for "freezer")."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            return path
    raise AssertionError(f"PID {pid} has no v1 freezer cgroup")


def unique(prefix: str) -> str:
    """`prefix` and 8 random hex digits: a tag or name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def finish(*procs: "subprocess.Popen[Any]") -> None:
    """Resume (SIGCONT), kill and reap each of `procs` still running, in order (a tracer
    before its tracee), and prove them all gone."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)
    assert not any(alive(p.pid) for p in procs)


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0) -> bool:
    """Poll `predicate` every 10 ms until it is true or `timeout_s` passes; return its last
    truth value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def tagged(tag: str, live_only: bool = False) -> list[int]:
    """The PIDs of the processes whose environment carries CHAOSGPU_TAG=`tag` (read straight
    from /proc); with `live_only`, zombies and dead ones left out."""
    needle = f"CHAOSGPU_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)] if live_only else found
