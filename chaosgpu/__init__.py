"""chaosgpu: a Chaos Toolkit extension that injects faults into GPU workloads and proves the
node comes back clean.

This module owns the extension's identity (its version, read from the installed package's
metadata when first asked, the one place it is defined being pyproject.toml) and `discover()`, which
`chaos discover` calls to list every activity. It must not import heavy dependencies (torch,
kubernetes) at import time: activity modules are imported lazily by discovery only.
"""

from __future__ import annotations

TYPE_CHECKING = False  # mypy reads it as true; typing costs ~5-9 ms of every command's start
if TYPE_CHECKING:
    from typing import Any

__all__ = ["__version__", "discover", "portable_type", "ACTIVITY_MODULES", "DISTRIBUTION"]

DISTRIBUTION = "chaostoolkit-gpu"


def __getattr__(name: str) -> Any:
    """`__version__`, read from the package metadata when first asked: importlib.metadata
    costs 15 ms, more than the rest of `chaosgpu snapshot`'s imports, and few commands need it."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import metadata

    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # imported from a source tree never installed
        version = "0+unknown"
    globals()["__version__"] = version
    return version

# Every module whose public functions are Chaos Toolkit activities. Actions first, then probes.
ACTIVITY_MODULES = (
    "chaosgpu.process.actions",
    "chaosgpu.job.actions",
    "chaosgpu.sandbox.actions",
    "chaosgpu.workloads.actions",
    "chaosgpu.gpu.actions",
    "chaosgpu.network.actions",
    "chaosgpu.k8s.actions",
    "chaosgpu.node.probes",
    "chaosgpu.gpu.probes",
    "chaosgpu.process.probes",
    "chaosgpu.job.probes",
    "chaosgpu.sandbox.probes",
    "chaosgpu.network.probes",
    "chaosgpu.timeline.probes",
    "chaosgpu.k8s.probes",
    "chaosgpu.agent.probes",
)


def discover(discover_system: bool = True) -> dict[str, Any]:
    """Describe chaosgpu's activities and, when asked, this system (GPUs seen through NVML)."""
    import importlib.util
    import logging

    from chaoslib.discovery.discover import (
        discover_actions,
        discover_probes,
        initialize_discovery_result,
    )

    logging.getLogger("chaostoolkit").info("Discovering capabilities from chaostoolkit-gpu")
    discovery = initialize_discovery_result(DISTRIBUTION, __getattr__("__version__"), "gpu")
    for module in ACTIVITY_MODULES:
        if importlib.util.find_spec(module) is None:
            continue
        found = (discover_actions(module) if module.endswith(".actions")
                 else discover_probes(module))
        for activity in found:
            _port_types(activity)
        discovery["activities"].extend(found)
    if discover_system:
        discovery["system"] = _describe_system()
    return discovery  # type: ignore[no-any-return]


def portable_type(annotation: Any) -> str:
    """chaoslib's portable type name for an annotation, also for Optional[X] (X's name: the
    argument's null default says it is optional) and Union[X, Y] ("x|y"), which chaoslib itself
    reports as "object"."""
    import types
    import typing

    from chaoslib.discovery.discover import portable_type_name

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return "|".join(dict.fromkeys(portable_type(arg) for arg in members))
    return portable_type_name(annotation)  # type: ignore[no-any-return]


def _port_types(activity: dict[str, Any]) -> None:
    """Rewrite the types chaoslib could not name, reading the activity's own signature."""
    import importlib
    import inspect

    func = getattr(importlib.import_module(activity["mod"]), activity["name"])
    signature = inspect.signature(func)
    for argument in activity.get("arguments", []):
        annotation = signature.parameters[argument["name"]].annotation
        if annotation is not inspect.Parameter.empty:
            argument["type"] = portable_type(annotation)
    if signature.return_annotation is not inspect.Signature.empty:
        activity["return_type"] = portable_type(signature.return_annotation)


def _describe_system() -> dict[str, Any]:
    try:
        from chaosgpu.node import nvml_snapshot

        return {"gpu": nvml_snapshot()}
    except Exception as error:  # discovery must never fail because the node is odd
        return {"gpu": {"available": False, "reason": str(error)}}
