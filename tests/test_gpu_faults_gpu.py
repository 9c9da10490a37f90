"""GPU faults on a real GPU (marked `gpu`: skipped cleanly without NVML).

The real NVML layer (utilisation, XID event registration), memory pressure through the driver
(N MiB, all but N MiB), memory-bandwidth contention with a duty cycle, a `trap` XID, the Python
injector's GPU modes inside real ranks (gpu-hang released early and with a duration; oom), and
the CUDA injection library (failed allocations with both strategies, a failed launch). Every test
ends with no process left (the autouse fixture) and the GPU's memory back at its baseline.
With CHAOSGPU_RECORD_DIR set, the readings are written there (they become tests/data
recordings for the CPU tests).
"""

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.gpu import actions, nvml, probes
from chaosgpu.node import nvml_device_memory, nvml_gpu_processes
from chaosgpu.workloads.actions import start_ring, stop_workload

pytestmark = pytest.mark.gpu


def _record(name: str, data: Any) -> None:
    folder = os.environ.get("CHAOSGPU_RECORD_DIR")
    if folder:
        Path(folder, name).write_text(json.dumps(data, indent=1, default=str))
    print(f"\n{name}: {json.dumps(data, default=str)[:1500]}")


def _used() -> float:
    return float(nvml_device_memory()[0]["used_mib"])


@pytest.fixture
def gpu_baseline() -> Any:
    """The device's used MiB before the test; afterwards it must come back (64 MiB tolerance)."""
    before = _used()
    yield before
    deadline = time.monotonic() + 20
    while _used() > before + 64 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used() <= before + 64, f"GPU memory left: {_used()} MiB vs {before} before"


