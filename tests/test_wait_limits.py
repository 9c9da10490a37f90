"""Every wait in seconds is capped at LONGEST_WAIT_S (1e9 s), by the rules of chaosgpu.arguments,
also where a number is not a `checked` activity's float: a pod's grace period (whole seconds,
or -1 for the pod's own) and the agent's options. A value over the cap is refused naming the
argument and the cap, before anything is contacted or started; the cap itself is accepted.
(The GPU faults' seconds: tests/test_gpu_faults.py; every activity's rules:
tests/test_arguments.py.)"""

import re
from typing import Any

import pytest

from chaosgpu.agent import cli as agent_cli
from chaosgpu.arguments import LONGEST_WAIT_S
from chaosgpu.errors import InvalidArgument
from chaosgpu.k8s import actions as k8s_actions

TOO_LONG = int(LONGEST_WAIT_S) + 1
AT_MOST = re.escape("must be at most 1e+09 s (the longest wait chaosgpu makes)")


def test_the_grace_period_rule_takes_whole_seconds_up_to_the_cap_or_minus_one() -> None:
    rule = k8s_actions.GRACE_PERIOD
    assert all(rule.accepts(v) for v in (-1, 0, 30, int(LONGEST_WAIT_S)))
    for bad in (-2, -1.0, 1.5, 30.0, True, "3", None, TOO_LONG):
        assert not rule.accepts(bad), bad
    with pytest.raises(InvalidArgument, match=f"^grace_period {AT_MOST}, got {TOO_LONG}$"):
        rule.require("grace_period", TOO_LONG)


@pytest.mark.parametrize("activity, kwargs", [
    ("create_gpu_pod", {"spec_path": "pod.yaml"}),
    ("delete_gpu_pods", {"label_selector": "app=trainer"}),
])
def test_a_pod_grace_period_over_the_cap_is_refused_before_the_api_is_called(
        activity: str, kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    def no_api(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the Kubernetes API was contacted")

    monkeypatch.setattr(k8s_actions, "core_api", no_api)
    func = getattr(k8s_actions, activity)
    with pytest.raises(InvalidArgument, match=f"^{activity}: grace_period {AT_MOST}, "
                                              f"got {TOO_LONG}$"):
        func(**kwargs, grace_period=TOO_LONG)
    for bad in (-2, 1.5):
        with pytest.raises(InvalidArgument, match=f"^{activity}: grace_period must be an "
                                                  r"integer >= 0 \(seconds\), or -1 for the "
                                                  f"pod's own, got {bad}$"):
            func(**kwargs, grace_period=bad)


@pytest.mark.parametrize("option", ["--max-seconds", "--jobs-every", "--retention-s",
                                    "--census-ttl", "--job-window"])
def test_an_agent_option_in_seconds_over_the_cap_is_bad_usage(
        option: str, capsys: pytest.CaptureFixture[str]) -> None:
    # --max-seconds and --jobs-every were capped by a check of the agent's own, after parsing.
    with pytest.raises(SystemExit) as stopped:
        agent_cli.main(["--listen", "127.0.0.1:0", "--rate-hz", "0", option, "2e9"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be at most 1e+09 s" in err and "2e9" in err, err
    parsed = agent_cli._parser().parse_args([option, "1e9"])
    assert getattr(parsed, option[2:].replace("-", "_")) == LONGEST_WAIT_S


def test_validate_refuses_a_wait_over_the_cap_without_running_anything() -> None:
    from chaosgpu.validation import argument_problems

    def action(module: str, func: str, **arguments: Any) -> dict[str, Any]:
        return {"type": "action", "name": func, "provider": {
            "type": "python", "module": module, "func": func, "arguments": arguments}}

    experiment = {"method": [
        action("chaosgpu.gpu.actions", "start_memory_pressure", mib=8, duration_s=2e9),
        action("chaosgpu.gpu.actions", "trigger_xid", watch_s="${watch}")],
        "rollbacks": [action("chaosgpu.k8s.actions", "delete_gpu_pods",
                             label_selector="app=trainer", grace_period=TOO_LONG)]}
    problems = argument_problems(experiment, {"watch": 1e12})
    assert [re.sub(r" must be at most .*, got", " ... got", p) for p in problems] == [
        "method['start_memory_pressure']: start_memory_pressure: duration_s ... got 2000000000.0",
        "method['trigger_xid']: trigger_xid: watch_s ... got 1000000000000.0",
        f"rollbacks['delete_gpu_pods']: delete_gpu_pods: grace_period ... got {TOO_LONG}"]
