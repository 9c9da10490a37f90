"""Run a command, or one of chaosgpu's in-target programs, inside a pod's container through the
Kubernetes exec API (the websocket channel protocol), with a deadline.

This module owns the exec transport: opening the stream (`kubernetes.stream.stream` on
`connect_get_namespaced_pod_exec`), feeding stdin, collecting stdout (channel 1) and stderr
(channel 2), reading the exit status from the error channel (channel 3), closing the stream at the
deadline, and turning each way it can fail into a clear `ExecError`. In-target programs are
streamed in (nothing is installed in the pod): `python3 -c BOOTSTRAP` reads the source from stdin
(a small one may go as one argument instead: the command travels in the exec URL, and proxies
in front of an API server may limit URL lines to 8 KiB), and the bootstrap arms SIGALRM so the
program dies in the pod even if the client's stream is cut. It knows nothing of
what the programs do, and it selects no pod.
"""

import json
import logging
import math
import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream
from websocket import WebSocketConnectionClosedException

from chaosgpu import intarget

__all__ = ["ExecError", "ExecTimeout", "run_in_pod", "run_program", "program_command"]

logger = logging.getLogger("chaostoolkit")

STDOUT, STDERR, ERROR = 1, 2, 3
# Sources up to this size go in the command (the exec URL); larger ones on stdin. The command is
# URL-encoded into the request line: 8 KiB line limits are common (aiohttp, nginx), the API
# server allows 1 MiB, Linux one argv string 128 KiB.
_MAX_ARG = 2_000
# Linux's limit on one argv string (MAX_ARG_STRLEN: 32 pages, its NUL included): a longer
# source in the command would fail to start (E2BIG), so it goes on stdin whatever _MAX_ARG says.
_ARG_STRLEN_MAX = 32 * 4096 - 1

# argv: NAME ALARM_SECONDS SOURCE ARGS...  (source in argv) or NAME ALARM_SECONDS - ARGS...
# (then stdin carries "<byte length>\n<source>").
_BOOTSTRAP = (
    "import signal,sys\n"
    "signal.alarm(int(sys.argv[2]))\n"
    "src=sys.argv[3]\n"
    "if src=='-':\n"
    " n=int(sys.stdin.buffer.readline());src=sys.stdin.buffer.read(n).decode('utf-8')\n"
    "sys.argv=[sys.argv[1]]+sys.argv[4:]\n"
    "exec(compile(src,sys.argv[0],'exec'),{'__name__':'__main__','__file__':sys.argv[0]})\n"
)


