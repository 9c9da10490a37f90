"""Chaos Toolkit probes on GPUs and on what GPU faults do to jobs.

This module owns the GPU probes that experiments call: memory and processes (through
`chaosgpu.node`, the census), utilisation over time and XID events (through chaosgpu.gpu.nvml,
the thin layer for the readings the census does not take), and the victim's side of a GPU
fault: a ring job's progress and stragglers (its own step counter), CUDA out-of-memory seen in a
job. It must not import pynvml itself, and must not signal or start anything. NVML absent is a
normal state: `gpu_available` says so, NVML probes raise a clear error naming why.

A workload's `tag` is matched exactly, never stripped: one with whitespace or a control
character (chaosgpu.arguments.TAG) is refused by name before anything is read.
A probe that reads a workload by tag (job_stalled, cuda_oom_seen) fails when the tag is one this
run never met (no workload recorded or started under it, no process seen carrying it: a typo)
unless `missing_ok` allows it: true, or "before-method" (the default, the catalog's form: before
the experiment's method starts the workload; chaosgpu.arguments.missing_allowed).
"""

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from chaosgpu import arguments
from chaosgpu.arguments import (
    DEVICE,
    INDEX,
    MISSING_OK,
    PID,
    POSITIVE,
    POSITIVE_SECONDS,
    SECONDS,
    TAG,
    checked,
)
from chaosgpu.gpu import devices, monitor
from chaosgpu.node import nvml_snapshot, take_census

__all__ = ["gpu_available", "gpu_memory_used", "gpu_processes", "process_gpu_memory",
           "gpu_utilization", "gpu_usable", "xid_events", "job_progress", "job_stalled",
           "job_slowdown", "cuda_oom_seen", "gpu_faults"]

_baselines: dict[str, dict[str, Any]] = {}

MissingOk = Union[bool, str]


def _unknown_tag(tag: str, missing_ok: Any, what: str) -> ValueError | None:
    """The error for a workload tag that reads as absent, or None where `missing_ok` allows it
    (a tag this run met: it ended; or before the method, with "before-method")."""
    from chaosgpu.scope import tag_seen

    if arguments.missing_allowed(missing_ok, tag_seen(tag)):
        return None
    return ValueError(f"no {what} tagged {tag!r}, and this run never met that tag (no workload "
                      "started or recorded under it, no process seen carrying it): a typo? A "
                      "workload that may be absent " + arguments.missing_advice(missing_ok))


def _snapshot(device: int | None) -> dict[str, Any]:
    snapshot = nvml_snapshot()
    if not snapshot.get("available"):
        raise RuntimeError(f"no GPU visible through NVML: {snapshot.get('reason')}")
    if device is not None:
        indexes = [d["index"] for d in snapshot["devices"]]
        if not isinstance(device, int) or device not in indexes:
            raise ValueError(f"GPU {device!r} does not exist here; GPUs are {indexes}")
    return snapshot


def gpu_available(configuration: Optional[Dict[str, Any]] = None,
                  secrets: Optional[Dict[str, Any]] = None) -> bool:
    """Return whether NVML sees at least one GPU here (false without driver, library or GPU)."""
    return bool(nvml_snapshot(with_processes=False).get("available"))


@checked(device=INDEX)
def gpu_memory_used(device: Optional[int] = None, configuration: Optional[Dict[str, Any]] = None,
                    secrets: Optional[Dict[str, Any]] = None) -> float:
    """Return the GPU memory used in MiB on GPU `device` (all GPUs summed when None), as NVML
    reports it, including the driver's own reservation (~615 MiB on an idle H200): compare it
    with a baseline, not with zero."""
    snapshot = _snapshot(device)
    return float(sum(d["memory_used_mib"] or 0.0 for d in snapshot["devices"]
                     if device is None or d["index"] == device))


