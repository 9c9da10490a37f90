"""Render a `Report` as one self-contained HTML page (inline CSS, plots as base64 PNG data URIs,
no script, no external resource) so it works offline and can be mailed or archived.

This module owns HTML only; the content and its order come from `tables` and the shared texts in
`markdown.SECTIONS` (so the two renderings say the same thing). It must not read or write files.
"""

import base64
import datetime
import html

from chaosgpu.report import Report
from chaosgpu.report.markdown import (
    NOT_SHOWN_NOTE,
    UNITS_NOTE,
    figure_notes,
    run_facts,
    shown_events,
    shown_path,
    sources_of,
)
from chaosgpu.report.model import RunView
from chaosgpu.report.tables import comparison_table, pair_table, summary_table, verdict_table

__all__ = ["render"]

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px;color:#222;
max-width:1200px}
h1{font-size:1.6em;margin-bottom:0}
h2{border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
h3{margin-bottom:6px}
table{border-collapse:collapse;margin:8px 0 16px;font-size:0.86em}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f2f4f7}td.num{text-align:right;font-variant-numeric:tabular-nums}
.problem{background:#fff4e5;border-left:4px solid #f0a030;padding:6px 10px;margin:4px 0}
.missing{color:#8a5a00}.note{color:#555;font-size:0.9em}
.status-completed{color:#1a7f37}.status-failed,.status-interrupted,.status-aborted{color:#b42318}
img{max-width:100%;border:1px solid #ddd}
code{background:#f5f5f5;padding:0 3px}
"""


def _e(text: object) -> str:
    return html.escape(str(text))


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    out = ["<table><thead><tr>"]
    out += [f"<th>{_e(cell)}</th>" for cell in header]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            cls = ' class="num"' if i >= numeric_from and _looks_numeric(cell) else ""
            out.append(f"<td{cls}>{_e(cell)}</td>")
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _looks_numeric(cell: str) -> bool:
    return cell.replace(",", "").replace(".", "").replace("-", "").replace("+", "").isdigit()


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<p><img alt="{_e(alt)}" src="data:image/png;base64,{data}"></p>'


def _run_parts(report: Report, run: RunView) -> list[str]:
    """The HTML of one run: facts, notes, plot, verdicts and events."""
    parts: list[str] = []
    parts.append(f"<h3 id=\"run-{_e(run.name)}\">{_e(run.title)}</h3>")
    parts.append("<ul>")
    for key, value in run_facts(run):
        css = f" class=\"status-{_e(value)}\"" if key == "status" else ""
        parts.append(f"<li><b>{_e(key)}</b>: <span{css}>{_e(value)}</span></li>")
    parts.append("</ul>")
    for note in run.notes:
        parts.append(f"<p class=\"missing\">{_e(note)}</p>")
    if run.missing:
        parts.append("<p class=\"missing\">missing: " + _e("; ".join(run.missing)) + "</p>")
    sources = sources_of(run)
    if sources:
        parts.append("<p class=\"note\">where the figures come from: " + _e(sources) + "</p>")
    png = report.plots.get(f"run:{run.name}")
    if png:
        parts.append(_img(png, f"{run.memory.split(' (')[0]} over time, {run.name}"))
    elif run.timeline is None:
        parts.append("<p class=\"missing\">no timeline in this journal: no plot.</p>")
    if run.verdicts:
        parts.append("<p>Observed job verdicts:</p>")
        parts.append(_table(*verdict_table(run)))
    events = shown_events(run)
    if events:
        rows = [[f"{e['t']:.3f}", e["kind"], e["name"], str(e.get("activity") or "")]
                for e in events]
        parts.append(_table(["t (s)", "kind", "event", "activity"], rows, numeric_from=9))
    return parts


def render(report: Report) -> str:
    """Return the whole HTML page."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<title>chaosgpu game-day report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>chaosgpu game-day report</h1>",
        f"<p class=\"note\">Generated {now} from {len(report.runs)} journal(s)"
        f"{f', {len(report.problems)} problem(s)' if report.problems else ''}. "
        f"{_e(UNITS_NOTE)}</p>",
    ]
    if report.problems or report.plots_error:
        parts.append("<h2>Problems</h2>")
        if report.plots_error:
            parts.append(f"<div class=\"problem\">{_e(report.plots_error)}</div>")
        for problem in report.problems:
            parts.append(f"<div class=\"problem\"><code>{_e(shown_path(problem.path))}</code>: "
                         f"{_e(problem.message)}</div>")
    if not report.runs:
        parts.append("<p>No usable journal.</p></body></html>")
        return "".join(parts)

    parts.append("<h2>Summary</h2>")
    parts.append(_table(*summary_table(report.runs), numeric_from=7))
    parts.append("<h2>Comparison</h2>")
    parts.append("<p class=\"note\">One row per run, in the field report's shape. "
                 + _e(NOT_SHOWN_NOTE) + " See each run's \"missing\".</p>")
    parts.append(_table(*comparison_table(report.runs)))

    if report.pairs:
        parts.append("<h2>Remediations against their baselines</h2>")
        for pair in report.pairs:
            parts.append(f"<h3>{_e(pair.remediation.remediation)}</h3>")
            parts.append(f"<p>{_e(pair.remediation.title)} (<code>{_e(pair.remediation.name)}"
                         f"</code>) against {_e(pair.baseline.title)} (<code>"
                         f"{_e(pair.baseline.name)}</code>).</p>")
            parts.append(_table(*pair_table(pair)))
            png = report.plots.get(f"pair:{pair.baseline.name}:{pair.remediation.name}")
            if png:
                parts.append(_img(png, f"before/after {pair.remediation.name}"))

    parts.append("<h2>Runs</h2>")
    for run in report.runs:
        parts += _run_parts(report, run)
    parts.append("<h2>Figures</h2><ul>")
    for title, unit, what in figure_notes():
        parts.append(f"<li><b>{_e(title)}</b>{f' ({_e(unit)})' if unit else ''}: {_e(what)}"
                     "</li>")
    parts.append("</ul></body></html>")
    return "".join(parts)
