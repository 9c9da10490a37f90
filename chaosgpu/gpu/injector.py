"""The chaosgpu side of the in-process injectors: the environment that arms a job, and the trigger
channel that fires a fault in one armed process.

Two injectors listen on the same channel, a folder (CHAOSGPU_INJECT_DIR, by default
`<state>/inject`): the Python one (site/sitecustomize.py + site/chaosgpu_injector.py, on
PYTHONPATH) and the CUDA one (cuda_inject/, through CUDA_INJECTION64_PATH). An armed process
announces itself with `<key>.armed` / `<key>.cuda-armed`, where key = "<pid namespace
inode>-<pid in that namespace>-<start time>", which chaosgpu computes from the census record of
the process it means; a trigger file carries that key, so it can reach no other process, and a
reused PID has another key. The injector answers every trigger with an ack file; a fault nobody
acknowledged is reported as not delivered, never as done.

This module owns the environment, the keys, and writing triggers / reading acks and the markers
the injectors leave (OOM observed, CUDA faults hit). It must not signal processes; choosing
which process a fault targets (scope) is chaosgpu.gpu.actions'.
"""

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from chaosgpu import state
from chaosgpu.errors import ActivityError

__all__ = ["SITE_DIR", "MODES", "EXCEPTIONS", "CUDA_FAULTS", "inject_dir", "environment",
           "process_key", "listening_dir", "armed", "cuda_armed", "trigger", "trigger_cuda",
           "release", "oom_events", "cuda_events", "tagged_events", "sweep", "InjectionError"]

SITE_DIR = Path(__file__).resolve().parent / "site"
MODES = ("gpu-hang", "hold-gil", "raise", "segfault", "oom")
EXCEPTIONS = ("RuntimeError", "OutOfMemoryError", "KeyboardInterrupt")
CUDA_FAULTS = ("alloc", "launch")
POLL_S = 0.02


class InjectionError(ActivityError):
    """A fault could not be delivered (target not armed, no ack in time, refused by the target)."""


def inject_dir() -> Path:
    """The default trigger folder, `<state>/inject` (created, mode 0700)."""
    path = state.state_dir() / "inject"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def environment(base: dict[str, str] | None = None, folder: str | None = None,
                cuda: bool = False) -> dict[str, str]:
    """The variables that arm a job started with them: PYTHONPATH gets the injector's site folder
    first (the job's own PYTHONPATH after it), CHAOSGPU_INJECT_DIR names the trigger folder; with
    `cuda`, CUDA_INJECTION64_PATH (the CUDA injector, built here) too. `base` is the environment
    whose PYTHONPATH is extended (default: this process's)."""
    base = dict(os.environ if base is None else base)
    target = folder or str(inject_dir())
    sweep(Path(target))
    rest = base.get("PYTHONPATH")
    env = {"PYTHONPATH": str(SITE_DIR) + (os.pathsep + rest if rest else ""),
           "CHAOSGPU_INJECT_DIR": target}
    if cuda:
        from chaosgpu.gpu import cudainject

        env.update(cudainject.environment(target))
    return env


def process_key(process: dict[str, Any]) -> str:
    """The key of a census process record: pid namespace inode, innermost PID, start time."""
    pid_ns = str(process.get("pid_ns") or "")
    inode = "".join(ch for ch in pid_ns if ch.isdigit())
    nspid = process.get("nspid") or [process.get("pid")]
    starttime = process.get("starttime")
    if not inode or starttime is None or nspid[-1] is None:
        raise InjectionError(f"process {process.get('pid')} cannot be named safely (pid "
                             f"namespace {pid_ns or 'unreadable'}, start time {starttime})")
    return f"{inode}-{int(nspid[-1])}-{int(starttime)}"


def listening_dir(process: dict[str, Any]) -> Path:
    """The trigger folder a process listens on (its CHAOSGPU_INJECT_DIR); raises when it has none
    (it was not started armed)."""
    env = process.get("env") or {}
    folder = env.get("CHAOSGPU_INJECT_DIR")
    if not folder:
        raise InjectionError(f"process {process.get('pid')} was not started with the injector "
                             "(no CHAOSGPU_INJECT_DIR in its environment): start the job with "
                             "chaosgpu.gpu.injector.environment()")
    return Path(folder)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def armed(process: dict[str, Any]) -> dict[str, Any] | None:
    """The Python injector's armed file of `process`, or None when it is not armed."""
    return _read(listening_dir(process) / f"{process_key(process)}.armed")


