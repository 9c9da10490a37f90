"""The timeline control's input and its claims: an unknown (typo'd) argument or a control that
cannot start (a bad scope key, a rate out of range, a flag that is not true or false) stops the
run before anything runs, with the control's own error; a scope that matched no process during
the experiment is said loudly and gives no measurement. Unit tests of the control's hooks, then
the real `chaos run` (tests/experiments/timeline-hold-kill.json with its control changed)."""

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chaoslib.exceptions import InterruptExecution

from chaosgpu.errors import InvalidArgument
from chaosgpu.timeline import control
from chaosgpu.timeline.sampler import current

CHAOS = str(Path(sys.executable).with_name("chaos"))
EXPERIMENT = Path(__file__).resolve().parent / "experiments" / "timeline-hold-kill.json"


@pytest.fixture
def clean_control() -> Iterator[None]:
    """The control's hooks share module state: each test starts and ends without a sampler."""
    control.cleanup_control()
    try:
        yield
    finally:
        control.cleanup_control()
    assert current() is None


def test_an_unknown_argument_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(InvalidArgument) as refused:
        control.configure_control(rate_hz=100, fail_on_failed_activty=True)
    message = str(refused.value)
    assert "unknown argument 'fail_on_failed_activty'" in message
    assert "fail_on_failed_activity" in message and "scope" in message


@pytest.mark.parametrize("value", ["ture", "", "enabled", 2, None, [True]])
def test_a_flag_that_is_not_true_or_false_is_refused(value: Any) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(
            f"fail_on_missed_steady_state must be true or false, got {value!r}")):
        control.configure_control(fail_on_missed_steady_state=value)


@pytest.mark.parametrize("value, expected", [(True, True), ("true", True), (" Yes ", True),
                                             ("1", True), (1, True), (False, False),
                                             ("false", False), ("off", False), (0, False)])
def test_a_flag_reads_true_or_false(value: Any, expected: bool, clean_control: None) -> None:
    control.configure_control(fail_on_failed_activity=value)
    assert control._settings["fail_on_failed_activity"] is expected


@pytest.mark.parametrize("arguments, error", [
    ({"fail_on_failed_activty": True}, "unknown argument 'fail_on_failed_activty'"),
    ({"scope": {"tags": "ring"}}, r"unknown scope key\(s\) \['tags'\]"),
    ({"rate_hz": -5}, "rate_hz must be a number between 1 and 5000, got -5.0"),
    ({"rate_hz": "fast"}, "rate_hz must be a number, got 'fast'"),
    ({"fail_on_failed_activity": "ture"}, "fail_on_failed_activity must be true or false"),
    ({"source": "nvlm"}, "source must be 'auto', 'nvml' or 'host-rss', got 'nvlm'"),
    ({"inline_max_points": "lots"}, "inline_max_points must be a number, got 'lots'"),
])
def test_a_control_that_cannot_start_interrupts_the_run_with_its_own_error(
        arguments: dict[str, Any], error: str, clean_control: None) -> None:
    """Before the fix the error was logged, the run went on unmeasured, and the last error the
    user saw was a later, misleading one (a probe that found no job)."""
    with pytest.raises(InterruptExecution, match="the timeline control cannot start") as stop:
        control.before_experiment_control(context={}, **{"rate_hz": 50, **arguments})
    assert re.search(error, str(stop.value)), str(stop.value)
    _assert_not_measuring(error)
    assert control._gating["interrupted"] is True
    assert re.search(error, control._gating["start_error"])


def test_a_valid_control_starts_and_a_later_bad_one_leaves_no_sampler(
        clean_control: None) -> None:
    control.before_experiment_control(context={}, rate_hz=50, source="host-rss",
                                      scope={"tag": f"ok-{uuid.uuid4().hex[:8]}"})
    assert current() is not None and current().running  # type: ignore[union-attr]
    with pytest.raises(InterruptExecution, match="unknown argument 'rate'"):
        control.before_experiment_control(context={}, rate=50)
    _assert_not_measuring("unknown argument 'rate'")


def _assert_not_measuring(error: str) -> None:
    """No sampler runs after a control that could not start: only one that never starts stands
    in, saying why and that the method has not started (for the rollbacks' "before-method")."""
    sampler = current()
    assert sampler is not None and not sampler.started and not sampler.running
    assert re.search(error, sampler.start_error or "")
    assert sampler.event_time("method", "start") is None


def test_a_scope_that_matched_nothing_is_said_loudly_at_the_end_of_the_method(
        caplog: pytest.LogCaptureFixture, clean_control: None) -> None:
    tag = f"typo-{uuid.uuid4().hex[:8]}"
    control.before_experiment_control(context={}, rate_hz=50, source="host-rss",
                                      scope={"tag": tag})
    control.before_method_control()
    with caplog.at_level(logging.WARNING, logger="chaostoolkit"):
        control.after_method_control()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("matched no process during the experiment" in w and f"tag={tag}" in w
               for w in warnings), warnings
    assert control._gating["scope_matched_nothing"] == f"'tag={tag}'"
    journal: dict[str, Any] = {}
    control.after_experiment_control(state=journal)
    summary = journal["chaosgpu"]["summary"]
    assert summary["scope_matched"] is False and summary["tracked_processes"] == 0
    assert summary["scope"]["tag"] == tag


