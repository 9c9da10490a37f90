"""The report's tables, as plain rows of strings: per-run summary, the comparison across runs in
the field report's shape, and the before/after of a remediation against its baseline.

This module owns formatting figures (units, missing values) and pairing remediations with their
baselines. It must not read files, draw, or emit HTML/Markdown: `html.py` and `markdown.py` render
what it returns.

Pairing (documented in docs/report.md): a run tagged `remediation-of:<id>` (or with
`chaosgpu.remediation_of` / configuration `remediation_of`) is paired with the run whose
configuration `tag`, journal file name or title is <id> (else whose scenario id is <id>),
preferring a run without a remediation; a remediation run without that reference is paired with
the run of the same scenario id that has no remediation.
"""

from dataclasses import dataclass
from typing import Any

from chaosgpu.report.model import METRICS, Metric, RunView

__all__ = [
    "MISSING",
    "verdict_table",
    "Pair",
    "comparison_table",
    "format_metric",
    "format_value",
    "pair_runs",
    "pair_table",
    "summary_table",
]

MISSING = "—"


@dataclass
class Pair:
    """A remediation run and the baseline it is compared with."""

    baseline: RunView
    remediation: RunView


def format_value(metric: str, value: Any) -> str:
    """Format one figure with its unit's precision; MISSING when unknown."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return str(value)
    unit = METRICS[metric][1] if metric in METRICS else ""
    if unit == "MiB":
        return f"{value:,.0f}" if abs(value) >= 10 else f"{value:,.1f}"
    if unit == "s":
        return f"{value:.2f}"
    if unit == "GiB x s":
        if abs(value) >= 10:
            return f"{value:,.1f}"
        return f"{value:.2f}" if abs(value) >= 0.1 or value == 0 else f"{value:.2g}"
    return f"{value:g}" if isinstance(value, float) else str(value)


def format_metric(metric: str, figure: Metric) -> str:
    """A figure's table cell: its value with its unit's precision, and its note beside it (the
    note alone when the value is unknown, e.g. "no SIGKILL")."""
    if figure.value is None:
        return figure.note or MISSING
    text = format_value(metric, figure.value)
    return f"{text} ({figure.note})" if figure.note else text


def _column_title(metric: str) -> str:
    title, unit = METRICS[metric]
    return f"{title} ({unit})" if unit else title


def summary_table(runs: list[RunView]) -> tuple[list[str], list[list[str]]]:
    """One row per run: what it was and how it ended."""
    header = ["run", "experiment", "status", "deviated", "fault", "remediation", "backend",
              "duration (s)"]
    rows = []
    for run in runs:
        rows.append([
            run.name,
            run.title,
            run.status,
            MISSING if run.deviated is None else ("yes" if run.deviated else "no"),
            run.fault,
            run.remediation + (f" (of {run.remediation_of})" if run.remediation_of else ""),
            run.backend or MISSING,
            MISSING if run.duration_s is None else f"{run.duration_s:.1f}",
        ])
    return header, rows


def comparison_table(runs: list[RunView]) -> tuple[list[str], list[list[str]]]:
    """The field report's table: one row per run, one column per figure of METRICS."""
    header = ["run", "memory measured"] + [_column_title(metric) for metric in METRICS]
    rows = []
    for run in runs:
        row = [run.name, run.memory.split(" (")[0]]
        for metric in METRICS:
            row.append(format_metric(metric, run.metrics[metric]))
        rows.append(row)
    return header, rows


def _ids(run: RunView) -> set[str]:
    """What a `remediation-of:<id>` may name: the experiment's configuration `tag` (the catalog
    sets it to the experiment's file name), the journal's file name (also without a
    `journal-`/`handmade-` prefix or `-journal`/`.journal` suffix), the title."""
    ids = {run.name, run.title}
    if run.tag_id:
        ids.add(run.tag_id)
    for prefix in ("handmade-", "journal-"):
        if run.name.startswith(prefix):
            ids.add(run.name[len(prefix) :])
    for suffix in ("-journal", ".journal"):
        if run.name.endswith(suffix):
            ids.add(run.name[: -len(suffix)])
    return ids


