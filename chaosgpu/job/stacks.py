"""Python stacks of training ranks, taken from outside with py-spy, and what they show.

This module owns two things: taking a stack sample of every Python thread of a process
(`py-spy dump --json --nonblocking`, with a deadline) and reading a
sample: where each thread waits (a collective, a barrier, a rendezvous, DDP's backward, the
GPU) and a progress signature (frames and simple local values outside the innermost line)
that changes when the rank moves on and stays the same while it is blocked. It decides no
verdict (chaosgpu.job.verdict does) and signals nothing.

What a Python stack can show, and its limits: py-spy sees Python frames only. A rank blocked in
C++ (`work.wait()`, `tensor.item()` on a GPU) shows the Python line that made the call; that
line's source text (read through /proc/PID/root, so it works for containers) tells what the call
is. With DistributedDataParallel the gradient all_reduce runs on the autograd engine's thread
(no Python frames); the main thread shows `backward()`.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from chaosgpu.process.environment import helper_env

__all__ = ["Frame", "ThreadStack", "StackSample", "Site", "py_spy_path", "take_samples",
           "classify", "signature", "is_dataloader_worker", "SITE_KINDS"]

#: Kinds of waiting site, strongest evidence of a blocked collective first.
SITE_KINDS = ("collective", "barrier", "rendezvous", "backward", "gpu-wait", "wait")

_C10D = "torch/distributed/distributed_c10d.py"
_COLLECTIVES = frozenset((
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_coalesced", "all_gather_object", "all_gather_single", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single",
    "broadcast", "broadcast_object_list", "reduce", "all_to_all", "all_to_all_single",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv",
    "batch_isend_irecv", "send_object_list", "recv_object_list",
))
_BARRIERS = frozenset(("barrier", "monitored_barrier"))
_RENDEZVOUS_C10D = frozenset(("init_process_group", "new_group", "_new_group_with_tag",
                              "_store_based_barrier", "new_subgroups",
                              "new_subgroups_by_enumeration", "split_group", "shrink_group",
                              "init_device_mesh"))
_RENDEZVOUS_FILES = ("torch/distributed/rendezvous.py", "torch/distributed/elastic/rendezvous/")
_BACKWARD = (("torch/autograd/graph.py", "_engine_run_backward"),
             ("torch/autograd/__init__.py", "backward"),
             ("torch/autograd/__init__.py", "grad"))
_GPU_SYNC = (("torch/cuda/__init__.py", "synchronize"), ("torch/cuda/streams.py", "synchronize"))
_DDP = "torch/nn/parallel/distributed.py"
#: torch.distributed's helpers that run a collective on every rank from Python (DDP's
#: constructor verifies parameter shapes and broadcasts module states; FSDP syncs its params):
#: named after what they do, wherever they live under torch/distributed/ or in DDP's module.
_DIST_TREE = ("torch/distributed/", _DDP)
_HELPER_COLLECTIVE = re.compile(
    r"(^|_)(sync|broadcast|all_?reduce|all_gather|reduce_scatter|all_to_all|verify_param)")

_SOURCE_WAIT = re.compile(r"\.wait\(|is_completed\(\)|\.get_future\(\)|\.value\(\)")
_SOURCE_GPU = re.compile(r"\.item\(\)|\.cpu\(\)|\.tolist\(\)|synchronize\(")
_SOURCE_COLLECTIVE = re.compile(
    r"\b(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|all_to_all\w*|barrier)\(")
_SIMPLE_REPR = re.compile(r"^-?[0-9][0-9_.eE+-]*$|^(True|False|None)$|^'.{0,64}'$")


@dataclass(frozen=True)
class Frame:
    """One Python frame: function (qualified name), file, line, simple locals (name -> repr)."""

    function: str
    filename: str
    line: int
    locals: tuple[tuple[str, str], ...] = ()

    def where(self) -> str:
        """`file:line function`, with the file shortened to its last three parts (a path of
        three parts or fewer is kept whole, its leading slash included)."""
        parts = self.filename.split("/")
        short = "/".join(parts[-3:]) if len(parts) > 4 else self.filename
        return f"{short}:{self.line} {self.function}"


@dataclass
class ThreadStack:
    """The Python frames of one thread, innermost first."""

    tid: int | None
    name: str | None
    frames: list[Frame]


@dataclass
class StackSample:
    """A stack sample of one process, or why there is none (`error`)."""

    pid: int
    taken_at: float
    threads: list[ThreadStack] = field(default_factory=list)
    error: str | None = None

    def main_thread(self) -> ThreadStack | None:
        """The process's main thread (its thread id is the PID; py-spy may list it after
        helper threads), else the first thread with frames; None without frames."""
        with_frames = [thread for thread in self.threads if thread.frames]
        for thread in with_frames:
            if thread.tid == self.pid or thread.name == "MainThread":
                return thread
        return with_frames[0] if with_frames else None


@dataclass(frozen=True)
class Site:
    """Where a thread waits: kind (one of SITE_KINDS), what (all_reduce, init_process_group,
    `.wait()` ...), the frame that waits, its caller in user code, the source line, and `via`:
    the outermost torch.distributed function between the two (the library that runs the
    collective for the user's call: DCP's save, FSDP's unshard, gather_object), when there is
    one other than the waiting frame."""

    kind: str
    what: str
    frame: str
    caller: str | None
    source: str | None
    thread: str | None
    via: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The site as a JSON-ready dict."""
        return {"kind": self.kind, "what": self.what, "frame": self.frame,
                "caller": self.caller, "source": self.source, "thread": self.thread,
                "via": self.via}

    def describe(self) -> str:
        """The site in words for a reason: `collective all_reduce`, `barrier`, `wait .wait()`,
        with `via` where there is one."""
        text = self.kind if self.what == self.kind or self.what.startswith(self.kind) \
            else f"{self.kind} {self.what}"
        if self.kind == "wait":
            text = f"a wait on a collective ({self.what})"
        if self.via:
            text += f" (via {self.via})"
        return text


def py_spy_path() -> str | None:
    """The py-spy executable on PATH, else the one installed beside this Python (a virtual
    environment's bin, used without activating it: `.venv/bin/chaos run ...`), or None (then
    no stack evidence can be taken)."""
    found = shutil.which("py-spy")
    if found is None:
        beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
        found = beside if os.access(beside, os.X_OK) else None
    return found


def _parse(pid: int, text: str, taken_at: float) -> StackSample:
    data = json.loads(text)
    threads = []
    for thread in data:
        frames = []
        for raw in thread.get("frames") or []:
            values = tuple(
                (str(item.get("name")), str(item.get("repr")))
                for item in raw.get("locals") or []
                if isinstance(item.get("repr"), str) and _SIMPLE_REPR.match(item["repr"]))
            frames.append(Frame(str(raw.get("name")), str(raw.get("filename")),
                                int(raw.get("line") or 0), values))
        threads.append(ThreadStack(thread.get("os_thread_id"), thread.get("thread_name"),
                                   frames))
    return StackSample(pid, taken_at, threads, None)


def take_samples(pids: Iterable[int], timeout_s: float = 3.0,
                 local_values: bool = True) -> dict[int, StackSample]:
    """Take one stack sample of each PID at once, every dump with the same deadline. py-spy
    reads each process's memory without attaching to it (`--nonblocking`): the rank is never
    ptrace-stopped, so sampling neither pauses a running rank nor races a stop signal sent to
    it meanwhile (by a fault, a scheduler suspending the job, an operator), which a tracer
    attached at that moment would receive and could swallow on detaching; a stopped rank is
    read without waiting for it to run. A rank blocked in a call shows the same stack in
    every read; a running one may be read between two of its steps, which is a move it made.
    A PID py-spy cannot read gets a sample with `error` (not installed, no permission, not a
    Python process, gone, no answer in time). py-spy runs without the runner's scope
    variables (helper_env): a kill by the runner's tag never hits it."""
    exe = py_spy_path()
    now = time.time()
    if exe is None:
        missing = (f"py-spy was found neither on PATH nor beside {sys.executable} "
                   "(pip install py-spy)")
        return {pid: StackSample(pid, now, error=missing) for pid in pids}
    running: dict[int, subprocess.Popen[str]] = {}
    for pid in pids:
        argv = [exe, "dump", "--pid", str(pid), "--json", "--nonblocking"]
        if local_values:
            argv.append("--locals")
        running[pid] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        stdin=subprocess.DEVNULL, text=True, env=helper_env())
    end = time.monotonic() + timeout_s
    samples = {}
    for pid, proc in running.items():
        try:
            out, err = proc.communicate(timeout=max(0.05, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            samples[pid] = StackSample(pid, now, error=f"py-spy gave no answer in {timeout_s} s")
            continue
        if proc.returncode != 0:
            first = (err.strip().splitlines() or ["no output"])[0]
            samples[pid] = StackSample(pid, now, error=f"py-spy failed: {first[:300]}")
            continue
        try:
            samples[pid] = _parse(pid, out, now)
        except (ValueError, TypeError, AttributeError) as error:
            samples[pid] = StackSample(pid, now, error=f"unreadable py-spy output: {error}")
    return samples


class SourceLines:
    """Reads source lines of a process's files through /proc/PID/root (its mount namespace),
    once per file."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, str], list[str] | None] = {}

    def line(self, pid: int, filename: str, number: int) -> str | None:
        """The stripped source line, or None when the file cannot be read."""
        key = (pid, filename)
        if key not in self._files:
            try:
                with open(f"/proc/{pid}/root{filename}", encoding="utf-8",
                          errors="replace") as handle:
                    self._files[key] = handle.read().splitlines()
            except OSError:
                self._files[key] = None
        lines = self._files[key]
        if lines is None or not 0 < number <= len(lines):
            return None
        return lines[number - 1].strip()[:200]


def _frame_site(frame: Frame) -> tuple[str, str] | None:
    path = frame.filename
    short = frame.function.rsplit(".", 1)[-1]
    if path.endswith(_C10D):
        if short in _BARRIERS:
            return "barrier", short
        if short in _COLLECTIVES:
            return "collective", short
        if short in _RENDEZVOUS_C10D:
            return "rendezvous", short
    if any(part in path for part in _RENDEZVOUS_FILES):
        return "rendezvous", short
    for suffix, name in _BACKWARD:
        if path.endswith(suffix) and short == name:
            return "backward", "backward (DDP's all_reduce runs on the autograd thread)"
    for suffix, name in _GPU_SYNC:
        if path.endswith(suffix) and short == name:
            return "gpu-wait", "torch.cuda.synchronize"
    if any(part in path for part in _DIST_TREE) and _HELPER_COLLECTIVE.search(short):
        owner = "DDP" if path.endswith(_DDP) or "torch/distributed/utils.py" in path \
            else "torch.distributed"
        return "collective", f"{owner} {short}"
    return None


def _source_site(source: str | None, gpu: bool) -> tuple[str, str] | None:
    if not source:
        return None
    match = _SOURCE_COLLECTIVE.search(source)
    if match:
        return ("barrier" if match.group(1) == "barrier" else "collective"), match.group(1)
    match = _SOURCE_WAIT.search(source)
    if match:
        return "wait", match.group(0) + ("" if match.group(0).endswith(")") else ")")
    if gpu and _SOURCE_GPU.search(source):
        return "gpu-wait", _SOURCE_GPU.search(source).group(0).strip(".(")  # type: ignore[union-attr]
    return None


def _user_caller(frames: list[Frame], start: int) -> str | None:
    for frame in frames[start:]:
        if "/torch/" not in frame.filename and "/site-packages/" not in frame.filename:
            return frame.where()
    return None


def _via(frames: list[Frame], start: int) -> str | None:
    """The outermost named torch.distributed function above frames[start] and below the user's
    code (wrappers and loggers skipped), or None when there is none."""
    found = None
    for frame in frames[start + 1:]:
        if "/torch/" not in frame.filename and "/site-packages/" not in frame.filename:
            break
        if "torch/distributed/" in frame.filename and "<locals>" not in frame.function \
                and not frame.filename.endswith(("c10d_logger.py", "/logger.py")):
            found = frame
    return found.where() if found is not None else None


def is_dataloader_worker(sample: StackSample) -> bool:
    """Whether the sampled process is a PyTorch DataLoader worker (a thread runs
    torch.utils.data's `_worker_loop`): a rank's forked helper, which carries its environment,
    RANK included, but is no rank."""
    return any(frame.function.endswith("_worker_loop")
               and frame.filename.endswith("torch/utils/data/_utils/worker.py")
               for thread in sample.threads for frame in thread.frames)


def classify(sample: StackSample, sources: SourceLines, gpu: bool = False) -> Site | None:
    """The strongest waiting site among the sample's threads (SITE_KINDS order), or None when
    no thread waits in a known place. A frame of torch.distributed, autograd or torch.cuda
    names the site; otherwise the innermost line's source text (a `.wait()`, an
    `is_completed()` poll, a collective called through a wrapper, and with `gpu` a `.item()` or
    `synchronize()`), or one of the three lines above it (a poll loop sleeps between checks)."""
    best: Site | None = None
    for thread in sample.threads:
        site = _thread_site(sample.pid, thread, sources, gpu)
        if site is not None and (best is None
                                 or SITE_KINDS.index(site.kind) < SITE_KINDS.index(best.kind)):
            best = site
    return best


def _thread_site(pid: int, thread: ThreadStack, sources: SourceLines, gpu: bool) -> Site | None:
    frames = thread.frames
    for index, frame in enumerate(frames):
        found = _frame_site(frame)
        if found is not None:
            caller = _user_caller(frames, index + 1)
            return Site(found[0], found[1], frame.where(), caller, None, thread.name,
                        _via(frames, index))
    if not frames:
        return None
    inner = frames[0]
    for back in range(4):
        source = sources.line(pid, inner.filename, inner.line - back)
        found = _source_site(source, gpu)
        if found is not None:  # the waiting call is made by this (user) frame itself
            return Site(found[0], found[1], inner.where(), inner.where(), source, thread.name)
        if source is None:
            break
    return None


def signature(sample: StackSample, threads: set[str] | None = None) -> tuple[Any, ...]:
    """What changes when a rank makes progress and stays put while it waits: for every thread
    named in `threads` (all of them when None or when none of the sample's threads has one of
    those names), its frames (file, function, line) with their simple local values, except the
    innermost frame's line (a poll loop alternates between the check and the sleep)."""
    result = []
    chosen = [t for t in sample.threads if threads is None or t.name in threads]
    for thread in sorted(chosen or sample.threads, key=lambda t: t.tid or 0):
        frames = []
        for index, frame in enumerate(thread.frames):
            frames.append((frame.filename, frame.function,
                           None if index == 0 else frame.line, frame.locals))
        result.append((thread.tid, tuple(frames)))
    return tuple(result)


def describe_move(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """What differs between two signatures, for the evidence: the first thread and frame that
    changed (its function, line and the locals that changed), or the thread that came or went."""
    old = dict(before)
    new = dict(after)
    for tid in sorted(set(old) | set(new), key=lambda t: t or 0):
        if tid not in old or tid not in new:
            return f"thread {tid} {'started' if tid in new else 'ended'}"
        frames_old, frames_new = old[tid], new[tid]
        if len(frames_old) != len(frames_new):
            leaf = frames_new[0] if frames_new else None
            return (f"thread {tid}: {len(frames_old)} -> {len(frames_new)} frames"
                    + (f", now in {leaf[1]}" if leaf else ""))
        for a, b in zip(frames_old, frames_new, strict=True):
            if a == b:
                continue
            if a[:3] != b[:3]:
                return f"thread {tid}: {a[1]}:{a[2]} -> {b[1]}:{b[2]}"
            changed = [f"{name} {dict(a[3]).get(name)} -> {value}" for name, value in b[3]
                       if dict(a[3]).get(name) != value]
            return f"thread {tid}: in {b[1]}, " + ", ".join(changed[:3])
    return "unchanged"


def render(sample: StackSample) -> str:
    """The sample as text, py-spy style: one block per thread, innermost frame first."""
    if sample.error:
        return f"(no stack: {sample.error})"
    lines = []
    for thread in sample.threads:
        lines.append(f"Thread {thread.tid} ({thread.name or '?'})")
        for frame in thread.frames:
            values = ", ".join(f"{k}={v}" for k, v in frame.locals)
            lines.append(f"    {frame.function} ({frame.filename}:{frame.line})"
                         + (f" [{values}]" if values else ""))
    return "\n".join(lines)
