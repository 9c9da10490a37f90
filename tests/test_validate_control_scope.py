"""`chaosgpu validate` refuses a timeline control with nothing to track, as `chaos run` does.

Given no `scope`, the timeline control tracks the tags, jobs and sandboxes the experiment's
chaosgpu activities name (`own_targets`); with none, it cannot start and `chaos run` stops before
the steady state and the method. Before, `chaosgpu validate` passed such an experiment. Both now
make the one decision (`chaosgpu.timeline.control.no_scope_problem`) and say it in the same
words (`NO_SCOPE`). A `${name}` validation resolves (a configuration value, a `--var`) is
decided: a tag it gives is tracked, a null one names nothing. One only the run resolves (an
environment variable, a secret) is left to the run, which then decides with its value. The real
CLIs run on experiments written here; every process they start is waited for and shown gone.
"""

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import processes_with_test_id
from experiment_helpers import activity as _activity
from experiment_helpers import chaos_run as _chaos_run
from experiment_helpers import experiment
from experiment_helpers import validate as _validate

from chaosgpu.timeline.control import NO_SCOPE

CONTROL = "controls['chaosgpu-timeline']: the timeline control cannot start ("


def _experiment(*method: dict[str, Any], scope: Any = None, **extra: Any) -> dict[str, Any]:
    """An experiment whose timeline control gets `scope` (none when None)."""
    arguments: dict[str, Any] = {"rate_hz": 20, "source": "host-rss"}
    if scope is not None:
        arguments["scope"] = scope
    return experiment(*method, controls=[{"name": "chaosgpu-timeline", "provider": {
        "type": "python", "module": "chaosgpu.timeline.control", "arguments": arguments}}],
        **extra)


#: a method whose only activity names no tag, job or sandbox
NOTHING_NAMED = _activity("chaosgpu.node.probes", "jobs")


def _gone(test_id: str) -> None:
    """No process the test started (each carries its CHAOSGPU_TEST_ID) is alive."""
    assert not [p for p in processes_with_test_id(test_id) if p[1] != "Z"]


