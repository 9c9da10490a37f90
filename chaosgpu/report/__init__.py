"""chaosgpu.report: the game-day report (HTML + Markdown) built from Chaos Toolkit journals.

This package owns `build_report`, which ties the parts together: `loading` (reading and
validating journals), `events` (the typed facts: fault, signals, release, verdicts),
`figures` (the figures), `model` (the shapes), `tables` (rows and pairing), `plots`
(matplotlib PNGs), `html` and `markdown` (rendering), `cli` (`chaosgpu report`). Nothing
here runs experiments or reads the node; a bad journal never stops the report (it is listed
under "problems").
"""

import os
from dataclasses import dataclass, field

from chaosgpu.report.loading import load_journals
from chaosgpu.report.model import Problem, RunView
from chaosgpu.report.tables import Pair, pair_runs

__all__ = ["Report", "build_report", "collect"]


@dataclass
class Report:
    """Everything a rendering needs: runs, pairs, problems and the plots (PNG bytes by key:
    `run:<name>` and `pair:<baseline>:<remediation>`)."""

    runs: list[RunView]
    pairs: list[Pair]
    problems: list[Problem]
    plots: dict[str, bytes] = field(default_factory=dict)
    plots_error: str | None = None


def collect(paths: list[str], with_plots: bool = True) -> Report:
    """Read the journals and draw the plots (plot failures become problems, never raise)."""
    from chaosgpu.report import plots

    runs, problems = load_journals(paths)
    report = Report(runs=runs, pairs=pair_runs(runs), problems=problems)
    if not with_plots:
        return report
    try:
        for run in runs:
            try:
                png = plots.run_plot(run)
            except plots.PlotsUnavailable:
                raise
            except Exception as error:  # one odd timeline must not cost the whole report
                report.problems.append(Problem(run.path, f"plot failed: {error}"))
                continue
            if png:
                report.plots[f"run:{run.name}"] = png
        for pair in report.pairs:
            png = plots.pair_plot(pair.baseline, pair.remediation)
            if png:
                report.plots[f"pair:{pair.baseline.name}:{pair.remediation.name}"] = png
    except plots.PlotsUnavailable as error:
        report.plots_error = str(error)
    return report


def build_report(paths: list[str], out_dir: str, with_plots: bool = True) -> Report:
    """Write `report.html` (self-contained) and `report.md` (+ PNGs in `plots/`) into out_dir."""
    from chaosgpu.report import html, markdown

    report = collect(paths, with_plots=with_plots)
    os.makedirs(out_dir, exist_ok=True)
    images = {}
    if report.plots:
        os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
    for key, png in report.plots.items():
        filename = "plots/" + key.replace(":", "--").replace("/", "_") + ".png"
        with open(os.path.join(out_dir, filename), "wb") as handle:
            handle.write(png)
        images[key] = filename
    with open(os.path.join(out_dir, "report.html"), "w", encoding="utf-8") as handle:
        handle.write(html.render(report))
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as handle:
        handle.write(markdown.render(report, images))
    return report
