"""No vacuous success: a selection that matches nothing (a typo'd tag, job, pod uid or sandbox,
an event not on the timeline) never reads as the healthy value ("no zombies", "nothing left",
"not stalled", "no OOM", "released"), and an action that reached nothing never reads as done.

The one rule (chaosgpu.arguments.missing_allowed): absence is accepted with missing_ok true, or
with "before-method" before the experiment's method starts, and afterwards only for a selection
this run has met (a workload it started, a process seen carrying the tag): it ended. Processes
are real and proven gone afterwards (the autouse fixture checks every one carrying the test id).
"""

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import nvml_available

from chaosgpu import node
from chaosgpu.errors import InvalidArgument
from chaosgpu.gpu import nvml
from chaosgpu.gpu import probes as gpu_probes
from chaosgpu.node import probes as node_probes
from chaosgpu.process import actions as process_actions
from chaosgpu.process import probes as process_probes
from chaosgpu.scope import ScopeError
from chaosgpu.timeline import probes as timeline_probes
from chaosgpu.timeline.sampler import Sampler, install, uninstall
from chaosgpu.workloads import actions as workload_actions

REPO = Path(__file__).resolve().parent.parent

# Each probe on a scope, and what it answers for a scope that holds nothing.
SCOPE_PROBES: list[tuple[Callable[..., Any], Any]] = [
    (process_probes.processes_in_scope, []),
    (process_probes.zombies_in_scope, 0),
    (process_probes.orphans_in_scope, 0),
    (process_probes.nothing_left, True),
    (node_probes.zombies, []),
    (node_probes.orphans, []),
]


def _typo() -> str:
    return f"typo-{uuid.uuid4().hex[:12]}"


@contextmanager
def timeline(method_started: bool) -> Iterator[Sampler]:
    """The experiment's timeline as the control installs it, before or after the method's
    start."""
    sampler = Sampler(rate_hz=20, source="host-rss")
    sampler.start()
    install(sampler)
    try:
        if method_started:
            sampler.mark("method", "start")
        yield sampler
    finally:
        uninstall(sampler)
        sampler.stop()


def _alive(pid: int) -> bool:
    return node.process_state(pid) not in (None, "Z", "X")


def _wait_state(pid: int, states: tuple[str, ...], deadline_s: float = 5.0) -> str | None:
    end = time.monotonic() + deadline_s
    state = node.process_state(pid)
    while state not in states and time.monotonic() < end:
        time.sleep(0.01)
        state = node.process_state(pid)
    return state


@pytest.mark.parametrize("kind", ["tag", "job", "pod", "sandbox"])
def test_scope_probes_refuse_a_selection_this_run_never_met(kind: str) -> None:
    scope = {kind: _typo()}
    for probe, empty in SCOPE_PROBES:
        with pytest.raises(ScopeError, match="a typo"):
            probe(scope)
        with pytest.raises(ScopeError, match="a typo"):
            probe(scope, missing_ok=False)
        assert probe(scope, missing_ok=True) == empty, probe.__name__
        with pytest.raises(InvalidArgument, match="missing_ok must be true, false or"):
            probe(scope, missing_ok="sometimes")
    # the rollback that thaws: a typo would leave the frozen processes frozen
    with pytest.raises(ScopeError, match="a typo"):
        process_actions.resume_processes(scope)
    assert process_actions.resume_processes(scope, missing_ok=True)["sent"] == 0


def test_before_method_accepts_absence_only_until_the_method_starts() -> None:
    tag = _typo()
    with timeline(method_started=False):
        for probe, empty in SCOPE_PROBES:
            assert probe({"tag": tag}) == empty, probe.__name__
        assert gpu_probes.job_stalled(tag, window_s=0.1) is False
        assert gpu_probes.cuda_oom_seen(tag)["seen"] is False
        assert timeline_probes.memory_release_time(after_event=tag, timeout_s=0,
                                                   missing_ok="before-method") == 0.0
    with timeline(method_started=True):
        for probe, _ in SCOPE_PROBES:
            with pytest.raises(ScopeError, match="never met it"):
                probe({"tag": tag})
        with pytest.raises(ValueError, match="no chaosgpu ring workload tagged .* a typo"):
            gpu_probes.job_stalled(tag, window_s=0.1)
        with pytest.raises(ValueError, match="never met that tag"):
            gpu_probes.cuda_oom_seen(tag)
        with pytest.raises(ValueError, match=f"no event '{tag}'"):
            timeline_probes.memory_release_time(after_event=tag, timeout_s=0,
                                                missing_ok="before-method")
        # true is the experiment's explicit "always": it still reads as released
        assert timeline_probes.memory_release_time(after_event=tag, timeout_s=0,
                                                   missing_ok=True) == 0.0
        with pytest.raises(InvalidArgument, match="missing_ok"):
            timeline_probes.memory_release_time(after_event=tag, missing_ok="sometimes")


