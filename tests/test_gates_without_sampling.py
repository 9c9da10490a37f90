"""The timeline control's gates without its sampler (`sample: false`): for an experiment with
nothing on this node to sample (a Kubernetes experiment run from outside the cluster) a fault
that failed still fails the run, through the real `chaos` CLI and `chaosgpu validate` as
subprocesses. The fault used: a signal to a tag that matches no process (nothing is sent,
which must never pass); no process is started.

* Without a control, Chaos Toolkit ends such a run "completed", exit 0 (the baseline).
* With `sample: false` and `fail_on_failed_activity`, the run is stopped at the failed fault,
  exit 1, the journal says which activity failed, and no sampler ran (no scope needed).
* `chaosgpu validate` accepts such a control with no scope; a `sample` that is no flag is
  refused, and a control that samples with nothing to track is still refused."""

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

BIN = Path(sys.executable).parent
CHAOS, CHAOSGPU = str(BIN / "chaos"), str(BIN / "chaosgpu")


def _experiment(controls: list[dict[str, Any]]) -> dict[str, Any]:
    tag = f"gates-nothing-{uuid.uuid4().hex[:8]}"  # no process carries it
    return {"version": "1.0.0", "title": "a fault that matches nothing", "description": "test",
            "controls": controls,
            "steady-state-hypothesis": {"title": "always met", "probes": [{
                "type": "probe", "name": "true", "tolerance": 0,
                "provider": {"type": "process", "path": "true"}}]},
            "method": [{"type": "action", "name": "signal-nothing", "provider": {
                "type": "python", "module": "chaosgpu.process.actions",
                "func": "signal_processes",
                "arguments": {"scope": {"tag": tag}, "signal": "SIGTERM"}}}]}


def _gates(**arguments: Any) -> list[dict[str, Any]]:
    return [{"name": "chaosgpu-gates", "provider": {
        "type": "python", "module": "chaosgpu.timeline.control", "arguments": arguments}}]


def _run(tmp_path: Path, experiment: dict[str, Any]
         ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal = tmp_path / "journal.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "run", "--journal-path", str(journal), str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return done, json.loads(journal.read_text())


def _validate(tmp_path: Path, experiment: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    return subprocess.run([CHAOSGPU, "validate", str(path)], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_without_a_control_a_fault_that_failed_passes(tmp_path: Path) -> None:
    """The baseline the gate exists for: Chaos Toolkit alone carries on past the failed fault
    and the run is "completed", exit 0."""
    done, journal = _run(tmp_path, _experiment([]))
    (action,) = journal["run"]
    assert action["status"] == "failed" and "matched no process" in "".join(
        action.get("exception") or []), action
    assert done.returncode == 0 and journal["status"] == "completed", journal["status"]


def test_the_gates_without_sampling_fail_the_run_on_the_failed_fault(tmp_path: Path) -> None:
    done, journal = _run(tmp_path, _experiment(_gates(sample=False,
                                                      fail_on_failed_activity=True)))
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert journal["status"] in ("interrupted", "failed"), journal["status"]
    section = journal["chaosgpu"]
    assert section["gating"]["failed_activity"]["name"] == "signal-nothing"
    assert section["summary"] == {"note": "not sampled (the control's sample: false)"}
    assert section["timeline"] is None
    log = (tmp_path / "log").read_text()
    assert "not sampling (sample: false)" in log
    assert "failing the run (fail_on_failed_activity)" in log


def test_validate_takes_gates_without_a_scope_and_refuses_a_bad_sample(tmp_path: Path) -> None:
    good = _validate(tmp_path, _experiment(_gates(sample=False, fail_on_failed_activity=True)))
    assert good.returncode == 0, good.stdout + good.stderr
    bad = _validate(tmp_path, _experiment(_gates(sample="flase")))
    assert bad.returncode != 0
    assert "sample must be true or false, got 'flase'" in bad.stdout + bad.stderr


@pytest.mark.parametrize("arguments", [{}, {"sample": True}, {"sample": False}])
def test_a_control_that_samples_needs_something_to_track(
        tmp_path: Path, arguments: dict[str, Any]) -> None:
    """An experiment whose activities name no tag, job or sandbox (a Kubernetes one names pods
    by labels): a control that samples has nothing to track and is refused; `sample: false` is
    taken."""
    experiment = _experiment(_gates(**arguments))
    experiment["method"] = [{"type": "action", "name": "nothing-local",
                             "provider": {"type": "process", "path": "true"}}]
    done = _validate(tmp_path, experiment)
    if arguments.get("sample") is False:
        assert done.returncode == 0, done.stdout + done.stderr
    else:
        assert done.returncode != 0
        assert "the timeline control cannot start" in done.stdout + done.stderr
