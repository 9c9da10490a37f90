"""A workload the node has no GPU for is refused at once, before any process starts: backend
"nccl" with fewer GPUs than ranks, a holder `via="torch"` on a GPU that is not there, and a ring
armed with the CUDA injector where no GPU would ever load it. GPUs are counted the one way backend
"auto" counts them (chaosgpu.workloads.cuda_driver.gpu_count), and the tests ask for more GPUs
than the machine has, so they run on a GPU machine too. Each call is watched from the outside:
no child of this test process and no process carrying the workload's tag may appear while it
runs, and it must answer well under a second (it took 2.8 s and 4.2 s, spawning every rank or
worker, before)."""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from proc_helpers import tagged, unique

from chaosgpu import scope, state
from chaosgpu.errors import InvalidArgument
from chaosgpu.sandbox import runtime
from chaosgpu.workloads import actions
from chaosgpu.workloads.cuda_driver import gpu_count

FAST_S = 0.5  # "at once": the refusal counts GPUs and starts nothing


def _children() -> set[int]:
    """This process's live children, read straight from /proc (every thread's list)."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            continue
    return found


class SpawnWatch:
    """While it runs, records every new child of this process (`children`) and every process
    carrying `tag` (`tagged`), polled every few ms: a rank that fails lives for seconds."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.before = _children()
        self.children: set[int] = set()
        self.tagged: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _look(self) -> None:
        self.children |= _children() - self.before
        self.tagged |= set(tagged(self.tag))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            time.sleep(0.002)

    def __enter__(self) -> "SpawnWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._look()


def _refused_at_once(tag: str, call: Callable[[], Any], message: str) -> float:
    """Run `call`, which must raise InvalidArgument matching `message` within FAST_S with no
    process started; return how long it took."""
    with SpawnWatch(tag) as watch:
        started = time.monotonic()
        try:
            with pytest.raises(InvalidArgument, match=message):
                call()
        finally:
            took = time.monotonic() - started
    assert watch.children == set() and watch.tagged == set(), \
        f"processes started: {sorted(watch.children | watch.tagged)}"
    assert took < FAST_S, f"refused after {took:.3f} s"
    assert state.read_record("workloads", tag) is None
    assert not (state.state_dir() / "workloads" / f"{tag}.d").exists()
    assert not scope.tag_seen(tag)  # a refused start claims no tag
    return took


@pytest.mark.parametrize("launcher", ["bare", "torchrun"])
def test_nccl_with_fewer_gpus_than_ranks_is_refused_before_any_rank_starts(launcher: str) -> None:
    tag = unique("nogpu-ring")
    ranks = max(2, gpu_count() + 1)
    try:
        took = _refused_at_once(
            tag, lambda: actions.start_ring(world_size=ranks, backend="nccl", launcher=launcher,
                                            tag=tag, timeout_s=60),
            rf"^backend 'nccl' needs one GPU per rank \(world_size {ranks}\), and "
            rf"(no GPU is visible here|only {ranks - 1} GPU\(s\) are visible here)")
        print(f"start_ring(backend='nccl', launcher={launcher!r}) refused in {took:.4f} s")
    finally:
        actions.stop_workload(tag, grace_s=0, missing_ok=True)


@pytest.mark.parametrize("via", ["torch", "driver", "auto"])
def test_a_gpu_holder_on_a_gpu_that_is_not_there_is_refused_before_any_worker_starts(
        via: str) -> None:
    """via torch, driver or auto (without allow_host_fallback) on a GPU that is not there: refused
    at once, naming what to do instead; before, driver and auto workers started and failed."""
    tag = unique("nogpu-hold")
    device = gpu_count()  # one past the last GPU: none on a machine without a GPU
    instead = "on a machine without a GPU" if via == "torch" else "or allow_host_fallback: true"
    try:
        took = _refused_at_once(
            tag, lambda: actions.start_holders(count=2, mib=1, via=via, device=device,
                                               tag=tag, timeout_s=60),
            rf"^via '{via}' holds GPU memory on GPU {device} \(device\), and "
            r"(no GPU is visible|only \d+ GPU\(s\) are visible) here.*no worker was started; "
            rf"use via 'host'.*{instead}")
        print(f"start_holders(via={via!r}) refused in {took:.4f} s")
    finally:
        actions.stop_workload(tag, grace_s=0, missing_ok=True)


@pytest.mark.parametrize("via", ["driver", "auto"])
def test_a_holder_allowed_to_fall_back_to_host_memory_starts_without_the_gpu(via: str) -> None:
    """allow_host_fallback lets driver and auto hold host memory where the GPU is not there:
    not refused; the workers say they hold host memory."""
    if gpu_count() > 0:
        pytest.skip("a GPU is usable here: the workers would hold GPU memory")
    tag = unique("fallback-hold")
    try:
        started = actions.start_holders(count=1, mib=1, via=via, allow_host_fallback=True,
                                        tag=tag, timeout_s=60)
        assert [d["via"] for d in started["ready"]] == ["host"], started
    finally:
        actions.stop_workload(tag, grace_s=0, missing_ok=True)
    assert not tagged(tag)


def test_a_pod_of_torch_holders_without_the_gpu_is_refused_before_the_pod_exists() -> None:
    tag, pod = unique("nogpu-pod"), unique("nogpu-box")
    try:
        _refused_at_once(
            tag, lambda: actions.start_pod_with_holders(pod=pod, init="sleep", count=1, mib=1,
                                                        via="torch", device=gpu_count(),
                                                        tag=tag, timeout_s=60),
            r"^via 'torch' holds GPU memory on GPU \d+ \(device\)")
        assert runtime.get_record(pod) is None
    finally:
        actions.stop_workload(tag, grace_s=0, missing_ok=True)
        runtime.remove(pod)


@pytest.mark.parametrize("inject", ["cuda", "both"])
def test_a_ring_armed_with_the_cuda_injector_is_refused_without_a_gpu(inject: str) -> None:
    if gpu_count() > 0:
        pytest.skip("a GPU is usable here: the CUDA injector arms")
    tag = unique("nogpu-inject")
    try:
        _refused_at_once(
            tag, lambda: actions.start_ring(world_size=2, backend="gloo", inject=inject, tag=tag,
                                            timeout_s=120),
            rf"^inject '{inject}' arms the CUDA injector, .* no GPU is visible here")
    finally:
        actions.stop_workload(tag, grace_s=0, missing_ok=True)


def test_the_ring_command_refuses_nccl_without_the_gpus_and_starts_nothing(
        tmp_path: Path) -> None:
    tag = unique("nogpu-cli")
    ranks = max(2, gpu_count() + 1)
    ready, logs = tmp_path / "ready", tmp_path / "logs"
    with SpawnWatch(tag) as watch:
        command = subprocess.Popen(
            [sys.executable, "-m", "chaosgpu.workloads", "ring", "--backend", "nccl",
             "--world-size", str(ranks), "--ready-dir", str(ready), "--log-dir", str(logs),
             "--tag", tag, "--detach"],
            env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL)  # fmt: skip
        out, err = command.communicate(timeout=60)
    assert command.returncode == 2, (out, err)
    assert f"ring: backend 'nccl' needs one GPU per rank (world_size {ranks})" in err
    # the command is this process's one child; no rank (which would carry the tag) appeared
    assert watch.children <= {command.pid} and watch.tagged == set(), \
        sorted(watch.children | watch.tagged)
    assert not ready.exists() and not logs.exists()
