"""Prometheus text exposition (format 0.0.4) of a census and the agent's timeline.

This module owns the metric names, their labels and the text format (escaping, HELP/TYPE
lines). It must not take a census or sample anything: the server passes what it has.

Metrics (MiB = 2^20 bytes, as everywhere in chaosgpu):
- chaosgpu_gpu_available, chaosgpu_gpu_memory_used_mib{gpu,uuid,name},
  chaosgpu_gpu_memory_total_mib{gpu,uuid,name}
- chaosgpu_gpu_process_memory_mib{gpu,pid,ns_pid,pod_uid,container_id,job,rank,visible}: pid is
  the host PID (as NVML reports it), ns_pid the PID inside its namespace
- chaosgpu_pod_gpu_memory_mib{pod_uid}: the sum over the pod's GPU processes
- chaosgpu_zombie_processes, chaosgpu_orphan_processes, chaosgpu_processes
- chaosgpu_jobs, chaosgpu_hung_jobs, chaosgpu_job_hang_suspected{job}
- chaosgpu_census_duration_seconds, chaosgpu_census_age_seconds, chaosgpu_census_errors
- chaosgpu_timeline_rate_hz, chaosgpu_timeline_samples, chaosgpu_timeline_total_mib
- chaosgpu_agent_requests_total
"""

import math
from typing import Any

__all__ = ["escape_label", "render"]


def escape_label(value: Any) -> str:
    """A label value escaped for the text format (backslash, double quote, newline)."""
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: Any) -> str:
    if value is None:
        return "NaN"
    if isinstance(value, bool):
        return "1" if value else "0"
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return repr(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.declared: set[str] = set()

    def metric(self, name: str, kind: str, help_text: str, value: Any,
               labels: dict[str, Any] | None = None) -> None:
        if name not in self.declared:
            self.declared.add(name)
            self.lines.append(f"# HELP {name} {help_text}")
            self.lines.append(f"# TYPE {name} {kind}")
        if labels:
            inner = ",".join(f'{key}="{escape_label(val)}"' for key, val in labels.items())
            self.lines.append(f"{name}{{{inner}}} {_number(value)}")
        else:
            self.lines.append(f"{name} {_number(value)}")

    def declare(self, name: str, kind: str, help_text: str) -> None:
        if name not in self.declared:
            self.declared.add(name)
            self.lines.append(f"# HELP {name} {help_text}")
            self.lines.append(f"# TYPE {name} {kind}")


def render(census: dict[str, Any], timeline: Any = None, census_age_s: float | None = None,
           requests: int | None = None) -> str:
    """The whole exposition for one census (and the timeline window when there is one)."""
    w = _Writer()
    gpu = census.get("gpu") or {}
    w.metric("chaosgpu_gpu_available", "gauge", "1 when NVML answered on this node",
             bool(gpu.get("available")))
    w.declare("chaosgpu_gpu_memory_used_mib", "gauge",
              "GPU memory used per device in MiB (includes the driver's reservation)")
    for device in gpu.get("devices") or []:
        labels = {"gpu": device.get("index"), "uuid": device.get("uuid"),
                  "name": device.get("name")}
        w.metric("chaosgpu_gpu_memory_used_mib", "gauge", "", device.get("memory_used_mib"),
                 labels)
    w.declare("chaosgpu_gpu_memory_total_mib", "gauge", "GPU memory per device in MiB")
    for device in gpu.get("devices") or []:
        labels = {"gpu": device.get("index"), "uuid": device.get("uuid"),
                  "name": device.get("name")}
        w.metric("chaosgpu_gpu_memory_total_mib", "gauge", "", device.get("memory_total_mib"),
                 labels)
    w.declare("chaosgpu_gpu_process_memory_mib", "gauge",
              "GPU memory per process in MiB; pid = host PID, ns_pid = PID in its namespace")
    per_pod: dict[str, float] = {}
    for entry in census.get("gpu_processes") or []:
        container = entry.get("container") or {}
        labels = {"gpu": entry.get("gpu_index"), "pid": entry.get("host_pid"),
                  "ns_pid": entry.get("ns_pid"), "pod_uid": container.get("pod_uid"),
                  "container_id": container.get("id"), "job": entry.get("job"),
                  "rank": entry.get("rank"), "visible": "1" if entry.get("visible") else "0"}
        w.metric("chaosgpu_gpu_process_memory_mib", "gauge", "", entry.get("used_mib"), labels)
        if container.get("pod_uid") and isinstance(entry.get("used_mib"), int | float):
            per_pod[container["pod_uid"]] = per_pod.get(container["pod_uid"], 0.0) + float(
                entry["used_mib"])
    w.declare("chaosgpu_pod_gpu_memory_mib", "gauge",
              "GPU memory held by the processes of a pod, in MiB")
    for pod_uid, mib in sorted(per_pod.items()):
        w.metric("chaosgpu_pod_gpu_memory_mib", "gauge", "", mib, {"pod_uid": pod_uid})
    w.metric("chaosgpu_processes", "gauge", "processes seen by the census",
             len(census.get("processes") or []))
    w.metric("chaosgpu_zombie_processes", "gauge", "zombie processes (state Z)",
             len(census.get("zombies") or []))
    w.metric("chaosgpu_orphan_processes", "gauge",
             "orphans: reparented to their namespace's init or a subreaper",
             len(census.get("orphans") or []))
    jobs = census.get("jobs") or []
    w.metric("chaosgpu_jobs", "gauge", "distributed-training jobs found from process environments",
             len(jobs))
    w.metric("chaosgpu_hung_jobs", "gauge",
             "jobs with a dead, zombie or frozen rank and live survivors",
             sum(1 for job in jobs if job.get("hang_suspected")))
    w.declare("chaosgpu_job_hang_suspected", "gauge", "1 when the job looks hung")
    for job in jobs:
        w.metric("chaosgpu_job_hang_suspected", "gauge", "", bool(job.get("hang_suspected")),
                 {"job": job.get("id")})
    w.metric("chaosgpu_census_duration_seconds", "gauge", "how long the last census took",
             (census.get("duration_ms") or 0) / 1000.0)
    w.metric("chaosgpu_census_age_seconds", "gauge", "age of the census these metrics come from",
             census_age_s)
    w.metric("chaosgpu_census_errors", "gauge", "errors the census reported",
             len(census.get("errors") or []))
    if timeline is not None:
        summary = timeline.sampler.summary()
        w.metric("chaosgpu_timeline_rate_hz", "gauge", "measured sampling rate of the timeline",
                 summary.get("rate_hz"))
        w.metric("chaosgpu_timeline_samples", "gauge", "samples held in the retention window",
                 summary.get("samples"))
        w.metric("chaosgpu_timeline_total_mib", "gauge",
                 "last sampled total (GPU used, or tracked RSS without NVML) in MiB",
                 summary.get("final_total_mib"))
    if requests is not None:
        w.metric("chaosgpu_agent_requests_total", "counter", "HTTP requests served", requests)
    return "\n".join(w.lines) + "\n"
