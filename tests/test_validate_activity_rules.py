"""`chaosgpu validate` (and the pre-run check of the chaosgpu.validation and timeline controls)
refuses every argument value an activity would refuse before touching anything, through the
activity's own rules (chaosgpu.arguments.checked): a scope with a typo'd key, a `missing_ok`
that is not true, false or "before-method", an unknown verdict or phase name, a signal the
signalling program does not send, the timeline control's own bad arguments, a `--var` the
experiment never declares nor uses, and the process faults' and probes', the node probes' and
the workloads' arguments (a signal, a freeze method, a via, an init, a ring's choices, a new
workload's tag). Before, each validated and failed only when its activity
ran, after earlier activities had changed the node. The real CLIs run on experiments written
here; `chaos run` is shown to stop before its method (a SIGKILL it would have sent first is
never sent)."""

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from experiment_helpers import activity as _activity
from experiment_helpers import chaos_run
from experiment_helpers import experiment as _experiment
from experiment_helpers import validate as _validate

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
    # the process faults and probes, the node probes, the workloads and the GPU faults' tag:
    # each was refused only by its body, when the run reached it
    ("chaosgpu.process.actions", "signal_processes", {"scope": {"tag": "x"}, "signal": "SIGKIL"},
     "signal", "unsupported signal 'SIGKIL'"),
    ("chaosgpu.process.actions", "signal_processes", {"scope": {"tags": "x"}}, "scope",
     "unknown scope key(s) ['tags']"),
    ("chaosgpu.process.actions", "freeze_processes", {"scope": {"tag": "x"}, "method": "cgroup"},
     "method", "must be one of 'sigstop', 'freezer', 'freezer-v1', 'freezer-v2', got 'cgroup'"),
    ("chaosgpu.process.actions", "freeze_processes", {"scope": {"tag": "x "}}, "scope",
     "scope 'tag' must be a tag"),
    ("chaosgpu.process.actions", "resume_processes",
     {"scope": {"tag": "x"}, "missing_ok": "sometimes"}, "missing_ok",
     "must be true, false or \"before-method\", got 'sometimes'"),
    ("chaosgpu.process.actions", "resume_processes", {"scope": {"pid": [1]}}, "scope",
     "unknown scope key(s) ['pid']"),
    ("chaosgpu.process.probes", "nothing_left", {"scope": {"tag": "x"}, "missing_ok": "yes"},
     "missing_ok", "got 'yes'"),
    ("chaosgpu.process.probes", "zombies_in_scope", {"scope": {"pids": []}}, "scope",
     "scope 'pids' must be a non-empty list of PIDs"),
    ("chaosgpu.process.probes", "processes_in_scope", {"scope": "x"}, "scope",
     "a scope must be a dict"),
    ("chaosgpu.process.probes", "orphans_in_scope",
     {"scope": {"tag": "x"}, "missing_ok": "before_method"}, "missing_ok",
     "got 'before_method'"),
    ("chaosgpu.node.probes", "zombies", {"scope": {"tag": "x"}, "missing_ok": "sometimes"},
     "missing_ok", "got 'sometimes'"),
    ("chaosgpu.node.probes", "orphans", {"scope": {"tag": "x", "job": "y"}}, "scope",
     "a scope names exactly one kind of target"),
    ("chaosgpu.workloads.actions", "stop_workload", {"tag": "x", "missing_ok": "sometimes"},
     "missing_ok", "got 'sometimes'"),
    ("chaosgpu.workloads.actions", "start_holders", {"via": "gpu"}, "via",
     "must be one of 'torch', 'driver', 'host', 'auto', got 'gpu'"),
    ("chaosgpu.workloads.actions", "start_holders", {"on_sigterm": "exit-now"}, "on_sigterm",
     "must be one of 'ignore', 'exit', 'cleanup', got 'exit-now'"),
    ("chaosgpu.workloads.actions", "start_holders", {"sandbox": "my pod"}, "sandbox",
     "invalid sandbox name 'my pod'"),
    ("chaosgpu.workloads.actions", "start_holders", {"tag": "my tag"}, "tag",
     "invalid tag 'my tag'"),
    ("chaosgpu.workloads.actions", "start_holders", {"count": 5000}, "count",
     "must be an integer from 1 to 1000, got 5000"),
    ("chaosgpu.workloads.actions", "start_pod_with_holders", {"pod": "my pod"}, "pod",
     "invalid sandbox name 'my pod'"),
    ("chaosgpu.workloads.actions", "start_pod_with_holders", {"pod": "p", "init": "systemd"},
     "init", "must be one of 'sleep', 'tini', 'dumb-init', 'none', got 'systemd'"),
    ("chaosgpu.workloads.actions", "start_pod_with_holders", {"pod": "p", "via": "cuda"},
     "via", "got 'cuda'"),
    ("chaosgpu.workloads.actions", "start_pod_with_holders", {"pod": "p", "tag": "-p"}, "tag",
     "invalid tag '-p'"),
    ("chaosgpu.workloads.actions", "start_ring", {"backend": "gpu"}, "backend",
     "must be one of 'nccl', 'gloo', 'auto', got 'gpu'"),
    ("chaosgpu.workloads.actions", "start_ring", {"launcher": "torch"}, "launcher",
     "must be one of 'bare', 'torchrun', got 'torch'"),
    ("chaosgpu.workloads.actions", "start_ring", {"async_error_handling": 4},
     "async_error_handling", "must be one of 0, 1, 2, 3, got 4"),
    ("chaosgpu.workloads.actions", "start_ring", {"sigterm_handler": "exit"}, "sigterm_handler",
     "must be one of 'none', 'destroy', got 'exit'"),
    ("chaosgpu.workloads.actions", "start_ring", {"on_oom": "retry"}, "on_oom",
     "must be one of 'fail', 'skip', got 'retry'"),
    ("chaosgpu.workloads.actions", "start_ring", {"inject": "nccl"}, "inject", "got 'nccl'"),
    ("chaosgpu.workloads.actions", "start_ring", {"tag": "ring/1"}, "tag",
     "invalid tag 'ring/1'"),
    ("chaosgpu.gpu.actions", "start_memory_pressure", {"mib": 64, "tag": "a b"}, "tag",
     "invalid tag 'a b'"),
    ("chaosgpu.gpu.actions", "start_compute_contention", {"tag": "x" * 64}, "tag",
     "invalid tag"),
    ("chaosgpu.k8s.actions", "delete_gpu_pods", {"name_pattern": "x", "missing_ok": "sometimes"},
     "missing_ok", "must be true or false, got 'sometimes'"),
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
        run, data, _ = chaos_run(tmp_path, experiment)
        assert run.returncode != 0, run.stdout + run.stderr
        assert "method['wait']: wait_job_verdict: verdicts must be" in \
            (tmp_path / "log").read_text()
        assert data["status"] == "interrupted" and data["run"] == [], data["run"]
        assert target.poll() is None  # the SIGKILL was never sent
    finally:
        if target.poll() is None:
            os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


