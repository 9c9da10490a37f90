"""How a rank ended, seen from outside: its exit status, even when it was not our child.

This module owns holding a pidfd on each watched rank and reading, once it is gone, how it
ended: Linux 6.15+ returns the exit status of a process through its pidfd after it was reaped by
its own parent (`PIDFD_GET_INFO` with `PIDFD_INFO_EXIT`), so the observer learns that rank 1 was
killed by SIGKILL and rank 0 exited 1 although torchrun reaped both. On older kernels the status
is read from a zombie's /proc stat while it waits for its parent (when a sample catches it), else
it is reported as not visible. The pidfd is opened only after the PID's start time was checked,
and checked again after opening (a reused PID is never watched). It reads the error a rank left
where one is readable: torchrun's per-rank error file (TORCHELASTIC_ERROR_FILE, written by
`@record`) or the tail of a stderr redirected to a regular file. It never signals.
"""

import contextlib
import fcntl
import json
import os
import select
import signal
import struct
import time
from dataclasses import dataclass
from typing import Any

from chaosgpu.node import process_starttime

__all__ = ["Exit", "ExitWatch", "describe_status", "keep_watch", "read_error"]

_PIDFD_INFO_EXIT = 1 << 3
_PIDFD_INFO_SIZE = 64
#: _IOWR(PIDFS_IOCTL_MAGIC = 0xFF, 11, struct pidfd_info (64 bytes))
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11
_EXIT_CODE_OFFSET = 60


@dataclass
class Exit:
    """How a process ended: `code` (exit code) or `signal` (signal name), or neither when the
    status could not be seen (`source` None, `note` says why)."""

    code: int | None
    signal: str | None
    source: str | None
    note: str | None = None

    @property
    def clean(self) -> bool | None:
        """True for exit code 0, False for a non-zero code or a signal, None when unknown."""
        if self.code is None and self.signal is None:
            return None
        return self.code == 0

    def describe(self) -> str:
        """"exit 0", "exit 1", "killed by SIGKILL" or "exit status not visible"."""
        if self.signal is not None:
            return f"killed by {self.signal}"
        if self.code is not None:
            return f"exit {self.code}"
        return "exit status not visible" + (f" ({self.note})" if self.note else "")

    def to_json(self) -> dict[str, Any]:
        """The exit as a JSON-ready dict."""
        return {"code": self.code, "signal": self.signal, "source": self.source,
                "note": self.note, "text": self.describe()}


