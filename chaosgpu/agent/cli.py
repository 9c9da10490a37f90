"""`chaosgpu agent`: serve this node's census and timeline over HTTP (see docs/agent.md).

This module owns the command line: arguments, the bind and token rules, starting and stopping
the server. The server itself is `chaosgpu.agent.server`.

Rules: loopback by default; a non-loopback address needs `--allow-remote` AND a token given by
`--token-file` or `CHAOSGPU_AGENT_TOKEN`. Every endpoint but /healthz needs the token; without
one given (loopback only) a random token is generated and written, mode 0600, to
`<state dir>/agent/token` (its path is printed), locked for the agent's life, so that a second
agent of the same state dir is refused rather than overwrite the token the first one serves.
Numbers are checked by `chaosgpu.arguments.option` (nan, inf and out-of-range values are usage
errors, exit 2) and `--ready-file` before listening. SIGTERM/SIGINT stop the agent cleanly;
`--max-seconds` bounds a run (tests, benchmarks).
"""

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import IO, Any

from chaosgpu.arguments import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE_SECONDS,
    SECONDS,
    option,
)

__all__ = ["main", "resolve_token"]

DEFAULT_LISTEN = "127.0.0.1:9464"
TOKEN_ENV = "CHAOSGPU_AGENT_TOKEN"


class UsageError(ValueError):
    """A bad argument: printed, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaosgpu agent",
        description="Serve this node's truth (census), a high-rate GPU memory timeline and "
        "Prometheus metrics over HTTP, with bearer-token authentication.")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"address to bind (default {DEFAULT_LISTEN}; port 0 = any free)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback address (needs --token-file or "
                        f"${TOKEN_ENV})")
    parser.add_argument("--token-file", metavar="FILE",
                        help=f"file holding the bearer token (else ${TOKEN_ENV}, else a "
                        "generated one, loopback only)")
    parser.add_argument("--rate-hz", type=option(NON_NEGATIVE), default=100.0,
                        help="timeline sampling rate (default 100; 0 = no timeline; at most "
                        "5000)")
    parser.add_argument("--process-every", type=option(COUNT, int), default=5,
                        help="list GPU processes every N samples (default 5)")
    parser.add_argument("--retention-s", type=option(POSITIVE_SECONDS), default=600.0,
                        help="seconds of timeline kept in memory (default 600)")
    parser.add_argument("--census-ttl", type=option(SECONDS), default=1.0,
                        help="reuse a census for this many seconds (default 1.0; 0 = a new "
                        "census per request)")
    parser.add_argument("--no-fds", action="store_true",
                        help="skip the /proc/PID/fd scan in the census (faster, no nvidia_fds)")
    parser.add_argument("--max-inflight", type=option(COUNT, int), default=32,
                        help="requests answered at once; more get 503 + Retry-After "
                        "(default 32, at most 10000; /healthz is never refused)")
    parser.add_argument("--jobs-every", type=option(SECONDS), default=1.0,
                        help="observe the training jobs' verdicts every S seconds (default 1; "
                        "0 = no job verdicts)")
    parser.add_argument("--job-window", type=option(POSITIVE_SECONDS), default=None,
                        help="seconds without progress before a job is called hung (default "
                        "chaosgpu.job's, 3)")
    parser.add_argument("--max-seconds", type=option(POSITIVE_SECONDS), default=None,
                        help="stop after this many seconds (tests, benchmarks)")
    parser.add_argument("--ready-file", metavar="FILE",
                        help="write {url, token_file, pid} as JSON here once listening")
    return parser


def resolve_token(token_file: str | None,
                  remote: bool) -> tuple[str, str | None, IO[str] | None]:
    """Return (token, path of a generated token file or None, the open generated file or None);
    UsageError when unusable.

    A generated token file is locked (flock) for as long as the returned file stays open, i.e.
    the agent's life: a second agent of the same state dir is refused instead of overwriting
    the token the first one serves (the kernel drops the lock when its holder exits, however it
    exits, so a stale file from a dead agent is simply reused)."""
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise UsageError(f"--token-file {token_file!r}: {error.strerror or error}") from None
        except UnicodeDecodeError:
            raise UsageError(f"--token-file {token_file!r} is not UTF-8 text") from None
        if not token:
            raise UsageError(f"--token-file {token_file!r} is empty")
        mode = os.stat(token_file).st_mode
        if mode & 0o077:
            print(f"chaosgpu agent: warning: --token-file {token_file!r} is readable by other "
                  f"users (mode {mode & 0o777:o}); chmod 600 it", file=sys.stderr)
        return token, None, None
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token, None, None
    if remote:
        raise UsageError("a non-loopback address needs a token: --token-file FILE or "
                         f"${TOKEN_ENV}")
    from chaosgpu.state import state_dir

    folder = state_dir() / "agent"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / "token"
    handle = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o600), "r+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UsageError(f"another agent is running with the generated token {path}; stop it, "
                         f"or give this one its own token (--token-file FILE or ${TOKEN_ENV}) "
                         "or its own CHAOSGPU_STATE_DIR") from None
    token = secrets.token_urlsafe(32)
    handle.truncate(0)
    handle.write(token + "\n")
    handle.flush()
    os.chmod(path, 0o600)
    return token, str(path), handle


def _check_ready_file(path: str) -> None:
    """UsageError unless `path` can be written (its folder exists and is writable) before the
    agent listens, so that a bad --ready-file changes nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"--ready-file {path!r} is a directory; give a file path")
    if not os.path.isdir(folder):
        raise UsageError(f"--ready-file {path!r}: its directory {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--ready-file {path!r}: its directory {folder} is not writable")


