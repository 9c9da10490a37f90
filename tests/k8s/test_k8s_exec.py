"""The exec transport through the real `kubernetes` client (`kubernetes.stream.stream`) against a
loopback server speaking the exec channel protocol and really running the commands."""

import json
import signal
import subprocess
import sys
import time

import pytest
from kubernetes import client

from chaosgpu.k8s import exec as kexec
from chaosgpu.k8s.exec import ExecError, ExecTimeout, run_in_pod, run_program
from k8s.cluster import Cluster
from k8s.k8s_exec_server import ExecServer


@pytest.fixture()
def core(exec_server: ExecServer) -> client.CoreV1Api:
    configuration = client.Configuration()
    configuration.host = exec_server.url
    configuration.api_key["authorization"] = "exec-token"
    configuration.api_key_prefix["authorization"] = "Bearer"
    return client.CoreV1Api(client.ApiClient(configuration))


@pytest.mark.parametrize("protocols", [("v4.channel.k8s.io",),
                                       ("v5.channel.k8s.io", "v4.channel.k8s.io")])
def test_success_stdout_is_one_json_document(core: client.CoreV1Api, exec_server: ExecServer,
                                             protocols: tuple[str, ...]) -> None:
    exec_server.protocols = protocols
    code = "import json,sys; print(json.dumps({'ok': True, 'argv': sys.argv[1:]}))"
    result = run_in_pod(core, "trainer-0", "ml", ["python3", "-c", code, "a b", "c"],
                        container="worker", timeout=20)
    assert result["exit_code"] == 0 and result["stderr"] == ""
    assert json.loads(result["stdout"]) == {"ok": True, "argv": ["a b", "c"]}
    entry = exec_server.log[-1]
    assert entry["protocol"] == protocols[0]
    assert (entry["namespace"], entry["pod"], entry["container"]) == ("ml", "trainer-0", "worker")
    assert entry["command"][:2] == ["python3", "-c"] and not entry["stdin"] and not entry["tty"]
    assert entry["authorization"] == "Bearer exec-token"


def test_large_output_and_stdin_round_trip(core: client.CoreV1Api) -> None:
    code = ("import sys; data=sys.stdin.buffer.read(200000); "
            "sys.stdout.write(str(len(data))+'x'*300000)")
    result = run_in_pod(core, "p", "default", ["python3", "-c", code], stdin=b"y" * 200000,
                        timeout=30)
    assert result["exit_code"] == 0
    assert result["stdout"].startswith("200000") and len(result["stdout"]) == 300006


@pytest.mark.parametrize("protocols", [("v4.channel.k8s.io",),
                                       ("v5.channel.k8s.io", "v4.channel.k8s.io")])
def test_in_target_program_streamed_in_on_stdin(core: client.CoreV1Api, exec_server: ExecServer,
                                                protocols: tuple[str, ...]) -> None:
    exec_server.protocols = protocols
    document = run_program(core, "p", "default", "probes", "node_census",
                           args=["--no-fds", "--no-gpu"], timeout=60)
    assert document["schema"] == "chaosgpu.census/1"
    assert document["processes"] and document["observer"]["pid"] > 0
    entry = exec_server.log[-1]
    assert entry["stdin"] and entry["exit_code"] == 0
    assert entry["command"][3:] == ["chaosgpu-probes-node_census.py", "61", "-",  # name, alarm
                                    "--no-fds", "--no-gpu"]


def test_in_target_program_in_the_command_when_allowed(
        core: client.CoreV1Api, exec_server: ExecServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kexec, "_MAX_ARG", 1 << 20)
    document = run_program(core, "p", "default", "actions", "signal_processes",
                           args=["SIGTERM", "[]"], timeout=60)  # no target: nothing signalled
    assert document["schema"].startswith("chaosgpu.") and "error" not in document, document
    entry = exec_server.log[-1]
    assert not entry["stdin"] and "def main(" in entry["command"][5]


