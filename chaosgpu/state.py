"""Where chaosgpu keeps live state on disk (sandboxes, workloads started by experiments), so that
a later process (a rollback, `chaosgpu cleanup` after a crashed runner) can find what an earlier
one started. This module owns the location and atomic JSON records; it knows nothing of what
the records mean.
"""

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["StateDirError", "check_private_dir", "state_dir", "write_record", "read_record",
           "list_records", "remove_record"]


class StateDirError(RuntimeError):
    """The state directory is unsafe to use (the message names it and says what is wrong)."""


def state_dir() -> Path:
    """Return (and create, mode 0700) the directory that holds chaosgpu's live state.

    Its records decide what a later cleanup SIGKILLs, removes and unlinks, so a directory that
    someone else could have prepared is refused (StateDirError), as ssh-agent and tmux refuse
    their socket folders: it must be a real directory (not a symlink, checked with lstat) owned
    by this process's effective UID and closed to group and others (no bits of 0o077).
    """
    explicit = os.environ.get("CHAOSGPU_STATE_DIR")
    if explicit:
        path = Path(explicit)
    elif os.geteuid() == 0:
        path = Path("/run/chaosgpu")
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "chaosgpu"
    else:
        path = Path(tempfile.gettempdir()) / f"chaosgpu-{os.geteuid()}"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Raise StateDirError unless `path` is a directory (not a symlink) owned by this effective
    UID with no permission for group or others."""
    try:
        info = os.lstat(path)
    except OSError as error:
        raise StateDirError(f"state directory {path}: cannot be read ({error})") from None
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link (a real directory is needed)"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by UID {info.st_uid}, not by this user (UID {os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = (f"has mode {stat.S_IMODE(info.st_mode):04o}: group or others have access "
                   "(it must be 0700)")
    if problem is not None:
        raise StateDirError(f"refusing the state directory {path}: it {problem}; remove it or "
                            "set CHAOSGPU_STATE_DIR to a private directory")


def _record_path(kind: str, name: str) -> Path:
    if not kind.isidentifier():
        raise ValueError(f"invalid record kind {kind!r}")
    if not name or "/" in name or name.startswith(".") or len(name) > 200:
        raise ValueError(f"invalid record name {name!r}")
    folder = state_dir() / kind
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{name}.json"


def write_record(kind: str, name: str, record: dict[str, Any]) -> Path:
    """Atomically write the JSON record `name` of `kind` and return its path."""
    path = _record_path(kind, name)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_record(kind: str, name: str) -> dict[str, Any] | None:
    """Return the record `name` of `kind`, or None when there is none (or it is unreadable)."""
    path = _record_path(kind, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def list_records(kind: str) -> dict[str, dict[str, Any]]:
    """Return every readable record of `kind`, by name."""
    folder = state_dir() / kind
    records: dict[str, dict[str, Any]] = {}
    if not folder.is_dir():
        return records
    for path in sorted(folder.glob("*.json")):
        record = read_record(kind, path.stem)
        if record is not None:
            records[path.stem] = record
    return records


def remove_record(kind: str, name: str) -> bool:
    """Remove the record `name` of `kind`; return whether there was one."""
    try:
        _record_path(kind, name).unlink()
        return True
    except FileNotFoundError:
        return False
