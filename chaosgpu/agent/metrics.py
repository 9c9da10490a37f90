"""Prometheus exposition of a census, the jobs' verdicts and the agent's own state.

This module owns the metric names, their labels and units; the text format is
`prometheus_client`'s (`generate_latest`, format 0.0.4). It must not take a census, observe a
job or sample anything: the server passes what it has.

Units are base units: bytes and seconds (the census and the timeline count MiB = 2^20 bytes;
they are converted here). The `_mib` names of the first release are still served, marked
DEPRECATED in their HELP text, and go in the next release (docs/agent.md lists both).
"""

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["CONTENT_TYPE", "DEPRECATED", "MIB", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MIB = 1024 * 1024
#: deprecated name -> its replacement (served for one more release)
DEPRECATED = {
    "chaosgpu_gpu_memory_used_mib": "chaosgpu_gpu_memory_used_bytes",
    "chaosgpu_gpu_memory_total_mib": "chaosgpu_gpu_memory_total_bytes",
    "chaosgpu_gpu_process_memory_mib": "chaosgpu_gpu_process_memory_bytes",
    "chaosgpu_pod_gpu_memory_mib": "chaosgpu_pod_gpu_memory_bytes",
    "chaosgpu_timeline_total_mib": "chaosgpu_timeline_total_bytes",
    "chaosgpu_job_hang_suspected": 'chaosgpu_job_verdict{verdict="hung"}',
}
_DEVICE = ["gpu", "uuid", "name"]
_PROCESS = ["gpu", "pid", "ns_pid", "pod_uid", "container_id", "job", "rank", "visible"]


def _value(value: Any, scale: float = 1.0) -> float:
    if value is None or isinstance(value, str):
        return math.nan
    return float(value) * scale


def _label(value: Any) -> str:
    return "" if value is None else str(value)


def _pair(name: str, help_text: str, labels: list[str]) -> tuple[GaugeMetricFamily,
                                                                 GaugeMetricFamily]:
    """A base-unit gauge `name` and its deprecated `_mib` twin."""
    old = next(k for k, v in DEPRECATED.items() if v == name)
    return (GaugeMetricFamily(name, f"{help_text} (bytes)", labels=labels),
            GaugeMetricFamily(old, f"DEPRECATED (removed in the next release): use {name}. "
                                   f"{help_text} (MiB)", labels=labels))


def _gpu(census: dict[str, Any]) -> Iterator[Metric]:
    gpu = census.get("gpu") or {}
    yield GaugeMetricFamily("chaosgpu_gpu_available", "1 when NVML answered on this node",
                            value=1.0 if gpu.get("available") else 0.0)
    used, used_old = _pair("chaosgpu_gpu_memory_used_bytes",
                           "GPU memory used per device (includes the driver's reservation)",
                           _DEVICE)
    total, total_old = _pair("chaosgpu_gpu_memory_total_bytes", "GPU memory per device",
                             _DEVICE)
    for device in gpu.get("devices") or []:
        labels = [_label(device.get(k)) for k in ("index", "uuid", "name")]
        for new, old, key in ((used, used_old, "memory_used_mib"),
                              (total, total_old, "memory_total_mib")):
            new.add_metric(labels, _value(device.get(key), MIB))
            old.add_metric(labels, _value(device.get(key)))
    proc, proc_old = _pair("chaosgpu_gpu_process_memory_bytes",
                           "GPU memory per process; pid = host PID, ns_pid = PID in its "
                           "namespace", _PROCESS)
    pod, pod_old = _pair("chaosgpu_pod_gpu_memory_bytes",
                         "GPU memory held by the processes of a pod", ["pod_uid"])
    per_pod: dict[str, float] = {}
    for entry in census.get("gpu_processes") or []:
        container = entry.get("container") or {}
        labels = [_label(v) for v in (
            entry.get("gpu_index"), entry.get("host_pid"), entry.get("ns_pid"),
            container.get("pod_uid"), container.get("id"), entry.get("job"), entry.get("rank"),
            "1" if entry.get("visible") else "0")]
        proc.add_metric(labels, _value(entry.get("used_mib"), MIB))
        proc_old.add_metric(labels, _value(entry.get("used_mib")))
        if container.get("pod_uid") and isinstance(entry.get("used_mib"), int | float):
            per_pod[container["pod_uid"]] = per_pod.get(container["pod_uid"], 0.0) + float(
                entry["used_mib"])
    for uid, mib in sorted(per_pod.items()):
        pod.add_metric([uid], mib * MIB)
        pod_old.add_metric([uid], mib)
    yield from (used, total, proc, pod, used_old, total_old, proc_old, pod_old)


def _processes(census: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("chaosgpu_processes", "processes seen by the census",
                            value=len(census.get("processes") or []))
    yield GaugeMetricFamily("chaosgpu_zombie_processes", "zombie processes (state Z)",
                            value=len(census.get("zombies") or []))
    yield GaugeMetricFamily("chaosgpu_orphan_processes",
                            "orphans: reparented to their namespace's init or a subreaper",
                            value=len(census.get("orphans") or []))
    yield GaugeMetricFamily("chaosgpu_jobs", "distributed-training jobs the census found "
                            "(from process environments)", value=len(census.get("jobs") or []))
    yield GaugeMetricFamily("chaosgpu_census_duration_seconds", "how long the last census took",
                            value=_value(census.get("duration_ms"), 0.001))
    yield GaugeMetricFamily("chaosgpu_census_errors", "errors the census reported",
                            value=len(census.get("errors") or []))


def _jobs(jobs: list[dict[str, Any]]) -> Iterator[Metric]:
    from chaosgpu.job.verdict import VERDICTS

    verdict = GaugeMetricFamily(
        "chaosgpu_job_verdict", "the job's observed verdict (chaosgpu.job): 1 for the current "
        "one, 0 for the others", labels=["job", "verdict"])
    since = GaugeMetricFamily("chaosgpu_job_verdict_since_timestamp_seconds",
                              "unix time the job's current verdict began (NaN: it already "
                              "held when the agent first saw the job)", labels=["job"])
    restarts = GaugeMetricFamily("chaosgpu_job_restarts",
                                 "restarts of the job's ranks by the elastic agent",
                                 labels=["job"])
    hang = GaugeMetricFamily("chaosgpu_job_hang_suspected",
                             "DEPRECATED (removed in the next release): use "
                             'chaosgpu_job_verdict{verdict="hung"}. 1 when the job is hung',
                             labels=["job"])
    for job in jobs:
        job_id = _label(job.get("id"))
        for name in VERDICTS:
            verdict.add_metric([job_id, name], 1.0 if job.get("verdict") == name else 0.0)
        since.add_metric([job_id], _value(job.get("since") if job.get("since_known", True)
                                          else None))
        restarts.add_metric([job_id], _value(job.get("restart_count")))
        hang.add_metric([job_id], 1.0 if job.get("verdict") == "hung" else 0.0)
    yield GaugeMetricFamily("chaosgpu_hung_jobs", "jobs whose observed verdict is hung",
                            value=sum(1 for job in jobs if job.get("verdict") == "hung"))
    yield from (verdict, since, restarts, hang)


def _agent(agent: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("chaosgpu_census_age_seconds",
                            "age of the census these metrics come from",
                            value=_value(agent.get("census_age_s")))
    for key, name, help_text in (
            ("censuses", "chaosgpu_agent_censuses", "censuses the agent took"),
            ("census_failures", "chaosgpu_agent_census_failures", "censuses that failed"),
            ("requests", "chaosgpu_agent_requests", "HTTP requests served"),
            ("rejected", "chaosgpu_agent_requests_rejected",
             "HTTP requests refused with 503 (the agent was at its concurrency limit)"),
            ("nvml_attempts", "chaosgpu_agent_nvml_init_attempts",
             "NVML initialisations tried (failed ones are retried with backoff)")):
        if agent.get(key) is not None:
            yield CounterMetricFamily(name, help_text, value=agent[key])
    if "inflight" in agent:
        yield GaugeMetricFamily("chaosgpu_agent_inflight_requests",
                                "HTTP requests being answered now", value=agent["inflight"])
    if "nvml_retry_in_s" in agent:
        yield GaugeMetricFamily("chaosgpu_agent_nvml_retry_in_seconds",
                                "seconds until NVML's initialisation is tried again (NaN: "
                                "none due: NVML is up)",
                                value=_value(agent["nvml_retry_in_s"]))


def _timeline(summary: dict[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("chaosgpu_timeline_rate_hz", "measured sampling rate of the "
                            "timeline", value=_value(summary.get("rate_hz")))
    yield GaugeMetricFamily("chaosgpu_timeline_samples", "samples held in the retention window",
                            value=_value(summary.get("samples")))
    help_text = "last sampled total (GPU used, or tracked RSS without NVML)"
    new, old = _pair("chaosgpu_timeline_total_bytes", help_text, [])
    new.add_metric([], _value(summary.get("final_total_mib"), MIB))
    old.add_metric([], _value(summary.get("final_total_mib")))
    yield from (new, old)


class _Snapshot(Collector):
    def __init__(self, census: dict[str, Any], jobs: list[dict[str, Any]] | None,
                 timeline: dict[str, Any] | None, agent: dict[str, Any]) -> None:
        self.census, self.jobs, self.timeline, self.agent = census, jobs, timeline, agent

    def collect(self) -> Iterator[Metric]:
        yield from _gpu(self.census)
        yield from _processes(self.census)
        if self.jobs is not None:
            yield from _jobs(self.jobs)
        if self.timeline is not None:
            yield from _timeline(self.timeline)
        yield from _agent(self.agent)


def render(census: dict[str, Any], jobs: list[dict[str, Any]] | None = None,
           timeline: dict[str, Any] | None = None,
           agent: dict[str, Any] | None = None) -> bytes:
    """The whole exposition: the census, the jobs' verdicts (None: no job watch), the timeline's
    summary (None: no timeline) and the agent's own counters (`census_age_s`, `censuses`,
    `census_failures`, `requests`, `rejected`, `inflight`, `nvml_attempts`,
    `nvml_retry_in_s`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(census, jobs, timeline, dict(agent or {})))
    result: bytes = generate_latest(registry)
    return result
