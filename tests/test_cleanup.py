"""`chaosgpu cleanup` after a runner that crashed mid-experiment: every recorded workload and
sandbox goes, frozen processes included; a second run finds nothing; bad usage is refused."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import require_tool
from proc_helpers import proc_state

from chaosgpu import state
from chaosgpu.scope import resolve_scope

CRASHING_RUNNER = """
import os, signal, sys
from chaosgpu.workloads.actions import start_holders
from chaosgpu.sandbox.actions import create_sandbox, exec_in_sandbox
from chaosgpu.process.actions import freeze_processes
tag, name, method = sys.argv[1], sys.argv[2], sys.argv[3]
start_holders(count=2, mib=8, via="host", tag=tag, timeout_s=60)
create_sandbox(name=name, init="sleep", grace_s=30)
start_holders(count=1, mib=8, via="host", tag=tag + "-pod", sandbox=name, timeout_s=60)
freeze_processes({"tag": tag}, method=method)
print("ready", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the runner crashes: no rollback runs
"""


def _alive(tag: str) -> list[int]:
    return [p["pid"] for p in resolve_scope({"tag": tag}, observe=True) if not p.get("zombie")]


def _cleanup(*args: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "cleanup", *args],
                         env=dict(os.environ), capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("method", ["sigstop", "freezer"])
def test_cleanup_after_a_crashed_runner_leaves_nothing(method: str) -> None:
    if method == "freezer" and (os.geteuid() != 0 or
                                not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs")):
        pytest.skip("needs root and the cgroup v1 freezer")
    tag, name = f"cl-{uuid.uuid4().hex[:8]}", f"cl-{uuid.uuid4().hex[:6]}"
    runner = subprocess.run([sys.executable, "-c", CRASHING_RUNNER, tag, name, method],
                            env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert runner.returncode == -signal.SIGKILL and "ready" in runner.stdout, runner.stderr
    assert len(_alive(tag)) == 2 and len(_alive(tag + "-pod")) == 1
    assert name in state.list_records("sandboxes")
    code, output = _cleanup("--json", "--grace-s", "0.5")
    report = json.loads(output[output.index("{"):])
    assert code == 0, output
    kinds = {(item["kind"], item["name"]) for item in report["removed"]}
    assert {("workload", tag), ("workload", tag + "-pod"), ("sandbox", name)} <= kinds
    deadline = time.monotonic() + 10
    while (_alive(tag) or _alive(tag + "-pod")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(tag) and not _alive(tag + "-pod")
    assert not state.list_records("workloads") and not state.list_records("sandboxes")
    if method == "freezer":
        assert report["thawed_cgroups"]
    code, output = _cleanup()
    assert code == 0 and "nothing to clean up" in output


LIVE_RUNNER = """
import sys, time
from chaosgpu.workloads.actions import start_holders
from chaosgpu.process.actions import freeze_processes
tag, method = sys.argv[1], sys.argv[2]
start_holders(count=1, mib=4, via="host", tag=tag, timeout_s=60)
freeze_processes({"tag": tag}, method=method)
print("ready", flush=True)
time.sleep(120)  # a game-day in progress: its runner lives
"""


def _state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()[0].decode()


@pytest.mark.parametrize("method", ["sigstop", "freezer"])
def test_cleanup_keeps_a_run_in_progress_until_its_runner_is_gone(method: str) -> None:
    """Another team's game-day shares the state dir: its runner lives, its workload is frozen.
    `chaosgpu cleanup --tag <another tag>` keeps that workload and leaves it frozen (before
    round 22 it stopped the workload and thawed every chaosgpu freezer group on the host);
    once the runner is gone, the workload is left behind and the next cleanup removes it."""
    if method == "freezer" and (os.geteuid() != 0 or
                                not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs")):
        pytest.skip("needs root and the cgroup v1 freezer")
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    runner = subprocess.Popen([sys.executable, "-c", LIVE_RUNNER, tag, method],
                              env=dict(os.environ), stdout=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    try:
        assert runner.stdout is not None and runner.stdout.readline().strip() == "ready"
        (pid,) = _alive(tag)
        frozen = _state_of(pid)
        assert frozen in ("T", "D"), frozen
        code, output = _cleanup("--json", "--tag", f"cl-other-{uuid.uuid4().hex[:6]}")
        report = json.loads(output[output.index("{"):])
        assert code == 0, output
        assert [(k["kind"], k["name"], k["runner"]["pid"]) for k in report["kept"]
                if k["name"] == tag] == [("workload", tag, runner.pid)], report["kept"]
        assert not any(item.get("name") == tag for item in report["removed"]), report
        assert all(pid not in group["pids"] for group in report["thawed_cgroups"]), report
        time.sleep(0.3)
        assert _alive(tag) == [pid] and _state_of(pid) == frozen  # still frozen, untouched
        assert tag in state.list_records("workloads")
    finally:
        runner.kill()
        runner.wait(timeout=10)
    code, output = _cleanup("--json", "--grace-s", "0.5")
    report = json.loads(output[output.index("{"):])
    assert code == 0, output
    assert ("workload", tag) in {(item["kind"], item["name"]) for item in report["removed"]}
    deadline = time.monotonic() + 10
    while _alive(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(tag) and tag not in state.list_records("workloads")
    if method == "freezer":
        assert any(pid in group["pids"] for group in report["thawed_cgroups"]), report


def test_cleanup_by_tag_removes_unrecorded_processes() -> None:
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    procs = [subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                              start_new_session=True, stdin=subprocess.DEVNULL)
             for _ in range(2)]
    try:
        time.sleep(0.1)
        code, output = _cleanup("--tag", tag, "--grace-s", "0.2")
        assert code == 0, output
        for proc in procs:
            assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_cleanup_by_tag_of_another_users_process_removes_nothing_and_says_so() -> None:
    # It sent nothing, waited out the grace and the deadline, listed the PID twice as not
    # removed, and (through hang.cleanup's success) showed no error for the tag.
    if os.geteuid() != 0:
        pytest.skip("needs root to start a process of another user")
    require_tool("setpriv", install="apt-get install util-linux")
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    other = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                              "sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                             stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.1)
        started = time.monotonic()
        code, output = _cleanup("--tag", tag, "--grace-s", "5", "--deadline-s", "10")
        assert time.monotonic() - started < 5.0, output  # neither grace nor deadline waited
        assert code == 1, output
        lines = [line for line in output.splitlines() if line.startswith("NOT removed")]
        assert len(lines) == 1 and f"removed none of the 1 process(es) it found: PID " \
            f"{other.pid}: refused: another user's process" in lines[0], output
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_cleanup_bad_usage() -> None:
    assert _cleanup("--grace-s", "-1")[0] == 2
    assert _cleanup("--bogus")[0] == 2
    code, output = _cleanup("--help")
    assert code == 0 and "chaosgpu cleanup" in output


@pytest.mark.parametrize("suffix", [" ", "\n"])
def test_a_tag_that_could_never_match_exactly_is_bad_usage(suffix: str) -> None:
    # It was taken as any non-empty text: `--tag 'x '` matched nothing (the processes tagged
    # "x" stayed) and the cleanup said it succeeded.
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        code, output = _cleanup("--tag", tag + suffix, "--grace-s", "0")
        assert code == 2, output
        assert (f"argument --tag: must be a tag: a non-empty string without whitespace or "
                f"control characters, got {tag + suffix!r}") in output
        assert proc.poll() is None  # nothing was touched
    finally:
        proc.kill()
        proc.wait()


def test_a_record_removed_between_listing_and_removal_is_no_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # stop_workload and remove_sandbox refuse a name this run never met (a typo); cleanup
    # takes its names from the records, so one another cleanup or rollback removed meanwhile
    # has ended: it must not show as "NOT removed".
    from chaosgpu.cleanup import cleanup_all

    ghost_workload, ghost_sandbox = f"cl-{uuid.uuid4().hex[:8]}", f"cl-{uuid.uuid4().hex[:6]}"
    listed = {"workloads": ghost_workload, "sandboxes": ghost_sandbox}
    real = state.list_records
    monkeypatch.setattr(state, "list_records", lambda kind: (
        {listed[kind]: {}, **real(kind)} if kind in listed else real(kind)))
    report = cleanup_all(grace_s=0, deadline_s=5)
    assert report["not_removed"] == [], report
    details = {(item["kind"], item["name"]): item["detail"] for item in report["removed"]}
    assert details[("workload", ghost_workload)]["stopped"] is False
    assert details[("sandbox", ghost_sandbox)]["removed"] is False


PARTITIONING_RUNNER = """
import os, signal, socket, subprocess, sys, time
tag = sys.argv[1]
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(1)
port = server.getsockname()[1]
peer = ("import socket, sys, time; s = socket.create_connection(('127.0.0.1', %d)); "
        "time.sleep(120)" % port)
env = dict(os.environ, CHAOSGPU_TAG=tag)
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
child = subprocess.Popen([sys.executable, "-c", peer], env=env, start_new_session=True, **quiet)
conn, _ = server.accept()
# the listening side lives on in a tagged process holding the accepted connection
holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env,
                          pass_fds=(conn.fileno(),), start_new_session=True, **quiet)
