"""A torch.multiprocessing.spawn job with a file:// rendezvous whose main process exports
MASTER_ADDR/MASTER_PORT (for other tooling) before it starts the ranks, and, once they train,
starts another spawn-context child: an evaluator that imports torch and idles (an async
evaluation or checkpoint uploader). Each rank prints "rank R pid P step N"; the main process
prints "evaluator pid P". Arguments: PORT STORE_FILE."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    tensor = torch.ones(4)
    step = 0
    while True:
        dist.all_reduce(tensor)
        tensor.fill_(1)
        step += 1
        print(f"rank {rank} pid {os.getpid()} step {step}", flush=True)
        time.sleep(0.2)


def evaluator() -> None:
    while True:
        time.sleep(1)


def main() -> None:
    port, store = sys.argv[1], sys.argv[2]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    context = mp.start_processes(worker, args=(2, store), nprocs=2, join=False,
                                 start_method="spawn")
    time.sleep(3)
    child = mp.get_context("spawn").Process(target=evaluator, daemon=True)
    child.start()
    print(f"evaluator pid {child.pid}", flush=True)
    while not context.join():
        pass


if __name__ == "__main__":
    main()
