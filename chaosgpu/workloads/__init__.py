"""chaosgpu.workloads: the reference workloads that reproduce the field report's workers.

- `hold` (chaosgpu.workloads.hold): take N MiB of GPU memory (torch, or the CUDA driver API with
  ctypes) or host memory, with a chosen SIGTERM behaviour and a readiness file.
- `ring` (chaosgpu.workloads.ring): ranks doing all_reduce (nccl or gloo), bare or via torchrun.
- `readiness`: the readiness files and how to wait on them without sleeping blindly.
- `actions`: Chaos Toolkit actions that start and stop them, detached from the runner.

Run them with `python -m chaosgpu.workloads hold|ring ...` or `chaosgpu workload hold|ring ...`.
This package must not import torch at import time (only the workloads themselves do).
"""
