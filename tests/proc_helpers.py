"""Small process helpers shared by the tests (the package's own readings live in chaosgpu.node;
tests use these to check it from the outside)."""

import time
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


def wait_until(predicate: Callable[[], Any], timeout_s: float = 10.0) -> bool:
    """Poll `predicate` every 10 ms until it is true or `timeout_s` passes; return its last
    truth value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
