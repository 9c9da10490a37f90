"""The report on REAL journals of the typed format (tests/results/report-cpu-2026-12-03, catalog
runs through the real `chaos` CLI on a CPU machine, read in place): the typed fault, signals and
verdicts are what the report shows, a node loss is worded as one, the remediation's survivors
that ended by themselves are the good outcome, host memory is labelled host memory, and the
baseline's waste is integrated until the cleanup and projected to 600 s."""

import json
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.report import build_report, collect
from chaosgpu.report.model import RunView
from chaosgpu.report.tables import comparison_table, verdict_table

RESULTS = Path(__file__).resolve().parent / "results" / "report-cpu-2026-12-03"
JOURNALS = sorted(RESULTS.glob("*.journal.json"))


@pytest.fixture(scope="module")
def runs() -> dict[str, RunView]:
    report = collect([str(p) for p in JOURNALS], with_plots=False)
    assert report.problems == []
    assert len(report.runs) == len(JOURNALS) == 6
    return {run.name.removesuffix(".journal"): run for run in report.runs}


def _raw(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.journal.json").read_text())


def test_every_run_is_typed_and_its_fault_is_the_recorded_one(runs: dict[str, RunView]) -> None:
    for name, run in runs.items():
        section = _raw(name)["chaosgpu"]
        assert run.typed and section["format"] == 2, name
        assert run.fault_kind == section["fault"]["kind"], name
        fault = next(e for e in run.events if e["kind"] == "fault")
        assert fault["t"] == pytest.approx(section["fault"]["t"]), name
        assert run.memory.startswith("host memory"), name
    assert runs["nccl-rank-kill"].fault.startswith("node loss") and \
        "kill (SIGKILL)" not in runs["nccl-rank-kill"].fault
    assert runs["zombies-sleep-pid1"].fault.startswith("kill (SIGKILL) by 'kill-workers'")
    assert runs["pod-delete-ignore-sigterm"].fault_kind == "pod-delete"


def test_the_hang_and_its_verdict_row(runs: dict[str, RunView]) -> None:
    nccl = runs["nccl-rank-kill"]
    (verdict,) = _raw("nccl-rank-kill")["chaosgpu"]["verdicts"]
    assert nccl.metrics["hang_detected"].value is True
    assert nccl.metrics["detection_after_fault_s"].value == verdict["after_fault_s"] > 0
    header, (row,) = verdict_table(nccl)
    cells = dict(zip(header, row, strict=True))
    assert cells["verdict"] == "hung"
    assert cells["culprits"].startswith("rank 0: partitioned")
    assert cells["survivors blocked in"] == (f"{verdict['blocked_in']['kind']} "
                                             f"{verdict['blocked_in']['what']} "
                                             f"(ranks {verdict['blocked_in']['ranks']})")
    assert cells["outcome"].startswith("the weakness")


def test_the_remediation_survivors_ending_is_the_good_outcome(runs: dict[str, RunView]) -> None:
    remedy = runs["nccl-timeout-remediation"]
    raw = _raw("nccl-timeout-remediation")
    assert raw["status"] == "completed" and raw["deviated"] is False
    assert remedy.is_remediation
    header, rows = verdict_table(remedy)
    cells = dict(zip(header, rows[-1], strict=True))
    assert cells["verdict"] == "failed" and cells["survivors' exits"].startswith("all exited")
    assert cells["outcome"] == "good: the survivors ended by themselves (the remedy worked)"
    # the memory came back by itself, before the cleanup, within the 15 s timeout and a margin
    assert 14 < remedy.metrics["release_s"].value < 25
    assert remedy.metrics["gib_seconds_600s"].value is None


def test_baseline_waste_until_the_cleanup_and_projected(runs: dict[str, RunView]) -> None:
    nccl = runs["nccl-rank-kill"]
    waste, projected = nccl.metrics["gib_seconds"], nccl.metrics["gib_seconds_600s"]
    assert waste.note == "held until the cleanup" and waste.value > 0
    held = nccl.metrics["memory_held_mib"].value
    assert waste.value < projected.value <= waste.value + held / 1024 * 600
    assert "600 s" in projected.source and projected.note.startswith("projected")
    assert nccl.metrics["release_s"].value is None
    assert nccl.metrics["cleanup_release_s"].value is not None


def test_signals_come_from_the_typed_record(runs: dict[str, RunView]) -> None:
    raw = _raw("pod-delete-ignore-sigterm")
    signals = raw["chaosgpu"]["signals"]
    assert [s["signal"] for s in signals if s["part"] == "method"][:2] == ["SIGTERM", "SIGKILL"]
    kill = max(s["t"] for s in signals if s["signal"] == "SIGKILL" and s["part"] == "method")
    run = runs["pod-delete-ignore-sigterm"]
    back = next(e["t"] for e in run.events if e["kind"] == "release")
    assert run.metrics["release_after_sigkill_s"].value == pytest.approx(back - kill, abs=1e-3)
    handler = runs["pod-delete-sigterm-handler"].metrics["release_after_sigkill_s"]
    assert handler.value is None and handler.note.startswith("no SIGKILL")


def test_the_rendered_report_says_host_memory_and_node_loss(tmp_path: Path) -> None:
    report = build_report([str(p) for p in JOURNALS], str(tmp_path), with_plots=False)
    header, rows = comparison_table(report.runs)
    assert {row[header.index("memory measured")] for row in rows} == {"host memory"}
    md = (tmp_path / "report.md").read_text()
    assert "host memory (RSS of the tracked processes, not GPU memory)" in md
    assert "node loss (the rank partitioned, then SIGKILLed" in md
    assert "good: the survivors ended by themselves (the remedy worked)" in md


ALL_KEPT = sorted((RESULTS.parent).glob("**/*.journal.json"))
# Journals of runs that declared chaosgpu's timeline control (the Kubernetes catalog does not:
# its figures come from the deletion and census outputs; see the test below)
KEPT = [p for p in ALL_KEPT if json.loads(p.read_text()).get("chaosgpu")]
WITHOUT_TIMELINE = [p for p in ALL_KEPT if p not in KEPT]


@pytest.mark.parametrize("path", WITHOUT_TIMELINE,
                         ids=lambda p: str(p.relative_to(RESULTS.parent)))
def test_a_kept_journal_without_the_timeline_control_loads_and_says_so(path: Path) -> None:
    """A run without chaosgpu's timeline control still loads; the report says it has no
    timeline (tables only) and nothing else is wrong."""
    from chaosgpu.report.loading import load_journal

    run, problems = load_journal(str(path))
    assert run is not None
    assert [p.message for p in problems] == [
        "no timeline in this journal (declare the control chaosgpu.timeline.control): tables "
        "only, no plot"]


@pytest.mark.parametrize("path", KEPT, ids=lambda p: str(p.relative_to(RESULTS.parent)))
def test_every_kept_real_journal_loads(path: Path) -> None:
    """Every kept real journal (older ones included) loads without a problem and says what its
    fault was; an older one says its facts were rebuilt."""
    from chaosgpu.report.loading import load_journal

    run, problems = load_journal(str(path))
    assert run is not None and problems == []
    raw = json.loads(path.read_text())
    assert run.typed == ("format" in raw["chaosgpu"])
    assert run.fault != "unknown" and run.fault_kind, run.missing
    assert run.typed or any("older journal without typed events" in n for n in run.notes)
    for figure in run.metrics.values():
        assert figure.value is None or isinstance(figure.value, int | float)
