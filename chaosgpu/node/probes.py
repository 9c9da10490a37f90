"""Chaos Toolkit probes on the node's truth: snapshot, zombies, orphans, jobs (a job's ranks:
chaosgpu.job.probes.job_ranks).

This module owns the probe functions that experiments call; every value comes from one census
(`chaosgpu.node.take_census`), never from a reading of /proc of its own. The `scope` filter here
is resolved by `chaosgpu.scope` (the one scope resolver). A scope that matches no process fails
unless this run has met its selection (it ended) or `missing_ok` allows it: true, or
"before-method" (the default: before the experiment's method starts), so a typo'd tag never
reads as "no zombies" (chaosgpu.scope.resolve_observed).
"""

from typing import Any, Dict, List, Optional, Union

from chaosgpu.arguments import BOOL, MISSING_OK, POSITIVE_SECONDS, checked
from chaosgpu.node import take_census
from chaosgpu.scope import SCOPE

__all__ = ["node_snapshot", "zombies", "orphans", "jobs", "hung_jobs"]


def _select(flag: str, scope: dict[str, Any] | None, missing_ok: Any) -> list[dict[str, Any]]:
    """The census processes with `flag` set, within `scope` when one is given (resolved by
    chaosgpu.scope, the one scope resolver: tag, sandbox, job, pids; a scope matching nothing
    as `missing_ok` allows)."""
    if scope is None:
        census = take_census(gpu=False, fds=False, cache=True)  # polled: stat per known PID
        processes = census["processes"]
    else:
        from chaosgpu.scope import resolve_observed

        census = take_census(gpu=False, fds=False, cache=True)
        processes = resolve_observed(scope, missing_ok, census=census,
                                     observe=False)["processes"]
    return [_described(p) for p in processes if p.get(flag)]


def _described(proc: dict[str, Any]) -> dict[str, Any]:
    nspid = proc.get("nspid") or []
    return {"pid": proc["pid"], "host_pid": nspid[0] if nspid else None,
            "ns_pid": nspid[-1] if nspid else None, "ppid": proc["ppid"],
            "state": proc["state"], "uid": proc["uid"], "comm": proc["comm"],
            "cmdline": proc["cmdline"], "tag": proc["tag"], "container": proc["container"],
            "orphan_reason": proc.get("orphan_reason")}


@checked(gpu=BOOL, env=BOOL, fds=BOOL)
def node_snapshot(gpu: bool = True, env: bool = True, fds: bool = True,
                  configuration: Optional[Dict[str, Any]] = None,
                  secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Return the whole node census (schema chaosgpu.census/1: GPUs, processes, GPU processes
    attributed to host and namespace PIDs, containers and job ranks, zombies, orphans, jobs);
    set `gpu`, `env` or `fds` to false to skip NVML, environments or fd scanning."""
    return take_census(gpu=gpu, env=env, fds=fds)


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def zombies(scope: Optional[Dict[str, Any]] = None,
            missing_ok: Union[bool, str] = "before-method",
            configuration: Optional[Dict[str, Any]] = None,
            secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Return the zombie processes (state Z: exited, not reaped by their parent) in `scope`
    (a dict with any of tag, sandbox, job, pids; none = the whole node), each with its host and
    namespace PID, parent, owner, container and tag; an empty list is the healthy value. A
    scope matching nothing: see `missing_ok` in the module docstring."""
    return _select("zombie", scope, missing_ok)


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def orphans(scope: Optional[Dict[str, Any]] = None,
            missing_ok: Union[bool, str] = "before-method",
            configuration: Optional[Dict[str, Any]] = None,
            secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Return the orphan processes (reparented to their PID namespace's init or a subreaper and
    not started by it on purpose; rule in docs/census.md) in `scope` (tag, sandbox, job, pids),
    each with host and namespace PID, parent, container and the reason it counts as orphan. A
    scope matching nothing: see `missing_ok` in the module docstring."""
    return _select("orphan", scope, missing_ok)


def jobs(configuration: Optional[Dict[str, Any]] = None,
         secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """Return the distributed-training jobs found in one reading (by their ranks' environment:
    TORCHELASTIC_RUN_ID but not torchrun's default "none", CHAOSGPU_JOB or
    MASTER_ADDR:MASTER_PORT, qualified by network namespace where one loopback id is seen in
    several; or by their rendezvous
    store's connections where no environment names them), each with world size, launcher,
    restart count, ranks and their states now (alive, stopped, frozen, zombie, missing). No
    verdict: whether a job runs or hangs is observed over time (chaosgpu.job.probes)."""
    census = take_census(gpu=True, fds=False, cache=True)
    result: list[dict[str, Any]] = census["jobs"]
    return result


@checked(window_s=POSITIVE_SECONDS)
def hung_jobs(window_s: float = 3.0, configuration: Optional[Dict[str, Any]] = None,
              secrets: Optional[Dict[str, Any]] = None) -> List[str]:
    """Observe every training job on the node for about `window_s` (plus a second) and return
    the ids of those observed hung (no progress for the window while live ranks wait in a
    collective, barrier or rendezvous); an empty list is the healthy value for a steady state.
    As non-root, other users' jobs are invisible (see `chaosgpu jobs`)."""
    from chaosgpu.job.observe import Observer

    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or window_s <= 0:
        raise ValueError(f"window_s must be a number of seconds > 0, got {window_s!r}")
    observer = Observer(window_s=float(window_s), all_jobs=True)
    try:
        observer.run(lambda o: bool(o.tracks) and all(
            t.verdict in ("hung", "failed", "finished") for t in o.tracks.values()),
            float(window_s) + 1.0)
        return sorted(t.id for t in observer.tracks.values() if t.verdict == "hung")
    finally:
        observer.close()
