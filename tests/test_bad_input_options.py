"""Bad input to the command lines (`chaosgpu agent`, `workload ring`, `cleanup`, `snapshot`,
`help`) and to the agent's HTTP server: each is refused with a message naming the option (or the
file) and what was wrong, exit code 2 for bad usage, no traceback, and nothing changed (no
server left listening, no file written, no process started, nothing cleaned up).

Every command runs for real as a subprocess; the autouse fixture `no_process_left_behind`
(conftest) proves that nothing a test started is still alive afterwards.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from proc_helpers import wait_until

from chaosgpu.agent import cli as agent_cli
from chaosgpu.agent.server import AgentConfig, AgentServer, CensusCache
from chaosgpu.workloads.ring import RingConfig

REPO = Path(__file__).resolve().parent.parent
RECORDED = REPO / "tests" / "data" / "nvml_h200_recorded.json"
PROGRAM = REPO / "probes" / "node_census.py"


def _run(*args: str, env: dict[str, str] | None = None, stdin: str | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`chaosgpu ARGS...` as a subprocess."""
    return subprocess.run([sys.executable, "-m", "chaosgpu.cli", *args], capture_output=True,
                          text=True, timeout=timeout, input=stdin,
                          env=env if env is not None else dict(os.environ))


def _refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    """A usage error: exit 2, every word in the message, no traceback, nothing on stdout."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    assert result.stdout == "", result.stdout


def _agent_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CHAOSGPU_AGENT_TOKEN"}
    env["CHAOSGPU_STATE_DIR"] = str(tmp_path / "state")
    return env


# -- chaosgpu agent: numbers -----------------------------------------------------------------

@pytest.mark.parametrize("option,value", [
    ("--retention-s", "nan"), ("--retention-s", "inf"), ("--retention-s", "0"),
    ("--max-seconds", "inf"), ("--max-seconds", "nan"), ("--max-seconds", "1e300"),
    ("--jobs-every", "inf"), ("--jobs-every", "nan"), ("--jobs-every", "1e300"),
    ("--census-ttl", "nan"), ("--job-window", "nan"), ("--rate-hz", "nan"),
    ("--rate-hz", "6000"), ("--process-every", "0"), ("--max-inflight", "x"),
])
def test_agent_refuses_bad_numbers_before_listening(tmp_path: Path, option: str,
                                                    value: str) -> None:
    ready = tmp_path / "ready.json"
    result = _run("agent", "--listen", "127.0.0.1:0", "--ready-file", str(ready), option, value,
                  env=_agent_env(tmp_path), timeout=30)
    _refused(result, option, "must be")
    assert not ready.exists() and not (tmp_path / "state").exists()  # nothing written


def test_agent_refuses_a_ready_file_it_cannot_write_before_listening(tmp_path: Path) -> None:
    env = _agent_env(tmp_path)
    result = _run("agent", "--listen", "127.0.0.1:0", "--ready-file",
                  str(tmp_path / "missing" / "ready.json"), env=env, timeout=30)
    _refused(result, "--ready-file", "does not exist")
    result = _run("agent", "--listen", "127.0.0.1:0", "--ready-file", str(tmp_path), env=env,
                  timeout=30)
    _refused(result, "--ready-file", "is a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no token, no ready file


def test_agent_stops_cleanly_when_the_ready_file_fails_after_listening(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("CHAOSGPU_AGENT_TOKEN", raising=False)
    monkeypatch.setenv("CHAOSGPU_STATE_DIR", str(tmp_path / "state"))

    def fail(path: str, document: dict[str, Any]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(agent_cli, "_write_ready_file", fail)
    code = agent_cli.main(["--listen", "127.0.0.1:0", "--rate-hz", "0", "--jobs-every", "0",
                           "--ready-file", str(tmp_path / "ready.json")])
    assert code == 1
    err = capsys.readouterr().err
    assert "--ready-file" in err and "No space left on device" in err and "Traceback" not in err
    assert not [t.name for t in threading.enumerate() if t.name.startswith("chaosgpu-agent")]
    assert not (tmp_path / "state" / "agent" / "token").exists()  # the token it generated
    assert not (tmp_path / "ready.json").exists()


# -- chaosgpu agent: the generated token -------------------------------------------------------

def _start_agent(env: dict[str, str], ready: Path,
                 *extra: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.cli", "agent", "--listen", "127.0.0.1:0",
         "--rate-hz", "0", "--jobs-every", "0", "--ready-file", str(ready), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert wait_until(lambda: ready.exists() or process.poll() is not None, 30), \
        "the agent never listened"
    assert ready.exists(), process.communicate()
    return process, json.loads(ready.read_text())


def test_a_second_agent_does_not_overwrite_the_first_ones_token(tmp_path: Path) -> None:
    env = _agent_env(tmp_path)
    first, info = _start_agent(env, tmp_path / "first.json", "--max-seconds", "60")
    try:
        token_file = Path(info["token_file"])
        token = token_file.read_text()
        second = _run("agent", "--listen", "127.0.0.1:0", "--max-seconds", "5", env=env,
                      timeout=30)
        _refused(second, "another agent is running", str(token_file), "--token-file")
        assert token_file.read_text() == token  # the first agent's token still works
        headers = {"Authorization": f"Bearer {token.strip()}"}
        assert requests.get(info["url"] + "/metrics", headers=headers, timeout=30).ok
        first.send_signal(signal.SIGTERM)
        assert first.wait(20) == 0
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
    # its holder gone, the token file is free: a new agent takes it and writes a new token
    third, info = _start_agent(env, tmp_path / "third.json", "--max-seconds", "0.5")
    third.communicate(timeout=20)
    assert third.returncode == 0
    assert info["token_file"] == str(token_file) and token_file.read_text() != token


# -- the agent's HTTP server -------------------------------------------------------------------

@pytest.fixture
def server() -> Iterator[AgentServer]:
    running = AgentServer("127.0.0.1", 0, AgentConfig("the-token", CensusCache(ttl_s=1.0),
                                                      None)).start()
    try:
        yield running
    finally:
        running.stop()


def _raw(server: AgentServer, request: bytes) -> tuple[str, bytes]:
    """Send raw HTTP bytes; return (the head, the body)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(request)
        data = b""
        while chunk := connection.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.decode("latin-1"), body