from chaosgpu.network.actions import partition_processes
out = partition_processes({"tag": tag})
print("ready", out["partition"], out["table"], child.pid, holder.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the runner crashes: no rollback heals the partition
"""


def _nft_tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                          timeout=30).stdout


def test_cleanup_heals_partitions_and_sweeps_injector_files_of_a_crashed_runner() -> None:
    import shutil

    from chaosgpu.gpu import injector
    from chaosgpu.node import process_starttime

    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("needs root and nft (nftables)")
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    runner = subprocess.run([sys.executable, "-c", PARTITIONING_RUNNER, tag],
                            env=dict(os.environ), capture_output=True, text=True, timeout=120)
    assert runner.returncode == -signal.SIGKILL and "ready" in runner.stdout, runner.stderr
    _, ident, table, *pids = runner.stdout.split()
    try:
        assert table in _nft_tables()
        # a trigger file of a process that is gone (same PID namespace, wrong start time)
        own = "".join(ch for ch in os.readlink("/proc/self/ns/pid") if ch.isdigit())
        gone_start = process_starttime(os.getpid()) + 1
        stale = injector.inject_dir() / f"{own}-{os.getpid()}-{gone_start}.json"
        stale.write_text("{}")
        code, output = _cleanup("--json")
        report = json.loads(output[output.index("{"):])
        assert code == 0, output
        assert ("partition", ident) in {(i["kind"], i["name"]) for i in report["removed"]}
        assert table not in _nft_tables()
        assert ident not in state.list_records("partitions")
        assert report["injector_files_removed"] >= 1 and not stale.exists()
        code, output = _cleanup()
        assert code == 0 and "nothing to clean up" in output
    finally:
        for pid in pids:
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["nft", "delete", "table", "inet", table], capture_output=True)
    deadline = time.monotonic() + 10
    while _alive(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(tag)


def test_a_namespace_init_that_ends_by_itself_is_not_reported_left() -> None:
    """The namespace's PID 1 is refused (nothing is sent to it), but once the cleanup's
    SIGTERM ends its only child it exits by itself: gone, so not "not removed" and exit 0; the
    report says it ended by itself (before: "NOT removed ... refused" and exit 1 for a node
    left clean)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a PID namespace")
    require_tool("unshare", install="apt-get install util-linux")
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    # unshare forks the namespace's init (sh), which waits for its sleep, then exits
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                              "sleep 60; exit 0"], env=dict(os.environ, CHAOSGPU_TAG=tag),
                             start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while len(_alive(tag)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_alive(tag)) == 3, resolve_scope({"tag": tag}, observe=True)
        code, output = _cleanup("--json", "--tag", tag, "--grace-s", "2")
        report = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]
        assert code == 0, output
        assert report["not_removed"] == [], output
        [entry] = [item for item in report["removed"] if item["kind"] == "tag"]
        assert len(entry["pids"]) == 2, entry
        [ended] = entry["ended_by_themselves"]
        assert "namespace" in ended["note"] and ended["pid"] not in entry["pids"], entry
        assert outer.wait(timeout=10) is not None
        assert _alive(tag) == []
    finally:
        for pid in _alive(tag):
            os.kill(pid, signal.SIGKILL)
        outer.kill()
        outer.wait()


