"""Chaos Toolkit actions that start and stop the reference workloads, for real."""

import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import require_tool
from proc_helpers import alive as _alive
from proc_helpers import tagged

from chaosgpu import state
from chaosgpu.arguments import TAG
from chaosgpu.errors import ActivityError, InvalidArgument
from chaosgpu.sandbox import runtime
from chaosgpu.workloads import actions


def test_start_and_stop_holders_on_the_host() -> None:
    started = actions.start_holders(count=3, mib=8, via="host", on_sigterm="cleanup", tag="h-host")
    try:
        assert started["tag"] == "h-host" and started["backend"] == "host"
        assert len(started["pids"]) == 3 and all(_alive(p) for p in started["pids"])
        assert started["ns_pids"] == started["pids"]
        for pid in started["pids"]:
            assert os.getsid(pid) == pid  # own session, detached from the runner
            assert b"CHAOSGPU_TAG=h-host" in Path(f"/proc/{pid}/environ").read_bytes()
        record = state.read_record("workloads", "h-host")
        assert record and [p["pid"] for p in record["processes"]] == started["pids"]
        assert all(p["starttime"] for p in record["processes"])
    finally:
        result = actions.stop_workload("h-host", grace_s=5)
    assert set(result["processes"].values()) == {"exited on SIGTERM"}
    assert not any(_alive(p) for p in started["pids"])
    assert state.read_record("workloads", "h-host") is None
    assert actions.stop_workload("h-host") == {  # twice: this run started it, it ended
        "tag": "h-host", "stopped": False, "note": "no such workload: it ended (this run met "
        "that tag)"}  # fmt: skip


