"""Python stacks of training ranks, taken from outside with py-spy, and what they show.

This module owns two things: taking a stack sample of every Python thread of a process
(`py-spy dump --json --nonblocking`, with a deadline) and reading a
sample: where each thread waits (a collective, a barrier, a rendezvous, DDP's backward, the
GPU) and a progress signature (frames and simple local values outside the innermost line)
that changes when the rank moves on and stays the same while it is blocked (the locals of a
frame that polls in a loop, a poll counter, do not count). It decides no verdict
(chaosgpu.job.verdict does) and signals nothing.

What a Python stack can show, and its limits: py-spy sees Python frames only. A rank blocked in
C++ (`work.wait()`, `tensor.item()` on a GPU) shows the Python line that made the call; that
line's source text (read through /proc/PID/root, so it works for containers) tells what the call
is: the statement the line belongs to (a call spread over several lines), or the loop it runs in
when that loop polls (`while not work.is_completed(): time.sleep(0.01)`), never a line nearby.
With DistributedDataParallel the gradient all_reduce runs on the autograd engine's thread
(no Python frames); the main thread shows `backward()`.
"""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
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
_SOURCE_POLL = re.compile(r"\bis_completed\(\)|\.done\(\)")
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
    loop: int | None = None
    tid: int | None = None

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
    once per file, and parses a file where a statement or its loop is asked for (the last
    `TREES_KEPT` parsed files kept; what was found for a line is kept in `statements`)."""

    TREES_KEPT = 16

    def __init__(self) -> None:
        self._files: dict[tuple[int, str], list[str] | None] = {}
        self._trees: OrderedDict[tuple[int, str], ast.Module] = OrderedDict()
        self._unparsable: set[tuple[int, str]] = set()
        #: (pid, file, line) -> the statement's source and the poll loop around it, or None
        #: when the file cannot be parsed
        self.statements: dict[tuple[int, str, int],
                              tuple[str | None, tuple[int, str, tuple[str, str]] | None]
                              | None] = {}

    def _lines(self, pid: int, filename: str) -> list[str] | None:
        key = (pid, filename)
        if key not in self._files:
            try:
                with open(f"/proc/{pid}/root{filename}", encoding="utf-8",
                          errors="replace") as handle:
                    # lines as Python counts them (str.splitlines also splits at a form feed)
                    self._files[key] = handle.read().split("\n")
            except OSError:
                self._files[key] = None
        return self._files[key]

    def line(self, pid: int, filename: str, number: int) -> str | None:
        """The stripped source line, or None when the file cannot be read."""
        lines = self._lines(pid, filename)
        if lines is None or not 0 < number <= len(lines):
            return None
        return lines[number - 1].strip()[:200]

    def code(self, pid: int, filename: str) -> tuple[ast.Module, list[str]] | None:
        """The file parsed and its lines, or None when it cannot be read or parsed (a syntax
        this Python does not know): then only its lines are read, one at a time."""
        lines = self._lines(pid, filename)
        if lines is None:
            return None
        key = (pid, filename)
        if key in self._unparsable:
            return None
        if key in self._trees:
            self._trees.move_to_end(key)
        else:
            try:
                self._trees[key] = ast.parse("\n".join(lines))
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                self._unparsable.add(key)
                return None
            while len(self._trees) > self.TREES_KEPT:
                self._trees.popitem(last=False)
        return self._trees[key], lines


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
    names the site; otherwise the source of the innermost frame's line (a `.wait()`, an
    `is_completed()` poll, a collective called through a wrapper, and with `gpu` a `.item()` or
    `synchronize()`): the whole statement that line belongs to (a call spread over several
    lines: which of them a Python reports differs between versions), or the loop it runs in when
    that loop polls a work (a `while` whose condition calls `is_completed()`, or a loop whose
    body has `if ...is_completed()...: break`; a poll loop sleeps between checks). A line nearby
    that is neither is not read: a rank sleeping right after a collective is not in it. A file
    this Python cannot parse is read at the innermost line alone."""
    best: Site | None = None
    for thread in sample.threads:
        site = _thread_site(sample.pid, thread, sources, gpu)
        if site is not None and (best is None
                                 or SITE_KINDS.index(site.kind) < SITE_KINDS.index(best.kind)):
            best = site
    return best


_LOOPS = (ast.While, ast.For, ast.AsyncFor)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _children(node: ast.AST) -> list[ast.stmt]:
    found: list[ast.stmt] = []
    for name in ("body", "orelse", "finalbody"):
        value = getattr(node, name, None)
        if isinstance(value, list):
            found += [child for child in value if isinstance(child, ast.stmt)]
    for clause in [*getattr(node, "handlers", []), *getattr(node, "cases", [])]:
        found += clause.body
    return found