def test_cleanup_removes_the_pod_deletion_records_of_ended_runs() -> None:
    """A pod deletion's timings (evidence a later probe of the same run reads) outlive their
    run until a later run saves one; `chaosgpu cleanup` removes and lists those of runners
    that are gone, and leaves those of a run in progress alone without listing them (they
    hold nothing: before, the pytest session's own records read "kept ... run in progress",
    and a cleanup expected to find nothing did not say "nothing to clean up")."""
    from chaosgpu.cleanup import K8S_DELETION_RECORDS
    from chaosgpu.k8s import deletion
    from chaosgpu.node import process_starttime

    assert K8S_DELETION_RECORDS == deletion.RECORD_KIND
    gone = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    live = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    gone_runner = {"pid": gone.pid, "starttime": process_starttime(gone.pid)}
    live_runner = {"pid": live.pid, "starttime": process_starttime(live.pid)}
    gone.kill()
    gone.wait()
    suffix = uuid.uuid4().hex[:6]
    ended, running = f"default__ended-{suffix}", f"default__running-{suffix}"
    try:
        state.write_record(K8S_DELETION_RECORDS, ended, {"runner": gone_runner})
        state.write_record(K8S_DELETION_RECORDS, running, {"runner": live_runner})
        code, output = _cleanup("--json")
        report = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]
        assert code == 0, output
        assert {"kind": "k8s-deletion-record", "name": ended,
                "detail": {"removed": True}} in report["removed"], output
        assert all(item.get("name") != running for item in
                   report["removed"] + report["kept"]), output  # a run's own: not a word
        records = state.list_records(K8S_DELETION_RECORDS)
        assert ended not in records and running in records
    finally:
        state.remove_record(K8S_DELETION_RECORDS, ended)
        state.remove_record(K8S_DELETION_RECORDS, running)
        live.kill()
        live.wait()


