"""The agent's timeline window: the shared sampler kept to a retention window, its processes
attributed to pods and containers.

This module owns the window (trim, attribution, the answer of /v1/timeline) and the switch from
the "host-rss" source to "nvml" when NVML comes up after the agent started (a DaemonSet that
started before the driver). The sampling itself is `chaosgpu.timeline.sampler.Sampler` (one
implementation for the whole project); it reads the node only through chaosgpu.node.
"""

import bisect
import logging
import threading
import time
from typing import Any

__all__ = ["TIMELINE_SCHEMA", "TimelineWindow"]

logger = logging.getLogger("chaostoolkit")

TIMELINE_SCHEMA = "chaosgpu.agent.timeline/1"
#: How often a host-rss timeline asks whether NVML has come up (NVML's own backoff applies).
NVML_CHECK_S = 5.0



def _gone_by(entry: dict[str, Any], t: float) -> bool:
    """Whether a tracked process was last seen gone at or before `t` (timeline seconds)."""
    before = [state for at, state in entry["states"] if at <= t]
    return bool(before) and before[-1] == "gone"

class TimelineWindow:
    """The agent's timeline: a `chaosgpu.timeline.sampler.Sampler` (every GPU process when NVML
    is there, else chaosgpu-tagged processes' RSS) kept to the last `retention_s` seconds, with
    each process attributed (pod uid, container id, namespace PID) the first time it is seen."""

    def __init__(self, rate_hz: float = 100.0, process_every: int = 5,
                 retention_s: float = 600.0, housekeeping_s: float = 0.25) -> None:
        from chaosgpu.timeline.sampler import Sampler

        if not isinstance(retention_s, int | float) or retention_s <= 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s!r}")
        self._args: dict[str, Any] = {
            "rate_hz": rate_hz, "process_every": process_every,
            # the retention bounds memory; max_samples only guards a stuck trim
            "max_samples": int(rate_hz * retention_s * 4) + 10_000}
        self.sampler = Sampler(**self._args)
        self.retention_s = float(retention_s)
        self.switched_to_nvml_at: float | None = None
        self._next_nvml_check = time.monotonic() + NVML_CHECK_S
        self.housekeeping_s = housekeeping_s
        self.attribution: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling and the housekeeping thread (trim + attribution)."""
        self.sampler.start()
        self._thread = threading.Thread(target=self._housekeeping, name="chaosgpu-agent-timeline",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop both threads (each waits at most `timeout_s`)."""
        self._stop.set()
        self.sampler.stop(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _housekeeping(self) -> None:
        while not self._stop.wait(self.housekeeping_s):
            try:
                self.attribute_new()
                self.trim()
                if self.sampler.source == "host-rss" and \
                        time.monotonic() >= self._next_nvml_check:
                    self._next_nvml_check = time.monotonic() + NVML_CHECK_S
                    self.upgrade_to_nvml()
            except Exception:
                logger.error("chaosgpu agent: timeline housekeeping failed", exc_info=True)

    def upgrade_to_nvml(self) -> bool:
        """When NVML answers now (it did not when the timeline started), start an NVML sampler
        in place of the host-rss one (the host-rss samples are dropped: another unit of
        another thing); True when it switched."""
        from chaosgpu.node import nvml_device_memory
        from chaosgpu.timeline.sampler import Sampler

        if self.sampler.source != "host-rss" or not nvml_device_memory():
            return False
        fresh = Sampler(source="nvml", **self._args)
        fresh.start()
        # the switch time is set before the new sampler is published: whoever sees the NVML
        # source sees when it came (the old sampler's stop can take a while)
        self.switched_to_nvml_at = time.time()
        old, self.sampler = self.sampler, fresh
        self.attribution.clear()
        old.stop()
        logger.info("chaosgpu agent: NVML is up: the timeline samples GPU memory from now on")
        return True

    def summary(self) -> dict[str, Any]:
        """{"source", "samples", "rate_hz" (measured over the retained window),
        "final_total_mib", "running"}: cheap (no pass over the samples), for /metrics, /healthz
        and /v1/timeline."""
        sampler = self.sampler
        with sampler._data_lock:
            n = len(sampler.t)
            span = sampler.t[-1] - sampler.t[0] if n > 1 else 0.0
            final = sampler.total[-1] if n else None
        return {"source": sampler.source, "samples": n, "running": sampler.running,
                "rate_hz": round((n - 1) / span, 2) if span > 0 else None,
                "final_total_mib": final}

    def remember(self, census: dict[str, Any]) -> None:
        """Attribute every GPU process of a census (a CensusCache listener)."""
        for entry in census.get("gpu_processes") or []:
            pid = entry.get("host_pid")
            if isinstance(pid, int) and pid not in self.attribution:
                container = entry.get("container") or {}
                self.attribution[pid] = {
                    "pod_uid": container.get("pod_uid"), "container_id": container.get("id"),
                    "ns_pid": entry.get("ns_pid"), "job": entry.get("job"),
                    "rank": entry.get("rank")}

    def attribute_new(self) -> None:
        """Read the container identity of processes the sampler saw for the first time."""
        from chaosgpu.node import read_process

        with self.sampler._data_lock:
            pids = [pid for pid in self.sampler.processes if pid not in self.attribution]
        for pid in pids:
            record = read_process(pid, env=False, fds=False)
            if record is None:
                self.attribution[pid] = {"pod_uid": None, "container_id": None, "ns_pid": None,
                                         "note": "gone before it could be attributed"}
                continue
            container = record.get("container") or {}
            nspid = record.get("nspid") or []
            self.attribution[pid] = {"pod_uid": container.get("pod_uid"),
                                     "container_id": container.get("id"),
                                     "ns_pid": nspid[-1] if nspid else None}

    def trim(self) -> None:
        """Drop samples older than the retention window."""
        sampler = self.sampler
        cutoff = sampler.now() - self.retention_s
        with sampler._data_lock:
            cut = bisect.bisect_left(sampler.t, cutoff)
            if cut >= max(100, len(sampler.t) // 10):
                del sampler.t[:cut]
                del sampler.total[:cut]
                for series in sampler.devices.values():
                    del series[:cut]
            for pid in list(sampler.processes):
                entry = sampler.processes[pid]
                if entry["t"] and entry["t"][-1] < cutoff and (
                        not entry["states"] or entry["states"][-1][0] < cutoff):
                    del sampler.processes[pid]
                    self.attribution.pop(pid, None)
                    continue
                pcut = bisect.bisect_left(entry["t"], cutoff)
                if pcut:
                    del entry["t"][:pcut]
                    del entry["mib"][:pcut]
            sampler.events[:] = [e for e in sampler.events if e["t"] >= cutoff]

    def window(self, since: float, until: float, pod_uid: str | None = None,
               pid: int | None = None) -> dict[str, Any]:
        """The timeline between two unix times, in the journal's timeline shape (times relative
        to t0), optionally only the processes of one pod or one PID."""
        sampler = self.sampler
        t0 = sampler.t0
        lo, hi = since - t0, until - t0
        with sampler._data_lock:
            a = bisect.bisect_left(sampler.t, lo)
            b = bisect.bisect_right(sampler.t, hi)
            t = sampler.t[a:b]
            total = sampler.total[a:b]
            devices = [{"index": index, "t": t, "used_mib": series[a:b]}
                       for index, series in sorted(sampler.devices.items())]
            oldest = sampler.t[0] + t0 if sampler.t else None
            processes = {}
            for key, entry in sampler.processes.items():
                who = self.attribution.get(key, {})
                if pid is not None and key != pid:
                    continue
                if pod_uid is not None and who.get("pod_uid") != pod_uid:
                    continue
                pa = bisect.bisect_left(entry["t"], lo)
                pb = bisect.bisect_right(entry["t"], hi)
                if pa and not _gone_by(entry, lo):
                    # the series starts with the last reading before the window: the process
                    # list is read seconds apart while device memory stays put, and that
                    # reading holds until the next (chaosgpu.timeline.integral)
                    pa -= 1
                states = [s for s in entry["states"] if lo <= s[0] <= hi]
                if pa == pb and not states:
                    continue
                processes[str(key)] = {
                    "t": entry["t"][pa:pb], "mib": entry["mib"][pa:pb], "tag": entry.get("tag"),
                    "rank": entry.get("rank"), "comm": entry.get("comm"), "states": states,
                    "pod_uid": who.get("pod_uid"), "container_id": who.get("container_id"),
                    "ns_pid": who.get("ns_pid")}
            events = [dict(e) for e in sampler.events if lo <= e["t"] <= hi]
        summary = self.summary()
        return {
            "schema": TIMELINE_SCHEMA, "t0": t0, "since": since, "until": until,
            "source": sampler.source, "rate_hz": summary["rate_hz"],
            "rate_hz_requested": sampler.rate_hz, "process_every": sampler.process_every,
            "unit": "MiB", "t": t, "total_mib": total, "devices": devices,
            "processes": processes, "events": events,
            "retained_since": oldest, "retention_s": self.retention_s,
            "truncated": oldest is None or since < oldest,
            "errors": list(sampler.errors)}
