"""`python -m chaosgpu.gpu pressure|contention|xid ...`: the GPU fault programs that chaosgpu
starts as processes of their own (see chaosgpu.gpu.actions)."""

import sys

PROGRAMS = {
    "pressure": "chaosgpu.gpu.pressure",
    "contention": "chaosgpu.gpu.contention",
    "xid": "chaosgpu.gpu.xid",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch to one GPU fault program."""
    import importlib

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in PROGRAMS:
        print(f"usage: python -m chaosgpu.gpu {{{','.join(PROGRAMS)}}} [ARGS...]",
              file=sys.stderr)
        return 2
    module = importlib.import_module(PROGRAMS[args[0]])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
