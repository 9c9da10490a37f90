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

from chaosgpu.report.journal import METRICS, RunView

__all__ = [
    "MISSING",
    "Pair",
    "comparison_table",
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


def _column_title(metric: str) -> str:
    title, unit, _ = METRICS[metric]
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
    header = ["run"] + [_column_title(metric) for metric in METRICS]
    rows = []
    for run in runs:
        row = [run.name]
        for metric in METRICS:
            row.append(format_value(metric, run.metrics[metric].value))
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
    rows = []
    for metric in METRICS:
        before = pair.baseline.metrics[metric].value
        after = pair.remediation.metrics[metric].value
        if before is None and after is None:
            continue
        rows.append([_column_title(metric), format_value(metric, before),
                     format_value(metric, after), _change(metric, before, after)])
    return header, rows
