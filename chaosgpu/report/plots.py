"""The report's plots as PNG bytes: GPU memory over time per device and per process for one run
(events marked), and a remediation against its baseline aligned at the fault.

This module owns every use of matplotlib (the optional extra `report`), imported lazily with the
Agg backend; without it `PlotsUnavailable` says how to install it and the report goes on without
plots. It must not read journals or write files.
"""

import io
from typing import Any

from chaosgpu.report.events import fault_time
from chaosgpu.report.figures import total_process_series
from chaosgpu.report.model import RunView

__all__ = ["PlotsUnavailable", "pair_plot", "run_plot"]

EVENT_STYLE = {
    "fault": ("#d62728", "-"),
    "SIGTERM": ("#ff7f0e", "--"),
    "SIGKILL": ("#9467bd", "-."),
    "release": ("#2ca02c", ":"),
    "other": ("#7f7f7f", ":"),
}
MAX_PROCESS_LINES = 12


class PlotsUnavailable(RuntimeError):
    """matplotlib cannot be imported: the report is produced without plots."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotsUnavailable(
            f"matplotlib is not installed ({error}): plots left out; install the extra with "
            "pip install 'chaostoolkit-gpu[report]'"
        ) from error
    return plt


def _png(fig: Any, plt: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _mark_events(ax: Any, events: list[dict[str, Any]], label: bool) -> None:
    used: set[str] = set()
    names_at: dict[float, list[str]] = {}
    # Faults and instants reported by actions; activity starts/ends stay in the table.
    events = [e for e in events if e["kind"] != "other" or e.get("phase") == "point"]
    for event in events:
        color, style = EVENT_STYLE.get(event["kind"], EVENT_STYLE["other"])
        text = event["kind"] if event["kind"] != "other" else "event"
        ax.axvline(event["t"], color=color, linestyle=style, linewidth=1.2,
                   label=text if label and text not in used else None)
        used.add(text)
        names_at.setdefault(round(event["t"], 2), []).append(event["name"])
    if label:  # one annotation per cluster of instants, so close events stay readable
        low, high = ax.get_xlim()
        gap = 0.02 * (high - low)
        clusters: list[tuple[float, list[str]]] = []
        for t in sorted(names_at):
            if clusters and t - clusters[-1][0] <= gap:
                clusters[-1][1].extend(names_at[t])
            else:
                clusters.append((t, list(names_at[t])))
        for t, names in clusters:
            ax.annotate(" + ".join(dict.fromkeys(names)), xy=(t, 1.0),
                        xycoords=("data", "axes fraction"), xytext=(2, -2),
                        textcoords="offset points", fontsize=7, rotation=90, va="top",
                        color="#333333")


def run_plot(run: RunView) -> bytes | None:
    """PNG of one run's timeline (None when the run has no timeline)."""
    timeline = run.timeline
    if timeline is None:
        return None
    plt = _pyplot()
    has_processes = any(series["t"] for series in timeline["processes"].values())
    rows = 2 if has_processes else 1
    fig, axes = plt.subplots(rows, 1, figsize=(10, 3.2 * rows), sharex=True, squeeze=False)
    ax = axes[0][0]
    for device in timeline["devices"]:
        ax.plot(device["t"], device["used_mib"], linewidth=1.2, label=f"GPU {device['index']} used")
    total = timeline.get("total")
    if total and (len(timeline["devices"]) > 1 or not timeline["devices"]):
        what = "all GPUs" if timeline["devices"] else "tracked processes' RSS (no NVML)"
        ax.plot(total["t"], total["mib"], color="black", linewidth=1.2, label=what)
    if timeline.get("baseline_mib") is not None and len(timeline["devices"]) <= 1:
        ax.axhline(timeline["baseline_mib"], color="#999999", linewidth=0.8, linestyle="--",
                   label="baseline")
    ax.set_ylabel("memory used (MiB)" if timeline["devices"] else "host memory (MiB)")
    source = timeline.get("source") or "?"
    rate = timeline.get("rate_hz")
    what = ("GPU memory per device" if timeline["devices"]
            else "no NVML: resident memory of the tracked processes")
    ax.set_title(f"{run.title}\n{run.name}: {what} "
                 f"(source {source}{f', {rate:g} Hz' if isinstance(rate, int | float) else ''})",
                 fontsize=9)
    _mark_events(ax, run.events, label=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    if has_processes:
        ax2 = axes[1][0]
        items = sorted(((pid, series) for pid, series in timeline["processes"].items()
                        if series["t"]), key=lambda kv: -max(kv[1]["mib"] or [0]))
        for pid, series in items[:MAX_PROCESS_LINES]:
            name = series.get("tag") or f"pid {pid}"
            if series.get("rank") is not None:
                name += f" (rank {series['rank']})"
            elif series.get("tag"):
                name += f" (pid {pid})"  # several workers of one tag stay distinguishable
            t, mib = list(series["t"]), list(series["mib"])
            if series.get("gone_t") is not None:
                t.append(series["gone_t"])
                mib.append(0.0)
            ax2.step(t, mib, where="post", linewidth=1, label=name)
        times, totals = total_process_series(timeline)
        if len(items) > 1:
            ax2.step(times, totals, where="post", color="black", linewidth=1.5,
                     label=f"all {len(items)} processes")
        _mark_events(ax2, run.events, label=False)
        ax2.set_ylabel("per process (MiB)" if timeline["devices"] else "process RSS (MiB)")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7, loc="center right", ncol=2 if len(items) > 6 else 1)
        if len(items) > MAX_PROCESS_LINES:
            ax2.text(0.01, 0.95, f"{len(items) - MAX_PROCESS_LINES} more processes not drawn "
                     "(included in the total)", transform=ax2.transAxes, fontsize=7, va="top")
    axes[-1][0].set_xlabel(f"time since the timeline started (s); t0 = {timeline['t0']:.3f} unix")
    fig.tight_layout()
    return _png(fig, plt)


