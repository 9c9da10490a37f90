"""Bad arguments are refused before an activity touches anything (chaosgpu.arguments).

Every rule of every activity is tried with values it must refuse: the activity raises
InvalidArgument (chaoslib's InvalidActivity, a ValueError) naming the argument, before its body
runs. Two holes a review found are proved on real processes: freeze_processes(deadline_s=-1)
froze its target, and kill_rank(wait_s=-1) was accepted.
"""

import importlib
import inspect
import os
import re
import signal
import subprocess
import time
from typing import Any

import pytest
from chaoslib.exceptions import InvalidActivity
from proc_helpers import proc_state

import chaosgpu
from chaosgpu import arguments
from chaosgpu.arguments import checked, rules_of
from chaosgpu.errors import InvalidArgument

BAD: dict[str, list[Any]] = {
    "SECONDS": [-1, -0.5, float("nan"), float("inf"), True, "5", 1e12, 1e300],
    "POSITIVE_SECONDS": [0, -1, float("nan"), True, "5", 1e12],
    "UNIX_TIME": [-1, float("nan"), float("inf"), True, "1796648543"],
    "POSITIVE": [0, -2.0, True, "1"],
    "FRACTION": [0, 1.5, -0.1, True],
    "COUNT": [0, -1, 1.5, True, "2"],
    "INDEX": [-1, 1.5, True, "0"],
    "RANK": [-1, 1.5, True, "0", "some", ""],
    "MIB": [-1, float("nan"), True, "64"],
    "PID": [0, -3, 1.0, True, "12"],
    "TEXT": ["", "   ", 3, ["x"]],
    "TAG": ["", "x ", " x", "x\n", "a b", "a\tb", "a\x00b", "a\u200bb", 3],
    "NAME": ["", " x", "x ", "x\n", 3],
    "DEVICE": [-1, "", 1.5, True],
    "ID": [-1, 4294967295, 2**40, 1.5, True, "0"],
    "PORT": [0, 65536, -1, True, "80"],
    "GRACE_PERIOD": [-2, -1.0, 1.5, True, "3", 2_000_000_000],
    "SIGNAL_NAME": ["SIGKIL", "SIGSYS", "sigkill", "", 9, None],
    "FAIL_HOW": ["nodeloss", "Kill", "", 3, None],
    "FREEZE_METHOD": ["cgroup", "SIGSTOP", "", 1, None],
    "MISSING_OK": ["sometimes", "true", "before_method", "", 1, 0, None],
    "BOOL": ["true", "false", 1, 0, None],
    "SCOPE": [{"tag": "x", "include_other_user": True}, {}, "x", {"tag": "x "},
              {"tag": "a", "job": "b"}, {"pids": []}, {"tag": "x", "include_ns_init": "yes"}],
    "VERDICT_LIST": [["runing"], [], "running", [1], None],
    "PHASE": ["begin", "Start", "", 1, None],
    "PARTITION_ID": ["", " ", "${partition}", 3, None],
    "SANDBOX_NAME": ["", "a b", "x\n", "-x", "a/b", 3],
    "INIT": ["systemd", "", 1, None],
    "ARGV": [[], "echo", [1], ["a", 2]],
    "ENV": [["A=1"], {"A": 1}, {"": "x"}, {"A=B": "x"}, "A=1"],
    "USER": ["root", "1:x", -1, 1.5, 2**40],
    "BACKEND": ["gpu", "", 1, None],
    "TARGET": ["cpu", "", 1, None],
    "MODE": ["hang", "", 1, None],
    "EXCEPTION": ["ValueError", "", 1],
    "CUDA_FAULT": ["free", "", 1, None],
    "XID_KIND": ["illegal_address", "", 1, None],
    "CHUNK_MIB": [1, 0, 2.5, True, "64"],
    "FAULT_COUNT": [0, 1_000_001, 1.5, True, "2"],
    "NAMESPACE": ["", "Default", "a b", 3, "x" * 64],
    "POD_NAME": ["", "Pod", "a b", 3],
    "COMMAND": [[], "ls", [1]],
    "SPEC_OVERRIDES": ["{", "[1]", 3, [1]],
    "SIGNAL": ["SIGKIL", "SIGSYS", "", "  ", 9, None],
    "WORKLOAD_TAG": ["", "a b", "x\n", "-x", ".x", "a/b", "x" * 64, 3],
    "VIA": ["gpu", "Torch", "", 1, None],
    "SIGTERM_MODE": ["exit-now", "", 0, None],
    "HOLDER_COUNT": [0, 1001, 1.5, True, "2", None],
    "RING_BACKEND": ["gpu", "NCCL", "", 1, None],
    "LAUNCHER": ["torch", "", 1, None],
    "ASYNC_ERROR_HANDLING": [4, -1, True, 1.0, "3", None],
    "SIGTERM_HANDLER": ["exit", "", 0, None],
    "ON_OOM": ["retry", "", 0, None],
    "INJECT": ["nccl", "", "None", True, 0, 1],
}
#: The rules activities use: chaosgpu.arguments', the Kubernetes grace period (seconds or -1)
#: and the rank faults' choices (a signal the signalling program sends, fail_rank's how,
#: freeze_rank's and freeze_processes' method), and each module's own (a scope, a verdict list,
#: a phase, signal_processes' signal, a new workload's tag, a ring's choices...).
_JOB_ACTIONS = importlib.import_module("chaosgpu.job.actions")
_OWN_RULES = {
    "chaosgpu.scope": ["SCOPE"], "chaosgpu.job.probes": ["VERDICT_LIST"],
    "chaosgpu.timeline.probes": ["PHASE"], "chaosgpu.network.actions": ["PARTITION_ID"],
    "chaosgpu.sandbox.probes": ["SANDBOX_NAME"],
    "chaosgpu.sandbox.actions": ["INIT", "ARGV", "ENV", "USER"],
    "chaosgpu.gpu.actions": ["BACKEND", "TARGET", "MODE", "EXCEPTION", "CUDA_FAULT", "XID_KIND",
                             "CHUNK_MIB", "FAULT_COUNT"],
    "chaosgpu.k8s.selection": ["NAMESPACE", "POD_NAME"],
    "chaosgpu.k8s.actions": ["COMMAND", "SPEC_OVERRIDES"],
    "chaosgpu.process.actions": ["SIGNAL"],
    "chaosgpu.workloads.actions": ["WORKLOAD_TAG", "VIA", "SIGTERM_MODE", "HOLDER_COUNT",
                                   "INJECT"],
    "chaosgpu.workloads.ring": ["RING_BACKEND", "LAUNCHER", "ASYNC_ERROR_HANDLING",
                                "SIGTERM_HANDLER", "ON_OOM"],
}
RULES = {**{name: getattr(arguments, name) for name in BAD if hasattr(arguments, name)},
         "GRACE_PERIOD": importlib.import_module("chaosgpu.k8s.actions").GRACE_PERIOD,
         **{name: getattr(_JOB_ACTIONS, name)
            for name in ("SIGNAL_NAME", "FAIL_HOW", "FREEZE_METHOD")},
         **{name: getattr(importlib.import_module(module), name)
            for module, names in _OWN_RULES.items() for name in names}}
