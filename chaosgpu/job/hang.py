"""Distributed-training jobs as one census reading sees them, and cleaning a hung job up.

This module owns finding a job's processes (ranks, launcher, tagged helpers) in a census, the
backend a job uses, and the rollback that removes a job: thaw, SIGTERM, grace, SIGKILL, wait for
death and GPU release (a process the signal rules refuse, such as another user's, is neither
signalled nor waited for; a cleanup that removed none of what it found raises; a stopped or
frozen launcher is sent its SIGTERM before anything resumes, so it restarts no rank). Whether
a job is hung is not decided here: that is a verdict observed over time (chaosgpu.job.observe
and chaosgpu.job.verdict). It reads the node only through the census (chaosgpu.node) and signals
only through chaosgpu.process.actions.send (the in-target signal program). It must not start
workloads. Every function that waits has its own deadline.
"""

import logging
import os
import re
import time
from typing import Any

from chaosgpu.arguments import POSITIVE_SECONDS, SECONDS
from chaosgpu.errors import ActivityError
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


def _refusal(result: dict[str, Any]) -> str:
    """The `not_removed` reason of a process the signal rules refused at `result["signal"]`
    (at SIGCONT, the cleanup's first signal: nothing was sent to it). The rules' hint to widen
    a scope ("set include_other_users to allow") is left out: a cleanup has no such option."""
    why = re.sub(r"\s*\(set include_\w+ to allow\)", "", str(result.get("reason")))
    if result.get("reason_code") == "other_user":
        why = f"another user's process ({why})"
    first = result["signal"] == "SIGCONT"
    return f"refused: {why}: " + ("nothing was sent to it" if first
                                  else f"{result['signal']} was not sent to it")


def cleanup(job: str | None = None, tag: str | None = None, grace_s: float = 5.0,
            deadline_s: float = 30.0) -> dict[str, Any]:
    """Thaw, SIGTERM, wait `grace_s`, SIGKILL, wait for death and GPU release; report honestly.
    A launcher that is stopped or frozen gets its SIGTERM first, while it cannot act: resumed
    before it, an elastic agent would start a new attempt's ranks this cleanup never saw.
    Idempotent: finding nothing is a normal outcome. A process the signal rules refuse
    (another user's, a namespace init, the runner) is sent nothing more, not waited for, and
    listed once in `not_removed` with the reason, or in `ended_by_themselves` when it is gone
    by the end (a namespace's PID 1 exits once its last child does). Raises ActivityError when
    processes were found, none of them was removed and some are left (refused, or still alive
    at the deadline): a rollback that removed nothing never reads as a success."""
    check_selector(job, tag)
    SECONDS.require("grace_s", grace_s)
    POSITIVE_SECONDS.require("deadline_s", deadline_s)
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
        report.update(removed=[], not_removed=[], zombies=[], ended_by_themselves=[],
                      gpu_memory_released=None,
                      note="nothing to clean up: no process of this job is left",
                      took_s=round(time.monotonic() - started, 4))
        return report
    scope = {"include_other_users": False, "include_ns_init": False}
    all_pids = [p["pid"] for p in processes]
    refused: dict[int, dict[str, Any]] = {}  # PID -> its refusal (and signal): nothing more sent

    def send_to(procs: list[dict[str, Any]], signal: str) -> dict[str, Any]:
        """Send `signal` to those of `procs` not refused yet; note the new refusals."""
        sent = send([p for p in procs if p["pid"] not in refused], signal, scope)
        for result in sent["results"]:
            if result["result"] == "refused":
                refused.setdefault(result["pid"], dict(result, signal=signal))
        return sent

    def targets(procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"pid": p["pid"], "starttime": p.get("starttime")} for p in procs
                if p["pid"] not in refused]

    # 0. a launcher that cannot act (stopped, or frozen) gets its SIGTERM before anything is
    # resumed: resumed first, an elastic agent restarts the ranks (a new attempt, processes
    # this cleanup never saw) before it learns it is to end; pending, the SIGTERM is the first
    # thing it handles once it runs again
    held = _held_launcher(processes, found)
    report["steps"] += [{"step": "sigterm_held_launcher", "pids": [p["pid"] for p in held],
                         "sent": send_to(held, "SIGTERM")["sent"],
                         "t": round(time.monotonic() - started, 4)}] if held else []
    # 1. thaw: a frozen process ignores SIGKILL until thawed (freezer) and SIGTERM until SIGCONT
    thawed = _thaw_freezer_groups(set(all_pids))
    cont = send_to(processes, "SIGCONT")
    report["steps"].append({"step": "thaw", "thawed_cgroups": thawed, "sigcont_sent": cont["sent"],
                            "t": round(time.monotonic() - started, 4)})
    # 2. SIGTERM, then wait the grace period (for the processes signalled only)
    term = send_to(processes, "SIGTERM")
    from chaosgpu.process.actions import wait_gone

    termed = targets(processes)
    waited = wait_gone(termed, min(grace_s, left()))
    report["steps"].append({"step": "sigterm", "sent": term["sent"], "gone_in_grace":
                            waited["all_gone"] if termed else None,
                            "t": round(time.monotonic() - started, 4)})
    # 3. SIGKILL what is left, wait for death
    remaining = [p for p in processes if p["pid"] in set(waited["still_alive"])]
    if remaining:
        kill = send_to(remaining, "SIGKILL")
        killed = targets(remaining)
        waited = wait_gone(killed, left())
        report["steps"].append({"step": "sigkill", "sent": kill["sent"],
                                "all_dead": waited["all_gone"] if killed else None,
                                "t": round(time.monotonic() - started, 4)})
    report["reaped"] = reap_if_children(all_pids, min(2.0, left()))
    # 4. GPU memory back: NVML no longer lists any of them (those signalled)
    signalled = {p["pid"] for p in processes if p["pid"] not in refused}
    gpu_released: bool | None = None
    gpu = _gpu_pids()
    while gpu is not None and signalled & gpu and left() > 0:
        time.sleep(0.02)
        gpu = _gpu_pids()
    if gpu is not None:
        gpu_released = not (signalled & gpu)
    report["steps"].append({"step": "gpu_release", "released": gpu_released,
                            "note": None if gpu is not None else "NVML not available here",
                            "t": round(time.monotonic() - started, 4)})
    # 5. the honest account
    removed, not_removed, zombies, ended = _account(processes, refused)
    report.update(zombies=zombies, removed=removed, not_removed=not_removed,
                  ended_by_themselves=ended, gpu_memory_released=gpu_released,
                  took_s=round(time.monotonic() - started, 4))
    if not removed and not_removed:
        what = f"tag {tag!r}" if tag is not None else f"job {report['job']!r}"
        raise ActivityError(f"cleanup of {what} removed none of the {len(processes)} "
                            "process(es) it found: " + "; ".join(
                                f"PID {item['pid']}: {item['reason']}" for item in not_removed))
    if not_removed:
        logger.warning("chaosgpu: hang cleanup could not remove everything: %s", not_removed)
    if zombies:
        logger.info("chaosgpu: dead, awaiting their parent's reap: %s", [z["pid"] for z in zombies])
    return report


