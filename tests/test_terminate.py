"""The one terminate primitive, on real processes: grace then escalation under one deadline, waits
on pidfds, identity (start time) checks that fail closed, the null signal, bad input refused
before anything is sent. Every case runs twice: through the package's typed front
(chaosgpu.process.terminate) and through the in-target program's command line (the way it runs
inside a pod), which are one algorithm."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from proc_helpers import alive, wait_until

from chaosgpu.intarget import program_path
from chaosgpu.process import terminate
from chaosgpu.sandbox.runtime import process_starttime

IGNORE_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def _start(code: str = "import time; time.sleep(60)") -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code + "\n"], env=dict(os.environ),
                            stdin=subprocess.DEVNULL)
    # Python has set its handlers once it has opened its script; give it a moment.
    assert wait_until(lambda: "-c" in open(f"/proc/{proc.pid}/cmdline").read(), 5.0)
    time.sleep(0.3)
    return proc


def _target(proc: subprocess.Popen[bytes]) -> dict[str, int]:
    starttime = process_starttime(proc.pid)
    assert starttime is not None
    return {"pid": proc.pid, "starttime": starttime}


def _via_package(targets: list[dict[str, int]], signals: list[str], grace_s: float,
                 deadline_s: float, **kwargs: Any) -> list[dict[str, Any]]:
    typed = [terminate.Target(t["pid"], t["starttime"]) for t in targets]
    outcomes = terminate.terminate(typed, signals, grace_s, deadline_s, terminate.Rules(),
                                   **kwargs)
    return [{"pid": o.pid, "result": o.result, "reason_code": o.reason_code,
             "exited_on": o.exited_on, "signals": [s.signal for s in o.signals]}
            for o in outcomes]


def _via_program(targets: list[dict[str, int]], signals: list[str], grace_s: float,
                 deadline_s: float, **kwargs: Any) -> list[dict[str, Any]]:
    once = kwargs.pop("until", None) == "sent"  # one signal, no wait: the command line's default
    assert not kwargs and (not once or len(signals) == 1), "the command line has no such option"
    timing = [] if once else [f"--grace-s={grace_s}", f"--deadline-s={deadline_s}"]
    done = subprocess.run([sys.executable, str(program_path("actions", "signal_processes")),
                           ",".join(signals), json.dumps(targets), *timing],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return [{"pid": r["pid"], "result": r["result"], "reason_code": r.get("reason_code"),
             "exited_on": r.get("exited_on"),
             "signals": ([signals[0]] if r.get("sent_at") else []) if once
             else [s["signal"] for s in r["signals"]]}
            for r in json.loads(done.stdout)["results"]]


Runner = Callable[..., list[dict[str, Any]]]
Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start processes (see _start) that are killed and reaped after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def _spawn(code: str = "import time; time.sleep(60)") -> subprocess.Popen[bytes]:
        started.append(_start(code))
        return started[-1]

    yield _spawn
    for proc in started:
        proc.kill()
        proc.wait()
RUNNERS = pytest.mark.parametrize("run", [_via_package, _via_program], ids=["package", "program"])


@RUNNERS
def test_exit_within_grace_needs_no_sigkill(run: Runner, spawn: Spawn) -> None:
    proc = spawn()
    t0 = time.monotonic()
    (out,) = run([_target(proc)], ["SIGTERM", "SIGKILL"], 5.0, 10.0)
    assert out["result"] == "exited" and out["exited_on"] == "SIGTERM"
    assert out["signals"] == ["SIGTERM"]
    assert time.monotonic() - t0 < 4.0  # did not wait out the grace
    assert proc.wait(timeout=5) == -signal.SIGTERM


@RUNNERS
def test_sigterm_ignored_escalates_to_sigkill_after_the_grace(run: Runner, spawn: Spawn) -> None:
    proc = spawn(IGNORE_TERM)
    t0 = time.monotonic()
    (out,) = run([_target(proc)], ["SIGTERM", "SIGKILL"], 0.5, 10.0)
    took = time.monotonic() - t0
    assert out["result"] == "exited" and out["exited_on"] == "SIGKILL", out
    assert out["signals"] == ["SIGTERM", "SIGKILL"]
    assert 0.45 < took < 8.0
    assert proc.wait(timeout=5) == -signal.SIGKILL


@RUNNERS
def test_one_deadline_bounds_the_whole_escalation(run: Runner, spawn: Spawn) -> None:
    proc = spawn(IGNORE_TERM)
    t0 = time.monotonic()
    # SIGTERM only, ignored: the grace (30 s) is cut by the deadline (0.5 s).
    (out,) = run([_target(proc)], ["SIGTERM"], 30.0, 0.5)
    assert out["result"] == "alive" and out["signals"] == ["SIGTERM"]
    assert time.monotonic() - t0 < 5.0
    assert alive(proc.pid)


#: More than one poll(2) can wait (2**31 - 1 ms, about 24.8 days) and less than LONGEST_WAIT_S.
LONGER_THAN_ONE_POLL_S = 3e6


@RUNNERS
def test_a_grace_longer_than_one_poll_can_take_ends_at_the_exit(run: Runner,
                                                                spawn: Spawn) -> None:
    # It sent SIGTERM, then raised OverflowError ("timeout is too large") from poll(2).
    proc = spawn()
    t0 = time.monotonic()
    (out,) = run([_target(proc)], ["SIGTERM", "SIGKILL"], LONGER_THAN_ONE_POLL_S,
                 2 * LONGER_THAN_ONE_POLL_S)
    assert out["result"] == "exited" and out["exited_on"] == "SIGTERM", out
    assert out["signals"] == ["SIGTERM"]
    assert time.monotonic() - t0 < 5.0
    assert proc.wait(timeout=5) == -signal.SIGTERM


@RUNNERS
def test_a_reused_pid_is_refused_and_left_alone(run: Runner, spawn: Spawn) -> None:
    proc = spawn()
    target = _target(proc)
    target["starttime"] += 1  # what a recycled PID looks like
    (out,) = run([target], ["SIGKILL"], 0.0, 1.0)
    assert out["result"] == "refused" and out["reason_code"] == "reused"
    assert out["signals"] == [] and alive(proc.pid)


@RUNNERS
def test_the_caller_pid1_and_a_dead_target(run: Runner, spawn: Spawn) -> None:
    proc = spawn()
    dead = _target(proc)
    proc.kill()
    proc.wait()
    me = {"pid": os.getpid(), "starttime": process_starttime(os.getpid()) or 0}
    init = {"pid": 1, "starttime": process_starttime(1) or 0}
    outs = run([me, init, dead], ["SIGTERM", "SIGKILL"], 0.1, 1.0)
    assert [o["reason_code"] for o in outs[:2]] == ["runner", "pid1"]
    assert outs[2]["result"] in ("gone", "refused")  # reaped (or, rarely, the PID reused)
    assert all(o["signals"] == [] for o in outs)


@RUNNERS
def test_the_null_signal_checks_only(run: Runner, spawn: Spawn) -> None:
    proc = spawn()
    os.kill(proc.pid, signal.SIGSTOP)
    assert wait_until(lambda: open(f"/proc/{proc.pid}/stat").read().split()[2] == "T")
    (out,) = run([_target(proc)], ["0"], 0.0, 0.0, until="sent")
    assert out["result"] == "sent" and out["signals"] == ["0"]
    time.sleep(0.2)
    assert open(f"/proc/{proc.pid}/stat").read().split()[2] == "T"  # still stopped


def test_cont_first_lets_a_stopped_process_act_on_sigterm() -> None:
    stopped = [_start(), _start()]
    try:
        for proc in stopped:
            os.kill(proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: all(open(f"/proc/{p.pid}/stat").read().split()[2] == "T"
                                      for p in stopped))
        rules = terminate.Rules()
        plain, resumed = ([terminate.Target(**_target(p))] for p in stopped)
        (out,) = terminate.terminate(plain, ["SIGTERM", "SIGKILL"], 0.3, 5.0, rules)
        assert out.exited_on == "SIGKILL"  # a stopped process does not act on SIGTERM
        (out,) = terminate.terminate(resumed, ["SIGTERM", "SIGKILL"], 3.0, 5.0, rules,
                                     cont_first=True)
        assert out.exited_on == "SIGTERM"
        assert [p.wait(timeout=5) for p in stopped] == [-signal.SIGKILL, -signal.SIGTERM]
    finally:
        for proc in stopped:
            proc.kill()
            proc.wait()


def test_until_reaped_waits_for_the_parent_to_reap() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; c = subprocess.Popen(['sleep', '60']);"
         " print(c.pid, flush=True); c.wait()"],
        env=dict(os.environ), stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        starttime = process_starttime(child)
        assert starttime is not None
        (out,) = terminate.terminate([terminate.Target(child, starttime)], ["SIGKILL"], 0.0, 5.0,
                                     terminate.Rules(), until="reaped")
        assert out.result == "exited" and out.reaped is True and out.reaped_at is not None
        assert not os.path.exists(f"/proc/{child}")
        assert parent.wait(timeout=5) == 0
    finally:
        parent.kill()
        parent.wait()


def test_wait_exits_polls_pidfds() -> None:
    procs = [_start(), _start()]
    try:
        targets = [terminate.Target(**_target(p)) for p in procs]
        assert terminate.wait_exits(targets, 0.2) == targets
        procs[0].kill()
        assert terminate.wait_exits(targets, 5.0) == [targets[1]]  # a zombie counts as gone
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_wait_longer_than_one_poll_can_take(spawn: Spawn) -> None:
    # The wait ends at the exit, well within the first poll.
    proc = spawn("import time; time.sleep(0.5)")
    target = terminate.Target(**_target(proc))
    t0 = time.monotonic()
    assert terminate.wait_exits([target], LONGER_THAN_ONE_POLL_S) == []
    assert time.monotonic() - t0 < 5.0


def test_a_wait_is_made_of_polls_until_the_deadline(spawn: Spawn,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Each poll(2) waits at most POLL_SLICE_S (a day); shrunk here, a 0.5 s wait takes many
    # polls, ends at its own deadline and not at the first poll's, and still sees an exit.
    from chaosgpu.intarget import load

    monkeypatch.setattr(load("actions", "signal_processes"), "POLL_SLICE_S", 0.02)
    alive_one = terminate.Target(**_target(spawn()))
    t0 = time.monotonic()
    assert terminate.wait_exits([alive_one], 0.5) == [alive_one]
    assert 0.45 < time.monotonic() - t0 < 3.0
    ending = terminate.Target(**_target(spawn("import time; time.sleep(0.5)")))
    t0 = time.monotonic()
    assert terminate.wait_exits([ending, alive_one], 1.5) == [alive_one]
    assert 1.45 < time.monotonic() - t0 < 4.0
    assert not alive(ending.pid)


@pytest.mark.parametrize(
    "signals, grace_s, deadline_s, until, message",
    [([], 1.0, 1.0, "exit", "at least one signal"),
     (["SIGNOPE"], 1.0, 1.0, "exit", "unsupported signal"),
     (["SIGTERM"], -1.0, 1.0, "exit", "grace_s must be a number of seconds >= 0"),
     (["SIGTERM"], 1.0, -1.0, "exit", "deadline_s must be a number of seconds >= 0"),
     (["SIGTERM"], 1.0, float("nan"), "exit", "deadline_s must be"),
     (["SIGTERM"], 1.0, 1.0, "forever", "until must be one of")],
)
def test_bad_input_is_refused_before_anything_is_sent(
        signals: list[str], grace_s: float, deadline_s: float, until: str, message: str,
        spawn: Spawn) -> None:
    proc = spawn()
    with pytest.raises(ValueError, match=message):
        terminate.terminate([terminate.Target(**_target(proc))], signals, grace_s,
                            deadline_s, terminate.Rules(), until=until)
    assert alive(proc.pid)


def test_a_target_without_a_start_time_cannot_be_named() -> None:
    with pytest.raises(ValueError, match="starttime must be an integer"):
        terminate.Target(os.getpid(), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pid must be an integer > 0"):
        terminate.Target(0, 5)
    with pytest.raises(TypeError, match="Target"):
        terminate.signal_once([{"pid": 5, "starttime": 1}], "SIGKILL",  # type: ignore[list-item]
                              terminate.Rules())
