"""Pre-release gating: a run whose fault was never injected must not pass. With the timeline
control's `fail_on_failed_activity`, a failed method activity stops the run (exit 1, status
interrupted) and the rollbacks still play; without it Chaos Toolkit carries on and the run
completes with the steady state met (the silent pass this option exists to prevent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = str(Path(sys.executable).with_name("chaos"))


def _gated(strict: bool, pod: str, title: str, description: str, rate_hz: int = 100) -> dict:
    """An experiment with the timeline control (`fail_on_failed_activity` = `strict`) and a
    steady state of no zombies in sandbox `pod`; the caller adds its method."""
    return {
        "version": "1.0.0", "title": title, "description": description,
        "controls": [{"name": "chaosgpu-timeline", "provider": {
            "type": "python", "module": "chaosgpu.timeline.control",
            "arguments": {"rate_hz": rate_hz, "fail_on_failed_activity": strict}}}],
        "steady-state-hypothesis": {"title": "no zombies", "probes": [{
            "type": "probe", "name": "no-zombies", "tolerance": 0,
            "provider": {"type": "python", "module": "chaosgpu.sandbox.probes",
                         "func": "sandbox_zombie_count", "arguments": {"name": pod}}}]},
    }


def _run(tmp_path: Path, experiment: dict) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`chaos run` of `experiment` in `tmp_path` (log in `log`): the process and its journal."""
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal_path = tmp_path / "journal.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "run", "--journal-path", str(journal_path), str(path)],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    return done, json.loads(journal_path.read_text())


def experiment(fail_on_failed_activity: bool) -> dict:
    return _gated(fail_on_failed_activity, "gating-pod", "a fault that cannot be injected",
                  "create_sandbox with init 'sleep' and an argv fails; nothing else happens") | {
        "method": [{"type": "action", "name": "create-pod", "provider": {
            "type": "python", "module": "chaosgpu.sandbox.actions", "func": "create_sandbox",
            # a refusal of two arguments together, which only the activity makes when it
            # runs (an unknown init alone is refused before the run: chaosgpu validate)
            "arguments": {"name": "gating-pod", "init": "sleep", "argv": ["true"]}}}],
        "rollbacks": [{"type": "action", "name": "remove-pod", "provider": {
            "type": "python", "module": "chaosgpu.sandbox.actions", "func": "remove_sandbox",
            "arguments": {"name": "gating-pod"}}}],
        "runtime": {"rollbacks": {"strategy": "always"}},
    }


@pytest.mark.parametrize("strict", [True, False])
def test_failed_method_activity(strict: bool, tmp_path: Path) -> None:
    done, journal = _run(tmp_path, experiment(strict))
    assert journal["run"][0]["status"] == "failed"
    assert "init 'sleep' takes no argv" in "".join(journal["run"][0]["exception"])
    assert [r["status"] for r in journal["rollbacks"]] == ["succeeded"]
    if strict:
        assert done.returncode == 1
        assert journal["status"] == "interrupted"
        assert journal["chaosgpu"]["gating"]["failed_activity"]["name"] == "create-pod"
    else:
        assert done.returncode == 0 and journal["status"] == "completed"
        assert journal["deviated"] is False


MISSED = Path(__file__).resolve().parent / "experiments" / "missed-steady-state.json"


def _alive_with_tag(tag: str) -> list[int]:
    from chaosgpu.scope import resolve_scope

    return [p["pid"] for p in resolve_scope({"tag": tag}, observe=True) if not p.get("zombie")]


