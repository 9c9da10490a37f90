"""Chaos Toolkit actions on distributed-training jobs: kill, freeze, resume or fail one rank,
and clean a hung job up (a rollback).

A job is named by its id (`chaosgpu snapshot` lists it: TORCHELASTIC_RUN_ID, CHAOSGPU_JOB, or
MASTER_ADDR:MASTER_PORT) or by the tag its ranks carry (the workload's tag). This module owns
these faults; finding jobs and cleaning up is chaosgpu.job.hang, every signal goes through the
in-target signal program (pidfds, identity and refusal checks). Each function has a deadline.
"""

import logging
import time
from typing import Any

from chaosgpu.job import hang
from chaosgpu.process.actions import _freeze_with_freezer, _thaw_freezer_groups, send, wait_gone

__all__ = ["kill_rank", "freeze_rank", "resume_rank", "fail_rank", "cleanup_hung_job"]

logger = logging.getLogger("chaostoolkit")


def _rank_process(job: str | None, tag: str | None, rank: int,
                  deadline_s: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(census, job, the rank's process), waiting up to `deadline_s` for the rank to appear."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    hang._check_selector(job, tag)
    end = time.monotonic() + deadline_s
    while True:
        census = hang._census(gpu=False)
        found = hang.find_job(census, job, tag)
        if found is not None:
            entry = next((r for r in found.get("ranks") or [] if r.get("rank") == rank), None)
            if entry is not None and entry.get("pid") is not None:
                proc = next(p for p in census["processes"] if p["pid"] == entry["pid"])
                return census, found, proc
        if time.monotonic() >= end:
            what = f"job {job!r}" if job else f"the job tagged {tag!r}"
            if found is None:
                raise hang.JobError(f"{what} is not running (no such job in the census)")
            raise hang.JobError(f"{what} has no live process for rank {rank} (ranks: "
                                f"{[(r.get('rank'), r.get('state')) for r in found['ranks']]})")
        time.sleep(0.05)


def _mark_fault(what: str, **extra: Any) -> None:
    from chaosgpu.timeline.sampler import current

    sampler = current()
    if sampler is not None:
        sampler.mark(f"fault:{what}", "point", **extra)


def _signal_rank(job: str | None, tag: str | None, rank: int, signal: str,
                 wait_s: float, find_deadline_s: float = 2.0) -> dict[str, Any]:
    _, found, proc = _rank_process(job, tag, rank, find_deadline_s)
    report = send([proc], signal, {"job": found["id"]})
    result = report["results"][0]
    if result["result"] == "sent":
        _mark_fault(signal, job=found["id"], rank=rank, pid=proc["pid"])
    out = {"job": found["id"], "rank": rank, "pid": proc["pid"], "signal": report["signal"],
           "result": result["result"], "reason": result.get("reason"),
           "sent_at": result.get("sent_at")}
    if result["result"] == "refused":
        raise PermissionError(f"refused to signal rank {rank} (PID {proc['pid']}): "
                              f"{result['reason']}")
    if wait_s > 0 and signal in ("SIGKILL", "SIGTERM") and result["result"] == "sent":
        out["wait"] = wait_gone([{"pid": proc["pid"], "starttime": proc["starttime"]}], wait_s)
    return out


def kill_rank(job: str | None = None, rank: int = 0, tag: str | None = None,
              signal: str = "SIGKILL", wait_s: float = 2.0,
              configuration: dict[str, Any] | None = None,
              secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Kill one rank of a training job (by job id or by the ranks' tag) with `signal` (SIGKILL,
    a crash, by default; SIGTERM for a polite stop), through a pidfd, and wait up to `wait_s`
    for it to die. The other ranks are untouched: under NCCL they hang in their next
    collective. Returns the job, rank, PID and what happened."""
    return _signal_rank(job, tag, rank, signal, wait_s)


def freeze_rank(job: str | None = None, rank: int = 0, tag: str | None = None,
                method: str = "sigstop", configuration: dict[str, Any] | None = None,
                secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Freeze one rank of a training job (SIGSTOP, or the cgroup v1 freezer with
    method="freezer"): a peer that stops answering, which is how a gloo job reproduces an NCCL
    hang (a gloo survivor notices a killed peer at once). Resume it with resume_rank, or clean
    the job up with cleanup_hung_job."""
    if method not in ("sigstop", "freezer"):
        raise ValueError(f"method must be 'sigstop' or 'freezer', got {method!r}")
    if method == "sigstop":
        out = _signal_rank(job, tag, rank, "SIGSTOP", 0)
    else:
        _, found, proc = _rank_process(job, tag, rank, 5.0)
        check = send([proc], "SIGCONT", {"job": found["id"]})["results"][0]
        if check["result"] != "sent":
            raise PermissionError(f"refused to freeze rank {rank}: {check.get('reason')}")
        frozen = _freeze_with_freezer({"job": f"{found['id']}-rank{rank}"}, [proc], 5.0)
        _mark_fault("freezer", job=found["id"], rank=rank, pid=proc["pid"])
        out = {"job": found["id"], "rank": rank, "pid": proc["pid"], "result": "frozen",
               **frozen}
    out["method"] = method
    return out


def resume_rank(job: str | None = None, rank: int = 0, tag: str | None = None,
                configuration: dict[str, Any] | None = None,
                secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Resume a frozen rank (thaw its freezer cgroup, SIGCONT through a pidfd)."""
    _, found, proc = _rank_process(job, tag, rank, 5.0)
    thawed = _thaw_freezer_groups({proc["pid"]})
    report = send([proc], "SIGCONT", {"job": found["id"]})
    return {"job": found["id"], "rank": rank, "pid": proc["pid"],
            "result": report["results"][0]["result"], "thawed_cgroups": thawed}


def fail_rank(job: str | None = None, rank: int = 0, tag: str | None = None,
              how: str = "auto", configuration: dict[str, Any] | None = None,
              secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Make one rank fail the way that leaves its peers hung: how="kill" (SIGKILL), "freeze"
    (SIGSTOP), or "auto": SIGKILL under NCCL (survivors hang until the NCCL timeout), SIGSTOP
    under gloo (gloo survivors see a killed peer at once, "connection reset", so a frozen peer is
    how gloo reproduces the hang). The result says which backend was seen and what was done."""
    if how not in ("auto", "kill", "freeze"):
        raise ValueError(f"how must be 'auto', 'kill' or 'freeze', got {how!r}")
    census, found, _ = _rank_process(job, tag, rank, 5.0)
    backend = hang.job_backend(census, found)
    chosen = how if how != "auto" else ("kill" if backend == "nccl" else "freeze")
    if chosen == "kill":
        out = _signal_rank(found["id"], None, rank, "SIGKILL", 2.0)
    else:
        out = _signal_rank(found["id"], None, rank, "SIGSTOP", 0)
    out.update(backend=backend, how=how, done=chosen)
    logger.info("chaosgpu: failed rank %d of %s (%s) by %s", rank, found["id"], backend, chosen)
    return out


def cleanup_hung_job(job: str | None = None, tag: str | None = None, grace_s: float = 5.0,
                     deadline_s: float = 30.0, configuration: dict[str, Any] | None = None,
                     secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Roll back a hung job: thaw frozen ranks (a frozen process ignores SIGKILL until thawed),
    SIGTERM every remaining process of the job (ranks, launcher, and with a tag everything
    carrying it), wait `grace_s`, SIGKILL what is left, wait until they are dead and NVML no
    longer lists them (when NVML is available), all within `deadline_s`. Idempotent: a second
    call, or a call after the runner crashed, finds nothing and says so. Reports what it removed
    and, honestly, what it could not."""
    return hang.cleanup(job=job, tag=tag, grace_s=grace_s, deadline_s=deadline_s)
