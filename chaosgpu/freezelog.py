"""The freezes this runner has not undone yet, kept on disk for `chaosgpu cleanup`.

chaosgpu.faultlog, in memory, is what the rollbacks read to resume what this run froze. A
runner that crashes or is killed before its rollback takes that log with it, and the
processes it stopped (a stop signal) or froze (chaosgpu's freezer group) would stay so with
nothing left to say it did. This module owns the trace that survives the runner: one file per
runner under the state directory (`freezes/<pid>-<starttime>.jsonl`), a line appended per
freeze (`{"frozen": [pid, starttime], "kind": "SIGSTOP" | "freezer" ...}`) and per resume
(`{"resumed": [pid, starttime]}`), removed once every freeze it holds is resumed. Appending
costs one write per process, whatever the size of the run; a line cut short by a crash is
skipped when read. `chaosgpu cleanup` reads the files of runners that are gone
(`outstanding`) and resumes what they left; it signals nothing here.
"""

import contextlib
import json
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

from chaosgpu import state

__all__ = ["DIRECTORY", "frozen", "resumed", "runs", "outstanding", "remove"]

logger = logging.getLogger("chaostoolkit")
#: The state directory's folder of freeze files.
DIRECTORY = "freezes"

_LOCK = threading.Lock()
# (pid, starttime) -> the kinds noted for it (a stop signal's name, "freezer")
_OUTSTANDING: dict[tuple[int, int], set[str]] = {}


def _own_file() -> Path:
    from chaosgpu.node import process_starttime

    folder = state.state_dir() / DIRECTORY
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{os.getpid()}-{process_starttime(os.getpid())}.jsonl"


def _append(lines: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    fd = os.open(_own_file(), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def frozen(keys: list[tuple[int, int]], kind: str) -> None:
    """Note on disk that this runner freezes these processes ((pid, starttime) each; `kind`: a
    stop signal's name, or "freezer"). The fault actions call it before they stop or freeze
    (a runner killed while it waits for the freeze to hold leaves its trace), and the fault
    log again once the freeze is recorded (noted once); `resumed` drops those the action did
    not freeze after all. A state directory that cannot be written is logged, never raised:
    this run's own rollback still resumes from the fault log."""
    with _LOCK:
        new = [key for key in keys if kind not in _OUTSTANDING.get(key, ())]
        if not new:
            return
        try:
            _append([{"frozen": list(key), "kind": kind} for key in new])
        except (OSError, state.StateDirError) as error:
            logger.warning("chaosgpu: the freeze of PID(s) %s is not kept on disk (%s): a "
                           "`chaosgpu cleanup` after a crash of this run cannot resume it",
                           [key[0] for key in new][:10], error)
            return
        for key in new:
            _OUTSTANDING.setdefault(key, set()).add(kind)


def resumed(keys: list[tuple[int, int]]) -> None:
    """Note on disk that this runner resumed these processes ((pid, starttime) each); the file
    goes once nothing it holds is outstanding (resumed, or ended: a process gone is frozen no
    more)."""
    from chaosgpu.node import process_starttime

    with _LOCK:
        mine = [key for key in keys if key in _OUTSTANDING]
        if not mine:
            return
        try:
            for key in [*mine, *(key for key in _OUTSTANDING
                                 if process_starttime(key[0]) != key[1])]:
                _OUTSTANDING.pop(key, None)
            if _OUTSTANDING:
                _append([{"resumed": list(key)} for key in mine])
            else:
                with contextlib.suppress(FileNotFoundError):
                    _own_file().unlink()
        except (OSError, state.StateDirError) as error:
            logger.warning("chaosgpu: the resume of %s is not kept on disk (%s)", mine, error)


def runs() -> dict[str, dict[str, Any]]:
    """Every runner's freeze file in the state directory: name -> {"runner": {pid,
    starttime}, "path"}; a file whose name is no runner's is left out. The folder must be as
    private as the state directory (a real directory of this user, closed to others:
    StateDirError otherwise): its files decide which processes a cleanup resumes."""
    folder = state.state_dir() / DIRECTORY
    found: dict[str, dict[str, Any]] = {}
    if not os.path.lexists(folder):
        return found
    state.check_private_dir(folder)
    with contextlib.suppress(FileNotFoundError):
        for path in sorted(folder.iterdir()):
            pid, _, start = path.name.removesuffix(".jsonl").partition("-")
            if path.suffix == ".jsonl" and pid.isdigit() and start.isdigit():
                found[path.stem] = {"runner": {"pid": int(pid), "starttime": int(start)},
                                    "path": str(path)}
    return found


def outstanding(name: str) -> list[dict[str, Any]]:
    """The freezes of runner file `name` never resumed, oldest first: [{"pid", "starttime",
    "kinds"}]; lines that do not parse (a write cut short) are skipped. A file that is not a
    regular file of this user closed to others' writes (a symlink included) is not trusted:
    StateDirError."""
    path = state.state_dir() / DIRECTORY / f"{name}.jsonl"
    kinds: dict[tuple[int, int], set[str]] = {}
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() \
                or info.st_mode & 0o022:
            raise state.StateDirError(
                f"freeze file {path}: not a regular file of this user closed to others' writes "
                f"(mode {stat.S_IMODE(info.st_mode):04o}, owner {info.st_uid}): not trusted")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read()
    finally:
        os.close(fd)
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            entry = json.loads(line)
            if "frozen" in entry:
                key = (int(entry["frozen"][0]), int(entry["frozen"][1]))
                kinds.setdefault(key, set()).add(str(entry["kind"]))
            elif "resumed" in entry:
                kinds.pop((int(entry["resumed"][0]), int(entry["resumed"][1])), None)
        except (ValueError, TypeError, KeyError, IndexError):
            continue
    return [{"pid": pid, "starttime": start, "kinds": sorted(how)}
            for (pid, start), how in kinds.items()]


def remove(name: str) -> bool:
    """Remove runner file `name`; return whether there was one."""
    try:
        (state.state_dir() / DIRECTORY / f"{name}.jsonl").unlink()
        return True
    except FileNotFoundError:
        return False
