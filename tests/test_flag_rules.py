"""Every boolean flag of a public activity is checked by the rule `BOOL` of chaosgpu.arguments:
true or false, never read by truthiness. Before, `"then_kill": "false"` (a string, truthy) or
`"gpu_only": 0` silently changed what the activity did, and `chaosgpu validate` let it through.

Per flag: `chaosgpu validate` (the real CLI) refuses the text "false" naming the activity, the
argument and "true or false"; the activity called directly refuses a bad value with
InvalidArgument before its body runs (each is given arguments with which its body, were it
reached, would only fail: an unknown sandbox, a missing manifest, no agent url, a GPU index no
machine has; the Kubernetes client is replaced by one that fails the test). `chaos run` with the
validation control stops before its method. `chaos discover` still names each flag "boolean".
Every process a test starts has ended when it returns (the CLIs are waited for, the run's target
is killed, reaped and its /proc entry checked; conftest's no_process_left_behind checks the rest).
"""

import importlib
import inspect
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from experiment_helpers import CHAOS, chaos_run
from experiment_helpers import activity as _activity
from experiment_helpers import experiment as _experiment
from experiment_helpers import validate as _validate

from chaosgpu import ACTIVITY_MODULES
from chaosgpu.arguments import rules_of
from chaosgpu.errors import InvalidArgument

#: A name no sandbox, namespace, pod or job of a test machine has.
NONE = "flag-rule-none"

