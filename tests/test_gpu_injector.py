"""The Python fault injector inside real torchrun jobs (gloo, CPU tensors), armed through the
environment only: the job (tests/gpu_injector_job.py) knows nothing of chaosgpu.

What runs here for real: sitecustomize loading (and chaining to the next sitecustomize), the
armed file and watcher thread, the trigger/ack channel keyed by PID namespace + PID + start
time, hold-gil (a rank stalls while alive, its peer waits in all_reduce, both resume), raise and
segfault (the rank dies, torchrun tears the job down), refusals (gpu-hang and oom need CUDA;
an unarmed process; a wrong key), and the rollback (chaosgpu.job.hang.cleanup by tag). GPU-only
modes run in tests/test_gpu_faults_gpu.py on a GPU machine.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.gpu import actions, injector
from chaosgpu.job import hang
from chaosgpu.node import read_process

pytest.importorskip("torch")

JOB = Path(__file__).with_name("gpu_injector_job.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def torchrun_job(tmp_path: Path, armed: bool = True, chain: Path | None = None,
                 seconds: float = 120.0) -> Iterator[dict[str, Any]]:
    """A 2-rank torchrun job tagged with a fresh tag; armed with chaosgpu's injector or not."""
    tag = f"inj-{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "inject"
    folder.mkdir()
    jobdir = tmp_path / "job"
    jobdir.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", CHAOSGPU_TAG=tag)
    env.pop("PYTHONPATH", None)
    if armed:
        env.update(injector.environment(base=env, folder=str(folder)))
    else:
        env["PYTHONPATH"] = str(injector.SITE_DIR)
    if chain is not None:
        env["PYTHONPATH"] += os.pathsep + str(chain)
    torchrun = Path(sys.executable).parent / "torchrun"
    log = open(tmp_path / "torchrun.log", "wb")  # noqa: SIM115
    launcher = subprocess.Popen(
        [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", tag, "--max-restarts",
         "0", "--monitor-interval", "0.1", str(JOB), "--dir", str(jobdir), "--seconds",
         str(seconds)], env=env, start_new_session=True, stdin=subprocess.DEVNULL,
        stdout=log, stderr=subprocess.STDOUT)
    try:
        yield {"tag": tag, "launcher": launcher, "jobdir": jobdir, "folder": folder,
               "log": tmp_path / "torchrun.log"}
    finally:
        hang.cleanup(tag=tag, grace_s=1.0, deadline_s=30.0)
        launcher.wait(timeout=30)
        log.close()


def _progress(jobdir: Path, rank: int) -> int:
    try:
        return int(json.loads((jobdir / f"rank{rank}.progress").read_text())["iteration"])
    except (OSError, ValueError, KeyError):
        return -1


