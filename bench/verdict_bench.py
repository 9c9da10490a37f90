"""Observed job verdicts on real torchrun gloo jobs (CPU): detection latency and false verdicts,
side by side with PyTorch's own process-group timeout at a short setting, measured in the same
runs.

Each case starts tests/jobs/train.py under torchrun (2 ranks, a 10 s process-group timeout),
watches it from a separate process (`chaosgpu jobs --watch --json`, as a node agent would: no
shared interpreter with the fault injector), injects the case's fault at a random point, and
records every verdict the watcher printed:

* stop: rank 1 SIGSTOPped; expected "hung". PyTorch's reference: rank 0 raises when the 10 s
  timeout fires.
* stall: rank 1 sleeps in Python at step 8 (alive); expected "hung"; same reference.
* node-loss: rank 1 partitioned (nftables drop), then SIGKILLed; expected "hung"; same
  reference. Bare ranks (no launcher): under torchrun the rank's own agent, on the same host,
  sees its death and tears the job down ("failed"), which a lost host's agent could not do.
* kill: rank 1 SIGKILLed; expected "failed", never "hung" (gloo survivors see the reset).
* healthy: no fault, 15 s watched; expected "running" only.
* lockstep-20s: 3 steps of 20 s compute each (watched from the end of the first); expected
  "finished", never "hung".
* checkpoint: rank 0 saves for 7 s after destroy_process_group; expected "finished", never "hung".
* spawn-stop, spawn-kill: the same faults on a job chaosgpu did not launch and whose ranks carry
  no RANK: tests/jobs/spawn_ddp.py (PyTorch's DDP tutorial shape, torch.multiprocessing.spawn,
  DataLoader workers), rank 0 (found as the store host) stopped or killed. No reference: the
  job keeps PyTorch's default timeout (30 min).
* lightning-stop, lightning-kill: tests/jobs/lightning_ddp.py (PyTorch Lightning's own DDP
  launcher), rank 1 (LOCAL_RANK on node 0) stopped or killed; no reference either.

Prints, per case: the verdicts reached, detection latency from the fault (median, max), the
reference's latency (median) and the ratio, and false verdicts ("hung" in a case that must not
hang, or no hang where one must be seen). Writes bench/results/verdicts-<date>.txt.

    python bench/verdict_bench.py [--reps 3] [--cases stop,stall,...] [--window 3] [--name N]
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _results import write  # noqa: E402
from jobs.launch import (  # noqa: E402
    start_bare,
    start_lightning,
    start_spawn,
    start_torchrun,
    wait_spawn_steps,
)

from chaosgpu.job import actions  # noqa: E402

PG_TIMEOUT_S = 10.0
CASES = {
    "stop": {"args": [], "expect": "hung"},
    "stall": {"args": ["--stall-rank", "1", "--stall-at", "8", "--stall-s", "120"],
              "expect": "hung"},
    "node-loss": {"args": [], "expect": "hung", "bare": True},
    "kill": {"args": [], "expect": "failed"},
    "healthy": {"args": [], "expect": "running"},
    "lockstep-20s": {"args": ["--steps", "3", "--compute-s", "20", "--sleep-s", "0"],
                     "expect": "finished", "ready_steps": 1},
    "checkpoint": {"args": ["--steps", "6", "--checkpoint-rank", "0", "--checkpoint-s", "7"],
                   "expect": "finished"},
    "spawn-stop": {"shape": "spawn", "fault": "stop", "rank": 0, "expect": "hung"},
    "spawn-kill": {"shape": "spawn", "fault": "kill", "rank": 0, "expect": "failed"},
    "lightning-stop": {"shape": "lightning", "fault": "stop", "rank": 1, "expect": "hung"},
    "lightning-kill": {"shape": "lightning", "fault": "kill", "rank": 1, "expect": "failed"},
}


def _start(spec: dict[str, Any], folder: Path) -> Any:
    """Start the case's job and wait until it steps."""
    shape = spec.get("shape", "bare" if spec.get("bare") else "torchrun")
    if shape in ("spawn", "lightning"):
        job = start_spawn(folder) if shape == "spawn" else start_lightning(folder)
        wait_spawn_steps(job, 3, timeout_s=180)
        return job
    args = [*spec.get("args", []), "--pg-timeout-s", str(PG_TIMEOUT_S)]
    job = start_bare(folder, args) if shape == "bare" else start_torchrun(folder, args)
    job.wait_steps(spec.get("ready_steps", 2), timeout_s=180)
    return job


