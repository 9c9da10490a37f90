"""The timeline's typed events know every signal the one signalling program sends
(actions/signal_processes.py's SIGNALS): a fault log entry of any of them alone (no output
record of the send) is a signal sent, in the typed section the timeline control writes, in the
section the report rebuilds from an older journal's `fault:<kind>` marks, and on the report's
event list. Before, the timeline kept a list of its own without SIGTSTP, SIGTTIN, SIGTTOU,
SIGALRM, SIGPIPE, SIGSEGV and SIGBUS: a SIGSEGV recorded in the fault log was no signal."""

import json
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.intarget import load
from chaosgpu.report import events as report_events
from chaosgpu.report.loading import load_journal
from chaosgpu.timeline import events as typed

PROGRAM_SIGNALS = tuple(load("actions", "signal_processes").SIGNALS)
T0 = 1796212800.0


def test_the_timeline_reads_the_program_s_list() -> None:
    assert typed.SIGNAL_NAMES == PROGRAM_SIGNALS
    assert {"SIGTTIN", "SIGTTOU", "SIGALRM", "SIGPIPE", "SIGSEGV", "SIGBUS"} <= set(
        typed.SIGNAL_NAMES)


@pytest.mark.parametrize("name", PROGRAM_SIGNALS)
def test_a_fault_log_entry_of_each_signal_is_a_signal_sent(name: str) -> None:
    """The control's records: the fault action recorded `name` in the fault log and its output
    says nothing of a send: the typed section has the signal, and the report draws it."""
    record = typed.ActivityRecord(name="crash", type="action", module="chaosgpu.job.actions",
                                  func="kill_rank", part="method", at=T0 + 1.0,
                                  end_at=T0 + 1.5, faults=[{"kind": name, "t": T0 + 1.2}],
                                  output={"rank": 0})
    section = typed.typed_section([record], {}, T0, lambda n, p: None)
    assert [(s["signal"], s["activity"], s["t"]) for s in section["signals"]] == [
        (name, "crash", pytest.approx(1.2))]
    assert section["fault"]["kind"] == name
    events = report_events.run_events(None, section)
    assert [(e["name"], e["activity"]) for e in events if e["name"].endswith(" sent")] == [
        (f"{name} sent", "crash")]


@pytest.mark.parametrize("name", PROGRAM_SIGNALS)
def test_a_cleanup_step_of_each_signal_is_a_signal_sent(name: str) -> None:
    """A cleanup's steps (`t` from the action's start) name the signal sent."""
    output = {"steps": [{"step": name.lower(), "t": 0.25, "sent": 1}]}
    assert typed.output_signals(output, T0) == [(name, T0 + 0.25)]


def _older_journal(tmp_path: Path, name: str) -> Path:
    """A journal of before the typed format: the fault is the timeline's `fault:<kind>` mark
    inside the activity's start and end."""
    timeline: dict[str, Any] = {
        "t0": T0, "rate_hz": 10, "source": "host-rss", "devices": [],
        "t": [0.0, 1.0, 2.0, 3.0], "total_mib": [100.0, 100.0, 10.0, 10.0],
        "events": [{"name": "crash", "phase": "start", "t": 1.0, "activity": "crash"},
                   {"name": f"fault:{name}", "phase": "point", "t": 1.2},
                   {"name": "crash", "phase": "end", "t": 1.5, "activity": "crash"}]}
    journal = {
        "chaoslib-version": "1", "status": "completed", "deviated": False,
        "experiment": {"title": "older", "description": "d", "method": []},
        "start": "2026-12-01T00:00:00", "end": "2026-12-01T00:00:10", "duration": 10,
        "steady_states": {"before": None, "after": None, "during": []},
        "run": [{"activity": {"type": "action", "name": "crash", "provider": {
                    "type": "python", "module": "chaosgpu.job.actions", "func": "kill_rank",
                    "arguments": {"tag": "x", "rank": 0, "signal": name}}},
                 "status": "succeeded", "output": {"rank": 0},
                 "start": "2026-12-01T00:00:01", "end": "2026-12-01T00:00:02"}],
        "rollbacks": [], "chaosgpu": {"timeline": timeline}}
    path = tmp_path / f"{name}.journal.json"
    path.write_text(json.dumps(journal))
    return path


@pytest.mark.parametrize("name", PROGRAM_SIGNALS)
def test_an_older_journal_s_fault_mark_of_each_signal_is_drawn_as_a_signal(
        tmp_path: Path, name: str) -> None:
    run, _ = load_journal(str(_older_journal(tmp_path, name)))
    assert run is not None and not run.typed
    sent = [(e["name"], e["activity"], e["t"]) for e in run.events
            if e["name"].endswith(" sent")]
    assert sent == [(f"{name} sent", "crash", pytest.approx(1.2))]
