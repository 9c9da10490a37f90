"""The field report's variants 1-4 on a real GPU (marked `gpu`; skipped without NVML).

Variant 1: torch worker, root. Variant 2: CUDA driver API through ctypes (no torch), root.
Variant 3: torch worker as an unprivileged UID. Variant 4: 10 torch workers as that UID.
Each: a local pod with `sleep` as PID 1, workers exec'd and backgrounded (orphans of PID 1),
2048 MiB configured per worker (the report's workers showed 2466 / 2356 / 2466 / 24702 MiB in
nvidia-smi, context included). Step 2: memory held, seen by NVML under the workers' host PIDs.
Step 3: kill -9, time until NVML shows the memory back, workers left as zombies. Step 3-B (with
fresh workers): termination with a short grace, GB x s held during it, release after SIGKILL.
Results are printed and written as JSON to $CHAOSGPU_GPU_RESULTS (default: a temp file).
"""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.sandbox import runtime
from chaosgpu.workloads import actions

pytestmark = pytest.mark.gpu

MIB_PER_WORKER = 2048
GRACE_S = 2.0
REPORT_MIB = {1: 2466, 2: 2356, 3: 2466, 4: 24702}
RESULTS: dict[str, Any] = {}


def _nvml() -> Any:
    import pynvml

    pynvml.nvmlInit()
    return pynvml


def _used_mib(nvml: Any, index: int = 0) -> float:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    return float(nvml.nvmlDeviceGetMemoryInfo(handle).used) / (1024 * 1024)


def _gpu_pids(nvml: Any, index: int = 0) -> dict[int, float | None]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    found = {}
    for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
        used = process.usedGpuMemory
        found[int(process.pid)] = None if used is None else used / (1024 * 1024)
    return found


def _wait_used_below(nvml: Any, limit: float, timeout_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if _used_mib(nvml) <= limit:
            return time.monotonic() - started
        time.sleep(0.002)
    return None


class _Sampler(threading.Thread):
    """Samples device 0's used memory every ~5 ms to integrate GB x s."""

    def __init__(self, nvml: Any, baseline: float) -> None:
        super().__init__(daemon=True)
        self.nvml, self.baseline = nvml, baseline
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), _used_mib(self.nvml)))
            time.sleep(0.005)

    def gb_s(self) -> float:
        total = 0.0
        for (t0, m0), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            total += max(0.0, m0 - self.baseline) / 1024 * (t1 - t0)
        return total


def _test_uid() -> int:
    for name in ("chaosuser",):
        try:
            return pwd.getpwnam(name).pw_uid
        except KeyError:
            pass
    if os.geteuid() != 0:
        pytest.skip("no unprivileged test user and not root")
    subprocess.run(["useradd", "-m", "chaosuser"], check=True)
    return pwd.getpwnam("chaosuser").pw_uid


def _start(pod: str, count: int, via: str, uid: int | None) -> dict[str, Any]:
    runtime.create(pod, init="sleep", uid=uid, grace_s=GRACE_S)
    return actions.start_holders(count=count, mib=MIB_PER_WORKER, via=via, on_sigterm="ignore",
                                 sandbox=pod, timeout_s=90)  # fmt: skip


VARIANTS = [(1, "torch", 1, False), (2, "driver", 1, False), (3, "torch", 1, True),
            (4, "torch", 10, True)]  # fmt: skip


