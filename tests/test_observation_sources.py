"""The sources the job verdicts are built from, each checked against the real thing: the kernel's
TCP counters (sock_diag) against `ss`, a process's /proc activity, exit statuses of processes
that were not our children (pidfd), Flight Recorder dumps read as data only, and what a non-root
observer is told."""

import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaosgpu.job import flight_recorder, observe
from chaosgpu.job.exits import ExitWatch
from chaosgpu.node import process_activity, process_starttime, tcp_sockets


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return server, client, accepted


def test_tcp_counters_match_ss_for_a_real_connection() -> None:
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    server, client, accepted = _pair()
    try:
        client.sendall(b"x" * 100_000)
        received = 0
        while received < 100_000:
            received += len(accepted.recv(65536))
        accepted.sendall(b"y" * 1234)
        assert len(client.recv(65536)) > 0
        time.sleep(0.2)
        inode = os.fstat(client.fileno()).st_ino
        entry = tcp_sockets()[inode]
        port = client.getsockname()[1]
        assert entry["state"] == "ESTABLISHED" and entry["local_port"] == port
        assert entry["remote_port"] == server.getsockname()[1]
        assert entry["bytes_acked"] >= 100_000 and entry["bytes_received"] >= 1234
        # both ends named: another connection (the real node's, say) may share the client's
        # ephemeral port with another peer
        out = subprocess.run(["ss", "-tinH", "state", "established", "src", "127.0.0.1",
                              f"sport = :{port} and dport = :{server.getsockname()[1]}"],
                             capture_output=True, text=True, check=True).stdout
        assert out.count("bytes_acked:") == 1, out
        acked = int(re.search(r"bytes_acked:(\d+)", out).group(1))  # type: ignore[union-attr]
        got = int(re.search(r"bytes_received:(\d+)", out).group(1))  # type: ignore[union-attr]
        assert (acked, got) == (entry["bytes_acked"], entry["bytes_received"])
        listening = [s for s in tcp_sockets().values()
                     if s["state"] == "LISTEN" and s["local_port"] == server.getsockname()[1]]
        assert listening
    finally:
        for sock in (client, accepted, server):
            sock.close()


