"""A training-like job for the injector tests, started by torchrun: gloo all_reduce of CPU
tensors plus a small matmul per step, a step counter in <dir>/rank<R>.progress, and the names of
its threads at start in <dir>/rank<R>.threads. It knows nothing of chaosgpu. It stops by itself
after --seconds so a lost test never leaves it running for long."""

import argparse
import datetime
import json
import os
import threading
import time

import torch
import torch.distributed as dist


def _write(path: str, document: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(document, handle)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    _write(os.path.join(args.dir, f"rank{rank}.threads"),
           {"threads": [t.name for t in threading.enumerate()], "pid": os.getpid()})
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    tensor = torch.ones(16)
    left, right = torch.rand(32, 32), torch.rand(32, 32)
    deadline = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < deadline:
        float((left @ right)[0, 0])
        dist.all_reduce(tensor)
        tensor.fill_(1.0)
        step += 1
        _write(os.path.join(args.dir, f"rank{rank}.progress"),
               {"iteration": step, "t": time.time(), "pid": os.getpid()})
        time.sleep(0.02)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
