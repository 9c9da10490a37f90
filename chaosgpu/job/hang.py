"""Distributed-training jobs as one census reading sees them, and cleaning a hung job up.

This module owns finding a job's processes (ranks, launcher, tagged helpers) in a census, the
backend a job uses, and the rollback that removes a job: thaw, SIGTERM, grace, SIGKILL, wait for
death and GPU release. Whether a job is hung is not decided here: that is a verdict observed over
time (chaosgpu.job.observe and chaosgpu.job.verdict). It reads the node only through the census
(chaosgpu.node) and signals only through chaosgpu.process.actions.send (the in-target signal
program). It must not start workloads. Every function that waits has its own deadline.
"""

import logging
import os
import time
from typing import Any

from chaosgpu.job.observe import JobError, check_selector, select_jobs
from chaosgpu.process.actions import _thaw_freezer_groups, is_alive, send

__all__ = ["JobError", "find_job", "job_processes", "cleanup", "reap_if_children",
           "job_backend"]

logger = logging.getLogger("chaostoolkit")



def _census(gpu: bool = False) -> dict[str, Any]:
    from chaosgpu.node import take_census

    return take_census(gpu=gpu, fds=False)  # type: ignore[no-any-return]


def find_job(census: dict[str, Any], job: str | None = None,
             tag: str | None = None) -> dict[str, Any] | None:
    """Return the census job named by id or by its ranks' (or launcher's) tag; None when there
    is none; raise JobError when a tag matches several jobs or a job and a tag disagree."""
    check_selector(job, tag)
    matches = select_jobs(census, job, tag)
    if len(matches) > 1:
        raise JobError(f"tag {tag!r} matches several jobs {[j['id'] for j in matches]}: "
                       "name one with job=<id>")
    return matches[0] if matches else None


def job_processes(census: dict[str, Any], found: dict[str, Any] | None,
                  tag: str | None = None) -> list[dict[str, Any]]:
    """The census processes of a job: its ranks, its launcher, and (with a tag) every process
    carrying the tag."""
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    pids: set[int] = set()
    if found is not None:
        pids |= {r["pid"] for r in found.get("ranks") or [] if r.get("pid") in by_pid}
        if found.get("launcher_pid") in by_pid:
            pids.add(found["launcher_pid"])
    if tag is not None:
        from chaosgpu.scope import resolve_scope

        pids |= {p["pid"] for p in resolve_scope({"tag": tag}, census, observe=True)}
    return [by_pid[pid] for pid in sorted(pids)]


def job_backend(census: dict[str, Any], found: dict[str, Any]) -> str:
    """"nccl" or "gloo" for a job: from the ranks' command line (`--backend X`), their
    CHAOSGPU_BACKEND, or their open /dev/nvidia* files (NCCL) — gloo otherwise."""
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    for rank in found.get("ranks") or []:
        proc = by_pid.get(rank.get("pid"))
        if proc is None:
            continue
        cmdline = proc.get("cmdline") or []
        if "--backend" in cmdline[:-1]:
            value = cmdline[cmdline.index("--backend") + 1]
            if value in ("nccl", "gloo"):
                return value
        backend = (proc.get("env") or {}).get("CHAOSGPU_BACKEND")
        if backend in ("nccl", "gloo"):
            return str(backend)
        if proc.get("nvidia_fds"):
            return "nccl"
    return "gloo"


def _rank_summary(found: dict[str, Any]) -> dict[str, Any]:
    ranks = found.get("ranks") or []
    def with_state(*states: str) -> list[int]:
        return [r["rank"] for r in ranks if r.get("state") in states and r.get("rank") is not None]
    return {"dead_ranks": with_state("zombie", "missing"),
            "zombie_ranks": with_state("zombie"), "missing_ranks": with_state("missing"),
            "stopped_ranks": with_state("stopped"), "frozen_ranks": with_state("stopped", "frozen"),
            "survivor_ranks": with_state("alive")}


def reap_if_children(pids: list[int], deadline_s: float = 1.0) -> list[int]:
    """Reap those of `pids` that are this process's children and dead (a zombie leader of a
    many-threaded process is reapable only once every thread exited: retry until the deadline).
    Returns the PIDs reaped."""
    from chaosgpu.node import process_state

    reaped: list[int] = []
    pending = list(pids)
    end = time.monotonic() + deadline_s
    while pending:
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (or already reaped)
                pending.remove(pid)
                continue
            if done:
                reaped.append(pid)
                pending.remove(pid)
            elif process_state(pid) not in ("Z", "X"):
                pending.remove(pid)  # alive: not ours to wait for here
        if not pending or time.monotonic() >= end:
            break
        time.sleep(0.005)
    return reaped


