"""On a GPU machine: a torch worker holding 2 GiB inside a PID namespace is attributed by the
census to its host PID, its namespace PID and its memory, seen from the host; seen from inside
the namespace it is "not visible here" (NVML gives host PIDs), never an orphan or gone (the
field report's false ORPHANED). Also records a real NVML snapshot for tests/data when
$CHAOSGPU_RECORD_DIR is set. Skipped cleanly without NVML."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from census_helpers import PROGRAM, children, comm, wait_for

from chaosgpu import node

pytestmark = pytest.mark.gpu

WORKER = (
    "import sys, time, torch\n"
    "x = torch.empty(2048 * 1024 * 1024, dtype=torch.uint8, device='cuda')\n"
    "x.fill_(1); torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def namespaced_worker():  # type: ignore[no-untyped-def]
    """A torch worker as PID 1 of its own PID namespace, holding 2 GiB; yields (unshare
    Popen, worker host PID)."""
    runner = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", WORKER],
        env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True)
    worker = -1
    try:
        assert runner.stdout is not None
        assert runner.stdout.readline().strip() == "ready"
        worker = wait_for(lambda: [p for p in children(runner.pid)
                                   if comm(p).startswith(("python", "pt_main"))],
                          what="the worker's host PID")[0]
        wait_for(lambda: any(p["pid"] == worker for p in node.nvml_gpu_processes()),
                 timeout=20, what="NVML to list the worker")
        yield runner, worker
    finally:
        os.killpg(runner.pid, signal.SIGKILL)
        runner.wait(timeout=30)
        # the driver frees a killed process's memory after it is gone: the next test's
        # baseline must not be taken while it still holds 2 GiB
        wait_for(lambda: not any(p["pid"] == worker for p in node.nvml_gpu_processes()),
                 timeout=60, what="NVML to stop listing the killed worker")


def test_namespaced_worker_attributed_from_the_host(namespaced_worker) -> None:  # type: ignore[no-untyped-def]
    _, worker = namespaced_worker
    census = node.take_census()
    assert census["observer"]["host_view"] is True
    [entry] = [g for g in census["gpu_processes"] if g["host_pid"] == worker]
    assert entry["visible"] and entry["pid"] == worker
    assert entry["ns_pid"] == 1  # the worker is PID 1 of its namespace
    assert entry["used_mib"] is not None and entry["used_mib"] >= 2048
    assert entry["note"] is None
    record = next(p for p in census["processes"] if p["pid"] == worker)
    assert record["nspid"] == [worker, 1] and not record["orphan"]
    assert any(path.startswith("/dev/nvidia") for path in record["nvidia_fds"])
    total = census["gpu"]["devices"][0]["memory_total_mib"]
    assert total > 10000


def test_namespaced_worker_from_inside_attributed_not_orphaned(namespaced_worker, tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, worker = namespaced_worker
    result = subprocess.run(["nsenter", "-t", str(worker), "-p", "-m", sys.executable,
                             str(PROGRAM)], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    inside = json.loads(result.stdout)
    print("NVML seen from inside the namespace:", json.dumps(inside["gpu"]))
    print("GPU processes seen from inside:", json.dumps(inside["gpu_processes"]))
    assert inside["observer"]["host_view"] is False
    assert inside["gpu"]["available"] is True
    # driver 580 translates the PID into the caller's namespace (seen: 1, not the host PID);
    # either way the worker must never be reported as orphaned or gone
    [entry] = inside["gpu_processes"]
    procs = {p["pid"]: p for p in inside["processes"]}
    assert procs[1]["ns_init"] and not procs[1]["orphan"]  # the worker itself, PID 1 inside
    assert inside["orphans"] == []
    assert procs[1]["nvidia_fds"]  # it holds the device
    if entry["nvml_pid"] == 1:
        assert entry["visible"] and entry["pid"] == 1 and entry["ns_pid"] == 1
        assert entry["used_mib"] >= 2048 and entry["note"] is None
    else:
        assert entry["nvml_pid"] == worker and entry["visible"] is False
        assert "not visible here" in entry["note"]
    record_dir = os.environ.get("CHAOSGPU_RECORD_DIR")
    if record_dir:
        (Path(record_dir) / "nvml_inside_namespace.json").write_text(json.dumps(
            {"worker_nspid": [worker, 1], "inside": inside["gpu"],
             "gpu_processes": inside["gpu_processes"]}, indent=2))


def test_fast_paths_and_record_a_snapshot(namespaced_worker) -> None:  # type: ignore[no-untyped-def]
    runner, worker = namespaced_worker
    memory = node.nvml_device_memory()
    assert memory and memory[0]["used_mib"] > 2048
    started = time.perf_counter()
    for _ in range(1000):
        node.nvml_device_memory()
    per_call_us = (time.perf_counter() - started) * 1000
    assert per_call_us < 1000, f"nvml_device_memory took {per_call_us:.0f} us"
    processes = node.nvml_gpu_processes()
    assert any(p["pid"] == worker and p["used_mib"] >= 2048 for p in processes)
    record_dir = os.environ.get("CHAOSGPU_RECORD_DIR")
    if record_dir:
        snapshot = node.nvml_snapshot()
        nspid = {str(p["pid"]): (node.read_process(p["pid"]) or {}).get("nspid")
                 for d in snapshot["devices"] for p in d["processes"]}
        path = Path(record_dir) / "nvml_census_recorded.json"
        path.write_text(json.dumps({"recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                 time.gmtime()),
                                    "worker_mib": 2048, "unshare_pid": runner.pid,
                                    "held": snapshot, "nspid": nspid,
                                    "nvml_device_memory_us": per_call_us}, indent=2))


def _text(value: object) -> str:
    """pynvml's text (bytes in older releases, str in newer)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def test_the_census_nvml_calls_agree_with_pynvml(namespaced_worker) -> None:  # type: ignore[no-untyped-def]
    """The census's own ctypes calls into libnvidia-ml (no pynvml) give what pynvml gives:
    driver version, each GPU's UUID, name and memory, and the one-call process listing (raw
    v3 into room sized from the last listing), also when the room is too small at first (no
    room at all: the driver's count is asked again). A census process never imports pynvml."""
    import pynvml

    runner, worker = namespaced_worker
    module = node.census_module()
    module._NVML_ROOM["nvmlDeviceGetComputeRunningProcesses"] = 0
    ours = {(p["gpu_index"], p["pid"], p["used_mib"]) for p in node.nvml_gpu_processes()}
    assert module._NVML_ROOM["nvmlDeviceGetComputeRunningProcesses"] >= 16
    library = module._NVML["module"]
    assert isinstance(library, module._NvmlLibrary)
    assert module._raw_listing(library, "nvmlDeviceGetComputeRunningProcesses") is not None
    section = node.nvml_snapshot()
    pynvml.nvmlInit()
    try:
        assert section["driver"] == _text(pynvml.nvmlSystemGetDriverVersion())
        theirs = set()
        assert len(section["devices"]) == pynvml.nvmlDeviceGetCount()
        for index, device in enumerate(section["devices"]):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            assert device["uuid"] == _text(pynvml.nvmlDeviceGetUUID(handle))
            assert device["name"] == _text(pynvml.nvmlDeviceGetName(handle))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            assert device["memory_total_mib"] == memory.total / 2**20
            assert abs(device["memory_used_mib"] - memory.used / 2**20) < 64
            for entry in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                theirs.add((index, int(entry.pid), entry.usedGpuMemory / 2**20
                            if entry.usedGpuMemory is not None else None))
    finally:
        pynvml.nvmlShutdown()
    assert theirs <= ours and any(pid == worker for _, pid, _ in ours)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import node_census as c; "
            "s = c.nvml_snapshot(); print(json.dumps({'available': s['available'], "
            "'pynvml': 'pynvml' in sys.modules}))")
    result = subprocess.run([sys.executable, "-c", code, str(PROGRAM.parent)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) == {"available": True, "pynvml": False}


def test_a_snapshot_with_forked_readers_reads_nvml_in_a_forked_child(namespaced_worker) -> None:  # type: ignore[no-untyped-def]
    """A one-shot census that forks its /proc readers reads NVML in a forked child too (off
    its GIL): the worker's 2 GiB are in its GPU section and attributed to its host PID."""
    runner, worker = namespaced_worker
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import node_census as c; "
            "pids = c.list_pids(); d = c.census(pids=pids * (1 + 1000 // len(pids)), "
            "workers=2, fds=False); print(json.dumps({'reader': d['observer']['gpu_reader'], "
            "'readers': d['observer']['readers'], 'gpu': d['gpu'], "
            "'attributed': d['gpu_processes']}))")
    result = subprocess.run([sys.executable, "-c", code, str(PROGRAM.parent)],
                            capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(result.stdout)
    assert out["reader"] == "forked" and out["readers"] == 2
    assert out["gpu"]["available"] is True
    listed = [p for d in out["gpu"]["devices"] for p in d["processes"] if p["pid"] == worker]
    assert listed and listed[0]["used_mib"] >= 2048
    assert any(item["pid"] == worker and item["visible"] for item in out["attributed"])