class ExecError(RuntimeError):
    """A command run in a pod could not run, failed, or printed no usable result."""

    def __init__(self, message: str, exit_code: int | None = None, stderr: str = "",
                 document: Any = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.stderr = stderr
        self.document = document


class ExecTimeout(ExecError):
    """A command run in a pod did not finish before its deadline; the stream was closed."""


def _exit_code(raw: bytes, where: str) -> int:
    if not raw:
        raise ExecError(f"exec in {where}: the stream closed without an exit status "
                        "(error channel empty)")
    try:
        status = json.loads(raw.decode("utf-8", "replace"))
    except json.JSONDecodeError:
        raise ExecError(f"exec in {where}: unreadable exit status {raw[:200]!r}") from None
    if status.get("status") == "Success":
        return 0
    for cause in ((status.get("details") or {}).get("causes") or []):
        if cause.get("reason") == "ExitCode":
            try:
                return int(cause.get("message"))
            except (TypeError, ValueError):
                break
    raise ExecError(f"exec in {where} failed: {status.get('reason') or 'Failure'}: "
                    f"{status.get('message') or status}")


def _refusal(error: ApiException) -> str:
    """Why the exec handshake was refused, in the API server's words: the websocket client puts
    the HTTP status, every response header (audit ids, dates) and the Status body into one text
    ("Handshake status 403 Forbidden -+-+- {headers} -+-+- {body}"); keep the status and the
    body's message."""
    text = str(error.reason or error)
    parts = text.split(" -+-+- ")
    if len(parts) != 3:
        return text
    status = parts[0].removeprefix("Handshake status ").strip()
    try:
        body = json.loads(parts[2])
    except ValueError:
        return f"{status}: {parts[2].strip()}"
    message = body.get("message") if isinstance(body, dict) else None
    return f"{status}: {message}" if message else f"{status}: {parts[2].strip()}"


def run_in_pod(core: client.CoreV1Api, name: str, ns: str, command: list[str],
               container: str | None = None, stdin: bytes | None = None,
               timeout: float = 60.0) -> dict[str, Any]:
    """Run `command` in the pod; return exit_code, stdout, stderr (text) and duration_s."""
    if not command or not all(isinstance(part, str) for part in command):
        raise ExecError(f"command must be a non-empty list of strings, not {command!r}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ExecError(f"timeout must be a positive number of seconds, not {timeout!r}")
    where = f"pod {ns}/{name}" + (f" container {container}" if container else "")
    kwargs: dict[str, Any] = {"command": command, "stdout": True, "stderr": True,
                              "stdin": stdin is not None, "tty": False,
                              "_preload_content": False, "binary": True,
                              "_request_timeout": max(1.0, min(timeout, 30.0))}
    if container:
        kwargs["container"] = container
    started = time.monotonic()
    deadline = started + timeout
    try:
        ws = stream(core.connect_get_namespaced_pod_exec, name, ns, **kwargs)
    except ApiException as error:
        raise ExecError(f"exec in {where} could not start: {_refusal(error)}") from None
    out: list[bytes] = []
    err: list[bytes] = []
    status = b""
    try:
        if stdin is not None:
            try:
                ws.write_stdin(stdin)
            except Exception as error:  # the command may exit (and the stream close) first
                logger.debug("exec in %s: stdin not fully written: %s", where, error)
        try:
            while ws.is_open():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    out.append(ws.read_channel(STDOUT))
                    err.append(ws.read_channel(STDERR))
                    raise ExecTimeout(
                        f"exec in {where} timed out after {timeout:g} s: {command[0]!r} still "
                        "running; the stream was closed",
                        stderr=b"".join(err).decode("utf-8", "replace"))
                ws.update(timeout=min(remaining, 0.25))
                out.append(ws.read_channel(STDOUT))
                err.append(ws.read_channel(STDERR))
                status += ws.read_channel(ERROR)
        except (OSError, WebSocketConnectionClosedException) as error:
            # The connection dropped: a server or proxy may reset it right after its close
            # frame, before the client's answering close is sent. What was received stays
            # readable once the stream is marked closed; no exit status is an error below.
            logger.debug("exec in %s: the connection dropped: %r", where, error)
            ws.close()
        out.append(ws.read_channel(STDOUT))
        err.append(ws.read_channel(STDERR))
        status += ws.read_channel(ERROR)
    finally:
        ws.close()
    stderr = b"".join(err).decode("utf-8", "replace")
    try:
        code = _exit_code(status, where)
    except ExecError as error:
        error.stderr = stderr
        if stderr.strip():
            error.args = (f"{error.args[0]}; stderr: {stderr.strip()[-2000:]}",)
        raise
    return {"exit_code": code, "stdout": b"".join(out).decode("utf-8", "replace"),
            "stderr": stderr, "duration_s": round(time.monotonic() - started, 4)}


def program_command(kind: str, program: str, args: list[str] | None = None,
                    timeout: float = 60.0,
                    python: str = "python3") -> tuple[list[str], bytes | None]:
    """Return (command, stdin bytes or None) that runs an in-target program with a kill alarm."""
    source = intarget.source(kind, program)
    args = [str(a) for a in (args or [])]
    alarm = str(max(1, math.ceil(timeout) + 1))
    label = f"chaosgpu-{kind}-{program}.py"
    data = source.encode("utf-8")
    if len(data) <= min(_MAX_ARG, _ARG_STRLEN_MAX):
        return [python, "-c", _BOOTSTRAP, label, alarm, source, *args], None
    return [python, "-c", _BOOTSTRAP, label, alarm, "-", *args], f"{len(data)}\n".encode() + data


def run_program(core: client.CoreV1Api, name: str, ns: str, kind: str, program: str,
                args: list[str] | None = None, container: str | None = None,
                timeout: float = 60.0, python: str = "python3") -> Any:
    """Stream in-target program `kind/program` into the pod, run it, return its JSON document."""
    command, stdin = program_command(kind, program, args, timeout, python)
    result = run_in_pod(core, name, ns, command, container=container, stdin=stdin,
                        timeout=timeout)
    where = f"pod {ns}/{name}"
    stdout, stderr, code = result["stdout"], result["stderr"], result["exit_code"]
    try:
        document = json.loads(stdout)
    except json.JSONDecodeError:
        document = None
    if code not in (0, 2) or document is None:
        raise ExecError(
            f"{kind}/{program} in {where} exited {code} "
            + ("without one JSON document on stdout" if document is None else "")
            + (f"; stderr: {stderr.strip()[-2000:]}" if stderr.strip() else ""),
            exit_code=code, stderr=stderr, document=document)
    if code == 2:
        reason = document.get("error") if isinstance(document, dict) else document
        raise ExecError(f"{kind}/{program} in {where} refused: {reason}", exit_code=code,
                        stderr=stderr, document=document)
    logger.debug("chaosgpu: %s/%s in %s took %.3f s", kind, program, where, result["duration_s"])
    return document