def describe_status(status: int, source: str) -> Exit:
    """An Exit from a wait status (as waitpid and the kernel's exit_code give it)."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return Exit(None, name, source)
    return Exit(os.WEXITSTATUS(status), None, source)


#: Pidfds shared by every ExitWatch of this process (a fault action opens one on its target
#: before signalling it, so an observer started afterwards can still learn how it ended).
_POOL: dict[tuple[int, int], int] = {}
_POOL_LIMIT = 512


class ExitWatch:
    """Pidfds on the watched processes, keyed by (pid, starttime), in the process-wide pool.
    While the watcher waits (``wait``), the pidfds tell when each process ended: a pidfd turns
    readable at its process's exit, so two ranks that ended 0.1 s apart (a rank killed, then
    the others stopped by torchrun's teardown) are told apart even when one census reading
    finds both gone."""

    def __init__(self) -> None:
        self._fds = _POOL
        self._mine: set[tuple[int, int]] = set()
        self._watched: set[tuple[int, int]] = set()
        self._ended_at: dict[tuple[int, int], float] = {}
        self._zombie_status: dict[tuple[int, int], int] = {}
        self.supported: bool | None = None

    def watch(self, pid: int, starttime: int) -> bool:
        """Hold a pidfd on `pid` if it is still the process that started at `starttime`;
        False when it is gone or is another process now."""
        key = (pid, starttime)
        if key in self._fds:
            self._watched.add(key)
            return True
        if process_starttime(pid) != starttime:
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        if process_starttime(pid) != starttime:  # reused between the check and the open
            os.close(fd)
            return False
        self._fds[key] = fd
        self._mine.add(key)
        self._watched.add(key)
        while len(self._fds) > _POOL_LIMIT:  # the oldest first
            with contextlib.suppress(OSError):
                os.close(self._fds.pop(next(iter(self._fds))))
        return True

    def wait(self, seconds: float) -> None:
        """Sleep `seconds` (the watcher's pause between two readings) while noting the moment
        (time.time()) each watched process ends: its pidfd turns readable then. A process that
        had ended before the wait began is noted at its start (an upper bound, as a reading
        gives it)."""
        deadline = time.monotonic() + max(0.0, seconds)
        dropped: set[tuple[int, int]] = set()  # a pidfd the pool closed meanwhile
        while True:
            fds = {self._fds[key]: key for key in self._watched
                   if key not in self._ended_at and key not in dropped and key in self._fds}
            left = deadline - time.monotonic()
            if not fds:
                if left > 0:
                    time.sleep(left)
                return
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            ready = poller.poll(max(0, int(left * 1000) + (left > 0)))
            seen = time.time()
            for fd, events in ready:
                if events & select.POLLIN:  # the process ended
                    self._ended_at[fds[fd]] = seen
                else:  # POLLNVAL, POLLERR: no live pidfd there any more
                    dropped.add(fds[fd])
            if not ready and time.monotonic() >= deadline:
                return

    def ended_at(self, pid: int, starttime: int) -> float | None:
        """When a wait saw the process end (time.time()), or None when no wait saw it."""
        return self._ended_at.get((pid, starttime))

    def note_zombie(self, pid: int, starttime: int, exit_code: int | None) -> None:
        """Remember the wait status a sample read from a zombie's stat (older kernels)."""
        if exit_code is not None:
            self._zombie_status[(pid, starttime)] = exit_code

    def exit_of(self, pid: int, starttime: int) -> Exit:
        """How the watched process ended (call once it is gone or a zombie)."""
        key = (pid, starttime)
        fd = self._fds.get(key)
        if fd is not None:
            buffer = bytearray(_PIDFD_INFO_SIZE)
            struct.pack_into("=Q", buffer, 0, _PIDFD_INFO_EXIT)
            try:
                fcntl.ioctl(fd, _PIDFD_GET_INFO, buffer, True)
                (mask,) = struct.unpack_from("=Q", buffer, 0)
                if mask & _PIDFD_INFO_EXIT:
                    self.supported = True
                    (status,) = struct.unpack_from("=i", buffer, _EXIT_CODE_OFFSET)
                    return describe_status(status, "pidfd")
            except OSError as error:
                if error.errno in (25, 22):  # ENOTTY / EINVAL: the kernel has no PIDFD_GET_INFO
                    self.supported = False
        if key in self._zombie_status:
            return describe_status(self._zombie_status[key], "zombie stat")
        note = ("this kernel does not report the exit status through a pidfd (Linux < 6.15) "
                "and no sample caught the zombie") if self.supported is False else \
            "not watched before it ended"
        return Exit(None, None, None, note)

    def exit_or_fault(self, pid: int, starttime: int, faults: list[dict[str, Any]]) -> Exit:
        """exit_of, or, when its status is not visible and chaosgpu sent this process (its PID
        and start time: never an earlier process that had the PID) an uncatchable SIGKILL,
        "killed by SIGKILL" from that fault's record."""
        found = self.exit_of(pid, starttime)
        if found.source is None and any(
                f.get("kind") == "SIGKILL" and f.get("pid") == pid
                and f.get("starttime") == starttime for f in faults):
            return Exit(None, "SIGKILL", "chaosgpu's fault record",
                        "its status was not visible; chaosgpu sent it SIGKILL")
        return found

    def forget(self, pid: int, starttime: int) -> None:
        """Stop watching a process; close its pidfd if this watch opened it. One a fault
        action opened (keep_watch) stays pooled: the probes that follow in the same run read
        how that rank ended from it too (closing it here made the next probe report the exit
        the first one had seen as "not visible")."""
        key = (pid, starttime)
        fd = self._fds.pop(key, None) if key in self._mine else None
        self._mine.discard(key)
        self._watched.discard(key)
        self._ended_at.pop(key, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close the pidfds this watch opened (those a fault action opened stay pooled)."""
        for key in self._mine:
            fd = self._fds.pop(key, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._mine.clear()
        self._watched.clear()


def keep_watch(pid: int, starttime: int) -> bool:
    """Open a pooled pidfd on a process about to be faulted, so that how it ended stays
    readable by an observer started later; False when it is already gone or reused."""
    return ExitWatch().watch(pid, starttime)


def _error_message(data: Any) -> str | None:
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return None if message is None else str(message)


def read_error(pid: int, env: dict[str, str] | None, stderr_path: str | None,
               roots: tuple[str, ...] = ("",), limit: int = 600) -> dict[str, Any] | None:
    """The error a rank left, where readable: torchrun's error file (TORCHELASTIC_ERROR_FILE,
    JSON written by `@record`), else the last lines of its stderr when it went to a regular
    file (`stderr_path`, as read while it lived). Paths are tried under each of `roots` (e.g.
    /proc/<launcher>/root for a container whose rank is gone, then "" for the host). None when
    nothing is readable."""
    error_file = (env or {}).get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        for root in (f"/proc/{pid}/root", *roots):
            try:
                with open(root + error_file, encoding="utf-8") as handle:
                    message = _error_message(json.load(handle))
            except (OSError, ValueError):
                continue
            if message:
                return {"source": "torchelastic error file", "path": error_file,
                        "text": message[-limit:]}
    if stderr_path:
        for root in (f"/proc/{pid}/root", *roots):
            try:
                with open(root + stderr_path, "rb") as handle:
                    handle.seek(0, os.SEEK_END)
                    size = handle.tell()
                    handle.seek(max(0, size - 4096))
                    tail = handle.read().decode("utf-8", "replace")
            except OSError:
                continue
            lines = [line for line in tail.splitlines() if line.strip()]
            if lines:
                return {"source": "stderr file", "path": stderr_path,
                        "text": "\n".join(lines[-6:])[-limit:]}
            break
    return None
