"""Bad input to the sandbox, validate, report and hold command lines (the real CLIs, as
subprocesses) and to the library functions behind them: a clear error naming the option and
what was wrong, exit code 2 for usage errors and 1 for refusals, no traceback, and nothing
changed (no process started, no record, no file written or left behind)."""

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaosgpu import intarget, state
from chaosgpu.errors import ActivityError, InvalidArgument
from chaosgpu.sandbox import probes, runtime

JOURNALS = Path(__file__).resolve().parent / "results" / "report-cpu-2026-12-03"


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chaosgpu.cli", *args], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL, cwd=cwd,
                          env=dict(os.environ))  # fmt: skip


def _refused(done: subprocess.CompletedProcess[str], rc: int, *words: str) -> None:
    assert done.returncode == rc, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, (word, done.stderr)


@pytest.fixture
def box() -> str:
    name = f"b-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    yield name
    runtime.remove(name)
    assert runtime.get_record(name) is None


def _no_trace(name: str) -> None:
    assert runtime.get_record(name) is None
    assert not (state.state_dir() / "sandboxes" / f"{name}.log").exists()


# ---------------------------------------------------------------- sandbox: ids


@pytest.mark.parametrize("user", ["-1", "4294967295", "99999999999", "abc", "0:-1", "1:x"])
def test_sandbox_exec_refuses_a_bad_user(box: str, tmp_path: Path, user: str) -> None:
    runtime.create(box)
    marker = tmp_path / "ran"
    done = _cli("sandbox", "exec", box, "--user", user, "--", "touch", str(marker))
    _refused(done, 2, "--user", "4294967294", repr(user.split(":")[-1] if ":" in user else user))
    assert not marker.exists()
    assert [p["ns_pid"] for p in runtime.processes(box)] == [1]


@pytest.mark.parametrize("flag, value", [("--uid", "-1"), ("--uid", "4294967295"),
                                         ("--gid", "abc")])
def test_sandbox_create_refuses_a_bad_id(box: str, flag: str, value: str) -> None:
    _refused(_cli("sandbox", "create", box, "--uid", "0", flag, value), 2, flag, repr(value))
    _no_trace(box)


def test_library_refuses_out_of_range_ids(box: str) -> None:
    for kwargs in ({"uid": -1}, {"uid": 2**32 - 1}, {"uid": 2**32}, {"uid": 0, "gid": 2**40}):
        with pytest.raises(ValueError, match="must be a user or group id"):
            runtime.create(box, **kwargs)
        _no_trace(box)
    runtime.create(box)
    for user in (-1, 2**32, "0:-1", "0:4294967295", "x"):
        with pytest.raises(ValueError, match="user|uid|gid"):
            runtime.exec_in(box, ["true"], user=user)
    assert [p["ns_pid"] for p in runtime.processes(box)] == [1]


# ---------------------------------------------------------------- sandbox: seconds


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_sandbox_create_refuses_a_bad_grace(box: str, value: str) -> None:
    _refused(_cli("sandbox", "create", box, "--grace", value), 2, "--grace", repr(value))
    _no_trace(box)
    with pytest.raises(ValueError, match="grace_s must be a number of seconds >= 0"):
        runtime.create(box, grace_s=float(value))
    _no_trace(box)


def test_sandbox_exec_and_terminate_refuse_bad_seconds(box: str, tmp_path: Path) -> None:
    runtime.create(box)
    marker = tmp_path / "ran"
    for value in ("nan", "inf", "0"):
        _refused(_cli("sandbox", "exec", box, "--timeout", value, "--", "touch", str(marker)),
                 2, "--timeout", repr(value))
    for flag in ("--grace", "--deadline"):
        _refused(_cli("sandbox", "terminate", box, flag, "nan"), 2, flag, "'nan'")
    assert not marker.exists()
    assert runtime.sandbox_alive(box)
    with pytest.raises(ValueError, match="timeout_s"):
        runtime.exec_in(box, ["true"], timeout_s=math.nan)
    with pytest.raises(ValueError, match="deadline_s"):
        runtime.terminate(box, deadline_s=math.inf)
    assert runtime.sandbox_alive(box)


def test_a_recorded_infinite_grace_is_refused_clearly(box: str) -> None:
    # A record written before create refused it: terminate says so instead of overflowing.
    record = runtime.create(box)
    state.write_record("sandboxes", box, dict(record, grace_s=math.inf))
    with pytest.raises(runtime.SandboxError, match="grace_s"):
        runtime.terminate(box)
    assert runtime.sandbox_alive(box)
    assert runtime.terminate(box, grace_s=0)["already_gone"] is False


def test_intarget_terminate_refuses_non_finite_seconds() -> None:
    program = intarget.load("actions", "signal_processes")
    for kwargs in ({"grace_s": math.inf}, {"deadline_s": math.inf}, {"grace_s": math.nan}):
        with pytest.raises(program.SignalInputError, match="must be a number of seconds >= 0"):
            program.terminate([], ["SIGTERM", "SIGKILL"], **kwargs)


# ---------------------------------------------------------------- sandbox: exec and create


def test_exec_timeout_names_the_command(box: str) -> None:
    runtime.create(box)
    with pytest.raises(runtime.SandboxError, match=r"`sleep 30` did not finish within 0.3 s"):
        runtime.exec_in(box, ["sleep", "30"], timeout_s=0.3)
    deadline = time.monotonic() + 10  # the killed command is reaped by the pod's init
    while [p["ns_pid"] for p in runtime.processes(box)] != [1]:
        assert time.monotonic() < deadline, runtime.processes(box)
        time.sleep(0.05)


