"""Distributed-training jobs as the census sees them: finding a job, detecting a hang, gathering
evidence (survivors' Python stacks), and cleaning a hung job up.

A job is found by its id (TORCHELASTIC_RUN_ID, CHAOSGPU_JOB or MASTER_ADDR:MASTER_PORT, as the
census names it) or by the chaosgpu tag its ranks carry. A hang is a job with a dead, zombie,
missing, stopped or frozen rank while other ranks are alive: the survivors will block in their
next collective until the process-group timeout (10 minutes by default for NCCL). Detection polls
the census; it needs nothing from the job itself (no instrumentation).

This module owns that logic. It reads the node only through the census (chaosgpu.node) and
signals only through chaosgpu.process.actions.send (the in-target signal program). It must not
start workloads. Every function that waits has its own deadline.
"""

import logging
import os
import shutil
import subprocess
import time
from typing import Any

from chaosgpu.process.actions import _thaw_freezer_groups, is_alive, send

__all__ = ["JobError", "find_job", "job_processes", "detect", "python_stacks", "cleanup",
           "wait_survivors_exit", "reap_if_children",
           "job_backend"]

logger = logging.getLogger("chaostoolkit")

PY_SPY_TIMEOUT_S = 5.0


class JobError(ValueError):
    """A job that cannot be identified (none, or several, match)."""


def _census(gpu: bool = False) -> dict[str, Any]:
    from chaosgpu.node import take_census

    return take_census(gpu=gpu, fds=False)  # type: ignore[no-any-return]


