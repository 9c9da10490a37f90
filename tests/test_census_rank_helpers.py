"""Which process of a rank is the rank: the trainer, not what it runs. A multi-threaded trainer
(importing torch starts threads; here a Python thread stands in) that starts a `sleep`
sidecar and a shell running a probe keeps being the rank, and all three are its helpers; a
shell that runs the trainer is a wrapper, and the trainer under it is the rank. Before round
21 every child carrying the rank's environment was taken for the rank: a trainer's sidecar
was frozen in its place. Real processes, read by the real census."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

from census_helpers import wait_for
from proc_helpers import alive, wait_until

from chaosgpu import node

TRAINER = r"""
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
if sys.argv[1] == "sidecars":
    subprocess.Popen(["sleep", "600"])
    subprocess.Popen(["sh", "-c", "sleep 600; exit 1"])
time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _rank(command: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`command` started in a session of its own with rank 0's environment of a one-rank job;
    yields it and the job's id. Every process of the session is SIGKILLed at the end."""
    port = _free_port()
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCHELASTIC_RUN_ID", None)
    env.pop("CHAOSGPU_JOB", None)
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _session(sid: int) -> list[int]:
    return [p["pid"] for p in node.take_census(gpu=False, env=False, fds=False)["processes"]
            if p["sid"] == sid]


def _job(job_id: str, processes: int, sid: int) -> dict | None:
    """The job once all `processes` of its session are up and the trainer's thread runs."""
    census = node.take_census(gpu=False)
    members = [p for p in census["processes"] if p["sid"] == sid]
    if len(members) < processes or not any(p["threads"] > 1 for p in members):
        return None
    return next((j for j in census["jobs"] if j["id"] == job_id), None)


def test_a_trainer_s_sidecar_and_probe_are_its_helpers_not_the_rank() -> None:
    with _rank([sys.executable, "-c", TRAINER, "sidecars"]) as (trainer, job_id):
        job = wait_for(lambda: _job(job_id, 4, trainer.pid), timeout=30,
                       what="the trainer, its sidecar and its probe")
        others = sorted(set(_session(trainer.pid)) - {trainer.pid})
        assert [r["pid"] for r in job["ranks"]] == [trainer.pid]
        assert job["ranks"][0]["rank"] == 0
        assert sorted(job["ranks"][0]["helpers"]) == others and len(others) == 3
        started = _session(trainer.pid)
    assert wait_until(lambda: not [pid for pid in started if alive(pid)])


def test_a_shell_that_runs_the_trainer_is_its_wrapper() -> None:
    script = f"{sys.executable} -c '{TRAINER}' alone; exit 0"
    with _rank(["sh", "-c", script]) as (shell, job_id):
        job = wait_for(lambda: _job(job_id, 2, shell.pid), timeout=30,
                       what="the shell and its trainer")
        trainer = [pid for pid in _session(shell.pid) if pid != shell.pid]
        assert [r["pid"] for r in job["ranks"]] == trainer
        assert job["ranks"][0]["helpers"] == []
        started = _session(shell.pid)
    assert wait_until(lambda: not [pid for pid in started if alive(pid)])


def test_the_subreaper_that_adopts_torchrun_s_ranks_is_not_their_launcher() -> None:
    """torchrun's ranks whose agent died are adopted by a subreaper (tini, systemd, a
    supervisor: here a Python one, without torch): it is not their launcher, so no cleanup
    sends it a signal. Before round 21 it was listed as the job's torchrun."""
    reaper = r"""
import ctypes, os, subprocess, sys, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
env = dict(os.environ, TORCHELASTIC_RUN_ID="adopted-" + sys.argv[1], RANK="0", WORLD_SIZE="1",
           MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
subprocess.Popen(["sh", "-c", "sleep 600 & exit 0"], env=env)  # the rank's parent exits
time.sleep(600)
"""
    port = str(_free_port())
    with _rank([sys.executable, "-c", reaper, port]) as (subreaper, _):
        def adopted() -> dict | None:
            census = node.take_census(gpu=False)
            mine = [p for p in census["processes"] if p["sid"] == subreaper.pid
                    and p["comm"] == "sleep" and p["ppid"] == subreaper.pid]
            return next((j for j in census["jobs"] if j["id"] == f"adopted-{port}"), None) \
                if mine else None

        job = wait_for(adopted, timeout=30, what="the rank adopted by the subreaper")
        assert job["launcher_pid"] is None  # launched by a torchrun that is gone
        assert [r["rank"] for r in job["ranks"]] == [0]
        started = _session(subreaper.pid)
    assert wait_until(lambda: not [pid for pid in started if alive(pid)])
