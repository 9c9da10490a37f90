"""Chaos Toolkit probes on local pods (sandboxes): existence, processes, zombies, orphans.

This module owns only the probe signatures; the readings come from chaosgpu.sandbox.runtime and,
for orphans, from the census (chaosgpu.node: the one orphan rule).
Every probe on a sandbox by name, `sandbox_exists` included, fails (ActivityError naming the
sandbox) when no sandbox of that name is recorded, so a typo'd name never passes a steady state
(not even "the pod is gone"), unless `missing_ok` allows it: true
(always: empty lists, 0) or "before-method" (the default, as the job probes' catalog form):
before the experiment's method has started (the timeline control marks it), and afterwards
for a sandbox this run asked to create (removed since, or never started). Without the timeline
control the method's start is unknown: "before-method" then accepts only a sandbox this run
asked to create, and the error says the control is what tells before from after.
"""

from typing import Any, Dict, List, Optional, Union

from chaosgpu import arguments
from chaosgpu.arguments import MISSING_OK, Rule, checked
from chaosgpu.errors import ActivityError
from chaosgpu.node import take_census
from chaosgpu.sandbox import runtime

MissingOk = Union[bool, str]
#: a sandbox's name, as chaosgpu.sandbox.runtime takes it (its own check): refused before
#: anything is read or started, and by `chaosgpu validate` before a run
SANDBOX_NAME = Rule.by_check("a sandbox name", runtime._validate_name)

__all__ = [
    "sandbox_exists",
    "sandbox_processes",
    "sandbox_zombies",
    "sandbox_zombie_count",
    "sandbox_orphans",
    "sandboxes",
]


def missing_allowed(missing_ok: Any, name: str) -> bool:
    """Whether sandbox `name`, not recorded, may read as empty (chaosgpu.arguments'
    missing_allowed; "before-method" accepts afterwards a sandbox this run asked to create). Not
    a probe (left out of __all__): the rule for any activity that reads a sandbox by name."""
    return arguments.missing_allowed(missing_ok, runtime.created_here(name))


def recorded(name: str, missing_ok: Any) -> bool:
    """True when sandbox `name` is recorded; False when it is not and `missing_ok` allows it
    (missing_allowed); otherwise ActivityError naming the sandbox and those recorded. Not a
    probe (left out of __all__): the check of any activity that reads or removes a sandbox by
    name, so that a typo'd name never reads as "nothing there" nor as "removed"."""
    allowed = missing_allowed(missing_ok, name)  # a bad missing_ok is refused either way
    if runtime.get_record(name) is not None:
        return True
    if allowed:
        return False
    known = sorted(s["name"] for s in runtime.list_sandboxes())
    raise ActivityError(f"no sandbox named {name!r} is recorded, and this run never created "
                        f"it: a typo? Recorded sandboxes: {known or 'none'}. A sandbox that "
                        f"may be absent {arguments.missing_advice(missing_ok)}")


def _processes(name: str, missing_ok: Any) -> list[dict[str, Any]]:
    return runtime.processes(name) if recorded(name, missing_ok) else []


@checked(name=SANDBOX_NAME, missing_ok=MISSING_OK)
def sandbox_exists(
    name: str,
    missing_ok: MissingOk = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> bool:
    """Tell whether sandbox `name` is running (its recorded PID 1 is alive). A sandbox not
    recorded is false only where `missing_ok` allows it (see the module docstring): otherwise
    it fails, so a steady state "the pod is gone" never passes on a typo'd name."""
    if not recorded(name, missing_ok):
        return False
    return any(s["name"] == name and s["alive"] for s in runtime.list_sandboxes())


@checked(name=SANDBOX_NAME, missing_ok=MISSING_OK)
def sandbox_processes(
    name: str,
    missing_ok: MissingOk = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """List the processes in sandbox `name`'s PID namespace: host pid, namespace pid, namespace
    ppid, state (Z = zombie) and command line. A sandbox not recorded: see `missing_ok` in the
    module docstring."""
    return _processes(name, missing_ok)


@checked(name=SANDBOX_NAME, missing_ok=MISSING_OK)
def sandbox_zombies(
    name: str,
    missing_ok: MissingOk = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[int]:
    """Host PIDs of the zombie processes in sandbox `name` (what `sleep` as PID 1 never reaps).
    A sandbox not recorded: see `missing_ok` in the module docstring."""
    return [p["pid"] for p in _processes(name, missing_ok) if p["zombie"]]


@checked(name=SANDBOX_NAME, missing_ok=MISSING_OK)
def sandbox_zombie_count(
    name: str,
    missing_ok: MissingOk = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> int:
    """How many zombie processes sandbox `name` holds. A sandbox not recorded fails, or counts
    0 where `missing_ok` allows it (see the module docstring)."""
    return len(sandbox_zombies(name, missing_ok))


@checked(name=SANDBOX_NAME, missing_ok=MISSING_OK)
def sandbox_orphans(
    name: str,
    missing_ok: MissingOk = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[int]:
    """Host PIDs of live processes in sandbox `name` that are orphans by the census's one rule
    (docs/census.md): reparented to the pod's PID 1 or a subreaper and not started by it (the
    field report's orphaned workers); the same answer the census gives from inside the pod.
    A sandbox not recorded: see `missing_ok` in the module docstring."""
    if not recorded(name, missing_ok):
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
