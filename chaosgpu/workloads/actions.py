"""Chaos Toolkit actions that start and stop the reference workloads.

This module owns starting `hold` workers and `ring` jobs detached from the runner (own session,
DEVNULL stdin, output in a log file under the state dir; or, with `sandbox`, as backgrounded
shells exec'd inside a local pod like the field report's workers), recording them in
`<state>/workloads/<tag>.json` (host PIDs + starttimes), waiting for their readiness files under
a deadline, and stopping them by tag (idempotent; a tag this run never met is a typo, as
chaosgpu.scope tells). A new workload's tag is claimed here (`claim_tag`, TAG_RE: also the GPU
fault programs'); a tag an activity selects by is chaosgpu.arguments.TAG. Every process it
starts gets the runner's environment without its scope variables
(chaosgpu.process.environment.helper_env) plus the workload's own tag. It must not signal any
process that is not in a record it wrote.
"""

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from chaosgpu import state
from chaosgpu.arguments import (
    BOOL,
    COUNT,
    INDEX,
    MISSING_OK,
    NAME,
    POSITIVE,
    POSITIVE_SECONDS,
    SECONDS,
    TAG,
    Rule,
    checked,
    missing_advice,
    missing_allowed,
    one_of,
)
from chaosgpu.errors import ActivityError, InvalidArgument
from chaosgpu.process import terminate
from chaosgpu.process.environment import helper_env
from chaosgpu.sandbox.actions import INIT
from chaosgpu.sandbox.probes import SANDBOX_NAME
from chaosgpu.workloads.readiness import wait_all_ready
from chaosgpu.workloads.ring import (
    ASYNC_ERROR_HANDLING,
    LAUNCHER,
    ON_OOM,
    RING_BACKEND,
    SIGTERM_HANDLER,
)

__all__ = [
    "start_holders",
    "start_pod_with_holders",
    "start_ring",
    "stop_workload",
    "stop_all_workloads",
    "list_workloads",
]

logger = logging.getLogger("chaostoolkit")

KIND = "workloads"
#: The tag a new workload may be given (stricter than chaosgpu.arguments.TAG, which a selection
#: takes): 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit, so that it
#: is also a safe record and folder name. Matched whole (fullmatch): `^...$` let "x\n" through.
TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
VIAS = ("torch", "driver", "host", "auto")
SIGTERM_MODES = ("ignore", "exit", "cleanup")
#: start_ring's `inject` choices ("none" may also be given as false or null)
INJECTS = ("none", "python", "cuda", "both")
#: The hold workers a start_holders or start_pod_with_holders may start at most.
MOST_HOLDERS = 1000
_python_cache: dict[tuple[int, int], tuple[str, dict[str, str]]] = {}


def _proc() -> Any:
    from chaosgpu.sandbox import runtime

    return runtime


