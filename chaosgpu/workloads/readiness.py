"""Readiness files of the reference workloads.

This module owns the one way a workload announces that it is ready (its memory is really held,
its ring has completed a first all_reduce): an atomically written JSON file, and the one way a
caller waits for it: polling the file at a short interval under a deadline. It must not start
or signal processes.
"""

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from chaosgpu.progress import Progress

__all__ = ["write_ready", "read_ready", "wait_ready", "wait_all_ready"]

POLL_INTERVAL_S = 0.01


def write_ready(path: str | os.PathLike[str], data: dict[str, Any]) -> Path:
    """Atomically write the readiness document `data` to `path` (a reader never sees half).
    OSError (its folder missing, not writable...) leaves no temporary file behind."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return target


def read_ready(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Return the readiness document at `path`, or None when it is not (completely) there."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _pid_alive(pid: int) -> bool:
    from chaosgpu.node import process_state

    return process_state(pid) not in (None, "Z", "X")


def wait_ready(
    path: str | os.PathLike[str],
    timeout_s: float,
    pid: int | None = None,
    interval_s: float = POLL_INTERVAL_S,
) -> dict[str, Any]:
    """Wait until the readiness file `path` exists and return its document.

    Polls every `interval_s` until `timeout_s` has passed, then raises TimeoutError naming the
    file awaited. When `pid` is given and that process dies (or turns zombie) first, raises
    RuntimeError at once instead of waiting out the deadline.
    """
    if timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    owner = f" of pid {pid}" if pid is not None else ""
    waiting = Progress(f"the readiness file {os.fspath(path)}{owner}", timeout_s)
    while True:
        document = read_ready(path)
        if document is not None:
            return document
        if pid is not None and not _pid_alive(pid):
            document = read_ready(path)
            if document is not None:
                return document
            raise RuntimeError(
                f"process {pid} exited before it wrote its readiness file {os.fspath(path)}"
            )
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(
                f"readiness file {os.fspath(path)}{owner} did not appear within {timeout_s:g} s"
            )
        waiting.update("not written yet" + (", the process lives" if pid is not None else ""))
        time.sleep(min(interval_s, max(0.0, deadline - now)))


def wait_all_ready(
    paths: Iterable[str | os.PathLike[str]],
    timeout_s: float,
    pids: Iterable[int | None] | None = None,
) -> list[dict[str, Any]]:
    """Wait for every readiness file in `paths` under one shared deadline; return the documents."""
    paths = list(paths)
    pid_list = list(pids) if pids is not None else [None] * len(paths)
    deadline = time.monotonic() + timeout_s
    documents = []
    for path, pid in zip(paths, pid_list, strict=True):
        documents.append(wait_ready(path, max(0.0, deadline - time.monotonic()), pid=pid))
    return documents
