"""A PyTorch Lightning DDP job on the CPU, written the way Lightning's documentation writes one:
`Trainer(strategy="ddp", devices=2)` in a plain script. Lightning's own launcher makes the main
process rank 0 (it sets MASTER_ADDR, MASTER_PORT, LOCAL_RANK ... in os.environ, invisible
from outside) and starts the script again for ranks 1..N-1 with LOCAL_RANK and NODE_RANK in
their environment, never RANK. Each rank reads its batches from a DataLoader with a worker
process. It knows nothing of chaosgpu; it prints "rank R step N" per step (the ground truth).

    python lightning_ddp.py [--devices 2] [--steps 0]
"""

import argparse
import sys
import time

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        self.step_count = 0

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        inputs, targets = batch
        self.step_count += 1
        print(f"rank {self.global_rank} step {self.step_count}", flush=True)
        time.sleep(0.05)
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=-1, help="-1: until killed")
    args = parser.parse_args()
    data = TensorDataset(torch.randn(1 << 14, 16), torch.randn(1 << 14, 1))
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=args.devices,
                        max_steps=args.steps, max_epochs=-1, enable_progress_bar=False,
                        logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(data, batch_size=32, num_workers=1,
                                         persistent_workers=True))


if __name__ == "__main__":
    sys.exit(main())
