"""Declared scopes and the process faults and probes built on them, on real processes."""

import os
import pwd
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from chaosgpu.job import hang
from chaosgpu.job.observe import JobError
from chaosgpu.node import read_process
from chaosgpu.process import actions, freezer, probes
from chaosgpu.scope import (
    ScopeError,
    describe_scope,
    resolve_scope,
    resolve_scope_detail,
    validate_scope,
)


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
        ({"pids": [{"pid": 5}]}, r"entries are a PID or \{\"pid\": PID, \"starttime\""),
        ({"pids": [{"pid": 5, "starttime": -1}]}, "entries are a PID or"),
        ({"pids": [{"pid": 5, "starttime": True}]}, "entries are a PID or"),
        ({"pids": [{"pid": 0, "starttime": 7}]}, "positive integers"),
        ({"pids": [5, {"pid": 5, "starttime": 7}]}, "names PID 5 twice"),
        ({"tag": "a", "include_other_users": "yes"}, "true or false"),
        ({"tag": "a "}, r"scope 'tag' must be a tag: .* got 'a '"),
        ({"tag": "\ta"}, r"without whitespace or control characters, got '\\ta'"),
        ({"tag": "a b"}, "got 'a b'"),
        ({"tag": "a\x07"}, r"got 'a\\x07'"),
        ({"job": "j "}, r"scope 'job' must be a non-empty string without leading or trailing "
                        r"whitespace, got 'j '"),
        ({"sandbox": " s"}, "scope 'sandbox' must be .* got ' s'"),
    ],
)
def test_bad_scopes_are_refused_with_a_clear_error(scope: object, message: str) -> None:
    with pytest.raises(ScopeError, match=message):
        validate_scope(scope)


def test_validate_normalises() -> None:
    assert validate_scope({"pids": [5, 3, 5]}) == {
        "pids": [3, 5], "include_other_users": False, "include_ns_init": False}


@pytest.mark.parametrize("bad", [" ", "\n", "\t"])
def test_a_tag_with_whitespace_is_refused_and_touches_no_process(bad: str) -> None:
    # A tag is matched as given: "t " once reached the processes tagged exactly "t".
    tag = _tag()
    named = {tag: _start(tag), tag + bad: _start(tag + bad), bad + tag: _start(bad + tag)}
    try:
        time.sleep(0.05)
        for wrong in (tag + bad, bad + tag):
            # resolve_scope says it alone; an activity's rule (SCOPE) wraps it, naming itself
            message = f"scope 'tag' must be a tag: .*, got {re.escape(repr(wrong))}(\\)|$)"
            for attempt in (resolve_scope, partial(actions.signal_processes, signal="SIGSTOP"),
                            actions.freeze_processes, probes.processes_in_scope,
                            partial(actions.resume_processes, missing_ok=True)):
                with pytest.raises(ScopeError, match=message):
                    attempt({"tag": wrong})
            # `chaosgpu cleanup --tag` takes it here, as a job selector does
            with pytest.raises(JobError, match=f"tag must be a tag: .*, got "
                                               f"{re.escape(repr(wrong))}$"):
                hang.cleanup(tag=wrong, grace_s=0, deadline_s=1)
        time.sleep(0.1)
        assert {name: _state(proc.pid) for name, proc in named.items()} == {
            name: "S" for name in named}, "a process was stopped or killed"
    finally:
        for proc in named.values():
            proc.kill()
            proc.wait()


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
    # twice is fine: what this run froze is resumed already, nothing is sent
    again = actions.resume_processes({"tag": tag})
    assert again["sent"] == 0 and again["left_stopped"] == [], again


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


