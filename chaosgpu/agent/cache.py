"""The agent's census: one census in flight at a time, shared by every request that needs it.

This module owns when a census is taken. It runs on the server's event loop; the census itself
runs on one dedicated thread (so at most one census ever runs), and every request that needs a
new census awaits the one in flight instead of starting its own (single flight). It never reads
/proc or NVML itself: the census is `chaosgpu.node.take_census`.

Rules (docs/agent.md, "Census"):

* a census at most `ttl_s` old is answered as it is;
* an older one (up to `max_stale_s`) is answered too, and one refresh starts in the background
  unless one is already in flight;
* none yet, one older than `max_stale_s`, `fresh`, or `ttl_s` 0: the request waits for a census
  that *started after it arrived*; concurrent such requests share it (N fresh requests arriving
  while a census runs cost one more census, not N).
"""

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CensusCache"]

logger = logging.getLogger("chaostoolkit")


def _take_census(**kwargs: Any) -> dict[str, Any]:
    from chaosgpu.node import take_census

    return take_census(**kwargs)


class CensusCache:
    """The census cache with a single flight (see the module's rules)."""

    def __init__(self, ttl_s: float = 1.0, max_stale_s: float = 10.0,
                 census_kwargs: dict[str, Any] | None = None,
                 take: Callable[..., dict[str, Any]] | None = None) -> None:
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self.max_stale_s = max(float(max_stale_s), self.ttl_s)
        self.census_kwargs = dict(census_kwargs or {})
        self._take = take or _take_census
        self._census: dict[str, Any] | None = None
        self._taken_mono = 0.0
        self._flight: asyncio.Future[dict[str, Any]] | None = None
        self._flight_started = 0.0
        self._executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="chaosgpu-agent-census")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.censuses = 0
        self.failures = 0
        self.last_error: str | None = None
        self.listeners: list[Callable[[dict[str, Any]], None]] = []  # called with each census

    # ------------------------------------------------------------------ on the census thread

    def _run(self) -> dict[str, Any]:
        census = self._take(**self.census_kwargs)
        for listener in list(self.listeners):
            try:
                listener(census)
            except Exception:
                logger.error("chaosgpu agent: census listener failed", exc_info=True)
        return census

    # ------------------------------------------------------------------ on the event loop

    def _start(self) -> "asyncio.Future[dict[str, Any]]":
        loop = asyncio.get_running_loop()
        self.loop = loop
        flight = loop.run_in_executor(self._executor, self._run)
        self._flight, self._flight_started = flight, time.monotonic()
        flight.add_done_callback(self._landed)
        return flight

    def _landed(self, flight: "asyncio.Future[dict[str, Any]]") -> None:
        """Take in a finished census: from its done callback, or earlier from `get` when the
        future is done but its callback has not run yet (once either way)."""
        if self._flight is not flight:
            return  # taken in already
        self._flight = None
        if flight.cancelled():
            return
        error = flight.exception()
        if error is not None:
            self.failures += 1
            self.last_error = f"{type(error).__name__}: {error}"
            logger.error("chaosgpu agent: census failed: %s", self.last_error)
            return
        self._census, self._taken_mono = flight.result(), time.monotonic()
        self.censuses += 1

    async def get(self, fresh: bool = False) -> dict[str, Any]:
        """Return a census by the module's rules; raises what the census raised when a needed
        census failed."""
        asked = time.monotonic()
        census, age = self._census, asked - self._taken_mono
        if census is not None and not fresh and self.ttl_s > 0 and age <= self.max_stale_s:
            if age > self.ttl_s and self._flight is None:
                self._start()
            return census
        while True:
            flight = self._flight
            if flight is None:
                flight = self._start()
            elif self._flight_started < asked:
                # started before this request: a census of an earlier moment; wait for it to
                # land, then share (or start) the next one
                if flight.done():
                    # awaiting a done future does not yield: take it in now, or this loop
                    # would spin before its done callback ever runs
                    self._landed(flight)
                    continue
                try:
                    await asyncio.shield(flight)
                except Exception:
                    pass
                continue
            return await asyncio.shield(flight)

    def get_blocking(self, fresh: bool = False, timeout_s: float = 60.0) -> dict[str, Any]:
        """`get` from another thread (the job watch): through the server's event loop."""
        if self.loop is None or self.loop.is_closed():
            raise RuntimeError("the census cache is not attached to a running server")
        return asyncio.run_coroutine_threadsafe(self.get(fresh), self.loop).result(timeout_s)

    def latest(self) -> dict[str, Any] | None:
        """The cached census as it is (None before the first); takes nothing."""
        return self._census

    def age_s(self) -> float | None:
        """Seconds since the cached census was taken (None before the first)."""
        return None if self._census is None else time.monotonic() - self._taken_mono

    @property
    def in_flight(self) -> bool:
        """Whether a census runs now."""
        return self._flight is not None

    def close(self) -> None:
        """Stop the census thread (a census running now is let finish)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