def _write_ready_file(path: str, document: dict[str, Any]) -> None:
    """Write `document` as JSON to `path` at once (a temporary file renamed over it), so a
    reader never sees half of it; OSError when it cannot (nothing left behind)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(json.dumps(document))
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _check(args: Any) -> tuple[str, int]:
    from chaosgpu.agent.server import is_loopback, parse_listen

    try:
        host, port = parse_listen(args.listen)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not is_loopback(host) and not args.allow_remote:
        raise UsageError(f"--listen {args.listen}: not a loopback address; pass --allow-remote "
                         "(with a token) to serve other machines")
    # the types refuse nan, inf and numbers out of their rule (seconds above LONGEST_WAIT_S
    # too); what is left is the ranges
    if not (args.rate_hz == 0 or 1 <= args.rate_hz <= 5000):
        raise UsageError(f"--rate-hz must be 0 or between 1 and 5000, got {args.rate_hz:g}")
    if args.max_inflight > 10_000:
        raise UsageError(f"--max-inflight must be between 1 and 10000, got {args.max_inflight}")
    if args.ready_file:
        _check_ready_file(args.ready_file)
    return host, port


def _server(args: Any, host: str, port: int, token: str) -> Any:
    """The AgentServer the arguments ask for (not started)."""
    from chaosgpu.agent.server import (
        AgentConfig,
        AgentServer,
        CensusCache,
        JobWatch,
        TimelineWindow,
    )

    census = CensusCache(ttl_s=args.census_ttl,
                         census_kwargs={"fds": not args.no_fds, "cache": True})
    timeline = None
    if args.rate_hz:
        timeline = TimelineWindow(rate_hz=args.rate_hz, process_every=args.process_every,
                                  retention_s=args.retention_s)
        census.listeners.append(timeline.remember)
    jobs = None
    if args.jobs_every:
        window = {} if args.job_window is None else {"window_s": args.job_window}
        jobs = JobWatch(lambda: census.get_blocking(), every_s=args.jobs_every, **window)
    return AgentServer(host, port, AgentConfig(token, census, timeline, jobs=jobs,
                                               max_inflight=args.max_inflight))


def main(argv: list[str] | None = None) -> int:
    """Run `chaosgpu agent`; return the exit code (2: bad usage, 1: could not serve)."""
    args = _parser().parse_args(argv)
    try:
        host, port = _check(args)
        from chaosgpu.agent.server import is_loopback

        token, generated, token_lock = resolve_token(args.token_file,
                                                     remote=not is_loopback(host))
    except UsageError as error:
        print(f"chaosgpu agent: {error}", file=sys.stderr)
        return 2
    try:
        return _serve(args, host, port, token, generated)
    finally:
        if token_lock is not None:
            token_lock.close()


def _serve(args: Any, host: str, port: int, token: str, generated: str | None) -> int:
    """Listen, write the ready file, serve until a signal or --max-seconds; the exit code."""
    server = _server(args, host, port, token)
    try:
        server.start()
    except OSError as error:
        server.stop()
        return _give_up(generated, f"cannot listen on {args.listen}: {error.strerror or error}")
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    failure = None
    try:
        if args.ready_file:
            try:
                _write_ready_file(args.ready_file, {"url": server.url, "token_file": generated,
                                                    "pid": os.getpid()})
            except OSError as error:
                failure = (f"cannot write --ready-file {args.ready_file!r}: "
                           f"{error.strerror or error}; stopped")
        if failure is None:
            timeline = server.config.timeline
            sampling = ("off" if timeline is None
                        else f"{args.rate_hz:g} Hz, {timeline.sampler.source}")
            jobs = "off" if server.config.jobs is None else f"every {args.jobs_every:g} s"
            print(f"chaosgpu agent: listening on {server.url} (timeline {sampling}, census TTL "
                  f"{args.census_ttl:g} s, job verdicts {jobs})"
                  + (f"; token written to {generated}" if generated else ""), flush=True)
            stop.wait(args.max_seconds)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        return _give_up(generated, failure)
    print("chaosgpu agent: stopped", flush=True)
    return 0


def _give_up(generated: str | None, message: str) -> int:
    """Remove the token file generated for a server that stopped at once, say why; 1."""
    if generated:  # ours alone (we hold its lock) and of no use to anyone now
        with contextlib.suppress(OSError):
            os.unlink(generated)
    print(f"chaosgpu agent: {message}", file=sys.stderr)
    return 1