def test_detached_exec_of_a_missing_program_fails_and_leaves_no_zombie(box: str) -> None:
    runtime.create(box)
    done = _cli("sandbox", "exec", box, "--detach", "--", "/nonexistent/program")
    _refused(done, 1, "/nonexistent/program", "not found")
    assert done.stdout == ""
    listed = runtime.processes(box)
    assert [p["ns_pid"] for p in listed] == [1] and not any(p["zombie"] for p in listed)


def test_create_reports_the_pid1_exec_error_and_leaves_no_log(box: str) -> None:
    done = _cli("sandbox", "create", box, "--init", "none", "--", "/nonexistent/init")
    _refused(done, 1, "could not start", "/nonexistent/init", "No such file or directory")
    _no_trace(box)


def test_rm_removes_a_leftover_log(box: str) -> None:
    log = state.state_dir() / "sandboxes" / f"{box}.log"
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    log.write_text("from an older failed create\n")
    done = _cli("sandbox", "rm", box)
    assert done.returncode == 0, done.stderr
    assert not log.exists()


# ---------------------------------------------------------------- sandbox probes


def test_probes_refuse_a_sandbox_that_is_not_recorded(box: str) -> None:
    typo = box + "-typo"
    for probe in (probes.sandbox_zombie_count, probes.sandbox_zombies,
                  probes.sandbox_processes, probes.sandbox_orphans, probes.sandbox_exists):
        with pytest.raises(ActivityError, match=f"no sandbox named '{typo}'"):
            probe(typo)  # sandbox_exists too: "the pod is gone" never passes on a typo
        assert probe(typo, missing_ok=True) in (0, [])
        with pytest.raises(InvalidArgument, match="missing_ok"):
            probe(typo, missing_ok="sometimes")
    assert probes.sandbox_exists(typo, missing_ok=True) is False
    # A sandbox this process created, removed since, reads as empty (the experiment's own).
    runtime.create(box)
    runtime.remove(box)
    assert probes.sandbox_zombie_count(box) == 0
    with pytest.raises(ActivityError):
        probes.sandbox_zombie_count(box, missing_ok=False)


# ---------------------------------------------------------------- chaosgpu validate


def _experiment(tmp_path: Path) -> Path:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps({
        "title": "t", "description": "d",
        "method": [{"type": "probe", "name": "p", "provider": {
            "type": "python", "module": "os.path", "func": "exists",
            "arguments": {"path": "${job}-${rank}"}}}],
    }))  # fmt: skip
    return path


def test_validate_understands_typed_vars(tmp_path: Path) -> None:
    path = _experiment(tmp_path)
    for job, rank in (("job=abc", "rank=1"), ("job:str=abc", "rank:int=1"),
                      ("job:json=\"x\"", "rank:float=1.5")):
        done = _cli("validate", str(path), "--var", job, "--var", rank)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["valid"] is True


@pytest.mark.parametrize("var, words", [
    ("rank:int=x", ["--var", "'rank:int=x'", "invalid literal for int()"]),
    ("rank:integer2=1", ["--var", "variable type can only be"]),
    ("rank:json={", ["--var", "'rank:json={'"]),
    ("rank", ["--var", "NAME:TYPE=VALUE", "'rank'"]),
    ("=1", ["--var", "NAME:TYPE=VALUE"]),
])  # fmt: skip
def test_validate_refuses_a_bad_var(tmp_path: Path, var: str, words: list[str]) -> None:
    _refused(_cli("validate", str(_experiment(tmp_path)), "--var", "job=a", "--var", var),
             2, *words)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("kind", ["folder", "bad-json", "empty", "json-string", "url"])
def test_validate_refuses_an_unreadable_experiment(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "experiment.json"
    if kind == "folder":
        path.mkdir()
    elif kind == "bad-json":
        path.write_text('{"title": ')
    elif kind == "empty":
        path.write_text("")
    elif kind == "json-string":
        path.write_text('"an experiment"')
    source = f"http://127.0.0.1:{_closed_port()}/x.json" if kind == "url" else str(path)
    done = _cli("validate", source)
    _refused(done, 1, f"chaosgpu validate: {source}: ")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


# ---------------------------------------------------------------- chaosgpu report


def test_report_keeps_a_good_report_when_no_journal_is_usable(tmp_path: Path) -> None:
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.html").write_text("the good one")
    bad = tmp_path / "journal.json"
    bad.write_text("{")
    _refused(_cli("report", str(bad), "--out", str(out)), 2, "no usable journal",
             "nothing written")
    assert [p.name for p in out.iterdir()] == ["report.html"]
    assert (out / "report.html").read_text() == "the good one"


@pytest.mark.parametrize("out, words", [("", ["--out", "non-empty"]),
                                        ("/proc/chaosgpu-report", ["--out",
                                                                   "cannot write the report"])])
def test_report_refuses_an_unwritable_out(tmp_path: Path, out: str, words: list[str]) -> None:
    journal = JOURNALS / "zombies-sleep-pid1.journal.json"
    _refused(_cli("report", str(journal), "--out", out, "--no-plots", cwd=tmp_path), 2, *words)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- chaosgpu workload hold


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_hold_refuses_an_unwritable_ready_file(tmp_path: Path, where: str) -> None:
    ready = tmp_path / "no" / "such" / "ready.json" if where == "missing-folder" else tmp_path
    before = sorted(os.listdir(tmp_path.parent))
    done = _cli("workload", "hold", "--via", "host", "--mib", "1", "--ready-file", str(ready))
    _refused(done, 2, "--ready-file", "cannot be written")
    assert list(tmp_path.iterdir()) == []
    assert sorted(os.listdir(tmp_path.parent)) == before  # no .tmp file beside it either
