"""The in-target signal program: pidfd sends, identity checks and every refusal rule, on real
processes."""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time

import pytest

from chaosgpu.intarget import load, program_path

sp = load("actions", "signal_processes")


def _start(argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, env=dict(os.environ), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]


def _target(pid: int) -> dict[str, int]:
    stat = sp._read_stat(pid)
    assert stat is not None
    return {"pid": pid, "starttime": stat[3]}


def _state(pid: int) -> str:
    stat = sp._read_stat(pid)
    return "gone" if stat is None else stat[0]


def _wait_state(pid: int, states: tuple[str, ...], timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(pid)
        if state in states:
            return state
        time.sleep(0.01)
    return _state(pid)


def test_sigkill_is_sent_and_the_process_dies() -> None:
    proc = _start(["sleep", "60"])
    report = sp.signal_targets([_target(proc.pid)], "SIGKILL")
    assert report["sent"] == 1 and report["results"][0]["result"] == "sent"
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_stop_then_cont() -> None:
    proc = _start(["sleep", "60"])
    try:
        assert sp.signal_targets([_target(proc.pid)], "STOP")["sent"] == 1
        assert _wait_state(proc.pid, ("T",)) == "T"
        assert sp.signal_targets([_target(proc.pid)], "sigcont")["sent"] == 1
        assert _wait_state(proc.pid, ("S", "R")) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()


def test_reused_pid_is_refused_by_starttime() -> None:
    proc = _start(["sleep", "60"])
    try:
        target = _target(proc.pid)
        target["starttime"] -= 1
        report = sp.signal_targets([target], "SIGKILL")
        assert report["results"][0]["reason_code"] == "reused"
        assert _state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()


def test_reaped_process_is_gone() -> None:
    proc = _start(["sleep", "60"])
    target = _target(proc.pid)
    proc.kill()
    proc.wait()
    result = sp.signal_targets([target], "SIGKILL")["results"][0]
    # Either no such process, or (rarely) the PID was reused: never "sent".
    assert result["result"] in ("gone", "refused")


def test_zombie_counts_as_gone() -> None:
    proc = _start(["sleep", "60"])
    target = _target(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    assert _wait_state(proc.pid, ("Z",)) == "Z"
    result = sp.signal_targets([target], "SIGKILL")["results"][0]
    assert result["result"] == "gone" and result["reason_code"] == "zombie"
    proc.wait()


def test_pid1_runner_and_ancestors_are_refused() -> None:
    targets = [_target(1), _target(os.getpid()), _target(os.getppid())]
    report = sp.signal_targets(targets, "SIGCONT")
    codes = [r["reason_code"] for r in report["results"]]
    assert codes == ["pid1", "runner", "runner"]
    assert report["sent"] == 0


def test_runner_pid_argument_protects_its_ancestors() -> None:
    proc = _start(["sleep", "60"])
    try:
        report = sp.signal_targets([_target(proc.pid)], "SIGKILL", runner_pid=proc.pid)
        assert report["results"][0]["reason_code"] == "runner"
    finally:
        proc.kill()
        proc.wait()


def test_kernel_thread_is_refused() -> None:
    # kthreadd is PID 2 in the initial PID namespace.
    stat = sp._read_stat(2)
    if stat is None or not stat[2] & sp.PF_KTHREAD:
        pytest.skip("PID 2 is not kthreadd here (not in the initial PID namespace)")
    report = sp.signal_targets([_target(2)], "SIGCONT")
    assert report["results"][0]["reason_code"] == "kernel_thread"


def test_missing_starttime_is_refused() -> None:
    proc = _start(["sleep", "60"])
    try:
        report = sp.signal_targets([{"pid": proc.pid}], "SIGKILL")
        assert report["results"][0]["reason_code"] == "no_identity"
        assert _state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_namespace_init_refused_unless_allowed() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root for a PID namespace")
    outer = _start(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        inner = None
        while time.monotonic() < deadline and inner is None:
            for entry in os.listdir("/proc"):
                if entry.isdigit():
                    stat = sp._read_stat(int(entry))
                    if stat and stat[1] == outer.pid:
                        inner = int(entry)
            time.sleep(0.01)
        assert inner is not None
        refused = sp.signal_targets([_target(inner)], "SIGKILL")["results"][0]
        assert refused["reason_code"] == "ns_init"
        sent = sp.signal_targets([_target(inner)], "SIGKILL", allow_ns_init=True)
        assert sent["sent"] == 1
        outer.wait(timeout=5)
    finally:
        outer.kill()
        outer.wait()


def _ensure_user(name: str = "chaosuser") -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        subprocess.run(["useradd", "-m", name], check=True)
        return pwd.getpwnam(name).pw_uid


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv")
def test_other_users_refused_unless_allowed() -> None:
    uid = _ensure_user()
    proc = _start(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                   "sleep", "60"])
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            status = sp._read_status(proc.pid)
            if status and status[0] and status[0][0] == uid:
                break
            time.sleep(0.01)
        report = sp.signal_targets([_target(proc.pid)], "SIGKILL")
        assert report["results"][0]["reason_code"] == "other_user"
        assert _state(proc.pid) in ("S", "R")
        report = sp.signal_targets([_target(proc.pid)], "SIGKILL", allow_other_users=True)
        assert report["sent"] == 1
        proc.wait(timeout=5)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "targets, name, message",
    [
        ([{"pid": 1}], "SIGNOPE", "unsupported signal"),
        ([{"pid": 1}], "SIGALARM", "unsupported signal 'SIGALARM'; expected one of .*SIGALRM"),
        ([{"pid": 1}], "", "signal must be a name"),
        ({"pid": 1}, "SIGKILL", "targets must be a list"),
        ([{"pid": "12"}], "SIGKILL", "pid must be a positive integer"),
        ([{"pid": 0}], "SIGKILL", "pid must be a positive integer"),
        ([{"pid": 5, "starttime": "x"}], "SIGKILL", "starttime must be an integer"),
        ([7], "SIGKILL", "must be an object"),
    ],
)
def test_bad_input_is_refused_before_anything(targets: object, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sp.signal_targets(targets, name)


def test_command_line_prints_one_json_document() -> None:
    proc = _start(["sleep", "60"])
    try:
        path = program_path("actions", "signal_processes")
        out = subprocess.run([sys.executable, str(path), "SIGKILL"],
                             input=json.dumps([_target(proc.pid)]), capture_output=True,
                             text=True, timeout=10, env=dict(os.environ))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["sent"] == 1
        assert proc.wait(timeout=5) == -signal.SIGKILL
        bad = subprocess.run([sys.executable, str(path), "SIGKILL", "not json"],
                             capture_output=True, text=True, timeout=10)
        assert bad.returncode == 2 and "not valid JSON" in json.loads(bad.stdout)["error"]
    finally:
        proc.kill()
        proc.wait()


def test_program_is_python38_syntax() -> None:
    # It runs inside targets whose Python may be old (3.8 parses it; pidfds need 3.9).
    import ast

    ast.parse(program_path("actions", "signal_processes").read_text(), feature_version=(3, 8))


def test_null_signal_checks_without_sending() -> None:
    proc = _start(["sleep", "60"])
    try:
        assert sp.signal_targets([_target(proc.pid)], "STOP")["sent"] == 1
        assert _wait_state(proc.pid, ("T",)) == "T"
        report = sp.signal_targets([_target(proc.pid)], "0")
        assert report["signal"] == "0" and report["sent"] == 1
        time.sleep(0.1)
        assert _state(proc.pid) == "T"  # a SIGCONT would have resumed it
    finally:
        proc.kill()
        proc.wait()


def test_a_fault_field_named_like_the_entry_s_own_is_refused() -> None:
    """A fault recorded with a field called "kind" or "t" would shadow the entry's own (an XID
    fault's kind once did): refused with a clear error, nothing recorded."""
    from chaosgpu import faultlog

    before = len(faultlog.recent(0.0))
    with pytest.raises(ValueError, match=r"\['kind'\] are the entry's own"):
        faultlog.record("xid", device=0, kind="trap")
    assert len(faultlog.recent(0.0)) == before
    entry = faultlog.record("xid", device=0, xid_kind="trap")
    assert entry["kind"] == "xid" and entry["xid_kind"] == "trap"
