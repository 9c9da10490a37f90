"""In-pod readings and faults built on the exec transport: the census seen from inside a pod, a
rank of a distributed-training job found in it, and that rank signalled from inside the pod.

This module owns how the in-target programs are combined in a pod: `probes/node_census.py` reads
(it is the one reading of /proc and NVML; nothing here parses /proc), `actions/signal_processes.py`
signals (pidfd, start-time identity check, its refusal rules). Both are streamed in by exec.py;
the pod needs nothing but a Python 3 interpreter. It must not select pods (selection.py does).
"""

import json
from typing import Any

from kubernetes import client

from chaosgpu.k8s.exec import ExecError, run_program
from chaosgpu.process.terminate import not_stopped

__all__ = ["census", "summarize_census", "find_rank", "signal_rank"]


def census(core: client.CoreV1Api, name: str, ns: str, container: str | None = None,
           timeout: float = 60.0, args: list[str] | None = None,
           python: str = "python3") -> dict[str, Any]:
    """Run the census inside the pod's container; return its document (schema census/1)."""
    document = run_program(core, name, ns, "probes", "node_census", args=args,
                           container=container, timeout=timeout, python=python)
    if not isinstance(document, dict) or "processes" not in document:
        raise ExecError(f"the census in pod {ns}/{name} returned no census document")
    return document


def summarize_census(document: dict[str, Any]) -> dict[str, Any]:
    """Return the parts of an in-pod census an experiment judges on (small, JSON)."""
    processes = document.get("processes") or []
    by_pid = {p.get("pid"): p for p in processes}
    init = next((p for p in processes if p.get("pid") == 1), None)

    def brief(pid: Any) -> dict[str, Any]:
        proc = by_pid.get(pid) or {}
        return {"pid": pid, "nspid": proc.get("nspid"), "ppid": proc.get("ppid"),
                "state": proc.get("state"), "comm": proc.get("comm"),
                "orphan_reason": proc.get("orphan_reason")}

    return {
        "schema": document.get("schema"),
        "taken_at": document.get("taken_at"),
        "duration_ms": document.get("duration_ms"),
        "observer": document.get("observer"),
        "pid1": ({"comm": init.get("comm"), "cmdline": init.get("cmdline")} if init else None),
        "process_count": len(processes),
        "zombies": [brief(pid) for pid in (document.get("zombies") or [])],
        "orphans": [brief(pid) for pid in (document.get("orphans") or [])],
        "zombie_count": len(document.get("zombies") or []),
        "orphan_count": len(document.get("orphans") or []),
        "gpu": {k: v for k, v in (document.get("gpu") or {}).items() if k != "devices"},
        "gpu_processes": document.get("gpu_processes") or [],
        "jobs": document.get("jobs") or [],
        "errors": document.get("errors") or [],
    }


def find_rank(document: dict[str, Any], rank: int, job: str | None = None) -> dict[str, Any]:
    """Return {"job", "rank", "pid", "starttime", "state"} of a rank in an in-pod census."""
    jobs = document.get("jobs") or []
    if job is not None:
        jobs = [j for j in jobs if j.get("id") == job]
        if not jobs:
            known = [j.get("id") for j in document.get("jobs") or []]
            raise ExecError(f"no job {job!r} in the pod (jobs seen: {known or 'none'})")
    if not jobs:
        raise ExecError("no distributed-training job is visible in the pod (no process with "
                        "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in its environment, and no "
                        "rendezvous store its torch processes are connected to)")
    if len(jobs) > 1:
        raise ExecError("several jobs in the pod; name one with `job`: "
                        + ", ".join(str(j.get("id")) for j in jobs))
    chosen = jobs[0]
    entries = [r for r in chosen.get("ranks") or [] if r.get("rank") == rank]
    if not entries or all(r.get("pid") is None for r in entries):
        present = [r.get("rank") for r in chosen.get("ranks") or [] if r.get("pid") is not None]
        raise ExecError(f"rank {rank} of job {chosen.get('id')!r} has no process in the pod "
                        f"(ranks present: {present})")
    entry = next(r for r in entries if r.get("pid") is not None)
    proc: dict[str, Any] = next((p for p in document.get("processes") or []
                                 if p.get("pid") == entry["pid"]), {})
    if proc.get("starttime") is None:
        raise ExecError(f"rank {rank}: the census could not read the start time of pid "
                        f"{entry['pid']}, refusing to signal it")
    return {"job": chosen.get("id"), "rank": rank, "pid": entry["pid"],
            "starttime": proc["starttime"], "state": entry.get("state"),
            "comm": proc.get("comm")}


def signal_rank(core: client.CoreV1Api, name: str, ns: str, rank: int, signal: str,
                job: str | None = None, container: str | None = None, timeout: float = 60.0,
                allow_other_users: bool = False, python: str = "python3") -> dict[str, Any]:
    """Find `rank` with an in-pod census, then signal it from inside the pod; return both. A
    stop signal's target is watched there until it is stopped (the program's STOP_WAIT_S):
    one that does not stop raises, with what its /proc said."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ExecError(f"rank must be a non-negative integer, not {rank!r}")
    document = census(core, name, ns, container=container, timeout=timeout,
                      args=["--no-fds", "--no-gpu"], python=python)
    target = find_rank(document, rank, job)
    args = [signal, json.dumps([{"pid": target["pid"], "starttime": target["starttime"]}])]
    if allow_other_users:
        args.append("--allow-other-users")
    report = run_program(core, name, ns, "actions", "signal_processes", args=args,
                         container=container, timeout=timeout, python=python)
    results = report.get("results") or [{}]
    outcome = results[0]
    if outcome.get("result") == "refused":
        raise ExecError(f"{signal} to rank {rank} (pid {target['pid']} in pod {ns}/{name}) "
                        f"refused: {outcome.get('reason')}", document=report)
    missed = not_stopped({"results": results})
    if missed:
        raise ExecError(f"{signal} was sent to rank {rank} (pid {target['pid']} in pod "
                        f"{ns}/{name}), but it was not seen stopped within the signalling "
                        f"program's wait: {missed[0]}", document=report)
    return {"pod": f"{ns}/{name}", "container": container, **target,
            "signal": report.get("signal"), "result": outcome.get("result"),
            "stopped": outcome.get("stopped"),
            "census_ms": document.get("duration_ms"), "signal_report": report}