RULE_NAMES = {id(rule): name for name, rule in RULES.items()}
#: a value a required argument's choice rule takes (a placeholder "x" it would refuse)
GOOD = {"MODE": "raise", "VERDICT_LIST": ["running"]}


def _placeholder(param: inspect.Parameter, rule: Any = None) -> Any:
    """A value a required argument's rule accepts (the rule under test fails first)."""
    if RULE_NAMES.get(id(rule)) in GOOD:
        return GOOD[RULE_NAMES[id(rule)]]
    text = str(param.annotation)
    if "Dict" in text or "dict" in text:
        return {"pids": [1]}
    if "List" in text or "list" in text:
        return ["x"]
    if param.annotation is int or "int" in text:  # Union[int, str] (a rank or "any")
        return 1
    return "x"


def _checked_activities() -> list[tuple[str, str]]:
    found = []
    for module_name in chaosgpu.ACTIVITY_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if rules_of(getattr(module, name)):
                found.append((module_name, name))
    return found


def test_every_rule_has_bad_values_to_try() -> None:
    for module_name, name in _checked_activities():
        func = getattr(importlib.import_module(module_name), name)
        for argument, rule in rules_of(func).items():
            assert id(rule) in RULE_NAMES, (name, argument, rule)


@pytest.mark.parametrize(("module_name", "name"), _checked_activities())
def test_bad_arguments_are_refused_by_name(module_name: str, name: str) -> None:
    func = getattr(importlib.import_module(module_name), name)
    signature = inspect.signature(func)
    required = {p.name: _placeholder(p, rules_of(func).get(p.name))
                for p in signature.parameters.values() if p.default is inspect.Parameter.empty}
    for argument, rule in rules_of(func).items():
        for bad in BAD[RULE_NAMES[id(rule)]]:
            with pytest.raises(InvalidArgument, match=f"^{name}: {argument} must be ") as error:
                func(**{**required, argument: bad})
            assert isinstance(error.value, InvalidActivity) and isinstance(error.value, ValueError)
            assert repr(bad) in str(error.value)