def _wait_progress(tag: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if probes.job_progress(tag, window_s=0.5)["progressing"]:
            return
    pytest.fail(f"ring {tag} does not progress")


def test_nvml_layer_reads_utilization_samples_and_xid_registration(gpu_baseline: float) -> None:
    reading = nvml.utilization(0)
    samples = nvml.utilization_samples(0)
    watch = nvml.XidWatch([0])
    try:
        time.sleep(0.3)
    finally:
        watch.stop()
    assert 0 <= reading["gpu_pct"] <= 100 and 0 <= reading["memory_pct"] <= 100
    assert watch.registered == [0] or watch.unsupported, (watch.registered, watch.unsupported)
    # the census's own NVML calls read what pynvml reads: the driver's samples it still keeps
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        since = samples[0][0] - 1 if samples else 0
        ours = {stamp: value for stamp, value in nvml.utilization_samples(0, since_us=since)}
        try:
            _, raw = pynvml.nvmlDeviceGetSamples(handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES,
                                                 since)
        except pynvml.NVMLError_NotFound:
            raw = []
        theirs = {int(s.timeStamp): int(s.sampleValue.uiVal) for s in raw}
    finally:
        pynvml.nvmlShutdown()
    both = set(ours) & set(theirs)
    assert both or not (ours or theirs), (ours, theirs)
    assert {stamp: ours[stamp] for stamp in both} == {stamp: theirs[stamp] for stamp in both}
    _record("nvml_h200_xid_registration.json",
            {"reading": reading, "samples": samples[-20:], "registered": watch.registered,
             "unsupported": watch.unsupported, "error": watch.error})
    with pytest.raises(ValueError, match="out of range"):
        actions.start_memory_pressure(device=len(nvml_device_memory()), mib=64)
    total = int(nvml_device_memory()[0]["total_mib"])
    with pytest.raises(ValueError, match="more than GPU 0"):
        actions.start_memory_pressure(mib=total + 1)


def test_memory_pressure_mib_and_all_but_n_through_the_driver(gpu_baseline: float) -> None:
    taken = actions.start_memory_pressure(mib=4096, tag="press-gpu-a")
    listed = {p["pid"]: p["used_mib"] for p in nvml_gpu_processes()}
    assert listed.get(taken["pid"], 0) >= 4096, listed
    stop_a = actions.stop_gpu_fault("press-gpu-a", grace_s=5)
    assert stop_a["gpu_released"] is True
    full = actions.start_memory_pressure(leave_mib=2048, tag="press-gpu-b")
    used_now = _used()
    total = nvml_device_memory()[0]["total_mib"]
    stop_b = actions.stop_gpu_fault("press-gpu-b", grace_s=5)
    _record("gpu_pressure.json", {"mib_4096": taken, "stop_a": stop_a, "all_but_2048": full,
                                  "nvml_used_while_held": used_now, "total_mib": total,
                                  "stop_b": stop_b})
    assert full["free_mib_after"] <= 2048 + 64, full
    assert total - used_now <= 2048 + 128
    assert stop_b["gpu_released"] is True and stop_b["took_s"] < 10


def test_memory_bandwidth_contention_with_a_duty_cycle(gpu_baseline: float) -> None:
    out = actions.start_compute_contention(duration_s=6.0, duty_cycle=0.5, period_s=0.2,
                                           target="memory", tag="cont-gpu-mem")
    utilization = probes.gpu_utilization(0, window_s=3.0, interval_s=0.05)
    time.sleep(3.5)
    stopped = actions.stop_gpu_fault("cont-gpu-mem")
    _record("nvml_h200_utilization_memory_contention.json",
            {"ready": out["ready"], "utilization": utilization, "stop": stopped})
    result = stopped["result"]
    assert 0.35 <= result["achieved_duty_cycle"] <= 0.7, result
    # HBM bandwidth while busy, counted by the program (bytes read + written per copy); NVML's
    # memory utilisation is recorded for what it says, it is not a bandwidth measure
    assert result["copy_gb_per_s"] > 1000, result
    assert utilization["available"] is True


def test_trap_xid_and_the_device_stays_usable(gpu_baseline: float) -> None:
    out = actions.trigger_xid(kind="trap", watch_s=5.0)
    _record("gpu_xid_trap.json", out)
    assert out["seen_expected_error"] is True and out["device_usable"] is True, out
    assert probes.gpu_usable(0) is True


def test_gpu_hang_stalls_a_rank_release_and_duration(gpu_baseline: float) -> None:
    tag = "hang-gpu"
    start_ring(world_size=2, backend="gloo", matmul=1024, iters_per_s=50, inject="python",
               tag=tag, timeout_s=180)
    try:
        _wait_progress(tag)
        fault = actions.inject_rank_fault(mode="gpu-hang", tag=tag, rank=1, timeout_s=10)
        stalled = probes.job_progress(tag, window_s=2.0)
        busy = probes.gpu_utilization(0, window_s=1.0, interval_s=0.05)
        hang = __import__("chaosgpu.job.probes", fromlist=["detect_hang"]).detect_hang(
            tag=tag, timeout_s=30.0)
        released = actions.release_rank_fault(rank=1, tag=tag)
        after_release = probes.job_progress(tag, window_s=2.0)
        timed = actions.inject_rank_fault(mode="gpu-hang", tag=tag, rank=0, duration_s=3.0)
        during = probes.job_progress(tag, window_s=1.5)
        time.sleep(2.5)
        after_duration = probes.job_progress(tag, window_s=2.0)
        _record("gpu_hang.json", {"fault": fault, "stalled": stalled, "utilization": busy,
                                  "detect_hang": hang, "released": released,
                                  "after_release": after_release, "timed": timed,
                                  "during_timed": during, "after_duration": after_duration})
        assert sorted(stalled["stalled_ranks"]) == [0, 1], stalled
        # observed, not inferred: rank 0 waits in the collective, rank 1 on its stalled GPU
        assert hang["verdict"] == "hung", hang["reason"]
        assert [c["rank"] for c in hang["culprit_ranks"]] == [1], hang["culprit_ranks"]
        assert busy["gpu_pct"]["min"] >= 90, busy
        assert after_release["progressing"] is True, after_release
        assert during["stalled_ranks"], during
        assert after_duration["progressing"] is True, after_duration
    finally:
        stop_workload(tag, grace_s=1)


def test_oom_mode_fails_torch_allocations_for_a_while(gpu_baseline: float) -> None:
    tag = "oom-gpu"
    start_ring(world_size=1, backend="gloo", step_mib=256, on_oom="skip", iters_per_s=20,
               inject="python", tag=tag, timeout_s=180)
    try:
        _wait_progress(tag)
        fault = actions.inject_rank_fault(mode="oom", tag=tag, rank=0, duration_s=3.0)
        during = probes.job_progress(tag, window_s=2.0)
        time.sleep(2.0)
        after = probes.job_progress(tag, window_s=1.5)
        later = probes.job_progress(tag, window_s=1.5)
        seen = probes.cuda_oom_seen(tag)
        _record("gpu_oom_mode.json", {"fault": fault, "during": during, "after": after,
                                      "later": later, "seen": seen})
        assert (during["ranks"]["0"]["ooms"] or 0) >= 5, during
        # released after its duration: the ring steps again without new OOMs
        assert later["ranks"]["0"]["ooms"] == after["ranks"]["0"]["ooms"], (after, later)
        assert later["progressing"] is True
        assert seen["seen"] is True and seen["torch_observer"], seen
    finally:
        stop_workload(tag, grace_s=1)


def test_cuda_library_fails_the_next_allocations(gpu_baseline: float) -> None:
    tag = "cuda-alloc"
    start_ring(world_size=1, backend="gloo", step_mib=64, on_oom="skip", iters_per_s=20,
               inject="cuda", tag=tag, timeout_s=180)
    try:
        _wait_progress(tag)
        pid = probes.job_progress(tag, window_s=0.2)["ranks"]
        before = {p["pid"]: p["used_mib"] for p in nvml_gpu_processes()}
        fault = actions.inject_cuda_fault(fault="alloc", count=3, tag=tag, rank=0)
        time.sleep(2.0)
        progress = probes.job_progress(tag, window_s=1.0)
        seen = probes.cuda_oom_seen(tag)
        after = {p["pid"]: p["used_mib"] for p in nvml_gpu_processes()}
        _record("gpu_cuda_alloc.json", {"fault": fault, "progress": progress, "seen": seen,
                                        "nvml_mib_before": before, "nvml_mib_after": after,
                                        "ranks": pid})
        assert len(seen["cuda_injector"]) == 3, seen
        assert (progress["ranks"]["0"]["ooms"] or 0) >= 1, progress
        # what the driver gave to the failed calls was freed: the rank holds no more than before
        rank_pid = fault["pid"]
        assert after.get(rank_pid, 0) <= before.get(rank_pid, 0) + 64, (before, after)
    finally:
        stop_workload(tag, grace_s=1)


def test_cuda_library_fails_a_launch(gpu_baseline: float) -> None:
    tag = "cuda-launch"
    start_ring(world_size=1, backend="gloo", matmul=256, iters_per_s=20, inject="cuda", tag=tag,
               timeout_s=180)
    try:
        _wait_progress(tag)
        from chaosgpu import state

        workdir = Path(state.read_record("workloads", tag)["workdir"])
        fault = actions.inject_cuda_fault(fault="launch", count=1, tag=tag, rank=0)
        deadline = time.monotonic() + 20
        log = ""
        while time.monotonic() < deadline:
            log = "".join(p.read_text(errors="replace") for p in workdir.glob("*.log"))
            if "CUDA error" in log or "cudaError" in log:
                break
            time.sleep(0.1)
        _record("gpu_cuda_launch.json", {"fault": fault, "log": log[-3000:],
                                         "events": probes.cuda_oom_seen(tag)["cuda_injector"]})
        assert "CUDA error" in log or "cudaError" in log, log[-2000:]
    finally:
        stop_workload(tag, grace_s=1)
