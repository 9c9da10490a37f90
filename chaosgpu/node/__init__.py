"""The node's truth, typed: chaosgpu's access to the census of `probes/node_census.py`.

This package owns the typed face of the census for the rest of chaosgpu (job, process, timeline,
agent, sandbox ...). It loads the in-target program with `chaosgpu.intarget.load` and delegates
every reading to it: it must never read /proc or NVML itself (one reading for the whole project).
The low-level /proc readers (one read per call, typed errors as psutil has them: NoSuchProcess,
AccessDenied) are the in-target program's own public functions, re-exported here; the rest of
chaosgpu reads /proc through them and nothing else. The census schema (`chaosgpu.census/1`) is
documented in docs/census.md.
"""

from __future__ import annotations

from chaosgpu.intarget import load

TYPE_CHECKING = False  # mypy reads it as true; typing costs ~5-9 ms of every command's start
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

try:
    from chaosgpu.intarget.probes import node_census as _program
except ModuleNotFoundError:  # a source tree on sys.path, not installed: probes/ is not mapped
    _program = load("probes", "node_census")  # type: ignore[assignment]

# the low-level readers: the in-target program's own public functions and errors
AccessDenied = _program.AccessDenied
NoSuchProcess = _program.NoSuchProcess
ProcError = _program.ProcError
nvidia_registered = _program.nvidia_registered
open_stat = _program.open_stat
open_statm = _program.open_statm
pid_ns_inode = _program.pid_ns_inode
net_ns_inode = _program.net_ns_inode
read_children = _program.read_children
read_cmdline = _program.read_cmdline
read_environ = _program.read_environ
read_pid_ns = _program.read_pid_ns
read_proc_file = _program.read_proc_file
read_stat = _program.read_stat
read_status = _program.read_status
last_pid = _program.last_pid
read_sysctl = _program.read_sysctl
shows_own_pid_ns = _program.shows_own_pid_ns
rss_bytes = _program.rss_bytes
uptime_s = _program.uptime_s

__all__ = [
    "AccessDenied",
    "NoSuchProcess",
    "ProcError",
    "nvidia_registered",
    "open_stat",
    "open_statm",
    "pid_ns_inode",
    "net_ns_inode",
    "read_children",
    "read_cmdline",
    "read_environ",
    "read_pid_ns",
    "read_proc_file",
    "read_stat",
    "read_status",
    "last_pid",
    "read_sysctl",
    "shows_own_pid_ns",
    "rss_bytes",
    "uptime_s",
    "SCHEMA",
    "census_module",
    "take_census",
    "read_process",
    "process_starttime",
    "process_state",
    "process_activity",
    "tcp_sockets",
    "list_pids",
    "parse_container",
    "nvml_snapshot",
    "nvml_device_memory",
    "nvml_gpu_processes",
]

SCHEMA = "chaosgpu.census/1"


def census_module() -> ModuleType:
    """Return the loaded in-target program `probes/node_census.py` (loaded once per process)."""
    return load("probes", "node_census")


def take_census(
    proc_root: str = "/proc",
    env: bool = True,
    fds: bool | str = True,
    gpu: bool = True,
    gpu_snapshot: dict[str, Any] | None = None,
    pids: list[int] | None = None,
    cgroup_root: str = "/sys/fs/cgroup",
    cache: bool = False,
    detail: str = "full",
    workers: int = 1,
) -> dict[str, Any]:
    """Take the node census (processes, GPU, attribution, zombies, orphans, jobs); see
    `node_census.census` and docs/census.md. `gpu_snapshot` replaces NVML by a recorded `gpu`
    section; `pids` limits the census to those processes; `cache` keeps the fields that do not
    change during a process's life across calls (faster repeated censuses; zombies keep the
    tag and rank they had while alive); `detail="lite"` reads cmdline, cgroup, env and fds only
    for candidate processes (GPU holders, zombies, orphan candidates, workers by name);
    `workers` > 1 splits the reading over readers (N - 1 forked), 0 picks as many as pay; `fds`
    scans for /dev/nvidia* where an NVIDIA device is registered (`"always"`: everywhere)."""
    result: dict[str, Any] = census_module().census(
        proc_root=proc_root, env=env, fds=fds, gpu=gpu, gpu_snapshot=gpu_snapshot, pids=pids,
        cgroup_root=cgroup_root, cache=cache, detail=detail, workers=workers)
    return result


def read_process(pid: int, proc_root: str = "/proc", env: bool = True,
                 fds: bool = True) -> dict[str, Any] | None:
    """Return the census record of one process, or None when it does not exist."""
    result: dict[str, Any] | None = census_module().read_process(pid, proc_root, env=env, fds=fds)
    return result


def process_starttime(pid: int, proc_root: str = "/proc") -> int | None:
    """Return the start time (clock ticks since boot) of `pid`, or None when it is gone."""
    result: int | None = census_module().process_starttime(pid, proc_root)
    return result


def process_state(pid: int, proc_root: str = "/proc", starttime: int | None = None,
                  fd: int | None = None) -> str | None:
    """Return the one-letter state of `pid` (R, S, D, Z, T ...), or None when it is gone (or,
    with `starttime`, when the PID is another process's now): one read of its stat, a pread of
    `fd` (from `open_stat`) when given."""
    result: str | None = census_module().process_state(pid, proc_root, starttime=starttime,
                                                        fd=fd)
    return result


def process_activity(pid: int, proc_root: str = "/proc", threads: bool = True,
                     sockets: bool = True) -> dict[str, Any] | None:
    """One sample of what `pid` is doing now (state, CPU ticks, write counters, threads with
    their names, states and wchan, socket inodes), or None when it is gone; see
    `node_census.process_activity`."""
    result: dict[str, Any] | None = census_module().process_activity(
        pid, proc_root, threads=threads, sockets=sockets)
    return result


def tcp_sockets() -> dict[int, dict[str, Any]]:
    """Every TCP socket of this network namespace by inode, with the kernel's byte counters and
    timers (netlink sock_diag); raises OSError when netlink is refused."""
    result: dict[int, dict[str, Any]] = census_module().tcp_sockets()
    return result


def list_pids(proc_root: str = "/proc") -> list[int]:
    """Return every PID of `proc_root`."""
    result: list[int] = census_module().list_pids(proc_root)
    return result


def parse_container(cgroup_path: str | None) -> dict[str, Any] | None:
    """Return `{"runtime", "id", "pod_uid"}` parsed from a cgroup path, or None."""
    result: dict[str, Any] | None = census_module().parse_container(cgroup_path)
    return result


def nvml_snapshot(with_processes: bool = True) -> dict[str, Any]:
    """Return the census's `gpu` section (`{"available": False, "reason": ...}` without NVML)."""
    result: dict[str, Any] = census_module().nvml_snapshot(with_processes=with_processes)
    return result


def nvml_device_memory() -> list[dict[str, Any]]:
    """Fast per-GPU memory: `[{"index", "used_mib", "total_mib"}]` (empty without NVML)."""
    result: list[dict[str, Any]] = census_module().nvml_device_memory()
    return result


def nvml_gpu_processes() -> list[dict[str, Any]]:
    """Fast GPU process list: `[{"gpu_index", "pid" (host), "used_mib"}]` (empty without NVML)."""
    result: list[dict[str, Any]] = census_module().nvml_gpu_processes()
    return result
