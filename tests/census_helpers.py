"""Helpers shared by the census tests: real PID namespaces ("pods") with `sleep` as PID 1."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAM = REPO / "probes" / "node_census.py"

#: A program whose main thread ends while another thread runs on: its /proc stat then says Z
#: with a thread count above 1 (what a CUDA process shows during its driver teardown).
LEADER_EXITS = """
import ctypes, threading, time
def work():
    while True:
        time.sleep(0.05)
threading.Thread(target=work).start()
time.sleep(0.2)
ctypes.CDLL(None).pthread_exit(None)  # the main thread ends; the other one runs on
"""


def children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc/PID/task/PID/children)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll `predicate` until it returns a truthy value or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def pod(init: tuple[str, ...] = ("sleep", "infinity")) -> Iterator[int]:
    """A PID namespace (+ its own /proc) whose PID 1 is `init`; yields PID 1's host PID and
    kills the whole namespace at the end (SIGKILL of PID 1)."""
    runner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", *init],
                              env=dict(os.environ), start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    pid1 = 0
    try:
        def ready() -> int:
            kids = children(runner.pid)
            return kids[0] if kids and comm(kids[0]) == os.path.basename(init[0]) else 0

        pid1 = wait_for(ready, what="the pod's PID 1")
        yield pid1
    finally:
        if pid1:
            with contextlib.suppress(OSError):
                os.kill(pid1, signal.SIGKILL)
        try:
            runner.wait(timeout=10)
        except subprocess.TimeoutExpired:
            runner.kill()
            runner.wait(timeout=10)


def exec_in_pod(pid1: int, *command: str, timeout: float = 60.0,
                user: tuple[int, int] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `command` inside the pod like `kubectl exec` (nsenter into its PID + mount ns)."""
    prefix = ["nsenter", "-t", str(pid1), "-p", "-m"]
    if user is not None:
        prefix += ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
    return subprocess.run(prefix + list(command), env=dict(os.environ), capture_output=True,
                          text=True, timeout=timeout, check=False)


def run_program(*args: str, user: tuple[int, int] | None = None, timeout: float = 60.0,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the in-target census program as a separate process (optionally as another user)."""
    prefix: list[str] = []
    if user is not None:
        prefix = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--clear-groups"]
    return subprocess.run(prefix + [sys.executable, str(PROGRAM), *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout, check=False,
                          input=stdin)
