"""Targets frozen by a cgroup freezer, on real processes and the real v1 freezer: a signal that
ends a process stays pending while it sits in a frozen cgroup, so the one terminate primitive
lets its targets (and only them) out of chaosgpu's freezer groups first, and refuses a target in
a frozen cgroup chaosgpu did not make; a thawed group is removed once its last member has gone;
a SIGSTOP sent by signal_processes is this run's freeze, which resume_processes undoes."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from proc_helpers import alive, unique, v1_freezer_cgroup, wait_until

from chaosgpu import faultlog, state
from chaosgpu.errors import ActivityError
from chaosgpu.process import actions as process_actions
from chaosgpu.process import freezer
from chaosgpu.sandbox import runtime
from chaosgpu.scope import resolve_scope_detail
from chaosgpu.workloads import actions as workload_actions

V1 = Path("/sys/fs/cgroup/freezer")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (V1 / "cgroup.procs").exists(),
    reason="needs root and the cgroup v1 freezer")


def _groups_named(*needles: str) -> list[str]:
    """chaosgpu's (and this file's) freezer groups whose name holds one of `needles`."""
    return sorted(p.name for p in V1.iterdir()
                  if p.is_dir() and any(n in p.name for n in needles))


def _sleeper(tag: str) -> "subprocess.Popen[bytes]":
    return subprocess.Popen(["sleep", "300"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                            start_new_session=True)


def _finish(*procs: "subprocess.Popen[bytes]") -> None:
    """Thaw what is left of `procs` in any freezer group, kill and reap them."""
    pids = {p.pid for p in procs}
    freezer.thaw(pids)
    for proc in procs:
        if proc.poll() is None:
            try:
                (V1 / "cgroup.procs").write_text(str(proc.pid))
            except OSError:
                pass
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)


@contextmanager
def foreign_freeze(pids: list[int]) -> Iterator[Path]:
    """Freeze `pids` in a v1 freezer group chaosgpu did not make (as another tool would)."""
    group = V1 / unique("fzt-foreign")
    group.mkdir()
    try:
        for pid in pids:
            (group / "cgroup.procs").write_text(str(pid))
        (group / "freezer.state").write_text("FROZEN")
        assert wait_until(lambda: (group / "freezer.state").read_text().strip() == "FROZEN", 5)
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (V1 / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        assert wait_until(lambda: not (group / "cgroup.procs").read_text().split(), 5)
        group.rmdir()


@pytest.fixture(autouse=True)
def _fresh_faultlog() -> Iterator[None]:
    faultlog.clear()
    yield
    faultlog.clear()


# -- 6. a member killed while frozen: its group is removed once it has gone ---------------------

def test_cleanup_removes_the_freezer_group_of_a_rank_killed_while_frozen() -> None:
    # A torch rank takes a while to exit once thawed: the group must be removed after it has
    # gone, not left behind because the rmdir came first (EBUSY).
    pytest.importorskip("torch")
    from chaosgpu.job import actions as job_actions

    tag = unique("fzt-killed")
    started = workload_actions.start_ring(world_size=2, backend="gloo", tag=tag,
                                          process_group_timeout_s=30, timeout_s=120)
    try:
        frozen = job_actions.freeze_rank(tag=tag, rank=1, method="freezer")
        rank1 = frozen["pid"]
        os.kill(rank1, signal.SIGKILL)  # someone's kill: pending while the rank is frozen
        time.sleep(0.2)
        assert alive(rank1) and freezer.frozen_now(rank1)
        report = job_actions.cleanup_hung_job(tag=tag, grace_s=0.5, deadline_s=10)
        thawed = report["steps"][0]["thawed_cgroups"]
        assert not Path(frozen["cgroup"]).exists(), thawed
        assert [(g["cgroup"], g["pids"], g["removed"]) for g in thawed] == [
            (frozen["cgroup"], [rank1], True)], thawed
        assert not any(alive(pid) for pid in started["pids"])
    finally:
        freezer.thaw(set(started["pids"]))  # a test that failed mid-freeze
        workload_actions.stop_workload(tag, grace_s=0, missing_ok=True)
    assert _groups_named(tag) == []


# -- 7. signal_processes' SIGSTOP is this run's freeze: with every stop signal, in
# test_stop_and_fatal_signals.py (test_a_stop_through_signal_processes_is_resumed_...)

# -- the primitive: a fatal signal lets its targets, and only them, out of the freeze -----------

def test_a_fatal_signal_lets_only_its_targets_out_of_chaosgpus_freezer() -> None:
    tag, other = unique("fzt-target"), unique("fzt-bystander")
    target, bystander = _sleeper(tag), _sleeper(other)
    try:
        pids = [target.pid, bystander.pid]
        assert wait_until(lambda: len(resolve_scope_detail(
            {"pids": pids})["processes"]) == 2)
        frozen = process_actions.freeze_processes({"pids": pids}, method="freezer")
        assert sorted(frozen["frozen"]) == sorted(pids) and len(frozen["cgroups"]) == 1
        report = process_actions.signal_processes({"tag": tag}, signal="SIGKILL", wait_gone_s=5)
        assert report["wait"]["all_gone"] is True, report
        (result,) = report["results"]
        assert result["released_from"]["cgroup"] == frozen["cgroup"]
        assert result["released_from"]["left_frozen"] == [bystander.pid]
        assert target.wait(timeout=5) == -signal.SIGKILL
        # The bystander, outside the scope, is still frozen in its group.
        assert alive(bystander.pid) and freezer.frozen_now(bystander.pid)
        assert v1_freezer_cgroup(bystander.pid) == "/" + Path(frozen["cgroup"]).name
        resumed = process_actions.resume_processes({"pids": [bystander.pid]})
        assert [g["removed"] for g in resumed["thawed_cgroups"]] == [True], resumed
        assert not freezer.frozen_now(bystander.pid)
    finally:
        _finish(target, bystander)
    assert _groups_named(tag, str(target.pid)) == []


def test_a_fatal_signal_to_a_target_in_a_foreign_frozen_cgroup_is_refused_not_left_pending(
        ) -> None:
    tag = unique("fzt-foreign")
    proc = _sleeper(tag)
    try:
        assert wait_until(lambda: resolve_scope_detail({"tag": tag})["processes"])
        with foreign_freeze([proc.pid]) as group:
            with pytest.raises(Exception, match="frozen cgroup"):
                process_actions.signal_processes({"tag": tag}, signal="SIGKILL")
            assert v1_freezer_cgroup(proc.pid) == "/" + group.name  # left where it was
        time.sleep(0.2)  # thawed by its owner: no SIGKILL was left pending
        assert alive(proc.pid)
    finally:
        _finish(proc)


# -- 8. stop_workload on a freezer-frozen workload ------------------------------------------------

def test_stop_workload_stops_a_freezer_frozen_workload() -> None:
    tag = unique("fzt-wl")
    started = workload_actions.start_holders(count=2, mib=4, via="host", tag=tag)
    try:
        frozen = process_actions.freeze_processes({"tag": tag}, method="freezer")
        assert sorted(frozen["frozen"]) == sorted(started["pids"])
        result = workload_actions.stop_workload(tag, grace_s=0.5, deadline_s=3)
        assert result["stopped"] is True
        assert set(result["processes"].values()) <= {"killed", "exited on SIGTERM"}, result
        assert set(result["released_from_freezer"].values()) == {frozen["cgroup"]}
        assert not any(alive(pid) for pid in started["pids"])
        assert state.read_record("workloads", tag) is None
        assert not Path(frozen["cgroup"]).exists()
    finally:
        freezer.thaw(set(started["pids"]))
        workload_actions.stop_workload(tag, grace_s=0, missing_ok=True)
    assert _groups_named(tag) == []


def test_stop_workload_fails_and_keeps_the_record_when_a_worker_stays_frozen() -> None:
    tag = unique("fzt-wlf")
    started = workload_actions.start_holders(count=1, mib=4, via="host", tag=tag)
    (pid,) = started["pids"]
    try:
        with foreign_freeze([pid]):
            with pytest.raises(ActivityError, match="was not stopped.*frozen cgroup"):
                workload_actions.stop_workload(tag, grace_s=0, deadline_s=0.5)
            assert state.read_record("workloads", tag) is not None
        time.sleep(0.2)
        assert alive(pid)  # nothing was left pending for the thaw to deliver
        assert workload_actions.stop_workload(tag, grace_s=0)["stopped"] is True
        assert not alive(pid)
    finally:
        workload_actions.stop_workload(tag, grace_s=0, missing_ok=True)


# -- 9. kill_rank on a freezer-frozen rank ------------------------------------------------------

def test_kill_rank_kills_a_freezer_frozen_rank() -> None:
    pytest.importorskip("torch")
    from chaosgpu.job import actions as job_actions

    tag = unique("fzt-ring")
    started = workload_actions.start_ring(world_size=2, backend="gloo", tag=tag,
                                          process_group_timeout_s=30, timeout_s=120)
    try:
        frozen = job_actions.freeze_rank(tag=tag, rank=1, method="freezer")
        rank1 = frozen["pid"]
        assert frozen["freezer_state"] == "FROZEN"
        killed = job_actions.kill_rank(tag=tag, rank=1, wait_s=5)
        assert killed["result"] == "sent" and killed["wait"]["all_gone"] is True, killed
        assert killed["released_from"], killed  # the result says it was let out of the freeze
        assert not alive(rank1)
        assert not Path(frozen["cgroup"]).exists()
        assert [f["kind"] for f in faultlog.recent()] == ["freezer", "SIGKILL"]
    finally:
        freezer.thaw(set(started["pids"]))
        workload_actions.stop_workload(tag, grace_s=0, missing_ok=True)
    assert not any(alive(pid) for pid in started["pids"])
    assert _groups_named(tag) == []


# -- 20. a freezer-frozen pod is terminated and removed -----------------------------------------

def test_a_freezer_frozen_pod_is_terminated_and_removed() -> None:
    name = unique("fzt-pod")
    record = runtime.create(name, grace_s=1)
    workers = []
    try:
        for _ in range(2):
            workers.append(runtime.exec_in(name, ["sleep", "300"], detached=True)["host_pid"])
        pid1 = record["pid1"]
        frozen = process_actions.freeze_processes({"sandbox": name, "include_ns_init": True},
                                                  method="freezer")
        assert sorted(frozen["frozen"]) == sorted([pid1, *workers])
        done = runtime.terminate(name, deadline_s=5)
        assert done["already_gone"] is False
        released = done["released_from_freezer"]
        assert released["cgroup"] == frozen["cgroup"]
        assert released["with_members"] == sorted(workers)
        assert not any(alive(pid) for pid in [pid1, *workers])
        assert not alive(record["supervisor_pid"])
        assert runtime.remove(name)["removed"] is True
        assert not Path(frozen["cgroup"]).exists()
    finally:
        freezer.thaw({record["pid1"], *workers})  # a test that failed mid-freeze
        runtime.remove(name)
    assert runtime.get_record(name) is None
    assert _groups_named(name) == []


# -- the same through the real `chaos` CLI: the report's frozen workload and frozen-killed rank --

def _chaos() -> str:
    found = shutil.which("chaos") or str(Path(sys.executable).parent / "chaos")
    if not os.access(found, os.X_OK):
        pytest.skip("missing tool: chaos (pip install chaostoolkit)")
    return found


def test_chaos_run_stops_a_frozen_workload_and_resumes_its_sigstop(tmp_path: Path) -> None:
    tag = unique("fzt-run")

    def activity(kind: str, module: str, func: str, **arguments: object) -> dict:  # type: ignore[type-arg]
        return {"type": kind, "name": func, "provider": {
            "type": "python", "module": module, "func": func, "arguments": arguments}}  # fmt: skip

    scope = {"tag": tag}
    experiment = {
        "title": "a SIGSTOP resumed, then a freezer-frozen workload stopped",
        "description": "tests/test_frozen_targets.py",
        "runtime": {"rollbacks": {"strategy": "always"}},
        "method": [
            activity("action", "chaosgpu.workloads.actions", "start_holders", count=2, mib=4,
                     via="host", tag=tag),
            activity("action", "chaosgpu.process.actions", "signal_processes", scope=scope,
                     signal="SIGSTOP"),
            activity("action", "chaosgpu.process.actions", "resume_processes", scope=scope),
            activity("probe", "chaosgpu.process.probes", "processes_in_scope", scope=scope),
            activity("action", "chaosgpu.process.actions", "freeze_processes", scope=scope,
                     method="freezer"),
        ],
        "rollbacks": [
            activity("action", "chaosgpu.workloads.actions", "stop_workload", tag=tag,
                     grace_s=1, deadline_s=3),
        ],
    }
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal = tmp_path / "journal.json"
    try:
        done = subprocess.run(
            [_chaos(), "--no-version-check", "--log-file", str(tmp_path / "chaos.log"), "run",
             "--journal-path", str(journal), str(path)],
            cwd=tmp_path, env=dict(os.environ), capture_output=True, timeout=300,
            stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        result = json.loads(journal.read_text())
        runs = {r["activity"]["name"]: r for r in result["run"]}
        assert all(r["status"] == "succeeded" for r in result["run"]), runs
        pids = runs["start_holders"]["output"]["pids"]
        resumed = runs["resume_processes"]["output"]
        assert resumed["sent"] == 2 and resumed["left_stopped"] == [], resumed
        states = {p["pid"]: p["state"] for p in runs["processes_in_scope"]["output"]}
        assert sorted(states) == sorted(pids) and set(states.values()) <= {"S", "R"}, states
        (stop,) = result["rollbacks"]
        assert stop["status"] == "succeeded" and stop["output"]["stopped"] is True, stop
        assert not any(alive(pid) for pid in pids)
    finally:
        record = state.read_record("workloads", tag)
        if record is not None:  # a test that failed mid-freeze
            freezer.thaw({int(p["pid"]) for p in record["processes"]})
            workload_actions.stop_workload(tag, grace_s=0, missing_ok=True)
    assert _groups_named(tag) == []
