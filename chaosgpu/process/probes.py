"""Chaos Toolkit probes on the processes of a declared scope: what is there, zombies, orphans,
and whether anything is left at all (a steady-state check).

This module owns read-only questions about a scope. It reads the node through the census
(chaosgpu.scope -> chaosgpu.node) and must not signal anything. Probes observe: other users'
processes and namespace inits are counted (they are refused only for signals).
"""

import logging
from typing import Any, Dict, List, Optional, Union

from chaosgpu.scope import ScopeError, describe_scope, resolve_scope_detail, validate_scope

__all__ = ["processes_in_scope", "zombies_in_scope", "orphans_in_scope", "nothing_left"]

logger = logging.getLogger("chaostoolkit")

SUMMARY_KEYS = ("pid", "ppid", "state", "zombie", "orphan", "uid", "comm", "starttime", "nspid",
                "ns_init", "tag")


def _observed(scope: dict[str, Any] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    checked = validate_scope(scope)
    detail = resolve_scope_detail(checked, observe=True)
    return checked, detail["processes"]


def processes_in_scope(scope: Dict[str, Any],
                       configuration: Optional[Dict[str, Any]] = None,
                       secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """List the processes a declared scope covers now (pid, ppid, state, zombie, orphan, uid,
    comm, starttime, NSpid, namespace init, tag), as the census sees them; the runner, host
    PID 1 and kernel threads are never listed."""
    _, processes = _observed(scope)
    return [{k: p.get(k) for k in SUMMARY_KEYS} for p in processes]


def zombies_in_scope(scope: Dict[str, Any],
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> int:
    """Count the zombie processes (dead, not reaped by their parent) in a declared scope: a
    steady state of "no zombies" uses tolerance 0. The PIDs are logged."""
    checked, processes = _observed(scope)
    zombies = [p["pid"] for p in processes if p.get("zombie")]
    if zombies:
        logger.info("chaosgpu: zombies in %s: %s", describe_scope(checked), zombies)
    return len(zombies)


def orphans_in_scope(scope: Dict[str, Any],
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> int:
    """Count the orphan processes (reparented to their namespace's init or a subreaper, per the
    census rule) in a declared scope; tolerance 0 for "no orphans". The PIDs are logged."""
    checked, processes = _observed(scope)
    orphans = [p["pid"] for p in processes if p.get("orphan")]
    if orphans:
        logger.info("chaosgpu: orphans in %s: %s", describe_scope(checked), orphans)
    return len(orphans)


def nothing_left(scope: Dict[str, Any], missing_ok: Union[bool, str] = "before-method",
                 configuration: Optional[Dict[str, Any]] = None,
                 secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when a declared scope covers no process at all, zombies included: the steady state
    "nothing the experiment started is left" (tolerance true). A scope's sandbox that is not
    recorded counts as empty only where `missing_ok` allows it ("before-method", the default:
    before the method starts, and afterwards for a sandbox this run created, since removed);
    otherwise the probe fails, so a typo'd sandbox never passes. What is left is logged."""
    sandbox = scope.get("sandbox") if isinstance(scope, dict) else None
    try:
        checked, processes = _observed(scope)
    except ScopeError as error:
        if isinstance(sandbox, str) and "no sandbox named" in str(error):
            from chaosgpu.sandbox.probes import missing_allowed

            if missing_allowed(missing_ok, sandbox):
                return True
        raise
    if processes:
        logger.info("chaosgpu: left in %s: %s", describe_scope(checked),
                    [(p["pid"], p.get("comm"), p.get("state")) for p in processes])
    return not processes