def _aligned(run: RunView) -> tuple[list[float], list[float], float] | None:
    timeline = run.timeline
    if timeline is None:
        return None
    origin = fault_time(run.events) or 0.0
    times, totals = total_process_series(timeline)
    if not times and timeline["devices"]:
        device = timeline["devices"][0]
        times, totals = list(device["t"]), list(device["used_mib"])
    return [t - origin for t in times], totals, origin


def _back(run: RunView) -> str:
    """', memory back after 30.11 s' for a legend (empty when unknown)."""
    figure = run.metrics.get("release_s")
    value = figure.value if figure else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f" (memory back {value:.2f} s after the fault)"
    cleanup = run.metrics.get("cleanup_release_s")
    if cleanup is not None and isinstance(cleanup.value, int | float):
        return f" (memory back {cleanup.value:.2f} s after the cleanup started)"
    return f" ({figure.note})" if figure is not None and figure.note else ""


def pair_plot(baseline: RunView, remediation: RunView) -> bytes | None:
    """PNG of the processes' total GPU memory of a baseline and its remediation, both aligned at
    their first fault event (None when either has no timeline)."""
    before, after = _aligned(baseline), _aligned(remediation)
    if before is None or after is None:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.step(before[0], before[1], where="post", color="#d62728", linewidth=1.4,
            label=f"baseline: {baseline.name}{_back(baseline)}")
    ax.step(after[0], after[1], where="post", color="#2ca02c", linewidth=1.4,
            label=f"remediation: {remediation.name}{_back(remediation)}")
    ax.axvline(0.0, color="black", linestyle="--", linewidth=1, label="fault (t = 0)")
    ax.set_xlabel("time since the fault (s)")
    host = not (baseline.timeline or {}).get("devices") and not (
        remediation.timeline or {}).get("devices")
    ax.set_ylabel("memory (RSS) held by processes (MiB)" if host
                  else "GPU memory held by processes (MiB)")
    ax.set_title(f"before/after: {remediation.remediation}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig, plt)
