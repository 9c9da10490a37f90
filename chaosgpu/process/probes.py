"""Chaos Toolkit probes on the processes of a declared scope: what is there, zombies, orphans,
and whether anything is left at all (a steady-state check).

This module owns read-only questions about a scope. It reads the node through the census
(chaosgpu.scope -> chaosgpu.node) and must not signal anything. Probes observe: other users'
processes and namespace inits are counted (they are refused only for signals).

A scope that matches no process fails (ScopeError) unless this run has met its selection (a
workload it started, a process once seen carrying the tag or job: it ended) or `missing_ok`
allows it: true (always), or "before-method" (the default, the catalog's form: before the
experiment's method starts, as the timeline control marks it). So a typo'd tag, job, pod or
sandbox never reads as "no zombies" or "nothing left" (chaosgpu.scope.resolve_observed, the
rule of chaosgpu.arguments.missing_allowed). A `pids` scope is numbers from an earlier result:
PIDs that are gone read as nothing there.
"""

import logging
from typing import Any, Dict, List, Optional, Union

from chaosgpu.arguments import MISSING_OK, checked
from chaosgpu.scope import SCOPE, describe_scope, resolve_observed

__all__ = ["processes_in_scope", "zombies_in_scope", "orphans_in_scope", "nothing_left"]

logger = logging.getLogger("chaostoolkit")

SUMMARY_KEYS = ("pid", "ppid", "state", "zombie", "orphan", "uid", "comm", "starttime", "nspid",
                "ns_init", "tag")


MissingOk = Union[bool, str]


def _observed(scope: dict[str, Any] | None, missing_ok: Any
              ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    detail = resolve_observed(scope, missing_ok)
    return detail["scope"], detail["processes"]


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def processes_in_scope(scope: Dict[str, Any], missing_ok: MissingOk = "before-method",
                       configuration: Optional[Dict[str, Any]] = None,
                       secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """List the processes a declared scope covers now (pid, ppid, state, zombie, orphan, uid,
    comm, starttime, NSpid, namespace init, tag), as the census sees them; the runner, host
    PID 1 and kernel threads are never listed. A scope matching nothing: see `missing_ok` in
    the module docstring."""
    _, processes = _observed(scope, missing_ok)
    return [{k: p.get(k) for k in SUMMARY_KEYS} for p in processes]


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def zombies_in_scope(scope: Dict[str, Any], missing_ok: MissingOk = "before-method",
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> int:
    """Count the zombie processes (dead, not reaped by their parent) in a declared scope: a
    steady state of "no zombies" uses tolerance 0. The PIDs are logged. A scope matching
    nothing fails, or counts 0 where `missing_ok` allows it (see the module docstring)."""
    checked, processes = _observed(scope, missing_ok)
    zombies = [p["pid"] for p in processes if p.get("zombie")]
    if zombies:
        logger.info("chaosgpu: zombies in %s: %s", describe_scope(checked), zombies)
    return len(zombies)


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def orphans_in_scope(scope: Dict[str, Any], missing_ok: MissingOk = "before-method",
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> int:
    """Count the orphan processes (reparented to their namespace's init or a subreaper, per the
    census rule) in a declared scope; tolerance 0 for "no orphans". The PIDs are logged. A
    scope matching nothing fails, or counts 0 where `missing_ok` allows it (see the module
    docstring)."""
    checked, processes = _observed(scope, missing_ok)
    orphans = [p["pid"] for p in processes if p.get("orphan")]
    if orphans:
        logger.info("chaosgpu: orphans in %s: %s", describe_scope(checked), orphans)
    return len(orphans)


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def nothing_left(scope: Dict[str, Any], missing_ok: MissingOk = "before-method",
                 configuration: Optional[Dict[str, Any]] = None,
                 secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when a declared scope covers no process at all, zombies included: the steady state
    "nothing the experiment started is left" (tolerance true). A scope that matches nothing
    (a sandbox not recorded, a tag no process carries) is empty only where this run has met it
    (a workload it started, a sandbox it created: since ended or removed) or `missing_ok` allows
    it ("before-method", the default: before the method starts); otherwise the probe fails, so
    a typo'd tag or sandbox never passes. What is left is logged."""
    checked, processes = _observed(scope, missing_ok)
    if processes:
        logger.info("chaosgpu: left in %s: %s", describe_scope(checked),
                    [(p["pid"], p.get("comm"), p.get("state")) for p in processes])
    return not processes