def _chain(tree: ast.Module, line: int) -> list[ast.stmt]:
    """The statements whose lines hold `line`, outermost first."""
    chain: list[ast.stmt] = []
    nodes: list[ast.stmt] = tree.body
    while True:
        for node in nodes:
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                chain.append(node)
                nodes = _children(node)
                break
        else:
            return chain


def _text(lines: list[str], first: int, last: int) -> str:
    """Lines first..last stripped and joined, a comment dropped from a line with no quote."""
    parts = []
    for raw in lines[first - 1:last]:
        text = raw.strip()
        if "#" in text and "'" not in text and '"' not in text:
            text = text[:text.index("#")].rstrip()
        if text:
            parts.append(text)
    return " ".join(parts)


def _segment(lines: list[str], node: ast.expr) -> str:
    """The source of an expression (its offsets count UTF-8 bytes)."""
    last = node.end_lineno or node.lineno
    text = [line.encode() for line in lines[node.lineno - 1:last]]
    if not text:
        return ""
    text[-1] = text[-1][:node.end_col_offset]
    text[0] = text[0][node.col_offset:]
    return b"\n".join(text).decode(errors="replace")


def _shares_its_line(tree: ast.Module, chain: list[ast.stmt], lines: list[str],
                     line: int) -> bool:
    """Whether the statement `line` belongs to shares that line with others of its block that
    name other places (`dist.all_reduce(t); time.sleep(6)`): a sample gives the line, not which
    of them runs, so none of them is where the thread waits."""
    block = tree.body if len(chain) == 1 else _children(chain[-2])
    here = [node for node in block if node.lineno <= line <= (node.end_lineno or node.lineno)
            and not _children(node)]
    if len(here) < 2:
        return False
    return len({_source_site(_segment(lines, node), True)  # type: ignore[arg-type]
                for node in here}) > 1


def _statement_text(chain: list[ast.stmt], lines: list[str], line: int) -> str:
    """The source of the statement `line` belongs to, all its lines (a call spread over
    several: which of them a Python reports differs between versions), or of the clause
    header it is in (`while ...:`, `except ...:`), from the header's first line down to it."""
    node = chain[-1]
    children = _children(node)
    if not children:
        return _text(lines, node.lineno, node.end_lineno or line)
    starts = [child.end_lineno + 1 for child in children
              if child.end_lineno is not None and child.end_lineno < line]
    starts += [clause.lineno for clause in getattr(node, "handlers", []) if clause.lineno <= line]
    return _text(lines, max([node.lineno, *starts]), line)


def _poll(chain: list[ast.stmt], lines: list[str],
          line: int) -> tuple[int, str, tuple[str, str]] | None:
    """Where the loop that runs `line` polls (the line of the poll, its source, the site it
    names), when the nearest loop around `line` in its function polls a collective's work or
    a future: a `while` whose condition calls `is_completed()` or `.done()`, or a loop whose
    body has `if ...is_completed()...:` (or `.done()`) with a `break` or `return` in it. None
    otherwise: a training loop that calls a collective and then sleeps is no poll loop, and
    neither is one that checks a stop flag (`if stop.wait(0): break`: `.wait(` is any blocking
    wait; `is_completed()` and a future's `done()` are the checks that return at once)."""
    for node in reversed(chain):
        if isinstance(node, _SCOPES):
            return None
        if not isinstance(node, _LOOPS):
            continue
        if not node.body or line > (node.body[-1].end_lineno or node.lineno):
            return None  # in the loop's `else:`
        polls: list[tuple[int, ast.expr]] = []
        if isinstance(node, ast.While):
            polls.append((node.lineno, node.test))
        polls += [(child.lineno, child.test) for child in node.body if isinstance(child, ast.If)
                  and any(isinstance(inner, (ast.Break, ast.Return)) for inner in child.body)]
        for header, test in polls:
            match = _SOURCE_POLL.search(_segment(lines, test))
            if match:
                return header, _text(lines, header, test.end_lineno or header)[:200], \
                    ("wait", match.group(0).lstrip("."))
        return None
    return None


