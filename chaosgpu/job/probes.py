"""Chaos Toolkit probes on distributed-training jobs: hang detection with evidence, a steady-state
check, and the ranks' states.

This module owns these probes' public face; the logic is chaosgpu.job.hang (census polling, no
instrumentation of the job). It must not signal anything. Each function has its own deadline.
"""

from typing import Any

from chaosgpu.job import hang

__all__ = ["detect_hang", "job_hung", "job_ranks", "wait_survivors_exit"]


def detect_hang(job: str | None = None, tag: str | None = None, timeout_s: float = 5.0,
                poll_s: float = 0.1, stacks: bool = True,
                configuration: dict[str, Any] | None = None,
                secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Watch a training job (by id or by its ranks' tag) for a hang: a dead, zombie, missing,
    stopped or frozen rank while others are alive. Polls the node every `poll_s` for up to
    `timeout_s` and returns as soon as it sees one, with evidence: which ranks, when it was
    first seen (and how long after the fault when the timeline marked one), the survivors' PIDs
    and GPU MiB, and their Python stacks through py-spy when it is installed. "hung" is false
    when nothing was seen in time. Needs nothing from the job itself."""
    return hang.detect(job=job, tag=tag, timeout_s=timeout_s, poll_s=poll_s, stacks=stacks)


def job_hung(job: str | None = None, tag: str | None = None,
             configuration: dict[str, Any] | None = None,
             secrets: dict[str, Any] | None = None) -> bool:
    """True when the job (by id or tag; any job on the node when neither is given) has a dead
    or frozen rank while others are alive, right now: the steady state "no hung training job"
    uses tolerance false."""
    census = hang._census(gpu=False)
    if job is None and tag is None:
        return any(j.get("hang_suspected") for j in census.get("jobs") or [])
    found = hang.find_job(census, job, tag)
    return bool(found and found.get("hang_suspected"))


def job_ranks(job: str | None = None, tag: str | None = None,
              configuration: dict[str, Any] | None = None,
              secrets: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The ranks of a job (by id or tag) as the census sees them now: rank, PID, state (alive,
    stopped, frozen, zombie, missing) and GPU MiB. Empty when the job is not running."""
    census = hang._census(gpu=True)
    found = hang.find_job(census, job, tag)
    return list(found.get("ranks") or []) if found else []


def wait_survivors_exit(job: str | None = None, tag: str | None = None,
                        timeout_s: float = 60.0, poll_s: float = 0.1,
                        configuration: dict[str, Any] | None = None,
                        secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wait up to `timeout_s` for the surviving ranks of a job (by id or tag: those alive now,
    not the stopped, frozen or dead ones) to exit on their own, as they should when a
    process-group timeout and async error handling are set (the NCCL remediation). Returns
    "all_exited", each survivor's exit time in seconds from the call, those still alive
    ("still_alive" with PIDs, "survivors_left" as ranks), and
    (with NVML) those still holding GPU memory. A job no longer running counts as all exited."""
    return hang.wait_survivors_exit(job=job, tag=tag, timeout_s=float(timeout_s),
                                    poll_s=float(poll_s))