def test_a_program_longer_than_linux_allows_one_argument_goes_on_stdin(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever size the command is allowed, a source over Linux's limit on one argv string
    (128 KiB) goes on stdin: in the command it would fail to start with E2BIG."""
    monkeypatch.setattr(kexec, "_MAX_ARG", 1 << 20)
    for size, on_stdin in ((kexec._ARG_STRLEN_MAX, False), (kexec._ARG_STRLEN_MAX + 1, True)):
        source = "#" * (size - 1) + "\n"
        monkeypatch.setattr(kexec.intarget, "source", lambda kind, name, text=source: text)
        command, stdin = kexec.program_command("probes", "node_census", ["--no-gpu"])
        assert (stdin is not None) is on_stdin, size
        assert (command[5] == "-") is on_stdin and command[6:] == ["--no-gpu"]
        if on_stdin:
            assert stdin == f"{size}\n".encode() + source.encode()


def test_failing_command_reports_exit_code_and_stderr(core: client.CoreV1Api) -> None:
    result = run_in_pod(core, "p", "default", ["sh", "-c", "echo out; echo boom >&2; exit 3"],
                        timeout=20)
    assert (result["exit_code"], result["stdout"], result["stderr"]) == (3, "out\n", "boom\n")


def test_failing_program_is_a_clear_error(core: client.CoreV1Api) -> None:
    with pytest.raises(ExecError, match="exited 1 without one JSON document") as failed:
        run_program(core, "p", "default", "probes", "node_census", python="false", timeout=20)
    assert failed.value.exit_code == 1
    with pytest.raises(ExecError, match=r"actions/signal_processes in pod default/p refused: "
                       "usage") as refused:
        run_program(core, "p", "default", "actions", "signal_processes", timeout=20)
    assert refused.value.exit_code == 2 and refused.value.document["error"]


@pytest.mark.parametrize("code", [0, 1])
def test_a_server_dropping_the_connection_after_its_close_frame_still_gives_the_status(
        core: client.CoreV1Api, exec_server: ExecServer, code: int) -> None:
    exec_server.abrupt_close = "after-status"
    for _ in range(5):  # the client's answering close meets a reset socket: not an error
        result = run_in_pod(core, "p", "default", ["sh", "-c", f"echo out; exit {code}"],
                            timeout=20)
        assert (result["exit_code"], result["stdout"]) == (code, "out\n")


def test_a_connection_reset_before_the_exit_status_is_an_error(
        core: client.CoreV1Api, exec_server: ExecServer) -> None:
    exec_server.abrupt_close = "before-status"
    with pytest.raises(ExecError, match="closed without an exit status"):
        run_in_pod(core, "p", "default", ["sh", "-c", "echo out; exit 0"], timeout=20)


def test_crashing_program_gives_its_traceback(core: client.CoreV1Api,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kexec.intarget, "source", lambda kind, name: "print(1/0)\n")
    with pytest.raises(ExecError, match=r"(?s)exited 1 without one JSON document on stdout; "
                       r"stderr: Traceback.*ZeroDivisionError") as crashed:
        run_program(core, "p", "default", "probes", "crash", timeout=20)
    assert "chaosgpu-probes-crash.py" in crashed.value.stderr


def test_missing_executable_is_a_clear_error(core: client.CoreV1Api) -> None:
    with pytest.raises(ExecError, match="failed: InternalError"):
        run_in_pod(core, "p", "default", ["no-such-program-here"], timeout=20)


def test_timeout_closes_the_stream_and_the_command_dies(core: client.CoreV1Api,
                                                        exec_server: ExecServer) -> None:
    started = time.monotonic()
    with pytest.raises(ExecTimeout, match=r"timed out after 1 s: 'sh' still running"):
        run_in_pod(core, "p", "default", ["sh", "-c", "echo started >&2; exec sleep 30"],
                   timeout=1)
    assert time.monotonic() - started < 4
    deadline = time.monotonic() + 10
    while not exec_server.log[-1]["killed"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exec_server.log[-1]["killed"]  # the server saw the stream closed and killed it


def test_bootstrap_alarm_kills_the_program_in_the_pod() -> None:
    """On a real cluster a closed stream may leave the process running: the alarm ends it."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", kexec._BOOTSTRAP, "slow.py", "1",
                           "import time; time.sleep(30)"], timeout=20)
    assert done.returncode == -signal.SIGALRM and time.monotonic() - started < 5


@pytest.mark.parametrize("command,timeout,message", [
    ([], 5, "non-empty list"), (["ls", 3], 5, "non-empty list"), (["ls"], 0, "timeout must"),
])
def test_bad_exec_input(core: client.CoreV1Api, command: list, timeout: float,
                        message: str) -> None:
    with pytest.raises(ExecError, match=message):
        run_in_pod(core, "p", "default", command, timeout=timeout)


def test_exec_into_a_missing_pod_through_the_emulator(cluster: Cluster) -> None:
    with pytest.raises(ExecError, match="could not start"):
        run_in_pod(cluster.core, "ghost", "default", ["true"], timeout=10)
    cluster.add_pod("real", gpus=1)
    assert run_in_pod(cluster.core, "real", "default", ["true"], timeout=10)["exit_code"] == 0
