"""An experiment that omits a required argument, names a variable nothing defines, or gives an
argument a value its activity's rules refuse, is refused by validation, before anything runs:
chaoslib's validation (what `chaos validate` runs) for the arguments' names, `chaosgpu
validate` and the chaosgpu.validation control for the variables and the values."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chaoslib.exceptions import InvalidActivity
from chaoslib.experiment import ensure_experiment_is_valid

from chaosgpu.arguments import argument_problem
from chaosgpu.errors import UnknownVariable
from chaosgpu.validation import (
    argument_problems,
    ensure_variables_resolve,
    unresolved_variables,
)

ROOT = Path(__file__).resolve().parent.parent
CHAOS = shutil.which("chaos") or str(Path(sys.executable).with_name("chaos"))

# (module, function, the required argument left out, the arguments given)
REQUIRED = [
    ("chaosgpu.process.actions", "signal_processes", "scope", {"signal": "SIGTERM"}),
    ("chaosgpu.process.actions", "freeze_processes", "scope", {}),
    ("chaosgpu.process.actions", "resume_processes", "scope", {}),
    ("chaosgpu.process.probes", "processes_in_scope", "scope", {}),
    ("chaosgpu.process.probes", "zombies_in_scope", "scope", {}),
    ("chaosgpu.process.probes", "orphans_in_scope", "scope", {}),
    ("chaosgpu.process.probes", "nothing_left", "scope", {}),
    ("chaosgpu.k8s.actions", "create_gpu_pod", "spec_path", {"ns": "default"}),
    ("chaosgpu.k8s.actions", "kill_rank_in_pod", "name", {"rank": 0}),
    ("chaosgpu.k8s.actions", "freeze_rank_in_pod", "name", {"rank": 0}),
    ("chaosgpu.k8s.actions", "thaw_rank_in_pod", "name", {"rank": 0}),
    ("chaosgpu.k8s.probes", "pod_census", "name", {}),
    ("chaosgpu.gpu.probes", "process_gpu_memory", "pid", {}),
    ("chaosgpu.gpu.probes", "job_progress", "tag", {"window_s": 1}),
    ("chaosgpu.gpu.probes", "job_stalled", "tag", {}),
    ("chaosgpu.gpu.probes", "job_slowdown", "tag", {}),
    ("chaosgpu.gpu.probes", "cuda_oom_seen", "tag", {}),
    ("chaosgpu.timeline.probes", "memory_release_time", "after_event", {"timeout_s": 5}),
    ("chaosgpu.timeline.probes", "gb_seconds_held", "from_event", {"to_event": "kill"}),
    ("chaosgpu.timeline.probes", "termination_timings", "after_event", {}),
    ("chaosgpu.agent.probes", "pod_gpu_memory", "pod_uid", {"url": "http://127.0.0.1:1"}),
]


def _experiment(module: str, func: str, arguments: dict[str, Any],
                where: str = "rollbacks") -> dict[str, Any]:
    activity = {"type": "probe" if module.endswith("probes") else "action", "name": func,
                "provider": {"type": "python", "module": module, "func": func,
                             "arguments": arguments}}
    experiment: dict[str, Any] = {"title": "t", "description": "d", "method": [],
                                  "configuration": {"tag": "t"}}
    if where == "method":
        experiment["method"] = [activity]
    else:
        experiment[where] = [activity]
    return experiment


@pytest.mark.parametrize(("module", "func", "missing", "given"), REQUIRED,
                         ids=[f"{r[1]}-{r[2]}" for r in REQUIRED])
def test_validation_reports_a_required_argument_left_out(module: str, func: str, missing: str,
                                                         given: dict[str, Any]) -> None:
    with pytest.raises(InvalidActivity, match=f"required argument '{missing}' is missing"):
        ensure_experiment_is_valid(_experiment(module, func, given))


def _chaos(tmp_path: Path, *args: str, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           *args], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))


def test_chaos_validate_cli_refuses_an_experiment_missing_a_required_argument(
        tmp_path: Path) -> None:
    for module, func, missing, given, where in (
            ("chaosgpu.timeline.probes", "memory_release_time", "after_event", {}, "method"),
            ("chaosgpu.process.actions", "signal_processes", "scope", {"signal": "SIGKILL"},
             "rollbacks")):
        path = tmp_path / f"{func}.json"
        path.write_text(json.dumps(_experiment(module, func, given, where)))
        done = _chaos(tmp_path, "validate", str(path))
        output = done.stdout + done.stderr
        assert done.returncode == 1, output
        assert f"required argument '{missing}' is missing from activity '{func}'" in output
        given[missing] = "x" if missing == "after_event" else {"pids": [1]}
        path.write_text(json.dumps(_experiment(module, func, given, where)))
        done = _chaos(tmp_path, "validate", str(path))
        assert done.returncode == 0, done.stdout + done.stderr


def test_unresolved_variables_are_named_with_where_they_are_used() -> None:
    experiment = {
        "title": "${title_var}", "description": "d",
        "configuration": {"tag": "a", "n": {"type": "env", "key": "N"}},
        "secrets": {"k8s": {"token": "x"}},
        "method": [{"type": "action", "name": "kill",
                    "provider": {"type": "python", "module": "m", "func": "f",
                                 "arguments": {"scope": {"tag": "${tga}"}, "n": "${n}",
                                               "t": "${token}", "literal": "$${tga}",
                                               "argv": ["sh", "-c", "echo $HOME ${nope}"]}}}],
    }
    assert unresolved_variables(experiment) == [
        ("title_var", "title"),
        ("tga", "method['kill'].provider.arguments.scope.tag"),
        ("nope", "method['kill'].provider.arguments.argv[2]"),
    ]
    with pytest.raises(UnknownVariable, match=r"\$\{tga\} in method\['kill'\]"):
        ensure_variables_resolve(experiment)
    ensure_variables_resolve(experiment, {"title_var", "tga", "nope"})


def test_every_shipped_experiment_validates_and_resolves_its_variables(tmp_path: Path) -> None:
    paths = sorted((ROOT / "experiments").rglob("*.json")) + sorted(
        (ROOT / "tests" / "experiments").glob("*.json"))
    assert paths
    for path in paths:
        # An experiment on a job the user runs names it with --var (its configuration's tag
        # and job are null): without one its timeline control has nothing to track, and both
        # validate and the run refuse it.
        existing = "target:existing-job" in json.loads(path.read_text()).get("tags", [])
        names = ["--var", "tag:str=validate"] if existing else []
        done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", str(path),
                               *names],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env=dict(os.environ, SMOKE_TAG="validate"))
        assert done.returncode == 0, (path, done.stderr)
        if existing:
            bare = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", str(path)],
                                  capture_output=True, text=True, timeout=120, cwd=tmp_path)
            assert bare.returncode == 1 and "no scope given" in bare.stderr, (path, bare.stderr)


def _typo_experiment(tmp_path: Path, pid: int, control: str = "chaosgpu.validation") -> Path:
    experiment = {
        "title": "a typo'd variable", "description": "the kill must never be sent",
        "configuration": {"tag": "x"},
        "controls": [{"name": "chaosgpu-variables",
                      "provider": {"type": "python", "module": control}}],
        "method": [{"type": "action", "name": "kill",
                    "provider": {"type": "python", "module": "chaosgpu.process.actions",
                                 "func": "signal_processes",
                                 "arguments": {"scope": {"pids": [pid]}, "signal": "SIGKILL",
                                               "require_match": "${requier_match}"}}}],
    }
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(experiment))
    return path


def _assert_run_refused(tmp_path: Path, path: Path, target: subprocess.Popen) -> None:
    """`chaos run` of the typo'd experiment is interrupted before its method: nothing ran, and
    the target the method would have SIGKILLed is alive."""
    journal = tmp_path / "journal.json"
    run = _chaos(tmp_path, "run", "--journal-path", str(journal), str(path))
    assert run.returncode != 0, run.stdout + run.stderr
    assert "requier_match" in (tmp_path / "log").read_text()
    data = json.loads(journal.read_text())
    assert data["status"] == "interrupted" and data["run"] == [], data
    assert target.poll() is None  # the SIGKILL was never sent


def test_chaosgpu_validate_and_chaos_run_refuse_a_typo_d_variable(tmp_path: Path) -> None:
    target = subprocess.Popen(["sleep", "60"])
    try:
        path = _typo_experiment(tmp_path, target.pid)
        done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "${requier_match} in method['kill'].provider.arguments.require_match" \
            in done.stderr
        done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", "--var",
                               "requier_match:bool=true", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        # untyped, a --var is text, as chaos run reads it: "true" is no flag
        done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", "--var",
                               "requier_match=true", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 1 and "signal_processes: require_match must be true or " \
            "false, got 'true'" in done.stderr, done.stdout + done.stderr

        _assert_run_refused(tmp_path, path, target)
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


def test_the_timeline_control_refuses_a_typo_d_variable_too(tmp_path: Path) -> None:
    """Every catalog experiment declares the timeline control: it runs the same check."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        path = _typo_experiment(tmp_path, target.pid, control="chaosgpu.timeline.control")
        _assert_run_refused(tmp_path, path, target)
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


