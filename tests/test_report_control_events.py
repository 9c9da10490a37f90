"""The timeline control records typed events in the journal (chaosgpu.timeline.events): which
activity is the fault, its kind and time, the signals, the release, measured with units; and the
report reads them, never the activities' names. Real `chaos run` subprocesses of
tests/experiments/timeline-hold-kill.json whose activities are renamed so that a reading by
name would pick the wrong one (a probe called "sigterm-kill-check", the fault called "step-2",
the workers' start called "terminate-prep")."""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from chaosgpu.report.loading import load_journal
from chaosgpu.timeline import events as typed

CHAOS = str(Path(sys.executable).with_name("chaos"))
EXPERIMENT = Path(__file__).resolve().parent / "experiments" / "timeline-hold-kill.json"
NAMES = {"start-holders": "terminate-prep", "kill-holders": "step-2",
         "zombies": "sigterm-kill-check"}


def _alive_with_tag(tag: str) -> list[int]:
    from chaosgpu.scope import resolve_scope

    return [p["pid"] for p in resolve_scope({"tag": tag}, observe=True) if not p.get("zombie")]


def _renamed(fault_activity: str | None) -> dict[str, Any]:
    text = EXPERIMENT.read_text()
    for old, new in NAMES.items():
        text = text.replace(f'"{old}"', f'"{new}"')
    experiment = json.loads(text)
    if fault_activity:
        experiment["controls"][0]["provider"]["arguments"]["fault_activity"] = fault_activity
    return experiment