# (module, function, flag, the other arguments: ones with which the body could only fail)
FLAGS = [
    ("chaosgpu.sandbox.actions", "exec_in_sandbox", "detached",
     {"name": NONE, "argv": ["true"]}),
    ("chaosgpu.k8s.actions", "create_gpu_pod", "wait_running",
     {"spec_path": f"{NONE}.yaml", "ns": NONE}),
    ("chaosgpu.k8s.actions", "delete_gpu_pods", "rand", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.actions", "delete_gpu_pods", "gpu_only", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.actions", "delete_gpu_pods", "wait", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.actions", "kill_rank_in_pod", "allow_other_users", {"name": NONE, "ns": NONE}),
    ("chaosgpu.k8s.actions", "freeze_rank_in_pod", "allow_other_users",
     {"name": NONE, "ns": NONE}),
    ("chaosgpu.k8s.actions", "thaw_rank_in_pod", "allow_other_users", {"name": NONE, "ns": NONE}),
    ("chaosgpu.k8s.probes", "gpu_pods", "gpu_only", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.probes", "gpu_pod_count", "gpu_only", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.probes", "gpu_pods_terminating", "gpu_only",
     {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.probes", "pod_deletion_timings", "wait", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.k8s.probes", "pod_census", "full", {"name": NONE, "ns": NONE}),
    ("chaosgpu.workloads.actions", "start_holders", "allow_host_fallback",
     {"via": "host", "sandbox": NONE}),
    ("chaosgpu.workloads.actions", "start_pod_with_holders", "allow_host_fallback",
     {"pod": NONE, "via": "torch", "device": 4096}),
    ("chaosgpu.network.actions", "partition_rank", "then_kill", {"rank": 0, "tag": NONE}),
    ("chaosgpu.gpu.actions", "trigger_xid", "check", {"device": 4096}),
    ("chaosgpu.node.probes", "node_snapshot", "gpu", {}),
    ("chaosgpu.node.probes", "node_snapshot", "env", {}),
    ("chaosgpu.node.probes", "node_snapshot", "fds", {}),
    ("chaosgpu.agent.probes", "agent_snapshot", "processes", {}),
    # checked before this file, kept in the same test
    ("chaosgpu.k8s.actions", "delete_gpu_pods", "missing_ok", {"name_pattern": NONE, "ns": NONE}),
    ("chaosgpu.network.actions", "heal_all_partitions", "every", {}),
    ("chaosgpu.network.probes", "partitions_in_place", "every", {}),
    ("chaosgpu.job.probes", "detect_hang", "expect_hang", {"tag": NONE, "window_s": 0.1}),
    ("chaosgpu.process.actions", "signal_processes", "require_match",
     {"scope": {"tag": NONE}, "signal": "SIGKILL"}),
]
IDS = [f"{func}-{flag}" for _, func, flag, _ in FLAGS]



def _bool_flags() -> set[tuple[str, str, str]]:
    """(module, function, argument) of every argument of a published activity typed bool."""
    found = set()
    for module_name in ACTIVITY_MODULES:
        module = importlib.import_module(module_name)
        for func_name in getattr(module, "__all__", []):
            signature = inspect.signature(getattr(module, func_name))
            for parameter in signature.parameters.values():
                typed = parameter.annotation is not inspect.Parameter.empty
                flag = isinstance(parameter.default, bool) and not typed
                if parameter.annotation is bool or flag:
                    found.add((module_name, func_name, parameter.name))
    return found


def test_every_boolean_flag_of_an_activity_has_the_rule() -> None:
    """A flag added later without its rule fails here; each one is in FLAGS, so the CLI and
    direct-call tests below cover it."""
    flags = _bool_flags()
    assert flags == {(module, func, flag) for module, func, flag, _ in FLAGS}
    for module, func, flag in flags:
        rule = rules_of(getattr(importlib.import_module(module), func)).get(flag)
        assert rule is not None and rule.what == "true or false", (func, flag, rule)


@pytest.mark.parametrize(("module", "func", "flag", "arguments"), FLAGS, ids=IDS)
def test_validate_refuses_the_text_false(tmp_path: Path, module: str, func: str, flag: str,
                                         arguments: dict[str, Any]) -> None:
    done = _validate(tmp_path, _experiment(_activity(module, func,
                                                     {**arguments, flag: "false"})))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"method['act']: {func}: {flag} must be true or false, got 'false'" in done.stderr, \
        done.stderr


def test_validate_takes_true_and_false_for_every_flag(tmp_path: Path) -> None:
    """The rule refuses only what is not a boolean: every flag given true, then false, passes
    (the other arguments are valid values, whatever their body would do with them)."""
    method = [_activity(module, func, {**arguments, flag: value}, name=f"{func}-{flag}-{value}")
              for module, func, flag, arguments in FLAGS for value in (True, False)]
    done = _validate(tmp_path, _experiment(*method))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Kubernetes activities' client: one that fails the test if an activity reaches it."""

    def reached(*_: Any, **__: Any) -> Any:
        raise AssertionError("the activity reached the Kubernetes API")

    for module in ("chaosgpu.k8s.actions", "chaosgpu.k8s.probes"):
        monkeypatch.setattr(importlib.import_module(module), "core_api", reached)


@pytest.mark.parametrize("bad", ["false", "true", 0, 1, None, "", [False]],
                         ids=["text-false", "text-true", "zero", "one", "null", "empty", "list"])
@pytest.mark.parametrize(("module", "func", "flag", "arguments"), FLAGS, ids=IDS)
def test_the_activity_refuses_a_bad_flag_before_its_body(
        no_cluster: None, module: str, func: str, flag: str, arguments: dict[str, Any],
        bad: Any) -> None:
    """The rule's own refusal (its exact words and class: a body that ran would fail on its
    other arguments with another message), so nothing was touched."""
    activity = getattr(importlib.import_module(module), func)
    with pytest.raises(InvalidArgument) as refused:
        activity(**arguments, **{flag: bad})
    assert type(refused.value) is InvalidArgument
    assert str(refused.value) == f"{func}: {flag} must be true or false, got {bad!r}"


def test_chaos_run_stops_before_its_method_on_a_flag_given_as_text(tmp_path: Path) -> None:
    """The method SIGKILLs a process, then partitions a rank with `then_kill: "false"` (a
    truthy text that would have killed the rank too): the validation control refuses the run
    before the method, so the SIGKILL is never sent."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        experiment = _experiment(
            _activity("chaosgpu.process.actions", "signal_processes",
                      {"scope": {"pids": [target.pid]}, "signal": "SIGKILL"}, name="kill"),
            _activity("chaosgpu.network.actions", "partition_rank",
                      {"rank": 0, "tag": NONE, "then_kill": "false"}, name="partition"),
            controls=[{"name": "pre-run", "provider": {"type": "python",
                                                       "module": "chaosgpu.validation"}}])
        run, journal, _ = chaos_run(tmp_path, experiment)
        assert run.returncode != 0, run.stdout + run.stderr
        assert ("method['partition']: partition_rank: then_kill must be true or false, got "
                "'false'") in (tmp_path / "log").read_text()
        assert journal["status"] == "interrupted" and journal["run"] == [], journal["run"]
        assert target.poll() is None  # the SIGKILL was never sent
    finally:
        if target.poll() is None:
            os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)
    assert not Path(f"/proc/{target.pid}").exists()


def test_chaos_discover_still_names_every_flag_boolean(tmp_path: Path) -> None:
    """`checked` keeps the activity's own signature: discovery shows each flag as "boolean"
    with its default."""
    out = tmp_path / "discovery.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "discover", "--no-install", "--no-system-info", "--discovery-path",
                           str(out), "chaostoolkit-gpu"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and out.exists(), done.stdout + done.stderr
    listed = {(a["mod"], a["name"]): {arg["name"]: arg for arg in a["arguments"]}
              for a in json.loads(out.read_text())["activities"]}
    for module, func, flag, _ in FLAGS:
        argument = listed[(module, func)][flag]
        default = inspect.signature(getattr(importlib.import_module(module), func)
                                    ).parameters[flag].default
        assert argument["type"] == "boolean" and argument["default"] is default, \
            (func, argument)