def _thread_site(pid: int, thread: ThreadStack, sources: SourceLines, gpu: bool) -> Site | None:
    frames = thread.frames
    for index, frame in enumerate(frames):
        found = _frame_site(frame)
        if found is not None:
            caller = _user_caller(frames, index + 1)
            return Site(found[0], found[1], frame.where(), caller, None, thread.name,
                        _via(frames, index), tid=thread.tid)
    if not frames:
        return None
    inner = frames[0]  # the waiting call is made by this (user) frame itself, if any
    key = (pid, inner.filename, inner.line)
    if key not in sources.statements:
        code = sources.code(pid, inner.filename)
        if code is None:
            sources.statements[key] = None
        else:
            chain = _chain(code[0], inner.line)
            sources.statements[key] = (
                ("" if _shares_its_line(code[0], chain, code[1], inner.line)
                 else _statement_text(chain, code[1], inner.line)) if chain
                else sources.line(pid, inner.filename, inner.line),
                _poll(chain, code[1], inner.line))
    known = sources.statements[key]
    if known is None:  # unreadable or unparsable: the innermost line alone
        source = sources.line(pid, inner.filename, inner.line)
        found = _source_site(source, gpu)
        return None if found is None else Site(found[0], found[1], inner.where(), inner.where(),
                                               source, thread.name, tid=thread.tid)
    statement, poll = known
    found = _source_site(statement, gpu)
    source = statement[:200] if statement is not None else None
    if poll is not None and (found is None or found == poll[2]):
        at = Frame(inner.function, inner.filename, poll[0]).where()
        return Site(poll[2][0], poll[2][1], at, at, poll[1], thread.name, loop=poll[0],
                    tid=thread.tid)
    if found is None:
        return None
    return Site(found[0], found[1], inner.where(), inner.where(), source, thread.name,
                loop=poll[0] if poll is not None else None, tid=thread.tid)


def signature(sample: StackSample, threads: set[str] | None = None,
              site: Site | None = None) -> tuple[Any, ...]:
    """What changes when a rank makes progress and stays put while it waits: for every thread
    named in `threads` (where no thread has a name, as py-spy's --nonblocking gives them: the
    thread of `site` by its id, else "MainThread" is the one whose id is the process's; all of
    them when `threads` is None or none of those is found), its frames (file, function, line)
    with their simple local values, except the innermost frame's line (a poll loop alternates
    between the check and the sleep). When `site` (this sample's) is a poll loop read from the
    source (`site.loop`), its thread's innermost frame counts by that loop alone, neither by
    its line nor by its locals: a poll counter changes forever while the rank is blocked. Its
    outer frames still count (a step counter there), and so does leaving the loop."""
    result = []
    chosen = [t for t in sample.threads if threads is None or t.name in threads]
    if not chosen and threads is not None:
        # py-spy --nonblocking names no thread: the site's thread by its id, else the main
        # thread (its id is the process's own)
        wanted = site.tid if site is not None and site.tid is not None else sample.pid
        chosen = [t for t in sample.threads if t.tid == wanted]
    for thread in sorted(chosen or sample.threads, key=lambda t: t.tid or 0):
        loop = site.loop if site is not None and thread.tid == site.tid \
            and thread.name == site.thread else None
        frames: list[tuple[str, str, Any, tuple[tuple[str, str], ...]]] = []
        for index, frame in enumerate(thread.frames):
            if index == 0 and loop is not None:
                frames.append((frame.filename, frame.function, ("poll loop", loop), ()))
                continue
            frames.append((frame.filename, frame.function,
                           None if index == 0 else frame.line, frame.locals))
        result.append((thread.tid, tuple(frames)))
    return tuple(result)


def _at(entry: tuple[Any, ...]) -> str:
    """A signature's frame in words: its function, with its line or the poll loop it is in."""
    function, line = entry[1], entry[2]
    if isinstance(line, tuple):
        return f"{function} (poll loop at line {line[1]})"
    return function if line is None else f"{function}:{line}"


def describe_move(before: tuple[Any, ...], after: tuple[Any, ...]) -> str:
    """What differs between two signatures, for the evidence: the first thread and frame that
    changed (its function, line or poll loop, and the locals that changed), or the thread that
    came or went."""
    old = dict(before)
    new = dict(after)
    for tid in sorted(set(old) | set(new), key=lambda t: t or 0):
        if tid not in old or tid not in new:
            return f"thread {tid} {'started' if tid in new else 'ended'}"
        frames_old, frames_new = old[tid], new[tid]
        if len(frames_old) != len(frames_new):
            leaf = frames_new[0] if frames_new else None
            return (f"thread {tid}: {len(frames_old)} -> {len(frames_new)} frames"
                    + (f", now in {_at(leaf)}" if leaf else ""))
        for a, b in zip(frames_old, frames_new, strict=True):
            if a == b:
                continue
            if a[:3] != b[:3]:
                return f"thread {tid}: {_at(a)} -> {_at(b)}"
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
