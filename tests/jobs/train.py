"""A small torch.distributed training job written for chaosgpu's verdict tests (gloo, CPU).

It is an ordinary job: chaosgpu knows nothing of it and it knows nothing of chaosgpu. Launched
by torchrun or bare (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), or by
mpirun, whose task numbers it copies into RANK, WORLD_SIZE and LOCAL_RANK itself, inside
Python, as trainers run under MPI or Slurm do. Each step
does `--compute-s` of CPU work and one all_reduce (or a DDP forward/backward with `--ddp`).
The behaviours the tests need are options: stall one rank in Python, fail one rank, save a
checkpoint on one rank after destroy_process_group, delay a restarted rank before it joins.
The ground truth (steps done, per rank) is written to `--progress-dir` for the tests' own
assertions; the observer under test never reads it.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=0, help="0: run until killed")
    parser.add_argument("--compute-s", type=float, default=0.0)
    parser.add_argument("--sleep-s", type=float, default=0.05)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--stall-rank", type=int, default=-1)
    parser.add_argument("--stall-at", type=int, default=5)
    parser.add_argument("--stall-s", type=float, default=60.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-at", type=int, default=5)
    parser.add_argument("--checkpoint-rank", type=int, default=-1)
    parser.add_argument("--checkpoint-s", type=float, default=4.0)
    parser.add_argument("--delay-rank", type=int, default=-1,
                        help="this rank sleeps before init_process_group (never joins)")
    parser.add_argument("--delay-s", type=float, default=300.0)
    parser.add_argument("--ddp-delay-rank", type=int, default=-1,
                        help="with --ddp, this rank sleeps --delay-s after init_process_group, "
                             "before building DDP: its peers wait in DDP's constructor")
    parser.add_argument("--pg-timeout-s", type=float, default=600.0)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--mib", type=int, default=0, help="GPU memory to hold (cuda)")
    parser.add_argument("--gpu-hang-at", type=int, default=-1,
                        help="at this step, queue a GPU kernel that spins for --gpu-hang-s "
                             "before the collective: the rank waits on its GPU, alive")
    parser.add_argument("--gpu-hang-s", type=float, default=600.0)
    parser.add_argument("--loader-workers", type=int, default=0,
                        help="feed each step from a DataLoader with this many worker processes "
                             "(forked: they carry the rank's environment, RANK included)")
    parser.add_argument("--progress-dir", default="")
    parser.add_argument("--master", default="", metavar="ADDR:PORT",
                        help="set MASTER_ADDR/MASTER_PORT in os.environ (a launcher that does "
                             "not export them: outside, only the store's connections show it)")
    return parser.parse_args()


def busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 1.0001
    while time.monotonic() < end:
        for _ in range(10000):
            x = x * 1.0000001 % 7.0


def write_progress(args: argparse.Namespace, rank: int, step: int) -> None:
    if args.progress_dir:
        path = os.path.join(args.progress_dir, f"rank{rank}.json")
        with open(path + ".tmp", "w") as handle:
            json.dump({"step": step, "t": time.time(), "pid": os.getpid(),
                       "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}, handle)
        os.replace(path + ".tmp", path)


def build_ddp(args: argparse.Namespace, rank: int, device: torch.device) -> tuple:
    """A small DDP model on `device`, its optimizer and a batch (DDP's constructor runs
    collectives: parameter shapes verified, module states broadcast)."""
    torch.manual_seed(0)
    if rank == args.ddp_delay_rank:
        time.sleep(args.delay_s)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                 torch.nn.Linear(256, 8)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None)
    return (model, torch.optim.SGD(model.parameters(), lr=0.01),
            torch.randn(32, 64, device=device))


def rank_from_launcher(master: str) -> None:
    """Where no RANK was given, take the MPI launcher's task numbers (set in os.environ: the
    process's environment as /proc shows it keeps only the launcher's variables); `master`
    (ADDR:PORT), when given, sets MASTER_ADDR/MASTER_PORT the same way."""
    if master:
        address, _, port = master.rpartition(":")
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=port)
    for rank, size, local in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                               "OMPI_COMM_WORLD_LOCAL_RANK"),
                              ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")):
        if "RANK" not in os.environ and rank in os.environ:
            os.environ.update(RANK=os.environ[rank], WORLD_SIZE=os.environ[size],
                              LOCAL_RANK=os.environ[local])


@record
def main() -> int:
    args = parse()
    rank_from_launcher(args.master)
    rank = int(os.environ["RANK"])
    if rank == args.delay_rank:
        time.sleep(args.delay_s)  # a rank that never joins: its peers wait in the rendezvous
    from datetime import timedelta

    device = torch.device("cpu")
    init: dict = {"timeout": timedelta(seconds=args.pg_timeout_s)}
    if args.device == "cuda":
        # ranks share the GPUs there are (gloo with CUDA tensors can put two ranks on one GPU)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if args.backend == "nccl":
            init["device_id"] = device
    dist.init_process_group(args.backend, **init)
    world = dist.get_world_size()
    held = torch.empty(args.mib * 2**20, dtype=torch.uint8, device=device) if args.mib else None
    if args.ddp:
        model, optimizer, batch = build_ddp(args, rank, device)
    tensor = torch.ones(4096, device=device)
    batches = None
    if args.loader_workers:
        data = torch.utils.data.TensorDataset(torch.randn(1 << 16, 4))
        batches = iter(torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                                   num_workers=args.loader_workers,
                                                   persistent_workers=True))
    step = 0
    while args.steps == 0 or step < args.steps:
        if batches is not None:
            next(batches)
        if rank == args.stall_rank and step == args.stall_at:
            time.sleep(args.stall_s)  # alive, stalled in Python: its peers wait in all_reduce
        if rank == args.fail_rank and step == args.fail_at:
            raise RuntimeError(f"rank {rank} fails at step {step} (the test asked it to)")
        busy(args.compute_s)
        if args.device == "cuda" and step == args.gpu_hang_at:
            clock = torch.cuda.get_device_properties(device).clock_rate * 1000  # Hz
            torch.cuda._sleep(int(args.gpu_hang_s * clock))  # the GPU stalls, the rank lives
        if args.ddp:
            optimizer.zero_grad()
            loss = model(batch).pow(2).mean()
            loss.backward()
            optimizer.step()
        else:
            dist.all_reduce(tensor)
            if args.device == "cuda":
                float(tensor.sum().item())  # the host waits for the GPU every step
            tensor.fill_(1.0)
        step += 1
        write_progress(args, rank, step)
        time.sleep(args.sleep_s)
    dist.destroy_process_group()
    del held
    if rank == args.checkpoint_rank:
        end = time.monotonic() + args.checkpoint_s
        path = os.path.join(args.progress_dir or "/tmp", f"checkpoint-{os.getpid()}.pt")
        while time.monotonic() < end:  # a long checkpoint save after the others have exited
            torch.save({"weights": torch.randn(256, 256), "step": step}, path)
        os.unlink(path)
    print(f"rank {rank}/{world} done after {step} steps", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
