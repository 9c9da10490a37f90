"""A trainer that supervises itself (an auto-resume pattern): `self_supervised.py --mode MODE
SCRIPT ARGS...`, started by torchrun. The process torchrun starts imports no torch and runs the
training in a child, restarting it when it fails: `--mode rerun` runs its own command line
again, exactly (SUPERVISED=1 in the child's environment), `--mode spawn` runs it in a
spawn-context multiprocessing child (which starts multiprocessing's resource tracker beside
it). The child runs SCRIPT (tests/jobs/train.py) with ARGS."""

import os
import runpy
import subprocess
import sys
from pathlib import Path


def train(argv: list[str]) -> None:
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    runpy.run_path(argv[0], run_name="__main__")


def main() -> int:
    mode, argv = sys.argv[2], sys.argv[3:]
    if mode == "rerun":
        if os.environ.get("SUPERVISED"):
            train(argv)
            return 0
        status = 1
        for _ in range(3):
            status = subprocess.call(getattr(sys, "orig_argv", None)
                                     or [sys.executable, *sys.argv],
                                     env=dict(os.environ, SUPERVISED="1"))
            if status == 0:
                break
        return status
    import multiprocessing

    status = 1
    for _ in range(3):
        child = multiprocessing.get_context("spawn").Process(target=train, args=(argv,))
        child.start()
        child.join()
        status = child.exitcode or 0
        if status == 0:
            break
    return status


if __name__ == "__main__":
    sys.exit(main())