def check_tag_format(tag: Any) -> None:
    """ValueError naming `tag` unless TAG_RE takes it whole: the format of a new workload's tag
    (whether a running workload holds it is claim_tag's to say, when the workload starts)."""
    if not isinstance(tag, str) or not TAG_RE.fullmatch(tag):
        raise ValueError(
            f"invalid tag {tag!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


#: The rule of a new workload's `tag` (the starters here and the GPU faults'; None: one is
#: made): check_tag_format, so `chaosgpu validate` and the pre-run check refuse a tag the
#: start would refuse, before earlier activities ran.
WORKLOAD_TAG = Rule.by_check("a new workload's tag", check_tag_format)
VIA = one_of(VIAS)
SIGTERM_MODE = one_of(SIGTERM_MODES)
HOLDER_COUNT = Rule(f"an integer from 1 to {MOST_HOLDERS}",
                    lambda value: isinstance(value, int) and not isinstance(value, bool)
                    and 1 <= value <= MOST_HOLDERS)


#: start_ring's `inject`: one of INJECTS, or false or null for "none".
INJECT = Rule("one of " + ", ".join(map(repr, INJECTS)) + " (false or null: 'none')",
              lambda value: value is None or value is False
              or (isinstance(value, str) and value in INJECTS))


def _check_inject(inject: Any) -> None:
    """InvalidArgument (a ValueError) unless `inject` is one of start_ring's injector choices
    (INJECT)."""
    INJECT.require("inject", inject)


def claim_tag(tag: str | None, prefix: str) -> str:
    """The tag of a workload about to start (`prefix-<random>` when None), remembered as this
    run's (chaosgpu.scope). A tag TAG_RE refuses is ValueError naming it (check_tag_format); a
    tag a running workload holds is ValueError; a record left by a dead workload of that tag is
    cleared."""
    if tag is None:
        tag = f"{prefix}-{uuid.uuid4().hex[:8]}"
    check_tag_format(tag)
    from chaosgpu import scope

    scope.remember("tag", tag)  # the experiment's own tag: once it ends, "nothing left" holds
    existing = state.read_record(KIND, tag)
    if existing is not None:
        runtime = _proc()
        if any(
            runtime.process_state(p["pid"], p.get("starttime")) not in (None, "Z", "X")
            for p in existing.get("processes", [])
        ):
            raise ValueError(f"tag {tag!r} is already in use by a running workload")
        stop_workload(tag, grace_s=0)
    return tag


def _reap_in_background(process: subprocess.Popen[bytes]) -> None:
    """Reap the child when it exits, so a killed workload never lingers as the runner's zombie."""
    threading.Thread(
        target=process.wait, name=f"chaosgpu-reap-{process.pid}", daemon=True
    ).start()


def _package_root() -> str:
    import chaosgpu

    return str(Path(chaosgpu.__file__).resolve().parent.parent)


def python_for_user(uid: int, gid: int) -> tuple[str, dict[str, str]]:
    """Return a Python interpreter that user `uid` can run and that imports chaosgpu, plus env."""
    key = (uid, gid)
    if key in _python_cache:
        return _python_cache[key]
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise RuntimeError("setpriv not found (util-linux): cannot run workers as another user")
    extra = {"PYTHONPATH": _package_root()}
    candidates = [sys.executable, shutil.which("python3"), "/usr/bin/python3"]
    tried = []
    for exe in dict.fromkeys(c for c in candidates if c):
        probe = subprocess.run(
            [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
             "sh", "-c", '"$@"', "sh", exe, "-c", "import chaosgpu.workloads.hold"],
            env=helper_env(**extra), stdin=subprocess.DEVNULL, capture_output=True,
            timeout=60, cwd="/",
        )  # fmt: skip
        if probe.returncode == 0:
            _python_cache[key] = (exe, extra)
            return exe, extra
        tried.append(exe)
    raise RuntimeError(
        f"no Python interpreter usable by uid {uid} imports chaosgpu (tried {', '.join(tried)}): "
        "install chaosgpu where that user can read it"
    )


def _workdir(tag: str, owner: tuple[int, int] | None) -> Path:
    if owner is None:
        path = state.state_dir() / KIND / f"{tag}.d"
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
    # A non-root worker cannot reach the (0700) state dir: give it a private dir of its own.
    path = Path(tempfile.mkdtemp(prefix=f"chaosgpu-{tag}-"))
    os.chown(path, owner[0], owner[1])
    return path


def _record_process(pid: int, ns_pid: int | None = None, role: str = "worker") -> dict[str, Any]:
    return {
        "pid": pid,
        "ns_pid": ns_pid,
        "starttime": _proc().process_starttime(pid),
        "role": role,
    }


@checked(count=HOLDER_COUNT, mib=INDEX, device=INDEX, timeout_s=POSITIVE_SECONDS, via=VIA,
         on_sigterm=SIGTERM_MODE, sandbox=SANDBOX_NAME, tag=WORKLOAD_TAG, allow_host_fallback=BOOL)
def start_holders(
    count: int = 1,
    mib: int = 256,
    via: str = "auto",
    on_sigterm: str = "ignore",
    sandbox: Optional[str] = None,
    tag: Optional[str] = None,
    device: int = 0,
    allow_host_fallback: bool = False,
    timeout_s: float = 60.0,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Start `count` hold workers of `mib` MiB each and wait (up to `timeout_s`) until all hold it.

    `via`: torch, driver (CUDA driver API, no torch), host (host memory, no GPU needed) or auto.
    `via="torch"` needs GPU `device`, as `"driver"` and `"auto"` do without
    `allow_host_fallback`: where fewer GPUs are visible (counted as backend "auto" of
    start_ring counts them) it is InvalidArgument before any worker starts.
    `on_sigterm`: ignore (the field report's workers), exit or cleanup (free and exit at once).
    Without `sandbox` they run on the host in their own sessions; with `sandbox` (a local pod's
    name) they are started inside it as backgrounded exec'd shells, so they become orphans of the
    pod's PID 1 like the report's. Returns the tag, host and namespace PIDs and readiness documents.
    """
    _require_gpu_for_via(via, device, allow_host_fallback)
    owner: tuple[int, int] | None = None
    exe, extra_env = sys.executable, dict[str, str]()
    if sandbox is not None:
        from chaosgpu.sandbox import runtime

        box = runtime.get_record(sandbox)
        if box is None:
            raise ValueError(f"no sandbox named {sandbox!r}")
        if box.get("uid") not in (None, 0) and not box.get("userns"):
            owner = (int(box["uid"]), int(box.get("gid") or box["uid"]))
            exe, extra_env = python_for_user(*owner)
    tag = claim_tag(tag, "hold")
    workdir = _workdir(tag, owner)
    record: dict[str, Any] = {
        "tag": tag,
        "kind": "hold",
        "sandbox": sandbox,
        "workdir": str(workdir),
        "workdir_private": owner is not None,
        "created_at": time.time(),
        "runner": {"pid": os.getpid(), "starttime": _proc().process_starttime(os.getpid())},
        "config": {"count": count, "mib": mib, "via": via, "on_sigterm": on_sigterm,
                   "device": device},  # fmt: skip
        "processes": [],
    }
    state.write_record(KIND, tag, record)
    ready_files = []
    try:
        for index in range(count):
            ready = workdir / f"holder{index}.json"
            ready_files.append(ready)
            argv = _hold_argv(exe, mib, via, device, on_sigterm, ready, allow_host_fallback)
            env = dict(extra_env, CHAOSGPU_TAG=tag)
            log = workdir / f"holder{index}.log"
            if sandbox is not None:
                from chaosgpu.sandbox import runtime

                started = runtime.exec_in(
                    sandbox, argv, detached=True, env=env, log_path=str(log), timeout_s=timeout_s
                )
                entry = _record_process(started["host_pid"], started["ns_pid"])
            else:
                with open(log, "ab") as handle:
                    process = subprocess.Popen(
                        argv, env=helper_env(**env), stdin=subprocess.DEVNULL,
                        stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                _reap_in_background(process)
                entry = _record_process(process.pid)
            record["processes"].append(entry)
            state.write_record(KIND, tag, record)
        documents = wait_all_ready(
            ready_files, timeout_s, pids=[p["pid"] for p in record["processes"]]
        )
    except Exception as error:
        logs = " | ".join(_tail(p.with_suffix(".log")) for p in ready_files)
        stop_workload(tag, grace_s=0)
        raise RuntimeError(
            f"hold workers of tag {tag!r} did not get ready: {error} {logs}"
        ) from None
    return {
        "tag": tag,
        "kind": "hold",
        "sandbox": sandbox,
        "backend": documents[0]["via"] if documents else via,
        "pids": [p["pid"] for p in record["processes"]],
        "ns_pids": [p["ns_pid"] if p["ns_pid"] is not None else d["pid"]
                    for p, d in zip(record["processes"], documents, strict=True)],  # fmt: skip
        "mib": mib,
        "ready": documents,
    }


def _hold_argv(exe: str, mib: int, via: str, device: int, on_sigterm: str, ready: Path,
               allow_host_fallback: bool) -> list[str]:  # fmt: skip
    argv = [
        exe, "-m", "chaosgpu.workloads", "hold", "--mib", str(mib), "--via", via,
        "--device", str(device), "--on-sigterm", on_sigterm, "--ready-file", str(ready),
    ]  # fmt: skip
    if allow_host_fallback:
        argv.append("--allow-host-fallback")
    return argv


@checked(pod=SANDBOX_NAME, init=INIT, count=HOLDER_COUNT, mib=INDEX, grace_s=SECONDS, uid=INDEX,
         gid=INDEX, device=INDEX, timeout_s=POSITIVE_SECONDS, via=VIA, on_sigterm=SIGTERM_MODE,
         tag=WORKLOAD_TAG, allow_host_fallback=BOOL)
def start_pod_with_holders(
    pod: str,
    init: str = "dumb-init",
    count: int = 1,
    mib: int = 256,
    via: str = "auto",
    on_sigterm: str = "cleanup",
    tag: Optional[str] = None,
    grace_s: float = 30.0,
    uid: Optional[int] = None,
    gid: Optional[int] = None,
    device: int = 0,
    allow_host_fallback: bool = False,
    timeout_s: float = 60.0,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Create local pod `pod` whose main process runs `count` hold workers, and wait until they
    hold their memory. Unlike exec'd workers, these are the pod's own processes: with `init`
    "dumb-init" they share its child's process group, so SIGTERM to the pod reaches them (the
    report's remediation); "tini" forwards to the shell that started them; "none" makes a single
    worker PID 1; "sleep" falls back to exec'd workers (orphans, as in the report). A `via` that
    needs GPU `device` where it is not visible is refused before the pod is created, as
    start_holders refuses it.
    Returns the tag, pod, host and namespace PIDs, readiness documents."""
    _require_gpu_for_via(via, device, allow_host_fallback)
    runtime = _proc()
    if init == "sleep":
        runtime.create(pod, init="sleep", uid=uid, gid=gid, grace_s=grace_s, owner_pid=os.getpid())
        try:
            started = start_holders(count=count, mib=mib, via=via, on_sigterm=on_sigterm,
                                    sandbox=pod, tag=tag, device=device,
                                    allow_host_fallback=allow_host_fallback,
                                    timeout_s=timeout_s)  # fmt: skip
        except Exception:
            runtime.remove(pod)
            raise
        return dict(started, pod=pod, init=init)
    if runtime.get_record(pod) is not None and runtime.sandbox_alive(pod):
        raise ValueError(f"sandbox name {pod!r} is already in use")
    owner: tuple[int, int] | None = None
    exe, extra_env = sys.executable, dict[str, str]()
    if uid not in (None, 0) and os.geteuid() == 0:
        assert uid is not None
        owner = (uid, gid if gid is not None else uid)
        exe, extra_env = python_for_user(*owner)
    tag = claim_tag(tag, "pod")
    workdir = _workdir(tag, owner)
    ready_files = [workdir / f"holder{i}.json" for i in range(count)]
    commands = [_hold_argv(exe, mib, via, device, on_sigterm, ready, allow_host_fallback)
                for ready in ready_files]  # fmt: skip
    if init == "none" and count == 1:
        argv = commands[0]
    else:
        script = " ".join(
            f"{shlex.join(c)} >>{shlex.quote(str(r.with_suffix('.log')))} 2>&1 &"
            for c, r in zip(commands, ready_files, strict=True)
        )
        argv = ["sh", "-c", script + " wait"]
    record: dict[str, Any] = {
        "tag": tag, "kind": "hold", "sandbox": pod, "pod_main": True,
        "workdir": str(workdir), "workdir_private": owner is not None,
        "created_at": time.time(),
        "runner": {"pid": os.getpid(), "starttime": runtime.process_starttime(os.getpid())},
        "config": {"count": count, "mib": mib, "via": via, "on_sigterm": on_sigterm,
                   "device": device, "init": init},
        "processes": [],
    }  # fmt: skip
    state.write_record(KIND, tag, record)
    try:
        box = runtime.create(pod, init=init, argv=argv, uid=uid, gid=gid, grace_s=grace_s,
                             env=dict(extra_env, CHAOSGPU_TAG=tag),
                             owner_pid=os.getpid())  # fmt: skip
        documents = wait_all_ready(ready_files, timeout_s, pids=[box["pid1"]] * count)
        by_ns = {p["ns_pid"]: p["pid"] for p in runtime.processes(pod)}
        for document in documents:
            host = by_ns.get(document["pid"])
            if host is not None:
                record["processes"].append(_record_process(host, document["pid"]))
        state.write_record(KIND, tag, record)
    except Exception as error:
        logs = " | ".join(_tail(p.with_suffix(".log")) for p in ready_files)
        runtime.remove(pod)
        stop_workload(tag, grace_s=0)
        raise RuntimeError(f"pod {pod!r} with workers did not get ready: {error} {logs}") from None
    return {
        "tag": tag,
        "pod": pod,
        "init": init,
        "pid1": box["pid1"],
        "backend": documents[0]["via"] if documents else via,
        "pids": [p["pid"] for p in record["processes"]],
        "ns_pids": [p["ns_pid"] for p in record["processes"]],
        "mib": mib,
        "ready": documents,
    }


def _require_gpu_for_via(via: str, device: int, allow_host_fallback: bool) -> None:
    """InvalidArgument, before any worker starts, when `via` needs GPU `device` and fewer GPUs
    are visible: "torch" always, "driver" and "auto" unless `allow_host_fallback` lets them
    hold host memory instead (a worker would start, find no GPU and exit 3 after seconds). GPUs are
    counted as ring.resolve_backend counts them for backend "auto" (cuda_driver.gpu_count:
    NVML, else the CUDA driver API), which never counts fewer than torch or the driver API
    sees: a GPU counted here may still fail its worker, which then says why."""
    if via == "host" or (via in ("auto", "driver") and allow_host_fallback):
        return
    from chaosgpu.workloads.cuda_driver import gpu_count

    gpus = gpu_count()
    if device >= gpus:
        seen = "no GPU is visible here" if gpus == 0 else f"only {gpus} GPU(s) are visible here"
        way = ("use via 'host' on a machine without a GPU" if via == "torch"
               else "use via 'host', or allow_host_fallback: true")
        raise InvalidArgument(
            f"via {via!r} holds GPU memory on GPU {device} (device), and {seen} (NVML, else "
            f"the CUDA driver API): no worker was started; {way}")


def _tail(path: Path, limit: int = 400) -> str:
    try:
        return path.read_text(errors="replace")[-limit:].strip()
    except OSError:
        return ""


@checked(world_size=COUNT, process_group_timeout_s=POSITIVE_SECONDS, mib=INDEX,
         iters_per_s=POSITIVE, timeout_s=POSITIVE_SECONDS, matmul=INDEX, step_mib=INDEX,
         job_id=NAME, backend=RING_BACKEND, launcher=LAUNCHER,
         async_error_handling=ASYNC_ERROR_HANDLING, sigterm_handler=SIGTERM_HANDLER,
         on_oom=ON_OOM, inject=INJECT, tag=WORKLOAD_TAG)
def start_ring(
    world_size: int = 2,
    backend: str = "auto",
    launcher: str = "bare",
    process_group_timeout_s: float = 60.0,
    async_error_handling: int = 3,
    sigterm_handler: str = "none",
    mib: int = 0,
    iters_per_s: float = 10.0,
    tag: Optional[str] = None,
    job_id: Optional[str] = None,
    timeout_s: float = 120.0,
    matmul: int = 0,
    step_mib: int = 0,
    on_oom: str = "fail",
    inject: str = "none",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Start a ring of `world_size` ranks doing all_reduce, and wait until every rank ran one.

    `backend`: nccl (one GPU per rank), gloo (CPU) or auto; `launcher`: bare (ranks started
    directly, the report's exec'd ranks) or torchrun. `process_group_timeout_s`,
    `async_error_handling` and `sigterm_handler` ("destroy": destroy_process_group on SIGTERM) are
    the remediations under test. Every rank carries CHAOSGPU_JOB=`job_id` (default: the tag) and
    CHAOSGPU_TAG. Waits up to `timeout_s`; returns the tag, job id, backend, rank and agent PIDs.
    GPU-fault victims: `matmul` (an NxN matmul per iteration on the rank's GPU), `step_mib` (a
    fresh allocation per iteration), `on_oom` (fail or skip the step), `inject` ("python",
    "cuda" or "both": ranks start armed with chaosgpu's fault injectors, see
    chaosgpu.gpu.actions.inject_rank_fault and inject_cuda_fault; "none" by default).
    Refused (InvalidArgument) before any process starts where the node cannot run it: backend
    "nccl" with fewer GPUs than `world_size`, `inject` "cuda" or "both" with no GPU (the CUDA
    injector arms when a rank initialises CUDA: without a GPU it never would). GPUs are counted
    as backend "auto" counts them (chaosgpu.workloads.ring.resolve_backend).
    """
    from chaosgpu.workloads.ring import RingConfig, launch_ring, resolve_backend

    backend = resolve_backend(backend, world_size)  # nccl without enough GPUs: refused here
    if inject in ("cuda", "both"):
        _require_gpu_for_cuda_injector(inject)
    injector_env = _injector_env(inject)
    tag = claim_tag(tag, "ring")
    workdir = _workdir(tag, None)
    from chaosgpu import scope

    scope.remember("job", job_id or tag)
    config = RingConfig(
        backend=backend,
        world_size=world_size,
        launcher=launcher,
        timeout_s=process_group_timeout_s,
        async_error_handling=async_error_handling,
        sigterm_handler=sigterm_handler,
        mib=mib,
        iters_per_s=iters_per_s,
        ready_dir=str(workdir),
        tag=tag,
        job_id=job_id or tag,
        log_dir=str(workdir),
        matmul=matmul,
        step_mib=step_mib,
        on_oom=on_oom,
        extra_env=injector_env,
    )
    try:
        config.validate()
    except ValueError:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    record: dict[str, Any] = {
        "tag": tag,
        "kind": "ring",
        "sandbox": None,
        "workdir": str(workdir),
        "workdir_private": False,
        "created_at": time.time(),
        "runner": {"pid": os.getpid(), "starttime": _proc().process_starttime(os.getpid())},
        "processes": [],
    }
    state.write_record(KIND, tag, record)
    try:
        launch = launch_ring(config, detach=True)
        for process in launch.processes:
            _reap_in_background(process)
        role = "rank" if launcher == "bare" else "agent"
        record["processes"] = [_record_process(pid, role=role) for pid in launch.pids]
        record.update(job_id=launch.job_id, backend=launch.backend, launcher=launcher,
                      master_port=launch.master_port, world_size=world_size)  # fmt: skip
        state.write_record(KIND, tag, record)
        documents = launch.wait_ready(timeout_s)
        if launcher == "torchrun":
            record["processes"] += [_record_process(d["pid"], role="rank") for d in documents]
            state.write_record(KIND, tag, record)
    except Exception as error:
        logs = " | ".join(_tail(p) for p in sorted(workdir.glob("*.log")))
        stop_workload(tag, grace_s=0)
        raise RuntimeError(f"ring {tag!r} did not get ready: {error} {logs}") from None
    return {
        "tag": tag,
        "kind": "ring",
        "job_id": launch.job_id,
        "backend": launch.backend,
        "launcher": launcher,
        "world_size": world_size,
        "master_port": launch.master_port,
        "pids": [d["pid"] for d in documents],
        "agent_pid": launch.pids[0] if launcher == "torchrun" else None,
        "ranks": {str(d["rank"]): d["pid"] for d in documents},
        "ready": documents,
    }


def _require_gpu_for_cuda_injector(inject: str) -> None:
    """InvalidArgument, before any rank starts, when no GPU is visible (counted as backend
    "auto" counts them): libcuda loads the CUDA injector when a rank initialises CUDA, which
    never happens without a GPU, so inject_cuda_fault would later find it unarmed."""
    from chaosgpu.workloads.cuda_driver import gpu_count

    if gpu_count() < 1:
        raise InvalidArgument(
            f"inject {inject!r} arms the CUDA injector, which the CUDA driver loads when a rank "
            "initialises CUDA, and no GPU is visible here (NVML, else the CUDA driver API): it "
            "would never arm; no rank was started; use inject 'python' or 'none'")


def _injector_env(inject: str) -> dict[str, str]:
    _check_inject(inject)
    if inject in ("none", None, False):
        return {}
    from chaosgpu.gpu.injector import environment

    env = environment(cuda=inject in ("cuda", "both"))
    if inject == "cuda":
        env.pop("PYTHONPATH")
    return env


@checked(tag=TAG, grace_s=SECONDS, deadline_s=POSITIVE_SECONDS, missing_ok=MISSING_OK)
def stop_workload(
    tag: str,
    grace_s: float = 5.0,
    deadline_s: float = 10.0,
    missing_ok: Union[bool, str] = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Stop the workload `tag`: SIGCONT+SIGTERM, up to `grace_s` to exit, then SIGKILL; idempotent.

    Only processes recorded under the tag (same PID and starttime) are signalled, through pidfds;
    one in chaosgpu's frozen freezer cgroup is let out of it first (it would keep the signals
    pending: "released_from_freezer" names the group). Waits up to `deadline_s` after SIGKILL.
    Removes the record and the workload's files, and says "stopped": true, only once every
    process has ended; while one survives (or is refused: in a frozen cgroup chaosgpu did not
    make, for one) it fails naming them and keeps the record for a later stop or cleanup. A tag
    with no record returns {"stopped": false} where `missing_ok` allows it
    (chaosgpu.arguments.missing_allowed): true always; "before-method", the default, for a tag
    this run met (it started the workload, stopped since) and, for any tag, before the method
    starts; false never. Otherwise it fails,
    naming the recorded workloads (a typo would leave the real one running). `tag` is matched
    exactly, never stripped: one that is not a tag (chaosgpu.arguments.TAG: empty, whitespace,
    control characters) is InvalidArgument.
    """
    record = state.read_record(KIND, tag)
    if record is None:
        return no_workload(tag, missing_ok)
    outcome: dict[str, str] = {}
    targets = []
    for entry in record.get("processes", []):
        pid, starttime = int(entry["pid"]), entry.get("starttime")
        # No start time recorded: the worker had exited before it was recorded, so whatever has
        # this PID now is a stranger: never signal it.
        if starttime is None:
            outcome[str(pid)] = "already gone"
        else:
            targets.append(terminate.Target(pid, int(starttime)))
    # Recorded processes are ours: they may run as another user or be PID 1 of a pod.
    rules = terminate.Rules(allow_other_users=True, allow_ns_init=True)
    results = terminate.terminate(targets, ["SIGTERM", "SIGKILL"], grace_s, grace_s + deadline_s,
                                  rules, cont_first=True)
    stuck = []
    released = {}
    for result in results:
        said = _STOPPED.get(result.exited_on or result.result)
        if result.result == "refused" and result.reason_code != "reused":
            said = f"refused: {result.reason}"
        outcome[str(result.pid)] = said or "already gone"
        if result.released_from is not None:
            released[str(result.pid)] = result.released_from["cgroup"]
        if result.result in ("alive", "refused") and result.reason_code != "reused":
            stuck.append(f"PID {result.pid}: {outcome[str(result.pid)]}")
    if stuck:  # keep the record so that a later stop or cleanup finds what is still alive
        raise ActivityError(
            f"workload {tag!r} was not stopped: {len(stuck)} of its process(es) still alive "
            f"({'; '.join(stuck)}); its record is kept for a later stop_workload or "
            "`chaosgpu cleanup`")
    if record.get("workdir"):
        shutil.rmtree(record["workdir"], ignore_errors=True)
    state.remove_record(KIND, tag)
    done: dict[str, Any] = {"tag": tag, "stopped": True, "processes": outcome}
    if released:  # frozen in chaosgpu's freezer: let out before the signals (they were pending)
        done["released_from_freezer"] = released
    return done


def no_workload(tag: str, missing_ok: Any) -> dict[str, Any]:
    """The answer of a stop (stop_workload, stop_gpu_fault) for a tag with no record;
    ActivityError for a typo (a tag this run never met, chaosgpu.scope.tag_seen, where
    `missing_ok` does not allow it)."""
    from chaosgpu.scope import tag_seen

    seen = tag_seen(tag)
    if missing_allowed(missing_ok, seen):
        why = "it ended (this run met that tag)" if seen else f"missing_ok={missing_ok!r}"
        return {"tag": tag, "stopped": False, "note": f"no such workload: {why}"}
    known = sorted(state.list_records(KIND))
    raise ActivityError(
        f"no workload tagged {tag!r} is recorded, and this run never met that tag (no workload "
        f"it started, no process seen carrying it): a typo? Recorded workloads: "
        f"{known or 'none'}. A workload that may be absent {missing_advice(missing_ok)}")


# What stop_workload says of each process, from the terminate primitive's outcome.
_STOPPED = {"SIGTERM": "exited on SIGTERM", "SIGKILL": "killed",
            "alive": "still alive after SIGKILL", "gone": "already gone"}


@checked(grace_s=SECONDS, deadline_s=POSITIVE_SECONDS)
def stop_all_workloads(
    grace_s: float = 0.0,
    deadline_s: float = 10.0,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Stop every recorded workload (a rollback of last resort, and `chaosgpu cleanup`): each as
    `stop_workload` does, with `grace_s` (default 0: SIGKILL at once). One that cannot be
    stopped does not stop the others: every workload is tried, then one error names every
    failure."""
    done: list[dict[str, Any]] = []
    failures: list[str] = []
    for tag in state.list_records(KIND):
        try:
            # missing_ok: a record removed since it was listed (a stop running beside this one)
            # has ended; it is no typo.
            done.append(stop_workload(tag, grace_s=grace_s, deadline_s=deadline_s,
                                      missing_ok=True))
        except Exception as error:  # the next workloads must still be stopped
            logger.warning("chaosgpu: could not stop workload %s: %s", tag, error)
            failures.append(f"{tag}: {type(error).__name__}: {error}")
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(failures) + len(done)} workload(s) could not "
                           f"be stopped (the others were): {'; '.join(failures)}")
    return done


def list_workloads(
    configuration: Optional[Dict[str, Any]] = None, secrets: Optional[Dict[str, Any]] = None
) -> List[Dict[str, Any]]:
    """List every recorded workload with, for each process, whether it is still alive."""
    runtime = _proc()
    listed = []
    for tag, record in state.list_records(KIND).items():
        processes = [
            dict(p, state=runtime.process_state(p["pid"], p.get("starttime")))
            for p in record.get("processes", [])
        ]
        alive = [p["pid"] for p in processes if p["state"] not in (None, "Z", "X")]
        listed.append(dict(record, tag=tag, processes=processes, alive=alive))
    return listed
