"""Chaos Toolkit actions that inject GPU faults from outside a job: memory pressure, compute
contention, an in-process fault in one rank (GPU hang, GIL held, exception, segfault, OOM), a
failed CUDA call in any CUDA program, and a genuine XID.

This module owns the faults' public face: validating arguments (a device that exists, MiB that
fit it; seconds by the rules of chaosgpu.arguments: durations and timeouts > 0, at most
LONGEST_WAIT_S) before anything starts, choosing the target (a device by NVML index or
UUID; a rank by job id or tag), marking each fault on the experiment's timeline, and the
rollbacks. Fault programs run as chaosgpu-started, tagged, recorded processes (chaosgpu.gpu.launch);
in-process faults go through the injectors' trigger channel (chaosgpu.gpu.injector). It must not
signal any process itself: stopping goes through chaosgpu.workloads.actions.stop_workload.
"""

import logging
import time
from typing import Any, Dict, List, Optional, Union

from chaosgpu import state
from chaosgpu.arguments import (
    BOOL,
    DEVICE,
    FRACTION,
    INDEX,
    MISSING_OK,
    NAME,
    POSITIVE_SECONDS,
    RANK,
    SECONDS,
    TAG,
    Rule,
    checked,
    missing_allowed,
    one_of,
)
from chaosgpu.gpu import devices, injector, launch, monitor
from chaosgpu.gpu.contention import TARGETS
from chaosgpu.gpu.xid import KINDS
from chaosgpu.sandbox.probes import SANDBOX_NAME
from chaosgpu.workloads.actions import WORKLOAD_TAG

__all__ = [
    "start_memory_pressure",
    "start_compute_contention",
    "stop_gpu_fault",
    "stop_all_gpu_faults",
    "inject_rank_fault",
    "release_rank_fault",
    "inject_cuda_fault",
    "trigger_xid",
]

logger = logging.getLogger("chaostoolkit")

BACKENDS = ("driver", "host")
RELEASE_POLL_S = 0.01
#: the choices and numbers the faults check before starting anything (chaosgpu.arguments:
#: `chaosgpu validate` and the control's pre-run check run them too)
BACKEND = one_of(BACKENDS)
TARGET = one_of(TARGETS)
MODE = one_of(injector.MODES)
EXCEPTION = one_of(injector.EXCEPTIONS)
CUDA_FAULT = one_of(injector.CUDA_FAULTS)
XID_KIND = one_of(KINDS)
CHUNK_MIB = Rule.by_check("an integer >= 2 (MiB)", lambda value: devices.check_number(
    "chunk_mib", value, minimum=2, integer=True))
FAULT_COUNT = Rule.by_check("an integer from 1 to 1000000", lambda value: devices.check_number(
    "count", value, minimum=1, maximum=1_000_000, integer=True))


def _mark(name: str, **extra: Any) -> None:
    """Record the fault (chaosgpu.faultlog: the observed verdicts and the timeline read it)."""
    from chaosgpu import faultlog

    faultlog.record(name, **extra)


@checked(duration_s=POSITIVE_SECONDS, timeout_s=POSITIVE_SECONDS, device=DEVICE, backend=BACKEND,
         chunk_mib=CHUNK_MIB, sandbox=SANDBOX_NAME, tag=WORKLOAD_TAG)
