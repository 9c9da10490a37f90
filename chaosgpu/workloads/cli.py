"""`chaosgpu workload hold|ring ...` and `python -m chaosgpu.workloads hold|ring ...`.

This module owns only the dispatch to the workloads; `rank` (one rank of a ring) is internal and
used by the ring launcher and torchrun.
"""

import sys

__all__ = ["main"]

USAGE = """usage: chaosgpu workload {hold,ring} [ARGS...]

  hold   take N MiB of GPU (or host) memory and keep it; SIGTERM: ignore, exit or cleanup
  ring   a distributed job doing all_reduce in a loop (nccl or gloo; bare ranks or torchrun)

`chaosgpu workload hold --help` and `chaosgpu workload ring --help` describe the options.
The tag (--tag) sets CHAOSGPU_TAG in the workload's own environment, so chaosgpu finds it."""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to `hold`, `ring` or the internal `rank`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = args[0], args[1:]
    if name == "hold":
        from chaosgpu.workloads.hold import main as hold_main

        return hold_main(rest)
    if name == "ring":
        from chaosgpu.workloads.ring import main as ring_main

        return ring_main(rest)
    if name == "rank":
        from chaosgpu.workloads.ring import rank_main

        return rank_main(rest)
    print(f"chaosgpu workload: unknown workload {name!r}\n\n{USAGE}", file=sys.stderr)
    return 2
