"""The agent's job watch: each training job's observed verdict, for the metrics and /healthz.

This module owns how often the agent observes jobs and what it keeps of them. The verdicts are
chaosgpu.job's (an `Observer` of every job on the node, `chaosgpu.job.verdict` decides): the
observer reads the agent's shared census (no census of its own), each rank's /proc activity and
TCP counters, exits, and Python stacks every few seconds (py-spy, where installed). It never
signals anything. Jobs that ended (finished, failed) are dropped `keep_ended_s` after their
verdict, so the watch's memory stays bounded on a node that runs many jobs.
"""

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from chaosgpu.job.verdict import DEFAULT_WINDOW_S, VERDICTS

__all__ = ["JobWatch", "VERDICTS"]

logger = logging.getLogger("chaostoolkit")

_ENDED = ("finished", "failed")


#: the longest the job thread waits at a time before it looks at its stop flag (seconds)
PAUSE_SLICE_S = 0.2


class JobWatch:
    """Observes every job on the node on a thread, every `every_s` seconds."""

    def __init__(self, census: Callable[[], dict[str, Any]], every_s: float = 1.0,
                 window_s: float = DEFAULT_WINDOW_S, stacks: bool = True,
                 keep_ended_s: float = 600.0) -> None:
        from chaosgpu.job.observe import Observer

        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s!r}")
        self.every_s = float(every_s)
        self.keep_ended_s = float(keep_ended_s)
        self.observer = Observer(all_jobs=True, window_s=window_s, tick_s=every_s,
                                 stack_every_s=max(2.0, 2 * every_s), census_every_s=every_s,
                                 stacks=stacks, census=census)
        self._lock = threading.Lock()
        self._jobs: list[dict[str, Any]] = []
        self.ticks = 0
        self.errors = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start observing."""
        self._thread = threading.Thread(target=self._loop, name="chaosgpu-agent-jobs",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop observing and release the observer's pidfds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.observer.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.tick()
            except Exception as error:
                self.errors += 1
                self.last_error = f"{type(error).__name__}: {error}"
                logger.error("chaosgpu agent: job observation failed: %s", self.last_error)
            self._pause_until(max(began + self.every_s, time.monotonic() + 0.05))

    def _pause_until(self, deadline: float) -> None:
        """Wait until `deadline` (monotonic) or stop, in the observer's pause (which notes the
        moment each watched rank ends: its pidfd), a short slice at a time so stop is quick."""
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.observer.pause(min(left, PAUSE_SLICE_S))

    def tick(self) -> None:
        """One observation round: update every job's verdict, drop long-ended jobs."""
        self.observer.tick()
        now = time.time()
        tracks = self.observer.tracks
        for job_id in [k for k, t in tracks.items() if t.verdict in _ENDED
                       and t.since is not None and now - t.since > self.keep_ended_s]:
            del tracks[job_id]
        jobs = [{"id": t.id, "verdict": t.verdict, "reason": t.reason, "since": t.since,
                 "since_known": t.since_known, "restart_count": t.restart_count(), "tag": t.tag,
                 "ranks": len(t.current_ranks())} for t in tracks.values()]
        with self._lock:
            self._jobs = jobs
        self.ticks += 1

    def jobs(self) -> list[dict[str, Any]]:
        """The jobs' verdicts at the last round: [{"id", "verdict", "reason", "since",
        "since_known", "restart_count", "tag", "ranks"}] (since_known false: the verdict already
        held when the job was first seen, and `since` is that first sight)."""
        with self._lock:
            return list(self._jobs)