def _wait_running(job: dict[str, Any], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(_progress(job["jobdir"], r) > 5 for r in (0, 1)):
            return
        if job["launcher"].poll() is not None:
            break
        time.sleep(0.1)
    pytest.fail(f"the job did not start: {job['log'].read_text()[-2000:]}")


def _rank_record(job: dict[str, Any], rank: int) -> dict[str, Any]:
    pid = json.loads((job["jobdir"] / f"rank{rank}.threads").read_text())["pid"]
    record = read_process(pid)
    assert record is not None
    return record


@pytest.mark.slow
def test_hold_gil_stalls_a_live_rank_and_its_peer_then_both_resume(tmp_path: Path) -> None:
    with torchrun_job(tmp_path) as job:
        _wait_running(job)
        threads = json.loads((job["jobdir"] / "rank1.threads").read_text())["threads"]
        assert "chaosgpu-injector" in threads
        out = actions.inject_rank_fault(mode="hold-gil", tag=job["tag"], rank=1, duration_s=3.0,
                                        timeout_s=10)
        assert out["delivered"] is True and out["rank"] == 1 and out["ack"]["accepted"]
        time.sleep(0.5)
        stalled = [_progress(job["jobdir"], r) for r in (0, 1)]
        time.sleep(1.5)
        assert [_progress(job["jobdir"], r) for r in (0, 1)] == stalled, "ranks kept stepping"
        # every rank is alive while the job is stuck: the census sees nothing dead or stopped
        # (the verdict over time is tests/test_verdicts.py's and the gpu-rank-hang experiment's)
        found = hang.find_job(hang._census(), tag=job["tag"])
        assert found is not None
        assert {r["state"] for r in found["ranks"]} == {"alive"}
        time.sleep(2.5)
        resumed = [_progress(job["jobdir"], r) for r in (0, 1)]
        assert all(now > then for now, then in zip(resumed, stalled, strict=True)), resumed
        assert job["launcher"].poll() is None


@pytest.mark.slow
def test_raise_in_a_rank_fails_the_job(tmp_path: Path) -> None:
    with torchrun_job(tmp_path) as job:
        _wait_running(job)
        # "any" is the last live rank, as kill_rank picks it: rank 1 of two, named in the result
        out = actions.inject_rank_fault(mode="raise", tag=job["tag"], rank="any", timeout_s=10)
        assert (out["rank"], out["pid"]) == (1, _rank_record(job, 1)["pid"])
        assert out["ack"]["detail"]["exception"].endswith("ChaosGPUInjectedFault")
        assert job["launcher"].wait(timeout=60) != 0
        assert "ChaosGPUInjectedFault" in job["log"].read_text()


@pytest.mark.slow
def test_segfault_in_a_rank_kills_it_by_sigsegv(tmp_path: Path) -> None:
    with torchrun_job(tmp_path) as job:
        _wait_running(job)
        out = actions.inject_rank_fault(mode="segfault", tag=job["tag"], rank=0, timeout_s=10)
        assert out["ack"]["detail"]["signal"] == "SIGSEGV"
        assert job["launcher"].wait(timeout=60) != 0
        text = job["log"].read_text()
        assert "SIGSEGV" in text or "Signal 11" in text, text[-2000:]


@pytest.mark.slow
def test_gpu_modes_are_refused_without_cuda_and_the_job_goes_on(tmp_path: Path) -> None:
    with torchrun_job(tmp_path) as job:
        _wait_running(job)
        with pytest.raises(injector.InjectionError, match="refused fault 'gpu-hang'.*libcuda"):
            actions.inject_rank_fault(mode="gpu-hang", tag=job["tag"], rank=0, timeout_s=10)
        with pytest.raises(injector.InjectionError, match="torch has not initialised CUDA"):
            actions.inject_rank_fault(mode="oom", tag=job["tag"], rank=1, timeout_s=10)
        before = _progress(job["jobdir"], 0)
        time.sleep(1.0)
        assert _progress(job["jobdir"], 0) > before
        # a record whose start time differs (a reused PID) has another key: not armed
        record = _rank_record(job, 0)
        stranger = dict(record, starttime=record["starttime"] + 1)
        with pytest.raises(injector.InjectionError, match="is not armed"):
            injector.trigger(stranger, "raise", timeout_s=1)
        assert job["launcher"].poll() is None


@pytest.mark.slow
def test_unarmed_job_has_no_thread_no_file_and_is_refused(tmp_path: Path) -> None:
    chain = tmp_path / "chain"
    chain.mkdir()
    (chain / "sitecustomize.py").write_text(
        "import os\n"
        "open(os.path.join(os.environ['CHAIN_MARK'], str(os.getpid())), 'w').close()\n")
    os.environ["CHAIN_MARK"] = str(tmp_path / "marks")
    (tmp_path / "marks").mkdir()
    try:
        with torchrun_job(tmp_path, armed=False, chain=chain) as job:
            _wait_running(job)
            threads = json.loads((job["jobdir"] / "rank0.threads").read_text())["threads"]
            assert "chaosgpu-injector" not in threads
            assert list(job["folder"].iterdir()) == []
            with pytest.raises(ValueError, match="no live armed process"):
                # the job's ranks carry the tag but not CHAOSGPU_INJECT_DIR
                actions.inject_rank_fault(mode="raise", tag=job["tag"], rank=None,
                                          timeout_s=1)
            with pytest.raises(injector.InjectionError, match="not started with the injector"):
                injector.trigger(_rank_record(job, 0), "raise", timeout_s=1)
            pid = json.loads((job["jobdir"] / "rank0.threads").read_text())["pid"]
            # the next sitecustomize on the path still ran in the rank
            assert (tmp_path / "marks" / str(pid)).exists()
    finally:
        os.environ.pop("CHAIN_MARK", None)


@pytest.mark.slow
def test_armed_job_chains_the_next_sitecustomize_too(tmp_path: Path) -> None:
    chain = tmp_path / "chain"
    chain.mkdir()
    (chain / "sitecustomize.py").write_text(
        "import os\n"
        "open(os.path.join(os.environ['CHAIN_MARK'], str(os.getpid())), 'w').close()\n")
    os.environ["CHAIN_MARK"] = str(tmp_path / "marks")
    (tmp_path / "marks").mkdir()
    try:
        with torchrun_job(tmp_path, armed=True, chain=chain) as job:
            _wait_running(job)
            record = _rank_record(job, 1)
            assert injector.armed(record)["pid"] == record["pid"]
            assert (tmp_path / "marks" / str(record["pid"])).exists()
    finally:
        os.environ.pop("CHAIN_MARK", None)


def test_fault_arguments_are_refused_before_anything_is_looked_at() -> None:
    for kwargs, match in (
            ({"mode": "explode"}, "mode must be one of .*got 'explode'"),
            ({"mode": "hold-gil", "duration_s": 0}, "duration_s must be a number of seconds > 0"),
            ({"mode": "hold-gil", "duration_s": -1.0},
             "duration_s must be a number of seconds > 0"),
            ({"mode": "raise", "exception": "SystemExit"},
             "exception must be one of .*got 'SystemExit'"),
            ({"mode": "gpu-hang", "exception": "RuntimeError"}, "exception applies"),
            ({"mode": "gpu-hang", "device": -1}, "device must be a non-negative integer"),
            ({"mode": "gpu-hang", "timeout_s": 0}, "timeout_s must be a number of seconds > 0"),
            ({"mode": "gpu-hang", "rank": -2, "tag": "x"}, "rank must be a rank number"),
            ({"mode": "gpu-hang", "rank": "some", "tag": "x"}, "rank must be a rank number"),
            ({"mode": "gpu-hang", "rank": None}, "name the target"),
    ):
        with pytest.raises(ValueError, match=match):
            actions.inject_rank_fault(**kwargs)
    with pytest.raises(ValueError, match="fault must be one of .*got .free."):
        actions.inject_cuda_fault(fault="free", tag="x")
    with pytest.raises(ValueError, match="count must be >= 1"):
        actions.inject_cuda_fault(fault="alloc", count=0, tag="x")


def test_the_two_sides_agree_on_modes_and_exceptions() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "injector_copy", injector.SITE_DIR / "chaosgpu_injector.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert tuple(module.MODES) == injector.MODES
    assert tuple(module.EXCEPTIONS) == injector.EXCEPTIONS
    # the key the injector computes for itself is the key chaosgpu computes from the census
    own = read_process(os.getpid())
    assert own is not None and module.process_key() == injector.process_key(own)


@pytest.mark.slow
def test_an_armed_worker_inside_a_local_pod_is_reached_by_its_namespace_key(
        tmp_path: Path) -> None:
    """The key is built from the PID namespace and the PID inside it: a worker exec'd into a
    local pod (PID namespace of its own, /proc mounted for it) computes the same key chaosgpu
    computes from the host's census, so the trigger reaches it, and only it."""
    from chaosgpu.sandbox import actions as sandbox

    tag = f"inj-pod-{uuid.uuid4().hex[:6]}"
    name = f"injpod{uuid.uuid4().hex[:6]}"
    folder = tmp_path / "inject"
    folder.mkdir()
    env = dict(injector.environment(folder=str(folder)), CHAOSGPU_TAG=tag)
    script = "import time\nwhile True:\n    time.sleep(0.01)\n"
    sandbox.create_sandbox(name=name, init="sleep", grace_s=1.0)
    try:
        started = sandbox.exec_in_sandbox(name=name, argv=[sys.executable, "-c", script],
                                          detached=True, env=env, timeout_s=60)
        host_pid, ns_pid = started["host_pids"][0], started["ns_pids"][0]
        assert host_pid != ns_pid
        deadline = time.monotonic() + 60
        while not list(folder.glob("*.armed")) and time.monotonic() < deadline:
            time.sleep(0.1)
        armed = [json.loads(p.read_text()) for p in folder.glob("*.armed")]
        assert [a["pid"] for a in armed] == [ns_pid], armed  # the PID the worker sees
        record = read_process(host_pid)
        assert record is not None and injector.process_key(record) == armed[0]["key"]
        out = actions.inject_rank_fault(mode="raise", tag=tag, rank=None, timeout_s=10)
        assert out["pid"] == host_pid and out["ack"]["pid"] == ns_pid
        deadline = time.monotonic() + 20
        while read_process(host_pid) is not None and read_process(host_pid)["state"] != "Z" \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_process(host_pid) is None or read_process(host_pid)["state"] == "Z"
    finally:
        sandbox.remove_sandbox(name=name)
