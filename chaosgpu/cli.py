"""The `chaosgpu` command. This module owns only the dispatch to sub-commands; each sub-command
lives with the part of chaosgpu it belongs to and exposes `main(argv) -> int`.
"""

import sys

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, tuple[str, str]] = {
    "snapshot": ("chaosgpu.node.cli",
                 "the node's truth: GPUs, GPU processes, zombies, orphans, jobs"),
    "jobs": ("chaosgpu.job.cli",
             "training jobs and their observed verdicts (running, hung, failed ...)"),
    "workload": ("chaosgpu.workloads.cli", "run a reference workload (hold, ring)"),
    "sandbox": ("chaosgpu.sandbox.cli", "create, exec into, terminate and list local pods"),
    "cleanup": ("chaosgpu.cleanup", "remove every sandbox and workload chaosgpu left behind"),
    "agent": ("chaosgpu.agent.cli", "serve the node's truth and the timeline over HTTP"),
    "validate": ("chaosgpu.validation",
                 "validate an experiment: chaoslib's checks, and every ${name} must resolve"),
    "report": ("chaosgpu.report.cli", "build the game-day report (HTML + Markdown) from journals"),
}


def _usage() -> str:
    lines = ["usage: chaosgpu COMMAND [ARGS...]", "", "commands:"]
    width = max(len(name) for name in COMMANDS)
    for name, (_, summary) in COMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {summary}")
    lines.append("")
    lines.append("`chaosgpu COMMAND --help` (or `chaosgpu help COMMAND`) describes a command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the `chaosgpu` command line and return its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["help"] and len(args) > 1:  # `chaosgpu help COMMAND`: COMMAND --help
        args = [args[1], "--help"]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] == "--version":
        from chaosgpu import __version__

        print(f"chaosgpu {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"chaosgpu: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    __import__(COMMANDS[name][0])  # not importlib: its import brings warnings (~1 ms a start)
    module = sys.modules[COMMANDS[name][0]]
    if argv is None and name == "snapshot":  # the program itself: nothing to free once written
        return int(module.main(rest, exit_when_written=True) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
