"""The report's figures on the REAL journals of the catalog run on one H200
(tests/results/gpu-catalog-2026-12-02, read in place): each figure checked by hand against what
the journal records (the actions' outputs, the probes' outputs, the timeline), and the HTML and
Markdown free of machine paths.
"""

import json
import os
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.report import build_report, collect
from chaosgpu.report.journal import RunView
from chaosgpu.report.tables import MISSING, comparison_table, pair_table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gpu-catalog-2026-12-02"
NAMES = ("nccl-rank-kill", "pod-delete-ignore-sigterm", "pod-delete-ignore-sigterm-10",
         "pod-delete-sigterm-handler")

pytestmark = pytest.mark.skipif(not RESULTS.is_dir(), reason=f"{RESULTS} not present")


@pytest.fixture(scope="module")
def runs() -> dict[str, RunView]:
    report = collect([str(RESULTS / f"{name}.journal.json") for name in NAMES],
                     with_plots=False)
    assert report.problems == []
    return {run.name.removesuffix(".journal"): run for run in report.runs}


def _raw(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.journal.json").read_text())


def _output(raw: dict[str, Any], activity: str) -> Any:
    entries = raw["run"] + raw["rollbacks"]
    return next(e["output"] for e in entries if e["activity"]["name"] == activity)


def _event(raw: dict[str, Any], name: str, phase: str = "start") -> float:
    timeline = raw["chaosgpu"]["timeline"]
    at = next(e["t"] for e in timeline["events"] if e["name"] == name and e["phase"] == phase)
    return at - timeline["t0"] if at > 1e8 else at  # the contract allows either


def _value(runs: dict[str, RunView], name: str, metric: str) -> Any:
    return runs[name].metrics[metric].value


@pytest.mark.parametrize("name", ["pod-delete-ignore-sigterm", "pod-delete-ignore-sigterm-10"])
def test_baseline_pod_deletion_release_after_the_delete_and_after_sigkill(
        runs: dict[str, RunView], name: str) -> None:
    raw = _raw(name)
    delete = _output(raw, "delete-pod")
    probe = _output(raw, "release-time-after-delete")  # seconds from the delete's start
    # the report times it from the fault itself (the SIGTERM sent, typed), not the action's start
    fault = _event(raw, "delete-pod") + (delete["sigterm_sent"] - raw["chaosgpu"]["timeline"]["t0"]
                                         - _event(raw, "delete-pod"))
    assert _value(runs, name, "release_s") == pytest.approx(
        _event(raw, "delete-pod") + probe - fault, abs=1e-3)
    assert runs[name].fault_kind == "pod-delete" and not runs[name].typed
    assert probe == pytest.approx(30.1, abs=0.6)
    # memory back (delete start + probe) minus SIGKILL: well under a second
    back = _event(raw, "delete-pod") + probe
    sigkill = delete["sigkill_sent"] - raw["chaosgpu"]["timeline"]["t0"]
    after_kill = _value(runs, name, "release_after_sigkill_s")
    assert after_kill == pytest.approx(back - sigkill, abs=0.002)
    assert 0.05 < after_kill < 0.7
    assert "SIGKILL" in runs[name].metrics["release_after_sigkill_s"].source


def test_figures_of_the_one_worker_baseline(runs: dict[str, RunView]) -> None:
    assert _value(runs, "pod-delete-ignore-sigterm", "release_s") == pytest.approx(30.114,
                                                                                  abs=1e-3)
    assert _value(runs, "pod-delete-ignore-sigterm", "release_after_sigkill_s") == \
        pytest.approx(0.084, abs=0.002)
    assert _value(runs, "pod-delete-ignore-sigterm-10", "release_after_sigkill_s") == \
        pytest.approx(0.599, abs=0.002)


def test_sigterm_handler_releases_without_sigkill(runs: dict[str, RunView]) -> None:
    raw = _raw("pod-delete-sigterm-handler")
    delete = _output(raw, "delete-pod")
    assert delete["sigkill_sent"] is None and delete["exited_on_sigterm"] is True
    assert _value(runs, "pod-delete-sigterm-handler", "release_s") == pytest.approx(0.119,
                                                                                   abs=1e-3)
    figure = runs["pod-delete-sigterm-handler"].metrics["release_after_sigkill_s"]
    assert figure.value is None and figure.note == "no SIGKILL; 0.12 s after SIGTERM"
    assert _value(runs, "pod-delete-sigterm-handler", "deletion_s") == \
        pytest.approx(delete["total_s"], abs=0.001)


def test_nccl_release_is_relative_to_the_cleanup(runs: dict[str, RunView]) -> None:
    raw = _raw("nccl-rank-kill")
    cleanup = _output(raw, "cleanup-hung-job")
    assert cleanup["gpu_memory_released"] is True
    step = next(s for s in cleanup["steps"] if s["step"] == "gpu_release")
    # memory was held until the cleanup: a number from the cleanup's start, never a sentence
    release = runs["nccl-rank-kill"].metrics["release_s"]
    assert release.value is None and release.note == "held until the cleanup"
    assert _value(runs, "nccl-rank-kill", "cleanup_release_s") == pytest.approx(step["t"],
                                                                               abs=1e-3)
    assert "cleanup-hung-job" in runs["nccl-rank-kill"].metrics["cleanup_release_s"].source
    # the cleanup's SIGTERM sufficed (gone in grace): no SIGKILL
    figure = runs["nccl-rank-kill"].metrics["release_after_sigkill_s"]
    assert figure.value is None and figure.note.startswith("no SIGKILL")
    # the release is marked where the cleanup saw it
    release = next(e for e in runs["nccl-rank-kill"].events if e["kind"] == "release")
    assert release["t"] == pytest.approx(_event(raw, "cleanup-hung-job") + step["t"], abs=1e-6)


def test_zombies_not_applicable_without_a_kill(runs: dict[str, RunView]) -> None:
    # pod deletions kill nothing (transient zombies while being reaped are not "after kill");
    # nccl-rank-kill's fault is a freeze (SIGSTOP), the ranks die only in the rollback
    for name in NAMES:
        assert _value(runs, name, "zombies_after_kill") is None, name
        assert "no kill fault" in runs[name].metrics["zombies_after_kill"].source
    header, rows = comparison_table(list(runs.values()))
    column = header.index("zombies after kill")
    assert {row[column] for row in rows} == {MISSING}


def test_other_columns_against_the_journals(runs: dict[str, RunView]) -> None:
    for name in NAMES:
        raw = _raw(name)
        summary = raw["chaosgpu"]["summary"]
        held = summary["peak_total_mib"] - summary["baseline_total_mib"]
        assert _value(runs, name, "memory_held_mib") == pytest.approx(held, abs=0.1)
        # these runs' last sample came before their rollbacks ended (recorded before the
        # control took one after them): no residual is claimed from it
        assert _value(runs, name, "residual_mib") is None
        assert "no sample after the rollbacks ended" in \
            runs[name].metrics["residual_mib"].source
        if name.startswith("pod-delete"):
            delete = _output(raw, "delete-pod")
            assert _value(runs, name, "deletion_s") == pytest.approx(delete["total_s"], abs=0.001)
            assert _value(runs, name, "orphans") == _output(raw, "orphans-after-start")
            assert _value(runs, name, "gib_seconds") == _output(
                raw, "gb-seconds-held-during-delete")
            assert _value(runs, name, "hang_detected") is None
            assert _value(runs, name, "hang_cleaned") is None
            # the probe's reading of memory held agrees with the timeline's peak
            assert _output(raw, "memory-held") == pytest.approx(held, abs=1)
    assert [_value(runs, n, "orphans") for n in NAMES[1:]] == [1, 10, 0]
    assert _value(runs, "pod-delete-ignore-sigterm", "gib_seconds") == 72.5982
    assert _value(runs, "pod-delete-ignore-sigterm-10", "gib_seconds") == 732.5185
    nccl = runs["nccl-rank-kill"]
    hang = _output(_raw("nccl-rank-kill"), "detect-hang")
    assert nccl.metrics["hang_detected"].value is True
    assert nccl.metrics["detection_after_fault_s"].value == hang["detected_after_fault_s"]
    assert nccl.metrics["hang_cleaned"].value is True
    assert nccl.metrics["deletion_s"].value is None and nccl.metrics["orphans"].value is None


def test_the_pair_compares_the_release(runs: dict[str, RunView]) -> None:
    report = collect([str(RESULTS / f"{name}.journal.json") for name in NAMES],
                     with_plots=False)
    (pair,) = report.pairs
    assert pair.baseline.name == "pod-delete-ignore-sigterm.journal"
    _, rows = pair_table(pair)
    table = {row[0]: row[1:] for row in rows}
    assert table["memory back after the fault (s)"][:2] == ["30.11", "0.12"]
    assert table["memory back after SIGKILL (s)"][:2] == ["0.08",
                                                          "no SIGKILL; 0.12 s after SIGTERM"]
    assert table["memory measured"][:2] == ["GPU memory (NVML)", "GPU memory (NVML)"]
    assert "zombies after kill" not in table


def test_generated_files_carry_no_machine_path(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(HERE.parent)
    paths = [str(RESULTS / f"{name}.journal.json") for name in NAMES]  # absolute on purpose
    build_report(paths, str(tmp_path / "out"))
    page = (tmp_path / "out" / "report.html").read_text()
    md = (tmp_path / "out" / "report.md").read_text()
    assert os.path.getsize(tmp_path / "out" / "report.html") < 1_000_000
    for text in (page, md):
        assert str(HERE.parent) not in text
        assert "tests/results/gpu-catalog-2026-12-02/nccl-rank-kill.journal.json" in text
        assert "memory back after SIGKILL" in text


def test_nccl_waste_until_the_cleanup_and_projected(runs: dict[str, RunView]) -> None:
    """The baseline held its memory until the cleanup (0.03 s after the fault, the run ended
    early): waste integrated to the cleanup's start, and projected to 600 s with the memory
    held when the cleanup started (the rule stated in the figure)."""
    raw = _raw("nccl-rank-kill")
    timeline = raw["chaosgpu"]["timeline"]
    fault = runs["nccl-rank-kill"].events
    fault_t = next(e["t"] for e in fault if e["kind"] == "fault")
    cleanup_t = _event(raw, "rollbacks")
    base = timeline["baseline"]["total_mib"]
    at_cleanup = next(v for t, v in zip(timeline["t"], timeline["total_mib"], strict=True)
                      if t >= cleanup_t) - base
    waste = runs["nccl-rank-kill"].metrics["gib_seconds"]
    assert waste.note == "held until the cleanup"
    assert 0 < waste.value <= 4934 / 1024 * (cleanup_t - fault_t) + 0.01
    projected = runs["nccl-rank-kill"].metrics["gib_seconds_600s"]
    expected = waste.value + at_cleanup / 1024 * (600 - (cleanup_t - fault_t))
    assert projected.value == pytest.approx(expected, abs=0.1)
    assert "600 s" in projected.source and projected.unit == "GiB x s"
    # the pod deletions released by themselves: nothing to project
    for name in NAMES[1:]:
        assert _value(runs, name, "gib_seconds_600s") is None


def test_declared_and_observed_fault(runs: dict[str, RunView]) -> None:
    """This old run's fail_rank (how=auto, gloo) froze rank 0: the report words the fault as the
    journal recorded it (the fault mark on the timeline), not as "kill" nor from a name."""
    nccl = runs["nccl-rank-kill"]
    assert nccl.fault_kind == "SIGSTOP"
    assert nccl.fault.startswith("freeze (SIGSTOP) by 'fail-rank-0'")
    assert any("older journal without typed events" in note for note in nccl.notes)
    assert [(row["verdict"], row["after_fault_s"]) for row in nccl.verdicts] == [("hung", 0.0051)]
