"""chaosgpu: a Chaos Toolkit extension that injects faults into GPU workloads and proves the
node comes back clean.

This module owns the extension's identity (version) and `discover()`, which `chaos discover`
calls to list every activity. It must not import heavy dependencies (torch, kubernetes) at
import time: activity modules are imported lazily by discovery only.
"""

import importlib.util
import logging
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "discover"]

logger = logging.getLogger("chaostoolkit")

# Every module whose public functions are Chaos Toolkit activities. Actions first, then probes.
ACTIVITY_MODULES = (
    "chaosgpu.process.actions",
    "chaosgpu.job.actions",
    "chaosgpu.sandbox.actions",
    "chaosgpu.workloads.actions",
    "chaosgpu.gpu.actions",
    "chaosgpu.k8s.actions",
    "chaosgpu.node.probes",
    "chaosgpu.gpu.probes",
    "chaosgpu.process.probes",
    "chaosgpu.job.probes",
    "chaosgpu.sandbox.probes",
    "chaosgpu.timeline.probes",
    "chaosgpu.k8s.probes",
    "chaosgpu.agent.probes",
)


def discover(discover_system: bool = True) -> dict[str, Any]:
    """Describe chaosgpu's activities and, when asked, this system (GPUs seen through NVML)."""
    from chaoslib.discovery.discover import (
        discover_actions,
        discover_probes,
        initialize_discovery_result,
    )

    logger.info("Discovering capabilities from chaostoolkit-gpu")
    discovery = initialize_discovery_result("chaostoolkit-gpu", __version__, "gpu")
    for module in ACTIVITY_MODULES:
        if importlib.util.find_spec(module) is None:
            continue
        if module.endswith(".actions"):
            discovery["activities"].extend(discover_actions(module))
        else:
            discovery["activities"].extend(discover_probes(module))
    if discover_system:
        discovery["system"] = _describe_system()
    return discovery  # type: ignore[no-any-return]


def _describe_system() -> dict[str, Any]:
    try:
        from chaosgpu.node import nvml_snapshot

        return {"gpu": nvml_snapshot()}
    except Exception as error:  # discovery must never fail because the node is odd
        return {"gpu": {"available": False, "reason": str(error)}}