def _gpu_pids() -> set[int] | None:
    from chaosgpu.node import nvml_device_memory, nvml_gpu_processes

    if not nvml_device_memory():
        return None
    return {entry["pid"] for entry in nvml_gpu_processes()}


def cleanup(job: str | None = None, tag: str | None = None, grace_s: float = 5.0,
            deadline_s: float = 30.0) -> dict[str, Any]:
    """Thaw, SIGTERM, wait `grace_s`, SIGKILL, wait for death and GPU release; report honestly.
    Idempotent: finding nothing is a normal outcome."""
    check_selector(job, tag)
    if grace_s < 0 or deadline_s <= 0:
        raise ValueError("grace_s must be >= 0 and deadline_s > 0")
    started = time.monotonic()
    def left() -> float:
        return max(0.0, deadline_s - (time.monotonic() - started))
    census = _census(gpu=False)
    try:
        found = find_job(census, job, tag)
    except JobError:
        found = None
        if tag is None:
            raise
    processes = job_processes(census, found, tag)
    report: dict[str, Any] = {"job": found.get("id") if found else job, "tag": tag,
                              "found": len(processes), "steps": []}
    if not processes:
        report.update(removed=[], not_removed=[], zombies=[], gpu_memory_released=None,
                      note="nothing to clean up: no process of this job is left",
                      took_s=round(time.monotonic() - started, 4))
        return report
    scope = {"include_other_users": False, "include_ns_init": False}
    targets = [{"pid": p["pid"], "starttime": p.get("starttime")} for p in processes]
    all_pids = [p["pid"] for p in processes]
    # 1. thaw: a frozen process ignores SIGKILL until thawed (freezer) and SIGTERM until SIGCONT
    thawed = _thaw_freezer_groups(set(all_pids))
    cont = send(processes, "SIGCONT", scope)
    report["steps"].append({"step": "thaw", "thawed_cgroups": thawed, "sigcont_sent": cont["sent"],
                            "t": round(time.monotonic() - started, 4)})
    refused = [r for r in cont["results"] if r["result"] == "refused"]
    # 2. SIGTERM, then wait the grace period
    term = send(processes, "SIGTERM", scope)
    from chaosgpu.process.actions import wait_gone

    waited = wait_gone(targets, min(grace_s, left()))
    report["steps"].append({"step": "sigterm", "sent": term["sent"], "gone_in_grace":
                            waited["all_gone"], "t": round(time.monotonic() - started, 4)})
    # 3. SIGKILL what is left, wait for death
    remaining = [p for p in processes if p["pid"] in set(waited["still_alive"])]
    if remaining:
        kill = send(remaining, "SIGKILL", scope)
        killed_targets = [{"pid": p["pid"], "starttime": p.get("starttime")} for p in remaining]
        waited = wait_gone(killed_targets, left())
        report["steps"].append({"step": "sigkill", "sent": kill["sent"],
                                "all_dead": waited["all_gone"],
                                "t": round(time.monotonic() - started, 4)})
    report["reaped"] = reap_if_children(all_pids, min(2.0, left()))
    # 4. GPU memory back: NVML no longer lists any of them
    gpu_released: bool | None = None
    gpu = _gpu_pids()
    while gpu is not None and set(all_pids) & gpu and left() > 0:
        time.sleep(0.02)
        gpu = _gpu_pids()
    if gpu is not None:
        gpu_released = not (set(all_pids) & gpu)
    report["steps"].append({"step": "gpu_release", "released": gpu_released,
                            "note": None if gpu is not None else "NVML not available here",
                            "t": round(time.monotonic() - started, 4)})
    # 5. the honest account
    from chaosgpu.node import process_state

    not_removed = []
    removed = []
    zombies = []
    for target in targets:
        pid = target["pid"]
        if is_alive(pid, target["starttime"]):
            not_removed.append({"pid": pid, "reason": "still alive at the deadline"})
        elif process_state(pid) in ("Z", "X") and not _reused(pid, target["starttime"]):
            removed.append(pid)
            zombies.append({"pid": pid, "note": "dead but not reaped by its parent yet (a "
                            "zombie: holds no memory, holds a PID)"})
        else:
            removed.append(pid)
    report["zombies"] = zombies
    for item in refused:
        not_removed.append({"pid": item["pid"], "reason": f"refused: {item['reason']}"})
    report.update(removed=removed, not_removed=not_removed, gpu_memory_released=gpu_released,
                  took_s=round(time.monotonic() - started, 4))
    if not_removed:
        logger.warning("chaosgpu: hang cleanup could not remove everything: %s", not_removed)
    if zombies:
        logger.info("chaosgpu: dead, awaiting their parent's reap: %s", [z["pid"] for z in zombies])
    return report


def _reused(pid: int, starttime: int | None) -> bool:
    from chaosgpu.node import process_starttime

    return starttime is not None and process_starttime(pid) != starttime
