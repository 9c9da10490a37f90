"""On a GPU machine with CUDA MPS: a torch worker running as an MPS client is listed by the
census's NVML reading (compute or MPS-compute listing) and attributed to its host PID, and the
MPS server is seen as the GPU process it is. The test starts its own MPS control daemon with
private pipe and log folders, and quits it afterwards (no MPS process of its own is left).
Skipped without NVML, without `nvidia-cuda-mps-control`, or when an MPS daemon already runs
here (it must not touch one it did not start)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from census_helpers import wait_for

from chaosgpu import node

pytestmark = pytest.mark.gpu

WORKER = (
    "import time, torch\n"
    "x = torch.empty(512 * 1024 * 1024, dtype=torch.uint8, device='cuda')\n"
    "x.fill_(1); torch.cuda.synchronize()\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def _mps_processes() -> list[int]:
    """PIDs of every MPS control daemon or server on this node, zombies included (by the
    name the kernel keeps: `nvidia-cuda-mps`, cut to 15 characters)."""
    found = []
    for pid in node.list_pids():
        try:
            name = node.read_stat(pid)["comm"]
        except node.ProcError:
            continue
        if name.startswith("nvidia-cuda-mps"):
            found.append(pid)
    return found


@pytest.fixture
def mps_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An MPS control daemon of this test's own (pipe and log folders under tmp_path)."""
    if not node.nvml_device_memory():
        pytest.skip("needs an NVIDIA GPU with NVML")
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("nvidia-cuda-mps-control is not installed here")
    if _mps_processes():
        pytest.skip("an MPS daemon already runs here: not ours to start or stop")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path / "pipe"),
               CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "log"))
    (tmp_path / "pipe").mkdir()
    (tmp_path / "log").mkdir()
    # in the foreground, as this test's child: it is waited for here (a daemonised one would
    # be left to this node's init to reap); it starts the server and reaps it
    with open(tmp_path / "control.log", "wb") as log:
        daemon = subprocess.Popen([control, "-f"], env=env, stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: any((tmp_path / "pipe").iterdir()) or daemon.poll() is not None,
                 timeout=30, what="the MPS control daemon's pipe")
        assert daemon.poll() is None, (tmp_path / "control.log").read_text(errors="replace")
        yield env
    finally:
        subprocess.run([control], input="quit\n", text=True, env=env, timeout=60, check=False)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait()
        wait_for(lambda: not _mps_processes(), timeout=30,
                 what="the MPS daemon and server to be gone")


def test_an_mps_client_is_listed_and_attributed(mps_env: dict[str, str]) -> None:
    worker = subprocess.Popen([sys.executable, "-c", WORKER], env=mps_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline().strip()
        if line != "ready":
            worker.kill()
            _, err = worker.communicate(timeout=30)
            pytest.fail(f"the MPS client did not start: {err[-2000:]}")
        listed = wait_for(lambda: [p for p in node.nvml_gpu_processes()
                                   if p["pid"] == worker.pid],
                          timeout=20, what="NVML to list the MPS client")
        census = node.take_census()
        [entry] = [g for g in census["gpu_processes"] if g["host_pid"] == worker.pid]
        assert entry["visible"] and entry["pid"] == worker.pid
        servers = [g for g in census["gpu_processes"]
                   if (g.get("comm") or "").startswith("nvidia-cuda-mps")]
        evidence = os.environ.get("CHAOSGPU_GPU_EVIDENCE")
        if evidence:
            Path(evidence).mkdir(parents=True, exist_ok=True)
            (Path(evidence) / "mps-client.json").write_text(json.dumps(
                {"nvml_listing_of_the_client": listed, "census_entry": entry,
                 "mps_servers_in_census": servers,
                 "gpu_section": census["gpu"]}, indent=1, default=str), encoding="utf-8")
        assert servers, census["gpu_processes"]  # the MPS server holds the context
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(p["pid"] == worker.pid for p in node.nvml_gpu_processes()) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(p["pid"] == worker.pid for p in node.nvml_gpu_processes())