@checked(device=INDEX)
def gpu_processes(device: Optional[int] = None, configuration: Optional[Dict[str, Any]] = None,
                  secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Return the processes holding GPU memory (on GPU `device`, or all), each with host PID,
    the PID seen here and inside its namespace, container, job, rank and MiB; a process whose
    host PID this observer cannot see says "not visible here" (it is not an orphan)."""
    snapshot = _snapshot(device)
    census = take_census(gpu_snapshot=snapshot, fds=False)
    result: list[dict[str, Any]] = [g for g in census["gpu_processes"]
                                    if device is None or g["gpu_index"] == device]
    return result


@checked(pid=PID, device=INDEX)
def process_gpu_memory(pid: int, device: Optional[int] = None,
                       configuration: Optional[Dict[str, Any]] = None,
                       secrets: Optional[Dict[str, Any]] = None) -> float:
    """Return the GPU memory in MiB that host PID `pid` holds (on `device`, or all GPUs);
    0.0 when the process holds none (or is gone)."""
    if not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"pid must be a positive host PID, got {pid!r}")
    snapshot = _snapshot(device)
    return float(sum(p["used_mib"] or 0.0 for d in snapshot["devices"]
                     if device is None or d["index"] == device
                     for p in d["processes"] if p["pid"] == pid))


@checked(device=DEVICE, window_s=POSITIVE_SECONDS, interval_s=POSITIVE_SECONDS)
def gpu_utilization(device: Union[int, str] = 0, window_s: float = 2.0, interval_s: float = 0.1,
                    configuration: Optional[Dict[str, Any]] = None,
                    secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Sample GPU `device`'s utilisation through NVML every `interval_s` for `window_s`: SM busy
    % (share of time a kernel ran) and memory busy % (share of time device memory was read or
    written, NVML's stand-in for bandwidth use; it is not GB/s). Returns mean/min/max of each,
    the share of readings with the SMs >= 90 % busy, and the series. Without NVML it returns
    {"available": false, "reason": ...} (nothing to sample), so an experiment's other
    measurements still run."""
    from chaosgpu.gpu import nvml

    devices.check_duration(window_s, allow_none=False, name="window_s")
    devices.check_number("interval_s", interval_s, minimum=0.001, maximum=window_s)
    ok, why = nvml.available()
    if not ok:
        return {"available": False, "reason": why, "device": device}
    index = int(devices.resolve_device(device)["index"])
    readings = []
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        readings.append(nvml.utilization(index))
        time.sleep(interval_s)
    summary = monitor.summarize_utilization(readings)
    summary.update(device=index, available=True)
    return summary


@checked(device=DEVICE, timeout_s=POSITIVE_SECONDS)
def gpu_usable(device: Union[int, str] = 0, timeout_s: float = 60.0,
               configuration: Optional[Dict[str, Any]] = None,
               secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when GPU `device` (NVML index or UUID) allocates memory and runs a kernel in a fresh
    process (chaosgpu's XID program in check mode); false when it does not or there is no GPU."""
    import json

    from chaosgpu.gpu import launch

    try:
        entry = devices.resolve_device(device)
    except (RuntimeError, ValueError):
        return False
    uuid = ["--uuid", str(entry["uuid"])] if entry.get("uuid") else []
    run = launch.run_to_end("xid", launch.check_tag(None, "gpu-check"), "xid",
                            ["--check", *uuid], {"device": entry.get("index"), "check": True},
                            float(timeout_s))
    try:
        return bool(json.loads(run["stdout"] or "{}").get("usable"))
    except json.JSONDecodeError:
        return False


@checked(device=DEVICE, timeout_s=SECONDS)
def xid_events(device: Optional[Union[int, str]] = None, timeout_s: float = 5.0,
               configuration: Optional[Dict[str, Any]] = None,
               secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Wait up to `timeout_s` for XID events (NVML critical XID errors) on GPU `device` (all
    GPUs when None), from the moment the probe starts: {"xids": [{"t", "device", "xid"}],
    "registered": [devices], "unsupported": {device: why}}. An empty list after registration
    means NVML delivered none in the window; where registration is refused for some devices,
    "unsupported" says so. Where NVML registered no device at all, nothing could be seen: the
    probe fails (RuntimeError) rather than read as "no XID"."""
    from chaosgpu.gpu import nvml

    devices.check_number("timeout_s", timeout_s, minimum=0)
    indexes = None if device is None else [int(devices.resolve_device(device)["index"])]
    watch = nvml.XidWatch(indexes)
    try:
        if not watch.registered:
            raise RuntimeError(f"NVML registered no GPU for XID events (refused: "
                               f"{watch.unsupported or watch.error or 'no GPU'}): no XID "
                               "could be seen, so an empty list would prove nothing")
        seen = watch.wait(timeout_s)
    finally:
        watch.stop()
    return {"xids": monitor.describe_xids(seen), "registered": watch.registered,
            "unsupported": watch.unsupported, "error": watch.error, "window_s": timeout_s}


class NotAReadableRing(RuntimeError):
    """Live processes carry the tag, but no ring step counter of theirs can be read: never
    "no such ring" (missing_ok does not apply to what is running)."""


def _ring_folder(tag: str) -> Path:
    """The folder of ring `tag`'s step counters: its record's (start_ring), else the
    `--ready-dir` of its live ranks (a ring started with `chaosgpu workload ring --detach`,
    found by its tag in the census). ValueError: nothing carries the tag; NotAReadableRing:
    live processes carry it, but they are no ring whose counters can be read."""
    from chaosgpu import state

    record = state.read_record("workloads", tag) if isinstance(tag, str) and tag else None
    if record is not None and record.get("kind") == "ring" and record.get("workdir"):
        return Path(record["workdir"])
    carriers = [p for p in take_census(env=True, fds=False, gpu=False).get("processes") or []
                if p.get("tag") == tag and p.get("state") not in ("Z", "X")]
    if not carriers:
        raise ValueError(f"no chaosgpu ring workload tagged {tag!r}: progress is read from the "
                         "ring's own step counter (start it with start_ring, or `chaosgpu "
                         "workload ring --ready-dir DIR --tag TAG`)")
    folders = {d for d in (_ready_dir(p.get("cmdline") or []) for p in carriers) if d}
    if len(folders) != 1:
        pids = sorted(p["pid"] for p in carriers)[:8]
        why = ("none of them is a ring rank with --ready-dir" if not folders
               else f"their ranks name several ready dirs {sorted(folders)}")
        raise NotAReadableRing(f"processes carrying tag {tag!r} live (PIDs {pids}), but no "
                               f"ring step counter of theirs can be read: {why}")
    (folder,) = folders
    return Path(folder)


def _ready_dir(argv: List[str]) -> Optional[str]:
    """The `--ready-dir` of a ring rank's command line (`-m chaosgpu.workloads rank`)."""
    if "chaosgpu.workloads" not in argv or "rank" not in argv:
        return None
    for index, arg in enumerate(argv):
        if arg == "--ready-dir" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--ready-dir="):
            return arg.split("=", 1)[1]
    return None


@checked(tag=TAG, window_s=POSITIVE_SECONDS, stall_factor=POSITIVE)
def job_progress(tag: str, window_s: float = 2.0, stall_factor: float = 0.5,
                 configuration: Optional[Dict[str, Any]] = None,
                 secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Measure how fast each rank of the chaosgpu ring `tag` advances over `window_s` (from the
    ranks' own step counters): iterations/s per rank, stalled ranks (no step in the window), the
    straggler (slowest rank below `stall_factor` x the others' median), OOMs the ranks handled,
    and "progressing". The first measurement of a tag in this run is kept as its baseline for
    job_slowdown."""
    devices.check_duration(window_s, allow_none=False, name="window_s")
    folder = _ring_folder(tag)
    before = monitor.read_progress(folder)
    started = time.monotonic()
    time.sleep(window_s)
    after = monitor.read_progress(folder)
    result = monitor.progress_rates(before, after, time.monotonic() - started, stall_factor)
    result["tag"] = tag
    _baselines.setdefault(tag, result)
    return result


@checked(tag=TAG, window_s=POSITIVE_SECONDS, missing_ok=MISSING_OK)
def job_stalled(tag: str, window_s: float = 2.0, missing_ok: MissingOk = "before-method",
                configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when the chaosgpu ring `tag` runs (recorded by start_ring, or its live ranks carry
    the tag, as `chaosgpu workload ring --detach --ready-dir DIR` starts them) and a rank did
    not advance during `window_s` (blocked on its GPU, holding the GIL, waiting for a stuck
    peer, stopped, or gone); false when every rank advanced. The steady state "no stalled job"
    uses tolerance false. No such ring (nothing recorded, no live process carrying the tag):
    false where `missing_ok` allows it (before the method starts it, with "before-method", the
    default; or a ring this run started, since stopped), otherwise the probe fails, so a typo'd
    tag never passes. Live processes carrying the tag whose step counters cannot be read fail
    the probe whatever `missing_ok` says: what runs is never "no such ring"."""
    arguments.missing_allowed(missing_ok, True)  # a bad missing_ok is refused either way
    try:
        folder = _ring_folder(tag)
    except ValueError:
        refused = _unknown_tag(tag, missing_ok, "chaosgpu ring workload")
        if refused is not None:
            raise refused from None
        return False
    if not monitor.read_progress(folder):
        return False  # started but not stepping yet: nothing to judge
    return not bool(job_progress(tag, window_s)["progressing"])


@checked(tag=TAG, window_s=POSITIVE_SECONDS)
def job_slowdown(tag: str, window_s: float = 2.0,
                 configuration: Optional[Dict[str, Any]] = None,
                 secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Measure the ring `tag` now (as job_progress) and compare with its first measurement in
    this run (the baseline, taken before the fault): per-rank rate now / before, the slowest
    rank's slowdown factor (before / now), and the straggler."""
    if tag not in _baselines:
        raise ValueError(f"no baseline for {tag!r}: call job_progress before the fault")
    baseline = _baselines[tag]
    now = job_progress(tag, window_s)
    ratios: dict[str, float | None] = {}
    for rank, entry in now["ranks"].items():
        before = (baseline["ranks"].get(rank) or {}).get("rate_per_s")
        rate = entry.get("rate_per_s")
        ratios[rank] = round(rate / before, 3) if before and rate is not None else None
    known = [r for r in ratios.values() if r is not None]
    worst = min(known) if known else None
    return {"tag": tag, "baseline": baseline, "now": now, "rate_ratio": ratios,
            "slowdown_factor": round(1.0 / worst, 3) if worst else None,
            "straggler_rank": now["straggler_rank"], "stalled_ranks": now["stalled_ranks"]}


@checked(tag=TAG, missing_ok=MISSING_OK)
def cuda_oom_seen(tag: str, missing_ok: MissingOk = "before-method",
                  configuration: Optional[Dict[str, Any]] = None,
                  secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Whether processes tagged `tag` hit CUDA out-of-memory, from what reaches outside the job:
    torch's OOM observer (ranks started with chaosgpu's Python injector), allocations failed by
    chaosgpu's CUDA injector, the OOMs a chaosgpu ring reports in its step counter, and the
    lines of the workload's logs that name an OOM. Returns "seen" and each source's evidence;
    a job reached by none of these paths reads "seen": false with "reached" saying so. A tag
    known nowhere (no record, no injector file, never met by this run) fails unless
    `missing_ok` allows it (see the module docstring): a typo never reads as "no OOM"."""
    from chaosgpu import state
    from chaosgpu.gpu import injector

    arguments.missing_allowed(missing_ok, True)  # a bad missing_ok is refused either way
    events = injector.tagged_events(tag)
    record = state.read_record("workloads", tag)
    if record is None and not events["oom"] and not events["cuda"]:
        refused = _unknown_tag(tag, missing_ok, "workload or injector mark")
        if refused is not None:
            raise refused
    logs: dict[str, list[str]] = {}
    progress_ooms: dict[str, Any] = {}
    reached = ["injector files"]
    if record is not None and record.get("workdir"):
        reached.append("workload logs")
        folder = Path(record["workdir"])
        for path in sorted(folder.glob("*.log")):
            try:
                lines = monitor.oom_lines(path.read_text(errors="replace"))
            except OSError:
                continue
            if lines:
                logs[path.name] = lines
        progress_ooms = {str(r): d.get("ooms") for r, d in monitor.read_progress(folder).items()
                         if d.get("ooms")}
    seen = bool(events["oom"] or logs or progress_ooms or any(
        e.get("fault") == "alloc" for e in events["cuda"]))
    return {"tag": tag, "seen": seen, "torch_observer": events["oom"],
            "cuda_injector": events["cuda"], "ring_ooms": progress_ooms, "logs": logs,
            "reached": reached}


def gpu_faults(configuration: Optional[Dict[str, Any]] = None,
               secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The GPU fault programs chaosgpu has recorded (memory pressure, contention, XID), each with
    its tag, kind, configuration and whether its process is still alive."""
    from chaosgpu.gpu.launch import FAULT_KINDS
    from chaosgpu.workloads.actions import list_workloads

    return [w for w in list_workloads() if w.get("kind") in FAULT_KINDS]