def test_a_non_utf8_authorization_header_is_401_not_500(server: AgentServer) -> None:
    head, body = _raw(server, b"GET /v1/snapshot HTTP/1.1\r\nHost: x\r\n"
                              b"Authorization: Bearer \xff\xfe-token\r\nConnection: close\r\n\r\n")
    assert head.startswith("HTTP/1.1 401"), head
    assert "bearer token" in json.loads(body)["error"]


def test_healthz_refuses_unknown_parameters_and_405_says_what_is_allowed(
        server: AgentServer) -> None:
    response = requests.get(server.url + "/healthz", params={"x": "1"}, timeout=30)
    assert response.status_code == 400
    assert response.json()["parameter"] == "x"
    assert requests.get(server.url + "/healthz", timeout=30).json()["status"] == "ok"
    response = requests.post(server.url + "/healthz", timeout=30)
    assert response.status_code == 405 and response.headers["Allow"] == "GET, HEAD"
    assert response.headers["Content-Type"].startswith("application/json")


# -- chaosgpu workload ring --------------------------------------------------------------------

@pytest.mark.parametrize("option,value", [
    ("--timeout-s", "nan"), ("--timeout-s", "-1"), ("--iters-per-s", "0"),
    ("--iters-per-s", "nan"), ("--master-port", "70000"), ("--master-port", "-1"),
    ("--world-size", "0"), ("--world-size", "1.5"), ("--wait-ready-s", "inf"),
    ("--mib", "-1"), ("--step-mib", "nan"),
])
def test_ring_refuses_bad_numbers_and_starts_nothing(tmp_path: Path, option: str,
                                                     value: str) -> None:
    ready = tmp_path / "ready"
    result = _run("workload", "ring", "--detach", "--backend", "gloo", "--ready-dir", str(ready),
                  option, value, timeout=30)
    _refused(result, option, "must be")
    assert not ready.exists()  # no rank started (and none is alive: the autouse fixture)


def test_ring_config_refuses_nan_and_an_impossible_port() -> None:
    for field, value, words in (("timeout_s", float("nan"), "timeout must be"),
                                ("iters_per_s", float("inf"), "iters per second must be"),
                                ("master_port", 70000, "master port must be"),
                                ("timeout_s", 1e300, "timeout must be at most")):
        with pytest.raises(ValueError, match=words):
            RingConfig(**{field: value}).validate()  # type: ignore[arg-type]


# -- chaosgpu cleanup --------------------------------------------------------------------------

@pytest.mark.parametrize("args,option", [
    (["--tag", ""], "--tag"), (["--tag", "  "], "--tag"), (["--grace-s", "nan"], "--grace-s"),
    (["--deadline-s", "nan"], "--deadline-s"), (["--deadline-s", "inf"], "--deadline-s"),
    (["--deadline-s", "0"], "--deadline-s"),
])
def test_cleanup_refuses_bad_usage_and_cleans_nothing(args: list[str], option: str) -> None:
    result = _run("cleanup", *args)
    _refused(result, option, "must be")  # and stdout is empty: the cleanup did not run


# -- chaosgpu snapshot --gpu-snapshot, chaosgpu help ---------------------------------------------