def cuda_armed(process: dict[str, Any]) -> dict[str, Any] | None:
    """The CUDA injector's armed file of `process` (written at cuInit), or None."""
    return _read(listening_dir(process) / f"{process_key(process)}.cuda-armed")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _wait_ack(path: Path, timeout_s: float, what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ack = _read(path)
        if ack is not None:
            return ack
        time.sleep(POLL_S)
    raise InjectionError(f"{what}: no acknowledgement within {timeout_s:g} s (the target's "
                         "injector did not answer: not delivered)")


def trigger(process: dict[str, Any], mode: str, duration_s: float | None = None,
            device: int | None = None, exception: str | None = None,
            timeout_s: float = 5.0) -> dict[str, Any]:
    """Fire Python-injector fault `mode` in `process` (a census record) and wait for its ack;
    return the ack. Raises InjectionError when the process is not armed, does not answer within
    `timeout_s`, or refuses (the ack's error says why)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    folder = listening_dir(process)
    key = process_key(process)
    if armed(process) is None:
        raise InjectionError(f"process {process.get('pid')} is not armed (no {key}.armed in "
                             f"{folder}): its Python did not load the injector")
    ident = uuid.uuid4().hex[:12]
    request = {"id": ident, "mode": mode, "duration_s": duration_s, "device": device,
               "exception": exception, "t": time.time()}
    sent_at = time.time()
    _write_atomic(folder / f"{key}.trigger", json.dumps(request))
    ack = _wait_ack(folder / f"{key}.ack-{ident}.json", timeout_s,
                    f"fault {mode!r} to process {process.get('pid')}")
    ack["sent_at"] = sent_at
    ack["ack_after_s"] = round(float(ack.get("t_received", sent_at)) - sent_at, 4)
    if not ack.get("accepted"):
        raise InjectionError(f"process {process.get('pid')} refused fault {mode!r}: "
                             f"{ack.get('error')}")
    return ack


def trigger_cuda(process: dict[str, Any], fault: str, count: int = 1,
                 timeout_s: float = 5.0) -> dict[str, Any]:
    """Make the next `count` allocations (fault="alloc") or kernel launches ("launch") of
    `process` fail through the CUDA injector; wait for its ack and return it."""
    if fault not in CUDA_FAULTS:
        raise ValueError(f"unknown CUDA fault {fault!r}: choose one of {', '.join(CUDA_FAULTS)}")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1_000_000:
        raise ValueError(f"count must be an integer from 1 to 1000000, got {count!r}")
    folder = listening_dir(process)
    key = process_key(process)
    state_ = cuda_armed(process)
    if state_ is None or state_.get("state") != "armed":
        why = state_.get("error") if state_ else "no CUDA context yet, or not loaded"
        raise InjectionError(f"process {process.get('pid')}: the CUDA injector is not armed "
                             f"({why})")
    ident = uuid.uuid4().hex[:12]
    sent_at = time.time()
    _write_atomic(folder / f"{key}.cuda-trigger", f"{fault} {count} {ident}\n")
    ack = _wait_ack(folder / f"{key}.cuda-ack-{ident}.json", timeout_s,
                    f"CUDA fault {fault!r} to process {process.get('pid')}")
    ack["sent_at"] = sent_at
    if not ack.get("accepted"):
        raise InjectionError(f"process {process.get('pid')} refused CUDA fault: {ack.get('error')}")
    return ack


def release(process: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """End a gpu-hang or an oom fault in `process` early; return the injector's answer."""
    folder = listening_dir(process)
    key = process_key(process)
    done = folder / f"{key}.released.json"
    before = _read(done)
    _write_atomic(folder / f"{key}.release", "release\n")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _read(done)
        if now is not None and now != before:
            return now
        time.sleep(POLL_S)
    raise InjectionError(f"process {process.get('pid')} did not answer the release within "
                         f"{timeout_s:g} s")


def _jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def oom_events(process: dict[str, Any]) -> list[dict[str, Any]]:
    """CUDA out-of-memory events torch reported in `process` (the injector's OOM observer)."""
    return _jsonl(listening_dir(process) / f"{process_key(process)}.oom.jsonl")


def cuda_events(process: dict[str, Any]) -> list[dict[str, Any]]:
    """CUDA injector faults that hit in `process` (one line per failed call)."""
    return _jsonl(listening_dir(process) / f"{process_key(process)}.cuda-events.jsonl")


def tagged_events(tag: str, folder: Path | None = None) -> dict[str, list[dict[str, Any]]]:
    """Every OOM observed and CUDA fault hit by processes carrying `tag` in trigger folder
    `folder` (default `<state>/inject`), dead processes included: {"oom": [...], "cuda": [...]}."""
    folder = folder or inject_dir()
    found: dict[str, list[dict[str, Any]]] = {"oom": [], "cuda": []}
    for kind, pattern in (("oom", "*.oom.jsonl"), ("cuda", "*.cuda-events.jsonl")):
        for path in sorted(folder.glob(pattern)):
            found[kind] += [e for e in _jsonl(path) if e.get("tag") == tag]
    return found


def sweep(folder: Path, max_age_s: float = 86400.0) -> int:
    """Remove the trigger folder's files of processes that are gone (same PID namespace as
    ours: PID + start time checked; others: older than `max_age_s`); return how many."""
    from chaosgpu.node import ProcError, pid_ns_inode, process_starttime

    try:
        own = str(pid_ns_inode(os.getpid()))
        entries = list(folder.iterdir())
    except (OSError, ProcError):
        return 0
    removed = 0
    now = time.time()
    for path in entries:
        parts = path.name.split(".", 1)[0].split("-")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            continue
        inode, pid, start = parts
        if inode == own:
            gone = process_starttime(int(pid)) != int(start)
        else:
            try:
                gone = now - path.stat().st_mtime > max_age_s
            except OSError:
                continue
        if gone:
            path.unlink(missing_ok=True)
            removed += 1
    return removed
