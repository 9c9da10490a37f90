"""Declared scopes and the process faults and probes built on them, on real processes."""

import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaosgpu.process import actions, freezer, probes
from chaosgpu.scope import ScopeError, resolve_scope, resolve_scope_detail, validate_scope


def _tag() -> str:
    return f"scope-test-{uuid.uuid4().hex[:8]}"


def _start(tag: str, argv: list[str] | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, CHAOSGPU_TAG=tag)
    return subprocess.Popen(argv or ["sleep", "60"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


@pytest.fixture
def sleepers() -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    tag = _tag()
    procs = [_start(tag) for _ in range(3)]
    time.sleep(0.05)
    yield tag, procs
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except OSError:
            pass
        proc.kill()
        proc.wait()


def _state(pid: int) -> str | None:
    from chaosgpu.node import process_state

    return process_state(pid)  # type: ignore[no-any-return]


def _wait_state(pid: int, wanted: tuple[str, ...], timeout: float = 5.0) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _state(pid) in wanted:
            break
        time.sleep(0.01)
    return _state(pid)


@pytest.mark.parametrize(
    "scope, message",
    [
        (None, "declare a scope"),
        ({}, "declare a scope"),
        ("tag", "must be a dict"),
        ({"include_ns_init": True}, "declare a scope"),
        ({"tag": "a", "job": "b"}, "exactly one kind"),
        ({"tags": "a"}, "unknown scope key"),
        ({"tag": ""}, "non-empty string"),
        ({"tag": 3}, "non-empty string"),
        ({"pids": []}, "non-empty list"),
        ({"pids": [1, "2"]}, "positive integers"),
        ({"pids": [True]}, "positive integers"),
        ({"tag": "a", "include_other_users": "yes"}, "true or false"),
    ],
)
def test_bad_scopes_are_refused_with_a_clear_error(scope: object, message: str) -> None:
    with pytest.raises(ScopeError, match=message):
        validate_scope(scope)


def test_validate_normalises() -> None:
    assert validate_scope({"pids": [5, 3, 5]}) == {
        "pids": [3, 5], "include_other_users": False, "include_ns_init": False}


def test_tag_scope_resolves_to_the_tagged_processes(sleepers: tuple[str, list]) -> None:
    tag, procs = sleepers
    pids = {p["pid"] for p in resolve_scope({"tag": tag})}
    assert pids == {p.pid for p in procs}


def test_pids_scope_excludes_pid1_runner_and_reports_missing(sleepers: tuple[str, list]) -> None:
    _, procs = sleepers
    detail = resolve_scope_detail({"pids": [1, os.getpid(), procs[0].pid, 999_999_999]})
    assert [p["pid"] for p in detail["processes"]] == [procs[0].pid]
    reasons = {e["pid"]: e["reason"] for e in detail["excluded"]}
    assert "PID 1" in reasons[1] and "runner" in reasons[os.getpid()]
    assert detail["missing"][0]["pid"] == 999_999_999


def test_unknown_sandbox_is_a_clear_error() -> None:
    with pytest.raises(ScopeError, match="no sandbox named 'nope'"):
        resolve_scope({"sandbox": "nope"})


def test_signal_processes_kills_exactly_the_scope(sleepers: tuple[str, list]) -> None:
    tag, procs = sleepers
    bystander = _start(_tag())
    try:
        report = actions.signal_processes({"tag": tag}, "SIGKILL", wait_gone_s=5)
        assert report["sent"] == 3 and report["wait"]["all_gone"]
        for proc in procs:
            assert proc.wait(timeout=5) == -signal.SIGKILL
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_signal_processes_refuses_an_empty_scope_and_bad_signal() -> None:
    with pytest.raises(ScopeError, match="matched no process"):
        actions.signal_processes({"tag": _tag()}, "SIGKILL")
    with pytest.raises(ValueError, match="unsupported signal"):
        actions.signal_processes({"tag": _tag()}, "SIGBOGUS")
    with pytest.raises(ScopeError, match="declare a scope"):
        actions.signal_processes(None)
    empty = actions.signal_processes({"tag": _tag()}, "SIGKILL", require_match=False)
    assert empty["sent"] == 0


def test_freeze_and_resume_with_sigstop(sleepers: tuple[str, list]) -> None:
    tag, procs = sleepers
    report = actions.freeze_processes({"tag": tag})
    assert report["sent"] == 3
    assert all(_wait_state(p.pid, ("T",)) == "T" for p in procs)
    resumed = actions.resume_processes({"tag": tag})
    assert resumed["sent"] == 3
    assert all(_wait_state(p.pid, ("S", "R")) in ("S", "R") for p in procs)
    # twice is fine
    assert actions.resume_processes({"tag": tag})["sent"] == 3


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs"),
                    reason="needs root and the cgroup v1 freezer")
def test_freeze_and_resume_with_the_freezer(sleepers: tuple[str, list]) -> None:
    tag, procs = sleepers
    report = actions.freeze_processes({"tag": tag}, method="freezer")
    assert sorted(report["frozen"]) == sorted(p.pid for p in procs)
    assert report["freezer_state"] == "FROZEN"
    resumed = actions.resume_processes({"tag": tag})
    assert resumed["thawed_cgroups"] and not os.path.exists(report["cgroup"])


ROOT = os.geteuid() == 0
FREEZERS = [
    pytest.param("freezer-v1", marks=pytest.mark.skipif(
        not ROOT or not (freezer.V1_ROOT / "cgroup.procs").exists(),
        reason="needs root and the cgroup v1 freezer")),
    pytest.param("freezer-v2", marks=pytest.mark.skipif(
        not ROOT or freezer.v2_root() is None, reason="needs root and a cgroup v2 hierarchy")),
]


def _v2_path(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as handle:
        return next(line.split(":", 2)[2].strip() for line in handle if line.startswith("0::"))


def _our_groups() -> list[str]:
    found = [str(p) for p in freezer.V1_ROOT.glob(f"{freezer.V1_PREFIX}*")]
    return found + [str(p) for p in freezer._v2_groups()]


@pytest.mark.parametrize("method", FREEZERS)
def test_the_freezer_leaves_a_stopped_process_stopped(sleepers: tuple[str, list],
                                                      method: str) -> None:
    # The refusal rules are checked with the null signal: a SIGCONT would resume a process
    # that something else stopped on purpose.
    tag, procs = sleepers
    os.kill(procs[0].pid, signal.SIGSTOP)
    assert _wait_state(procs[0].pid, ("T",)) == "T"
    try:
        report = actions.freeze_processes({"tag": tag}, method=method)
        assert sorted(report["frozen"]) == sorted(p.pid for p in procs)
        assert report["freezer_state"] == "FROZEN"
    finally:
        thawed = freezer.thaw({p.pid for p in procs})  # the cgroups only: no SIGCONT
    assert thawed
    time.sleep(0.2)
    assert _state(procs[0].pid) == "T", "the freezer resumed a stopped process"
    assert _wait_state(procs[1].pid, ("S", "R")) in ("S", "R")


@pytest.mark.skipif(not ROOT or freezer.v2_root() is None,
                    reason="needs root and a cgroup v2 hierarchy")
def test_freeze_and_resume_with_the_v2_freezer(sleepers: tuple[str, list]) -> None:
    tag, procs = sleepers
    homes = {p.pid: _v2_path(p.pid) for p in procs}
    try:
        report = actions.freeze_processes({"tag": tag}, method="freezer-v2")
        assert report["cgroup_version"] == 2 and report["freezer_state"] == "FROZEN"
        assert sorted(report["frozen"]) == sorted(homes)
        group = Path(report["cgroup"])
        assert group.name.startswith(freezer.V2_PREFIX)
        assert "frozen 1" in (group / "cgroup.events").read_text().splitlines()
        for proc in procs:  # a child of its own cgroup: its parent's limits still apply
            assert _v2_path(proc.pid) == f"{homes[proc.pid].rstrip('/')}/{group.name}"
    finally:
        resumed = actions.resume_processes({"tag": tag})
    assert [g["cgroup"] for g in resumed["thawed_cgroups"]] == [str(group)]
    assert not group.exists()
    assert {p.pid: _v2_path(p.pid) for p in procs} == homes  # back where they were
    assert all(_wait_state(p.pid, ("S", "R")) in ("S", "R") for p in procs)


@pytest.mark.parametrize("method", ["sigstop", "freezer", "freezer-v2"])
def test_a_negative_deadline_is_refused_before_anything(sleepers: tuple[str, list],
                                                        method: str) -> None:
    tag, procs = sleepers
    before = _our_groups()
    with pytest.raises(ValueError, match="deadline_s must be a number of seconds > 0, got -1"):
        actions.freeze_processes({"tag": tag}, method=method, deadline_s=-1)
    time.sleep(0.1)
    assert all(_state(p.pid) in ("S", "R") for p in procs), "a target was frozen"
    assert _our_groups() == before


def test_bad_freeze_method() -> None:
    with pytest.raises(ValueError, match="'sigstop' or 'freezer'.*'freezer-v2'.*got 'ice'"):
        actions.freeze_processes({"tag": "x"}, method="ice")


def test_probes_count_zombies_and_nothing_left(sleepers: tuple[str, list]) -> None:
    tag, procs = sleepers
    assert probes.nothing_left({"tag": tag}) is False
    assert len(probes.processes_in_scope({"tag": tag})) == 3
    os.kill(procs[0].pid, signal.SIGKILL)  # not reaped yet: a zombie child of this test
    assert _wait_state(procs[0].pid, ("Z",)) == "Z"
    assert probes.zombies_in_scope({"tag": tag}) == 1
    assert probes.orphans_in_scope({"tag": tag}) == 0
    for proc in procs:
        proc.kill()
        proc.wait()
    assert probes.nothing_left({"tag": tag}) is True
    # a sandbox never created in this run is a typo, not an empty sandbox
    with pytest.raises(ScopeError, match="no sandbox named 'never-created'"):
        probes.nothing_left({"sandbox": "never-created"})
    assert probes.nothing_left({"sandbox": "never-created"}, missing_ok=True) is True
    with pytest.raises(ValueError, match="missing_ok must be true, false or"):
        probes.nothing_left({"sandbox": "never-created"}, missing_ok="sometimes")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv")
def test_other_users_are_excluded_unless_allowed() -> None:
    try:
        uid = pwd.getpwnam("chaosuser").pw_uid
    except KeyError:
        subprocess.run(["useradd", "-m", "chaosuser"], check=True)
        uid = pwd.getpwnam("chaosuser").pw_uid
    tag = _tag()
    proc = _start(tag, ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                        "sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            procs = resolve_scope_detail({"tag": tag}, observe=True)["processes"]
            if procs and procs[0]["uid"] == uid:
                break
            time.sleep(0.02)
        detail = resolve_scope_detail({"tag": tag})
        assert not detail["processes"] and "UID" in detail["excluded"][0]["reason"]
        with pytest.raises(ScopeError, match="matched no process"):
            actions.signal_processes({"tag": tag}, "SIGKILL")
        report = actions.signal_processes({"tag": tag, "include_other_users": True}, "SIGKILL")
        assert report["sent"] == 1
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a local pod")
def test_sandbox_scope_spares_pid1_and_shows_the_zombies() -> None:
    from chaosgpu.sandbox.actions import create_sandbox, remove_sandbox
    from chaosgpu.workloads.actions import start_holders, stop_workload

    name, tag = f"sc-{uuid.uuid4().hex[:6]}", _tag()
    create_sandbox(name=name, init="sleep", grace_s=5)
    try:
        start_holders(count=2, mib=4, via="host", sandbox=name, tag=tag, timeout_s=60)
        detail = resolve_scope_detail({"sandbox": name})
        assert len(detail["processes"]) >= 2
        assert any("PID 1 of its namespace" in e["reason"] for e in detail["excluded"])
        with_init = resolve_scope({"sandbox": name, "include_ns_init": True})
        assert len(with_init) == len(detail["processes"]) + 1
        workers = {p["pid"] for p in resolve_scope({"tag": tag})}
        report = actions.signal_processes({"tag": tag}, "SIGKILL", wait_gone_s=5)
        assert report["sent"] == len(workers) == 2
        # `sleep` as PID 1 never reaps: the report's zombies, counted by the sandbox scope.
        deadline = time.monotonic() + 5
        while probes.zombies_in_scope({"sandbox": name}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert probes.zombies_in_scope({"sandbox": name}) == 2
        assert probes.nothing_left({"sandbox": name}) is False
    finally:
        stop_workload(tag, grace_s=0)
        remove_sandbox(name)
    assert probes.nothing_left({"sandbox": name}) is True


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a local pod")
def test_terminated_sandbox_scope_never_resolves_to_a_newer_namespace() -> None:
    # The kernel hands a freed PID-namespace inode number to the next namespace created: a
    # terminated sandbox's recorded `pid_ns` then names another sandbox's namespace.
    from chaosgpu.sandbox.actions import create_sandbox, remove_sandbox
    from chaosgpu.sandbox.runtime import get_record, terminate

    old, new = f"sc-{uuid.uuid4().hex[:6]}", f"sc-{uuid.uuid4().hex[:6]}"
    create_sandbox(name=old, init="sleep", grace_s=1)
    try:
        terminate(old, grace_s=0)
        create_sandbox(name=new, init="sleep", grace_s=1)
        old_ns, new_ns = get_record(old)["pid_ns"], get_record(new)["pid_ns"]  # type: ignore
        detail = resolve_scope_detail({"sandbox": old, "include_ns_init": True})
        assert detail["processes"] == [], (old_ns, new_ns, detail["processes"])
        assert detail["missing"] and detail["missing"][0]["sandbox"] == old
        assert probes.nothing_left({"sandbox": old}) is True
        assert resolve_scope({"sandbox": new, "include_ns_init": True})
    finally:
        remove_sandbox(new)
        remove_sandbox(old)
