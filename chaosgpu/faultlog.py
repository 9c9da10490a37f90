"""The faults this runner injected, in order, for the observers that measure their effect.

A Chaos Toolkit run executes every activity in one process: the fault actions (kill, freeze,
partition, GPU faults) record here what they did to which process, and the job observer reads it
to say "rank 1 was killed by chaosgpu 0.2 s before the survivors failed" and to time a detection
from the fault. The timeline sampler, when one runs, gets the same mark. This module owns that
log and the order of freezes and resumes (`resumed`); it signals nothing. It keeps no state on
disk but hands each freeze and resume to chaosgpu.freezelog, which does, for a cleanup after
the runner crashed.
"""

import itertools
import threading
import time
from typing import Any

__all__ = ["record", "recent", "for_pid", "resumed", "resumed_at", "clear"]

_LOCK = threading.Lock()
_FAULTS: list[dict[str, Any]] = []
# Each entry's place in the log ("seq", from 1): what was recorded after a resume is told by
# this order, never by the wall clock ("t"), which may step back between the two.
_SEQ = itertools.count(1)
_LAST_SEQ = 0
# (PID, start time) -> the log's position when this run last resumed it (resumed): a freeze
# recorded before then is over, so a second resume leaves alone what someone else stopped
# since.
_RESUMED_AT: dict[tuple[int, int], int] = {}
# The rollbacks read this log to undo what this run froze: an entry dropped is a process left
# frozen. Kept far above what one run does (a freeze of every process of a large node, each
# one entry of ~200 bytes); only a runaway run reaches it.
_LIMIT = 200_000


def record(kind: str, /, **fields: Any) -> dict[str, Any]:
    """Record a fault injected now (`kind`: "SIGKILL", "SIGSTOP", "freezer", "partition" ...;
    fields such as job, rank, pid, starttime; never "t", "seq" or "kind", which the entry
    owns) and mark it on the running timeline."""
    global _LAST_SEQ
    reserved = sorted({"t", "seq", "kind"} & set(fields))
    if reserved:
        raise ValueError(f"fault fields {reserved} are the entry's own: name them otherwise")
    with _LOCK:
        _LAST_SEQ = next(_SEQ)
        entry = {"t": time.time(), "seq": _LAST_SEQ, "kind": kind, **fields}
        _FAULTS.append(entry)
        del _FAULTS[:-_LIMIT]
    from chaosgpu.process.actions import FREEZE_KINDS

    if kind in FREEZE_KINDS and isinstance(fields.get("pid"), int) \
            and isinstance(fields.get("starttime"), int):
        from chaosgpu import freezelog

        freezelog.frozen([(fields["pid"], fields["starttime"])], kind)  # for a cleanup after
        # a crash (noted once: the action noted it before its freeze already)
    from chaosgpu.timeline.sampler import current

    sampler = current()
    if sampler is not None:
        sampler.mark(f"fault:{kind}", "point", **fields)
    return entry


def recent(since: float | None = None) -> list[dict[str, Any]]:
    """The faults recorded at or after `since` (unix time; all when None), oldest first."""
    with _LOCK:
        return [dict(f) for f in _FAULTS if since is None or f["t"] >= since]


def for_pid(pid: int, starttime: int | None = None) -> list[dict[str, Any]]:
    """The faults recorded against one process (and start time, when given)."""
    with _LOCK:
        return [dict(f) for f in _FAULTS if f.get("pid") == pid
                and (starttime is None or f.get("starttime") in (None, starttime))]


def resumed(keys: list[tuple[int, int]]) -> None:
    """This run resumed these processes ((PID, start time) each) now: the freezes recorded so
    far are over for them (resumed_at), on disk too (chaosgpu.freezelog)."""
    from chaosgpu import freezelog

    with _LOCK:
        for key in keys:
            _RESUMED_AT[key] = _LAST_SEQ
    freezelog.resumed(keys)


def resumed_at(key: tuple[int, int]) -> int:
    """The log's position when this run last resumed the process `key` (PID, start time): its
    freezes with a greater "seq" came after; 0 when never resumed."""
    with _LOCK:
        return _RESUMED_AT.get(key, 0)


def clear() -> None:
    """Forget every recorded fault and resume (tests)."""
    with _LOCK:
        _FAULTS.clear()
        _RESUMED_AT.clear()