CRASH_AFTER_FREEZES = """
import os, sys
from chaosgpu.process.actions import freeze_processes
for tag, method in zip(sys.argv[1::2], sys.argv[2::2]):
    freeze_processes({"tag": tag}, method=method)
print("ready", flush=True)
os._exit(0)  # no rollback: the fault log in memory goes with the runner
"""


def test_cleanup_resumes_what_a_crashed_runner_froze() -> None:
    """A runner that froze processes (SIGSTOP, and chaosgpu's freezer group where it can be
    used) and ended without its rollback: `chaosgpu cleanup` resumes them from the runner's
    freeze file and removes it (before: "nothing to clean up", exit 0, both left frozen; found
    by an outside trial). A freeze this process makes and resumes leaves no file."""
    from chaosgpu import freezelog
    from chaosgpu.process.actions import freeze_processes, resume_processes

    methods = ["sigstop"]
    if os.geteuid() == 0 and os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs"):
        methods.append("freezer")
    tags = {method: f"cl-{uuid.uuid4().hex[:8]}" for method in methods}
    procs = {method: subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL,
                                      env=dict(os.environ, CHAOSGPU_TAG=tag))
             for method, tag in tags.items()}
    try:
        time.sleep(0.1)
        before = set(freezelog.runs())
        args = [word for method, tag in tags.items() for word in (tag, method)]
        runner = subprocess.run([sys.executable, "-c", CRASH_AFTER_FREEZES, *args],
                                env=dict(os.environ), capture_output=True, text=True,
                                timeout=120)
        assert runner.returncode == 0 and "ready" in runner.stdout, runner.stderr
        left = set(freezelog.runs()) - before
        assert len(left) == 1, left
        assert proc_state(procs["sigstop"].pid) == "T"
        code, output = _cleanup("--json")
        report = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]
        assert code == 0, output
        [entry] = [item for item in report["removed"] if item["kind"] == "freeze"]
        assert entry["detail"]["resumed"] == [procs["sigstop"].pid], entry
        assert set(freezelog.runs()) & left == set()
        for proc in procs.values():  # running again: SIGTERM ends it at once
            proc.terminate()
            assert proc.wait(timeout=10) == -signal.SIGTERM
        if "freezer" in procs:
            assert entry["detail"]["in_freezer"] == [procs["freezer"].pid], entry
        # a freeze resumed by the same runner leaves nothing on disk
        again = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL,
                                 env=dict(os.environ, CHAOSGPU_TAG=tags["sigstop"]))
        procs["again"] = again
        time.sleep(0.1)
        freeze_processes({"tag": tags["sigstop"]})
        assert set(freezelog.runs()) - before, "the freeze was not kept on disk"
        resume_processes({"tag": tags["sigstop"]})
        assert set(freezelog.runs()) - before == set()
    finally:
        for proc in procs.values():
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()



