"""PyTorch Flight Recorder, read from outside a rank: per-collective sequence numbers.

Where a job enables it (TORCH_FR_BUFFER_SIZE, or the older TORCH_NCCL_TRACE_BUFFER_SIZE, > 0)
and names a dump pipe (TORCH_NCCL_DEBUG_INFO_PIPE_FILE), ProcessGroupNCCL's monitor thread
dumps the recorder when anything is written to `<pipe prefix><rank>.pipe`; the dump lands in
`<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>` (default /tmp/nccl_trace_rank_<rank>). This module
owns asking for a dump (at most once per `REQUEST_EVERY_S` per rank), reading it through
/proc/PID/root (the rank's mount namespace) with an unpickler that refuses every class (a dump is
data; nothing in it is ever executed), and summarising it: the last completed collective's
sequence number (it grows while the job progresses) and the first collective not completed (where
the rank waits). Jobs without these variables (gloo, or NCCL without the pipe) have no summary.
It signals nothing and writes only to the pipe the job itself created for this purpose.
"""

import contextlib
import io
import os
import pickle
import stat
import time
from typing import Any

__all__ = ["enabled", "request_dump", "read_dump", "summarise", "summary_for",
           "REQUEST_EVERY_S"]

REQUEST_EVERY_S = 1.0
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"
_MAX_DUMP_BYTES = 64 << 20
_requested: dict[tuple[int, int], float] = {}
_seen: dict[tuple[int, int], float] = {}


class _DataOnly(pickle.Unpickler):
    """An unpickler for plain data: dicts, lists, tuples, strings, numbers. Any class or
    function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a dump holds data only")


def enabled(env: dict[str, str] | None) -> bool:
    """Whether a rank's environment asks for Flight Recorder with a dump pipe."""
    env = env or {}
    size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"))
    try:
        buffer = int(size)
    except ValueError:
        buffer = 0
    return buffer > 0 and bool(env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE"))


def request_dump(pid: int, env: dict[str, str], rank: int) -> bool:
    """Write to the rank's dump pipe (non-blocking; False when there is no reader or no
    pipe). The pipe must be a FIFO: a regular file of that name is never written."""
    path = f"/proc/{pid}/root{env['TORCH_NCCL_DEBUG_INFO_PIPE_FILE']}{rank}.pipe"
    try:
        if not stat.S_ISFIFO(os.stat(path).st_mode):
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, b"1\n")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_dump(pid: int, env: dict[str, str], rank: int,
              seen_mtime: float | None = None) -> tuple[dict[str, Any], float] | None:
    """The rank's latest dump and its modification time, or None (none yet, unreadable, not
    a plain-data pickle, or the one modified at `seen_mtime`: not read again)."""
    prefix = env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or DEFAULT_DUMP_PREFIX
    path = f"/proc/{pid}/root{prefix}{rank}"
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_DUMP_BYTES or \
                info.st_mtime == seen_mtime:
            return None
        with open(path, "rb") as handle:
            data = handle.read(_MAX_DUMP_BYTES)
        dump = _DataOnly(io.BytesIO(data)).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            AttributeError, IndexError):
        return None
    if not isinstance(dump, dict):
        return None
    return dump, info.st_mtime


def summarise(dump: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """{"entries", "last_completed_seq", "last_started_seq", "pending": {seq, name, state,
    age_s} or None} from a dump's entries (`collective_seq_id`, `state`, `profiling_name`,
    `time_created_ns`)."""
    now = time.time() if now is None else now
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    completed = [e.get("collective_seq_id") for e in entries if e.get("state") == "completed"]
    started = [e.get("collective_seq_id") for e in entries
               if e.get("state") in ("started", "completed")]
    pending = None
    for entry in sorted(entries, key=lambda e: e.get("collective_seq_id") or 0):
        if entry.get("state") != "completed":
            created = entry.get("time_created_ns")
            pending = {"seq": entry.get("collective_seq_id"),
                       "name": entry.get("profiling_name"), "state": entry.get("state"),
                       "age_s": round(now - created / 1e9, 3)
                       if isinstance(created, (int, float)) else None}
            break
    numbers = [n for n in completed if isinstance(n, int)]
    started_numbers = [n for n in started if isinstance(n, int)]
    return {"entries": len(entries),
            "last_completed_seq": max(numbers) if numbers else None,
            "last_started_seq": max(started_numbers) if started_numbers else None,
            "pending": pending, "version": dump.get("version")}


def summary_for(pid: int, env: dict[str, str] | None, rank: int | None) -> dict[str, Any] | None:
    """A fresh summary of a rank's recorder when the job enables it: asks for a dump (at most
    every REQUEST_EVERY_S) and summarises the newest one not seen before; None otherwise."""
    if rank is None or not enabled(env):
        return None
    assert env is not None
    key = (pid, rank)
    now = time.time()
    if now - _requested.get(key, 0.0) >= REQUEST_EVERY_S:
        _requested[key] = now
        request_dump(pid, env, rank)
    found = read_dump(pid, env, rank, _seen.get(key))
    if found is None:
        return None
    dump, mtime = found
    _seen[key] = mtime
    summary = summarise(dump, now)
    summary["dumped_at"] = mtime
    summary["requested_at"] = _requested.get(key)  # the last dump asked for (its latency)
    return summary


def forget(pid: int) -> None:
    """Drop what is remembered about a process's dumps."""
    for store in (_requested, _seen):
        for key in [k for k in store if k[0] == pid]:
            with contextlib.suppress(KeyError):
                del store[key]
