"""`chaosgpu agent`: serve this node's census and timeline over HTTP (see docs/agent.md).

This module owns the command line: arguments, the bind and token rules, starting and stopping
the server. The server itself is `chaosgpu.agent.server`.

Rules: loopback by default; a non-loopback address needs `--allow-remote` AND a token given by
`--token-file` or `CHAOSGPU_AGENT_TOKEN`. Every endpoint but /healthz needs the token; without
one given (loopback only) a random token is generated and written, mode 0600, to
`<state dir>/agent/token` (its path is printed). SIGTERM/SIGINT stop the agent cleanly;
`--max-seconds` bounds a run (tests, benchmarks).
"""

import argparse
import json
import os
import secrets
import signal
import sys
import threading
from pathlib import Path
from typing import Any

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
    parser.add_argument("--rate-hz", type=float, default=100.0,
                        help="timeline sampling rate (default 100; 0 = no timeline)")
    parser.add_argument("--process-every", type=int, default=5,
                        help="list GPU processes every N samples (default 5)")
    parser.add_argument("--retention-s", type=float, default=600.0,
                        help="seconds of timeline kept in memory (default 600)")
    parser.add_argument("--census-ttl", type=float, default=1.0,
                        help="reuse a census for this many seconds (default 1.0; 0 = a new "
                        "census per request)")
    parser.add_argument("--no-fds", action="store_true",
                        help="skip the /proc/PID/fd scan in the census (faster, no nvidia_fds)")
    parser.add_argument("--max-inflight", type=int, default=32,
                        help="requests answered at once; more get 503 + Retry-After "
                        "(default 32; /healthz is never refused)")
    parser.add_argument("--jobs-every", type=float, default=1.0,
                        help="observe the training jobs' verdicts every S seconds (default 1; "
                        "0 = no job verdicts)")
    parser.add_argument("--job-window", type=float, default=None,
                        help="seconds without progress before a job is called hung (default "
                        "chaosgpu.job's, 3)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop after this many seconds (tests, benchmarks)")
    parser.add_argument("--ready-file", metavar="FILE",
                        help="write {url, token_file, pid} as JSON here once listening")
    return parser


def resolve_token(token_file: str | None, remote: bool) -> tuple[str, str | None]:
    """Return (token, path of a generated token file or None); UsageError when unusable."""
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as error:
            raise UsageError(f"--token-file {token_file!r}: {error.strerror or error}") from None
        if not token:
            raise UsageError(f"--token-file {token_file!r} is empty")
        mode = os.stat(token_file).st_mode
        if mode & 0o077:
            print(f"chaosgpu agent: warning: --token-file {token_file!r} is readable by other "
                  f"users (mode {mode & 0o777:o}); chmod 600 it", file=sys.stderr)
        return token, None
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token, None
    if remote:
        raise UsageError("a non-loopback address needs a token: --token-file FILE or "
                         f"${TOKEN_ENV}")
    from chaosgpu.state import state_dir

    folder = state_dir() / "agent"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / "token"
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    os.chmod(path, 0o600)
    return token, str(path)


def _check(args: Any) -> tuple[str, int]:
    from chaosgpu.agent.server import is_loopback, parse_listen

    try:
        host, port = parse_listen(args.listen)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if not is_loopback(host) and not args.allow_remote:
        raise UsageError(f"--listen {args.listen}: not a loopback address; pass --allow-remote "
                         "(with a token) to serve other machines")
    if not (args.rate_hz == 0 or 1 <= args.rate_hz <= 5000):
        raise UsageError(f"--rate-hz must be 0 or between 1 and 5000, got {args.rate_hz}")
    if args.process_every < 1:
        raise UsageError(f"--process-every must be >= 1, got {args.process_every}")
    if args.retention_s <= 0:
        raise UsageError(f"--retention-s must be > 0, got {args.retention_s}")
    if args.census_ttl < 0:
        raise UsageError(f"--census-ttl must be >= 0, got {args.census_ttl}")
    if not 1 <= args.max_inflight <= 10_000:
        raise UsageError(f"--max-inflight must be between 1 and 10000, got {args.max_inflight}")
    if args.jobs_every < 0:
        raise UsageError(f"--jobs-every must be >= 0, got {args.jobs_every}")
    if args.job_window is not None and args.job_window <= 0:
        raise UsageError(f"--job-window must be > 0, got {args.job_window}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise UsageError(f"--max-seconds must be > 0, got {args.max_seconds}")
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
    """Run `chaosgpu agent`; return the exit code."""
    args = _parser().parse_args(argv)
    try:
        host, port = _check(args)
        from chaosgpu.agent.server import is_loopback

        token, generated = resolve_token(args.token_file, remote=not is_loopback(host))
    except UsageError as error:
        print(f"chaosgpu agent: {error}", file=sys.stderr)
        return 2

    from chaosgpu.agent.server import AgentServer

    server = _server(args, host, port, token)
    try:
        server.start()
    except OSError as error:
        server.stop()
        print(f"chaosgpu agent: cannot listen on {args.listen}: {error.strerror or error}",
              file=sys.stderr)
        return 1
    assert isinstance(server, AgentServer)
    stop = threading.Event()

    def _stop(signum: int, frame: Any) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    timeline = server.config.timeline
    print(f"chaosgpu agent: listening on {server.url} (timeline "
          f"{'off' if timeline is None else f'{args.rate_hz:g} Hz, {timeline.sampler.source}'}"
          f", census TTL {args.census_ttl:g} s, job verdicts "
          f"{'off' if server.config.jobs is None else f'every {args.jobs_every:g} s'})"
          + (f"; token written to {generated}" if generated else ""), flush=True)
    if args.ready_file:
        Path(args.ready_file).write_text(json.dumps(
            {"url": server.url, "token_file": generated, "pid": os.getpid()}), encoding="utf-8")
    try:
        stop.wait(args.max_seconds)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("chaosgpu agent: stopped", flush=True)
    return 0