def _refused(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    assert CONTROL + NO_SCOPE + ")" in done.stderr, done.stderr


def _not_refused(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no scope given" not in done.stderr, done.stderr


def _assert_run_refused(run: subprocess.CompletedProcess[str], journal: dict[str, Any],
                        log: str) -> None:
    """The run stopped at the control's start, before the steady state and the method, with
    the control's own words (as before validate made the check)."""
    assert run.returncode == 1, run.stdout + run.stderr
    assert journal["status"] == "interrupted" and journal["run"] == [], journal["run"]
    assert journal["chaosgpu"]["gating"]["start_error"] == NO_SCOPE
    assert (f"chaosgpu: the timeline control cannot start ({NO_SCOPE}); nothing of this run "
            f"would be measured: stopping it before the steady state and method") in log
    assert "bad argument values" not in log  # the control's refusal, not the pre-run check's


def test_validate_refuses_a_control_with_nothing_to_track_and_chaos_run_still_stops(
        tmp_path: Path, no_process_left_behind: str) -> None:
    """Before, `chaosgpu validate` printed {"valid": true} for this experiment."""
    experiment = _experiment(NOTHING_NAMED)
    _refused(_validate(tmp_path, experiment))
    run, journal, log = _chaos_run(tmp_path, experiment)
    _assert_run_refused(run, journal, log)
    _gone(no_process_left_behind)


@pytest.mark.parametrize(("activity", "scope"), [
    (_activity("chaosgpu.job.probes", "job_state", {"tag": "ring"}), None),
    (_activity("chaosgpu.job.probes", "job_state", {"job": "ring-1"}), None),
    (_activity("chaosgpu.process.probes", "processes_in_scope", {"scope": {"tag": "ring"}}),
     None),
    (_activity("chaosgpu.sandbox.probes", "sandbox_exists", {"name": "box-1"}), None),
    (NOTHING_NAMED, {"tag": "ring"}),
], ids=["tag", "job", "scope-argument", "sandbox-name", "control-scope"])
def test_a_named_target_or_a_scope_lets_the_control_start(
        tmp_path: Path, activity: dict[str, Any], scope: Any, no_process_left_behind: str) -> None:
    _not_refused(_validate(tmp_path, _experiment(NOTHING_NAMED, activity, scope=scope)))
    _gone(no_process_left_behind)


def test_a_rollback_or_steady_state_target_counts_too(tmp_path: Path,
                                                      no_process_left_behind: str) -> None:
    """As at run time, the steady-state probes and the rollbacks name targets too."""
    probe = _activity("chaosgpu.job.probes", "job_state", {"tag": "ring"}, name="probe")
    experiment = _experiment(NOTHING_NAMED, **{"steady-state-hypothesis": {
        "title": "h", "probes": [{**probe, "tolerance": True}]}})
    _not_refused(_validate(tmp_path, experiment))
    experiment = _experiment(NOTHING_NAMED, rollbacks=[_activity(
        "chaosgpu.workloads.actions", "stop_workload", {"tag": "ring", "missing_ok": True})])
    _not_refused(_validate(tmp_path, experiment))
    _gone(no_process_left_behind)


def test_a_tag_the_configuration_or_a_var_gives_is_decided_by_validate(
        tmp_path: Path, no_process_left_behind: str) -> None:
    """`${tag}` from the configuration: a tag is tracked; null (the catalog's "give it with
    --var") names nothing, so validate refuses it as the run without that --var would; the
    --var given to validate decides it as the run's --var would."""
    tagged = _activity("chaosgpu.job.probes", "job_state", {"tag": "${tag}"})
    _not_refused(_validate(tmp_path, _experiment(NOTHING_NAMED, tagged,
                                                 configuration={"tag": "ring"})))
    experiment = _experiment(NOTHING_NAMED, tagged, configuration={"tag": None})
    _refused(_validate(tmp_path, experiment))
    _not_refused(_validate(tmp_path, experiment, "--var", "tag=ring"))
    _refused(_validate(tmp_path, _experiment(NOTHING_NAMED, tagged,
                                             configuration={"tag": "ring"}),
                       "--var", "tag:json=null"))
    # the control's own scope from a ${name}: null is no scope, a value is one
    _refused(_validate(tmp_path, _experiment(NOTHING_NAMED, scope="${scope}",
                                             configuration={"scope": None})))
    _not_refused(_validate(tmp_path, _experiment(NOTHING_NAMED, scope="${scope}",
                                                 configuration={"scope": None}),
                           "--var", 'scope:json={"tag": "ring"}'))
    run, journal, log = _chaos_run(tmp_path, experiment)  # tag null, no --var: refused
    _assert_run_refused(run, journal, log)
    _gone(no_process_left_behind)


@pytest.mark.parametrize("where", ["environment", "secret", "control-scope"])
def test_what_only_the_run_resolves_is_left_to_the_run(
        tmp_path: Path, where: str, no_process_left_behind: str) -> None:
    """A tag from an environment variable or a secret, or the control's scope from an
    environment variable: validate cannot know it, so it does not refuse."""
    env_config = {"tag": {"type": "env", "key": "SCOPECHK_TAG"}}
    tagged = _activity("chaosgpu.job.probes", "job_state", {"tag": "${tag}"})
    experiment = {
        "environment": _experiment(NOTHING_NAMED, tagged, configuration=env_config),
        "secret": _experiment(NOTHING_NAMED, tagged, secrets={"ids": {"tag": "ring"}}),
        "control-scope": _experiment(
            NOTHING_NAMED, scope="${scope}",
            configuration={"scope": {"type": "env", "key": "SCOPECHK_SCOPE",
                                     "env_var_type": "json"}}),
    }[where]
    _not_refused(_validate(tmp_path, experiment, env={"SCOPECHK_TAG": "ring",
                                                      "SCOPECHK_SCOPE": '{"tag": "ring"}'}))
    _gone(no_process_left_behind)


def test_the_run_decides_what_validate_left_to_it(tmp_path: Path,
                                                  no_process_left_behind: str) -> None:
    """The tag from an environment variable: validate passes either way; the run tracks the
    tag it gives, and refuses one that names nothing (an empty text), in the same words."""
    experiment = _experiment(
        _activity("chaosgpu.process.probes", "processes_in_scope",
                  {"scope": {"tag": "${tag}"}, "missing_ok": True}),
        configuration={"tag": {"type": "env", "key": "SCOPECHK_TAG"}})
    for value in ("", "scopechk-ring"):
        _not_refused(_validate(tmp_path, experiment, env={"SCOPECHK_TAG": value}))
    run, journal, log = _chaos_run(tmp_path, experiment, env={"SCOPECHK_TAG": ""})
    _assert_run_refused(run, journal, log)
    run, journal, log = _chaos_run(tmp_path, experiment, env={"SCOPECHK_TAG": "scopechk-ring"})
    assert run.returncode == 0, log[-3000:]
    assert journal["status"] == "completed", log[-3000:]
    assert [entry["tag"] for entry in journal["chaosgpu"]["summary"]["own_targets"]] \
        == ["scopechk-ring"]
    assert "start_error" not in journal["chaosgpu"]["gating"]
    _gone(no_process_left_behind)
