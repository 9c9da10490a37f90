"""Shared by the benches: describe the machine and write a results file (command, date, machine,
output) under bench/results/. Owns nothing else."""

import datetime
import os
import platform
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    """One line naming the machine: kernel, CPU count, Python, torch and GPU when present."""
    parts = [platform.platform(), f"{os.cpu_count()} CPUs", f"Python {platform.python_version()}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
    except ImportError:
        parts.append("no torch")
    try:
        from chaosgpu.node import nvml_snapshot

        gpu = nvml_snapshot(with_processes=False)
        parts.append(", ".join(d.get("name") or "?" for d in gpu.get("devices") or [])
                     if gpu.get("available") else "no GPU (NVML unavailable)")
    except Exception as error:  # the bench still runs without chaosgpu.node working
        parts.append(f"GPU unknown ({error})")
    return "; ".join(parts)


def write(name: str, output: str) -> Path:
    """Write bench/results/<name>-<date>.txt and return its path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    path = RESULTS / f"{name}-{now:%Y-%m-%d}.txt"
    header = (f"command: {' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}\n"
              f"date: {now:%Y-%m-%dT%H:%M:%SZ}\nmachine: {machine()}\n\n")
    path.write_text(header + output, encoding="utf-8")
    return path