def test_none_only_where_the_argument_is_optional() -> None:
    @checked(grace_s=arguments.SECONDS, limit=arguments.COUNT, name=arguments.TEXT)
    def probe(name: str, grace_s: float = 1.0, limit: int | None = 3) -> str:
        """A test activity."""
        return name

    assert probe("a", limit=None) == "a"
    with pytest.raises(InvalidArgument, match="probe: grace_s must be a number of seconds >= 0, "
                                              "got None"):
        probe("a", grace_s=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        probe()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="no argument"):
        checked(nope=arguments.TEXT)(probe)
    assert inspect.signature(probe).parameters["grace_s"].default == 1.0  # signature kept


def test_freeze_with_a_negative_deadline_freezes_nothing() -> None:
    from chaosgpu.process.actions import freeze_processes

    target = subprocess.Popen(["sleep", "60"])
    try:
        for bad in (-1, 0):
            with pytest.raises(InvalidArgument, match="deadline_s must be a number of seconds"):
                freeze_processes(scope={"pids": [target.pid]}, deadline_s=bad)
        time.sleep(0.2)
        assert proc_state(target.pid) == "S"  # still running, never stopped
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


def test_kill_rank_with_a_negative_wait_kills_nothing() -> None:
    from chaosgpu.job.actions import kill_rank

    tag = f"args-{os.environ['CHAOSGPU_TEST_ID']}"
    target = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag, RANK="0",
                                                       WORLD_SIZE="1", LOCAL_RANK="0"))
    try:
        with pytest.raises(InvalidArgument, match="kill_rank: wait_s must be a number of seconds"):
            kill_rank(rank=0, tag=tag, wait_s=-1)
        with pytest.raises(InvalidArgument, match="kill_rank: rank must be a rank number"):
            kill_rank(rank=-1, tag=tag)
        with pytest.raises(InvalidArgument, match=r"kill_rank: unknown argument 'rnk'; it "
                                                  r"takes rank, job, tag, signal, wait_s"):
            kill_rank(rnk=0, tag=tag)  # type: ignore[call-arg]
        time.sleep(0.2)
        assert target.poll() is None and proc_state(target.pid) == "S"
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


@pytest.mark.parametrize(("rule", "convert", "text"), [
    ("SECONDS", float, "nan"), ("SECONDS", float, "inf"), ("SECONDS", float, "-1"),
    ("SECONDS", float, "1e12"), ("POSITIVE_SECONDS", float, "1e10"),
    ("POSITIVE_SECONDS", float, "0"), ("ID", int, "-1"), ("ID", int, "4294967295"),
    ("ID", int, "abc"), ("PORT", int, "70000")])