def test_an_unsafe_state_dir_is_one_line_and_exit_1(tmp_path) -> None:
    """A state directory others can write is refused (its records decide what is killed):
    one line naming it and what is wrong, exit 1, no traceback."""
    unsafe = tmp_path / "state"
    unsafe.mkdir(mode=0o755)
    unsafe.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "cleanup"], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ,
                                                         CHAOSGPU_STATE_DIR=str(unsafe)))
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert str(unsafe) in out.stderr and "0755" in out.stderr, out.stderr


VFORK_HOLD = r"""
#include <unistd.h>
int main(void) {
    pid_t child = vfork();  /* the parent waits, uninterruptible, until the child exits */
    if (child == 0) { sleep(60); _exit(0); }
    return 0;
}
"""

FREEZE_AND_WAIT = """
import sys
from chaosgpu.process.actions import freeze_processes
print("freezing", flush=True)
freeze_processes({"tag": sys.argv[1]}, deadline_s=120)
"""


def test_cleanup_resumes_a_freeze_whose_runner_died_waiting_for_it_to_hold(tmp_path) -> None:
    """The runner is killed while freeze_processes waits for a target that cannot stop yet (a
    parent held in vfork, state D): the freeze was noted on disk before the wait, so `chaosgpu
    cleanup` resumes the process that did stop (before: the file was written only after the
    wait, and the cleanup said "nothing to clean up" with it stopped; outside trial)."""
    require_tool("gcc", install="apt-get install gcc")
    source = tmp_path / "vf.c"
    source.write_text(VFORK_HOLD)
    subprocess.run(["gcc", "-O0", "-o", str(tmp_path / "vf"), str(source)], check=True,
                   timeout=120)
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, CHAOSGPU_TAG=tag)
    plain = subprocess.Popen(["sleep", "60"], env=env, stdin=subprocess.DEVNULL)
    held = subprocess.Popen([str(tmp_path / "vf")], env=env, stdin=subprocess.DEVNULL)
    runner = None
    try:
        time.sleep(0.2)
        assert proc_state(held.pid) == "D"
        runner = subprocess.Popen([sys.executable, "-c", FREEZE_AND_WAIT, tag],
                                  env=dict(os.environ), stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while proc_state(plain.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_state(plain.pid) == "T"
        runner.kill()  # it waits for the vfork parent, up to 120 s
        runner.wait(timeout=10)
        code, output = _cleanup("--json")
        report = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]
        [entry] = [item for item in report["removed"] if item["kind"] == "freeze"]
        assert plain.pid in entry["detail"]["resumed"], output
        assert proc_state(plain.pid) != "T"
    finally:
        for proc in (runner, plain, held):
            if proc is not None:
                with __import__("contextlib").suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=30)
        for pid in _alive(tag):  # the vfork child
            os.kill(pid, signal.SIGKILL)