def test_process_activity_sees_cpu_writes_sockets_and_stderr(tmp_path: Path) -> None:
    log = tmp_path / "err.log"
    code = ("import socket, sys, time\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
            "end = time.monotonic() + 1.5\n"
            "while time.monotonic() < end: pass\n"
            "sys.stdout.write('z' * 50000); sys.stdout.flush()\n"
            "time.sleep(30)\n")
    with open(log, "wb") as err, open(tmp_path / "out.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err)
    try:
        time.sleep(2.5)
        first = process_activity(proc.pid)
        assert first is not None and first["errors"] == {}
        assert first["starttime"] == process_starttime(proc.pid)
        assert first["cpu_ticks"] >= 20  # 1.5 s of busy loop (100 ticks/s), on a busy machine
        assert first["wchar"] >= 50000 and first["syscw"] >= 1
        assert first["stderr"] == str(log)
        assert first["socket_inodes"], first
        assert first["threads"] and first["threads"][0]["tid"] == proc.pid
        assert first["state"] in ("S", "R")
    finally:
        proc.kill()
        proc.wait()
    assert process_activity(proc.pid) is None


def test_the_exit_status_of_a_process_reaped_by_someone_else_is_seen() -> None:
    code = ("import subprocess, sys\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5);"
            " raise SystemExit(3)'])\n"
            "print(child.pid, flush=True)\n"
            "child.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        start = process_starttime(pid)
        assert start is not None
        watch = ExitWatch()
        assert watch.watch(pid, start)
        assert parent.wait(timeout=30) == 0  # its parent reaped it: it is not our child
        found = watch.exit_of(pid, start)
        if watch.supported is False:
            pytest.skip("this kernel has no PIDFD_INFO_EXIT (Linux < 6.15)")
        assert (found.code, found.signal, found.source) == (3, None, "pidfd")
        assert found.describe() == "exit 3"
        watch.close()
    finally:
        parent.kill()
        parent.wait()


def test_a_reused_pid_is_never_watched() -> None:
    watch = ExitWatch()
    assert watch.watch(os.getpid(), (process_starttime(os.getpid()) or 0) + 1) is False
    assert watch.watch(2 ** 22 + 12345, 1) is False  # no such process
    watch.close()


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/chaosgpu-pwned",))


def test_flight_recorder_dumps_are_read_as_data_only(tmp_path: Path) -> None:
    prefix = str(tmp_path / "trace_rank_")
    env = {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path / "p"),
           "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    assert flight_recorder.enabled(env) and not flight_recorder.enabled({})
    now = time.time()
    dump = {"version": "2.9", "pg_config": {}, "entries": [
        {"collective_seq_id": 1, "state": "completed", "profiling_name": "nccl:all_reduce",
         "time_created_ns": int((now - 5) * 1e9)},
        {"collective_seq_id": 2, "state": "completed", "profiling_name": "nccl:all_reduce",
         "time_created_ns": int((now - 4) * 1e9)},
        {"collective_seq_id": 3, "state": "started", "profiling_name": "nccl:all_reduce",
         "time_created_ns": int((now - 3) * 1e9)}]}
    Path(prefix + "0").write_bytes(pickle.dumps(dump))
    found = flight_recorder.read_dump(os.getpid(), env, 0)
    assert found is not None
    summary = flight_recorder.summarise(found[0], now)
    assert summary["last_completed_seq"] == 2 and summary["last_started_seq"] == 3
    assert summary["pending"]["seq"] == 3 and summary["pending"]["name"] == "nccl:all_reduce"
    assert 2.5 < summary["pending"]["age_s"] < 3.5
    marker = Path("/tmp/chaosgpu-pwned")
    marker.unlink(missing_ok=True)
    Path(prefix + "1").write_bytes(pickle.dumps({"entries": [_Evil()]}))
    assert flight_recorder.read_dump(os.getpid(), env, 1) is None
    assert not marker.exists()
    # the dump pipe must be a FIFO: a regular file of that name is never written
    (tmp_path / "p0.pipe").write_text("")
    assert flight_recorder.request_dump(os.getpid(), env, 0) is False
    assert (tmp_path / "p0.pipe").read_text() == ""
    os.mkfifo(tmp_path / "p1.pipe")
    assert flight_recorder.request_dump(os.getpid(), env, 1) is False  # no reader: no block


FAKE_RANK_WITH_FLIGHT_RECORDER = r"""
import os, pickle, sys, time
pipe, dump = sys.argv[1], sys.argv[2]
os.mkfifo(pipe)
reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
print("ready", flush=True)
seq = 0
while True:  # as ProcessGroupNCCL's monitor thread: polls its dump pipe about once a second
    time.sleep(0.5)
    seq += 1
    try:
        asked = os.read(reader, 64)
    except BlockingIOError:
        asked = b""
    if asked:
        entries = [{"collective_seq_id": i, "state": "completed", "time_created_ns":
                    time.time_ns(), "profiling_name": "nccl:all_reduce"} for i in range(1, seq)]
        with open(dump + ".tmp", "wb") as handle:
            pickle.dump({"version": "2.9", "entries": entries}, handle)
        os.replace(dump + ".tmp", dump)
"""


def test_flight_recorder_is_read_at_every_tick_also_with_stacks_off(tmp_path: Path) -> None:
    """A rank whose job enables Flight Recorder is asked for dumps and each new one is read
    by the watch itself: with stacks off (or py-spy slow) the recorder is still a source."""
    tag = f"fr-{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29977", CHAOSGPU_TAG=tag, TORCH_FR_BUFFER_SIZE="2000",
               TORCH_NCCL_DEBUG_INFO_PIPE_FILE=str(tmp_path / "fr_pipe_"),
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(tmp_path / "fr_dump_"))
    rank = subprocess.Popen([sys.executable, "-c", FAKE_RANK_WITH_FLIGHT_RECORDER,
                             str(tmp_path / "fr_pipe_0.pipe"), str(tmp_path / "fr_dump_0")],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        observer = observe.observe(tag=tag, timeout_s=4.0, window_s=4, stacks=False)
        (track,) = observer.tracks.values()
        state = track.to_json()
        assert "flight-recorder" in state["sources"], state["sources"]
        summary = state["flight_recorder"]["0"]
        assert summary["entries"] > 0 and summary["last_completed_seq"] >= 1
        assert summary["last_completed_seq"] >= 2  # dumps asked for and read more than once
    finally:
        rank.kill()
        rank.wait(timeout=10)
    assert rank.poll() is not None


def test_a_non_root_observer_is_told_other_users_jobs_are_invisible(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to observe as another user")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999", CHAOSGPU_TAG="root-job")
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    state = tmp_path / "nobody-state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)
    os.chmod(tmp_path, 0o755)
    as_nobody = ["env", f"CHAOSGPU_STATE_DIR={state}", "setpriv", "--reuid=65534",
                 "--regid=65534", "--clear-groups"]
    try:
        probe = subprocess.run(as_nobody + [sys.executable, "-c", "print(1)"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot run Python as nobody here: {probe.stderr[-200:]}")
        listed = subprocess.run(as_nobody + [sys.executable, "-m", "chaosgpu.cli", "jobs",
                                             "--json", "--observe", "0.5"],
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        out = json.loads(listed.stdout)
        assert not [j for j in out["jobs"] if j["tag"] == "root-job"]
        # another user's launcher is listed by its command line, with no verdict on it
        assert all(j["verdict"] == "unknown" for j in out["jobs"]), out["jobs"]
        assert "could not be inspected as UID 65534" in out["visibility"]
        kill = subprocess.run(as_nobody + [sys.executable, "-c",
                                           "from chaosgpu.job import actions\n"
                                           "actions.kill_rank(tag='root-job', rank=0)"],
                              capture_output=True, text=True, timeout=60)
        assert kill.returncode != 0
        assert "not running on this node" in kill.stderr
        assert "could not be inspected" in kill.stderr
        assert job.poll() is None  # nothing was signalled
    finally:
        job.kill()
        job.wait()


def test_stacks_are_read_with_the_py_spy_beside_this_python_when_path_lacks_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`.venv/bin/chaos run ...` without activating the environment: PATH has no py-spy, the
    one installed beside the interpreter is used (a hang verdict needs the stacks)."""
    from chaosgpu.job import stacks

    beside = Path(sys.executable).with_name("py-spy")
    if not beside.exists():
        pytest.skip("py-spy is not installed beside this Python")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert shutil.which("py-spy") is None or Path(shutil.which("py-spy") or "") != beside
    assert stacks.py_spy_path() in (str(beside), shutil.which("py-spy"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"])
    try:
        time.sleep(0.5)
        sample = stacks.take_samples([sleeper.pid], timeout_s=20)[sleeper.pid]
        assert sample.error is None, sample.error
        assert any(f.function == "<module>" for t in sample.threads for f in t.frames)
    finally:
        sleeper.kill()
        assert sleeper.wait(timeout=10) == -9  # ours, killed and reaped: nothing left


HELPER_FIRST = r"""
import threading, time
def helper_waits():
    while True:
        time.sleep(1)
threading.Thread(target=helper_waits, name="helper", daemon=True).start()
def main_waits():
    while True:
        time.sleep(1)
print("ready", flush=True)
main_waits()
"""


def test_where_a_rank_is_means_its_main_thread_not_a_helper() -> None:
    """A rank's place is its main thread's innermost frame, wherever py-spy lists it (on the
    H200 a GPU-stalled rank was described by an injector thread listed first)."""
    from chaosgpu.job import stacks

    rank = subprocess.Popen([sys.executable, "-c", HELPER_FIRST], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        sample = stacks.take_samples([rank.pid], timeout_s=20)[rank.pid]
        assert sample.error is None, sample.error
        assert {t.name for t in sample.threads} >= {"MainThread", "helper"} or len(
            sample.threads) == 2, sample.threads
        main = sample.main_thread()
        assert main is not None and any(f.function == "main_waits" for f in main.frames)
        reordered = stacks.StackSample(rank.pid, sample.taken_at,
                                       sorted(sample.threads, key=lambda t: t is not main))
        reordered.threads.reverse()  # the helper first, as py-spy listed the H200's
        assert reordered.threads[0] is not main and reordered.main_thread() is main
    finally:
        rank.kill()
        assert rank.wait(timeout=10) == -9


def test_a_fault_on_an_earlier_process_with_the_pid_is_not_this_ones_end() -> None:
    """A SIGKILL record speaks for how a process ended only when its PID and start time are
    this process's: an earlier process that had the PID (the fault log keeps minutes of them)
    says nothing of this one."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; c = subprocess.Popen(['sleep', '30']); "
         "print(c.pid, flush=True); sys.stdin.readline(); c.kill(); c.wait()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None and parent.stdin is not None
        pid = int(parent.stdout.readline())
        start = process_starttime(pid)
        assert start is not None
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.wait(timeout=30) == 0  # reaped by its parent, never watched here
        watch = ExitWatch()
        earlier = {"kind": "SIGKILL", "pid": pid, "starttime": start - 1, "t": time.time()}
        found = watch.exit_or_fault(pid, start, [earlier])
        assert found.source is None, found.describe()
        mine = dict(earlier, starttime=start)
        found = watch.exit_or_fault(pid, start, [earlier, mine])
        assert (found.signal, found.source) == ("SIGKILL", "chaosgpu's fault record")
        watch.close()
    finally:
        parent.kill()
        parent.wait()