class Watcher:
    """`chaosgpu jobs --watch --json --tag T` in its own process; collects its lines."""

    def __init__(self, tag: str, window: float) -> None:
        self.lines: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chaosgpu.cli", "jobs", "--watch", "--json", "--tag", tag,
             "--window", str(window)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.lines.append(json.loads(line))
            except ValueError:
                continue

    def wait_for(self, verdicts: set[str], timeout_s: float) -> dict[str, Any] | None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for line in self.lines:
                if line["verdict"] in verdicts:
                    return line
            time.sleep(0.05)
        return None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def one(case: str, window: float) -> dict[str, Any]:
    spec = CASES[case]
    fault = spec.get("fault", case)
    rank = spec.get("rank", 1)
    with tempfile.TemporaryDirectory() as folder:
        job = _start(spec, Path(folder))
        watcher = None
        try:
            watcher = Watcher(job.tag, window)
            if watcher.wait_for({"running"}, 30) is None:
                return {"case": case, "error": "the watcher never saw the job running"}
            time.sleep(random.uniform(0.5, 1.5))
            fault_t = time.time()
            if fault == "stop":
                actions.freeze_rank(tag=job.tag, rank=rank)
            elif fault == "node-loss":
                actions.fail_rank(tag=job.tag, rank=rank, how="node-loss")
            elif fault == "kill":
                actions.kill_rank(tag=job.tag, rank=rank, wait_s=0)
            elif case == "stall":
                fault_t = 0.0  # the rank stalls by itself: time from its last step instead
            wait = {"healthy": 15.0, "lockstep-20s": 120.0, "checkpoint": 60.0}.get(case, 40.0)
            # a kill is watched to its end: how survivors of a dead peer react is the job's
            # (a framework may keep them blocked for seconds, a DataLoader worker may keep the
            # dead rank's connections open): a hang on the way is false unless its culprit is
            # the killed rank
            target = {"hung"} if case == "healthy" else {"failed", "finished"} \
                if spec["expect"] == "failed" else {"hung", "failed", "finished"}
            reached = watcher.wait_for(target, wait)
            if case == "stall":
                fault_t = job.progress().get(1, {}).get("t", time.time())
            result: dict[str, Any] = {"case": case, "verdicts": [],
                                      "reached": reached["verdict"] if reached else None}
            if reached and reached.get("confirmed_at") and fault_t:
                result["detect_s"] = round(reached["confirmed_at"] - fault_t, 3)
            if spec["expect"] == "hung" and reached and reached["verdict"] == "hung" \
                    and "shape" not in spec:
                # the reference: PyTorch's own timeout fires in rank 0, which then exits
                end = time.monotonic() + PG_TIMEOUT_S + 30
                while time.monotonic() < end and "pytorch_timeout_s" not in result:
                    for line in list(watcher.lines):
                        exits = [r.get("exited_at") for r in line.get("ranks", [])
                                 if r.get("rank") == 0 and r.get("exited_at")]
                        if exits:
                            result["pytorch_timeout_s"] = round(exits[0] - fault_t, 3)
                            break
                    time.sleep(0.1)
            result["verdicts"] = [line["verdict"] for line in watcher.lines]
            hung = [line.get("reason") or "" for line in watcher.lines
                    if line["verdict"] == "hung"]
            if hung and spec["expect"] != "hung":
                result["hung_reasons"] = hung
            result["hung_explained"] = any(f"rank {rank} ended: killed by SIGKILL" in reason
                                           for reason in hung)
            result["helpers_named"] = any("outlive it holding" in reason for reason in hung)
            return result
        finally:
            if watcher is not None:
                watcher.stop()
            job.stop()
            from chaosgpu.network import partitions

            partitions.remove_all()


def summarise(results: list[dict[str, Any]]) -> str:
    lines = [f"torchrun, 2 gloo ranks (tests/jobs/train.py), process-group timeout "
             f"{PG_TIMEOUT_S:g} s (spawn-*, lightning-*: tests/jobs/spawn_ddp.py and "
             "lightning_ddp.py, 2 gloo ranks, PyTorch's default timeout); verdicts from "
             "`chaosgpu jobs --watch` in its own process", "",
             f"{'case':14} {'runs':>4} {'expected':>9} {'reached':>24} {'verdict med/max s':>17} "
             f"{'pytorch timeout s':>18} {'ratio':>6} {'false':>5}"]
    for case in CASES:
        runs = [r for r in results if r["case"] == case]
        if not runs:
            continue
        expect = CASES[case]["expect"]
        reached = [r.get("reached") for r in runs]
        detect = [r["detect_s"] for r in runs if "detect_s" in r]
        ref = [r["pytorch_timeout_s"] for r in runs if "pytorch_timeout_s" in r]
        if expect == "hung":
            false = sum(1 for r in runs if r.get("reached") != "hung")
        elif expect == "running":
            false = sum(1 for r in runs if "hung" in r.get("verdicts", []))
        else:
            false = sum(1 for r in runs if r.get("reached") != expect or (
                "hung" in r.get("verdicts", []) and not r.get("hung_explained")))
        det = f"{statistics.median(detect):.2f}/{max(detect):.2f}" if detect else "-"
        refs = f"{statistics.median(ref):.2f}" if ref else "-"
        ratio = f"{statistics.median(ref) / statistics.median(detect):.1f}x" \
            if detect and ref else "-"
        counts = ",".join(f"{v}:{reached.count(v)}" for v in sorted(set(map(str, reached))))
        lines.append(f"{case:14} {len(runs):>4} {expect:>9} {counts:>24} {det:>17} {refs:>18} "
                     f"{ratio:>6} {false:>5}")
    explained = [r["case"] for r in results if r.get("hung_explained")]
    lines += ["", "verdict: from the fault (stall: from the rank's last step; lockstep and "
              "checkpoint: from a random moment of the run) to the confirmed_at of the verdict "
              "reached; pytorch timeout: from the fault to rank 0's exit after its own "
              "timeout fired; false: a hang where none is, or none where one is (a kill is "
              "watched to its end: a hang on the way, survivors blocked with no progress for "
              "the window, counts as false unless its culprit is the killed rank)",
              f"kill runs hung on the way, culprit the killed rank: {len(explained)} "
              f"({', '.join(sorted(set(explained))) or '-'}); of them, with the killed rank's "
              f"DataLoader workers named as still holding its connections: "
              f"{sum(1 for r in results if r.get('helpers_named'))}"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--window", type=float, default=3.0)
    parser.add_argument("--name", default="verdicts", help="results file name prefix")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or args.reps < 1:
        parser.error(f"unknown cases {unknown} (known: {sorted(CASES)}) or --reps < 1")
    results = []
    for _ in range(args.reps):
        for case in cases:
            result = one(case, args.window)
            print(json.dumps(result), flush=True)
            results.append(result)
    text = summarise(results) + "\n\nruns:\n" + "\n".join(json.dumps(r) for r in results)
    print(summarise(results))
    print(f"written {write(args.name, text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