@pytest.mark.parametrize("variant, via, count, non_root", VARIANTS)
def test_report_variant(variant: int, via: str, count: int, non_root: bool) -> None:
    if via == "torch":
        pytest.importorskip("torch")
    nvml = _nvml()
    uid = _test_uid() if non_root else None
    pod = f"gpu-v{variant}-{os.getpid()}"
    result: dict[str, Any] = {"variant": variant, "via": via, "workers": count, "uid": uid,
                              "mib_per_worker": MIB_PER_WORKER,
                              "report_nvidia_smi_mib": REPORT_MIB[variant]}  # fmt: skip
    try:
        baseline = _used_mib(nvml)
        result["baseline_mib"] = baseline
        # Step 2: memory held, attributed to the workers' host PIDs.
        t0 = time.monotonic()
        started = _start(pod, count, via, uid)
        result["start_s"] = round(time.monotonic() - t0, 3)
        seen = _gpu_pids(nvml)
        held = _used_mib(nvml) - baseline
        result["held_mib"] = round(held, 1)
        result["per_process_mib"] = [seen.get(pid) for pid in started["pids"]]
        assert set(started["pids"]) <= set(seen), "NVML lists the workers under their host PIDs"
        assert held >= count * MIB_PER_WORKER
        orphans = [p for p in runtime.processes(pod) if p["ns_ppid"] == 1]
        assert {p["pid"] for p in orphans} == set(started["pids"])
        # Step 3: kill -9; memory comes back, workers stay zombies under sleep.
        for pid in started["pids"]:
            runtime.kill(pid, runtime.process_starttime(pid))
        released = _wait_used_below(nvml, baseline + 64, 30.0)
        result["release_after_sigkill_s"] = None if released is None else round(released, 3)
        assert released is not None and released < (2.0 if count == 1 else 10.0)
        time.sleep(0.2)
        zombies = [p["pid"] for p in runtime.processes(pod) if p["zombie"]]
        result["zombies"] = len(zombies)
        assert set(zombies) == set(started["pids"])
        actions.stop_workload(started["tag"], grace_s=0)
        runtime.remove(pod)
        # Step 3-B: delete the pod with the workers alive; SIGTERM ignored, the grace is waited.
        started = _start(pod, count, via, uid)
        sampler = _Sampler(nvml, baseline)
        sampler.start()
        timings = runtime.terminate(pod)
        after = _wait_used_below(nvml, baseline + 64, 30.0)
        time.sleep(0.05)
        sampler.stop.set()
        sampler.join()
        result["step3b"] = {
            "grace_waited_s": timings["namespace_empty_or_grace_end_s"],
            "gone_after_sigkill_s": timings["gone_after_sigkill_s"],
            "memory_back_after_gone_s": None if after is None else round(after, 3),
            "gb_s_held": round(sampler.gb_s(), 2),
        }
        assert timings["exited_on_sigterm"] is False
        assert timings["namespace_empty_or_grace_end_s"] >= GRACE_S - 0.05
        assert after is not None
        assert _used_mib(nvml) <= baseline + 64
        actions.stop_workload(started["tag"], grace_s=0)
    finally:
        for listed in actions.list_workloads():
            if listed.get("sandbox") == pod:
                actions.stop_workload(listed["tag"], grace_s=0)
        runtime.remove(pod)
        RESULTS[f"variant{variant}"] = result
        print(f"\nvariant {variant}: {json.dumps(result)}")
        _write_results()


def _write_results() -> None:
    path = os.environ.get("CHAOSGPU_GPU_RESULTS") or os.path.join(
        tempfile.gettempdir(), "chaosgpu-gpu-workloads.json"
    )
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(RESULTS, handle, indent=2, sort_keys=True)
    print(f"results: {path}")


def test_hold_cleanup_on_sigterm_frees_gpu_memory_at_once(tmp_path: Any) -> None:
    pytest.importorskip("torch")
    import sys

    nvml = _nvml()
    baseline = _used_mib(nvml)
    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.workloads", "hold", "--via", "torch", "--mib", "1024",
         "--on-sigterm", "cleanup", "--ready-file", str(ready)], env=dict(os.environ),
    )  # fmt: skip
    try:
        from chaosgpu.workloads.readiness import wait_ready

        wait_ready(ready, 90, pid=process.pid)
        assert _used_mib(nvml) - baseline >= 1024
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        released = _wait_used_below(nvml, baseline + 64, 10.0)
        print(f"\nscenario 4 on GPU: exit {time.monotonic() - sent:.3f} s, memory back {released}")
        assert released is not None and released < 2.0
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("count", [1, 10])
def test_remediation_sigterm_handler_under_an_init(count: int) -> None:
    """The report's scenario 4 with GPU memory: the pod's own workers free and exit on SIGTERM
    (forwarded by dumb-init, or the worker is PID 1): no grace period wasted."""
    pytest.importorskip("torch")
    nvml = _nvml()
    baseline = _used_mib(nvml)
    pod = f"gpu-remedy-{count}-{os.getpid()}"
    init = "none" if count == 1 else "dumb-init"
    dumb_init = shutil.which("dumb-init") or str(Path(sys.executable).parent / "dumb-init")
    if init == "dumb-init" and not os.access(dumb_init, os.X_OK):
        pytest.skip("dumb-init is not installed (pip install dumb-init)")
    result: dict[str, Any] = {"workers": count, "init": init}
    try:
        started = actions.start_pod_with_holders(
            pod=pod, init=init, count=count, mib=MIB_PER_WORKER, via="torch",
            on_sigterm="cleanup", grace_s=30, tag=f"remedy-{count}", timeout_s=90,
        )  # fmt: skip
        assert _used_mib(nvml) - baseline >= count * MIB_PER_WORKER
        sampler = _Sampler(nvml, baseline)
        sampler.start()
        timings = runtime.terminate(pod)
        back = _wait_used_below(nvml, baseline + 64, 30.0)
        sampler.stop.set()
        sampler.join()
        result.update(
            total_s=timings["total_s"], exited_on_sigterm=timings["exited_on_sigterm"],
            memory_back_after_gone_s=back, gb_s_held=round(sampler.gb_s(), 2),
        )  # fmt: skip
        assert timings["exited_on_sigterm"] is True and timings["total_s"] < 2.0
        assert back is not None and back < 5.0
        assert started["pids"]
    finally:
        runtime.remove(pod)
        actions.stop_workload(f"remedy-{count}", grace_s=0)
        RESULTS[f"remedy{count}"] = result
        print(f"\nremediation, {count} worker(s): {json.dumps(result)}")
        _write_results()
