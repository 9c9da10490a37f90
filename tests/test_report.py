"""Tests of `chaosgpu report`: figures in the tables against the journals, bad journals, the
Markdown twin, no matplotlib, and the HTML rendered by headless Chromium.

The journals come from CHAOSGPU_REPORT_JOURNALS (a folder of journal.json files of real catalog
runs) or, by default, tests/data/journals/ (hand-made fixtures: see make_handmade.py there). The
checks that name a hand-made fixture run only when that fixture is in the folder.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from chaosgpu.report import build_report, collect
from chaosgpu.report.cli import main as report_main
from chaosgpu.report.journal import METRICS, load_journal
from chaosgpu.report.tables import comparison_table, format_metric, verdict_table

HERE = Path(__file__).resolve().parent
JOURNALS = Path(os.environ.get("CHAOSGPU_REPORT_JOURNALS") or HERE / "data" / "journals")
BAD = HERE / "data" / "journals" / "bad"
JOURNAL_FILES = sorted(JOURNALS.glob("*.json"))


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


def _cell(header: list[str], row: list[str], metric: str) -> str:
    title, unit = METRICS[metric]
    return row[header.index(f"{title} ({unit})" if unit else title)]


def test_the_journal_folder_holds_journals() -> None:
    assert JOURNAL_FILES, f"no journal in {JOURNALS}"


@pytest.mark.parametrize("path", JOURNAL_FILES, ids=lambda p: p.name)
def test_every_journal_loads_without_problem(path: Path) -> None:
    run, problems = load_journal(str(path))
    assert run is not None, problems
    assert problems == []
    raw = _raw(path)
    assert run.status == raw["status"]
    assert run.deviated == raw["deviated"]
    assert run.title == raw["experiment"]["title"]


@pytest.mark.parametrize("path", JOURNAL_FILES, ids=lambda p: p.name)
def test_table_figures_match_the_journal(path: Path) -> None:
    """Every cell is its figure formatted; every figure is a number, a bool or None with its
    unit (a qualifier goes in `note`, never in the value); computed figures are consistent with
    the timeline (within its bounds)."""
    report = collect([str(path)], with_plots=False)
    (run,) = report.runs
    header, (row,) = comparison_table(report.runs)
    for metric, (_, unit) in METRICS.items():
        figure = run.metrics[metric]
        assert _cell(header, row, metric) == format_metric(metric, figure), metric
        assert figure.value is None or isinstance(figure.value, int | float), (metric, figure)
        assert figure.unit == unit, metric
    raw = _raw(path)
    timeline = (raw.get("chaosgpu") or {}).get("timeline")
    if not timeline:
        return
    span = max(max(d["t"]) for d in timeline["devices"]) - min(
        min(d["t"]) for d in timeline["devices"])
    peak = max(max(d["used_mib"]) for d in timeline["devices"]) * max(
        1, len(timeline["devices"]))
    for metric in ("release_s", "cleanup_release_s", "gib_seconds", "memory_held_mib",
                   "residual_mib"):
        value = run.metrics[metric].value
        if value is None:
            continue
        assert value >= 0, metric
        if metric.endswith("release_s"):
            assert value <= span + 1e-6
        if metric == "gib_seconds":
            assert value <= peak / 1024 * span + 0.1
        if metric in ("memory_held_mib", "residual_mib"):
            assert value <= peak + 1


HANDMADE_TRUTH = {
    # fixture: (held MiB, time to release s, GiB x s) as built by make_handmade.py
    "handmade-pod-delete-1-worker.json": (2466, 30.14, 2466 / 1024 * 30.14),
    "handmade-pod-delete-1-worker-sigterm-handler.json": (2466, 0.15, 2466 / 1024 * 0.15),
    "handmade-pod-delete-10-workers.json": (24700, 30.23, 24700 / 1024 * 30.23),
}


@pytest.mark.parametrize("name", sorted(HANDMADE_TRUTH))
def test_handmade_figures_are_the_ones_built_in(name: str) -> None:
    path = JOURNALS / name
    if not path.exists():
        pytest.skip(f"{name} not in {JOURNALS}")
    held, release, waste = HANDMADE_TRUTH[name]
    run, _ = load_journal(str(path))
    assert run is not None
    assert run.metrics["memory_held_mib"].value == pytest.approx(held, abs=1)
    assert run.metrics["release_s"].value == pytest.approx(release, abs=0.06)
    # The timeline integral (trapezoids): the built-in release falls on a device sample (100 Hz),
    # where the trapezoid counts half of the interval before it: within half an interval of the
    # held memory, and 1 %.
    assert run.metrics["gib_seconds"].value == pytest.approx(
        waste, abs=held / 1024 * 0.5 / 100 + waste * 0.01)


def test_handmade_pairs_and_nccl() -> None:
    if not (JOURNALS / "handmade-nccl-rank-kill.json").exists():
        pytest.skip("hand-made fixtures not in the folder")
    report = collect([str(JOURNALS)], with_plots=False)
    pairs = {(p.baseline.name, p.remediation.name) for p in report.pairs}
    assert ("handmade-pod-delete-1-worker", "handmade-pod-delete-1-worker-sigterm-handler") in pairs
    assert ("handmade-pod-delete-10-workers",
            "handmade-pod-delete-10-workers-sigterm-handler") in pairs
    assert ("handmade-nccl-rank-kill", "handmade-nccl-timeout-remediation") in pairs
    nccl = next(r for r in report.runs if r.name == "handmade-nccl-rank-kill")
    assert nccl.typed and nccl.fault_kind == "node-loss"
    assert nccl.fault.startswith("node loss") and "kill (SIGKILL)" not in nccl.fault
    # residual = what the timeline still saw at its end, after the cleanup (3942 MiB were
    # measured while the survivors hung, which is not what was left behind)
    assert nccl.metrics["residual_mib"].value == 0.0
    assert nccl.metrics["hang_detected"].value is True
    assert nccl.metrics["detection_after_fault_s"].value == 0.8
    kinds = [(round(e["t"], 2), e["kind"]) for e in nccl.events if e["kind"] != "other"]
    assert kinds == [(3.0, "fault"), (3.0, "SIGKILL"), (12.0, "SIGTERM"), (14.0, "SIGKILL"),
                     (14.2, "release")]
    # memory is back only during the rollbacks, 2.2 s after the cleanup started (its record),
    # 0.2 s after the cleanup's SIGKILL at 14 s
    assert nccl.metrics["release_s"].value is None
    assert nccl.metrics["release_s"].note == "held until the cleanup"
    assert nccl.metrics["cleanup_release_s"].value == 2.2
    assert nccl.metrics["release_after_sigkill_s"].value == pytest.approx(0.2, abs=0.01)
    assert nccl.metrics["hang_cleaned"].value is True
    assert nccl.metrics["hang_cleaned"].source == "output of 'cleanup-hang'"
    assert nccl.metrics["zombies_after_kill"].value == 1
    interrupted = next(r for r in report.runs if r.name == "handmade-interrupted")
    assert interrupted.status == "interrupted"
    assert any("did not complete" in note for note in interrupted.notes)
    # an older journal whose fault action recorded nothing: said, not guessed from its name
    assert not interrupted.typed and interrupted.fault == "unknown"
    assert any(m.startswith("fault (") for m in interrupted.missing)
    assert interrupted.metrics["release_s"].value is None
    assert "no fault identified" in interrupted.metrics["release_s"].source


def test_verdict_rows_and_the_remediation_outcome() -> None:
    """The observed verdicts are shown (state, culprits, where the survivors were blocked,
    detection after the fault); in a remediation, survivors that ended by themselves within
    the timeout ("failed") are the good outcome."""
    if not (JOURNALS / "handmade-nccl-timeout-remediation.json").exists():
        pytest.skip("hand-made fixtures not in the folder")
    report = collect([str(JOURNALS)], with_plots=False)
    runs = {r.name: r for r in report.runs}
    header, (row,) = verdict_table(runs["handmade-nccl-rank-kill"])
    cells = dict(zip(header, row, strict=True))
    assert cells["verdict"] == "hung"
    assert cells["culprits"] == "rank 0: ended: killed by SIGKILL (chaosgpu's fault)"
    assert cells["survivors blocked in"] == "collective all_reduce (ranks [1, 2])"
    assert cells["confirmed after the fault (s)"] == "0.800"
    assert cells["outcome"].startswith("the weakness")
    remedy = runs["handmade-nccl-timeout-remediation"]
    header, (row,) = verdict_table(remedy)
    cells = dict(zip(header, row, strict=True))
    assert cells["verdict"] == "failed"
    assert cells["survivors' exits"] == "all exited (rank 1: exit code 1, rank 2: exit code 1)"
    assert cells["outcome"].startswith("good: the survivors ended by themselves")
    # they gave the memory back by themselves: released before any cleanup, nothing projected
    assert remedy.metrics["release_s"].value == pytest.approx(15.23, abs=0.05)
    assert remedy.metrics["gib_seconds_600s"].value is None
    assert remedy.metrics["hang_detected"].value is False


def test_a_verdict_of_unnumbered_ranks_names_them_by_pid() -> None:
    """A job whose ranks show no number (a spawn or file:// job): culprits, ranks still alive
    and exits read "rank ? (PID n)" in the report, never "rank None"."""
    from types import SimpleNamespace

    from chaosgpu.timeline.events import VERDICT_SCHEMA, verdict_rows

    output = {"schema": VERDICT_SCHEMA, "id": "peers:11", "verdict": "failed",
              "culprit_ranks": [{"rank": None, "pid": 11, "why": "killed by SIGKILL"}],
              "all_exited": False, "survivors": [None, None],
              "still_alive": [{"rank": None, "pid": 12}],
              "exits": {"? (PID 13)": {"exit": {"code": 1}}}}
    (row,) = verdict_rows([("wait-survivors-exit", "method", output)])
    assert row["culprits"] == [{"rank": None, "pid": 11, "why": "killed by SIGKILL"}]
    assert row["still_alive"] == ["? (PID 12)"]
    header, (cells,) = verdict_table(SimpleNamespace(verdicts=[row],  # type: ignore[arg-type]
                                                     is_remediation=False))
    cells_by = dict(zip(header, cells, strict=True))
    assert cells_by["culprits"] == "rank ? (PID 11): killed by SIGKILL"
    assert cells_by["survivors' exits"] == ("still alive: ranks ? (PID 12) "
                                            "(rank ? (PID 13): exit code 1)"), cells_by


def test_a_stopped_elastic_agent_among_the_culprits_is_named_as_the_agent() -> None:
    """A hang whose culprit is the elastic agent (role "launcher", rank None: stopped, it can
    neither tear down nor restart the ranks): the timeline keeps its role and the report names
    it by its own words, never as "rank ? (PID n)"."""
    from types import SimpleNamespace

    from chaosgpu.timeline.events import VERDICT_SCHEMA, verdict_rows

    why = ("the elastic agent (PID 9), stopped (SIGSTOP or a debugger): it can neither tear "
           "down nor restart the ranks")
    output = {"schema": VERDICT_SCHEMA, "id": "job-1", "verdict": "hung",
              "culprit_ranks": [{"rank": 1, "pid": 11, "why": "stopped (SIGSTOP or a debugger)"},
                                {"rank": None, "pid": 9, "role": "launcher", "why": why}]}
    (row,) = verdict_rows([("detect-hang", "method", output)])
    assert row["culprits"][1] == {"rank": None, "pid": 9, "why": why, "role": "launcher"}
    header, (cells,) = verdict_table(SimpleNamespace(verdicts=[row],  # type: ignore[arg-type]
                                                     is_remediation=False))
    culprits = dict(zip(header, cells, strict=True))["culprits"]
    assert culprits == f"rank 1: stopped (SIGSTOP or a debugger); {why}", culprits


def test_markdown_and_html_show_verdicts_node_loss_and_memory_kind(tmp_path: Path) -> None:
    build_report([str(JOURNALS / "handmade-nccl-rank-kill.json"),
                  str(JOURNALS / "handmade-nccl-timeout-remediation.json")], str(tmp_path),
                 with_plots=False)
    md = (tmp_path / "report.md").read_text()
    page = (tmp_path / "report.html").read_text()
    for text in (md, page.replace("&#x27;", "'")):
        assert "Observed job verdicts" in text
        assert "good: the survivors ended by themselves (the remedy worked)" in text
        assert "node loss (the rank partitioned, then SIGKILLed" in text
        assert "wasted, projected to 600 s" in text
        assert "GPU memory (NVML)" in text


def test_host_rss_runs_say_host_memory(tmp_path: Path) -> None:
    """A run without a GPU (the sampler's host-rss source) is labelled host memory."""
    raw = _raw(JOURNALS / "handmade-pod-delete-1-worker.json")
    timeline = raw["chaosgpu"]["timeline"]
    timeline["source"] = "host-rss"
    timeline["devices"] = []
    path = tmp_path / "host-rss.json"
    path.write_text(json.dumps(raw))
    run, problems = load_journal(str(path))
    assert run is not None and problems == []
    assert run.memory.startswith("host memory (RSS")
    build_report([str(path)], str(tmp_path / "out"), with_plots=False)
    md = (tmp_path / "out" / "report.md").read_text()
    assert "host memory (RSS of the tracked processes, not GPU memory)" in md
    assert "| host memory |" in md


@pytest.mark.parametrize(
    "name, message",
    [
        ("handmade-truncated.json", "not valid JSON at line 1"),
        ("handmade-foreign.json", "not a chaosgpu journal"),
        ("handmade-not-a-journal.json", "not a Chaos Toolkit journal"),
        ("handmade-missing-timeline.json", "timeline file 'missing-timeline.json' unusable"),
        ("handmade-no-timeline-control.json", "no timeline in this journal"),
    ],
)
def test_bad_journals_give_a_clear_message(name: str, message: str) -> None:
    _, problems = load_journal(str(BAD / name))
    assert any(message in p.message for p in problems), problems


def test_report_goes_on_past_bad_journals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    good = JOURNAL_FILES[0]
    rc = report_main([str(good), str(BAD), str(tmp_path / "nope.json"), "--out",
                      str(tmp_path / "out")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "truncated" in err and "not a chaosgpu journal" in err and "no such file" in err
    page = (tmp_path / "out" / "report.html").read_text()
    assert "not valid JSON" in page
    # The run whose timeline was lost is still reported, with what is missing said.
    assert "Pod deletion whose timeline file was lost" in page
    assert "no timeline in this journal" in page
    assert _raw(good)["experiment"]["title"].replace("&", "&amp;") in page


def test_no_usable_journal_exits_2(tmp_path: Path) -> None:
    # Nothing is written: a good report already in --out is kept (see test_bad_input_cli).
    assert report_main([str(BAD / "handmade-truncated.json"), "--out", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []


def test_html_is_self_contained_and_markdown_has_its_pngs(tmp_path: Path) -> None:
    report = build_report([str(JOURNALS)], str(tmp_path))
    page = (tmp_path / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(report.plots) > 0
    assert "http://" not in page and "https://" not in page and "<script" not in page
    md = (tmp_path / "report.md").read_text()
    images = [line[line.index("](") + 2 : -1] for line in md.splitlines() if line.startswith("![")]
    assert len(images) == len(report.plots)
    for image in images:
        assert (tmp_path / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "GiB x s" in md and "| run |" in md


def test_without_matplotlib_the_report_says_so(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    report = build_report([str(JOURNALS)], str(tmp_path))
    assert report.plots == {}
    assert report.plots_error and "chaostoolkit-gpu[report]" in report.plots_error
    assert "matplotlib is not installed" in (tmp_path / "report.html").read_text()
    assert report_main([str(JOURNALS), "--out", str(tmp_path / "cli")]) == 1


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _screenshot(page: Path, png: Path) -> None:
    profile = tempfile.mkdtemp(prefix="chaosgpu-chromium-")
    command = [
        _chromium() or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
        f"--screenshot={png}", "--window-size=1280,2000", page.as_uri(),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True, env=dict(os.environ))
    try:
        _, err = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail("chromium did not finish within 120 s")
    finally:
        try:  # chromium's helpers share its session: make sure none outlives the test
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(profile, ignore_errors=True)
    assert png.exists(), err.decode(errors="replace")[-2000:]


def _colour_pixels(png: Path, rgb: tuple[int, int, int], tolerance: int = 40) -> tuple[int, int]:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))[:, :, :3] * 255
    distance = abs(pixels - rgb).max(axis=2)
    non_white = int((pixels.min(axis=2) < 200).sum())
    return int((distance < tolerance).sum()), non_white


@pytest.mark.skipif(_chromium() is None, reason="chromium is not installed")
def test_chromium_opens_the_report_and_shows_the_plots(tmp_path: Path) -> None:
    report = build_report([str(JOURNALS)], str(tmp_path / "all"))
    shot = tmp_path / "all.png"
    _screenshot(tmp_path / "all" / "report.html", shot)
    assert shot.stat().st_size > 30_000
    _, non_white = _colour_pixels(shot, (0, 0, 0))
    assert non_white > 20_000  # tables and text drawn, not a blank page
    # One run alone puts its plot in the first screen: its device line (matplotlib's first
    # colour, #1f77b4) must be visible in the screenshot.
    with_timeline = next(r for r in report.runs if r.timeline is not None)
    build_report([with_timeline.path], str(tmp_path / "one"))
    shot_one = tmp_path / "one.png"
    _screenshot(tmp_path / "one" / "report.html", shot_one)
    blue, _ = _colour_pixels(shot_one, (31, 119, 180))
    assert blue > 200, f"no plot line visible ({blue} blue pixels)"
