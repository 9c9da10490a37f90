"""Render a `Report` as Markdown (for pull requests and wikis), with the plots as PNG files next
to it, and hold the texts both renderings share (units note, per-run facts, figure sources).

This module owns Markdown only. It must not read or write files: `build_report` writes the PNGs
and passes their relative paths.
"""

from typing import Any

from chaosgpu.report import Report
from chaosgpu.report.model import FIGURE_NOTES, METRICS, RunView
from chaosgpu.report.tables import comparison_table, pair_table, summary_table, verdict_table
from chaosgpu.timeline.integral import RULE

__all__ = ["NOT_SHOWN_NOTE", "UNITS_NOTE", "figure_notes", "render", "run_facts", "shown_events",
           "shown_path", "sources_of"]

NOT_SHOWN_NOTE = ("— = not in the journal, or not applicable (zombies after kill when the "
                  "method has no kill fault; hang figures when there is no hang).")


def shown_path(path: str) -> str:
    """A journal's path as the report shows it: relative to the working directory when under
    it (no machine path in a report that is shared)."""
    import os

    absolute = os.path.abspath(path)
    here = os.getcwd()
    if absolute.startswith(here + os.sep):
        return os.path.relpath(absolute, here)
    return path if not os.path.isabs(path) else os.path.basename(path)

UNITS_NOTE = (
    "Units: MiB = 2^20 bytes; s = seconds; GiB x s = memory held (MiB / 1024) times seconds, "
    f"integrated over the timeline ({RULE}). Memory is GPU memory (NVML) or, on a run without "
    "a GPU, the host memory (RSS) of the tracked processes: the 'memory measured' column says "
    "which. (The field report's 'GB x s' figures are decimal GB x s: 24.7 GB x 30 s = 740; in "
    "GiB x s that is 24702 / 1024 x 30 = 724.)"
)


def figure_notes() -> list[tuple[str, str, str]]:
    """(title, unit, what it is) of every figure, for the report's "Figures" section."""
    return [(title, unit, FIGURE_NOTES[name]) for name, (title, unit) in METRICS.items()]


def run_facts(run: RunView) -> list[tuple[str, str]]:
    """The key facts of one run, in display order."""
    facts = [
        ("journal", shown_path(run.path)),
        ("status", run.status),
        ("deviated", "unknown" if run.deviated is None else ("yes" if run.deviated else "no")),
        ("fault", run.fault),
        ("remediation", run.remediation),
        ("memory measured", run.memory),
    ]
    if run.remediation_of:
        facts.append(("remediation of", run.remediation_of))
    if run.scenario:
        facts.append(("scenario", run.scenario))
    if run.backend:
        facts.append(("backend", run.backend))
    if run.node:
        facts.append(("node", run.node))
    if run.start:
        facts.append(("started", run.start + (f", {run.duration_s:.1f} s" if run.duration_s
                                              is not None else "")))
    if run.timeline is not None:
        rate = run.timeline.get("rate_hz")
        overhead = run.timeline.get("overhead_cpu_pct")
        facts.append(("timeline", f"source {run.timeline.get('source') or '?'}, "
                      f"{len(run.timeline['devices'])} device(s), "
                      f"{len(run.timeline['processes'])} process(es)"
                      + (f", {rate:g} Hz" if isinstance(rate, int | float) else "")
                      + (f", sampler overhead {overhead:g} % of a core"
                         if isinstance(overhead, int | float) else "")))
    if run.tags:
        facts.append(("tags", ", ".join(run.tags)))
    return facts


def shown_events(run: RunView) -> list[dict[str, Any]]:
    """The events worth a line in a table: faults and instants, and every activity's start."""
    return [e for e in run.events
            if e["kind"] != "other" or e.get("phase") in (None, "start", "point")
            and e["name"] != "experiment"]


def sources_of(run: RunView) -> str:
    """Which figures came from where, e.g. 'computed from the timeline: time to release, ...'."""
    by_source: dict[str, list[str]] = {}
    for metric, value in run.metrics.items():
        if value.value is not None:
            by_source.setdefault(value.source, []).append(METRICS[metric][0])
    return "; ".join(f"{source}: {', '.join(names)}" for source, names in by_source.items())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render(report: Report, images: dict[str, str]) -> str:
    """Return the Markdown text; `images` maps plot keys to paths relative to the .md file."""
    out = ["# chaosgpu game-day report", "",
           f"{len(report.runs)} journal(s). {UNITS_NOTE}", ""]
    if report.problems or report.plots_error:
        out += ["## Problems", ""]
        if report.plots_error:
            out.append(f"- {report.plots_error}")
        out += [f"- `{shown_path(p.path)}`: {p.message}" for p in report.problems]
        out.append("")
    if not report.runs:
        out.append("No usable journal.")
        return "\n".join(out) + "\n"
    out += ["## Summary", "", _table(*summary_table(report.runs)),
            "## Comparison", "", NOT_SHOWN_NOTE, "",
            _table(*comparison_table(report.runs))]
    if report.pairs:
        out += ["## Remediations against their baselines", ""]
        for pair in report.pairs:
            out += [f"### {pair.remediation.remediation}", "",
                    f"{pair.remediation.title} (`{pair.remediation.name}`) against "
                    f"{pair.baseline.title} (`{pair.baseline.name}`).", "",
                    _table(*pair_table(pair))]
            key = f"pair:{pair.baseline.name}:{pair.remediation.name}"
            if key in images:
                out += [f"![before/after {pair.remediation.name}]({images[key]})", ""]
    out += ["## Runs", ""]
    for run in report.runs:
        out += [f"### {run.title}", ""]
        out += [f"- **{key}**: {value}" for key, value in run_facts(run)]
        out += [f"- *{note}*" for note in run.notes]
        if run.missing:
            out.append("- **missing**: " + "; ".join(run.missing))
        sources = sources_of(run)
        if sources:
            out.append(f"- where the figures come from: {sources}")
        out.append("")
        key = f"run:{run.name}"
        if key in images:
            out += [f"![{run.memory.split(' (')[0]} over time, {run.name}]({images[key]})", ""]
        elif run.timeline is None:
            out += ["No timeline in this journal: no plot.", ""]
        if run.verdicts:
            out += ["Observed job verdicts:", "", _table(*verdict_table(run))]
        events = shown_events(run)
        if events:
            rows = [[f"{e['t']:.3f}", e["kind"], e["name"], str(e.get("activity") or "")]
                    for e in events]
            out += [_table(["t (s)", "kind", "event", "activity"], rows)]
    out += ["## Figures", ""]
    out += [f"- **{title}**{f' ({unit})' if unit else ''}: {what}"
            for title, unit, what in figure_notes()]
    return "\n".join(out) + "\n"
