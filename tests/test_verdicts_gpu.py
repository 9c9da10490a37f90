"""Observed job verdicts on the GPU (run with `pytest -m gpu` where NVML and a GPU exist): a
gloo job with CUDA tensors, and a world-size-1 NCCL job with PyTorch's Flight Recorder and a
dump pipe (NCCL RAS queried where the installed NCCL serves it)."""

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_spawn, start_torchrun, wait_spawn_steps  # noqa: E402

from chaosgpu.job import actions, nccl_ras, observe, probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

EVIDENCE = os.environ.get("CHAOSGPU_GPU_EVIDENCE")  # a folder to keep the verdicts in


def keep(name: str, verdict: dict) -> None:
    if EVIDENCE:
        Path(EVIDENCE).mkdir(parents=True, exist_ok=True)
        Path(EVIDENCE, f"{name}.json").write_text(json.dumps(verdict, indent=1, default=str))


def _fr_env(tmp_path: Path) -> dict[str, str]:
    return {"TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "fr_pipe_"),
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr_dump_"),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def test_gloo_with_cuda_tensors_a_stopped_rank_hangs_its_peer(tmp_path: Path,
                                                              jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--device", "cuda", "--mib", "512"])
    jobs.append(job)
    job.wait_steps(3)
    state = probes.job_state(job=job.run_id)
    keep("gloo-gpu-running", state)
    assert state["verdict"] == "running", state["reason"]
    assert all((r["gpu_mib"] or 0) > 500 for r in state["ranks"]), state["ranks"]
    actions.freeze_rank(job=job.run_id, rank=1)
    found = probes.detect_hang(job=job.run_id, timeout_s=30)
    keep("gloo-gpu-hung", found)
    assert found["verdict"] == "hung", found["reason"]
    assert found["detection"]["after_fault_s"] < 6.0
    assert [c["rank"] for c in found["culprit_ranks"]] == [1]


def test_ranks_blocked_in_ddps_constructor_on_the_gpu_are_hung(tmp_path: Path,
                                                             jobs: list[Job]) -> None:
    """A DDP model on the GPU (gloo, CUDA tensors): a rank that never builds its DDP hangs its
    peer inside DDP's constructor (its parameter check and state broadcast), seen from
    outside with the late rank as culprit."""
    job = start_torchrun(tmp_path, ["--ddp", "--ddp-delay-rank", "1", "--device", "cuda"])
    jobs.append(job)
    found = probes.wait_job_verdict(["hung", "failed"], job=job.run_id, timeout_s=120)
    keep("ddp-constructor-gpu-hung", found)
    assert found["verdict"] == "hung", found["reason"]
    assert found["blocked_in"]["kind"] == "collective", found["blocked_in"]
    assert found["blocked_in"]["what"].startswith("DDP "), found["blocked_in"]
    assert [c["rank"] for c in found["culprit_ranks"]] == [1], found["culprit_ranks"]


@pytest.mark.parametrize("rendezvous", ["parent-env", "rank-env"])
def test_a_spawn_job_on_the_gpu_its_ranks_memory_and_a_frozen_rank(tmp_path: Path,
                                                                    jobs: list[Job],
                                                                    rendezvous: str) -> None:
    """The tutorial-shaped torch.multiprocessing.spawn DDP job (no RANK anywhere) with its
    model on the GPU: NVML's processes join the job's ranks (not its DataLoader workers), and
    a frozen rank hangs it; also where each rank sets MASTER_PORT in os.environ, as the
    tutorial does (the job found by its store's connections)."""
    job = start_spawn(tmp_path, device="cuda", rendezvous=rendezvous)
    jobs.append(job)
    wait_spawn_steps(job, 3)
    state = probes.job_state(job=job.run_id)
    keep(f"spawn-gpu-running-{rendezvous}", state)
    assert state["verdict"] == "running", state["reason"]
    assert [r["rank"] for r in state["ranks"]] == [0, None], state["ranks"]
    assert all((r["gpu_mib"] or 0) > 100 for r in state["ranks"]), state["ranks"]
    actions.freeze_rank(job=job.run_id, rank=0)
    found = probes.detect_hang(job=job.run_id, timeout_s=30)
    keep(f"spawn-gpu-hung-{rendezvous}", found)
    assert found["verdict"] == "hung", found["reason"]
    assert [c["rank"] for c in found["culprit_ranks"]] == [0]


def test_nccl_world_size_1_runs_with_flight_recorder_progress(tmp_path: Path,
                                                             jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--backend", "nccl", "--device", "cuda", "--mib", "256"],
                         nproc=1, extra_env=_fr_env(tmp_path))
    jobs.append(job)
    job.wait_steps(3)
    # job_state returns at the first progress; watch 8 s (as `chaosgpu jobs --observe 8` does):
    # a dump lands a second or more after it is asked for (ProcessGroupNCCL's monitor thread
    # polls its pipe about once a second); the summary keeps when it was asked and written
    observer = observe.observe(job=job.run_id, timeout_s=8.0, window_s=4)
    state = next(iter(observer.tracks.values())).to_json()
    ras = nccl_ras.query()
    keep("nccl-ws1-running", dict(state, nccl_ras_query=ras))
    assert state["verdict"] == "running", state["reason"]
    assert state["backend"] == "nccl"
    assert "flight-recorder" in state["sources"], state["sources"]
    summary = state["flight_recorder"]["0"]
    assert summary["last_completed_seq"] and summary["entries"] > 0


def test_nccl_world_size_1_gpu_stall_is_hung_from_flight_recorder(tmp_path: Path,
                                                                  jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--backend", "nccl", "--device", "cuda",
                                    "--gpu-hang-at", "15", "--gpu-hang-s", "120"],
                         nproc=1, extra_env=_fr_env(tmp_path))
    jobs.append(job)
    job.wait_steps(3)
    found = probes.wait_job_verdict(["hung"], job=job.run_id, timeout_s=60)
    keep("nccl-ws1-gpu-stall", found)
    assert found["verdict"] == "hung", found["reason"]
    assert "flight-recorder" in found["sources"]
    pending = found["flight_recorder"]["0"]["pending"]
    assert pending is not None and "all_reduce" in (pending["name"] or ""), pending


def test_nccl_world_size_1_stopped_then_finished(tmp_path: Path, jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--backend", "nccl", "--device", "cuda", "--steps", "400"],
                         nproc=1, extra_env=_fr_env(tmp_path))
    jobs.append(job)
    job.wait_steps(3)
    actions.freeze_rank(job=job.run_id, rank=0)
    found = probes.detect_hang(job=job.run_id, timeout_s=30)
    keep("nccl-ws1-stopped", found)
    assert found["verdict"] == "hung" and "stopped" in found["reason"], found["reason"]
    actions.resume_rank(job=job.run_id, rank=0)
    started = time.monotonic()
    done = probes.wait_job_verdict(["finished", "failed"], job=job.run_id, timeout_s=120)
    keep("nccl-ws1-finished", done)
    assert done["verdict"] == "finished", (done["reason"], time.monotonic() - started)