def test_a_scope_whose_process_matched_and_exited_is_not_warned_about(
        caplog: pytest.LogCaptureFixture, clean_control: None) -> None:
    tag = f"ok-{uuid.uuid4().hex[:8]}"
    control.before_experiment_control(context={}, rate_hz=50, source="host-rss",
                                      scope={"tag": tag})
    control.before_method_control()
    proc = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag))
    try:
        sampler = current()
        assert sampler is not None
        deadline = time.monotonic() + 10  # a look caught before its exec looks again
        while not sampler.matched() and time.monotonic() < deadline:
            control.after_activity_control(context={"name": "start", "type": "action"},
                                           state={"status": "succeeded"})  # a rescan, waited
        assert sampler.matched()
    finally:
        proc.kill()
        proc.wait()
    with caplog.at_level(logging.WARNING, logger="chaostoolkit"):
        control.after_method_control()
    assert not [r for r in caplog.records if "matched no process" in r.getMessage()]
    assert "scope_matched_nothing" not in control._gating


# -- the real `chaos run` ---------------------------------------------------------------------

def _chaos_run(tmp_path: Path, experiment: dict[str, Any], tag: str) -> tuple[int, dict, str]:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal_path = tmp_path / "journal.json"
    done = subprocess.run(
        [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "chaostoolkit.log"), "run",
         "--journal-path", str(journal_path), str(path)],
        cwd=tmp_path, env=dict(os.environ, SMOKE_TAG=tag), stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300)
    return done.returncode, json.loads(journal_path.read_text()), done.stdout + done.stderr


def _with_control_arguments(**changes: Any) -> dict[str, Any]:
    """tests/experiments/timeline-hold-kill.json (start two holders of 64 MiB, SIGKILL them,
    measure; the steady state: memory at the baseline) with its control's arguments changed."""
    experiment = json.loads(EXPERIMENT.read_text())
    experiment["controls"][0]["provider"]["arguments"].update(changes)
    return experiment


def _failures(journal: dict[str, Any]) -> dict[str, str]:
    runs = list(journal.get("run") or [])
    after = (journal.get("steady_states") or {}).get("after") or {}
    runs += [{**probe, "activity": {"name": "after:" + probe["activity"]["name"]}}
             for probe in after.get("probes") or []]
    return {run["activity"]["name"]: "".join(run.get("exception") or [])
            for run in runs if run["status"] == "failed"}


def test_chaos_run_with_a_typo_d_control_scope_does_not_complete(tmp_path: Path) -> None:
    """Before the fix: exit 0, completed, memory released at once and 0 GiB x s held, measured
    over a timeline that tracked no process (the holders carry the tag, the scope its typo)."""
    tag = f"tl-scope-{uuid.uuid4().hex[:8]}"
    code, journal, output = _chaos_run(
        tmp_path, _with_control_arguments(scope={"tag": "${tag}-typo"}), tag)
    assert code == 1, output[-3000:]
    assert journal["deviated"] is True, output[-3000:]
    failed = _failures(journal)
    measured = {"release-time", "held", "termination", "after:memory-at-baseline"}
    assert measured <= set(failed), failed
    for name in measured:
        assert f"scope 'tag={tag}-typo' matched no process during the experiment" in failed[
            name], (name, failed[name])
    assert "WARNING" in output and f"'tag={tag}-typo' matched no process" in output
    assert journal["chaosgpu"]["summary"]["scope_matched"] is False
    assert journal["chaosgpu"]["gating"]["scope_matched_nothing"] == f"'tag={tag}-typo'"
    # the holders did run (the scope, not the workload, was wrong) and were cleaned up
    assert journal["run"][0]["status"] == "succeeded"


def test_chaos_run_with_an_unknown_control_argument_stops_before_anything_runs(
        tmp_path: Path) -> None:
    tag = f"tl-arg-{uuid.uuid4().hex[:8]}"
    code, journal, output = _chaos_run(
        tmp_path, _with_control_arguments(fail_on_failed_activty=True), tag)
    assert code == 1, output[-3000:]
    assert journal["status"] == "interrupted"
    assert journal["run"] == [] and journal["steady_states"]["before"] is None
    assert "the timeline control cannot start (configure_control: unknown argument " \
           "'fail_on_failed_activty'" in output
    assert "fail_on_failed_activity" in journal["chaosgpu"]["gating"]["start_error"]
    # the run's own verdict is the control's error (before the fix: a later probe's); the
    # rollbacks still play (Chaos Toolkit's "always" strategy) and may log their own
    critical = [line for line in output.splitlines() if "CRITICAL" in line]
    assert len(critical) == 1 and "unknown argument 'fail_on_failed_activty'" in critical[0]