def _check_selector(job: str | None, tag: str | None) -> None:
    if job is None and tag is None:
        raise JobError("name the job: give job=<id> (as `chaosgpu snapshot` lists it) or "
                       "tag=<the workload's tag>")
    for name, value in (("job", job), ("tag", tag)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise JobError(f"{name} must be a non-empty string, got {value!r}")


def find_job(census: dict[str, Any], job: str | None = None,
             tag: str | None = None) -> dict[str, Any] | None:
    """Return the census job named by id or by its ranks' tag; None when there is none; raise
    JobError when a tag matches several jobs."""
    _check_selector(job, tag)
    jobs = census.get("jobs") or []
    if job is not None:
        matches = [j for j in jobs if j.get("id") == job]
    else:
        by_pid = {p["pid"]: p for p in census.get("processes") or []}
        matches = [j for j in jobs if any(
            r.get("pid") in by_pid and by_pid[r["pid"]].get("tag") == tag
            for r in j.get("ranks") or [])]
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


def python_stacks(pids: list[int], stopped: set[int] | None = None,
                  timeout_s: float = PY_SPY_TIMEOUT_S,
                  total_deadline_s: float = 3 * PY_SPY_TIMEOUT_S) -> dict[str, Any]:
    """Python stacks of `pids` through `py-spy dump` (`--nonblocking` for stopped processes);
    {"available": False, "note"} when py-spy is not installed. Each dump has a deadline
    (`timeout_s`) and all of them together another (`total_deadline_s`): PIDs not reached are
    listed under "skipped"."""
    exe = shutil.which("py-spy")
    if exe is None:
        return {"available": False,
                "note": "py-spy is not installed: no Python stacks (pip install py-spy)"}
    stacks: dict[str, Any] = {}
    end = time.monotonic() + total_deadline_s
    skipped: list[int] = []
    for pid in pids:
        if time.monotonic() >= end:
            skipped.append(pid)
            continue
        argv = [exe, "dump", "--pid", str(pid)]
        if stopped and pid in stopped:
            argv.append("--nonblocking")
        try:
            out = subprocess.run(argv, capture_output=True, text=True,
                                 timeout=min(timeout_s, max(0.1, end - time.monotonic())),
                                 stdin=subprocess.DEVNULL)
            stacks[str(pid)] = (out.stdout if out.returncode == 0
                                else f"py-spy failed (exit {out.returncode}): "
                                     f"{out.stderr.strip()[-500:]}")
        except subprocess.TimeoutExpired:
            stacks[str(pid)] = f"py-spy gave no answer within {timeout_s}s"
    return {"available": True, "stacks": stacks, "skipped": skipped}


def _fault_mark() -> dict[str, Any] | None:
    from chaosgpu.timeline.sampler import current

    sampler = current()
    if sampler is None:
        return None
    faults = [e for e in sampler.events if e["name"].startswith("fault:")]
    if not faults:
        return None
    event = dict(faults[-1])
    event["at"] = sampler.t0 + event["t"]
    return event


def detect(job: str | None = None, tag: str | None = None, timeout_s: float = 5.0,
           poll_s: float = 0.1, stacks: bool = True) -> dict[str, Any]:
    """Poll the census until the job hangs (a dead/zombie/missing/stopped/frozen rank and live
    survivors) or `timeout_s` passes; return the evidence."""
    _check_selector(job, tag)
    if timeout_s < 0 or poll_s <= 0:
        raise ValueError("timeout_s must be >= 0 and poll_s > 0")
    started = time.time()
    deadline = time.monotonic() + timeout_s
    polls = 0
    found = None
    census: dict[str, Any] = {}
    while True:
        census = _census(gpu=True)
        polls += 1
        found = find_job(census, job, tag)
        if found is not None and found.get("hang_suspected"):
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    detected_at = time.time()
    result: dict[str, Any] = {"job": found.get("id") if found else job, "tag": tag,
                              "hung": bool(found and found.get("hang_suspected")),
                              "polls": polls, "waited_s": round(detected_at - started, 4)}
    if found is None:
        result["note"] = "no such job in the census (not started, or every rank is gone)"
        return result
    result.update(_rank_summary(found))
    result["world_size"] = found.get("world_size")
    result["backend"] = job_backend(census, found)
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    result["survivors"] = [{"rank": r["rank"], "pid": r["pid"], "gpu_mib": r.get("gpu_mib"),
                            "state": (by_pid.get(r["pid"]) or {}).get("state")}
                           for r in found.get("ranks") or [] if r.get("state") == "alive"]
    result["faulty"] = [{"rank": r["rank"], "pid": r.get("pid"), "state": r.get("state")}
                        for r in found.get("ranks") or [] if r.get("state") != "alive"]
    if not result["hung"]:
        result["note"] = "no hang: every rank alive" if not result["faulty"] else \
            "no hang: no rank survives"
        return result
    result["first_seen"] = detected_at
    fault = _fault_mark()
    if fault is not None:
        result["fault"] = fault
        result["detected_after_fault_s"] = round(detected_at - fault["at"], 4)
    if stacks:
        stopped = {r["pid"] for r in result["faulty"] if r.get("state") in ("stopped", "frozen")
                   and r.get("pid")}
        pids = [s["pid"] for s in result["survivors"]]
        result["python_stacks"] = python_stacks(pids + sorted(stopped), stopped)
    result["returned_after_s"] = round(time.time() - started, 4)
    return result


def wait_survivors_exit(job: str | None = None, tag: str | None = None,
                        timeout_s: float = 60.0, poll_s: float = 0.1) -> dict[str, Any]:
    """Wait until every rank that is alive now (not stopped, frozen or dead) has exited, or
    `timeout_s` passes; report which exited, after how long, and which are still alive."""
    _check_selector(job, tag)
    if timeout_s < 0 or poll_s <= 0:
        raise ValueError("timeout_s must be >= 0 and poll_s > 0")
    started = time.monotonic()
    census = _census(gpu=False)
    found = find_job(census, job, tag)
    if found is None:
        return {"job": job, "tag": tag, "all_exited": True, "survivors": [],
                "exited_after_s": {}, "still_alive": [], "survivors_left": [], "waited_s": 0.0,
                "note": "no such job in the census: no survivor is left"}
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    survivors = [{"rank": r["rank"], "pid": r["pid"],
                  "starttime": (by_pid.get(r["pid"]) or {}).get("starttime")}
                 for r in found.get("ranks") or [] if r.get("state") == "alive"]
    exited: dict[str, float] = {}
    pending = list(survivors)
    while True:
        now = time.monotonic()
        for survivor in list(pending):
            if not is_alive(survivor["pid"], survivor["starttime"]):
                exited[str(survivor["rank"])] = round(now - started, 4)
                pending.remove(survivor)
        if not pending or now - started >= timeout_s:
            break
        time.sleep(poll_s)
    reap_if_children([s["pid"] for s in survivors if s not in pending], 0.5)
    result = {"job": found.get("id"), "tag": tag, "all_exited": not pending,
              "survivors": [s["rank"] for s in survivors], "exited_after_s": exited,
              "still_alive": [{"rank": s["rank"], "pid": s["pid"]} for s in pending],
              "survivors_left": [s["rank"] for s in pending],
              "waited_s": round(time.monotonic() - started, 4)}
    gpu = _gpu_pids()
    if gpu is not None:
        result["still_on_gpu"] = sorted({s["pid"] for s in survivors} & gpu)
    return result


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
    _check_selector(job, tag)
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