def start_memory_pressure(device: Union[int, str] = 0, mib: Optional[int] = None,
                          leave_mib: Optional[int] = None, duration_s: Optional[float] = None,
                          backend: str = "driver", chunk_mib: int = 1024,
                          sandbox: Optional[str] = None, tag: Optional[str] = None,
                          timeout_s: float = 120.0,
                          configuration: Optional[Dict[str, Any]] = None,
                          secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Take GPU memory from outside any job: `mib` MiB, or all of the device's free memory but
    `leave_mib` MiB, on GPU `device` (NVML index or UUID), held by a chaosgpu process until
    `duration_s` has passed (None: until stop_gpu_fault / rollback). With `sandbox` the holder
    runs inside that local pod. Waits up to `timeout_s` until the memory is held; returns the
    tag, PID, MiB held and the device's free MiB after. backend="host" holds host memory
    instead (machines without a GPU)."""
    if backend == "host":  # host memory: no GPU is asked (a machine without one runs it too)
        if mib is None or leave_mib is not None:
            raise ValueError("backend 'host' needs mib, not leave_mib (there is no device to "
                             "leave memory on)")
        devices.check_number("mib", mib, minimum=1, integer=True)
        entry = devices.host_backend_device(device)
        request = {"mib": mib, "leave_mib": None, "total_mib": entry.get("memory_total_mib"),
                   "free_mib": None}
    else:
        entry = devices.resolve_device(device)
        request = devices.check_mib(entry, mib, leave_mib)
    tag = launch.check_tag(tag, "pressure")
    args = ["--backend", backend, "--chunk-mib", str(chunk_mib),
            "--duration-s", str(duration_s or 0)]
    args += ["--mib", str(mib)] if mib is not None else ["--leave-mib", str(leave_mib)]
    if entry.get("uuid"):
        args += ["--uuid", str(entry["uuid"])]
    config = {"device": entry.get("index"), "uuid": entry.get("uuid"), "backend": backend,
              **request, "duration_s": duration_s}
    started = launch.start("memory-pressure", tag, "pressure", args, config, timeout_s, sandbox)
    ready = started["ready"]
    pid = started["record"]["processes"][0]["pid"]
    _mark("memory-pressure", tag=tag, pid=pid, held_mib=ready.get("held_mib"),
          device=entry.get("index"))
    logger.info("chaosgpu: holding %s MiB of %s (tag %s)", ready.get("held_mib"),
                "host memory" if backend == "host" else f"GPU {entry.get('index')}", tag)
    return {"tag": tag, "kind": "memory-pressure", "pid": pid, "device": entry.get("index"),
            "uuid": entry.get("uuid"), "backend": backend, "held_mib": ready.get("held_mib"),
            "free_mib_after": ready.get("free_mib_after"),
            "free_mib_before": ready.get("free_mib_before"), "total_mib": request["total_mib"],
            "duration_s": duration_s, "ready": ready}


@checked(duration_s=POSITIVE_SECONDS, period_s=POSITIVE_SECONDS, timeout_s=POSITIVE_SECONDS,
         device=DEVICE, duty_cycle=FRACTION, target=TARGET, backend=BACKEND, tag=WORKLOAD_TAG)
def start_compute_contention(device: Union[int, str] = 0, duration_s: float = 30.0,
                             duty_cycle: float = 1.0, target: str = "sm",
                             period_s: float = 0.1, backend: str = "driver",
                             tag: Optional[str] = None, timeout_s: float = 60.0,
                             configuration: Optional[Dict[str, Any]] = None,
                             secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Keep GPU `device` (NVML index or UUID) busy for `duration_s` seconds from outside any job:
    `target` "sm" (every multiprocessor runs FMA kernels), "memory" (device-to-device copies:
    HBM bandwidth) or "both", for `duty_cycle` (0 < d <= 1) of every `period_s`. Jobs sharing
    the device slow down; measure them with chaosgpu.gpu.probes.job_progress. Waits up to
    `timeout_s` until the work runs; stop it early with stop_gpu_fault. backend="host" spins a
    CPU core instead (machines without a GPU)."""
    if period_s > duration_s:
        raise ValueError(f"period_s ({period_s:g}) must not exceed duration_s ({duration_s:g})")
    entry = (devices.host_backend_device(device) if backend == "host"
             else devices.resolve_device(device))
    tag = launch.check_tag(tag, "contention")
    args = ["--backend", backend, "--target", target, "--duty-cycle", str(duty_cycle),
            "--period-s", str(period_s), "--duration-s", str(duration_s)]
    if entry.get("uuid"):
        args += ["--uuid", str(entry["uuid"])]
    config = {"device": entry.get("index"), "uuid": entry.get("uuid"), "backend": backend,
              "target": target, "duty_cycle": duty_cycle, "period_s": period_s,
              "duration_s": duration_s}
    started = launch.start("compute-contention", tag, "contention", args, config, timeout_s)
    pid = started["record"]["processes"][0]["pid"]
    _mark("compute-contention", tag=tag, pid=pid, device=entry.get("index"),
          duty_cycle=duty_cycle, target=target)
    return {"tag": tag, "kind": "compute-contention", "pid": pid, "device": entry.get("index"),
            "uuid": entry.get("uuid"), **config, "ready": started["ready"]}


def _gpu_pids_left(pids: list[int]) -> list[int]:
    from chaosgpu.node import nvml_gpu_processes

    listed = {p["pid"] for p in nvml_gpu_processes()}
    return [pid for pid in pids if pid in listed]


@checked(tag=TAG, grace_s=SECONDS, deadline_s=POSITIVE_SECONDS, missing_ok=MISSING_OK)
def stop_gpu_fault(tag: str, grace_s: float = 2.0, deadline_s: float = 10.0,
                   missing_ok: Union[bool, str] = "before-method",
                   configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Stop the GPU fault program of `tag` (memory pressure, contention; a rollback): SIGTERM
    (it frees and exits at once), SIGKILL after `grace_s`, then wait up to `deadline_s` until
    NVML no longer lists it on any GPU (its memory is back). Idempotent: a tag with no record
    returns {"stopped": false} where `missing_ok` allows it, as stop_workload's (a tag this run
    met, or any before the method starts); a tag this run never met fails (a typo'd rollback
    would leave the fault running). Returns what happened to each process, the program's
    result (contention: achieved duty cycle) and how long the GPU took to drop it."""
    from chaosgpu.workloads.actions import no_workload, stop_workload

    missing_allowed(missing_ok, True)  # a bad value is refused before anything is touched
    record = state.read_record("workloads", tag)
    if record is None:
        return no_workload(tag, missing_ok)
    if record.get("kind") not in launch.FAULT_KINDS:
        raise ValueError(f"tag {tag!r} is a {record.get('kind')!r} workload, not a GPU fault: "
                         "stop it with stop_workload")
    from chaosgpu.node import nvml_snapshot
    from chaosgpu.workloads.readiness import read_ready

    pids = [int(p["pid"]) for p in record.get("processes", [])]
    started = time.monotonic()
    stopped = stop_workload(tag, grace_s=grace_s, deadline_s=deadline_s)
    result_file = launch.result_file(tag)
    result = read_ready(result_file)
    result_file.unlink(missing_ok=True)
    left: list[int] | None = None
    if nvml_snapshot(with_processes=False).get("available"):
        left = _gpu_pids_left(pids)
        while left and time.monotonic() - started <= deadline_s:
            time.sleep(RELEASE_POLL_S)
            left = _gpu_pids_left(pids)
    out = dict(stopped, kind=record.get("kind"), result=(result or {}).get("result"),
               gpu_released=None if left is None else not left,
               still_on_gpu=left or [], took_s=round(time.monotonic() - started, 3))
    if left is None:
        out["note"] = "NVML not available here: GPU release not checked"
    return out


@checked(grace_s=SECONDS, deadline_s=POSITIVE_SECONDS)
def stop_all_gpu_faults(grace_s: float = 0.0, deadline_s: float = 10.0,
                        configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Stop every recorded GPU fault program (a rollback of last resort), as stop_gpu_fault."""
    return [stop_gpu_fault(tag, grace_s=grace_s, deadline_s=deadline_s, missing_ok=True)
            for tag, record in state.list_records("workloads").items()
            if record.get("kind") in launch.FAULT_KINDS]


def _rank_process(job: str | None, tag: str | None, rank: Union[int, str, None],
                  deadline_s: float = 3.0) -> dict[str, Any]:
    """The census record of the target process, with its `job` id and `rank` number: rank
    `rank` (a number, or "any") of the job named by id or tag, found the way every rank fault
    finds it (chaosgpu.job.actions.rank_process), or, with rank None, the one armed process
    carrying `tag`. Waits up to `deadline_s` for it to appear."""
    from chaosgpu.job.observe import check_selector

    if rank is not None:
        from chaosgpu.job.actions import rank_process

        _, found, proc, number = rank_process(job, tag, rank, deadline_s)
        return dict(proc, job=found["id"], rank=number)
    if tag is None or job is not None:
        raise ValueError("name the target: job=<id> or tag=<tag> with rank=<R>, or tag=<tag> "
                         "alone for the single process carrying it")
    check_selector(job, tag)
    from chaosgpu.node import take_census

    end = time.monotonic() + deadline_s
    while True:
        census = take_census(gpu=False, fds=False)
        tagged = [p for p in census["processes"] if p.get("tag") == tag and not p["zombie"]
                  and not p.get("exiting") and (p.get("env") or {}).get("CHAOSGPU_INJECT_DIR")]
        if len(tagged) == 1:
            return dict(tagged[0], job=None, rank=None)
        if len(tagged) > 1:
            raise ValueError(f"{len(tagged)} armed processes carry tag {tag!r} "
                             f"({[p['pid'] for p in tagged]}): name a rank")
        if time.monotonic() >= end:
            raise ValueError(f"tag {tag!r} has no live armed process")
        time.sleep(0.05)


@checked(duration_s=POSITIVE_SECONDS, timeout_s=POSITIVE_SECONDS, mode=MODE, rank=RANK, tag=TAG,
         job=NAME, device=INDEX, exception=EXCEPTION)
def inject_rank_fault(mode: str, rank: Union[int, str, None] = 0, tag: Optional[str] = None,
                      job: Optional[str] = None, duration_s: Optional[float] = None,
                      device: Optional[int] = None, exception: Optional[str] = None,
                      timeout_s: float = 5.0,
                      configuration: Optional[Dict[str, Any]] = None,
                      secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Fire an in-process fault in one rank of a Python job started armed (chaosgpu's injector
    on PYTHONPATH, e.g. start_ring(inject="python")): `mode` "gpu-hang" (a kernel that never
    ends, or lasts `duration_s`, blocks the rank's GPU stream; the process stays alive),
    "hold-gil" (every Python thread stops), "raise" (`exception` RuntimeError,
    OutOfMemoryError or KeyboardInterrupt in the main thread), "segfault", or "oom" (the rank's
    next CUDA allocations fail). The rank is named by job id or tag and `rank`: a number,
    "any" (the last live rank, as kill_rank picks it; the result names the rank and PID hit),
    or null with a tag alone for the one armed process carrying it. Waits up to
    `timeout_s` for the rank's acknowledgement: a fault not acknowledged is an error, never
    reported as done. `device`: the CUDA ordinal when the rank uses several GPUs."""
    if exception is not None and mode != "raise":
        raise ValueError(f"exception applies to mode 'raise' and is one of "
                         f"{', '.join(injector.EXCEPTIONS)}, got {exception!r} for mode "
                         f"{mode!r}")
    process = _rank_process(job, tag, rank)
    ack = injector.trigger(process, mode, duration_s=duration_s, device=device,
                           exception=exception, timeout_s=timeout_s)
    _mark(mode, job=process.get("job"), rank=process["rank"], pid=process["pid"],
          starttime=process.get("starttime"))
    logger.info("chaosgpu: %s injected in rank %s (PID %d)", mode, process["rank"],
                process["pid"])
    return {"job": process.get("job"), "rank": process["rank"], "pid": process["pid"],
            "mode": mode,
            "delivered": True, "ack_after_s": ack.get("ack_after_s"), "ack": ack}


@checked(timeout_s=POSITIVE_SECONDS, rank=RANK, tag=TAG, job=NAME)
def release_rank_fault(rank: Union[int, str, None] = 0, tag: Optional[str] = None,
                       job: Optional[str] = None, timeout_s: float = 5.0,
                       configuration: Optional[Dict[str, Any]] = None,
                       secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """End a gpu-hang or an oom fault in one rank early (the rank's kernel returns, its
    allocations work again); returns what the rank's injector released. `rank` as for
    inject_rank_fault ("any": the last live rank, which is the one a fault with "any" hit
    while the job's ranks stay as they were)."""
    process = _rank_process(job, tag, rank)
    answer = injector.release(process, timeout_s=timeout_s)
    _mark("release", job=process.get("job"), rank=process["rank"], pid=process["pid"])
    return {"job": process.get("job"), "rank": process["rank"], "pid": process["pid"], **answer}


@checked(timeout_s=POSITIVE_SECONDS, fault=CUDA_FAULT, count=FAULT_COUNT, rank=RANK, tag=TAG,
         job=NAME)
def inject_cuda_fault(fault: str = "alloc", count: int = 1, rank: Union[int, str, None] = 0,
                      tag: Optional[str] = None, job: Optional[str] = None,
                      timeout_s: float = 5.0,
                      configuration: Optional[Dict[str, Any]] = None,
                      secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Make the next `count` CUDA allocations (fault="alloc") or kernel launches ("launch") of a
    CUDA program fail, through chaosgpu's CUDA injection library (CUDA_INJECTION64_PATH, loaded
    by libcuda at cuInit: any CUDA program, e.g. start_ring(inject="cuda")). The target is rank
    `rank` (a number or "any") of a job (by id or tag), or with rank null the one armed
    process carrying `tag`.
    Waits up to `timeout_s` for the library's acknowledgement."""
    process = _rank_process(job, tag, rank)
    ack = injector.trigger_cuda(process, fault, count=count, timeout_s=timeout_s)
    _mark(f"cuda-{fault}", job=process.get("job"), rank=process["rank"], pid=process["pid"],
          starttime=process.get("starttime"), count=count)
    return {"job": process.get("job"), "rank": process["rank"], "pid": process["pid"],
            "fault": fault,
            "count": count, "delivered": True, "ack": ack}


@checked(watch_s=SECONDS, timeout_s=POSITIVE_SECONDS, device=DEVICE, kind=XID_KIND, check=BOOL)
def trigger_xid(device: Union[int, str] = 0, kind: str = "illegal-address",
                watch_s: float = 10.0, check: bool = True, timeout_s: float = 60.0,
                configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Make GPU `device` (NVML index or UUID) raise a genuine exception in a short-lived chaosgpu
    process: kind "illegal-address" (a store to an unmapped address: an MMU fault) or "trap".
    Watches NVML's XID events on that device from before the fault, for up to `watch_s` after
    it, and with `check` then proves the device still allocates and runs kernels in a fresh
    process. Returns the CUDA error the process saw, the XIDs NVML delivered (an empty list
    means NVML delivered none here, which the result says), and whether the device is usable."""
    import json

    from chaosgpu.gpu import nvml

    entry = devices.resolve_device(device)
    uuid = ["--uuid", str(entry["uuid"])] if entry.get("uuid") else []
    watch = None
    watch_note = None
    try:
        watch = nvml.XidWatch([int(entry["index"])])
        if not watch.registered:
            watch_note = f"NVML refused XID event registration: {watch.unsupported}"
    except Exception as error:
        watch_note = f"NVML XID events unavailable: {error}"
    try:
        fault_at = time.time()
        run = launch.run_to_end("xid", launch.check_tag(None, "xid"), "xid",
                                ["--kind", kind, *uuid], {"device": entry.get("index"),
                                                          "kind": kind}, timeout_s)
        try:
            program = json.loads(run["stdout"] or "{}")
        except json.JSONDecodeError:
            program = {"error": f"unreadable output: {run['stdout'][-300:]}"}
        if run["rc"] == 3 or (program.get("error") or "").startswith("no usable GPU"):
            raise RuntimeError(f"the XID program found no usable GPU: {program.get('error')} "
                               f"{run['log']}")
        _mark("xid", device=entry.get("index"), xid_kind=kind, error=program.get("error"))
        seen = watch.wait(watch_s, after=fault_at) if watch and watch.registered else []
        xids = monitor.describe_xids(seen, after=fault_at)
    finally:
        if watch is not None:
            watch.stop()
    usable = None
    checked = None
    if check:
        checked_run = launch.run_to_end("xid", launch.check_tag(None, "xid-check"), "xid",
                                        ["--check", *uuid], {"device": entry.get("index"),
                                                             "check": True}, timeout_s)
        try:
            checked = json.loads(checked_run["stdout"] or "{}")
        except json.JSONDecodeError:
            checked = {"error": checked_run["stdout"][-300:]}
        usable = bool(checked.get("usable"))
    return {"device": entry.get("index"), "uuid": entry.get("uuid"), "kind": kind,
            "cuda_error": program.get("error"), "seen_expected_error": program.get(
                "seen_expected"), "program": program, "xids": xids,
            "xid_seen": bool(xids), "xid_watch": watch_note or "registered",
            "device_usable": usable, "check": checked}