def test_host_workers_carry_their_own_tag_not_the_runners(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    # The runner's scope variables (its tag, job, sandbox) must not reach a workload: it
    # carries the tag it declares, and nothing that puts it in another selection's scope.
    monkeypatch.setenv("CHAOSGPU_TAG", "the-runners-tag")
    monkeypatch.setenv("CHAOSGPU_JOB", "the-runners-job")
    monkeypatch.setenv("CHAOSGPU_SANDBOX", "the-runners-pod")
    started = actions.start_holders(count=1, mib=1, via="host", tag="h-own-tag")
    try:
        environ = Path(f"/proc/{started['pids'][0]}/environ").read_bytes().split(b"\0")
        scope_keys = (b"CHAOSGPU_TAG=", b"CHAOSGPU_JOB=", b"CHAOSGPU_SANDBOX=")
        assert [e for e in environ if e.startswith(scope_keys)] == [b"CHAOSGPU_TAG=h-own-tag"]
    finally:
        actions.stop_workload("h-own-tag", grace_s=0)
    assert not any(_alive(p) for p in started["pids"])


def test_stop_kills_workers_that_ignore_sigterm() -> None:
    started = actions.start_holders(count=2, mib=4, via="host", on_sigterm="ignore")
    t0 = time.monotonic()
    result = actions.stop_workload(started["tag"], grace_s=0.5)
    assert set(result["processes"].values()) == {"killed"}
    assert 0.4 < time.monotonic() - t0 < 5.0
    assert not any(_alive(p) for p in started["pids"])


def test_holders_in_a_sandbox_are_orphans_of_its_pid1() -> None:
    runtime.create("wl-box", grace_s=1)
    try:
        started = actions.start_holders(count=2, mib=4, via="host", sandbox="wl-box")
        listed = {p["pid"]: p for p in runtime.processes("wl-box")}
        for pid, ns_pid in zip(started["pids"], started["ns_pids"], strict=True):
            assert listed[pid]["ns_ppid"] == 1 and listed[pid]["ns_pid"] == ns_pid > 1
        assert {d["sandbox"] for d in started["ready"]} == {"wl-box"}
        result = actions.stop_workload(started["tag"], grace_s=0.2)
        assert set(result["processes"].values()) == {"killed"}
    finally:
        runtime.remove("wl-box")


def test_a_worker_that_cannot_start_leaves_nothing() -> None:
    """Workers that start and fail (a PiB of host memory: mmap refuses it) fail the action with
    the worker's own words, and leave no record and no process."""
    with pytest.raises(RuntimeError, match="did not get ready.*Cannot allocate memory"):
        actions.start_holders(count=2, mib=2**30, via="host", tag="h-fail", timeout_s=60)
    assert state.read_record("workloads", "h-fail") is None
    assert actions.list_workloads() == [] and not tagged("h-fail")


@pytest.mark.parametrize(
    "kwargs, message",
    [({"count": 0}, "count"), ({"mib": -1}, "mib"), ({"via": "magic"}, "via"),
     ({"on_sigterm": "pray"}, "on_sigterm"), ({"tag": "no spaces"}, "invalid tag"),
     ({"tag": ""}, "invalid tag ''"), ({"tag": "x\n"}, r"invalid tag 'x\\n'"),
     ({"sandbox": "no-such-box", "via": "host"}, "no sandbox"), ({"timeout_s": 0}, "timeout")],
)  # fmt: skip
def test_start_holders_bad_input(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        actions.start_holders(**kwargs)
    assert actions.list_workloads() == []


def test_tag_in_use_is_refused() -> None:
    started = actions.start_holders(count=1, mib=1, via="host", tag="h-dup")
    try:
        with pytest.raises(ValueError, match="already in use"):
            actions.start_holders(count=1, mib=1, via="host", tag="h-dup")
    finally:
        actions.stop_workload("h-dup", grace_s=0)
    assert not _alive(started["pids"][0])


def test_discoverable() -> None:
    from chaoslib.discovery.discover import discover_actions

    names = {a["name"] for a in discover_actions("chaosgpu.workloads.actions")}
    assert {"start_holders", "start_ring", "stop_workload"} <= names


def test_stop_all_workloads() -> None:
    first = actions.start_holders(count=1, mib=1, via="host")
    second = actions.start_holders(count=2, mib=1, via="host")
    done = actions.stop_all_workloads()
    assert {d["tag"] for d in done} >= {first["tag"], second["tag"]}
    assert not any(_alive(p) for p in first["pids"] + second["pids"])
    assert actions.list_workloads() == []


def test_stop_all_workloads_tries_every_one_and_names_every_failure() -> None:
    # Records another version (or a hand edit) left unreadable fail to stop; the workload
    # listed between them must still be stopped, and the error must name both failures.
    for tag in ("a-broken", "z-broken"):
        state.write_record("workloads", tag, {"tag": tag, "processes": [{"pid": "not-a-pid"}]})
    started = actions.start_holders(count=2, mib=1, via="host", tag="m-fine")
    try:
        with pytest.raises(RuntimeError, match=r"2 of 3 workload\(s\) could not be stopped.*"
                                               r"a-broken: ValueError.*z-broken: ValueError"):
            actions.stop_all_workloads()
        assert not any(_alive(p) for p in started["pids"])
        assert state.read_record("workloads", "m-fine") is None
    finally:
        for tag in ("a-broken", "z-broken"):
            state.remove_record("workloads", tag)
        actions.stop_workload("m-fine", grace_s=0)


def test_stop_all_workloads_bad_input_changes_nothing() -> None:
    started = actions.start_holders(count=1, mib=1, via="host", tag="h-keep")
    try:
        with pytest.raises(ValueError, match="grace_s must be a number of seconds >= 0"):
            actions.stop_all_workloads(grace_s=-1)
        assert _alive(started["pids"][0])
    finally:
        actions.stop_workload("h-keep", grace_s=0)


@pytest.mark.parametrize(
    "init, count, on_sigterm, fast",
    [("dumb-init", 10, "cleanup", True), ("none", 1, "cleanup", True),
     ("tini", 2, "ignore", True), ("sleep", 2, "cleanup", False),
     ("dumb-init", 2, "ignore", True)],
)  # fmt: skip
def test_start_pod_with_holders(init: str, count: int, on_sigterm: str, fast: bool) -> None:
    pod = f"pwh-{init}-{count}"
    if init == "tini":
        require_tool("tini", install="apt-get install tini")
    started = actions.start_pod_with_holders(pod=pod, init=init, count=count, mib=4,
                                             via="host", on_sigterm=on_sigterm, grace_s=1.5,
                                             tag=f"pwh-{init}", timeout_s=120)  # fmt: skip
    try:
        assert len(started["pids"]) == count and all(_alive(p) for p in started["pids"])
        listed = {p["pid"]: p for p in runtime.processes(pod)}
        assert all(listed[p]["ns_pid"] == n for p, n in zip(started["pids"], started["ns_pids"],
                                                            strict=True))  # fmt: skip
        timings = runtime.terminate(pod)
        # SIGTERM reaches the pod's own workers through dumb-init (process group) or as PID 1;
        # tini forwards it to the shell only, whose exit ends the pod (as does the shell's death
        # under dumb-init when the workers ignore SIGTERM: the kernel kills them with the pod);
        # exec'd workers under sleep make the kubelet wait the whole grace.
        assert (timings["total_s"] < 1.0) is fast, timings
        assert not any(_alive(p) for p in started["pids"])
    finally:
        runtime.remove(pod)
        actions.stop_workload(f"pwh-{init}", grace_s=0)
    assert state.read_record("workloads", f"pwh-{init}") is None


def test_start_pod_with_holders_bad_input() -> None:
    with pytest.raises(ValueError, match="count"):
        actions.start_pod_with_holders(pod="pwh-bad", count=0)
    with pytest.raises(ValueError, match="^start_pod_with_holders: init must be one of 'sleep', "
                                         "'tini', 'dumb-init', 'none', got 'systemd'$"):
        actions.start_pod_with_holders(pod="pwh-bad", init="systemd", via="host", tag="pwh-bad")
    assert runtime.get_record("pwh-bad") is None
    assert state.read_record("workloads", "pwh-bad") is None


def test_stop_never_signals_a_recorded_pid_without_a_start_time() -> None:
    # A worker that exited before it was recorded gets `starttime: None`; its PID may since
    # belong to a stranger, which stop_workload must not signal (no identity to check).
    import signal
    import subprocess

    bystander = subprocess.Popen(["sleep", "60"], env=dict(os.environ),
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        state.write_record("workloads", "h-nostart", {
            "tag": "h-nostart",
            "processes": [{"pid": bystander.pid, "ns_pid": None, "starttime": None,
                           "role": "worker"}],
        })  # fmt: skip
        result = actions.stop_workload("h-nostart", grace_s=0.2, deadline_s=1)
        assert bystander.poll() is None and _alive(bystander.pid), result
        assert result["processes"] == {str(bystander.pid): "already gone"}
        assert state.read_record("workloads", "h-nostart") is None
    finally:
        state.remove_record("workloads", "h-nostart")
        bystander.send_signal(signal.SIGKILL)
        bystander.wait(timeout=10)


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs"),
                    reason="needs root and the cgroup v1 freezer")
def test_stop_keeps_the_record_of_a_worker_still_alive_after_sigkill() -> None:
    # A worker frozen in a v1 freezer group chaosgpu did not make cannot be stopped (a signal
    # would stay pending until its owner thaws it): stop_workload must fail and not forget it
    # (drop its record) while it still lives, so a later stop or cleanup finds it. (One frozen
    # by chaosgpu's own freezer is let out and stopped: tests/test_frozen_targets.py.)
    freezer_root = Path("/sys/fs/cgroup/freezer")
    group = freezer_root / f"h-foreign-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    started = actions.start_holders(count=1, mib=4, via="host", tag="h-frozen")
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(started["pids"][0]))
        (group / "freezer.state").write_text("FROZEN")
        with pytest.raises(ActivityError, match="not stopped.*frozen cgroup"):
            actions.stop_workload("h-frozen", grace_s=0, deadline_s=0.5)
        assert state.read_record("workloads", "h-frozen") is not None
    finally:
        (group / "freezer.state").write_text("THAWED")
        for pid in (group / "cgroup.procs").read_text().split():
            (freezer_root / "cgroup.procs").write_text(pid)
        group.rmdir()
        final = actions.stop_workload("h-frozen", grace_s=0)
    assert not any(_alive(p) for p in started["pids"]), final
    assert state.read_record("workloads", "h-frozen") is None


# -- a tag an activity selects by: matched exactly, never stripped -----------------------------

BAD_TAGS = ["x ", "x\n"]


def _gpu_probe(name: str) -> Any:
    from chaosgpu.gpu import probes

    return getattr(probes, name)


TAG_TAKERS = [
    ("stop_workload", lambda tag: actions.stop_workload(tag, grace_s=0)),
    ("job_progress", lambda tag: _gpu_probe("job_progress")(tag, window_s=0.1)),
    ("job_stalled", lambda tag: _gpu_probe("job_stalled")(tag, window_s=0.1, missing_ok=True)),
    ("job_slowdown", lambda tag: _gpu_probe("job_slowdown")(tag, window_s=0.1)),
    ("cuda_oom_seen", lambda tag: _gpu_probe("cuda_oom_seen")(tag, missing_ok=True)),
]


@pytest.mark.parametrize("bad", BAD_TAGS)
@pytest.mark.parametrize("name, call", TAG_TAKERS, ids=[n for n, _ in TAG_TAKERS])
def test_a_tag_with_whitespace_or_a_control_character_is_refused_naming_it(
        name: str, call: Callable[[str], Any], bad: str) -> None:
    # It used to be accepted as any non-empty text: never matched exactly, it read as "no
    # such workload" (missing_ok) or, stripped elsewhere, reached the workload tagged "x".
    with pytest.raises(InvalidArgument) as refused:
        call(bad)
    assert str(refused.value) == f"{name}: tag must be {TAG.what}, got {bad!r}"


@pytest.mark.parametrize("suffix", [" ", "\n", "\t"])
def test_stop_workload_with_a_near_miss_tag_leaves_the_workload_alone(suffix: str) -> None:
    started = actions.start_holders(count=1, mib=1, via="host", tag="h-exact")
    try:
        with pytest.raises(InvalidArgument, match="stop_workload: tag must be a tag"):
            actions.stop_workload("h-exact" + suffix, grace_s=0, missing_ok=True)
        assert _alive(started["pids"][0])
        assert state.read_record("workloads", "h-exact") is not None
    finally:
        actions.stop_workload("h-exact", grace_s=0)
    assert not _alive(started["pids"][0])


def test_stop_all_workloads_takes_a_record_gone_since_it_was_listed_as_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Another stop (a rollback, `chaosgpu cleanup`) removed it between the listing and the stop:
    # it has ended, it is no typo of a tag this run never met.
    started = actions.start_holders(count=1, mib=1, via="host", tag="h-listed")
    real = state.list_records
    ghost = f"h-gone-{uuid.uuid4().hex[:6]}"
    monkeypatch.setattr(state, "list_records", lambda kind: (
        {ghost: {"tag": ghost}, **real(kind)} if kind == "workloads" else real(kind)))
    try:
        done = {d["tag"]: d for d in actions.stop_all_workloads()}
        assert done[ghost]["stopped"] is False and done["h-listed"]["stopped"] is True
        assert not _alive(started["pids"][0])
    finally:
        monkeypatch.undo()
        actions.stop_workload("h-listed", grace_s=0)


@pytest.mark.parametrize("bad", ["x\n", "x ", "", "-x", "x" * 64, "a/b"])
def test_a_new_workload_tag_is_matched_whole_by_every_start(bad: str) -> None:
    # `^...$` let "x\n" through: a workload was started and recorded under "x\n".
    from chaosgpu.gpu import launch

    for claim in (actions.claim_tag, launch.check_tag):
        with pytest.raises(ValueError, match=f"^invalid tag {re.escape(repr(bad))}: use 1-63"):
            claim(bad, "p")
    assert actions.list_workloads() == []
