"""`chaosgpu sandbox create|exec|terminate|rm|ls|ps ...`: local pods from the command line.

This module owns only argument parsing and JSON output; the work is chaosgpu.sandbox.runtime's.
Exit codes: 0 done, 1 the operation failed (message on stderr), 2 bad arguments.
"""

import argparse
import json
import sys
from typing import Any

from chaosgpu.arguments import ID, POSITIVE_SECONDS, SECONDS, option
from chaosgpu.sandbox import runtime

__all__ = ["main"]

_id = option(ID, int)


def _user(text: str) -> int | str:
    """The argparse type of `--user`: a user id, or "uid:gid" (each an id in range)."""
    if ":" in text:
        uid, gid = text.split(":", 1)
        return f"{_id(uid)}:{_id(gid)}"
    return int(_id(text))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chaosgpu sandbox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser(
        "create", help="create a local pod (PID + mount namespace); [-- COMMAND] for its init",
        usage="chaosgpu sandbox create [options] NAME [-- COMMAND [ARG ...]]",
        description="Create a local pod: a PID and mount namespace whose PID 1 is --init: "
                    "sleep (`sleep infinity`, which never reaps; takes no COMMAND), tini or "
                    "dumb-init (COMMAND as their child, default `sleep infinity`), or none "
                    "(COMMAND itself is PID 1; required).")
    create.add_argument("name")
    create.add_argument("--init", choices=runtime.INITS, default="sleep",
                        help="the pod's PID 1 (default sleep: it never reaps)")
    create.add_argument("--uid", type=_id, help="run the pod as this user id")
    create.add_argument("--gid", type=_id, help="and this group id (default: the uid)")
    create.add_argument("--grace", type=option(SECONDS), default=30.0,
                        help="grace period, seconds")
    create.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    run = sub.add_parser("exec", help="run `-- COMMAND` inside a pod (attached or --detach)",
                         usage="chaosgpu sandbox exec [options] NAME -- COMMAND [ARG ...]")
    run.add_argument("name")
    run.add_argument("--detach", action="store_true", help="background it (orphan of PID 1)")
    run.add_argument("--user", type=_user, help="uid or uid:gid (default: the pod's user)")
    run.add_argument("--timeout", type=option(POSITIVE_SECONDS), default=60.0)
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    term = sub.add_parser("terminate", help="SIGTERM, grace period, SIGKILL (like the kubelet)")
    term.add_argument("name")
    term.add_argument("--grace", type=option(SECONDS), help="default: the pod's grace period")
    term.add_argument("--deadline", type=option(POSITIVE_SECONDS), default=10.0)
    rm = sub.add_parser("rm", help="remove a pod (kill it if alive); idempotent")
    rm.add_argument("names", nargs="*")
    rm.add_argument("--all", action="store_true")
    sub.add_parser("ls", help="list pods (alive, abandoned)")
    ps = sub.add_parser("ps", help="processes of a pod")
    ps.add_argument("name")
    return parser


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--env wants KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        env[key] = value
    return env


def _run(args: argparse.Namespace) -> Any:
    if args.command == "create":
        return runtime.create(
            args.name, init=args.init, argv=args.argv or None, uid=args.uid, gid=args.gid,
            env=_env(args.env), grace_s=args.grace,
        )  # fmt: skip
    if args.command == "exec":
        result = runtime.exec_in(
            args.name, args.argv, detached=args.detach, user=args.user, env=_env(args.env),
            timeout_s=args.timeout,
        )  # fmt: skip
        if not args.detach:
            sys.stdout.write(result["stdout"])
            sys.stderr.write(result["stderr"])
            return int(result["rc"])
        return result
    if args.command == "terminate":
        return runtime.terminate(args.name, grace_s=args.grace, deadline_s=args.deadline)
    if args.command == "rm":
        if args.all:
            return runtime.cleanup_all()
        if not args.names:
            raise ValueError("rm needs sandbox names or --all")
        return [runtime.remove(name) for name in args.names]
    if args.command == "ls":
        return [
            {k: s.get(k) for k in ("name", "alive", "abandoned", "init", "uid", "pid1",
                                   "pid_ns", "grace_s", "created_at", "state")}
            for s in runtime.list_sandboxes()
        ]  # fmt: skip
    if args.command == "ps":
        return runtime.processes(args.name)
    raise ValueError(f"unknown command {args.command!r}")


def main(argv: list[str] | None = None) -> int:
    """Run `chaosgpu sandbox ...` and return its exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in words:  # everything after `--` is the command to run in the pod
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1 :]
    try:
        args = _parser().parse_args(words)
    except SystemExit as stop:
        return int(stop.code or 0)
    args.argv = command
    try:
        result = _run(args)
    except (ValueError, runtime.SandboxError, FileNotFoundError) as error:
        print(f"chaosgpu sandbox {args.command}: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    if isinstance(result, int):
        return result
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0