@pytest.mark.parametrize("document,problem", [
    ({"held": 5}, '"held": not a JSON object'),
    ([1], "not a JSON object"),
    ({"available": True}, '"devices" is missing or not a list'),
    ({"devices": "x"}, '"devices" is missing or not a list'),
    ({"devices": [1]}, "devices[0] is not an object"),
    ({"devices": [{"index": "0"}]}, "devices[0].index is not an integer"),
    ({"devices": [{"index": 0, "processes": [3]}]}, "devices[0].processes[0] is not an object"),
    ({"devices": [{"index": 0, "processes": [{"pid": "7"}]}]}, "processes[0].pid is not"),
    ({"devices": [{"index": 0, "memory_used_mib": "x"}]}, "memory_used_mib is not a number"),
])
def test_a_wrongly_shaped_gpu_snapshot_is_a_clear_error(tmp_path: Path, document: Any,
                                                        problem: str) -> None:
    snapshot = tmp_path / "snapshot.json"
    snapshot.write_text(json.dumps(document))
    result = _run("snapshot", "--no-env", "--no-fds", "--gpu-snapshot", str(snapshot))
    _refused(result, "--gpu-snapshot", str(snapshot), problem, "expected the census's gpu")
    program = subprocess.run([sys.executable, str(PROGRAM), "--no-env", "--no-fds",
                              "--gpu-snapshot", str(snapshot)], capture_output=True, text=True,
                             timeout=60)
    assert program.returncode == 2 and problem in json.loads(program.stdout)["error"]


def test_a_gpu_snapshot_is_read_from_standard_input() -> None:
    result = _run("snapshot", "--json", "--no-env", "--no-fds", "--gpu-snapshot", "-",
                  stdin=RECORDED.read_text())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["gpu"]["devices"][0]["name"] == "NVIDIA H200"


def test_help_command_describes_that_command() -> None:
    result = _run("help", "snapshot")
    assert result.returncode == 0 and result.stdout.startswith("usage: chaosgpu snapshot")
    assert "--gpu-snapshot" in result.stdout
    result = _run("help", "bogus")
    assert result.returncode == 2 and "unknown command 'bogus'" in result.stderr


# -- chaosgpu snapshot: its options ------------------------------------------------------------

@pytest.mark.parametrize("args,words", [
    (["--workers"], ["--workers", "expected one argument"]),
    (["--workers", "x"], ["--workers", "invalid int value: 'x'"]),
    (["--workers", "--json"], ["--workers", "expected one argument"]),
    (["--workers", "-1"], ["--workers must be >= 0, got -1"]),
    (["--device=-2"], ["--device must be >= 0, got -2"]),
    (["--indent", "-3"], ["--indent must be >= 0, got -3"]),
    (["--json=yes"], ["--json", "ignored explicit argument 'yes'"]),
    (["--bogus"], ["unrecognized arguments: --bogus"]),
    (["--json", "extra"], ["unrecognized arguments: extra"]),
    # a missing file name is an error, never standard input (which holds a valid snapshot here)
    (["--gpu-snapshot"], ["--gpu-snapshot", "expected one argument"]),
])
def test_a_bad_snapshot_option_is_refused(args: list[str], words: list[str]) -> None:
    result = _run("snapshot", *args, stdin=RECORDED.read_text())
    _refused(result, *words)


@pytest.mark.parametrize("words", [
    [], ["--json"], ["--json", "--no-gpu", "--no-env", "--no-fds", "--scan-fds"],
    ["--workers", "3"], ["--workers=3", "--workers", "4"], ["--device", "0", "--indent=2"],
    ["--gpu-snapshot", "-"], ["--gpu-snapshot=--json"], ["--workers", "-1"],
    ["--gpu-snapshot", "file.json", "--json"],
])
def test_the_snapshots_own_reading_of_a_plain_command_line_is_argparses(
        words: list[str]) -> None:
    """The snapshot reads a plain command line without argparse (its import is ~9 ms of the
    snapshot's start); what it reads is what argparse, built from the same table, reads."""
    from chaosgpu.node import cli as snapshot_cli

    plain = snapshot_cli._parse_plain(words)
    assert plain is not None
    assert plain == snapshot_cli._parse_with_argparse(words)


@pytest.mark.parametrize("words", [["--js"], ["--no-g", "--json"], ["--workers"], ["-h"],
                                   ["--workers", "x"], ["--", "--json"], ["--json=1"]])
def test_anything_else_is_left_to_argparse(words: list[str]) -> None:
    from chaosgpu.node import cli as snapshot_cli

    assert snapshot_cli._parse_plain(words) is None


def test_an_abbreviated_snapshot_option_is_read_as_argparse_reads_it() -> None:
    result = _run("snapshot", "--js", "--no-g", "--no-e", "--no-f",
                  env=dict(os.environ, CHAOSGPU_TAG="abbreviated"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    observer = document["observer"]
    # --no-g: no NVML reader; --no-f: no fd scan; --no-e: no environment read, not even the
    # snapshot's own tag (what other jobs run on the machine meanwhile does not matter)
    assert observer["gpu_reader"] is None and observer["nvidia_fd_scan"] is False, observer
    (itself,) = [p for p in document["processes"] if p["pid"] == observer["pid"]]
    assert itself["env"] is None and itself["tag"] is None, itself
