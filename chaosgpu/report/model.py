"""What the report knows about a run: `RunView`, its figures (`Metric`), the problems found.

This module owns these shapes and the list of figures (`METRICS`: title and unit). It holds no
logic: `loading` builds a RunView, `events` and `figures` fill it.
"""

from dataclasses import dataclass, field
from typing import Any

__all__ = ["EVENT_KINDS", "METRICS", "FIGURE_NOTES", "Metric", "Problem", "RunView"]

# Canonical figure name -> (column title, unit).
METRICS: dict[str, tuple[str, str]] = {
    "memory_held_mib": ("memory held", "MiB"),
    "orphans": ("orphans", ""),
    "zombies_after_kill": ("zombies after kill", ""),
    "deletion_s": ("deletion time", "s"),
    "release_s": ("memory back after the fault", "s"),
    "cleanup_release_s": ("memory back after the cleanup started", "s"),
    "release_after_sigkill_s": ("memory back after SIGKILL", "s"),
    "gib_seconds": ("wasted", "GiB x s"),
    "gib_seconds_600s": ("wasted, projected to 600 s", "GiB x s"),
    "residual_mib": ("residual", "MiB"),
    "hang_detected": ("hang detected", ""),
    "detection_after_fault_s": ("hang detected after the fault", "s"),
    "hang_cleaned": ("hang cleaned", ""),
}

# What each figure is, as the report's "Figures" section explains it.
FIGURE_NOTES: dict[str, str] = {
    "memory_held_mib": "peak of the memory series above the baseline",
    "orphans": "the most orphans an orphan probe saw during the method",
    "zombies_after_kill": "zombies after a kill fault (SIGKILL or node loss): a zombie probe "
                          "after the fault, else process states still Z when the rollbacks start",
    "deletion_s": "the fault action's own record: SIGTERM sent to the pod gone",
    "release_s": "the fault to memory back (memory_release_time, else the first sample within "
                 "min(64 MiB, 5 % of held) of the baseline), when that came before the cleanup",
    "cleanup_release_s": "when memory came back only during the rollbacks: from the start of "
                         "the rollback action that freed it",
    "release_after_sigkill_s": "memory back minus the last SIGKILL sent before it",
    "gib_seconds": "integral of the memory series from the fault to memory back, or to the "
                   "cleanup's start when it was held until the cleanup",
    "gib_seconds_600s": "a run held until its cleanup, projected to 600 s after the fault "
                        "(PyTorch's default NCCL timeout): wasted until the cleanup plus the "
                        "memory held when the cleanup started, held to 600 s",
    "residual_mib": "the memory series' last value, when it was sampled after the rollbacks "
                    "ended (the timeline control takes one sample then); unknown otherwise",
    "hang_detected": "an observed job verdict 'hung' during the method",
    "detection_after_fault_s": "the verdict's confirmation minus the fault",
    "hang_cleaned": "the cleanup removed every process of the job",
}

# Event kinds, in the order a plot's legend lists them.
EVENT_KINDS = ("fault", "SIGTERM", "SIGKILL", "release", "other")


@dataclass
class Problem:
    """A journal (or part of one) the report could not use, and why."""

    path: str
    message: str


@dataclass
class Metric:
    """One figure of a run: its value (a number, a bool or None = unknown), its unit, where it
    came from, and a short qualifier (`note`, e.g. "no SIGKILL") that is never the value."""

    value: Any
    source: str
    unit: str = ""
    note: str | None = None


@dataclass
class RunView:
    """What the report knows about one run, read from its journal."""

    path: str
    name: str
    title: str
    status: str
    deviated: bool | None
    tags: list[str]
    fault: str
    remediation: str
    remediation_of: str | None
    scenario: str | None
    tag_id: str | None
    backend: str | None
    node: str | None
    start: str | None
    end: str | None
    duration_s: float | None
    timeline: dict[str, Any] | None
    events: list[dict[str, Any]]
    metrics: dict[str, Metric]
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fault_kind: str | None = None
    typed: bool = False  # the journal carries the control's typed events (format 2)
    memory: str = "unknown"  # "GPU memory (NVML)" or "host memory (RSS, not GPU)"
    verdicts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_remediation(self) -> bool:
        """Whether this run declares a remediation (anything but none)."""
        return self.remediation.lower() not in ("", "none", "-")