def test_a_bad_or_foreign_freeze_file_is_reported_and_the_others_still_resumed() -> None:
    """One freeze file that cannot be read (bytes that are no text) or is not this user's own
    regular file (a symlink to a file anyone could write) stops nothing else: it is listed as
    not removed, never trusted, and a good file beside it is still resumed (before: a
    traceback ended the whole cleanup, and a symlinked file was trusted; outside trial)."""
    from chaosgpu import freezelog

    folder = state.state_dir() / freezelog.DIRECTORY
    folder.mkdir(mode=0o700, exist_ok=True)
    stopped = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    victim = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    gone = subprocess.Popen(["true"])
    gone.wait()
    files = []
    try:
        from chaosgpu.node import process_starttime

        os.kill(stopped.pid, signal.SIGSTOP)
        os.kill(victim.pid, signal.SIGSTOP)
        good = folder / f"{gone.pid}-1.jsonl"
        good.write_text(json.dumps({"frozen": [stopped.pid, process_starttime(stopped.pid)],
                                    "kind": "SIGSTOP"}) + "\n")
        bad = folder / f"{gone.pid}-2.jsonl"
        bad.write_bytes(b"\xff\xfe\x00 not text\n")
        outside = state.state_dir().parent / f"open-{uuid.uuid4().hex[:6]}.jsonl"
        outside.write_text(json.dumps({"frozen": [victim.pid, process_starttime(victim.pid)],
                                       "kind": "SIGSTOP"}) + "\n")
        outside.chmod(0o666)
        link = folder / f"{gone.pid}-3.jsonl"
        link.symlink_to(outside)
        files = [good, bad, link, outside]
        os.chmod(good, 0o600)
        os.chmod(bad, 0o600)
        code, output = _cleanup("--json")
        assert "Traceback" not in output, output
        report = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]
        assert code == 1, output
        refused = {item["name"] for item in report["not_removed"] if item["kind"] == "freeze"}
        assert refused == {link.stem}, output  # undecodable bytes are skipped lines
        [entry] = [item for item in report["removed"] if item["name"] == good.stem]
        assert entry["detail"]["resumed"] == [stopped.pid], entry
        assert proc_state(stopped.pid) != "T" and proc_state(victim.pid) == "T"
    finally:
        for path in files:
            path.unlink(missing_ok=True)
        for proc in (stopped, victim):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


FREEZE_AND_STAY = """
import sys, time
from chaosgpu.process.actions import freeze_processes
freeze_processes({"tag": sys.argv[1]}, method="freezer")
print("frozen", flush=True)
time.sleep(120)
"""


def test_a_chaosgpu_freezer_group_this_cleanup_leaves_is_listed_left_frozen(tmp_path) -> None:
    """A run in progress with another state dir holds a process in a chaosgpu freezer group:
    a cleanup here thaws none of it, and says so under left_frozen (before: a group none of
    whose members it chose was not listed at all; outside trial). The run's own cleanup,
    once it is gone, thaws it."""
    if os.geteuid() != 0 or not os.path.exists("/sys/fs/cgroup/freezer/cgroup.procs"):
        pytest.skip("needs root and the cgroup v1 freezer")
    tag = f"cl-{uuid.uuid4().hex[:8]}"
    other_state = tmp_path / "other-state"
    other_state.mkdir(mode=0o700)
    frozen = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL,
                              env=dict(os.environ, CHAOSGPU_TAG=tag))
    runner = subprocess.Popen([sys.executable, "-c", FREEZE_AND_STAY, tag],
                              env=dict(os.environ, CHAOSGPU_STATE_DIR=str(other_state)),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None and runner.stdout.readline().strip() == "frozen"
        code, output = _cleanup("--json")
        report = json.JSONDecoder().raw_decode(output[output.index("{"):])[0]
        assert code == 0, output
        assert any(frozen.pid in group["pids"] for group in report["left_frozen"]), output
        assert not any(frozen.pid in group["pids"] for group in report["thawed_cgroups"])
        runner.kill()
        runner.wait(timeout=10)
        out = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "cleanup", "--json"],
                             env=dict(os.environ, CHAOSGPU_STATE_DIR=str(other_state)),
                             capture_output=True, text=True, timeout=120)
        theirs = json.JSONDecoder().raw_decode(out.stdout[out.stdout.index("{"):])[0]
        assert out.returncode == 0 and any(frozen.pid in group["pids"]
                                           for group in theirs["thawed_cgroups"]), out
        frozen.terminate()
        assert frozen.wait(timeout=10) == -signal.SIGTERM  # thawed: it ran its SIGTERM
    finally:
        runner.kill()
        runner.wait()
        if frozen.poll() is None:
            subprocess.run([sys.executable, "-m", "chaosgpu.cli", "cleanup", "--tag", tag],
                           env=dict(os.environ, CHAOSGPU_STATE_DIR=str(other_state)),
                           capture_output=True, timeout=120)
            frozen.kill()
            frozen.wait()