def test_a_command_line_option_is_refused_by_its_rule(rule: str, convert: Any,
                                                      text: str) -> None:
    """arguments.option: the argparse type every command uses for numbers; a refused value is
    argparse's usage error (exit 2) naming the option and the rule."""
    import argparse

    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--value", type=arguments.option(getattr(arguments, rule), convert))
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args(["--value", text])
    assert stopped.value.code == 2
    assert parser.parse_args(["--value", "1"]).value == 1


def test_every_rule_refuses_its_bad_values_and_takes_a_good_one() -> None:
    good = {"SECONDS": [0, 2.5, arguments.LONGEST_WAIT_S], "POSITIVE_SECONDS": [1e-3, 1e9],
            "UNIX_TIME": [0, 1796648543.72],  # a moment, not a wait: past the waits' cap
            "TAG": ["ring-1", "my.job_2", "hAfoo"], "NAME": ["job 1", "ns/pod"]}
    for name, values in good.items():
        rule = getattr(arguments, name)
        assert all(rule.accepts(v) for v in values), name
        for bad in BAD[name]:
            with pytest.raises(InvalidArgument, match=f"^x must be .*, got {re.escape(repr(bad))}"):
                rule.require("x", bad)
    with pytest.raises(InvalidArgument, match=r"^wait_s must be at most 1e\+09 s \(the longest "
                                              r"wait chaosgpu makes\), got 1000000000000\.0$"):
        arguments.SECONDS.require("wait_s", 1e12)


def _tagged_sleeper(tag: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag, **env))


def test_a_wait_too_long_to_make_is_refused_before_anything_is_sent() -> None:
    # Each once sent its signal, then failed on the wait with a bare OverflowError.
    from chaosgpu.job.actions import cleanup_hung_job, kill_rank
    from chaosgpu.process.actions import freeze_processes, signal_processes

    tag = f"args-{os.environ['CHAOSGPU_TEST_ID']}"
    target = _tagged_sleeper(tag, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        time.sleep(0.1)
        refusals = [
            ("signal_processes: wait_gone_s", 1e12,
             lambda v: signal_processes({"tag": tag}, "SIGKILL", wait_gone_s=v)),
            ("kill_rank: wait_s", 1e12, lambda v: kill_rank(rank=0, tag=tag, wait_s=v)),
            ("cleanup_hung_job: grace_s", 1e12, lambda v: cleanup_hung_job(tag=tag, grace_s=v)),
            ("freeze_processes: deadline_s", 1e300,
             lambda v: freeze_processes({"tag": tag}, deadline_s=v))]
        for label, value, call in refusals:
            with pytest.raises(InvalidArgument, match=f"^{label} must be at most 1e\\+09 s .*, "
                                                      f"got {re.escape(repr(value))}$"):
                call(value)
        os.kill(target.pid, signal.SIGSTOP)  # a SIGCONT sent would show: the target runs
        assert _wait_state(target.pid, "T") == "T"
        with pytest.raises(InvalidArgument, match="wait_gone_s must be at most 1e\\+09 s"):
            signal_processes({"tag": tag}, "SIGCONT", wait_gone_s=1e300)
        time.sleep(0.2)
        assert target.poll() is None and proc_state(target.pid) == "T"  # nothing was sent
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


def test_a_wait_longer_than_one_poll_can_take_is_waited_for() -> None:
    # 30 days: accepted, and longer than poll(2)'s 2**31 - 1 ms (which raised OverflowError).
    from chaosgpu.process.actions import signal_processes

    tag = f"args-{os.environ['CHAOSGPU_TEST_ID']}"
    target = _tagged_sleeper(tag)
    try:
        time.sleep(0.1)
        report = signal_processes({"tag": tag}, "SIGKILL", wait_gone_s=30 * 86400.0)
        assert report["sent"] == 1 and report["wait"]["all_gone"] is True, report
    finally:
        target.kill()
        target.wait(timeout=10)
    assert target.returncode == -signal.SIGKILL


def _wait_state(pid: int, wanted: str, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while proc_state(pid) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc_state(pid)