def _freeze_experiment(rank: Any, pid: int | None = None) -> dict:
    """A method that freezes `rank` of a job, then SIGKILLs `pid` (when given): neither may
    happen when validation refuses the rank."""
    method = [{"type": "action", "name": "freeze", "provider": {
        "type": "python", "module": "chaosgpu.job.actions", "func": "freeze_rank",
        "arguments": {"tag": "validation-job", "rank": rank}}}]
    if pid is not None:
        method.insert(0, {"type": "action", "name": "kill", "provider": {
            "type": "python", "module": "chaosgpu.process.actions", "func": "signal_processes",
            "arguments": {"scope": {"pids": [pid]}, "signal": "SIGKILL"}}})
    return {"title": "a bad rank", "description": "refused before the method",
            "configuration": {"literal_rank": 1, "env_rank": {"type": "env", "key": "RANK_X"}},
            "controls": [{"name": "chaosgpu-variables",
                          "provider": {"type": "python", "module": "chaosgpu.validation"}}],
            "method": method}


@pytest.mark.parametrize("rank", ["1", 1.0, -1, True])
def test_a_bad_literal_argument_value_is_named_with_where_it_is(rank: Any) -> None:
    problems = argument_problems(_freeze_experiment(rank))
    assert problems == [f"method['freeze']: freeze_rank: rank must be a rank number (a "
                        f"non-negative integer) or \"any\", got {rank!r}"]