def _run(tmp_path: Path, fault_activity: str | None = None) -> tuple[dict[str, Any], Path]:
    tag = f"typed-{uuid.uuid4().hex[:8]}"
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(_renamed(fault_activity)))
    journal_path = tmp_path / "journal.json"
    done = subprocess.run(
        [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run",
         "--journal-path", str(journal_path), str(path)],
        cwd=tmp_path, env=dict(os.environ, SMOKE_TAG=tag), capture_output=True, text=True,
        timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert not _alive_with_tag(tag)
    return json.loads(journal_path.read_text()), journal_path


def test_the_control_records_the_fault_and_the_report_reads_it(tmp_path: Path) -> None:
    journal, path = _run(tmp_path)
    section = journal["chaosgpu"]
    assert section["format"] == typed.FORMAT
    fault = section["fault"]
    assert (fault["activity"], fault["func"], fault["kind"]) == (
        "step-2", "signal_processes", "SIGKILL")
    assert fault["start_t"] <= fault["t"] < fault["start_t"] + 5
    signals = [s for s in section["signals"] if s["activity"] == "step-2"]
    assert [s["signal"] for s in signals] == ["SIGKILL"] and signals[0]["t"] == fault["t"]
    release = section["release"]
    assert release["unit"] == "s" and 0 <= release["after_fault_s"] < 3
    assert "memory_release_time" in release["source"]
    records = section["measurements"]["memory_release_time"]
    assert records[0]["unit"] == "s" and records[0]["value"] == records[0]["seconds"]
    assert section["measurements"]["gb_seconds_held"][0]["unit"] == "GiB x s"
    run, problems = load_journal(str(path))
    assert run is not None and problems == []
    assert run.typed and run.fault == "kill (SIGKILL) by 'step-2' (signal_processes)"
    kinds = [(e["kind"], e["activity"]) for e in run.events if e["kind"] != "other"]
    assert kinds[:2] == [("fault", "step-2"), ("SIGKILL", "step-2")]
    assert ("fault", "sigterm-kill-check") not in kinds
    assert run.metrics["release_s"].value == release["after_fault_s"]
    assert run.metrics["release_s"].unit == "s"
    # a kill fault: zombies counted by the zombie probe after it, whatever its name
    assert run.metrics["zombies_after_kill"].source == "output of 'sigterm-kill-check' (most seen)"


def test_the_fault_activity_argument_names_the_fault(tmp_path: Path) -> None:
    journal, _ = _run(tmp_path, fault_activity="terminate-prep")
    fault = journal["chaosgpu"]["fault"]
    assert fault["activity"] == "terminate-prep"
    assert fault["source"] == "the control's fault_activity argument"


def test_a_probe_is_never_the_fault() -> None:
    probe = typed.ActivityRecord(name="kill-everything", type="probe", module="m", func="f",
                                 part="method", at=100.0,
                                 output={"sigkill_sent": 1796212800.0})
    action = typed.ActivityRecord(name="x", type="action", module="chaosgpu.job.actions",
                                  func="fail_rank", part="method", at=1796212801.0,
                                  faults=[{"kind": "partition", "t": 1796212801.1},
                                          {"kind": "SIGKILL", "t": 1796212801.2}])
    section = typed.typed_section([probe, action], {}, 1796212800.0, lambda n, p: None)
    assert section["fault"]["activity"] == "x" and section["fault"]["kind"] == "node-loss"
    assert section["fault"]["t"] == pytest.approx(1.1)
    # the probe's record is no signal sent: only the action's fault log counts
    assert [(s["signal"], s["activity"]) for s in section["signals"]] == [("SIGKILL", "x")]


def test_a_scope_signalled_one_process_after_another_is_one_signal() -> None:
    """Two processes of one scope SIGKILLed 15 ms apart across a 10 ms boundary (a loaded node),
    recorded in the fault log and in the output: one SIGKILL; an escalation a second later
    (SIGTERM then SIGKILL 2 s on) stays two."""
    t = 1796212800.005
    kill = typed.ActivityRecord(
        name="kill", type="action", module="chaosgpu.process.actions", func="signal_processes",
        part="method", at=t - 0.1,
        faults=[{"kind": "SIGKILL", "t": t, "pid": 1}, {"kind": "SIGKILL", "t": t + 0.015}],
        output={"signal": "SIGKILL", "results": [{"pid": 1, "sent_at": t + 0.0004},
                                                 {"pid": 2, "sent_at": t + 0.0152}]})
    stop = typed.ActivityRecord(
        name="stop", type="action", module="m", func="f", part="rollbacks", at=t + 10,
        output={"sigterm_sent": t + 10.0, "sigkill_sent": t + 12.0})
    section = typed.typed_section([kill, stop], {}, t - 1, lambda n, p: None)
    assert [(s["signal"], s["activity"], s["at"]) for s in section["signals"]] == [
        ("SIGKILL", "kill", t), ("SIGTERM", "stop", t + 10.0), ("SIGKILL", "stop", t + 12.0)]
    assert section["fault"]["at"] == t


def test_a_background_method_action_can_be_the_fault() -> None:
    """Chaos Toolkit runs a `background: true` action on a thread of its own: it is still part
    of the method (only a hypothesis's probes are "hypothesis"), so it can be the fault."""
    import threading
    import time

    from chaosgpu.timeline import control

    action = {"type": "action", "name": "bg-kill", "background": True,
              "provider": {"type": "python", "module": "chaosgpu.process.actions",
                           "func": "signal_processes"}}
    probe = {"type": "probe", "name": "check", "provider": {"type": "python", "module": "m",
                                                             "func": "f"}}

    def background() -> None:
        control.before_activity_control(context=action)
        control.after_activity_control(context=action, state={
            "status": "succeeded", "output": {"signal": "SIGKILL", "sent_at": time.time()}})

    def hypothesis() -> None:
        control.before_hypothesis_control(context={})
        control.before_activity_control(context=probe)
        control.after_activity_control(context=probe, state={
            "status": "succeeded", "output": {"sigkill_sent": time.time()}})
        control.after_hypothesis_control(context={}, state={"steady_state_met": True})

    control.configure_control()
    try:
        control.before_method_control()
        for target in (hypothesis, background):
            thread = threading.Thread(target=target)
            thread.start()
            thread.join(timeout=10)
            assert not thread.is_alive()
        control.after_method_control()
        section = control._typed(None)
        assert section["fault"]["activity"] == "bg-kill"
        assert [(s["signal"], s["part"]) for s in section["signals"]] == [("SIGKILL", "method")]
        assert [c["when"] for c in control._gating["checks"]] == ["during"]
    finally:
        control.cleanup_control()