def _held_launcher(processes: list[dict[str, Any]],
                   found: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The job's launcher among `processes` when it is stopped (state T, t) or in a frozen
    cgroup (as the census reads a rank's freezer state): it can start nothing until resumed."""
    from chaosgpu.node import process_state
    from chaosgpu.process import freezer

    pid = (found or {}).get("launcher_pid")
    for proc in processes:
        if proc["pid"] == pid:
            state = process_state(pid, starttime=proc.get("starttime"))
            if state in ("T", "t") or (state not in (None, "Z", "X")
                                        and freezer.frozen_now(pid)):
                return [proc]
    return []


def _account(processes: list[dict[str, Any]], refused: dict[int, dict[str, Any]]
             ) -> tuple[list[int], list[dict[str, Any]], list[dict[str, Any]],
                        list[dict[str, Any]]]:
    """(removed PIDs, not_removed entries, zombies, ended by themselves) after a cleanup: one
    entry per process. A refused one still alive is not removed; one gone by now (a
    namespace's PID 1 exits once its last child does) ended by itself: the cleanup sent it
    nothing, and nothing of it is left."""
    from chaosgpu.node import process_state

    removed: list[int] = []
    not_removed: list[dict[str, Any]] = []
    zombies: list[dict[str, Any]] = []
    ended: list[dict[str, Any]] = []
    for proc in processes:
        pid, starttime = proc["pid"], proc.get("starttime")
        if pid in refused and not is_alive(pid, starttime):
            ended.append({"pid": pid, "reason_code": refused[pid].get("reason_code"),
                          "note": _refusal(refused[pid]) + "; it ended by itself"})
        elif pid in refused:
            not_removed.append({"pid": pid, "reason": _refusal(refused[pid]),
                                "reason_code": refused[pid].get("reason_code")})
        elif is_alive(pid, starttime):
            not_removed.append({"pid": pid, "reason": "still alive at the deadline"})
        elif process_state(pid) in ("Z", "X") and not _reused(pid, starttime):
            removed.append(pid)
            zombies.append({"pid": pid, "note": "dead but not reaped by its parent yet (a "
                            "zombie: holds no memory, holds a PID)"})
        else:
            removed.append(pid)
    return removed, not_removed, zombies, ended


def _reused(pid: int, starttime: int | None) -> bool:
    from chaosgpu.node import process_starttime

    return starttime is not None and process_starttime(pid) != starttime
