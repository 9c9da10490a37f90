"""Progress of a long wait, for the person watching `chaos run`.

An activity may wait minutes: a pod whose image is being pulled, a grace period, survivors that
must end by themselves within an NCCL timeout. `Progress` writes one line to Chaos Toolkit's
log every `every_s` seconds while it waits (none for a wait shorter than that), saying what it
waits for, for how long so far, until when at most, and what it sees now. It is the one way a
chaosgpu wait reports its progress.
"""

import logging
import time
from collections.abc import Callable

__all__ = ["PROGRESS_EVERY_S", "Progress"]

logger = logging.getLogger("chaostoolkit")

#: seconds between two progress lines of one wait (and before the first)
PROGRESS_EVERY_S = 10.0


class Progress:
    """The progress of one wait: call `update(seen)` at each of its polls; a line is logged
    when `every_s` seconds have passed since the wait began or since the last line."""

    def __init__(self, what: str, timeout_s: float | None = None,
                 every_s: float | None = None) -> None:
        """`every_s` defaults to PROGRESS_EVERY_S (read now, so that it can be set)."""
        every_s = PROGRESS_EVERY_S if every_s is None else every_s
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, not {every_s!r}")
        self.what = what
        self.timeout_s = timeout_s
        self.every_s = every_s
        self.started = time.monotonic()
        self._next = self.started + every_s
        self.lines = 0

    def update(self, seen: Callable[[], str] | str) -> None:
        """Log a progress line if one is due; `seen` (text, or a function that returns it,
        called only then) says what the wait sees now."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        self.lines += 1
        elapsed = now - self.started
        bound = f" of at most {self.timeout_s:g} s" if self.timeout_s is not None else ""
        logger.info("chaosgpu: still waiting for %s: %.0f s%s; %s", self.what, elapsed, bound,
                    seen() if callable(seen) else seen)