def _run_strategy(tmp_path: Path, strategy: str, tag: str) -> tuple[int, dict, str]:
    """`chaos run --hypothesis-strategy <strategy>` of missed-steady-state.json with the gate
    on; its method waits 3 s after its action so a during-method check runs at least once."""
    experiment = json.loads(MISSED.read_text())
    experiment["method"][0]["pauses"] = {"after": 3}
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal_path = tmp_path / "journal.json"
    done = subprocess.run(
        [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run",
         "--hypothesis-strategy", strategy, "--hypothesis-frequency", "0.5",
         "--journal-path", str(journal_path), str(path)],
        cwd=tmp_path, env=dict(os.environ, SMOKE_GATE="true", SMOKE_TAG=tag),
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return done.returncode, json.loads(journal_path.read_text()), done.stdout + done.stderr


@pytest.mark.parametrize("strategy", ["default", "before-method-only", "continuously"])
def test_missed_before_the_method_interrupts(strategy: str, tmp_path: Path) -> None:
    tag = f"gate-{strategy}-{os.getpid()}"
    code, journal, output = _run_strategy(tmp_path, strategy, tag)
    gating = journal["chaosgpu"]["gating"]
    assert code == 1, output[-3000:]
    assert journal["status"] == "interrupted" and journal["run"] == []
    assert gating["before_met"] is False and gating["interrupted"] is True
    assert [c["when"] for c in gating["checks"]] == ["before"]
    assert not _alive_with_tag(tag)


def _assert_deviated_after_the_method_ran(code: int, journal: dict, output: str) -> dict:
    """A run whose method and rollbacks ran and whose steady state was missed after the gate:
    exit 1, completed, deviated, never interrupted, no before-method check; returns gating."""
    gating = journal["chaosgpu"]["gating"]
    assert code == 1, output[-3000:]
    assert journal["status"] == "completed" and journal["deviated"] is True
    assert [r["status"] for r in journal["run"]] == ["succeeded"]
    assert [r["status"] for r in journal["rollbacks"]] == ["succeeded"]
    assert "before_met" not in gating and "interrupted" not in gating
    return gating


def test_missed_after_the_method_is_a_deviation(tmp_path: Path) -> None:
    # Before the fix the control took this first check for the gate: status interrupted,
    # deviated false.
    tag = f"gate-after-{os.getpid()}"
    gating = _assert_deviated_after_the_method_ran(
        *_run_strategy(tmp_path, "after-method-only", tag))
    assert gating["after_met"] is False
    assert gating["after_state"]["steady_state_met"] is False
    assert [c["when"] for c in gating["checks"]] == ["after"]
    assert not _alive_with_tag(tag)


def test_missed_during_the_method_is_a_deviation(tmp_path: Path) -> None:
    tag = f"gate-during-{os.getpid()}"
    code, journal, output = _run_strategy(tmp_path, "during-method-only", tag)
    gating = _assert_deviated_after_the_method_ran(code, journal, output)
    during = journal["steady_states"]["during"]
    assert during and all(state["steady_state_met"] is False for state in during)
    assert {c["when"] for c in gating["checks"]} == {"during"}
    assert gating["during_missed"] == len(gating["checks"]) >= 1
    assert gating["deviated_by"].endswith("checks during the method not met")
    assert not _alive_with_tag(tag)


def _errored_after_the_method(strict: bool) -> dict:
    """A steady state whose probe names a sandbox nothing creates: met before the method
    (missing_ok "before-method"), raising after it (this run never met that sandbox)."""
    return _gated(strict, "no-such-pod", "a steady-state probe that cannot be made after the "
                  "method", "a typo'd sandbox name in the steady state", rate_hz=50) | {
        "method": [{"type": "probe", "name": "look-at-jobs", "provider": {
            "type": "python", "module": "chaosgpu.node.probes", "func": "jobs"}}],
    }


@pytest.mark.parametrize("strict", [True, False])
def test_a_steady_state_probe_that_raises_after_the_method_is_no_deviation(
        strict: bool, tmp_path: Path) -> None:
    """Chaos Toolkit counts a probe that raised as a missed tolerance: the run deviated (status
    failed, deviated true), the expected end of every baseline. With the gate the run is
    failed and not deviated: the check was never made."""
    done, journal = _run(tmp_path, _errored_after_the_method(strict))
    gating = journal["chaosgpu"]["gating"]
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    assert [r["status"] for r in journal["run"]] == ["succeeded"]
    assert [e["name"] for e in gating["after_errored"]] == ["no-zombies"]
    assert "no-such-pod" in gating["after_errored"][0]["error"]
    if strict:
        assert journal["status"] == "failed" and journal["deviated"] is False
        assert "'no-zombies' raised after the method" in gating["failed_by"]
        assert "failed, not deviated" in (tmp_path / "log").read_text()
    else:
        assert journal["status"] == "failed" and journal["deviated"] is True
        assert "failed_by" not in gating
