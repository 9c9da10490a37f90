"""Chaos Toolkit probes on the node's truth: snapshot, zombies, orphans, jobs and their ranks.

This module owns the probe functions that experiments call; every value comes from one census
(`chaosgpu.node.take_census`), never from a reading of /proc of its own. The `scope` filter here
is deliberately simple (tag, sandbox, job, pids, observer-visible PIDs only); the full scope
resolution with refusal rules lives in `chaosgpu.scope`.
"""

from typing import Any

from chaosgpu.node import take_census

__all__ = ["node_snapshot", "zombies", "orphans", "jobs", "job_ranks", "hung_jobs"]


def _in_scope(proc: dict[str, Any], scope: dict[str, Any] | None) -> bool:
    """Whether a census process record matches a simple scope dict (all given keys must match)."""
    if not scope:
        return True
    if "pids" in scope:
        wanted = {int(p) for p in scope["pids"]}
        nspid = proc.get("nspid") or []
        if proc["pid"] not in wanted and not (nspid and nspid[0] in wanted):
            return False
    env = proc.get("env") or {}
    if "tag" in scope and proc.get("tag") != scope["tag"]:
        return False
    if "sandbox" in scope:
        container = proc.get("container") or {}
        in_sandbox = (env.get("CHAOSGPU_SANDBOX") == scope["sandbox"]
                      or (container.get("runtime") == "sandbox"
                          and container.get("id") == scope["sandbox"]))
        if not in_sandbox:
            return False
    if "job" in scope:
        job_ids = {env.get("TORCHELASTIC_RUN_ID"), env.get("CHAOSGPU_JOB")}
        if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            job_ids.add(f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
        if scope["job"] not in job_ids:
            return False
    return True


def _check_scope(scope: Any) -> None:
    if scope is None:
        return
    if not isinstance(scope, dict):
        raise ValueError(f"scope must be a dict like {{'tag': 'x'}}, got {scope!r}")
    unknown = set(scope) - {"tag", "sandbox", "job", "pids", "pod", "include_other_users",
                            "include_ns_init"}
    if unknown:
        raise ValueError(f"unknown scope keys {sorted(unknown)}; expected tag, sandbox, job, pids")
    if "pod" in scope:
        raise ValueError("scope 'pod' is resolved by chaosgpu.scope / chaosgpu.k8s, not here")


def _described(proc: dict[str, Any]) -> dict[str, Any]:
    nspid = proc.get("nspid") or []
    return {"pid": proc["pid"], "host_pid": nspid[0] if nspid else None,
            "ns_pid": nspid[-1] if nspid else None, "ppid": proc["ppid"],
            "state": proc["state"], "uid": proc["uid"], "comm": proc["comm"],
            "cmdline": proc["cmdline"], "tag": proc["tag"], "container": proc["container"],
            "orphan_reason": proc.get("orphan_reason")}


def node_snapshot(gpu: bool = True, env: bool = True, fds: bool = True,
                  configuration: dict[str, Any] | None = None,
                  secrets: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the whole node census (schema chaosgpu.census/1: GPUs, processes, GPU processes
    attributed to host and namespace PIDs, containers and job ranks, zombies, orphans, jobs);
    set `gpu`, `env` or `fds` to false to skip NVML, environments or fd scanning."""
    return take_census(gpu=gpu, env=env, fds=fds)


def zombies(scope: dict[str, Any] | None = None,
            configuration: dict[str, Any] | None = None,
            secrets: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Return the zombie processes (state Z: exited, not reaped by their parent) in `scope`
    (a dict with any of tag, sandbox, job, pids; none = the whole node), each with its host and
    namespace PID, parent, owner, container and tag; an empty list is the healthy value."""
    _check_scope(scope)
    census = take_census(gpu=False, fds=False)
    return [_described(p) for p in census["processes"] if p["zombie"] and _in_scope(p, scope)]


def orphans(scope: dict[str, Any] | None = None,
            configuration: dict[str, Any] | None = None,
            secrets: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Return the orphan processes (reparented to their PID namespace's init or a subreaper and
    not started by it on purpose; rule in docs/census.md) in `scope` (tag, sandbox, job, pids),
    each with host and namespace PID, parent, container and the reason it counts as orphan."""
    _check_scope(scope)
    census = take_census(gpu=False, fds=False)
    return [_described(p) for p in census["processes"] if p["orphan"] and _in_scope(p, scope)]


def jobs(configuration: dict[str, Any] | None = None,
         secrets: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Return the distributed-training jobs found from process environments (TORCHELASTIC_RUN_ID,
    CHAOSGPU_JOB or MASTER_ADDR:MASTER_PORT), each with world size, launcher, ranks and their
    states (alive, stopped, frozen, zombie, missing) and `hang_suspected`."""
    census = take_census(gpu=True, fds=False)
    result: list[dict[str, Any]] = census["jobs"]
    return result


def job_ranks(job: str = "", configuration: dict[str, Any] | None = None,
              secrets: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Return the ranks of job `job` (its id as in `jobs`), each with rank, local rank, PID,
    namespace PID, state and GPU MiB; raises ValueError naming the jobs seen if there is none
    with that id."""
    if not job:
        raise ValueError("job_ranks needs the job id (see the jobs probe)")
    found = [j for j in jobs() if j["id"] == job]
    if not found:
        seen = [j["id"] for j in jobs()]
        raise ValueError(f"no job {job!r} on this node; jobs seen: {seen}")
    result: list[dict[str, Any]] = found[0]["ranks"]
    return result


def hung_jobs(configuration: dict[str, Any] | None = None,
              secrets: dict[str, Any] | None = None) -> list[str]:
    """Return the ids of jobs with a hang suspected (a rank dead, stopped or frozen while
    another is alive); an empty list is the healthy value for a steady state."""
    return [j["id"] for j in jobs() if j["hang_suspected"]]
