"""A tiny gloo all_reduce loop for the census job tests (started by torchrun). It stops by
itself after --seconds so a lost test never leaves it running for long."""

import argparse
import datetime
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    tensor = torch.ones(4)
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        dist.all_reduce(tensor)
        tensor.fill_(1.0)
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