def test_validate_takes_every_value_those_activities_take(tmp_path: Path) -> None:
    """The new rules accept what the activities' bodies accepted (any case and "KILL" for a
    signal, the null signal, each freeze method, init, via, ring choice, false or null for no
    injector, a generated tag, true for delete_gpu_pods' missing_ok): with one bad value among
    them, validate names that one alone."""
    good = [
        ("chaosgpu.process.actions", "signal_processes",
         {"scope": {"tag": "x"}, "signal": "kill"}),
        ("chaosgpu.process.actions", "signal_processes", {"scope": {"pids": [1]}, "signal": "0"}),
        ("chaosgpu.process.actions", "freeze_processes",
         {"scope": {"job": "j"}, "method": "freezer-v2"}),
        ("chaosgpu.process.actions", "resume_processes",
         {"scope": {"sandbox": "b"}, "missing_ok": True}),
        ("chaosgpu.process.probes", "nothing_left", {"scope": {"tag": "x"},
                                                     "missing_ok": "before-method"}),
        ("chaosgpu.node.probes", "zombies", {}),
        ("chaosgpu.node.probes", "orphans", {"scope": {"pod": "ns/p"}, "missing_ok": False}),
        ("chaosgpu.workloads.actions", "stop_workload", {"tag": "x", "missing_ok": True}),
        ("chaosgpu.workloads.actions", "start_holders",
         {"via": "host", "on_sigterm": "cleanup", "sandbox": "box-1", "tag": "hold.1_a"}),
        ("chaosgpu.workloads.actions", "start_pod_with_holders",
         {"pod": "p", "init": "tini", "via": "driver", "on_sigterm": "exit", "tag": None}),
        ("chaosgpu.workloads.actions", "start_ring",
         {"backend": "gloo", "launcher": "torchrun", "async_error_handling": 0,
          "sigterm_handler": "destroy", "on_oom": "skip", "inject": False, "tag": "r1"}),
        ("chaosgpu.workloads.actions", "start_ring", {"inject": None}),
        ("chaosgpu.workloads.actions", "start_ring", {"inject": "python"}),
        ("chaosgpu.gpu.actions", "start_compute_contention", {"tag": "c-1"}),
        ("chaosgpu.k8s.actions", "delete_gpu_pods", {"name_pattern": "x", "missing_ok": True}),
    ]
    method = [_activity(module, func, arguments, name=f"good-{index}")
              for index, (module, func, arguments) in enumerate(good)]
    method.append(_activity("chaosgpu.workloads.actions", "start_ring",
                            {"async_error_handling": True}, name="bad"))
    done = _validate(tmp_path, _experiment(*method))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "method['bad']: start_ring: async_error_handling must be one of 0, 1, 2, 3, got " \
           "True" in done.stderr, done.stderr
    assert "good-" not in done.stderr, done.stderr


def test_chaos_run_stops_before_a_freeze_when_a_later_stop_could_not_run(tmp_path: Path) -> None:
    """The method freezes a process, then stops a workload with a `missing_ok` that is neither
    true, false nor "before-method": before, the process was frozen and the run failed at the
    stop; now the pre-run check refuses it and the process is never touched."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        experiment = _experiment(
            _activity("chaosgpu.process.actions", "freeze_processes",
                      {"scope": {"pids": [target.pid]}}, name="freeze"),
            _activity("chaosgpu.workloads.actions", "stop_workload",
                      {"tag": "x", "missing_ok": "sometimes"}, name="stop"),
            controls=[{"name": "pre-run", "provider": {"type": "python",
                                                       "module": "chaosgpu.validation"}}])
        run, data, _ = chaos_run(tmp_path, experiment)
        assert run.returncode != 0, run.stdout + run.stderr
        assert "method['stop']: stop_workload: missing_ok must be" in \
            (tmp_path / "log").read_text()
        assert data["status"] == "interrupted" and data["run"] == [], data["run"]
        stat = Path(f"/proc/{target.pid}/stat").read_text()
        assert stat[stat.rindex(")") + 2] != "T"  # never frozen
    finally:
        os.kill(target.pid, signal.SIGCONT)
        target.kill()
        target.wait(timeout=10)
    assert not Path(f"/proc/{target.pid}").exists()
