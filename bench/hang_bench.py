"""Hang detection latency and hang cleanup time on a CPU gloo ring (no GPU needed).

For each repetition: start a gloo ring (world size 3 by default), start `detect_hang` watching
it from a separate process, freeze one rank at a random point of its poll cycle (SIGSTOP through
a pidfd), and measure the time from the signal to the moment the census first showed the hang
(goal <= 1 s; PyTorch's own default is a 10-minute process-group timeout, NCCL RAS 60 s). Then
time `cleanup_hung_job` until every process of the job is dead (goal <= 5 s). Also reports what
collecting py-spy stacks adds. Prints the figures and writes bench/results/hang-<date>.txt.

    python bench/hang_bench.py [--reps 5] [--world-size 3] [--poll-s 0.1] [--grace-s 2]

"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import write  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402
from chaosgpu.workloads.ring import RingConfig, launch_ring  # noqa: E402

WATCHER = """
import json, sys
from chaosgpu.job import probes
tag, poll_s = sys.argv[1], float(sys.argv[2])
probes.job_ranks(tag=tag)  # warm: imports and the census program loaded
print("watching", flush=True)
print(json.dumps(probes.detect_hang(tag=tag, timeout_s=30, poll_s=poll_s, stacks=False)))
"""


def one(world_size: int, poll_s: float, grace_s: float) -> dict[str, Any]:
    tag = f"hang-bench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as ready:
        launch = launch_ring(RingConfig(backend="gloo", world_size=world_size, ready_dir=ready,
                                        tag=tag, timeout_s=600), detach=True)
        try:
            launch.wait_ready(120)
            time.sleep(0.3)
            # The watcher is a separate process (as a node agent would be: no shared GIL with
            # the fault injector). Once it polls a healthy job, the fault lands at a random
            # point of its poll cycle (a fixed delay would align with the polls).
            watcher = subprocess.Popen(
                [sys.executable, "-c", WATCHER, tag, str(poll_s)], stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL, text=True, env=dict(os.environ))
            assert watcher.stdout is not None
            assert watcher.stdout.readline().strip() == "watching"
            time.sleep(0.5 + random.uniform(0, poll_s))
            fault = actions.freeze_rank(tag=tag, rank=1)
            seen: dict[str, Any] = json.loads(watcher.communicate(timeout=60)[0])
            detection = seen["first_seen"] - fault["sent_at"] if seen.get("hung") else None
            t = time.monotonic()
            stacks = probes.detect_hang(tag=tag, timeout_s=5, stacks=True)
            with_stacks = time.monotonic() - t
            t = time.monotonic()
            cleaned = actions.cleanup_hung_job(tag=tag, grace_s=grace_s, deadline_s=30)
            cleanup_s = time.monotonic() - t
            return {"detection_s": detection, "polls": seen.get("polls"),
                    "detect_with_stacks_s": with_stacks,
                    "stacks": stacks.get("python_stacks", {}).get("available"),
                    "cleanup_s": cleanup_s, "not_removed": cleaned["not_removed"],
                    "steps": [(s["step"], s["t"]) for s in cleaned["steps"]]}
        finally:
            for proc in launch.processes:
                if proc.poll() is None:
                    os.kill(proc.pid, 18)
                    proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--poll-s", type=float, default=0.1)
    parser.add_argument("--grace-s", type=float, default=2.0)
    parser.add_argument("--name", default="hang", help="results file name prefix")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    lines = [f"gloo ring, world size {args.world_size}, rank 1 frozen by SIGSTOP; detect_hang "
             f"poll {args.poll_s} s; cleanup grace {args.grace_s} s; {args.reps} repetitions", ""]
    rows = []
    for rep in range(args.reps):
        row = one(args.world_size, args.poll_s, args.grace_s)
        rows.append(row)
        det = "missed" if row["detection_s"] is None else f"{row['detection_s']:.3f}"
        lines.append(f"rep {rep + 1}: detection {det} s (polls {row['polls']}), detect+stacks "
                     f"{row['detect_with_stacks_s']:.3f} s (py-spy: {row['stacks']}), cleanup "
                     f"{row['cleanup_s']:.3f} s, not removed {row['not_removed']}, "
                     f"steps {row['steps']}")
        print(lines[-1], flush=True)
    dets = [r["detection_s"] for r in rows if r["detection_s"] is not None]
    cleans = [r["cleanup_s"] for r in rows]
    lines += ["",
              f"detection latency: median {statistics.median(dets):.3f} s, max {max(dets):.3f} s"
              f" ({len(dets)}/{len(rows)} detected; goal <= 1 s; PyTorch default timeout 600 s "
              f"= {600 / max(dets):.0f}x slower)",
              f"cleanup time: median {statistics.median(cleans):.3f} s, max {max(cleans):.3f} s "
              "(goal <= 5 s)",
              f"detect with py-spy stacks: median "
              f"{statistics.median(r['detect_with_stacks_s'] for r in rows):.3f} s"]
    print("\n".join(lines[-4:]))
    if not args.no_write:
        print(f"written: {write(args.name, chr(10).join(lines) + chr(10))}")
    ok = len(dets) == len(rows) and max(dets) <= 1.0 and max(cleans) <= 5.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
