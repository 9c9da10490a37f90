"""A DistributedDataParallel job shaped like PyTorch's own DDP tutorial, for the verdict tests:
the ranks are started with torch.multiprocessing.spawn, which passes each its rank as an
argument (no RANK in any environment); each rank reads its batches from a DataLoader with
worker processes. Where the rendezvous is named (`--rendezvous`):

* `parent-env` (default): the main process sets MASTER_ADDR/MASTER_PORT in os.environ before
  spawning, so the ranks' environment names the job;
* `rank-env`: each rank sets them in os.environ itself before init_process_group, as the DDP
  tutorial's setup() does: no process's environment (/proc/PID/environ) shows them;
* `tcp`: init_process_group(init_method="tcp://127.0.0.1:PORT"): no variable at all;
* `file`: init_process_group(init_method="file://PATH") (`--store-file PATH`): no variable and
  no store served by any rank (PORT is not used).

It knows nothing of chaosgpu. It prints one line per step to stdout ("rank R step N"), the
ground truth for the tests' own assertions.

    python spawn_ddp.py PORT [--world-size 2] [--loader-workers 2] [--steps 0] [--device cuda]
                             [--rendezvous parent-env|rank-env|tcp|file] [--store-file PATH]
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def train(rank: int, world_size: int, loader_workers: int, steps: int, device: str,
          port: str, rendezvous: str, store_file: str) -> None:
    if rendezvous == "file":
        dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank,
                                world_size=world_size)
    elif rendezvous == "tcp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
    else:
        if rendezvous == "rank-env":
            os.environ["MASTER_ADDR"] = "127.0.0.1"
            os.environ["MASTER_PORT"] = port
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(),
                                                  nn.Linear(64, 1)).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(1 << 14, 16), torch.randn(1 << 14, 1))
    loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=loader_workers,
                        persistent_workers=loader_workers > 0)
    step = 0
    while steps == 0 or step < steps:
        for inputs, targets in loader:
            optimizer.zero_grad()
            inputs, targets = inputs.to(device), targets.to(device)
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            step += 1
            print(f"rank {rank} step {step}", flush=True)
            time.sleep(0.05)
            if steps and step >= steps:
                break
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="0: until killed")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on GPU 0)")
    parser.add_argument("--rendezvous", choices=("parent-env", "rank-env", "tcp", "file"),
                        default="parent-env")
    parser.add_argument("--store-file", default=os.path.abspath("spawn-ddp.store"),
                        help="the file of a file:// rendezvous (absolute; it must not exist)")
    args = parser.parse_args()
    if args.rendezvous == "parent-env":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = args.port
    mp.spawn(train, args=(args.world_size, args.loader_workers, args.steps, args.device,
                          args.port, args.rendezvous, args.store_file),
             nprocs=args.world_size, join=True)


if __name__ == "__main__":
    sys.exit(main())
