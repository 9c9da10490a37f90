"""Record a real NVML snapshot on a GPU machine, with a torch worker holding memory inside a PID
namespace, for the CPU test-suite (tests/data/). Run on a machine with a GPU, as root:

    python3 bench/gpu/record_nvml.py OUTPUT.json [--mib 2048]

The file holds what NVML reported (devices, compute processes with host PIDs and memory) and,
for every reported PID, the NSpid line of /proc/PID/status, so tests can check the host <->
namespace translation against what a real driver said.
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time

WORKER = (
    "import torch, sys, time\n"
    "x = torch.empty(int(sys.argv[1]) * 1024 * 1024, dtype=torch.uint8, device='cuda')\n"
    "x.fill_(1); torch.cuda.synchronize(); print('ready', flush=True)\n"
    "time.sleep(600)\n"
)


def nvml_view(pynvml):  # type: ignore[no-untyped-def]
    devices = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        processes = []
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used = proc.usedGpuMemory
            processes.append({"pid": proc.pid, "used_mib": None if used is None else used / 2**20})
        name = pynvml.nvmlDeviceGetName(handle)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        devices.append({
            "index": index,
            "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_used_mib": memory.used / 2**20,
            "memory_total_mib": memory.total / 2**20,
            "processes": processes,
        })
    driver = pynvml.nvmlSystemGetDriverVersion()
    return {"available": True, "reason": None,
            "driver": driver.decode() if isinstance(driver, bytes) else driver, "devices": devices}


def nspid(pid: int) -> list[int] | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        return None
    return None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--mib", type=int, default=2048)
    args = parser.parse_args()
    import pynvml

    pynvml.nvmlInit()
    idle = nvml_view(pynvml)
    pod = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", WORKER, str(args.mib)],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert pod.stdout is not None
        line = pod.stdout.readline()
        if "ready" not in line:
            print("worker did not become ready", file=sys.stderr)
            return 1
        time.sleep(0.2)
        held = nvml_view(pynvml)
        pids = {p["pid"] for d in held["devices"] for p in d["processes"]}
        record = {
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": platform.node(), "kernel": platform.release(),
            "worker_mib": args.mib, "unshare_pid": pod.pid,
            "idle": idle, "held": held, "nspid": {str(p): nspid(p) for p in pids},
        }
    finally:
        os.killpg(pod.pid, signal.SIGKILL)
        pod.wait()
    with open(args.output, "w") as handle:
        json.dump(record, handle, indent=2)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