def pair_runs(runs: list[RunView]) -> list[Pair]:
    """Pair every remediation run with its baseline (see the module docstring)."""
    pairs = []
    for run in runs:
        if not run.is_remediation:
            continue
        candidates = [other for other in runs if other is not run]
        if run.remediation_of:
            matches = [other for other in candidates if run.remediation_of in _ids(other)]
            if not matches:  # a scenario id as the reference
                matches = [other for other in candidates if other.scenario == run.remediation_of]
        else:
            matches = [other for other in candidates
                       if run.scenario and other.scenario == run.scenario]
        plain = [other for other in matches if not other.is_remediation]
        chosen = (plain or ([] if not run.remediation_of else matches))[:1]
        if chosen:
            pairs.append(Pair(baseline=chosen[0], remediation=run))
    return pairs


def _change(metric: str, before: Any, after: Any) -> str:
    if isinstance(before, bool) or isinstance(after, bool):
        return MISSING if before is None or after is None else (
            "same" if before == after else f"{format_value(metric, before)} → "
            f"{format_value(metric, after)}")
    if not isinstance(before, int | float) or not isinstance(after, int | float):
        return MISSING
    delta = after - before
    if delta == 0:
        return "same"
    text = format_value(metric, delta)
    if delta > 0:
        text = "+" + text
    if before:
        text += f" ({delta / before * 100:+.0f} %)"
    return text


def pair_table(pair: Pair) -> tuple[list[str], list[list[str]]]:
    """Before/after of one remediation: a row per figure, baseline vs remediation and change."""
    header = ["figure", f"baseline: {pair.baseline.name}",
              f"remediation: {pair.remediation.name}", "change"]
    rows = [["memory measured", pair.baseline.memory, pair.remediation.memory,
             "same" if pair.baseline.memory == pair.remediation.memory else "differs"]]
    for metric in METRICS:
        before, after = pair.baseline.metrics[metric], pair.remediation.metrics[metric]
        if before.value is None and after.value is None and not (before.note or after.note):
            continue
        rows.append([_column_title(metric), format_metric(metric, before),
                     format_metric(metric, after), _change(metric, before.value, after.value)])
    return header, rows


def _exit_text(exit: Any) -> str:
    """'exit code 1' from an exit record (chaosgpu.job.exits), or its own text."""
    if not isinstance(exit, dict):
        return str(exit)
    if exit.get("text"):
        return str(exit["text"])
    if exit.get("signal"):
        return f"killed by {exit['signal']}"
    return f"exit code {exit.get('code')}"


def verdict_table(run: RunView) -> tuple[list[str], list[list[str]]]:
    """The observed job verdicts of one run: activity, state, culprits, where the survivors
    were blocked, detection after the fault, survivors' exits, and what it means for this run
    (for a remediation, survivors that ended by themselves are the good outcome)."""
    from chaosgpu.job.verdict import rank_name
    from chaosgpu.report.events import verdict_outcome

    header = ["activity", "verdict", "culprits", "survivors blocked in",
              "confirmed after the fault (s)", "survivors' exits", "outcome"]
    rows = []
    for row in run.verdicts:
        culprits = "; ".join(
            str(c.get("why")) if c.get("role") == "launcher"  # its why names the agent itself
            else f"{rank_name(c.get('rank'), c.get('pid'))}: {c.get('why')}"
            for c in row.get("culprits") or []) or (row.get("culprits_note") or MISSING)
        blocked = row.get("blocked_in") or {}
        where = (f"{blocked.get('kind')} {blocked.get('what')} (ranks {blocked.get('ranks')})"
                 if blocked.get("kind") else MISSING)
        after = row.get("after_fault_s")
        exits = MISSING
        if "all_exited" in row:
            exits = ("all exited" if row["all_exited"] else
                     "still alive: ranks " + ", ".join(
                         str(rank) for rank in row.get("still_alive") or []))
            if row.get("exits"):
                exits += " (" + ", ".join(f"rank {k}: {_exit_text(v)}"
                                          for k, v in row["exits"].items()) + ")"
        rows.append([str(row.get("activity")), str(row.get("verdict") or MISSING), culprits,
                     where, f"{after:.3f}" if isinstance(after, int | float) else MISSING,
                     exits, verdict_outcome(row, run.is_remediation) or MISSING])
    return header, rows
