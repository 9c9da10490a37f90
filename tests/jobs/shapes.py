"""Training-job shapes for chaosgpu's verdict tests, written as ML teams write them (gloo, CPU).

An ordinary job: chaosgpu knows nothing of it. Launched by torchrun. `--shape`:

* ``retry``: each all_reduce runs in a retry loop (a short process-group timeout; a failed
  attempt is logged and retried after a pause), as a job that rides out a flaky peer does.
* ``loader``: each step's batch comes from a DataLoader whose worker computes for
  `--slow-s` on rank 1 (a heavy augmentation): rank 1 waits for its worker, rank 0 in all_reduce.
* ``dcp``: torch.distributed.checkpoint saves every 5 steps; rank 1 sleeps before the save at
  step 15 (its peer waits inside DCP's collectives).
* ``fsdp2``: a model sharded with fully_shard (FSDP2), forward, backward, step.

Each rank writes `ready` into `--dir` (rank 0 after 10 steps) and its steps into rank<N>.json.
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from train import busy  # tests/jobs/train.py: the same CPU work per step


class Slow(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        busy(self.seconds)
        return torch.ones(4)


def reduce_with_retry(tensor: torch.Tensor, rank: int) -> None:
    attempt = 0
    while True:
        try:
            dist.all_reduce(tensor)
            return
        except RuntimeError as error:
            attempt += 1
            print(f"rank {rank} all_reduce attempt {attempt} failed: {str(error)[:100]}",
                  file=sys.stderr, flush=True)
            time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True,
                        choices=("retry", "loader", "dcp", "fsdp2"))
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--slow-s", type=float, default=6.0)
    args = parser.parse_args()
    timeout = datetime.timedelta(seconds=2 if args.shape == "retry" else 600)
    dist.init_process_group("gloo", timeout=timeout)
    rank = dist.get_rank()
    tensor = torch.ones(1024)
    batches = None
    if args.shape == "loader":
        loader = torch.utils.data.DataLoader(Slow(args.slow_s if rank == 1 else 0.01),
                                             batch_size=1, num_workers=1)
        batches = iter(loader)
    if args.shape in ("dcp", "fsdp2"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(3)])
        if args.shape == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                fully_shard(layer)
            fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch = torch.randn(16, 128)
    step = 0
    while args.steps == 0 or step < args.steps:
        if batches is not None:
            next(batches)
        if args.shape == "retry":
            reduce_with_retry(tensor, rank)
        elif args.shape in ("dcp", "fsdp2"):
            optimizer.zero_grad()
            model(batch).pow(2).mean().backward()
            if args.shape == "dcp":
                for param in model.parameters():
                    dist.all_reduce(param.grad)
            optimizer.step()
        else:
            dist.all_reduce(tensor)
        tensor.fill_(1.0)
        step += 1
        with open(os.path.join(args.dir, f"rank{rank}.json"), "w") as handle:
            json.dump({"step": step, "t": time.time()}, handle)
        if step == 10 and rank == 0:
            open(os.path.join(args.dir, "ready"), "w").close()
        if args.shape == "dcp" and step % 5 == 0:
            if rank == 1 and step == 15:
                time.sleep(600)  # late for the save: its peer waits inside DCP
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": model.state_dict()},
                     checkpoint_id=os.path.join(args.dir, f"checkpoint-{step}"))
        time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