def test_a_tag_seen_then_ended_reads_empty_after_the_method() -> None:
    tag = f"vacuous-{os.environ['CHAOSGPU_TEST_ID']}"
    procs = [subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag))
             for _ in range(2)]
    try:
        assert process_probes.nothing_left({"tag": tag}) is False  # met here
        assert len(node_probes.orphans({"tag": tag}, missing_ok=False)) == 0
        for proc in procs:
            proc.kill()
            proc.wait()
        with timeline(method_started=True):
            assert process_probes.nothing_left({"tag": tag}) is True  # ended, not a typo
            assert process_probes.zombies_in_scope({"tag": tag}) == 0
            assert process_probes.processes_in_scope({"tag": tag}) == []
            assert node_probes.zombies({"tag": tag}) == []
            assert process_actions.resume_processes({"tag": tag})["sent"] == 0
            with pytest.raises(ScopeError, match="a typo"):
                process_probes.nothing_left({"tag": tag + "-typo"})
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert not any(_alive(proc.pid) for proc in procs)


def test_a_workload_this_run_started_reads_empty_once_stopped() -> None:
    tag = f"vacuous-w-{os.environ['CHAOSGPU_TEST_ID'][:8]}"
    started = workload_actions.start_holders(count=1, mib=4, via="host", on_sigterm="cleanup",
                                             tag=tag)
    try:
        assert workload_actions.stop_workload(tag, grace_s=1)["stopped"] is True
        assert not any(_alive(pid) for pid in started["pids"])
        with timeline(method_started=True):
            # never resolved by a scope here: started by this run is enough
            assert process_probes.nothing_left({"tag": tag}) is True
            assert gpu_probes.job_stalled(tag, window_s=0.1) is False
            assert gpu_probes.cuda_oom_seen(tag)["seen"] is False
    finally:
        workload_actions.stop_workload(tag, grace_s=0)
    assert not any(_alive(pid) for pid in started["pids"])


def test_signal_processes_fails_when_nothing_was_sent() -> None:
    proc = subprocess.Popen(["sleep", "0"])
    try:
        assert _wait_state(proc.pid, ("Z",)) == "Z"  # matched by the census, dead: gone
        with pytest.raises(ScopeError, match="nothing was sent"):
            process_actions.signal_processes({"pids": [proc.pid]}, signal="SIGTERM")
        report = process_actions.signal_processes({"pids": [proc.pid]}, signal="SIGTERM",
                                                  require_match=False)
        assert report["sent"] == 0 and report["gone"] == 1
    finally:
        proc.wait()
    assert node.process_state(proc.pid) is None or not _alive(proc.pid)


def test_signal_processes_still_signals_what_it_matched() -> None:
    tag = f"vacuous-s-{os.environ['CHAOSGPU_TEST_ID']}"
    proc = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag))
    try:
        report = process_actions.signal_processes({"tag": tag}, signal="SIGKILL",
                                                  wait_gone_s=5)
        assert report["sent"] == 1 and report["wait"]["all_gone"] is True
    finally:
        proc.kill()
        proc.wait()
    assert not _alive(proc.pid)


def test_xid_events_fail_when_nvml_registered_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """An XID watch that could watch nothing is no evidence of "no XID" (NVML's answer for a
    device that refuses event registration, faked here: no GPU on this machine)."""

    class Refused:
        registered: list[int] = []
        unsupported = {"0": "Not Supported"}
        error = None
        stopped = False

        def __init__(self, indexes: list[int] | None) -> None:
            Refused.indexes = indexes

        def wait(self, timeout_s: float) -> list[dict[str, Any]]:
            raise AssertionError("nothing to wait for")

        def stop(self) -> None:
            Refused.stopped = True

    monkeypatch.setattr(nvml, "XidWatch", Refused)
    with pytest.raises(RuntimeError, match="registered no GPU for XID events.*Not Supported"):
        gpu_probes.xid_events(timeout_s=0.1)
    assert Refused.stopped


@pytest.mark.skipif(nvml_available(), reason="checks the behaviour without NVML")
def test_without_nvml_the_gpu_probes_are_a_clear_error_never_a_pass() -> None:
    for probe, args in ((gpu_probes.gpu_memory_used, (0,)), (gpu_probes.gpu_processes, (0,)),
                        (gpu_probes.process_gpu_memory, (os.getpid(),)),
                        (gpu_probes.xid_events, ())):
        with pytest.raises(RuntimeError, match="NVML"):
            probe(*args)
    assert gpu_probes.gpu_usable(99) is False  # the steady state "usable" is not met
    assert gpu_probes.gpu_utilization(0, window_s=0.1)["available"] is False


def test_no_catalog_steady_state_accepts_absence_after_the_method() -> None:
    """missing_ok true would let a typo pass the steady state checked after the method: the
    catalog's form is "before-method"."""
    for path in sorted((REPO / "experiments").rglob("*.json")):
        experiment = json.loads(path.read_text())
        for probe in (experiment.get("steady-state-hypothesis") or {}).get("probes") or []:
            arguments = (probe.get("provider") or {}).get("arguments") or {}
            assert arguments.get("missing_ok", "before-method") in ("before-method", False), (
                path.name, probe.get("name"))
