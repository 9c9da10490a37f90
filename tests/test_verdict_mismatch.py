"""Ranks that wait in different collectives (a mismatch: rank 0 in all_reduce, rank 1 in
broadcast) are said so in the hang's reason, each with its place, not summed up under the
strongest site (before: "ranks [0, 1] wait in collective all_reduce" while rank 1 waited in
broadcast; outside trial).

Real processes: two bare gloo ranks (RANK/WORLD_SIZE/MASTER_* in their environment) running a
script written here; removed afterwards (the `jobs` fixture)."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, free_port  # noqa: E402

from chaosgpu.job import probes  # noqa: E402

pytestmark = pytest.mark.slow

MISMATCH = """
import os, time, datetime
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
rank = dist.get_rank()
t = torch.ones(8)
for step in range(3):
    dist.all_reduce(t)
print("mismatch now", flush=True)
if rank == 0:
    dist.all_reduce(t)
else:
    dist.broadcast(t, src=0)
"""


def test_ranks_in_different_collectives_are_each_named(tmp_path: Path,
                                                      jobs: list[Job]) -> None:
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    tag, port = f"verdict-{uuid.uuid4().hex[:8]}", free_port()
    job = Job(f"127.0.0.1:{port}", tag, tmp_path, world_size=2)
    jobs.append(job)
    for rank in (0, 1):
        env = dict(os.environ, CHAOSGPU_TAG=tag, RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        with open(tmp_path / f"rank{rank}.log", "wb") as log:
            job.processes.append(subprocess.Popen([sys.executable, str(script)], env=env,
                                                  stdout=log, stderr=log,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
    found = probes.detect_hang(tag=tag, timeout_s=90)
    assert found["verdict"] == "hung", (found["reason"], job.logs())
    assert "rank" in found["reason"] and "all_reduce" in found["reason"] \
        and "broadcast" in found["reason"] and "not the same call" in found["reason"], \
        found["reason"]
    places = {place["what"]: place["ranks"] for place in found["blocked_in"]["places"]}
    assert sorted(places.values()) == [[0], [1]], places
