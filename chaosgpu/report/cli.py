"""`chaosgpu report JOURNAL... [--out DIR] [--no-plots]`: the game-day report from journals.

This module owns the command line only (arguments, messages, exit code); the work is in
`chaosgpu.report.build_report`. Exit code: 0 when every journal was used, 1 when the report was
written but some journal (or plot) had a problem, 2 on bad usage, an --out that cannot be
written, or when no journal was usable (then nothing is written: an earlier report stays).
"""

import argparse
import os
import sys

from chaosgpu.arguments import TEXT, option

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaosgpu report",
        description="Build the game-day report (report.html, self-contained, and report.md with "
        "its PNGs) from Chaos Toolkit journals of chaosgpu experiments.",
    )
    parser.add_argument("journals", nargs="+", metavar="JOURNAL",
                        help="journal files (journal.json) or folders holding them")
    parser.add_argument("--out", default="chaosgpu-report", metavar="DIR", type=option(TEXT, str),
                        help="output folder (default: ./chaosgpu-report)")
    parser.add_argument("--no-plots", action="store_true", help="leave the plots out")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `chaosgpu report`; return the exit code."""
    args = _parser().parse_args(argv)
    from chaosgpu.report import build_report
    from chaosgpu.report.loading import load_journals

    if os.path.exists(args.out) and not os.path.isdir(args.out):
        print(f"chaosgpu report: --out {args.out!r} exists and is not a folder", file=sys.stderr)
        return 2
    runs, problems = load_journals(args.journals)
    if not runs:  # checked before anything is written: a good earlier report is kept
        for problem in problems:
            print(f"chaosgpu report: {problem.path}: {problem.message}", file=sys.stderr)
        print(f"chaosgpu report: no usable journal; nothing written to {args.out}",
              file=sys.stderr)
        return 2
    try:
        report = build_report(args.journals, args.out, with_plots=not args.no_plots)
    except OSError as error:
        print(f"chaosgpu report: cannot write the report to --out {args.out!r}: {error}",
              file=sys.stderr)
        return 2
    for problem in report.problems:
        print(f"chaosgpu report: {problem.path}: {problem.message}", file=sys.stderr)
    if report.plots_error:
        print(f"chaosgpu report: {report.plots_error}", file=sys.stderr)
    html_path = os.path.join(args.out, "report.html")
    print(f"{html_path} ({len(report.runs)} run(s), {len(report.pairs)} before/after pair(s), "
          f"{len(report.plots)} plot(s)); Markdown twin: {os.path.join(args.out, 'report.md')}")
    return 1 if report.problems or report.plots_error else 0
