"""Chaos Toolkit probes on local pods (sandboxes): existence, processes, zombies, orphans.

This module owns only the probe signatures; the readings come from chaosgpu.sandbox.runtime and,
for orphans, from the census (chaosgpu.node: the one orphan rule).
A missing sandbox reads as absent (False, empty lists, 0), never as an error, so steady-state
hypotheses can use it before and after an experiment.
"""

from typing import Any, Dict, List, Optional

from chaosgpu.arguments import TEXT, checked
from chaosgpu.node import take_census
from chaosgpu.sandbox import runtime

__all__ = [
    "sandbox_exists",
    "sandbox_processes",
    "sandbox_zombies",
    "sandbox_zombie_count",
    "sandbox_orphans",
    "sandboxes",
]


def _processes(name: str) -> list[dict[str, Any]]:
    if runtime.get_record(name) is None:
        return []
    return runtime.processes(name)


@checked(name=TEXT)
def sandbox_exists(
    name: str,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> bool:
    """Tell whether sandbox `name` is running (its recorded PID 1 is alive)."""
    return any(s["name"] == name and s["alive"] for s in runtime.list_sandboxes())


@checked(name=TEXT)
def sandbox_processes(
    name: str,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """List the processes in sandbox `name`'s PID namespace: host pid, namespace pid, namespace
    ppid, state (Z = zombie) and command line."""
    return _processes(name)


@checked(name=TEXT)
def sandbox_zombies(
    name: str,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[int]:
    """Host PIDs of the zombie processes in sandbox `name` (what `sleep` as PID 1 never reaps)."""
    return [p["pid"] for p in _processes(name) if p["zombie"]]


@checked(name=TEXT)
def sandbox_zombie_count(
    name: str,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> int:
    """How many zombie processes sandbox `name` holds (0 for a missing sandbox)."""
    return len(sandbox_zombies(name))


@checked(name=TEXT)
def sandbox_orphans(
    name: str,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[int]:
    """Host PIDs of live processes in sandbox `name` that are orphans by the census's one rule
    (docs/census.md): reparented to the pod's PID 1 or a subreaper and not started by it (the
    field report's orphaned workers); the same answer the census gives from inside the pod."""
    if runtime.get_record(name) is None:
        return []
    pids = runtime.host_pids(name)
    if not pids:
        return []
    census = take_census(pids=pids, gpu=False, env=False, fds=False)
    return sorted(p["pid"] for p in census["processes"] if p["orphan"] and not p["zombie"])


def sandboxes(
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Every recorded sandbox with `alive` and `abandoned` (record present but its supervisor or
    the runner that created it is gone, or nothing runs behind it any more)."""
    return runtime.list_sandboxes()
