"""What GPU-fault readings mean: utilisation summaries, a job's progress and its stragglers, OOMs
seen in a job's logs.

This module owns the interpretation and nothing else: it takes readings (NVML utilisation
readings from chaosgpu.gpu.nvml, progress documents written by chaosgpu's ring workload, log
text) as plain values, so every rule here runs on recorded readings on a machine without a GPU.
It must not read NVML or /proc, and must not start or signal anything.
"""

import json
import re
import statistics
from pathlib import Path
from typing import Any

__all__ = ["summarize_utilization", "progress_rates", "read_progress", "OOM_PATTERNS",
           "oom_lines", "XID_NAMES", "describe_xids"]

# What common XIDs mean (NVIDIA's XID catalogue, in brief). 31 and 43 are what chaosgpu's XID
# program raised on an H200 (illegal address, trap).
XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault (MMU fault: illegal address)",
    43: "GPU stopped processing (a kernel faulted; the channel was reset)",
    45: "preemptive cleanup after a fault",
    48: "double-bit ECC error",
    63: "row remapping pending",
    64: "row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
}

# How CUDA out-of-memory reads in a rank's output (torch's message, the CUDA error names).
OOM_PATTERNS = (
    re.compile(r"CUDA out of memory"),
    re.compile(r"OutOfMemoryError"),
    re.compile(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"),
)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(statistics.fmean(values), 2), "min": min(values), "max": max(values)}


def summarize_utilization(readings: list[dict[str, Any]]) -> dict[str, Any]:
    """Summarise utilisation readings [{"t", "gpu_pct", "memory_pct"}, ...]: mean/min/max of
    each, the share of readings with the SMs busy (gpu_pct >= 90), and the series."""
    gpu = [float(r["gpu_pct"]) for r in readings if r.get("gpu_pct") is not None]
    memory = [float(r["memory_pct"]) for r in readings if r.get("memory_pct") is not None]
    t0 = readings[0]["t"] if readings else 0.0
    return {"readings": len(readings), "gpu_pct": _stats(gpu), "memory_pct": _stats(memory),
            "busy_share": round(sum(1 for g in gpu if g >= 90) / len(gpu), 3) if gpu else None,
            "series": {"t": [round(r["t"] - t0, 3) for r in readings],
                       "gpu_pct": [r.get("gpu_pct") for r in readings],
                       "memory_pct": [r.get("memory_pct") for r in readings]}}


def read_progress(folder: str | Path) -> dict[int, dict[str, Any]]:
    """The latest progress document of each rank in a ring workload's folder (rank<R>.progress)."""
    found: dict[int, dict[str, Any]] = {}
    for path in Path(folder).glob("rank*.progress"):
        try:
            rank = int(path.stem[4:])
            document = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError):
            continue
        if isinstance(document, dict):
            found[rank] = document
    return found


def progress_rates(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]],
                   window_s: float, stall_factor: float = 0.5) -> dict[str, Any]:
    """Iterations per second of each rank between two progress readings taken `window_s` apart.

    A rank is stalled when its counter did not move; the straggler is the slowest rank, named
    when it runs below `stall_factor` x the median of the others. "progressing" is true when
    every rank seen advanced."""
    ranks: dict[str, Any] = {}
    for rank in sorted(set(before) | set(after)):
        old, new = before.get(rank), after.get(rank)
        if old is None or new is None:
            ranks[str(rank)] = {"rate_per_s": None, "stalled": None,
                                "note": "no progress file in one of the readings"}
            continue
        moved = int(new.get("iteration", 0)) - int(old.get("iteration", 0))
        ranks[str(rank)] = {"iteration": new.get("iteration"), "rate_per_s":
                            round(moved / window_s, 3) if window_s > 0 else None,
                            "stalled": moved <= 0, "ooms": new.get("ooms"),
                            "last_progress_t": new.get("t")}
    rates = {r: v["rate_per_s"] for r, v in ranks.items() if v.get("rate_per_s") is not None}
    straggler = None
    if len(rates) >= 2:
        slowest = min(rates, key=lambda r: rates[r])
        others = [v for r, v in rates.items() if r != slowest]
        if statistics.median(others) > 0 and rates[slowest] < stall_factor * statistics.median(
                others):
            straggler = int(slowest)
    stalled = [int(r) for r, v in ranks.items() if v.get("stalled")]
    return {"window_s": window_s, "ranks": ranks,
            "min_rate_per_s": min(rates.values()) if rates else None,
            "max_rate_per_s": max(rates.values()) if rates else None,
            "stalled_ranks": stalled, "straggler_rank": straggler,
            "progressing": bool(ranks) and not stalled and len(rates) == len(ranks)}


def oom_lines(text: str, limit: int = 20) -> list[str]:
    """The lines of a rank's output that report a CUDA out-of-memory error."""
    lines = [line.strip() for line in text.splitlines()
             if any(p.search(line) for p in OOM_PATTERNS)]
    return lines[:limit]


def describe_xids(events: list[dict[str, Any]], after: float = 0.0) -> list[dict[str, Any]]:
    """XID events at or after unix time `after`, each with the XID's meaning where known."""
    return [dict(e, meaning=XID_NAMES.get(int(e.get("xid", -1)), "not in chaosgpu's list"))
            for e in events if float(e.get("t", 0.0)) >= after]
