"""The `ring` workload on CPU (gloo), for real: a rank killed, a rank frozen, a SIGTERM handler,
bare ranks and torchrun. Behaviour is asserted (who errors, when), not exit codes (gloo
survivors sometimes die by SIGABRT)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_helpers import alive as _alive

from chaosgpu.workloads import actions
from chaosgpu.workloads.readiness import read_ready
from chaosgpu.workloads.ring import RingConfig, launch_ring, rank_env

pytest.importorskip("torch")


def _progress(ready_dir: str, rank: int) -> int:
    document = read_ready(os.path.join(ready_dir, f"rank{rank}.progress"))
    return int(document["iteration"]) if document else -1


def _exit_time(process: subprocess.Popen[bytes], timeout_s: float) -> float | None:
    started = time.monotonic()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - started



@pytest.fixture
def bare_ring(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    launches = []

    def start(world_size: int, timeout_s: float, **kw: object):  # type: ignore[no-untyped-def]
        config = RingConfig(backend="gloo", world_size=world_size, launcher="bare",
                            timeout_s=timeout_s, ready_dir=str(tmp_path / f"r{len(launches)}"),
                            log_dir=str(tmp_path / f"log{len(launches)}"), iters_per_s=20,
                            **kw)  # type: ignore[arg-type]  # fmt: skip
        launch = launch_ring(config)
        launches.append(launch)
        launch.wait_ready(120)
        return launch

    yield start
    for launch in launches:
        for process in launch.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.wait()


def test_bare_ring_ready_files_and_env(bare_ring) -> None:  # type: ignore[no-untyped-def]
    launch = bare_ring(3, 30.0, job_id="job-env", tag="t-env")
    # ready implies a step on record: a progress reading at once sees every rank
    assert all(_progress(launch.ready_dir, rank) >= 1 for rank in range(3))
    documents = launch.wait_ready(5)
    assert sorted(d["rank"] for d in documents) == [0, 1, 2]
    assert {d["backend"] for d in documents} == {"gloo"}
    assert {d["job"] for d in documents} == {"job-env"}
    environ = Path(f"/proc/{launch.pids[1]}/environ").read_bytes().split(b"\0")
    for needed in (b"CHAOSGPU_JOB=job-env", b"CHAOSGPU_TAG=t-env", b"RANK=1", b"WORLD_SIZE=3",
                   b"NCCL_NVLS_ENABLE=0", b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                   b"NVSHMEM_DISABLE_NVLS=1", b"TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
                   f"MASTER_PORT={launch.master_port}".encode()):  # fmt: skip
        assert needed in environ
    from chaosgpu.node import take_census

    jobs = {j["id"]: j for j in take_census(fds=False, gpu=False)["jobs"]}
    assert "job-env" in jobs and jobs["job-env"]["world_size"] == 3


RUNNER_SCOPE = {"CHAOSGPU_TAG": "the-runners-tag", "CHAOSGPU_JOB": "the-runners-job",
                "CHAOSGPU_SANDBOX": "the-runners-pod"}


def _scope_env(environ: dict[str, str] | bytes) -> dict[str, str]:
    """The scope variables (tag, job, sandbox) of an environment or a /proc/PID/environ."""
    if isinstance(environ, bytes):
        entries = environ.decode(errors="replace").split("\0")
        environ = dict(entry.partition("=")[::2] for entry in entries if "=" in entry)
    return {key: value for key, value in environ.items() if key in RUNNER_SCOPE}


def test_ranks_carry_their_own_tag_and_job_never_the_runners(
        bare_ring, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    # A runner carrying a tag, job or sandbox of its own handed them to every rank: a kill by
    # the runner's tag, or a sandbox scope, reached the ring.
    for key, value in RUNNER_SCOPE.items():
        monkeypatch.setenv(key, value)
    launch = bare_ring(2, 30.0, job_id="own-job", tag="own-tag")
    for pid in launch.pids:
        assert _scope_env(Path(f"/proc/{pid}/environ").read_bytes()) == {
            "CHAOSGPU_JOB": "own-job", "CHAOSGPU_TAG": "own-tag"}
    # a ring without a tag of its own carries none (torchrun's agent gets the same environment)
    for launcher in ("bare", "torchrun"):
        assert _scope_env(rank_env(RingConfig(launcher=launcher, job_id="j2"))) == {
            "CHAOSGPU_JOB": "j2"}
    assert os.environ["CHAOSGPU_SANDBOX"] == "the-runners-pod"  # the runner's own is kept


def test_bare_sigkill_of_a_rank_makes_survivors_fail_fast(bare_ring) -> None:  # type: ignore[no-untyped-def]
    launch = bare_ring(3, 30.0)
    launch.processes[1].kill()
    for rank in (0, 2):
        elapsed = _exit_time(launch.processes[rank], 20.0)
        assert elapsed is not None, f"rank {rank} still running after its peer was killed"
        assert elapsed < 10.0  # gloo: connection reset, far sooner than the 30 s timeout
        assert launch.processes[rank].returncode != 0


def test_bare_sigstop_blocks_survivors_until_the_timeout(bare_ring) -> None:  # type: ignore[no-untyped-def]
    launch = bare_ring(2, 4.0)
    os.kill(launch.pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    time.sleep(1.0)
    before = _progress(launch.ready_dir, 0)
    time.sleep(1.0)
    assert _alive(launch.pids[0]) and _progress(launch.ready_dir, 0) == before, "survivor blocks"
    elapsed = _exit_time(launch.processes[0], 20.0)
    assert elapsed is not None, "the survivor must give up when the process-group timeout elapses"
    total = time.monotonic() - stopped
    assert 3.5 <= total < 4.0 + 6.0, total
    assert launch.processes[0].returncode != 0
    log = Path(launch.ready_dir).parent.joinpath(
        Path(launch.ready_dir).name.replace("r", "log", 1), "rank0.log").read_text()  # fmt: skip
    assert "rank 0:" in log


def test_bare_sigcont_before_the_timeout_resumes(bare_ring) -> None:  # type: ignore[no-untyped-def]
    launch = bare_ring(2, 6.0)
    os.kill(launch.pids[1], signal.SIGSTOP)
    time.sleep(1.5)
    frozen_at = _progress(launch.ready_dir, 0)
    os.kill(launch.pids[1], signal.SIGCONT)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _progress(launch.ready_dir, 0) <= frozen_at + 5:
        time.sleep(0.05)
    assert _progress(launch.ready_dir, 0) > frozen_at + 5, "training resumes after SIGCONT"
    time.sleep(6.0 - 1.5)  # past the point where the timeout would have fired
    assert all(p.poll() is None for p in launch.processes)


def test_sigterm_handler_destroys_and_exits_zero(bare_ring) -> None:  # type: ignore[no-untyped-def]
    launch = bare_ring(2, 30.0, sigterm_handler="destroy")
    launch.processes[0].send_signal(signal.SIGTERM)
    elapsed = _exit_time(launch.processes[0], 10.0)
    assert elapsed is not None and elapsed < 5.0
    assert launch.processes[0].returncode == 0
    assert _exit_time(launch.processes[1], 20.0) is not None  # its peer then fails


def test_without_handler_sigterm_kills(bare_ring) -> None:  # type: ignore[no-untyped-def]
    launch = bare_ring(2, 30.0)
    launch.processes[0].send_signal(signal.SIGTERM)
    assert _exit_time(launch.processes[0], 10.0) is not None
    assert launch.processes[0].returncode == -signal.SIGTERM


def test_torchrun_sigkill_of_a_rank_tears_the_job_down() -> None:
    started = actions.start_ring(world_size=2, backend="gloo", launcher="torchrun",
                                 process_group_timeout_s=30, timeout_s=120)  # fmt: skip
    try:
        assert started["agent_pid"] and len(started["pids"]) == 2
        os.kill(started["ranks"]["1"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            _alive(p) for p in [started["agent_pid"], *started["pids"]]
        ):
            time.sleep(0.05)
        assert not any(_alive(p) for p in [started["agent_pid"], *started["pids"]])
    finally:
        actions.stop_workload(started["tag"], grace_s=0)


def test_torchrun_sigstop_survivor_fails_at_the_timeout() -> None:
    started = actions.start_ring(world_size=2, backend="gloo", launcher="torchrun",
                                 process_group_timeout_s=4, timeout_s=120)  # fmt: skip
    try:
        survivor, frozen = started["ranks"]["0"], started["ranks"]["1"]
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        time.sleep(2.0)
        assert _alive(survivor), "the survivor blocks while its peer is frozen"
        while time.monotonic() - stopped < 15 and _alive(survivor):
            time.sleep(0.05)
        total = time.monotonic() - stopped
        assert not _alive(survivor) and 3.5 <= total < 10.0, total
    finally:
        result = actions.stop_workload(started["tag"], grace_s=1)
    assert result["stopped"]


def test_start_ring_action_and_stop_is_idempotent() -> None:
    started = actions.start_ring(world_size=2, backend="auto", process_group_timeout_s=30,
                                 sigterm_handler="destroy", tag="ring-action")  # fmt: skip
    assert started["backend"] == "gloo" and started["job_id"] == "ring-action"
    with pytest.raises(ValueError, match="already in use"):
        actions.start_ring(world_size=2, backend="gloo", tag="ring-action")
    listed = {w["tag"]: w for w in actions.list_workloads()}
    assert sorted(listed["ring-action"]["alive"]) == sorted(started["pids"])
    result = actions.stop_workload("ring-action", grace_s=5)
    assert set(result["processes"].values()) == {"exited on SIGTERM"}
    assert actions.stop_workload("ring-action")["stopped"] is False
    assert not any(_alive(p) for p in started["pids"])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"world_size": 0}, "world.size"), ({"backend": "mpi"}, "backend"),
     ({"launcher": "srun"}, "launcher"), ({"async_error_handling": 7}, "async"),
     ({"sigterm_handler": "pray"}, "sigterm_handler must be one of 'none', 'destroy'"),
     ({"process_group_timeout_s": -1}, "timeout")],
)  # fmt: skip
def test_start_ring_bad_input(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        actions.start_ring(tag="bad-ring", **kwargs)  # type: ignore[arg-type]
    assert "bad-ring" not in {w["tag"] for w in actions.list_workloads()}


@pytest.mark.parametrize("field, value, label, must", [
    ("tag", "t ", "tag", "a tag: a non-empty string without whitespace or control characters"),
    ("tag", "t\n", "tag", "a tag: a non-empty string without whitespace or control characters"),
    ("job_id", " j", "job id", "a non-empty string without leading or trailing whitespace"),
])
def test_a_ring_never_carries_a_tag_or_job_id_no_selection_could_match(
        field: str, value: str, label: str, must: str, tmp_path: Path) -> None:
    # Ranks carrying "t " could be named by no selection (a tag or job is matched exactly).
    from chaosgpu.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=f"^{label} must be {must}, got "
                                              f"{re.escape(repr(value))}$"):
        launch_ring(RingConfig(backend="gloo", **{field: value}))  # type: ignore[arg-type]
    option = "--" + field.replace("_", "-")
    done = subprocess.run([sys.executable, "-m", "chaosgpu.workloads", "ring", "--backend",
                           "gloo", "--ready-dir", str(tmp_path), option, value],
                          env=dict(os.environ), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"argument {option}: must be {must}, got {value!r}" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing started
    if field == "job_id":
        with pytest.raises(InvalidArgument, match=f"^start_ring: job_id must be {must}"):
            actions.start_ring(backend="gloo", job_id=value, tag="ring-bad-job")
        assert "ring-bad-job" not in {w["tag"] for w in actions.list_workloads()}


def test_ring_cli_detach(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "chaosgpu.workloads", "ring", "--backend", "gloo",
         "--world-size", "2", "--ready-dir", str(tmp_path), "--detach", "--wait-ready-s", "120",
         "--job-id", "cli-job"],
        env=dict(os.environ), capture_output=True, timeout=180,
    )  # fmt: skip
    document = json.loads(done.stdout)
    try:
        assert done.returncode == 0, done.stderr
        assert document["job_id"] == "cli-job" and len(document["ready"]) == 2
        assert all(_alive(pid) for pid in document["pids"])
        assert os.getsid(document["pids"][0]) == document["pids"][0]  # own session
    finally:
        for pid in document["pids"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
