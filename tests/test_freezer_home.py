"""A cgroup v1 freeze and thaw put each process back into the freezer cgroup it was in, not the
root of the hierarchy: on real processes in a real child freezer cgroup (a container's, which
`docker pause` freezes through that cgroup). Thawed by resume_processes, by the thaw that
cleanups use (chaosgpu.process.actions._thaw_freezer_groups, freezer.thaw) and by release, the
process is back in its cgroup and that cgroup freezes it again; a cgroup gone by the thaw is
said so and the process goes to the root; a process in a frozen freezer cgroup chaosgpu did not
make is not moved."""

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from proc_helpers import alive, finish, unique, v1_freezer_cgroup, wait_until

from chaosgpu import state
from chaosgpu.process import actions as process_actions
from chaosgpu.process import freezer

V1 = Path("/sys/fs/cgroup/freezer")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not (V1 / "cgroup.procs").exists(),
    reason="needs root and the cgroup v1 freezer at /sys/fs/cgroup/freezer")


def _starttime(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _state(group: Path) -> str:
    return (group / "freezer.state").read_text().strip()


def _records_of(pid: int) -> list[str]:
    return [name for name, rec in state.list_records(freezer.HOMES_KIND).items()
            if rec.get("pid") == pid]


@pytest.fixture
def home() -> Iterator[Path]:
    """A nested child freezer cgroup made for the test (not named like chaosgpu's groups),
    removed afterwards: the test's processes must be gone by then."""
    outer = V1 / unique("trial-home")
    inner = outer / "inner"
    outer.mkdir()
    inner.mkdir()
    try:
        yield inner
    finally:
        for group in (inner, outer):
            if group.is_dir():
                if _state(group) != "THAWED":
                    (group / "freezer.state").write_text("THAWED")
                for pid in (group / "cgroup.procs").read_text().split():
                    try:  # a leftover (the test failed): out, so the group can go
                        (V1 / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass
                assert wait_until(lambda g=group: not (g / "cgroup.procs").read_text().split(), 5)
                group.rmdir()
        assert not outer.exists()


def _sleeper(tag: str, group: Path) -> "subprocess.Popen[bytes]":
    proc = subprocess.Popen(["sleep", "1000"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                            start_new_session=True)
    (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


def _done(tag: str, *procs: "subprocess.Popen[bytes]") -> None:
    """Resume what this run froze of `tag` (its freezes are then resumed in the fault log too),
    let `procs` out of any chaosgpu group left (a failed test), kill, reap, prove them gone."""
    process_actions.resume_processes({"tag": tag}, missing_ok=True)
    freezer.thaw({p.pid for p in procs})
    finish(*procs)
    assert not any(alive(p.pid) for p in procs)


def _freezable_there(group: Path, pid: int) -> None:
    """`pid` sits in `group`, and freezing `group` freezes it (then it is thawed again)."""
    assert str(pid) in (group / "cgroup.procs").read_text().split()
    (group / "freezer.state").write_text("FROZEN")
    try:
        assert wait_until(lambda: _state(group) == "FROZEN", 5), _state(group)
        assert freezer.frozen_now(pid)
    finally:
        (group / "freezer.state").write_text("THAWED")
    assert wait_until(lambda: not freezer.frozen_now(pid), 5)


def _expected(group: Path) -> str:
    return "/" + str(group.relative_to(V1))


def test_resume_processes_puts_it_back_in_its_freezer_cgroup(home: Path) -> None:
    tag = unique("fzh-resume")
    proc = _sleeper(tag, home)
    try:
        assert v1_freezer_cgroup(proc.pid) == _expected(home)
        frozen = process_actions.freeze_processes({"tag": tag}, method="freezer-v1")
        assert frozen["frozen"] == [proc.pid] and frozen["freezer_state"] == "FROZEN"
        assert v1_freezer_cgroup(proc.pid).startswith("/chaosgpu-")
        resumed = process_actions.resume_processes({"tag": tag})
        assert v1_freezer_cgroup(proc.pid) == _expected(home)
        assert not freezer.frozen_now(proc.pid)
        [group] = resumed["thawed_cgroups"]
        assert group["homes"] == [{"pid": proc.pid, "cgroup": str(home)}]
        assert group["home_lost"] == [] and group["removed"] is True
        assert not _records_of(proc.pid)
        _freezable_there(home, proc.pid)
    finally:
        _done(tag, proc)


def test_cleanup_thaw_puts_it_back_in_its_freezer_cgroup(home: Path) -> None:
    tag = unique("fzh-cleanup")
    first, second = _sleeper(tag, home), _sleeper(tag, home.parent)
    try:
        frozen = process_actions.freeze_processes({"tag": tag}, method="freezer-v1")
        assert sorted(frozen["frozen"]) == sorted([first.pid, second.pid])
        # the thaw chaosgpu cleanup, cleanup_hung_job and resume_rank use
        thawed = process_actions._thaw_freezer_groups({first.pid})
        assert v1_freezer_cgroup(first.pid) == _expected(home)
        assert [g["left_frozen"] for g in thawed] == [[second.pid]]
        assert freezer.frozen_now(second.pid)  # not named: stays frozen
        thawed = freezer.thaw({second.pid})
        assert v1_freezer_cgroup(second.pid) == _expected(home.parent)
        assert thawed[0]["homes"] == [{"pid": second.pid, "cgroup": str(home.parent)}]
        assert thawed[0]["removed"] is True
        _freezable_there(home, first.pid)
        _freezable_there(home.parent, second.pid)  # a parent's freeze reaches its children
        assert freezer.frozen_now(first.pid) is False
    finally:
        _done(tag, first, second)


def test_release_puts_it_back_in_its_freezer_cgroup(home: Path) -> None:
    tag = unique("fzh-release")
    proc = _sleeper(tag, home)
    try:
        process_actions.freeze_processes({"tag": tag}, method="freezer-v1")
        answers = freezer.release([{"pid": proc.pid, "starttime": _starttime(proc.pid)}])
        assert answers[proc.pid]["released"] is True
        assert v1_freezer_cgroup(proc.pid) == _expected(home)
        _freezable_there(home, proc.pid)
    finally:
        _done(tag, proc)


def test_a_cgroup_gone_by_the_thaw_is_said_and_the_root_taken(home: Path) -> None:
    tag = unique("fzh-gone")
    gone = home / "gone"
    gone.mkdir()
    proc = _sleeper(tag, gone)
    try:
        process_actions.freeze_processes({"tag": tag}, method="freezer-v1")
        gone.rmdir()  # empty now: its only member is in chaosgpu's group
        resumed = process_actions.resume_processes({"tag": tag})
        assert v1_freezer_cgroup(proc.pid) == "/"
        assert not freezer.frozen_now(proc.pid)
        [group] = resumed["thawed_cgroups"]
        [lost] = group["home_lost"]
        assert lost["pid"] == proc.pid and lost["cgroup"] == str(V1)
        assert str(gone) in lost["note"] and "no longer exists" in lost["note"]
        assert not _records_of(proc.pid)
    finally:
        _done(tag, proc)


def test_a_process_in_a_foreign_frozen_cgroup_is_left_alone(home: Path) -> None:
    tag = unique("fzh-foreign")
    proc = _sleeper(tag, home)
    try:
        (home / "freezer.state").write_text("FROZEN")
        assert wait_until(lambda: _state(home) == "FROZEN", 5)
        result = process_actions.freeze_processes({"tag": tag}, method="freezer-v1")
        assert result["frozen"] == [] and [a["pid"] for a in result["already_stopped"]] == [
            proc.pid]
        # freezer.freeze itself (freeze_rank calls it without that check) refuses it as well
        direct = freezer.freeze(unique("fzh-direct"), [{"pid": proc.pid,
                                                        "starttime": _starttime(proc.pid)}], 1.0,
                                "v1")
        assert direct["frozen"] == []
        assert [f["pid"] for f in direct["failed"]] == [proc.pid]
        assert "did not make" in direct["failed"][0]["reason"]
        Path(direct["cgroup"]).rmdir()  # the empty group that freeze made
        assert v1_freezer_cgroup(proc.pid) == _expected(home) and _state(home) == "FROZEN"
        assert not _records_of(proc.pid)
        resumed = process_actions.resume_processes({"tag": tag})
        assert [s["pid"] for s in resumed["left_stopped"]] == [proc.pid]
        assert v1_freezer_cgroup(proc.pid) == _expected(home) and _state(home) == "FROZEN"
    finally:
        (home / "freezer.state").write_text("THAWED")
        os.kill(proc.pid, signal.SIGCONT)
        _done(tag, proc)
