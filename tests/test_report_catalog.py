"""The report from REAL journals: catalog experiments run through the real `chaos` CLI on this
machine, then `chaosgpu report` over their journals (tables checked against the journals, the
remediation paired with its baseline, the page rendered by headless Chromium when present).

Every experiment listed must produce a journal (a run that writes none is a failure, never a
skip). Set CHAOSGPU_REPORT_KEEP=DIR to keep the journals and the report
(e.g. to regenerate tests/data/journals from real runs).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.report import build_report
from chaosgpu.report.model import METRICS
from chaosgpu.report.tables import comparison_table, format_metric

REPO = Path(__file__).resolve().parent.parent
CHAOS = str(Path(sys.executable).with_name("chaos"))

# Small sizes for a 2-core CI machine (the same scaling as the catalog tests).
RUNS: dict[str, dict[str, Any]] = {
    "zombies-sleep-pid1": {"mib": 16},
    "zombies-init-pid1": {"mib": 16},
    "pod-delete-ignore-sigterm": {"grace_s": 3.0, "mib": 64},
    "pod-delete-sigterm-handler": {"grace_s": 3.0, "mib": 64},
    "nccl-rank-kill": {},
    "nccl-timeout-remediation": {},
}


def _run(name: str, overrides: dict[str, Any], folder: Path) -> Path | None:
    journal = folder / f"{name}.json"
    command = [CHAOS, "--no-version-check", "--log-file", str(folder / f"{name}.log"), "run",
               "--journal-path", str(journal)]
    if overrides:
        var_file = folder / f"{name}.vars.json"
        var_file.write_text(json.dumps(overrides))
        command += ["--var-file", str(var_file)]
    command.append(str(REPO / "experiments" / f"{name}.json"))
    subprocess.run(command, cwd=folder, env=dict(os.environ), capture_output=True, text=True,
                   timeout=600, stdin=subprocess.DEVNULL)
    return journal if journal.exists() else None


@pytest.mark.slow
def test_report_from_real_catalog_journals(tmp_path: Path) -> None:
    if not Path(CHAOS).exists():
        pytest.skip("the chaos CLI is not installed next to this Python")
    folder = tmp_path / "journals"
    folder.mkdir()
    produced = {name: _run(name, overrides, folder) for name, overrides in RUNS.items()}
    journals = [path for path in produced.values() if path is not None]
    # every catalog run must leave its journal: a run that produced none is a failure
    assert len(journals) == len(RUNS), f"runs without a journal: {produced}"
    report = build_report([str(p) for p in journals], str(tmp_path / "report"))
    assert report.problems == [], report.problems
    assert len(report.runs) == len(journals)
    header, rows = comparison_table(report.runs)
    for run, row in zip(report.runs, rows, strict=True):
        raw = json.loads(Path(run.path).read_text())
        assert run.status == raw["status"] and run.deviated == raw["deviated"]
        assert run.timeline is not None, f"{run.name}: the timeline control wrote no timeline"
        for metric, (title, unit) in METRICS.items():
            cell = row[header.index(f"{title} ({unit})" if unit else title)]
            assert cell == format_metric(metric, run.metrics[metric])
        # every real catalog run carries the control's typed events and its fault
        assert run.typed and run.fault_kind, (run.name, run.fault)
    names = {run.name for run in report.runs}
    if {"zombies-sleep-pid1", "zombies-init-pid1"} <= names:
        pair = next(p for p in report.pairs if p.remediation.name == "zombies-init-pid1")
        assert pair.baseline.name == "zombies-sleep-pid1"
        assert pair.baseline.metrics["zombies_after_kill"].value >= 1
        assert pair.remediation.metrics["zombies_after_kill"].value == 0
    if "nccl-rank-kill" in names:
        nccl = next(r for r in report.runs if r.name == "nccl-rank-kill")
        assert nccl.metrics["hang_detected"].value is True
        assert isinstance(nccl.metrics["detection_after_fault_s"].value, float)
        assert nccl.metrics["hang_cleaned"].value is True
        assert any(row["verdict"] == "hung" and row["culprits"] for row in nccl.verdicts)
    if "nccl-timeout-remediation" in names:
        remedy = next(r for r in report.runs if r.name == "nccl-timeout-remediation")
        assert remedy.is_remediation
        assert any(row.get("all_exited") is True for row in remedy.verdicts), remedy.verdicts
    page = (tmp_path / "report" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(report.plots) >= len(journals)
    keep = os.environ.get("CHAOSGPU_REPORT_KEEP")
    if keep:
        shutil.copytree(folder, Path(keep) / "journals", dirs_exist_ok=True)
        shutil.copytree(tmp_path / "report", Path(keep) / "report", dirs_exist_ok=True)