@pytest.mark.parametrize("method", [pytest.param("sigstop"), *FREEZERS])
def test_resume_leaves_what_someone_else_stopped_stopped(sleepers: tuple[str, list],
                                                        method: str) -> None:
    # A stopped before the freeze (by someone else): freeze leaves it, resume must not SIGCONT
    # it; B, frozen by this run, resumed; then stopped again by someone else: left stopped.
    tag, procs = sleepers
    a, b = procs[0], procs[1]
    os.kill(a.pid, signal.SIGSTOP)
    assert _wait_state(a.pid, ("T",)) == "T"
    try:
        report = actions.freeze_processes({"tag": tag}, method=method)
        resumed = actions.resume_processes({"tag": tag})
    finally:
        freezer.thaw({p.pid for p in procs})  # were the resume to fail: the fixture can kill
    assert _wait_state(b.pid, ("S", "R")) in ("S", "R")
    time.sleep(0.2)
    assert _state(a.pid) == "T", "resume_processes resumed a process stopped by someone else"
    assert [(e["pid"], e["reason"]) for e in report["already_stopped"]] == [
        (a.pid, "stopped (state T) before this freeze: left as found")], report
    frozen = report["sent"] if method == "sigstop" else len(report["frozen"])
    assert frozen == 2 and a.pid not in report.get("frozen", []), report
    assert [(e["pid"], e["reason"]) for e in resumed["left_stopped"]] == [
        (a.pid, "stopped (state T), but not frozen by this run (or resumed since): left as "
                "found")], resumed
    assert a.pid not in [r["pid"] for r in resumed["results"]], resumed
    assert all(a.pid not in g["pids"] for g in resumed["thawed_cgroups"]), resumed
    assert not [g for g in _our_groups() if tag in g], "a freezer group was left behind"
    os.kill(b.pid, signal.SIGSTOP)  # after the resume, someone else stops B
    assert _wait_state(b.pid, ("T",)) == "T"
    again = actions.resume_processes({"tag": tag})
    time.sleep(0.2)
    assert (_state(a.pid), _state(b.pid)) == ("T", "T")
    assert again["sent"] == 0 and {e["pid"] for e in again["left_stopped"]} == {a.pid, b.pid}


def _members(group: Path) -> list[int]:
    return sorted(int(pid) for pid in (group / "cgroup.procs").read_text().split())


def _group_frozen(group: Path) -> bool:
    if (group / "freezer.state").exists():
        return (group / "freezer.state").read_text().strip() == "FROZEN"
    return "frozen 1" in (group / "cgroup.events").read_text().splitlines()


@pytest.mark.parametrize("method", FREEZERS)
def test_resume_thaws_only_what_this_run_froze_in_a_shared_group(sleepers: tuple[str, list],
                                                                  method: str) -> None:
    # A frozen earlier (another run: not in this run's fault log) in the group the scope's
    # name gives; this run's freeze moves B and C into the same group; resume takes them out
    # and leaves A frozen there.
    tag, procs = sleepers
    a = procs[0]
    name = describe_scope(validate_scope({"tag": tag}))
    earlier = freezer.freeze(name, resolve_scope({"pids": [a.pid]}), 5.0, method[-2:])
    group = Path(earlier["cgroup"])
    try:
        assert _members(group) == [a.pid] and _group_frozen(group)
        report = actions.freeze_processes({"tag": tag}, method=method)
        assert report["cgroups"] == [str(group)]  # the same group as A's
        resumed = actions.resume_processes({"tag": tag})
        assert all(_wait_state(p.pid, ("S", "R")) in ("S", "R") for p in procs[1:])
        time.sleep(0.2)
        assert group.exists() and _members(group) == [a.pid] and _group_frozen(group), \
            "resume_processes thawed a process it never froze"
    finally:
        thawed = freezer.thaw({p.pid for p in procs})
    assert [(g["cgroup"], g["pids"]) for g in thawed] == [(str(group), [a.pid])]
    assert not group.exists()
    assert _wait_state(a.pid, ("S", "R")) in ("S", "R")
    assert [(e["pid"], e["reason"]) for e in report["already_stopped"]] == [
        (a.pid, "in a frozen cgroup before this freeze: left as found")], report
    assert sorted(report["frozen"]) == sorted(p.pid for p in procs[1:])
    assert [(g["cgroup"], g["pids"], g["left_frozen"]) for g in resumed["thawed_cgroups"]] == [
        (str(group), sorted(p.pid for p in procs[1:]), [a.pid])], resumed
    assert [e["pid"] for e in resumed["left_stopped"]] == [a.pid], resumed


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
    with pytest.raises(ValueError, match="^freeze_processes: method must be one of 'sigstop', "
                                         "'freezer', 'freezer-v1', 'freezer-v2', got 'ice'$"):
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


def test_a_pids_scope_with_start_times_never_reaches_a_reused_pid() -> None:
    """`{"pid", "starttime"}` entries (as a snapshot or a fault's result gives them) match a
    PID only while it holds the process started then: a PID taken from an earlier step whose
    process ended, now another process's, is missing ("PID reused"), and nothing is sent."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        started = read_process(target.pid)["starttime"]
        reused = {"pids": [{"pid": target.pid, "starttime": started + 1}]}
        detail = resolve_scope_detail(reused)
        assert detail["processes"] == []
        assert detail["missing"][0]["pid"] == target.pid
        assert detail["missing"][0]["reason"].startswith("PID reused")
        with pytest.raises(ScopeError):
            actions.signal_processes(reused, signal="SIGSTOP")
        assert _state(target.pid) == "S"
        same = {"pids": [{"pid": target.pid, "starttime": started}]}
        assert [p["pid"] for p in resolve_scope(same)] == [target.pid]
    finally:
        target.kill()
        target.wait()
