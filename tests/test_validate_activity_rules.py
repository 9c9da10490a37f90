"""`chaosgpu validate` (and the pre-run check of the chaosgpu.validation and timeline controls)
refuses every argument value an activity would refuse before touching anything, through the
activity's own rules (chaosgpu.arguments.checked): a scope with a typo'd key, a `missing_ok`
that is not true, false or "before-method", an unknown verdict or phase name, a signal the
signalling program does not send, the timeline control's own bad arguments, and a `--var` the
experiment never declares nor uses. Before, each validated and failed only when its activity
ran, after earlier activities had changed the node. The real CLIs run on experiments written
here; `chaos run` is shown to stop before its method (a SIGKILL it would have sent first is
never sent)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CHAOS = str(Path(sys.executable).with_name("chaos"))


def _activity(module: str, func: str, arguments: dict[str, Any],
              name: str = "act") -> dict[str, Any]:
    return {"type": "probe" if module.endswith("probes") else "action", "name": name,
            "provider": {"type": "python", "module": module, "func": func,
                         "arguments": arguments}}


def _experiment(*method: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"title": "t", "description": "d", "method": list(method), **extra}


def _validate(tmp_path: Path, experiment: dict[str, Any],
              *options: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    return subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", *options,
                           str(path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


# (module, function, arguments, the argument refused, what the error must say)
REFUSED = [
    ("chaosgpu.network.actions", "partition_processes",
     {"scope": {"tag": "x", "include_other_user": True}}, "scope",
     "unknown scope key(s) ['include_other_user']"),
    ("chaosgpu.job.probes", "job_state", {"tag": "x", "missing_ok": "sometimes"}, "missing_ok",
     "must be true, false or \"before-method\", got 'sometimes'"),
    ("chaosgpu.job.probes", "wait_job_verdict", {"tag": "x", "verdicts": ["runing"]},
     "verdicts", "'running', 'hung', 'failed', 'restarting', 'finished', 'unknown', got "
                 "['runing']"),
    ("chaosgpu.timeline.probes", "memory_release_time", {"after_event": "kill",
                                                         "phase": "begin"},
     "phase", "must be one of 'start', 'end', 'point', got 'begin'"),
    ("chaosgpu.timeline.probes", "gb_seconds_held", {"from_event": "kill", "to_phase": "stop"},
     "to_phase", "got 'stop'"),
    ("chaosgpu.k8s.actions", "kill_rank_in_pod", {"name": "pod", "signal": "SIGKIL"},
     "signal", "got 'SIGKIL'"),
    ("chaosgpu.job.actions", "kill_rank", {"rank": 0, "tag": "ring "}, "tag",
     "must be a tag: a non-empty string without whitespace or control characters"),
    ("chaosgpu.sandbox.probes", "sandbox_exists", {"name": "my pod"}, "name",
     "invalid sandbox name 'my pod'"),
    ("chaosgpu.gpu.actions", "inject_rank_fault", {"mode": "hang", "tag": "x"}, "mode",
     "got 'hang'"),
    ("chaosgpu.network.actions", "heal_all_partitions", {"every": "yes"}, "every",
     "must be true or false, got 'yes'"),
]


@pytest.mark.parametrize(("module", "func", "arguments", "argument", "says"), REFUSED,
                         ids=[f"{r[1]}-{r[3]}" for r in REFUSED])
def test_validate_refuses_what_the_activity_would_refuse_when_it_ran(
        tmp_path: Path, module: str, func: str, arguments: dict[str, Any], argument: str,
        says: str) -> None:
    done = _validate(tmp_path, _experiment(_activity(module, func, arguments)))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"method['act']: {func}: {argument} must be " in done.stderr, done.stderr
    assert says in done.stderr, done.stderr


def test_a_var_value_is_checked_by_the_same_rule(tmp_path: Path) -> None:
    experiment = _experiment(
        _activity("chaosgpu.job.probes", "job_state",
                  {"tag": "x", "missing_ok": "${missing}"}),
        configuration={"missing": False})
    assert _validate(tmp_path, experiment).returncode == 0
    done = _validate(tmp_path, experiment, "--var", "missing:str=sometimes")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "job_state: missing_ok must be true, false or \"before-method\", got 'sometimes'" \
        in done.stderr
    assert _validate(tmp_path, experiment, "--var", "missing:bool=true").returncode == 0


def _timeline_control(**arguments: Any) -> list[dict[str, Any]]:
    return [{"name": "chaosgpu-timeline",
             "provider": {"type": "python", "module": "chaosgpu.timeline.control",
                          "arguments": {"scope": {"tag": "x"}, **arguments}}}]


@pytest.mark.parametrize(("arguments", "says"), [
    ({"rate_hz": 0}, "rate_hz must be a number between 1 and 5000, got 0.0"),
    ({"rate": 50}, "configure_control: unknown argument 'rate'"),
    ({"source": "nvlm"}, "source must be 'auto', 'nvml' or 'host-rss', got 'nvlm'"),
    ({"scope": {"tags": "x"}}, "unknown scope key(s) ['tags']"),
    ({"fail_on_failed_activity": "ture"}, "fail_on_failed_activity must be true or false"),
])
def test_validate_refuses_a_timeline_control_that_could_not_start(
        tmp_path: Path, arguments: dict[str, Any], says: str) -> None:
    experiment = _experiment(_activity("chaosgpu.job.probes", "job_state", {"tag": "x"}),
                             controls=_timeline_control(**arguments))
    done = _validate(tmp_path, experiment)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "controls['chaosgpu-timeline']: the timeline control cannot start (" in done.stderr
    assert says in done.stderr, done.stderr
    experiment["controls"] = _timeline_control(rate_hz=50)
    assert _validate(tmp_path, experiment).returncode == 0


def test_validate_refuses_a_var_the_experiment_does_not_know(tmp_path: Path) -> None:
    experiment = _experiment(
        _activity("chaosgpu.job.actions", "kill_rank", {"rank": "${rank}", "job": "${job}"}),
        configuration={"job": "ring-1", "rank": 0})
    done = _validate(tmp_path, experiment, "--var", "jobb:str=x", "--var", "rnak:int=1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "'jobb', 'rnak'" in done.stderr and "['job', 'rank']" in done.stderr, done.stderr
    done = _validate(tmp_path, experiment, "--var", "job:str=x", "--var", "rank:int=1")
    assert done.returncode == 0, done.stdout + done.stderr
    # a `${name}` only a --var defines, and a key chaosgpu reads itself, are known
    experiment["method"][0]["provider"]["arguments"]["tag"] = "${extra}"
    done = _validate(tmp_path, experiment, "--var", "extra=t",
                     "--var", "chaosgpu_agent_url=http://127.0.0.1:1")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("control", ["chaosgpu.validation", "chaosgpu.timeline.control"])
def test_chaos_run_stops_before_its_method_on_a_value_only_a_later_activity_refuses(
        tmp_path: Path, control: str) -> None:
    """The method SIGKILLs a process, then waits for an unknown verdict: before, the kill was
    sent and the run failed only at the second activity."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        experiment = _experiment(
            _activity("chaosgpu.process.actions", "signal_processes",
                      {"scope": {"pids": [target.pid]}, "signal": "SIGKILL"}, name="kill"),
            _activity("chaosgpu.job.probes", "wait_job_verdict",
                      {"tag": "x", "verdicts": ["runing"], "timeout_s": 1}, name="wait"),
            controls=[{"name": "pre-run", "provider": {
                "type": "python", "module": control,
                **({"arguments": {"scope": {"pids": [target.pid]}, "rate_hz": 20}}
                   if control == "chaosgpu.timeline.control" else {})}}])
        path = tmp_path / "experiment.json"
        path.write_text(json.dumps(experiment))
        journal = tmp_path / "journal.json"
        run = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                              "run", "--journal-path", str(journal), str(path)],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             stdin=subprocess.DEVNULL, env=dict(os.environ))
        assert run.returncode != 0, run.stdout + run.stderr
        assert "method['wait']: wait_job_verdict: verdicts must be" in \
            (tmp_path / "log").read_text()
        data = json.loads(journal.read_text())
        assert data["status"] == "interrupted" and data["run"] == [], data["run"]
        assert target.poll() is None  # the SIGKILL was never sent
    finally:
        if target.poll() is None:
            os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)