@pytest.mark.parametrize("rank", [1, 0, "any", "${literal_rank}", "${env_rank}", "${later}"])
def test_good_or_unknowable_values_pass(rank: Any) -> None:
    """A good value passes; a `${name}` passes when it is good or only the run can resolve it
    (an environment variable, a --var not given here)."""
    assert argument_problems(_freeze_experiment(rank)) == []


def test_a_var_s_value_is_checked_as_the_run_will_pass_it() -> None:
    experiment = _freeze_experiment("${rank}")
    assert argument_problems(experiment, {"rank": 1}) == []
    assert argument_problems(experiment, {"rank": "1"})[0].endswith("got '1'")


def test_the_headline_experiment_with_an_unknown_fault_is_refused_before_it_runs(
        tmp_path: Path) -> None:
    """`--var fault:str=nodeloss` (fail_rank's how is node-loss): `chaosgpu validate` refuses
    it naming the choices, so the run would not start the ring and fail only at the fault
    (before round 22 it validated). The same for kill_rank's signal and freeze_rank's method."""
    headline = ROOT / "experiments" / "nccl-rank-kill.json"
    done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", "--var",
                           "fault:str=nodeloss", str(headline)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "fail_rank: how must be one of 'auto', 'kill', 'freeze', 'partition', " \
           "'node-loss', got 'nodeloss'" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", "--var",
                           "fault:str=node-loss", str(headline)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    from chaosgpu.job import actions

    for function, name, value in ((actions.kill_rank, "signal", "SIGKIL"),
                                  (actions.freeze_rank, "method", "cgroup")):
        problem = argument_problem(function, name, value)
        assert problem is not None and problem.endswith(f"got {value!r}"), problem


def test_chaosgpu_validate_and_chaos_run_refuse_a_bad_argument_value(tmp_path: Path) -> None:
    """`--var rank:str=1` (a text, not a number): `chaosgpu validate` exits 1 naming it, and
    `chaos run` is interrupted before its method (the SIGKILL before the freeze never sent)."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "rank.json"
        experiment = _freeze_experiment("${rank}", target.pid)
        del experiment["configuration"]["env_rank"]  # chaoslib wants it set in the environment
        experiment["configuration"]["rank"] = 0  # `chaos run --var` overrides declared keys
        path.write_text(json.dumps(experiment))
        done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", "--var",
                               "rank:str=1", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "method['freeze']: freeze_rank: rank must be a rank number" in done.stderr
        assert "got '1'" in done.stderr
        done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", "--var",
                               "rank:int=1", str(path)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        journal = tmp_path / "journal.json"
        run = _chaos(tmp_path, "run", "--var", "rank:str=1", "--journal-path", str(journal),
                     str(path))
        assert run.returncode != 0, run.stdout + run.stderr
        assert "rank must be a rank number" in (tmp_path / "log").read_text()
        data = json.loads(journal.read_text())
        assert data["status"] == "interrupted" and data["run"] == [], data
        assert target.poll() is None  # the SIGKILL was never sent
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)
