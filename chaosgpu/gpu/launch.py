"""Start chaosgpu's GPU fault programs as processes of their own, recorded so they can be removed.

This module owns starting a fault program (`python -m chaosgpu.gpu pressure|contention|xid`)
detached from the runner (own session, DEVNULL stdin, output in a log file) or inside a local
pod, with its own CHAOSGPU_TAG in its environment and none of the runner's scope variables
(chaosgpu.process.environment.helper_env; in a pod, chaosgpu.sandbox.runtime.exec_in),
recording it in `<state>/workloads/<tag>.json` (the workloads' record schema: host PID + start
time) *before* waiting on it, so that a rollback (`chaosgpu.workloads.actions.stop_workload`)
and `chaosgpu cleanup` find and remove it even after a crash of the runner. It never signals
anything itself: stopping goes through stop_workload.
"""

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from chaosgpu import state
from chaosgpu.node import process_starttime
from chaosgpu.process.environment import helper_env
from chaosgpu.workloads.actions import KIND, claim_tag, stop_workload
from chaosgpu.workloads.readiness import wait_ready

__all__ = ["FAULT_KINDS", "check_tag", "start", "run_to_end", "tail", "result_file"]

FAULT_KINDS = ("memory-pressure", "compute-contention", "xid")


def check_tag(tag: str | None, prefix: str) -> str:
    """A valid, unused workload tag (`prefix-<random>` when None); a record left by a dead
    workload of that tag is cleared first. The one rule of a new workload's tag:
    chaosgpu.workloads.actions.claim_tag."""
    return claim_tag(tag, prefix)


def result_file(tag: str) -> Path:
    """Where a fault program leaves its result (outside its workdir, which stopping removes)."""
    folder = state.state_dir() / "gpu_results"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder / f"{tag}.json"


def tail(path: Path, limit: int = 600) -> str:
    """The end of a log file ("" when there is none)."""
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


def _spawn(tag: str, argv: list[str], log: Path, sandbox: str | None,
           timeout_s: float) -> tuple[dict[str, Any], subprocess.Popen[bytes] | None]:
    env = {"CHAOSGPU_TAG": tag}
    if sandbox is not None:
        from chaosgpu.sandbox import runtime

        started = runtime.exec_in(sandbox, argv, detached=True, env=env, log_path=str(log),
                                  timeout_s=timeout_s)
        pid, ns_pid, process = started["host_pid"], started["ns_pid"], None
    else:
        with open(log, "ab") as handle:
            process = subprocess.Popen(argv, env=helper_env(**env),
                                       stdin=subprocess.DEVNULL, stdout=handle,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=process.wait, name=f"chaosgpu-reap-{process.pid}",
                         daemon=True).start()
        pid, ns_pid = process.pid, None
    return {"pid": pid, "ns_pid": ns_pid, "starttime": process_starttime(pid),
            "role": "gpu-fault"}, process


def _new_record(tag: str, kind: str, sandbox: str | None, config: dict[str, Any]) -> dict[str, Any]:
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown GPU fault kind {kind!r}")
    if sandbox is not None:
        from chaosgpu.sandbox import runtime

        box = runtime.get_record(sandbox)
        if box is None:
            raise ValueError(f"no sandbox named {sandbox!r}")
        if box.get("uid") not in (None, 0) and not box.get("userns"):
            raise ValueError(f"sandbox {sandbox!r} runs as uid {box.get('uid')}: GPU fault "
                             "programs run as root inside a pod (they write to the state dir)")
    workdir = state.state_dir() / KIND / f"{tag}.d"
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return {"tag": tag, "kind": kind, "sandbox": sandbox, "workdir": str(workdir),
            "workdir_private": False, "created_at": time.time(),
            "runner": {"pid": os.getpid(), "starttime": process_starttime(os.getpid())},
            "config": config, "processes": []}


def start(kind: str, tag: str, program: str, args: list[str], config: dict[str, Any],
          timeout_s: float, sandbox: str | None = None) -> dict[str, Any]:
    """Start fault program `program` with `args` (plus --ready-file and, for contention,
    --result-file), wait up to `timeout_s` for its readiness file; return {"record", "ready"}.
    On any failure the program is stopped, its record removed, and RuntimeError names why."""
    record = _new_record(tag, kind, sandbox, config)
    workdir = Path(record["workdir"])
    ready = workdir / "ready.json"
    log = workdir / "program.log"
    argv = [sys.executable, "-m", "chaosgpu.gpu", program, *args, "--ready-file", str(ready)]
    if program == "contention":
        argv += ["--result-file", str(result_file(tag))]
    state.write_record(KIND, tag, record)
    try:
        entry, _ = _spawn(tag, argv, log, sandbox, timeout_s)
        record["processes"].append(entry)
        state.write_record(KIND, tag, record)
        document = wait_ready(ready, timeout_s, pid=entry["pid"])
    except Exception as error:
        output = tail(log)
        stop_workload(tag, grace_s=0)
        shutil.rmtree(workdir, ignore_errors=True)
        raise RuntimeError(f"{kind} {tag!r} did not start: {error} {output}") from None
    return {"record": record, "ready": document}


def run_to_end(kind: str, tag: str, program: str, args: list[str], config: dict[str, Any],
               timeout_s: float) -> dict[str, Any]:
    """Run a short-lived fault program to its end (recorded while it runs; killed through
    stop_workload past `timeout_s`); return {"rc", "stdout", "log", "took_s"}."""
    record = _new_record(tag, kind, None, config)
    workdir = Path(record["workdir"])
    out = workdir / "stdout.json"
    log = workdir / "program.log"
    argv = [sys.executable, "-m", "chaosgpu.gpu", program, *args]
    state.write_record(KIND, tag, record)
    started = time.monotonic()
    rc: int | None = None
    try:
        with open(out, "wb") as stdout, open(log, "ab") as stderr:
            process = subprocess.Popen(argv, env=helper_env(CHAOSGPU_TAG=tag),
                                       stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                                       start_new_session=True)
        record["processes"].append({"pid": process.pid, "ns_pid": None,
                                    "starttime": process_starttime(process.pid),
                                    "role": "gpu-fault"})
        state.write_record(KIND, tag, record)
        try:
            rc = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        result = {"rc": rc, "stdout": out.read_text(errors="replace"), "log": tail(log),
                  "took_s": round(time.monotonic() - started, 3)}
    finally:
        stop_workload(tag, grace_s=0)
        if rc is None and "process" in locals():
            process.wait(timeout=10)
    if rc is None:
        raise RuntimeError(f"{kind} program {tag!r} did not end within {timeout_s:g} s: killed")
    return result
