#!/usr/bin/env python3
# ruff: noqa: UP006, UP007, UP031, UP035, UP045
"""The node's truth: one reading of /proc and NVML for the whole of chaosgpu.

This in-target program runs where chaosgpu is not installed (a container, a node, through the
Kubernetes exec API) and is loaded as a module by `chaosgpu.node` locally, so every reading of
/proc and NVML in the project lives here and only here. It needs the standard library alone:
NVML is called through ctypes in the driver's libnvidia-ml.so.1, where the node has one (no
pynvml); the syntax stays Python 3.8 compatible because old containers run it. It must not
change anything on the node: it only reads.

Run it as a program: ``python3 node_census.py [--no-env] [--no-fds] [--no-gpu] [--pid N]
[--proc-root DIR] [--gpu-snapshot FILE|-]`` (or ``--tcp-sockets``) prints one JSON document
(schema ``chaosgpu.census/1``, described in docs/census.md) and exits 0; bad arguments print
``{"error": ...}`` and exit 2.

Definitions (also in docs/census.md):

* zombie: state ``Z`` with no thread left (exited, not yet reaped by its parent). A ``Z``
  whose thread count is above 1 is a thread-group leader that ended while other threads run
  or exit (a CUDA process's teardown in the driver takes seconds): ``exiting``, not a zombie
  (nothing to reap yet).
* orphan (``orphan_reason``): judged from the process's own PID namespace, so that the host and
  a census run inside that namespace agree. Its parent, in its own namespace (a parent outside
  it reads PPID 0 there: not judged), is that namespace's init or a known subreaper
  (containerd-shim, conmon, tini, dumb-init, catatonit ...), and it is none of: a session
  leader; in a session the namespace sees that is its parent's own; in a session whose leader
  is outside the namespace (as unshare and nsenter leave it), the leader of its own process
  group (as tini makes its child). Sessions and groups are compared as the namespace sees them
  (NSsid/NSpgid from the host; 0 when the leader is outside). Never orphans: namespace inits,
  kernel threads; an orphaned zombie is both. Limits: a deliberate double-fork daemon looks
  orphaned; a process that called setsid after being orphaned looks intended; an unknown
  subreaper is not recognised; under an init whose own session is outside its namespace
  (unshare without setsid), the children it forks without a group of their own look
  reparented in both views.
* GPU attribution: NVML reports PIDs of the caller's PID namespace when the driver can
  translate them, else PIDs of the initial (host) namespace. An observer in the host namespace
  finds them directly and translates to the PID seen inside the container with the last field
  of ``NSpid``. A nested observer trusts an NVML PID only when the process of that PID in its
  own /proc holds /dev/nvidia* fds; otherwise (an untranslated host PID: its /proc shows no
  host PID at all) the GPU process is reported with NVML's PID and ``"not visible here"``,
  never as an orphan or as gone.
"""

from __future__ import annotations

import _thread
import os
import sys
import time

TYPE_CHECKING = False  # mypy reads it as true; typing costs ~5-9 ms of every command's start
if TYPE_CHECKING:
    from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

SCHEMA = "chaosgpu.census/1"
#: The initial ("host") PID namespace: its inode number is fixed by the kernel (0xEFFFFFFC).
INIT_PID_NS = "pid:[4026531836]"

__all__ = [
    "SCHEMA",
    "INIT_PID_NS",
    "ENV_KEYS",
    "list_pids",
    "process_starttime",
    "process_state",
    "open_stat",
    "process_activity",
    "tcp_sockets",
    "read_process",
    "rank_lists",
    "parse_container",
    "nvml_snapshot",
    "nvml_device_memory",
    "nvml_gpu_processes",
    "nvml_init_state",
    "nvml_device",
    "gpu_snapshot_problem",
    "load_gpu_snapshot",
    "census",
    "main",
]

#: What MPI and Slurm launchers give each task, as (rank, world size, local rank), in this
#: order of trust: a trainer that sets RANK from them inside Python shows only these outside.
LAUNCHER_RANK_KEYS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)
#: torch's own (rank, world size, local rank): trusted before any launcher's.
TORCH_RANK_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

#: Environment keys the census reports (besides every ``CHAOSGPU_*`` key).
ENV_KEYS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_BUFFER_SIZE",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
) + tuple(key for keys in LAUNCHER_RANK_KEYS for key in keys)
#: Process names of MPI and Slurm launchers that start a job's tasks as their children.
TASK_LAUNCHERS = frozenset(("mpirun", "mpiexec", "orterun", "orted", "prterun", "prted",
                            "hydra_pmi_proxy", "mpiexec.hydra", "slurmstepd"))
#: Processes that carry a launcher's task numbers without being a trainer: shells (a Slurm
#: batch script is task 0 of its own step), the launchers themselves, srun's client.
NOT_TASKS = TASK_LAUNCHERS | frozenset(("srun", "sbatch", "salloc", "bash", "sh", "dash", "zsh",
                                        "ksh", "mksh", "tcsh", "csh", "fish", "busybox"))
_ENV_KEYS_B = frozenset(k.encode() for k in ENV_KEYS)
#: The keys that make a process a job's member or name its job (``_job_candidates``,
#: ``_job_id``, ``_numbering``), besides CHAOSGPU_JOB: a process chaosgpu starts for itself
#: (py-spy, nft, a sandbox's supervisor) must not carry them, or a runner that itself runs
#: inside a training job would pass its rank on and its helpers would read as that rank.
JOB_IDENTITY_KEYS = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                     "NODE_RANK", "ROLE_RANK", "LOCAL_WORLD_SIZE") + TORCH_RANK_KEYS + tuple(
    key for keys in LAUNCHER_RANK_KEYS for key in keys)

#: Process names that act as subreapers (children of dead parents are reparented to them).
KNOWN_SUBREAPERS = frozenset((
    "containerd-shim", "containerd-shim-runc-v2", "containerd-shim-runc-v1", "conmon",
    "tini", "tini-static", "dumb-init", "catatonit", "docker-init", "s6-svscan", "runsvdir",
))

#: Process names of Python trainers (torch renames its main thread pt_main_thread).
_WORKER_NAMES = ("python", "pt_", "torchrun", "ray::")  # comm prefixes (str.startswith)
_PF_KTHREAD = 0x00200000
_NVML_MIB = 1024.0 * 1024.0

# --------------------------------------------------------------------------------------------
# small readers


def _errno_name(error: OSError) -> str:
    import errno

    name = errno.errorcode.get(error.errno or 0, "") if error.errno else ""
    return name or type(error).__name__


class ProcError(Exception):
    """A /proc reading failed for a reason that is a fact about the process (base class)."""

    def __init__(self, pid: int, what: str, message: str) -> None:
        super().__init__(message)
        self.pid = pid
        self.what = what


class NoSuchProcess(ProcError):
    """The process does not exist: it never did, it exited (and was reaped), or its PID now
    belongs to another process (the start time given did not match)."""

    def __init__(self, pid: int, what: str = "stat", message: Optional[str] = None) -> None:
        super().__init__(pid, what, message or "no process with PID %d (%s)" % (pid, what))


class AccessDenied(ProcError):
    """The process exists but this observer may not read ``what`` of it (EACCES/EPERM: another
    user's process as non-root, ptrace rules for environ and fds)."""

    def __init__(self, pid: int, what: str, message: Optional[str] = None) -> None:
        super().__init__(pid, what, message or "access denied to %s of PID %d" % (what, pid))


def _read_bytes(path: str) -> bytes:
    """Read a whole /proc file that the kernel serves in one read (stat, status, cmdline,
    environ, cgroup, io: a short read is its end) with raw os calls: ~40% cheaper than open()
    objects, which matters at 10,000 processes. Files served a page at a time are read with
    ``_read_pages``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 65536)
        if len(data) < 65536:
            return data
        chunks = [data]
        while data:
            data = os.read(fd, 65536)
            chunks.append(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_pages(path: str) -> bytes:
    """Read a /proc file that the kernel serves a page at a time (a seq_file: net/tcp, maps,
    children, /proc/devices) to its end: one read returns at most about a page of it, so a
    short read is not its end there (``_read_bytes`` would keep only the first 4 KiB)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []  # type: List[bytes]
        while True:
            data = os.read(fd, 65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)
    finally:
        os.close(fd)


def _typed(pid: int, what: str, error: OSError) -> ProcError:
    """The typed error for an OSError of a /proc reading (vanished -> NoSuchProcess, EACCES or
    EPERM -> AccessDenied); other errors (EIO, ...) are returned as a ProcError."""
    if isinstance(error, (FileNotFoundError, ProcessLookupError)):
        return NoSuchProcess(pid, what)
    if isinstance(error, PermissionError):
        return AccessDenied(pid, what)
    return ProcError(pid, what, "cannot read %s of PID %d: %s" % (what, pid, _errno_name(error)))


def read_proc_file(pid: int, name: str, proc_root: str = "/proc") -> bytes:
    """Return the bytes of ``/proc/PID/<name>`` in one read; raise NoSuchProcess (gone),
    AccessDenied (not allowed) or ProcError (any other failure)."""
    try:
        return _read_bytes("%s/%d/%s" % (proc_root, pid, name))
    except OSError as error:
        raise _typed(pid, name, error) from None


def list_pids(proc_root: str = "/proc") -> List[int]:
    """Return every PID listed in ``proc_root`` (numeric entries), unsorted, in one listdir."""
    return list(map(int, filter(str.isdigit, os.listdir(proc_root))))


def _parse_stat(data: bytes) -> Tuple[str, List[bytes]]:
    """Split /proc/PID/stat into comm and the fields after it (index 0 = field 3, state)."""
    left = data.index(b"(")
    right = data.rindex(b")")
    comm = data[left + 1:right].decode("utf-8", "replace")
    return comm, data[right + 2:].split()


def read_stat(pid: int, proc_root: str = "/proc",
              starttime: Optional[int] = None) -> Dict[str, Any]:
    """One read of /proc/PID/stat: ``{"pid", "comm", "state", "ppid", "pgid", "sid", "flags",
    "kthread", "cpu_ticks", "num_threads", "starttime", "exit_code"}`` (PIDs as this /proc
    shows them). With ``starttime``, a process of another start time (a reused PID) raises
    NoSuchProcess, so one read both identifies and describes the process."""
    comm, fields = _parse_stat(read_proc_file(pid, "stat", proc_root))
    started = int(fields[19])
    if starttime is not None and started != starttime:
        raise NoSuchProcess(pid, "stat", "PID %d is another process now (start time %d, "
                            "expected %d)" % (pid, started, starttime))
    flags = int(fields[6])
    return {"pid": pid, "comm": comm, "state": fields[0].decode(), "ppid": int(fields[1]),
            "pgid": int(fields[2]), "sid": int(fields[3]), "flags": flags,
            "kthread": bool(flags & _PF_KTHREAD), "cpu_ticks": _cpu_ticks(fields),
            "num_threads": int(fields[_F_THREADS]), "starttime": started,
            "exit_code": int(fields[_F_EXIT_CODE]) if len(fields) > _F_EXIT_CODE else None}


def _status_line(data: bytes, key: bytes) -> Optional[List[int]]:
    start = data.find(b"\n" + key)
    if start < 0:
        return None
    end = data.find(b"\n", start + 1)
    return [int(x) for x in data[start + len(key) + 1:end if end >= 0 else len(data)].split()]


def read_status(pid: int, proc_root: str = "/proc") -> Dict[str, Any]:
    """One read of /proc/PID/status: ``{"uid" (real), "euid", "nspid", "nspgid", "nssid"}``,
    the NS* lists from this /proc's PID namespace down to the process's own (its own view
    last; 0 where the group or session leader is outside that namespace); None for a line the
    kernel does not have (NSpid needs Linux 4.1)."""
    data = read_proc_file(pid, "status", proc_root)
    uids = _status_line(data, b"Uid:")
    return {"uid": uids[0] if uids else None, "euid": uids[1] if uids else None,
            "nspid": _status_line(data, b"NSpid:"), "nspgid": _status_line(data, b"NSpgid:"),
            "nssid": _status_line(data, b"NSsid:")}


def _split_cmdline(raw: bytes) -> List[str]:
    return [a.decode("utf-8", "replace") for a in raw.rstrip(b"\0").split(b"\0")] if raw else []


def read_cmdline(pid: int, proc_root: str = "/proc") -> List[str]:
    """The argv of ``pid`` (empty for a kernel thread or a zombie, whose memory is gone)."""
    return _split_cmdline(read_proc_file(pid, "cmdline", proc_root))


def read_environ(pid: int, proc_root: str = "/proc",
                 keys: Optional[Iterable[str]] = None) -> Dict[str, str]:
    """The environment of ``pid`` as it was at exec (only ``keys`` when given); AccessDenied
    for another user's process (ptrace rules)."""
    data = read_proc_file(pid, "environ", proc_root)
    wanted = None if keys is None else frozenset(keys)
    env = {}  # type: Dict[str, str]
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            name = key.decode("utf-8", "replace")
            if wanted is None or name in wanted:
                # a name given twice: the first is the one getenv() and Python's os.environ
                # read, so the one the process itself goes by
                env.setdefault(name, value.decode("utf-8", "replace"))
    return env


def read_children(pid: int, proc_root: str = "/proc") -> List[int]:
    """The direct children of ``pid`` (/proc/PID/task/*/children, every thread's), sorted."""
    base = "%s/%d/task" % (proc_root, pid)
    try:
        tasks = os.listdir(base)
    except OSError as error:
        raise _typed(pid, "task", error) from None
    kids = []  # type: List[int]
    for task in tasks:
        try:
            kids.extend(int(x) for x in _read_pages(base + "/" + task + "/children").split())
        except (FileNotFoundError, ProcessLookupError):
            continue  # that thread ended while we listed
        except OSError as error:
            raise _typed(pid, "children", error) from None
    return sorted(set(kids))


def read_pid_ns(pid: int, proc_root: str = "/proc") -> str:
    """The PID namespace of ``pid`` as ``pid:[inode]`` (the ns/pid link)."""
    try:
        return os.readlink("%s/%d/ns/pid" % (proc_root, pid))
    except OSError as error:
        raise _typed(pid, "ns/pid", error) from None


def pid_ns_inode(pid: int, proc_root: str = "/proc") -> int:
    """The inode number of the PID namespace of ``pid`` (one stat of its ns/pid link)."""
    try:
        return os.stat("%s/%d/ns/pid" % (proc_root, pid)).st_ino
    except OSError as error:
        raise _typed(pid, "ns/pid", error) from None


def net_ns_inode(pid: int, proc_root: str = "/proc") -> int:
    """The inode number of the network namespace of ``pid`` (one stat of its ns/net link)."""
    try:
        return os.stat("%s/%d/ns/net" % (proc_root, pid)).st_ino
    except OSError as error:
        raise _typed(pid, "ns/net", error) from None


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def open_statm(pid: int, proc_root: str = "/proc") -> int:
    """Open /proc/PID/statm and return the fd, for ``rss_bytes`` to re-read with one pread
    per sample (the caller closes it)."""
    try:
        return os.open("%s/%d/statm" % (proc_root, pid), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise _typed(pid, "statm", error) from None


def rss_bytes(pid: int, fd: Optional[int] = None, proc_root: str = "/proc") -> int:
    """Resident set size of ``pid`` in bytes (statm field 2 x page size), from ``fd`` (see
    ``open_statm``) when given; NoSuchProcess once it has exited."""
    try:
        data = os.pread(fd, 128, 0) if fd is not None else \
            _read_bytes("%s/%d/statm" % (proc_root, pid))
    except OSError as error:
        raise _typed(pid, "statm", error) from None
    fields = data.split()
    if len(fields) < 2:  # an exited process's statm reads empty
        raise NoSuchProcess(pid, "statm")
    return int(fields[1]) * _PAGE_SIZE


def uptime_s(proc_root: str = "/proc") -> float:
    """Seconds since boot (/proc/uptime), to tell a process's age from its start time."""
    return float(_read_bytes(proc_root + "/uptime").split()[0])


def last_pid(proc_root: str = "/proc") -> int:
    """The PID the kernel allocated last in the reader's PID namespace (the last field of
    /proc/loadavg): unchanged between two readings means no process (and no thread) was
    created meanwhile, so a watcher need not list /proc again to find new ones. One read."""
    return int(_read_bytes(proc_root + "/loadavg").split()[-1])


def shows_own_pid_ns(proc_root: str = "/proc") -> bool:
    """Whether ``proc_root`` is a /proc of the reader's own PID namespace (its ``self`` is this
    process's PID): only then do ``last_pid`` and the PIDs it lists count the same PIDs."""
    try:
        return os.readlink(proc_root + "/self") == str(os.getpid())
    except OSError:
        return False


def read_sysctl(name: str, proc_root: str = "/proc") -> str:
    """The value of a sysctl (``user.max_user_namespaces`` reads /proc/sys/user/...)."""
    import re

    if not re.match(r"^[a-z0-9_]+(\.[a-z0-9_-]+)+$", name):
        raise ValueError("invalid sysctl name %r" % (name,))
    return _read_bytes(proc_root + "/sys/" + name.replace(".", "/")).decode().strip()


def process_starttime(pid: int, proc_root: str = "/proc") -> Optional[int]:
    """Return the start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat),
    or None when the process does not exist. One read: cheap enough to check a PID before
    signalling it (PID + starttime identify a process across PID reuse)."""
    try:
        data = _read_bytes("%s/%d/stat" % (proc_root, pid))
    except (FileNotFoundError, ProcessLookupError):
        return None
    _, fields = _parse_stat(data)
    return int(fields[19])


def open_stat(pid: int, proc_root: str = "/proc") -> int:
    """Open /proc/PID/stat and return the fd, for ``process_state`` to re-read with one pread
    per sample (the caller closes it). The fd reads this very process, or nothing once it is
    reaped: never a later owner of its PID."""
    try:
        return os.open("%s/%d/stat" % (proc_root, pid), os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise _typed(pid, "stat", error) from None


def process_state(pid: int, proc_root: str = "/proc",
                  starttime: Optional[int] = None, fd: Optional[int] = None) -> Optional[str]:
    """Return the one-letter state of ``pid`` (R, S, D, Z, T, t, I, X) or None if it is gone
    (or, with ``starttime``, if the PID now belongs to another process): one read, a pread of
    ``fd`` (see ``open_stat``) when given."""
    try:
        data = os.pread(fd, 4096, 0) if fd is not None else \
            _read_bytes("%s/%d/stat" % (proc_root, pid))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if not data:  # read through a held fd after the process was reaped
        return None
    _, fields = _parse_stat(data)
    if starttime is not None and int(fields[19]) != starttime:
        return None
    return fields[0].decode()


# --------------------------------------------------------------------------------------------
# activity: what a process is doing now (the job observer samples it repeatedly)

#: /proc/PID/stat field indexes in the list returned by _parse_stat (index 0 = field 3).
_F_UTIME, _F_STIME, _F_THREADS, _F_EXIT_CODE = 11, 12, 17, 49
#: stat fields 48 and 50 (arg_start, env_start), 0 being field 3
_F_ARG_START, _F_ENV_START = 45, 47


def _exec_marker(stat: bytes) -> Optional[Tuple[int, int]]:
    """Where the kernel placed the process's argv and environment at its last exec (stat
    fields 48 and 50, Linux 3.5+). They move at every exec (the stack is placed at random), so
    a process cached before an exec shows it has another command line and environment now.
    None where the kernel shows no such fields or zeros (a zombie, a kernel thread, a process
    this observer may not inspect): then nothing can be told."""
    fields = stat[stat.rindex(b")") + 2:].split(None, _F_ENV_START + 1)
    if len(fields) <= _F_ENV_START:
        return None
    marker = (int(fields[_F_ARG_START]), int(fields[_F_ENV_START]))
    return marker if marker[0] else None


def _forget_execed(cache: Dict[Tuple[str, int, int], Dict[str, Any]],
                   key: Tuple[str, int, int]) -> None:
    """Drop the cache entry of a process that exec'd; it is read afresh and not cached by
    this reading (see ``_EXECED``)."""
    del cache[key]
    if len(_EXECED) > 4096:
        _EXECED.clear()
    _EXECED.add(key)


def _execed(entry: Dict[str, Any], stat: bytes) -> bool:
    """Whether the process of this cache entry has exec'd since it was cached (see
    ``_exec_marker``): its cmdline, env and tag in the entry are then another program's."""
    then = entry.get("_exec")
    if then is None:
        return False
    now = _exec_marker(stat)
    return now is not None and now != then


def _cpu_ticks(fields: List[bytes]) -> int:
    return int(fields[_F_UTIME]) + int(fields[_F_STIME])


def process_activity(pid: int, proc_root: str = "/proc", threads: bool = True,
                     sockets: bool = True) -> Optional[Dict[str, Any]]:
    """One sample of what ``pid`` is doing now, or None when it does not exist: state,
    starttime, cpu_ticks (utime + stime of every thread, clock ticks), num_threads, exit_code
    (stat field 52: the wait status of a zombie, 0 while alive or when the kernel hides it),
    wchar and syscw (/proc/PID/io: bytes and calls of write-like syscalls, sockets included),
    threads (``[{"tid", "comm", "state", "cpu_ticks", "wchan"}]``: thread names tell a gloo or
    NCCL process group apart) and socket_inodes (the inodes of its open sockets, to join with
    ``tcp_sockets``) and stderr (where fd 2 points: a file path, ``pipe:[N]`` ...). A part
    that could not be read is None and explained in ``errors``
    (EACCES for another user's process as non-root, vanished ...)."""
    base = "%s/%d" % (proc_root, pid)
    try:
        _, fields = _parse_stat(_read_bytes(base + "/stat"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    state = fields[0].decode()
    record = {"pid": pid, "state": state, "starttime": int(fields[19]),
              "cpu_ticks": _cpu_ticks(fields), "num_threads": int(fields[_F_THREADS]),
              "exit_code": int(fields[_F_EXIT_CODE]) if len(fields) > _F_EXIT_CODE else None,
              "wchar": None, "syscw": None, "threads": None, "socket_inodes": None,
              "stderr": None, "errors": {}}  # type: Dict[str, Any]
    errors = record["errors"]
    try:
        io = _read_bytes(base + "/io")
        for line in io.split(b"\n"):
            if line.startswith(b"wchar:"):
                record["wchar"] = int(line[6:])
            elif line.startswith(b"syscw:"):
                record["syscw"] = int(line[6:])
    except OSError as error:
        errors["io"] = _errno_name(error)
    if threads and state not in ("Z", "X"):
        try:
            record["threads"] = _threads(base)
        except OSError as error:
            errors["threads"] = _errno_name(error)
    if sockets and state not in ("Z", "X"):
        try:
            record["socket_inodes"] = _socket_inodes(base + "/fd")
            record["stderr"] = os.readlink(base + "/fd/2")
        except OSError as error:
            errors["socket_inodes"] = _errno_name(error)
    return record


def _threads(base: str) -> List[Dict[str, Any]]:
    result = []  # type: List[Dict[str, Any]]
    for name in os.listdir(base + "/task"):
        task = base + "/task/" + name
        try:
            comm, fields = _parse_stat(_read_bytes(task + "/stat"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we listed
        try:
            wchan = _read_bytes(task + "/wchan").decode("ascii", "replace")
        except OSError:
            wchan = ""
        result.append({"tid": int(name), "comm": comm, "state": fields[0].decode(),
                       "cpu_ticks": _cpu_ticks(fields),
                       "wchan": wchan if wchan not in ("", "0") else None})
    result.sort(key=lambda t: t["tid"])
    return result


def _socket_inodes(fd_dir: str) -> List[int]:
    inodes = []
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir + "/" + name)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.append(int(target[8:-1]))
    return sorted(inodes)


# --------------------------------------------------------------------------------------------
# TCP sockets (netlink sock_diag): per-connection byte counters and timers

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
_TCP_STATES = ("?", "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
               "TIME_WAIT", "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING")


def _address(family: int, raw: bytes) -> str:
    import socket

    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    text = socket.inet_ntop(socket.AF_INET6, raw)
    return text[7:] if text.startswith("::ffff:") and "." in text else text


def _address_of(raw: bytes) -> str:
    """``_address`` of 4 (IPv4) or 16 (IPv6) address bytes."""
    import socket

    return _address(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _parse_diag(family: int, data: bytes, offset: int, end: int) -> Dict[str, Any]:
    import struct

    state, _timer, _retrans = data[offset + 1], data[offset + 2], data[offset + 3]
    sport, dport = struct.unpack_from(">HH", data, offset + 4)
    src = data[offset + 8:offset + 24]
    dst = data[offset + 24:offset + 40]
    rqueue, wqueue, uid, inode = struct.unpack_from("=IIII", data, offset + 56)
    entry = {"inode": inode, "state": _TCP_STATES[state] if state < len(_TCP_STATES) else state,
             "local": "%s:%d" % (_address(family, src), sport), "local_port": sport,
             "remote": "%s:%d" % (_address(family, dst), dport), "remote_port": dport,
             "uid": uid, "recv_queue": rqueue, "send_queue": wqueue}  # type: Dict[str, Any]
    at = offset + 72
    while at + 4 <= end:
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4:
            break
        if kind == _INET_DIAG_INFO and length - 4 >= 136:
            info = at + 4
            entry["retransmits"] = data[info + 2]
            entry["backoff"] = data[info + 4]
            (entry["unacked"],) = struct.unpack_from("=I", data, info + 24)
            (entry["ms_since_data_sent"], _, entry["ms_since_data_received"],
             entry["ms_since_ack_received"]) = struct.unpack_from("=IIII", data, info + 44)
            (entry["total_retransmits"],) = struct.unpack_from("=I", data, info + 100)
            entry["bytes_acked"], entry["bytes_received"] = \
                struct.unpack_from("=QQ", data, info + 120)
        at += (length + 3) & ~3
    return entry


def tcp_sockets() -> Dict[int, Dict[str, Any]]:
    """Every TCP socket of the observer's network namespace (IPv4 and IPv6) by inode, from one
    netlink sock_diag dump per family: state, local and remote address and port, queues, and
    the kernel's tcp_info counters (bytes_acked, bytes_received, unacked, retransmits, backoff,
    ms since data was last sent or received). These are the kernel's own counters of what
    crossed each connection: a rank whose peer connections move no bytes makes no progress.
    Raises OSError when netlink is refused (then nothing about sockets can be said)."""
    import socket
    import struct

    result = {}  # type: Dict[int, Dict[str, Any]]
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    try:
        for seq, family in enumerate((socket.AF_INET, socket.AF_INET6), 1):
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1),
                                  0, 0xFFFFFFFF) + b"\0" * 48
            header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY,
                                 _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0)
            sock.sendto(header + request, (0, 0))
            done = False
            while not done:
                data = sock.recv(1 << 20)
                if not data:
                    break
                offset = 0
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if length < 16:
                        done = True
                        break
                    if kind == _NLMSG_DONE:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, offset + 16)
                        if code:
                            raise OSError(-code, os.strerror(-code))
                        done = True
                        break
                    entry = _parse_diag(family, data, offset + 16, offset + length)
                    result[entry["inode"]] = entry
                    offset += (length + 3) & ~3
    finally:
        sock.close()
    return result


# --------------------------------------------------------------------------------------------
# cgroup -> container identity

_HEX64 = r"[0-9a-f]{64}"
#: (runtime, text the path must contain, pattern): a pattern is compiled (re's own cache) only
#: when its text is in a path, so that a node without containers compiles none of them
_CONTAINER_PATTERNS = (
    ("containerd", "cri-containerd-", r"cri-containerd-(" + _HEX64 + r")\.scope"),
    ("cri-o", "crio-", r"crio-(" + _HEX64 + r")\.scope"),
    ("cri-o", "crio-conmon-", r"crio-conmon-(" + _HEX64 + r")\.scope"),
    ("docker", "docker-", r"docker-(" + _HEX64 + r")\.scope"),
    ("docker", "/docker/", r"/docker/(" + _HEX64 + r")(?:/|$)"),
    ("containerd", "/k8s.io/", r"/k8s\.io/(" + _HEX64 + r")(?:/|$)"),
    ("kubepods", "/kubepods", r"/kubepods(?:/[a-z]+)?/pod[0-9a-f-]+/(" + _HEX64 + r")(?:/|$)"),
)
_POD_SYSTEMD = r"kubepods(?:-[a-z]+)?-pod([0-9a-f_]+)\.slice"
_POD_CGROUPFS = r"/kubepods(?:/[a-z]+)?/pod([0-9a-f-]+)(?:/|$)"
_SANDBOX = r"/chaosgpu[/-]([A-Za-z0-9_.-]+?)(?:\.scope|\.slice)?(?:/|$)"


def _first_group(pattern: str, text: str) -> Optional[str]:
    """The first group of ``pattern``'s first match in ``text``, or None. re is imported here,
    for a path that names a container, not at the program's start: re and enum are ~5 ms of a
    snapshot's start, on a node whose cgroups mostly name none."""
    import re

    match = re.search(pattern, text)
    return None if match is None else match.group(1)


def parse_container(cgroup_path: Optional[str]) -> Optional[Dict[str, Any]]:
    """Return ``{"runtime", "id", "pod_uid"}`` parsed from a cgroup path, or None for a path
    that names no container. Understands containerd (``cri-containerd-<id>.scope``), CRI-O
    (``crio-<id>.scope``), Docker (``docker-<id>.scope``, ``/docker/<id>``), the kubelet's
    cgroupfs driver (``/kubepods/<qos>/pod<uid>/<id>``: runtime ``kubepods`` because the path
    does not name the runtime) and systemd driver (``kubepods-<qos>-pod<uid_with_underscores>
    .slice``), on cgroup v1 and v2 alike, and chaosgpu sandboxes (``/chaosgpu/<name>``)."""
    if not cgroup_path:
        return None
    runtime = None
    cid = None
    for name, marker, pattern in _CONTAINER_PATTERNS:
        cid = _first_group(pattern, cgroup_path) if marker in cgroup_path else None
        if cid is not None:
            runtime = name
            break
    pod_uid = None
    if "kubepods" in cgroup_path:
        pod_uid = _first_group(_POD_SYSTEMD, cgroup_path)
        if pod_uid is not None:
            pod_uid = pod_uid.replace("_", "-")
        else:
            pod_uid = _first_group(_POD_CGROUPFS, cgroup_path)
    if runtime is None:
        sandbox = _first_group(_SANDBOX, cgroup_path) if "/chaosgpu" in cgroup_path else None
        if sandbox is not None:
            return {"runtime": "sandbox", "id": sandbox, "pod_uid": None}
        if pod_uid is not None:
            return {"runtime": "kubepods", "id": None, "pod_uid": pod_uid}
        return None
    return {"runtime": runtime, "id": cid, "pod_uid": pod_uid}


def _pick_cgroup(data: bytes) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """From /proc/PID/cgroup return (main path, v1 freezer path, v2 path)."""
    v2 = None
    freezer = None
    preferred = None
    other = None
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
            continue
        names = controllers.split(",")
        if "freezer" in names:
            freezer = path
        if preferred is None and ("pids" in names or "memory" in names
                                  or "name=systemd" in names):
            if path != "/":
                preferred = path
        if other is None and path != "/":
            other = path
    if v2 is not None and v2 != "/":
        return v2, freezer, v2
    return preferred or other or v2, freezer, v2


# --------------------------------------------------------------------------------------------
# one process


def _status_fields(data: bytes) -> Tuple[Optional[int], Optional[List[int]]]:
    uids = _status_line(data, b"Uid:")
    return (uids[0] if uids else None), _status_line(data, b"NSpid:")


def _read_env(data: bytes) -> Dict[str, str]:
    env = {}  # type: Dict[str, str]
    if not (b"RANK=" in data or b"MASTER_" in data or b"CHAOSGPU_" in data
            or b"TORCH" in data):
        return env  # no job or tag key: the common case, decided by C scans alone
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and (key in _ENV_KEYS_B or key.startswith(b"CHAOSGPU_")):
            # first one wins, as for getenv() (read_environ)
            env.setdefault(key.decode("utf-8", "replace"), value.decode("utf-8", "replace"))
    return env


def _nvidia_fds(fd_dir: str) -> List[str]:
    found = []
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(fd_dir + "/" + name)
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            found.append(target)
    return sorted(set(found))


#: ``fds`` value meaning "no NVIDIA device can be open on this kernel" (see ``nvidia_registered``)
NO_NVIDIA_DEVICE = "no NVIDIA character device is registered with this kernel (/proc/devices)"


def nvidia_registered(proc_root: str = "/proc") -> bool:
    """Whether an NVIDIA driver has registered a character device with this kernel
    (/proc/devices names ``nvidia*``). When none is, no file any process holds can be an NVIDIA
    device, so the census skips the fd scan and reports ``nvidia_fds: []`` as a fact. A /proc
    that cannot tell (unreadable, or a fake proc root in tests) counts as registered."""
    try:
        data = _read_pages(proc_root + "/devices")
    except OSError:
        return True
    return b"nvidia" in data or b"Character devices" not in data


_STABLE_FIELDS = ("uid", "nspid", "pid_ns", "ns_init", "cmdline", "env", "tag", "cgroup",
                  "container", "_exec")
#: what a record holds for a stable field that its cache entry lacks (as ``_stat_record``)
_STABLE_DEFAULTS = {"uid": None, "nspid": None, "pid_ns": None, "ns_init": False,
                    "cmdline": None, "env": None, "tag": None, "cgroup": None,
                    "container": None}  # type: Dict[str, Any]
_CACHE = {}  # type: Dict[Tuple[str, int, int], Dict[str, Any]]
#: cache keys of processes found to have exec'd since they were cached: read afresh and not
#: cached at once (an exec in progress may show a half-built environment), but at the next census
_EXECED = set()  # type: Any  # of cache keys
#: held by a census that uses _CACHE (one thread at a time; reentrant: a signal handler that
#: takes a census while its thread is in one must not wait for itself)
_CACHE_LOCK = _thread.RLock()
#: /proc/PID/cgroup contents -> (main path, v1 freezer path, v2 path, container)
_CGROUPS = {}  # type: Dict[bytes, Tuple[Optional[str], Optional[str], Optional[str], Any]]
#: /proc/PID/environ contents -> the job and tag keys in it: the processes of one parent share
#: one environment, and a hash of it costs a quarter of the scans that find no key in it
_ENVS = {}  # type: Dict[bytes, Dict[str, str]]


#: (proc root, pid) -> [fd, record template, last stat, last record, its cache entry, the
#: cache's key]:
#: /proc/PID/stat kept open for the processes the cache knows, re-read with one pread per census
#: instead of open, read and close; when the stat reads as before (an idle process) the last
#: record is copied instead of rebuilt. An fd opened on a process reads that process or fails
#: (ESRCH once it is reaped), never a later owner of its PID. The fds are moved to numbers
#: from HELD_FD_FLOOR up, so that the low numbers stay free for code that still uses select()
#: (FD_SETSIZE 1024) in the same process; they are held only where the soft RLIMIT_NOFILE
#: leaves room above that floor (at most three quarters of it: with the common limit of
#: 20,000, the 10,000 processes of a busy node fit, and a quarter stays free up there).
HELD_FD_FLOOR = 4096
_STAT_FDS = {}  # type: Dict[Tuple[str, int], List[Any]]
_STAT_FDS_LOCK = _thread.allocate_lock()
_STAT_FDS_MAX = [None]  # type: List[Optional[int]]


def _held_fd_budget() -> int:
    if _STAT_FDS_MAX[0] is None:
        try:
            import resource

            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if soft == resource.RLIM_INFINITY:
                soft = 1 << 20
        except (ImportError, OSError, ValueError):
            soft = 1024
        _STAT_FDS_MAX[0] = max(0, min((soft - HELD_FD_FLOOR) * 3 // 4, 1 << 16))
    return _STAT_FDS_MAX[0] or 0


#: the fields of a record read again at every census (the template keeps the others)
_LIVE_FIELDS = ("state", "zombie", "exiting", "threads", "ppid", "pgid", "sid", "comm",
                "nvidia_fds", "orphan", "orphan_reason", "unreadable", "errors", "not_read")


def _hold_stat(proc_root: str, pid: int, record: Dict[str, Any]) -> None:
    """Open and keep /proc/PID/stat of a process the cache knows, within the fd budget, with
    its record as a template; the first read through it confirms the start time (else it is
    closed: another process owns the PID now)."""
    key = (proc_root, pid)
    with _STAT_FDS_LOCK:
        if key in _STAT_FDS or len(_STAT_FDS) >= _held_fd_budget():
            return
        try:
            import fcntl

            opened = os.open("%s/%d/stat" % key, os.O_RDONLY | os.O_CLOEXEC)
            try:  # above the floor: the low numbers stay free for select() users
                fd = fcntl.fcntl(opened, fcntl.F_DUPFD_CLOEXEC, HELD_FD_FLOOR)
            finally:
                os.close(opened)
        except (ImportError, OSError):
            return
        try:
            _, fields = _parse_stat(os.pread(fd, 4096, 0))
            if int(fields[19]) == record["starttime"]:
                template = {name: value for name, value in record.items()
                            if name not in _LIVE_FIELDS and name not in _STABLE_FIELDS}
                template.update(_STABLE_DEFAULTS)  # the cache entry fills them at each use
                template.update(orphan=False, orphan_reason=None, nvidia_fds=None)
                _STAT_FDS[key] = [fd, template, None, None, None,
                                  (proc_root, pid, record["starttime"])]
                return
        except (OSError, ValueError, IndexError):
            pass
        os.close(fd)


def _live_record(pid: int, stat: bytes, template: Dict[str, Any]) -> Dict[str, Any]:
    """A known process's record: its template and what stat says now (one split, no start
    time to parse: the held fd is this very process)."""
    right = stat.rindex(b")")
    fields = stat[right + 2:].split(None, _F_THREADS + 1)
    record = dict(template)
    record["state"] = state = fields[0].decode()
    record["threads"] = threads = int(fields[_F_THREADS])
    record["exiting"] = leader_only = state == "Z" and threads > 1
    record["zombie"] = state == "Z" and not leader_only
    record["ppid"] = int(fields[1])
    record["pgid"] = int(fields[2])
    record["sid"] = int(fields[3])
    record["comm"] = stat[stat.index(b"(") + 1:right].decode("utf-8", "replace")
    record["unreadable"] = []
    record["errors"] = {}
    return record


def _drop_held_stats(proc_root: str, alive: Any) -> None:
    """Close the held stat fds of processes no longer listed under ``proc_root``."""
    with _STAT_FDS_LOCK:
        for key in [k for k in _STAT_FDS if k[0] == proc_root and k[1] not in alive]:
            os.close(_STAT_FDS.pop(key)[0])


def _stat_record(pid: int, stat: bytes) -> Dict[str, Any]:
    right = stat.rindex(b")")
    comm = stat[stat.index(b"(") + 1:right].decode("utf-8", "replace")
    fields = stat[right + 2:].split(None, 20)  # up to starttime: half the objects of a full split
    state = fields[0].decode()
    leader_only = state == "Z" and int(fields[_F_THREADS]) > 1
    return {
        "pid": pid, "ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3]),
        "state": state, "zombie": state == "Z" and not leader_only, "exiting": leader_only,
        "kthread": bool(int(fields[6]) & _PF_KTHREAD), "threads": int(fields[_F_THREADS]),
        "uid": None, "comm": comm,
        "cmdline": None, "starttime": int(fields[19]), "nspid": None, "pid_ns": None,
        "ns_init": False, "orphan": False, "orphan_reason": None, "container": None,
        "cgroup": None, "nvidia_fds": None, "env": None, "tag": None,
        "unreadable": [], "errors": {},
    }


def read_process(pid: int, proc_root: str = "/proc", env: bool = True,
                 fds: Union[bool, str] = True, proc_ns: Optional[str] = None,
                 cache: Optional[Dict[Tuple[str, int, int], Dict[str, Any]]] = None,
                 cache_before: Optional[int] = None,
                 details: bool = True, status: bool = True) -> Optional[Dict[str, Any]]:
    """Read one process from ``proc_root`` and return its census record, or None when it does
    not exist (or vanished while being read). Fields: pid, ppid, pgid, sid, state, zombie,
    kthread, threads (stat's thread count), uid, comm, cmdline, starttime (clock ticks, stat
    field 22), nspid (NSpid: the observer's PID first, innermost last), pid_ns
    (``pid:[inode]`` of its PID namespace), ns_init (PID 1 of its namespace), cgroup (path)
    and container (parsed from it), nvidia_fds (targets under /dev/nvidia*), env (only the
    job/tag keys: ENV_KEYS and ``CHAOSGPU_*``), tag (``CHAOSGPU_TAG``). A field that could not
    be read is None, named in ``unreadable`` and explained in ``errors`` (EACCES, vanished
    ...): never reported as absent.
    ``orphan``/``orphan_reason`` are filled by ``census`` (they need the parent's record).
    ``proc_ns``, when given, is the PID namespace of the /proc mount, used instead of reading
    the ns/pid link of processes whose NSpid has a single field (same namespace).
    ``fds`` is True (scan), False (not asked: None) or ``NO_NVIDIA_DEVICE`` (no scan needed:
    ``[]``, see ``nvidia_registered``).
    ``cache``, when given, maps (proc_root, pid, starttime) to what is kept for a process's life
    (uid as first seen, nspid, pid_ns, cmdline, env, cgroup and container): a process seen
    before is then read with stat (and the fd scan) only, and a zombie keeps the cmdline and
    env it had while alive. Only processes started before ``cache_before`` (clock ticks since
    boot) are stored: right after fork the child still shows its parent's cmdline and env,
    and right after exec the kernel shows an empty env for a moment. ``details=False`` reads
    only stat, status and the ns link (the fields the orphan and zombie rules need) and lists
    cmdline, cgroup, env and nvidia_fds in ``not_read`` (skipped on purpose, not unreadable);
    ``status=False`` too reads stat alone (uid, nspid, pid_ns, ns_init also in ``not_read``)."""
    base = "%s/%d" % (proc_root, pid)
    if cache is not None:
        known = {}  # type: Dict[int, Dict[str, Any]]
        if not _read_known([pid], proc_root, env, fds, details, cache, known):
            return known.get(pid)  # read through its held stat fd (None: it vanished)
    try:
        stat = _read_bytes(base + "/stat")
        record = _stat_record(pid, stat)
    except (FileNotFoundError, ProcessLookupError):
        return None
    cached = None
    execed = False
    if cache is not None:
        key = (proc_root, pid, record["starttime"])
        cached = cache.get(key)
        if cached is not None and _execed(cached, stat):
            _forget_execed(cache, key)
            cached = None
        if key in _EXECED:
            _EXECED.discard(key)
            execed = True
        record["_exec"] = _exec_marker(stat)
    # a process cached by a census without env is read again when env is asked for now
    if cached is not None and ("env" in cached or not env or record["kthread"]):
        record.update(cached)
        if not record["zombie"]:
            _hold_stat(proc_root, pid, record)
        return _finish_known(record, base, fds, details)
    if not status and not details:
        record["not_read"] = ["uid", "nspid", "pid_ns", "ns_init", "cmdline", "cgroup", "env",
                              "nvidia_fds"]
        return record
    _read_identity(record, base, proc_ns)
    cacheable = cache is not None and not record["zombie"] and cache_before is not None \
        and record["starttime"] < cache_before and not execed
    if record["kthread"]:  # no memory, no files: its identity is all there is, for its life
        if cacheable and cache is not None and not record["unreadable"]:
            cache[(proc_root, pid, record["starttime"])] = {
                name: record[name] for name in ("uid", "nspid", "pid_ns", "ns_init")}
        return record
    if not details:
        record["not_read"] = ["cmdline", "cgroup", "env", "nvidia_fds"]
        return record
    _read_details(record, base, env)
    if cacheable and cache is not None and not record["unreadable"]:
        cache[(proc_root, pid, record["starttime"])] = {
            name: record[name] for name in _STABLE_FIELDS if name in record
            and (env or name not in ("env", "tag"))}
    _read_fds(record, base, fds)
    return None if _vanished(record, base) else record


def _finish_known(record: Dict[str, Any], base: str, fds: Union[bool, str],
                  details: bool) -> Optional[Dict[str, Any]]:
    """The rest of a known process's reading: its fds (what can change), unless it is a
    kernel thread or only the basic fields were asked for; None when it vanished meanwhile."""
    if record["kthread"]:
        return record
    if not details:
        record["not_read"] = ["nvidia_fds"]
        return record
    _read_fds(record, base, fds)
    return None if _vanished(record, base) else record


def _read_identity(record: Dict[str, Any], base: str, proc_ns: Optional[str]) -> None:
    """uid, nspid (and the own-namespace session and group the orphan rule needs), pid_ns."""
    try:
        data = _read_bytes(base + "/status")
        uids = _status_line(data, b"Uid:")
        record["uid"] = uids[0] if uids else None
        nspid = record["nspid"] = _status_line(data, b"NSpid:")
        if nspid:
            record["ns_init"] = nspid[-1] == 1
            if len(nspid) > 1:
                nssid, nspgid = _status_line(data, b"NSsid:"), _status_line(data, b"NSpgid:")
                record["_nssid"] = nssid[-1] if nssid else None
                record["_nspgid"] = nspgid[-1] if nspgid else None
        else:
            record["unreadable"].append("nspid")
            record["errors"]["nspid"] = "no NSpid line (kernel older than 4.1?)"
    except (OSError, ValueError) as error:
        _note_failure(record, "uid", error)
        _note_failure(record, "nspid", error)
    nspid = record["nspid"]
    if proc_ns is not None and nspid is not None and len(nspid) == 1:
        record["pid_ns"] = proc_ns
    else:
        try:
            record["pid_ns"] = os.readlink(base + "/ns/pid")
        except OSError as error:
            _note_failure(record, "pid_ns", error)


def _parsed_once(table: Dict[bytes, Any], data: bytes, parse: Any, limit: int) -> Any:
    """``parse(data)``, kept in ``table`` by content (most processes share a few cgroup files
    and environments: each is parsed once); the table is emptied past ``limit`` entries."""
    parsed = table.get(data)
    if parsed is None:
        if len(table) > limit:
            table.clear()
        parsed = table[data] = parse(data)
    return parsed


def _cgroup_paths(data: bytes) -> Tuple[Optional[str], Optional[str], Optional[str], Any]:
    paths = _pick_cgroup(data)
    return paths + (parse_container(paths[0]),)


def _container_of(container: Any, env: Optional[Dict[str, str]]) -> Optional[Dict[str, Any]]:
    """A record's container: the one its cgroup path names, else the chaosgpu sandbox its
    environment names (CHAOSGPU_SANDBOX), else None."""
    if container:
        return dict(container)
    sandbox = (env or {}).get("CHAOSGPU_SANDBOX")
    return {"runtime": "sandbox", "id": sandbox, "pod_uid": None} if sandbox else None


def _cgroups(base: str) -> Tuple[Optional[str], Optional[str], Optional[str], Any]:
    """(main path, v1 freezer path, v2 path, container) of the process at ``base`` as its
    cgroup file says now; OSError when it cannot be read."""
    parsed = _parsed_once(_CGROUPS, _read_bytes(base + "/cgroup"), _cgroup_paths, 4096)
    return parsed  # type: ignore[no-any-return]


def _read_details(record: Dict[str, Any], base: str, env: bool) -> None:
    """cmdline, env (job and tag keys) and cgroup (with the container it names)."""
    if record["state"] in ("Z", "X"):  # memory gone: cmdline and environ read empty, a lie
        for field in ("cmdline", "env"):
            record["unreadable"].append(field)
            record["errors"][field] = "zombie: memory already released"
    else:
        try:
            record["cmdline"] = _split_cmdline(_read_bytes(base + "/cmdline"))
        except OSError as error:
            _note_failure(record, "cmdline", error)
        if env:
            try:
                found = record["env"] = dict(
                    _parsed_once(_ENVS, _read_bytes(base + "/environ"), _read_env, 1024))
                record["tag"] = found.get("CHAOSGPU_TAG")
            except OSError as error:
                _note_failure(record, "env", error)
    try:
        main_path, _, _, container = _cgroups(base)
        record["cgroup"] = main_path
    except OSError as error:
        container = None
        _note_failure(record, "cgroup", error)
    record["container"] = _container_of(container, record.get("env"))


def _vanished(record: Dict[str, Any], base: str) -> bool:
    """A read that failed with "vanished" means the process may be gone: if its stat is gone
    too, it exited while we read it (return None: what we read may be half of it)."""
    if "vanished" not in record["errors"].values():
        return False
    return not os.path.exists(base + "/stat")


def _note_failure(record: Dict[str, Any], field: str, error: BaseException) -> None:
    record["unreadable"].append(field)
    if isinstance(error, (FileNotFoundError, ProcessLookupError)):
        record["errors"][field] = "vanished"
    elif isinstance(error, OSError):
        record["errors"][field] = _errno_name(error)
    else:
        record["errors"][field] = "%s: %s" % (type(error).__name__, error)


def _read_fds(record: Dict[str, Any], base: str, fds: Union[bool, str]) -> None:
    """The open /dev/nvidia* fds: what can change during a process's life (read every time)."""
    if record["state"] in ("Z", "X") or fds == NO_NVIDIA_DEVICE:
        record["nvidia_fds"] = []  # exited: the kernel closed its files; or no such device
    elif fds:
        try:
            record["nvidia_fds"] = _nvidia_fds(base + "/fd")
        except OSError as error:
            _note_failure(record, "nvidia_fds", error)


# --------------------------------------------------------------------------------------------
# NVML

_NVML = {"module": None, "reason": None, "handles": None, "tried": False, "attempts": 0,
         "retry_at": 0.0, "backoff_s": 0.0}  # type: Dict[str, Any]
#: A failed NVML initialisation is tried again after this many seconds, doubling up to the
#: maximum (a DaemonSet that starts before the driver is loaded recovers on its own).
NVML_RETRY_FIRST_S = 1.0
NVML_RETRY_MAX_S = 60.0
_NVML_LOCK = _thread.allocate_lock()
#: NVML's process listings, in order; a PID listed twice on one GPU is kept once (the first).
_NVML_LISTS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
               "nvmlDeviceGetGraphicsRunningProcesses")


def _nvml() -> Tuple[Any, Optional[str]]:
    """Initialise NVML; return (the library as ``_load_nvml`` gives it, None) or (None,
    reason). A failed initialisation (no driver yet, no library, no GPU) is retried on a later
    call, after a backoff of ``NVML_RETRY_FIRST_S`` doubling up to ``NVML_RETRY_MAX_S``."""
    if _NVML["module"] is not None or (
            _NVML["tried"] and (_NVML["retry_at"] is None or time.monotonic() < _NVML["retry_at"])):
        return _NVML["module"], _NVML["reason"]
    with _NVML_LOCK:
        if _NVML["module"] is None and (not _NVML["tried"] or (
                _NVML["retry_at"] is not None and time.monotonic() >= _NVML["retry_at"])):
            _nvml_init()
    return _NVML["module"], _NVML["reason"]


class NVMLError(Exception):
    """An NVML call that did not succeed: ``value`` is NVML's return code (``nvmlReturn_t``),
    the message NVML's own text for it."""

    def __init__(self, value: int, text: str = "") -> None:
        Exception.__init__(self, text or "NVML error %d" % value)
        self.value = value


class _NvmlLibrary:
    """The driver's NVML (libnvidia-ml.so.1) called through ctypes: only the calls the census
    makes, under NVML's own names, so that the census reads NVML with the standard library
    alone. pynvml's import costs more than NVML's init (15.9 ms of NVML's 32 ms child on an
    H100 host, ctypes.util's imports the larger part); this costs ctypes' import. Each call
    raises ``NVMLError`` with NVML's code where it does not return NVML_SUCCESS."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_INSUFFICIENT_SIZE = 7
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_MEMORY_UTILIZATION_SAMPLES = 2
    nvmlEventTypeXidCriticalError = 0x8
    NVMLError = NVMLError

    def __init__(self, ctypes: Any, library: Any) -> None:
        self._ctypes = ctypes
        self._library = library
        library.nvmlErrorString.restype = ctypes.c_char_p

        class ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_v2_t, the same in _v3
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                        ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

        class Memory(ctypes.Structure):  # nvmlMemory_t
            _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                        ("used", ctypes.c_ulonglong)]

        class Utilization(ctypes.Structure):  # nvmlUtilization_t
            _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]

        class Value(ctypes.Union):  # nvmlValue_t
            _fields_ = [("dVal", ctypes.c_double), ("uiVal", ctypes.c_uint),
                        ("ulVal", ctypes.c_ulong), ("ullVal", ctypes.c_ulonglong),
                        ("sllVal", ctypes.c_longlong), ("siVal", ctypes.c_int),
                        ("usVal", ctypes.c_ushort)]

        class Sample(ctypes.Structure):  # nvmlSample_t
            _fields_ = [("timeStamp", ctypes.c_ulonglong), ("sampleValue", Value)]

        class EventData(ctypes.Structure):  # nvmlEventData_t
            _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong),
                        ("eventData", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                        ("computeInstanceId", ctypes.c_uint)]

        self.c_nvmlProcessInfo_v3_t = ProcessInfo
        self._memory = Memory
        self._utilization = Utilization
        self._sample = Sample
        self._event_data = EventData

    def _call(self, name: str, *args: Any) -> None:
        code = self._nvmlGetFunctionPointer(name)(*args)
        if code != self.NVML_SUCCESS:
            text = self._library.nvmlErrorString(code)
            raise NVMLError(code, text.decode(errors="replace") if text else "")

    def _nvmlGetFunctionPointer(self, name: str) -> Any:  # noqa: N802 (NVML's naming)
        """The library's function ``name``; NVMLError (function not found) where this
        driver lacks it."""
        try:
            return getattr(self._library, name)
        except AttributeError:
            raise NVMLError(self.NVML_ERROR_FUNCTION_NOT_FOUND,
                            "Function Not Found: %s" % name) from None

    def _text(self, name: str, handle: Any, size: int) -> bytes:
        buffer = self._ctypes.create_string_buffer(size)
        if handle is None:
            self._call(name, buffer, self._ctypes.c_uint(size))
        else:
            self._call(name, handle, buffer, self._ctypes.c_uint(size))
        return buffer.value

    def nvmlInit(self) -> None:  # noqa: N802
        """nvmlInit_v2."""
        self._call("nvmlInit_v2")

    def nvmlShutdown(self) -> None:  # noqa: N802
        """nvmlShutdown."""
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        """The GPUs NVML sees."""
        count = self._ctypes.c_uint(0)
        self._call("nvmlDeviceGetCount_v2", self._ctypes.byref(count))
        return count.value

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:  # noqa: N802
        """The handle of GPU ``index`` (an opaque pointer)."""
        handle = self._ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", self._ctypes.c_uint(index),
                   self._ctypes.byref(handle))
        return handle

    def nvmlSystemGetDriverVersion(self) -> bytes:  # noqa: N802
        """The driver's version."""
        return self._text("nvmlSystemGetDriverVersion", None, 80)

    def nvmlDeviceGetUUID(self, handle: Any) -> bytes:  # noqa: N802
        """A GPU's UUID."""
        return self._text("nvmlDeviceGetUUID", handle, 96)

    def nvmlDeviceGetName(self, handle: Any) -> bytes:  # noqa: N802
        """A GPU's product name."""
        return self._text("nvmlDeviceGetName", handle, 96)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:  # noqa: N802
        """A GPU's memory: ``total``, ``free``, ``used`` (bytes)."""
        memory = self._memory()
        self._call("nvmlDeviceGetMemoryInfo", handle, self._ctypes.byref(memory))
        return memory


    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:  # noqa: N802
        """A GPU's busy shares over the driver's last sample period, in %: ``gpu`` (a kernel
        ran), ``memory`` (device memory was read or written)."""
        rates = self._utilization()
        self._call("nvmlDeviceGetUtilizationRates", handle, self._ctypes.byref(rates))
        return rates

    #: nvmlValueType_t -> the field of nvmlValue_t that holds such a value
    _VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

    def nvmlDeviceGetSamples(self, handle: Any, sampling: int,  # noqa: N802
                             since_us: int) -> List[Tuple[int, Any]]:
        """The driver's samples of kind ``sampling`` (``NVML_GPU_UTILIZATION_SAMPLES``...)
        newer than ``since_us`` (NVML's timestamps, in us): ``[(timestamp_us, value)]``;
        NVMLError ``NVML_ERROR_NOT_FOUND`` where there is none."""
        ctypes = self._ctypes
        kind = ctypes.c_int(0)
        count = ctypes.c_uint(0)
        arguments = (handle, ctypes.c_int(sampling), ctypes.c_ulonglong(since_us),
                     ctypes.byref(kind), ctypes.byref(count))
        self._call("nvmlDeviceGetSamples", *(arguments + (None,)))  # the count
        samples = (self._sample * max(1, count.value))()
        self._call("nvmlDeviceGetSamples", *(arguments + (samples,)))
        field = self._VALUE_FIELDS[kind.value] if 0 <= kind.value < 7 else "ullVal"
        return [(int(sample.timeStamp), getattr(sample.sampleValue, field))
                for sample in samples[:count.value]]

    def nvmlEventSetCreate(self) -> Any:  # noqa: N802
        """A new event set (free it with ``nvmlEventSetFree``)."""
        event_set = self._ctypes.c_void_p()
        self._call("nvmlEventSetCreate", self._ctypes.byref(event_set))
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int,  # noqa: N802
                                 event_set: Any) -> None:
        """Deliver a GPU's events of ``event_types`` (a mask) to ``event_set``."""
        self._call("nvmlDeviceRegisterEvents", handle, self._ctypes.c_ulonglong(event_types),
                   event_set)

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:  # noqa: N802
        """The next event of ``event_set`` (``device``: the GPU's handle as a number,
        ``eventType``, ``eventData``: the XID for an XID event); NVMLError
        ``NVML_ERROR_TIMEOUT`` where none came within ``timeout_ms``."""
        data = self._event_data()
        self._call("nvmlEventSetWait_v2", event_set, self._ctypes.byref(data),
                   self._ctypes.c_uint(timeout_ms))
        return data

    def nvmlEventSetFree(self, event_set: Any) -> None:  # noqa: N802
        """Free an event set."""
        self._call("nvmlEventSetFree", event_set)


def nvml_device(index: int) -> Tuple[Any, Any]:
    """NVML (initialised by the census, retried as it retries) and the handle of GPU
    ``index``: ``(library, handle)``, the library's calls under NVML's names
    (``nvmlDeviceGetUtilizationRates``, ``nvmlDeviceGetSamples``, event sets); RuntimeError
    naming why where NVML is unavailable, ValueError where there is no GPU ``index``."""
    library, reason = _nvml()
    handles = _NVML["handles"]
    if library is None or handles is None:
        raise RuntimeError(reason or "NVML unavailable")
    if not 0 <= index < len(handles):
        raise ValueError("no GPU %d: NVML sees %d" % (index, len(handles)))
    return library, handles[index]


def _load_nvml() -> Any:
    """NVML's library as the census calls it (``_NvmlLibrary``); raises OSError where
    libnvidia-ml.so.1 cannot be loaded (no driver installed, or not mounted here)."""
    import ctypes

    return _NvmlLibrary(ctypes, ctypes.CDLL("libnvidia-ml.so.1"))


def _nvml_init() -> None:
    _NVML["tried"] = True
    _NVML["attempts"] += 1
    backoff = min(NVML_RETRY_MAX_S, max(NVML_RETRY_FIRST_S, 2.0 * _NVML["backoff_s"]))
    if not nvidia_registered():
        # no driver registered yet: NVML cannot work; say why without loading its library,
        # and try again after the backoff (a DaemonSet may start before the driver)
        _NVML.update(reason="NVML unavailable: " + NO_NVIDIA_DEVICE, handles=None,
                     backoff_s=backoff, retry_at=time.monotonic() + backoff)
        return
    nvml = None  # type: Any
    initialised = False
    try:
        nvml = _load_nvml()
        nvml.nvmlInit()
        initialised = True
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        reason = None if handles else "NVML found no GPU"
    except Exception as error:  # no library, driver not loaded, ...
        handles, reason = [], "NVML unavailable: %s" % (error,)
    if reason is None:
        _NVML.update(module=nvml, handles=handles, reason=None, retry_at=None, backoff_s=0.0)
        return
    if initialised:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    _NVML.update(reason=reason, handles=None, backoff_s=backoff,
                 retry_at=time.monotonic() + backoff)


def nvml_init_state() -> Dict[str, Any]:
    """Where NVML's initialisation stands: ``{"available", "reason", "attempts",
    "retry_in_s"}`` (``retry_in_s`` None when no retry is due: NVML up)."""
    retry_at = _NVML["retry_at"] if _NVML["module"] is None else None
    return {"available": _NVML["module"] is not None, "reason": _NVML["reason"],
            "attempts": _NVML["attempts"],
            "retry_in_s": None if retry_at is None or not _NVML["tried"]
            else max(0.0, retry_at - time.monotonic())}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _used_mib(value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    # NVML_VALUE_NOT_AVAILABLE is (unsigned long long)-1 (a stand-in may give None)
    if value < 0 or value >= 2 ** 63:
        return None
    return value / _NVML_MIB


#: (getter, GPU index) whose listing this driver refused (not supported): not asked again
_NVML_REFUSED = set()  # type: Any
_NVML_REFUSALS = (3, 13)  # NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND
#: entries to make room for in a raw listing, per getter: grown from what the driver last needed
_NVML_ROOM = {}  # type: Dict[str, int]
_NVML_RAW = {}  # type: Dict[str, Any]


def _raw_listing(nvml: Any, getter: str) -> Any:
    """The driver's ``<getter>_v3`` (else ``_v2``: the same entries) and its entry struct, or
    None where the library lacks both (a stand-in's own ``getter`` is called then). Resolved
    once per getter."""
    if getter not in _NVML_RAW:
        raw = None
        struct = getattr(nvml, "c_nvmlProcessInfo_v3_t", None)
        resolve = getattr(nvml, "_nvmlGetFunctionPointer", None)  # type: Any
        for version in ("_v3", "_v2") if struct is not None and resolve is not None else ():
            try:
                raw = (resolve(getter + version), struct)
                break
            except Exception:  # function not found on an older driver
                continue
        _NVML_RAW[getter] = raw
    return _NVML_RAW[getter]


def _listing(nvml: Any, getter: str, handle: Any) -> List[Tuple[int, Any]]:
    """One NVML process listing of one GPU as ``[(pid, used bytes or None)]``. One driver call
    into room sized from the last listing (pynvml's function makes two, the count then the
    entries, and builds an object per entry: twice the driver's time with 100 processes); a
    listing that outgrew the room is asked again with the count the driver gave. Raises
    NVMLError (NVML's code as ``value``)."""
    raw = _raw_listing(nvml, getter)
    if raw is None:
        return [(int(entry.pid), getattr(entry, "usedGpuMemory", None))
                for entry in getattr(nvml, getter)(handle)]
    function, struct = raw
    import ctypes

    room = _NVML_ROOM.get(getter, 64)
    for _ in range(4):
        count = ctypes.c_uint(room)
        entries = (struct * room)()
        code = function(handle, ctypes.byref(count), entries)
        if code == nvml.NVML_SUCCESS:
            return [(int(entries[i].pid), entries[i].usedGpuMemory) for i in range(count.value)]
        if code != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
            raise nvml.NVMLError(code)
        room = _NVML_ROOM[getter] = 2 * count.value + 16  # processes start while we ask
    raise nvml.NVMLError(code)


def _listed(nvml: Any, index: int, handle: Any,
            getters: Tuple[str, ...] = _NVML_LISTS) -> List[Dict[str, Any]]:
    """NVML's processes of one GPU as ``[{"pid", "used_mib"}]``: the listings of `getters`
    (compute, MPS compute, graphics by default) where this driver has them, each PID once
    (the first listing that has it). A listing refused as not supported is not asked again."""
    processes = []  # type: List[Dict[str, Any]]
    seen = set()
    for getter in getters:
        if (getter, index) in _NVML_REFUSED or (
                _raw_listing(nvml, getter) is None and not hasattr(nvml, getter)):
            continue
        try:
            found = _listing(nvml, getter, handle)
        except Exception as error:  # not supported on this device / driver
            name = type(error).__name__
            if getattr(error, "value", None) in _NVML_REFUSALS or "NotSupported" in name or \
                    "FunctionNotFound" in name:
                _NVML_REFUSED.add((getter, index))
            continue
        for pid, used in found:
            if pid not in seen:
                seen.add(pid)
                processes.append({"pid": pid, "used_mib": _used_mib(used)})
    return processes


def nvml_snapshot(with_processes: bool = True) -> Dict[str, Any]:
    """Return the census's ``gpu`` section: ``{"available", "reason", "driver", "devices":
    [{"index", "uuid", "name", "memory_used_mib", "memory_total_mib", "processes": [{"pid",
    "used_mib"}]}]}``. PIDs are NVML's, i.e. of the host's PID namespace. NVML missing, no
    driver or no GPU gives ``{"available": false, "reason": "..."}``; never raises."""
    nvml, reason = _nvml()
    if nvml is None:
        return {"available": False, "reason": reason, "driver": None, "devices": []}
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    except Exception:
        driver = None
    devices = []
    errors = []
    for index, handle in enumerate(_NVML["handles"]):
        device = {"index": index, "uuid": None, "name": None, "memory_used_mib": None,
                  "memory_total_mib": None, "processes": []}  # type: Dict[str, Any]
        try:
            device["uuid"] = _text(nvml.nvmlDeviceGetUUID(handle))
            device["name"] = _text(nvml.nvmlDeviceGetName(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            device["memory_used_mib"] = memory.used / _NVML_MIB
            device["memory_total_mib"] = memory.total / _NVML_MIB
            if with_processes:
                device["processes"] = _listed(nvml, index, handle)
        except Exception as error:  # a GPU fallen off the bus, ...
            device["error"] = str(error)
            errors.append("GPU %d: %s" % (index, error))
        devices.append(device)
    result = {"available": True, "reason": None, "driver": driver,
              "devices": devices}  # type: Dict[str, Any]
    if errors:
        result["errors"] = errors
    return result


def nvml_device_memory() -> List[Dict[str, Any]]:
    """Fast path for a 100 Hz sampler: ``[{"index", "used_mib", "total_mib"}]`` per GPU, one
    NVML memory query each (~10 us). Empty list when NVML is not available."""
    nvml, _ = _nvml()
    if nvml is None:
        return []
    get = nvml.nvmlDeviceGetMemoryInfo
    result = []
    for index, handle in enumerate(_NVML["handles"]):
        memory = get(handle)
        result.append({"index": index, "used_mib": memory.used / _NVML_MIB,
                       "total_mib": memory.total / _NVML_MIB})
    return result


def nvml_gpu_processes() -> List[Dict[str, Any]]:
    """Fast path for a sampler: ``[{"gpu_index", "pid", "used_mib"}]`` for every compute
    process on every GPU (host PIDs), MPS clients included where the driver lists them (each
    PID once per GPU). One driver call per listing: ~10 us idle, a few ms with 100 processes:
    sample it less often than device memory. Empty list when NVML is not available."""
    nvml, _ = _nvml()
    if nvml is None:
        return []
    return [dict(process, gpu_index=index)
            for index, handle in enumerate(_NVML["handles"])
            for process in _listed(nvml, index, handle, _NVML_LISTS[:2])]


# --------------------------------------------------------------------------------------------
# the census


def _observer(proc_root: str) -> Dict[str, Any]:
    observer = {"pid": os.getpid(), "uid": os.getuid(), "pid_ns": None, "nspid": None,
                "root": os.geteuid() == 0, "hostname": os.uname().nodename,
                "proc_root": proc_root}  # type: Dict[str, Any]
    try:
        observer["pid_ns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    status = proc_root + "/self/status"
    mounted = os.path.exists(status)  # a copied or recorded tree has no self: a live one does
    try:
        _, nspid = _status_fields(_read_bytes(status if mounted else "/proc/self/status"))
        observer["nspid"] = nspid
    except OSError:
        pass
    # Host PIDs (what NVML reports) are what this /proc shows only when the observer sits in the
    # initial PID namespace, whose inode is a kernel constant (PROC_PID_INIT_INO, since 3.8),
    # and this /proc is mounted from it (then our own NSpid there has a single field). A tree
    # without self cannot say which namespace it shows: not a host view.
    observer["host_view"] = (mounted and observer["pid_ns"] == INIT_PID_NS
                             and observer["nspid"] is not None and len(observer["nspid"]) == 1)
    return observer


def _proc_ns(proc_root: str) -> Optional[str]:
    """PID namespace of the /proc mount: that of a process whose NSpid has one field."""
    try:
        _, nspid = _status_fields(_read_bytes(proc_root + "/self/status"))
        if nspid is not None and len(nspid) == 1:
            return os.readlink(proc_root + "/self/ns/pid")
    except OSError:
        pass
    return None


def _int_value(env: Dict[str, str], key: str, pid: int, errors: List[str],
               minimum: int = 0) -> Tuple[Optional[int], Optional[str]]:
    """Parse an integer env value; return (value, None) or (None, raw) with an error noted."""
    raw = env.get(key)
    if raw is None:
        return None, None
    try:
        value = int(raw.strip())
    except ValueError:
        errors.append("pid %d: %s=%r is not an integer" % (pid, key, raw))
        return None, raw
    if value < minimum:
        errors.append("pid %d: %s=%r is below %d" % (pid, key, raw, minimum))
        return None, raw
    return value, None


#: The modules that are torchrun's elastic agent when Python runs them with ``-m``.
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
#: Python's options that take a value (``-X dev``, ``-W ignore``), besides -c and -m.
_PY_VALUE_OPTIONS = "XW"


def _python_program(cmdline: List[str]) -> Optional[Tuple[str, str]]:
    """What a Python interpreter's command line runs: ("module", name) for ``-m name``,
    ("script", path) for a script, ("code", "") for ``-c``, ("stdin", "") for none; None when
    ``cmdline`` is not a Python interpreter's (its program is no python*)."""
    if not cmdline or not cmdline[0].rsplit("/", 1)[-1].startswith("python"):
        return None
    index = 1
    while index < len(cmdline):
        arg = cmdline[index]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):  # --check-hash-based-pycs VALUE; other long options are flags
            index += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        for position, letter in enumerate(arg[1:], 1):
            rest = arg[position + 1:]
            if letter in "cm":
                value = rest if rest else (cmdline[index + 1] if index + 1 < len(cmdline)
                                           else "")
                return ("code", "") if letter == "c" else ("module", value)
            if letter in _PY_VALUE_OPTIONS:
                if not rest:
                    index += 1  # the value is the next argument
                break
        index += 1
    if index < len(cmdline) and cmdline[index] == "--":
        index += 1
    if index >= len(cmdline) or cmdline[index] == "-":
        return ("stdin", "")
    return ("script", cmdline[index])


def _is_launcher(proc: Dict[str, Any]) -> bool:
    """Whether ``proc`` is torchrun's elastic agent: the ``torchrun`` program itself (its name,
    or its script run by a Python interpreter: ``python .../bin/torchrun``), or a Python
    interpreter running ``-m torch.distributed.run`` or ``-m torch.distributed.launch``. Judged
    from the structure of its command line (the program, then the interpreter's script or
    module), never from a word among its arguments: before round 22 any process whose first
    four arguments mentioned torchrun was one (tmux, ``timeout``, ``sh -c "... torchrun ..."``,
    ``tail -f torchrun.log``), and ``cleanup_hung_job`` sent the tmux server SIGTERM."""
    cmdline = proc.get("cmdline")
    if not cmdline:  # a zombie, or a process whose command line cannot be read
        return proc.get("comm") == "torchrun"
    program = cmdline[0].rsplit("/", 1)[-1]
    if program == "torchrun":
        return True
    runs = _python_program(cmdline)
    if runs is None:
        return False
    kind, what = runs
    if kind == "module":
        return what in LAUNCHER_MODULES
    return kind == "script" and what.rsplit("/", 1)[-1] == "torchrun"


#: torchrun's run id when none is given (`--rdzv-id` defaults to it, `--standalone` draws a
#: random one): it names no job, and two jobs started so would be taken for one.
TORCHRUN_DEFAULT_RUN_ID = "none"


def _job_id(env: Dict[str, str]) -> Optional[str]:
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != TORCHRUN_DEFAULT_RUN_ID:
        return run_id
    if env.get("CHAOSGPU_JOB"):
        return env["CHAOSGPU_JOB"]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return "%s:%s" % (env["MASTER_ADDR"], env["MASTER_PORT"])
    return None


def _frozen(proc: Dict[str, Any], cgroup_root: str, proc_root: str) -> Optional[bool]:
    """Whether the process's cgroup is frozen (v1 freezer.state FROZEN, v2 cgroup.events
    frozen 1); None when it cannot be told. Its cgroup is read now, not taken from the record:
    freezing moves a process to another cgroup (chaosgpu's freezer does), which a cached
    census would not see; the record's cgroup and container follow what is read."""
    try:
        main_path, freezer, v2, container = _cgroups("%s/%d" % (proc_root, proc["pid"]))
    except OSError:
        return None
    if main_path != proc.get("cgroup"):
        proc["cgroup"] = main_path
        proc["container"] = _container_of(container, proc.get("env"))
    answer = None  # type: Optional[bool]
    if freezer is not None:
        try:
            state = _read_bytes(cgroup_root + "/freezer" + freezer + "/freezer.state").strip()
            if state in (b"FROZEN", b"FREEZING"):
                return True
            answer = False
        except OSError:
            pass
    if v2 is not None:
        for root in (cgroup_root, cgroup_root + "/unified"):
            try:
                events = _read_bytes(root + v2 + "/cgroup.events")
            except OSError:
                continue
            if b"frozen 1" in events:
                return True
            answer = False
            break
    return answer


def _launcher_option(proc: Dict[str, Any], *names: str) -> Optional[str]:
    """The value of a torchrun option (``--name value`` or ``--name=value``) in its cmdline."""
    cmdline = proc.get("cmdline") or []
    for index, arg in enumerate(cmdline):
        for name in names:
            if arg == name and index + 1 < len(cmdline):
                return cmdline[index + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None


def _new_job(job_id: str) -> Dict[str, Any]:
    return {"id": job_id, "world_size": None, "master": None, "launcher": "bare",
            "launcher_pid": None, "launcher_starttime": None, "ranks": [],
            "expected_ranks": None, "restart_count": None, "max_restarts": None,
            "survivors": [], "dead": [], "frozen": [], "stopped": [], "tag": None,
            "found_by": FOUND_BY_ENV, "orphaned_helpers": [], "_lws": None, "_group": None,
            "_base_id": job_id}


def _rank_state(proc: Dict[str, Any], cgroup_root: str, proc_root: str) -> str:
    state = proc["state"]
    if state in ("Z", "X"):
        return "zombie"
    if state in ("T", "t"):
        return "stopped"
    return "frozen" if _frozen(proc, cgroup_root, proc_root) else "alive"


def _add_rank(job: Dict[str, Any], proc: Dict[str, Any], env: Dict[str, str],
              gpu_by_pid: Dict[int, float], errors: List[str], cgroup_root: str,
              proc_root: str) -> None:
    pid = proc["pid"]
    numbering = _numbering(env) or TORCH_RANK_KEYS
    rank, bad_rank = _int_value(env, numbering[0], pid, errors)
    world, _ = _int_value(env, "WORLD_SIZE" if "WORLD_SIZE" in env else numbering[1], pid,
                          errors, minimum=1)
    local_rank, _ = _int_value(env, "LOCAL_RANK" if "LOCAL_RANK" in env else numbering[2], pid,
                               errors)
    lws, _ = _int_value(env, "LOCAL_WORLD_SIZE", pid, errors, minimum=1)
    group, _ = _int_value(env, "GROUP_RANK", pid, errors)
    restarts, _ = _int_value(env, "TORCHELASTIC_RESTART_COUNT", pid, errors)
    max_restarts, _ = _int_value(env, "TORCHELASTIC_MAX_RESTARTS", pid, errors)
    if world is not None:
        job["world_size"] = world
    if lws is not None:
        job["_lws"] = lws
    if group is not None:
        job["_group"] = group
    if restarts is not None:
        job["restart_count"] = max(restarts, job["restart_count"] or 0)
    if max_restarts is not None:
        job["max_restarts"] = max_restarts
    if env.get("TORCHELASTIC_RUN_ID"):
        job["launcher"] = "torchrun"
    if job["tag"] is None and proc.get("tag"):
        job["tag"] = proc["tag"]
    entry = {"rank": rank, "local_rank": local_rank, "pid": pid,
             "starttime": proc["starttime"], "restart_count": restarts,
             "host_pid": proc["nspid"][0] if proc.get("nspid") else None,
             "ns_pid": proc["nspid"][-1] if proc.get("nspid") else None,
             "state": _rank_state(proc, cgroup_root, proc_root),
             "gpu_mib": gpu_by_pid.get(pid),
             "rank_source": None if rank is None else (
                 "env" if numbering[0] == "RANK" else numbering[0]),
             "helpers": []}  # type: Dict[str, Any]
    if bad_rank is not None:
        entry["invalid_rank"] = bad_rank
    job["ranks"].append(entry)


def _spawned_child(proc: Dict[str, Any]) -> bool:
    """A process Python's multiprocessing started with the spawn or forkserver method (the
    ranks of torch.multiprocessing.spawn, a DataLoader's workers in a spawn context)."""
    cmdline = proc.get("cmdline") or []
    return "--multiprocessing-fork" in cmdline or any(
        arg.startswith("from multiprocessing.") for arg in cmdline[1:3])


def _rank_keys(proc: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    env = proc.get("env") or {}
    keys = _numbering(env)
    return env.get(keys[0]) if keys else None, env.get("LOCAL_RANK")


def _numbering(env: Dict[str, str]) -> Optional[Tuple[str, str, str]]:
    """The variables that number a task: torch's (TORCH_RANK_KEYS), else the first MPI or
    Slurm launcher's present (LAUNCHER_RANK_KEYS); None when none is."""
    for keys in (TORCH_RANK_KEYS,) + LAUNCHER_RANK_KEYS:
        if keys[0] in env:
            return keys
    return None


def _is_copy_of(child: Dict[str, Any], parent: Dict[str, Any]) -> bool:
    """Whether ``child`` is a copy of ``parent`` rather than a program it ran: forked without
    exec (the same command line) or a multiprocessing child (a DataLoader's workers)."""
    return child.get("cmdline") == parent.get("cmdline") or _spawned_child(child)


def _wraps(parent: Dict[str, Any], child: Dict[str, Any]) -> bool:
    """Whether ``parent`` is a wrapper that runs the trainer ``child`` (both carrying one rank's
    environment), rather than a trainer that runs ``child`` (a `sleep` sidecar, a `python -c`
    probe, a compiler). A wrapper is single-threaded (a shell, env, timeout, numactl, a Python
    script without torch), or a multi-threaded program that is not Python (a profiler such as
    nsys) whose child is multi-threaded too; a multi-threaded trainer (importing torch starts
    threads) is the rank, and what it runs is its helper. Before round 21 every such child
    was taken for the rank: a trainer's sidecar was frozen in its place, and a probe
    subprocess that exited 1 failed a job whose ranks all exited 0."""
    if parent.get("threads", 1) <= 1:
        return True
    return child.get("threads", 1) > 1 and not _python_named(parent)


def _copies_of(parent: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
               ranks: Iterable[int]) -> List[int]:
    """The children of ``parent``, other than ``ranks``, that are copies of it: its helpers."""
    others = set(ranks)
    return sorted(p["pid"] for p in processes.values() if p["ppid"] == parent["pid"]
                  and p["pid"] not in others and _is_copy_of(p, parent))


#: Helpers seen by this process's censuses, (proc root, pid, start time) -> (command line,
#: why): "copy" (forked without exec, a multiprocessing child) or "sidecar" (a wrapper's
#: child beside its trainer). An orphaned helper (its rank died and init or a subreaper adopted
#: it) stays a helper, and a wrapper's sidecar stays one after its trainer ended; a process
#: that exec'd since (another command line) is judged afresh.
_HELPERS = {}  # type: Dict[Tuple[str, int, int], Tuple[Tuple[str, ...], str]]
_HELPERS_MAX = 8192


def _remembered(proc: Dict[str, Any], proc_root: str) -> Optional[str]:
    """Why ``proc`` was a helper in an earlier census of this process ("copy", "sidecar"), if
    it was and still runs the same command line; else None."""
    seen = _HELPERS.get((proc_root, proc["pid"], proc["starttime"]))
    if seen is None or seen[0] != tuple(proc.get("cmdline") or ()):
        return None
    return seen[1]


def _remember(proc: Dict[str, Any], proc_root: str, why: str) -> None:
    if len(_HELPERS) > _HELPERS_MAX:
        _HELPERS.clear()
    _HELPERS[(proc_root, proc["pid"], proc["starttime"])] = (
        tuple(proc.get("cmdline") or ()), why)


def _adopted(proc: Dict[str, Any], processes: Dict[int, Dict[str, Any]]) -> bool:
    """Whether ``proc`` was orphaned: its parent is PID 1, a namespace's init or a known
    subreaper. A parent this census did not read (a census of some PIDs) tells nothing."""
    parent = processes.get(proc["ppid"])
    return parent is not None and (parent["pid"] == 1 or bool(parent.get("ns_init"))
                                   or parent["comm"] in KNOWN_SUBREAPERS)


#: The name torch gives a DataLoader worker's main thread, so /proc/PID/comm of the worker
#: process (torch 2.4 and later; fork, spawn and forkserver workers alike). It never trains.
DATA_WORKER_COMM = "pt_data_worker"

#: Why a process carrying a rank's environment is a helper left behind under no rank (a job's
#: ``orphaned_helpers``, each with its ``why``).
LEFT_DATA_WORKER = DATA_WORKER_COMM      # named so by torch: a DataLoader worker
LEFT_SEEN = "seen as a helper"           # an earlier census of this process judged it one
LEFT_SIDECAR = "sidecar"                 # remembered as a wrapper's sidecar; no trainer beside it
LEFT_SPAWNED = "multiprocessing child"   # a spawn/forkserver child carrying a rank number
LEFT_FORKED = "forked copy"              # shares argv and environment placement with another
LEFT_SESSION = "session leader gone"     # torchrun's run id, in a dead leader's session
_LEFT_REASONS = frozenset((LEFT_DATA_WORKER, LEFT_SEEN, LEFT_SPAWNED, LEFT_FORKED, LEFT_SESSION))


def _data_worker(proc: Dict[str, Any]) -> bool:
    """Whether ``proc``, a job's candidate, is a DataLoader worker by its name (torch names the
    worker's main thread ``pt_data_worker``) carrying a rank's number: never a rank, whether
    its rank lives or not (a fresh census has no memory to tell it otherwise)."""
    return proc["comm"] == DATA_WORKER_COMM and _numbering(proc.get("env") or {}) is not None


def _left_behind(proc: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
                 markers: Dict[int, Optional[Tuple[int, int]]], proc_root: str) -> Optional[str]:
    """Why ``proc``, a candidate adopted by init or a subreaper (``_adopted``) that has no copy
    of itself below it, is a helper left behind by a rank that died (``LEFT_*``), or None:
    remembered as a helper by an earlier census (``LEFT_SIDECAR`` for a wrapper's sidecar,
    which stays its trainer's helper where that trainer is left beside it); a multiprocessing
    child carrying a rank number (a spawn-context DataLoader worker: a rank gets its number as
    an argument or from its launcher, never by multiprocessing); a forked copy (the same argv
    and environment placement as another candidate of that same rank: a fork shares them, an
    exec draws new ones). A process with copies of itself below it (a trainer's DataLoader
    workers share its placement) is their original and is not asked: before, a trainer whose
    wrapper died was taken for its workers' fellow copy and the job had no rank left."""
    seen = _remembered(proc, proc_root)
    if seen is not None:  # the reason an earlier census gave, else what it judged it
        return seen if seen in _LEFT_REASONS else (
            LEFT_SIDECAR if seen == "sidecar" else LEFT_SEEN)
    env = proc.get("env") or {}
    if _spawned_child(proc) and _numbering(env) is not None:
        return LEFT_SPAWNED
    mine = markers.get(proc["pid"])
    if mine is not None and any(marker == mine and _rank_keys(processes[pid]) == _rank_keys(proc)
                                for pid, marker in markers.items() if pid != proc["pid"]):
        return LEFT_FORKED
    return None


def _session_gone(proc: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
                  proc_root: str) -> bool:
    """Whether ``proc`` carries torchrun's run id and lives outside a session of its own whose
    leader is gone: torchrun starts each rank as a session's leader, and a DataLoader worker
    lives in its rank's session. So does a trainer its per-rank wrapper ran (``torchrun
    --no-python bash wrap.sh``): this is asked only of a lone orphan (``_left_together``)."""
    sid = proc.get("sid") or 0
    return "TORCHELASTIC_RUN_ID" in (proc.get("env") or {}) and sid > 0 \
        and sid != proc["pid"] and sid not in processes \
        and not os.path.exists("%s/%d" % (proc_root, sid))


def _left_together(orphans: List[Dict[str, Any]], processes: Dict[int, Dict[str, Any]],
                   helper_of: Dict[int, int], left: Dict[int, str],
                   originals: Any, proc_root: str) -> None:
    """Judge the adopted candidates that no ``_left_behind`` reason made helpers. Those of one
    rank left together by one dead parent (the same adopter and session: a per-rank wrapper
    that ran a sidecar and the trainer, SIGKILLed) are judged as that wrapper's children were
    (``_sidecars``): the trainer stays the rank, the others are its helpers. Before, a fresh
    census made the sidecar a second rank of that number. A remembered sidecar with no trainer
    beside it, and a lone orphan outside its own session whose leader is gone
    (``_session_gone``, unless it has copies of itself below it), are helpers left behind."""
    groups = {}  # type: Dict[Tuple[Any, ...], List[Dict[str, Any]]]
    for proc in orphans:
        key = _rank_keys(proc) + (proc["ppid"], proc.get("sid"))
        groups.setdefault(key, []).append(proc)
    for group in groups.values():
        sidecar = [p for p in group if _remembered(p, proc_root) == "sidecar"]
        trainer = _sidecars(group, helper_of, proc_root) if len(sidecar) < len(group) \
            else None  # sidecars only: their trainer is gone
        for proc in group:
            pid = proc["pid"]
            if pid in helper_of or proc is trainer:
                continue
            if proc in sidecar:
                left[pid] = LEFT_SIDECAR
            elif pid not in originals and _session_gone(proc, processes, proc_root):
                left[pid] = LEFT_SESSION
                _remember(proc, proc_root, LEFT_SESSION)
            else:
                continue
            helper_of[pid] = pid  # a helper of no live rank


def _marker_of(proc: Dict[str, Any], proc_root: str) -> Optional[Tuple[int, int]]:
    try:
        return _exec_marker(_read_bytes("%s/%d/stat" % (proc_root, proc["pid"])))
    except (OSError, ValueError):
        return None


def _trainer(children: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Of a wrapper's children carrying one rank's environment, the trainer: the only one, else
    the only multi-threaded Python one, else the only multi-threaded one, else the only Python
    one; None when that cannot be told (two alike)."""
    if len(children) == 1:
        return children[0]
    tests = (lambda c: c.get("threads", 1) > 1 and _python_named(c),
             lambda c: c.get("threads", 1) > 1, _python_named)
    for test in tests:
        fitting = [c for c in children if test(c)]
        if fitting:
            return fitting[0] if len(fitting) == 1 else None
    return None


def _job_members(processes: Dict[int, Dict[str, Any]], candidates: List[Dict[str, Any]],
                 proc_root: str = "/proc"
                 ) -> Tuple[List[Dict[str, Any]], Dict[int, List[int]], Dict[int, str]]:
    """Split a job's candidate processes into its ranks and their helpers. A candidate whose
    parent is a candidate of the same rank (the same RANK, or none in both) is that parent's
    helper when it is a copy of it (forked without exec: the same command line; or a
    multiprocessing child: a DataLoader's workers, which inherit the rank's environment), or a
    program the trainer runs (a sidecar, a probe subprocess: ``_wraps`` says no); any other
    such child makes its parent a wrapper (a shell that runs the trainer): the child is the
    rank. A copy that trains under a single-threaded parent (a supervisor that re-runs its own
    command line, or runs training in a multiprocessing child) makes that parent a wrapper
    too. Of a wrapper's several such children (a per-rank script that starts a sidecar, then
    the trainer), the trainer is the rank: the only multi-threaded Python one, else the only
    multi-threaded one, else the only Python one; the others are its helpers. A DataLoader
    worker named so by torch (``_data_worker``) is never a rank: without a parent of its rank
    it is a helper left behind. A candidate adopted by init or a subreaper that is a helper
    left behind by a dead rank (``_left_behind``, ``_left_together``) is no rank; the trainer
    of a wrapper that died stays the rank. Returns (ranks, {rank pid: [helper pids]},
    {pid of a helper left behind, under no rank: why}: ``LEFT_*``)."""
    by_pid = {p["pid"]: p for p in candidates}
    helper_of = {}  # type: Dict[int, int]
    left = {}  # type: Dict[int, str]
    wrappers = set()
    under = {}  # type: Dict[int, List[Dict[str, Any]]]  # wrapper pid -> the children it runs
    orphans = []  # type: List[Dict[str, Any]]
    originals = set()  # of copies that are their helpers (a trainer's DataLoader workers)
    for proc in candidates:
        parent = by_pid.get(proc["ppid"])
        if parent is None or _rank_keys(parent) != _rank_keys(proc):
            if _data_worker(proc):
                helper_of[proc["pid"]] = proc["pid"]  # a helper of no live rank
                left[proc["pid"]] = LEFT_DATA_WORKER
            elif _adopted(proc, processes):
                orphans.append(proc)
            continue
        copy = _is_copy_of(proc, parent)
        if copy:  # a trainer's copy, unless it trains under a supervisor
            wrapper = parent.get("threads", 1) <= 1 and proc.get("threads", 1) > 1 \
                and _python_named(proc) and not _resource_tracker(proc) \
                and not _data_worker(proc)
        else:
            wrapper = _wraps(parent, proc)
        if wrapper:
            wrappers.add(parent["pid"])
            under.setdefault(parent["pid"], []).append(proc)
        else:
            helper_of[proc["pid"]] = parent["pid"]
            if copy:
                originals.add(parent["pid"])
    for children in under.values():
        _sidecars(children, helper_of, proc_root)
    if orphans:
        markers = {p["pid"]: _marker_of(p, proc_root) for p in candidates}
        together = []  # type: List[Dict[str, Any]]
        for proc in orphans:
            why = None if proc["pid"] in originals else _left_behind(proc, processes, markers,
                                                                      proc_root)
            if why is None or why == LEFT_SIDECAR:
                together.append(proc)
            else:
                helper_of[proc["pid"]] = proc["pid"]  # a helper of no live rank
                left[proc["pid"]] = why
                _remember(proc, proc_root, why)
        _left_together(together, processes, helper_of, left, originals, proc_root)
    pending = [p for p in candidates if p["ppid"] in helper_of and p["pid"] not in helper_of]
    while pending:  # what a helper runs (a trainer's `sh -c "sleep 1"`) is a helper too
        proc = pending.pop()
        if _rank_keys(by_pid[proc["ppid"]]) == _rank_keys(proc):
            helper_of[proc["pid"]] = proc["ppid"]
            wrappers.discard(proc["ppid"])
            pending.extend(p for p in candidates if p["ppid"] == proc["pid"]
                           and p["pid"] not in helper_of)
    ranks = [p for p in candidates if p["pid"] not in helper_of and p["pid"] not in wrappers]
    return ranks, _helpers_by_rank(helper_of, by_pid, proc_root), left


def _sidecars(children: List[Dict[str, Any]], helper_of: Dict[int, int],
              proc_root: str) -> Optional[Dict[str, Any]]:
    """Of one wrapper's children that would be ranks, make all but the trainer (``_trainer``;
    a child remembered as a sidecar never is) the trainer's helpers in ``helper_of``; return
    that trainer, None where there is none to tell (a single child, or two alike)."""
    if len(children) < 2:
        return None
    sidecars = [c for c in children if _remembered(c, proc_root) == "sidecar"]
    trainer = _trainer([c for c in children if c not in sidecars] or children)
    if trainer is None:
        return None  # which one trains cannot be told: all stay ranks
    for child in children:
        if child is not trainer:
            helper_of[child["pid"]] = trainer["pid"]
            _remember(child, proc_root, "sidecar")
    return trainer


def _orphaned_helper(proc: Dict[str, Any], why: str) -> Dict[str, Any]:
    """A job's entry for a helper left behind under no rank: its PID, start time, the rank
    number it carries (null where none or not a number) and why it is no rank (``LEFT_*``)."""
    keys = _numbering(proc.get("env") or {})
    value = (proc.get("env") or {}).get(keys[0]) if keys else None
    return {"pid": proc["pid"], "starttime": proc["starttime"],
            "rank": int(value) if value is not None and value.isdigit() else None, "why": why}


def _job_shape(job: Dict[str, Any], env: Dict[str, str], pid: int) -> None:
    """Fill the job's world size and this node's group (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``),
    where no rank gave them, from ``env``, a helper left behind by a dead rank: the job's
    expected ranks are then listed, the dead one ``missing``. Malformed values are the
    ranks' to report (``_add_rank``): here they are skipped."""
    numbering = _numbering(env) or TORCH_RANK_KEYS
    world = "WORLD_SIZE" if "WORLD_SIZE" in env else numbering[1]
    for field, key, minimum in (("world_size", world, 1), ("_lws", "LOCAL_WORLD_SIZE", 1),
                                ("_group", "GROUP_RANK", 0)):
        if job[field] is None:
            job[field] = _int_value(env, key, pid, [], minimum)[0]


def _helpers_by_rank(helper_of: Dict[int, int], by_pid: Dict[int, Dict[str, Any]],
                     proc_root: str) -> Dict[int, List[int]]:
    """{rank pid: [its helpers' pids]} from {helper pid: the process it helps}, through
    helpers' helpers; an orphaned helper (``helper_of`` itself) is under no rank. Every helper
    is remembered (``_HELPERS``)."""
    helpers = {}  # type: Dict[int, List[int]]
    for pid in sorted(helper_of):
        if helper_of[pid] == pid:
            continue  # an orphaned helper: listed under no rank
        if _remembered(by_pid[pid], proc_root) is None:
            _remember(by_pid[pid], proc_root, "helper")
        owner = helper_of[pid]
        seen = {pid}
        while owner in helper_of and owner not in seen and helper_of[owner] != owner:
            seen.add(owner)  # a helper's helper: the rank above
            owner = helper_of[owner]
        helpers.setdefault(owner, []).append(pid)
    return helpers


def _resource_tracker(proc: Dict[str, Any]) -> bool:
    """Whether ``proc`` is multiprocessing's resource tracker (never a rank)."""
    return any(arg.startswith("from multiprocessing.resource_tracker")
               for arg in (proc.get("cmdline") or [])[1:4])


def _listening_on(proc: Dict[str, Any], port: str, proc_root: str) -> bool:
    """Whether ``proc`` holds a TCP socket listening on ``port`` (in its network namespace)."""
    base = "%s/%d" % (proc_root, proc["pid"])
    inodes = _tcp_table(base)[0].get(int(port))
    if not inodes:
        return False
    try:
        return bool(inodes & set(_socket_inodes(base + "/fd")))
    except OSError:
        return False


def _set_spawn_parent(job: Dict[str, Any], parent: Dict[str, Any],
                      kind: str = "multiprocessing") -> None:
    """The parent that started the ranks and never restarts them: torch.multiprocessing.spawn's
    main process (ranks that carry no RANK; it joins them and, when one fails, ends the
    others), or an MPI or Slurm launcher (`kind`: its process name)."""
    job["launcher"] = kind
    job["launcher_pid"] = parent["pid"]
    job["launcher_starttime"] = parent["starttime"]
    job["max_restarts"] = 0
    if job["tag"] is None and parent.get("tag"):
        job["tag"] = parent["tag"]


def _set_task_launcher(job: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
                       ranks: List[Dict[str, Any]]) -> None:
    """Ranks numbered by an MPI or Slurm launcher, all started by one such process (mpirun,
    orted, slurmstepd..., directly or through a wrapper shell): that process launched them (it
    never restarts them)."""
    if job["launcher_pid"] is not None or not ranks or any(
            _numbering(p.get("env") or {}) in (None, TORCH_RANK_KEYS)
            for p in ranks):
        return
    parents = []  # type: List[Optional[int]]
    for proc in ranks:
        parent = processes.get(proc["ppid"])
        for _ in range(3):  # up through wrapper shells (`srun bash -c "python train.py"`)
            if parent is None or parent["comm"] in TASK_LAUNCHERS \
                    or parent["comm"] not in NOT_TASKS:
                break
            parent = processes.get(parent["ppid"])
        parents.append(parent["pid"] if parent is not None else None)
    only = parents[0] if len(set(parents)) == 1 else None
    parent = processes.get(only) if only is not None else None
    if parent is not None and not parent["zombie"] and parent["comm"] in TASK_LAUNCHERS:
        _set_spawn_parent(job, parent, parent["comm"])


def _set_launcher(job: Dict[str, Any], launcher: Dict[str, Any]) -> None:
    job["launcher"] = "torchrun"
    job["launcher_pid"] = launcher["pid"]
    job["launcher_starttime"] = launcher["starttime"]
    if job["max_restarts"] is None:
        value = _launcher_option(launcher, "--max-restarts", "--max_restarts")
        job["max_restarts"] = int(value) if value is not None and value.isdigit() else (
            0 if value is None else None)
    if job["tag"] is None and launcher.get("tag"):
        job["tag"] = launcher["tag"]


def _expected_ranks(job: Dict[str, Any], local_masters: Tuple[str, ...]) -> Optional[List[int]]:
    if job["_lws"] is not None and job["_group"] is not None:
        start = job["_group"] * job["_lws"]
        return list(range(start, start + job["_lws"]))
    if job["world_size"] is not None and job["master"] is not None \
            and job["master"].rsplit(":", 1)[0] in local_masters:
        return list(range(job["world_size"]))
    return None


def _finish_ranks(job: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
                  local_masters: Tuple[str, ...]) -> None:
    present = [r["rank"] for r in job["ranks"] if r["rank"] is not None]
    expected = _expected_ranks(job, local_masters)
    job["expected_ranks"] = expected
    missing_ranks = sorted(set(expected or []) - set(present))
    if len(missing_ranks) == 1 and job["launcher_pid"] is not None:
        # a dead rank's environment is gone with its memory: a lone zombie (or exiting) child
        # of the launcher is that rank (with more than one, which is which cannot be told)
        ghosts = [p for p in processes.values() if (p["zombie"] or p.get("exiting"))
                  and p["ppid"] == job["launcher_pid"] and p["env"] is None]
        if len(ghosts) == 1:
            ghost = ghosts[0]
            job["ranks"].append({
                "rank": missing_ranks.pop(), "local_rank": None, "pid": ghost["pid"],
                "starttime": ghost["starttime"], "restart_count": None,
                "host_pid": ghost["nspid"][0] if ghost.get("nspid") else None,
                "ns_pid": ghost["nspid"][-1] if ghost.get("nspid") else None,
                "state": "zombie", "gpu_mib": None, "inferred": True})
    for missing in missing_ranks:
        job["ranks"].append({"rank": missing, "local_rank": None, "pid": None,
                             "starttime": None, "restart_count": None, "host_pid": None,
                             "ns_pid": None, "state": "missing", "gpu_mib": None})
    job["ranks"].sort(key=lambda r: (r["rank"] is None, r["rank"] or 0, r["pid"] or 0))
    job.update(rank_lists(job["ranks"]))


def rank_lists(ranks: List[Dict[str, Any]]) -> Dict[str, List[int]]:
    """A job's rank numbers by state, as its census entry lists them: "survivors" (alive),
    "dead" (zombie or missing), "stopped", and "frozen" (frozen, and stopped too)."""
    lists = {"survivors": [], "dead": [], "stopped": [], "frozen": []}  # type: Dict[str, List[int]]
    names = {"alive": "survivors", "zombie": "dead", "missing": "dead", "stopped": "stopped",
             "frozen": "frozen"}
    for rank in ranks:
        if rank.get("rank") is not None and rank.get("state") in names:
            lists[names[rank["state"]]].append(rank["rank"])
            if rank["state"] == "stopped":
                lists["frozen"].append(rank["rank"])
    return lists


def _job_candidates(processes: Dict[int, Dict[str, Any]], jobs: Dict[str, Dict[str, Any]],
                    launchers: Dict[int, Dict[str, Any]],
                    proc_root: str = "/proc") -> Dict[str, List[Dict[str, Any]]]:
    """Fill ``jobs`` (by id, with their torchrun launcher) and ``launchers`` (every live
    torchrun); return each job's candidate rank processes: RANK in their environment; else,
    carrying the job's master, LOCAL_RANK (the ranks PyTorch Lightning starts) or a
    multiprocessing child (the ranks of torch.multiprocessing.spawn, which get their rank as
    an argument). A shell that exported MASTER_ADDR is no job. One id seen in several network
    namespaces with a loopback master is one job per namespace (``_namespaced_ids``)."""
    members = []  # type: List[Tuple[str, Dict[str, Any], bool]]
    for proc in processes.values():
        launcher = _is_launcher(proc)
        if launcher and not proc["zombie"] and not proc.get("exiting"):
            launchers[proc["pid"]] = proc
        env = proc.get("env")
        if not env:
            continue  # no job key: no job's member, and a launcher of no job here
        job_id = _job_id(env)
        member = "RANK" in env or ("MASTER_PORT" in env and (
            _spawned_child(proc) or "LOCAL_RANK" in env
            or (_numbering(env) is not None and proc["comm"] not in NOT_TASKS)))
        if job_id is not None and (launcher or member):
            members.append((job_id, proc, launcher))
    ids = _namespaced_ids(members, proc_root)
    candidates = {}  # type: Dict[str, List[Dict[str, Any]]]
    for job_id, proc, launcher in members:
        env = proc["env"]
        base_id, job_id = job_id, ids.get(proc["pid"], job_id)
        job = jobs.get(job_id)
        if job is None:
            job = jobs[job_id] = _new_job(job_id)
            job["_base_id"] = base_id
        if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
            job["master"] = "%s:%s" % (env["MASTER_ADDR"], env["MASTER_PORT"])
        if launcher:
            _set_launcher(job, proc)
        else:
            candidates.setdefault(job_id, []).append(proc)
    return candidates


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("localhost", "::1")


def _namespaced_ids(members: List[Tuple[str, Dict[str, Any], bool]],
                    proc_root: str) -> Dict[int, str]:
    """{pid: job id} for the job members whose id is shared by jobs that cannot be one:
    * of different network namespaces while their master is a loopback address (such a job
      cannot reach past its namespace): two pods each running `torchrun` on 127.0.0.1:29500,
      or with the same `--rdzv-id`. Such an id gets ``@`` and the namespace's container id
      (12 characters), else ``net:<inode>``;
    * with different masters, each group started by parents of its own (two torchruns given
      one `--rdzv-id` and two endpoints): ``@`` and the master (an elastic restart that moves
      the master keeps its agent, so it stays one job).
    An id seen once stays as it is; so do members without a master."""
    groups = {}  # type: Dict[str, Dict[Tuple[Optional[str], str], List[Dict[str, Any]]]]
    for job_id, proc, _ in members:
        env = proc["env"]
        if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
            continue
        master = "%s:%s" % (env["MASTER_ADDR"], env["MASTER_PORT"])
        namespace = _namespace_label(proc, proc_root) if _loopback(env["MASTER_ADDR"]) \
            else None
        groups.setdefault(job_id, {}).setdefault((namespace, master), []).append(proc)
    ids = {}  # type: Dict[int, str]
    for job_id, by_key in groups.items():
        if len(by_key) < 2:
            continue
        # a member whose namespace could not be read (a zombie's links are gone) splits nothing
        split_namespaces = len({key[0] for key in by_key if key[0] is not None}) > 1
        parents = [{p["ppid"] for p in procs} for procs in by_key.values()]
        split_masters = len({key[1] for key in by_key}) > 1 and \
            sum(len(group) for group in parents) == len(set().union(*parents))
        for (namespace, master), procs in by_key.items():
            label = "/".join(part for part, split in ((namespace, split_namespaces),
                                                       (master, split_masters))
                             if split and part)
            for proc in procs:
                if label:
                    ids[proc["pid"]] = "%s@%s" % (job_id, label)
    return ids


def _namespace_label(proc: Dict[str, Any], proc_root: str) -> Optional[str]:
    """The network namespace of ``proc`` in words: its container's id (12 characters), else
    ``net:<inode>``; None when it cannot be read."""
    container = (proc.get("container") or {}).get("id")
    if container:
        return str(container)[:12]
    try:
        return "net:%d" % net_ns_inode(proc["pid"], proc_root)
    except ProcError:
        return None


def _place_ranks(job: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
                 ranks: List[Dict[str, Any]], proc_root: str, gpu_by_pid: Dict[int, float],
                 errors: List[str], cgroup_root: str) -> None:
    """Number the ranks that carry no RANK, from facts seen outside. PyTorch Lightning starts
    ranks 1..N-1 with LOCAL_RANK and NODE_RANK: on node 0 the rank is LOCAL_RANK
    (``rank_source: "LOCAL_RANK on node 0"``), and rank 0 is their parent, the main process,
    whose own environment says nothing. torch.multiprocessing.spawn passes the rank as an
    argument: its ranks' common parent is the job's launcher. In both, init_process_group's
    env:// rendezvous makes rank 0 the server of the job's store: the one process listening on
    MASTER_PORT is rank 0 (``rank_source: "store host"``); the numbers of the others stay
    null."""
    rankless = [r for r in job["ranks"] if _numbering(processes[r["pid"]].get("env") or {})
                is None]
    if not rankless:
        _set_task_launcher(job, processes, ranks)
        return
    for entry in rankless:
        env = processes[entry["pid"]].get("env") or {}
        node = env.get("NODE_RANK", env.get("GROUP_RANK"))
        if entry["rank"] is None and node == "0" and entry["local_rank"] is not None:
            entry["rank"], entry["rank_source"] = entry["local_rank"], "LOCAL_RANK on node 0"
    parents = {processes[r["pid"]]["ppid"] for r in rankless}
    parent = processes.get(parents.pop()) if len(parents) == 1 else None
    # orphaned ranks (the main process died) have an init or a reaper as parent: none of theirs
    if parent is not None and (_is_launcher(parent) or parent["zombie"] or parent["ns_init"]
                               or parent["pid"] == 1 or parent["comm"] in KNOWN_SUBREAPERS):
        parent = None
    port = (job["master"] or ":").rsplit(":", 1)[1]
    has_zero = any(r["rank"] == 0 for r in job["ranks"])
    if parent is not None and not has_zero and port.isdigit() \
            and _listening_on(parent, port, proc_root):
        _add_rank(job, parent, parent.get("env") or {}, gpu_by_pid, errors, cgroup_root,
                  proc_root)
        job["ranks"][-1].update(rank=0, rank_source="store host", helpers=_copies_of(
            parent, processes, [r["pid"] for r in job["ranks"]]))
        return
    if parent is not None:
        _set_spawn_parent(job, parent)
    if has_zero or not port.isdigit():
        return
    by_pid = {p["pid"]: p for p in ranks}
    hosts = [r for r in rankless if r["rank"] is None and r["state"] != "zombie"
             and _listening_on(by_pid[r["pid"]], port, proc_root)]
    if len(hosts) == 1:
        hosts[0]["rank"] = 0
        hosts[0]["rank_source"] = "store host"


# --------------------------------------------------------------------------------------------
# jobs whose environment says nothing: found by their rendezvous store's connections

#: A job's ``found_by``: its ranks' environment (RANK, MASTER_PORT, a launcher's task numbers)
#: or, where no environment names it (MASTER_ADDR/MASTER_PORT set inside Python, as PyTorch's
#: DDP tutorial does; ``init_method="tcp://..."``), the connections to its TCPStore.
FOUND_BY_ENV = "environment"
FOUND_BY_STORE = "store connections"
FOUND_BY_PEERS = "peer connections"
#: Torch's libraries in a process's memory map (libtorch_cpu.so, libtorch_python.so ...).
_TORCH_LIBRARY = b"/libtorch"
#: (proc_root, pid, start time) -> None for a process seen with torch loaded (a library stays
#: mapped for the process's life), or when it was last seen without (looked at again after
#: TORCH_RECHECK_S: a Python program may import torch late).
_TORCH_SEEN = {}  # type: Dict[Tuple[str, int, int], Optional[float]]
TORCH_RECHECK_S = 5.0


def _endpoint(text: bytes) -> Tuple[bytes, int]:
    """(address bytes, port) of a /proc/net/tcp{,6} endpoint (``0100007F:3039``); an IPv4
    address mapped into IPv6 (``::ffff:127.0.0.1``) is given as IPv4, so that both tables
    name one connection alike."""
    import struct

    address, _, port = text.partition(b":")
    raw = b"".join(struct.pack("<I", int(address[i:i + 8], 16))
                   for i in range(0, len(address), 8))
    if len(raw) == 16 and raw[:12] == b"\0" * 10 + b"\xff\xff":
        raw = raw[12:]
    return raw, int(port, 16)


def _tcp_table(base: str) -> Tuple[Dict[int, set], List[Tuple[Tuple[bytes, int],
                                                                Tuple[bytes, int], int]]]:
    """The TCP table (IPv4 and IPv6) of the network namespace of the process at ``base``:
    ``({listening port: {socket inode}}, [(local end, remote end, inode) of each established
    connection])``, ends as ``_endpoint`` gives them; a table that cannot be read is empty."""
    listeners = {}  # type: Dict[int, set]
    connections = []  # type: List[Tuple[Tuple[bytes, int], Tuple[bytes, int], int]]
    for name in ("tcp", "tcp6"):
        try:
            lines = _read_pages(base + "/net/" + name).splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            if fields[3] == b"0A":
                listeners.setdefault(_endpoint(fields[1])[1], set()).add(int(fields[9]))
            elif fields[3] == b"01":
                connections.append((_endpoint(fields[1]), _endpoint(fields[2]), int(fields[9])))
    return listeners, connections


if TYPE_CHECKING:
    _Links = Tuple[Dict[int, set], List[Tuple[int, int, Tuple[bytes, int]]]]


def _node_links(base: str) -> _Links:
    """The TCP connections within the network namespace of the process at ``base`` (both ends
    seen) to one of its listening ports: ``({listening port: {socket inode}}, [(client socket
    inode, server socket inode, the address and port the client dialled)])``."""
    listeners, connections = _tcp_table(base)
    by_ends = {(local, remote): inode for local, remote, inode in connections}
    links = []
    for local, remote, inode in connections:
        if remote[1] not in listeners:
            continue
        server = by_ends.get((remote, local))  # the accepted end: a connection within the node
        if server is not None:
            links.append((inode, server, remote))
    return listeners, links


def _store_ports(links: _Links) -> Dict[int, Dict[str, Any]]:
    """Of ``_node_links``: every listening port with at least two clients, as ``{port:
    {"listeners": {inode}, "clients": {client inode: server inode}, "address": what the
    clients dialled}}``."""
    listeners, connections = links
    ports = {}  # type: Dict[int, Dict[str, Any]]
    for client, server, remote in connections:
        entry = ports.setdefault(remote[1], {"listeners": listeners[remote[1]], "clients": {},
                                             "address": _address_of(remote[0])})
        entry["clients"][client] = server
    return {port: entry for port, entry in ports.items() if len(entry["clients"]) >= 2}


def _peer_groups(links: _Links, holder: Dict[int, Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    """The processes of ``holder`` joined by ``_node_links`` (a connection between two of them,
    either way), in groups of two or more, each group's processes by PID."""
    group_of = {}  # type: Dict[int, int]  # PID -> a PID of its group (union-find)

    def root(pid: int) -> int:
        while group_of.setdefault(pid, pid) != pid:
            group_of[pid] = group_of[group_of[pid]]
            pid = group_of[pid]
        return pid

    for client, server, _ in links[1]:
        one, other = holder.get(client), holder.get(server)
        if one is not None and other is not None and one is not other:
            group_of[root(one["pid"])] = root(other["pid"])
    by_pid = {proc["pid"]: proc for proc in holder.values()}
    groups = {}  # type: Dict[int, List[Dict[str, Any]]]
    for pid in sorted(group_of):
        groups.setdefault(root(pid), []).append(by_pid[pid])
    return [members for members in groups.values() if len(members) >= 2]


def _torch_loaded(proc: Dict[str, Any], proc_root: str) -> bool:
    """Whether torch's libraries are mapped in ``proc`` (its memory map; a yes is kept for the
    process's life, a no for ``TORCH_RECHECK_S``)."""
    key = (proc_root, proc["pid"], proc["starttime"])
    now = time.monotonic()
    if key in _TORCH_SEEN:
        seen = _TORCH_SEEN[key]
        if seen is None or now - seen < TORCH_RECHECK_S:
            return seen is None
    try:
        loaded = _TORCH_LIBRARY in _read_pages("%s/%d/maps" % (proc_root, proc["pid"]))
    except OSError:
        return False
    if len(_TORCH_SEEN) > 8192:
        _TORCH_SEEN.clear()
    _TORCH_SEEN[key] = None if loaded else now
    return loaded


def _store_candidates(processes: Dict[int, Dict[str, Any]],
                      launchers: Dict[int, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Live Python processes with more than one thread (importing torch starts one; a process
    group runs more), other than torchrun's agents (whose ranks' environment names their job):
    from the census's own fields, so that a node of many single-threaded Python processes
    pays nothing more."""
    found = []
    for pid, proc in processes.items():
        if proc.get("threads", 2) < 2 or pid in launchers or proc["kthread"] \
                or proc["state"] in ("Z", "X") or proc.get("exiting"):
            continue  # (most processes of a node have a single thread: that test first)
        if _python_named(proc):
            found.append(proc)
    return found


def _python_named(proc: Dict[str, Any]) -> bool:
    """Whether ``proc`` is named as a Python trainer is (python*, pt_*, torchrun, ray::, or
    python* as its program)."""
    program = (proc.get("cmdline") or [""])[0].rsplit("/", 1)[-1]
    return proc["comm"].startswith(_WORKER_NAMES) or program.startswith("python")


def _store_jobs(processes: Dict[int, Dict[str, Any]], jobs: Dict[str, Dict[str, Any]],
                launchers: Dict[int, Dict[str, Any]], gpu_by_pid: Dict[int, float],
                errors: List[str], cgroup_root: str, proc_root: str) -> None:
    """Find torch.distributed jobs by their rendezvous store, where no environment names them
    or names the wrong processes: a TCPStore is served by one rank (rank 0) and every rank,
    that one included, holds a connection to it. So a listening port of a Python process with
    torch loaded that this same process and at least one other such process are connected to,
    within the node, is a job: those processes are its ranks, the store's host is rank 0
    (``rank_source: "store host"``), the other numbers are not known from outside. The job's
    id and ``master`` are the address and port the ranks dialled. Where processes share a
    socket (a DataLoader worker forked by its rank), the oldest holds it and the others are its
    helpers. A job found by environment is kept as it is when its ranks carry their numbers
    or are these same processes; otherwise (ranks that set MASTER_PORT in os.environ: only the
    DataLoader workers they spawn show it) the store's job replaces it.
    Where no store shows (a ``file://`` rendezvous; the ranks left when the store's host, rank
    0, is gone), the ranks' own connections do: gloo's pairs and NCCL's bootstrap ring join
    every rank to another. Such processes (the same kind: Python, torch loaded), joined by
    connections within the node and in no job found already, are a job found by "peer
    connections", named ``peers:PID`` after its oldest process, no rank number known unless a
    launcher's variables give it."""
    candidates = _store_candidates(processes, launchers)
    if len(candidates) < 2:
        return
    member_of = {}  # type: Dict[int, str]
    for job in jobs.values():  # every process of a job found by environment
        for rank in job["ranks"]:
            for pid in [rank["pid"], job["launcher_pid"]] + list(rank.get("helpers") or []):
                if pid is not None:
                    member_of[pid] = job["id"]
        for left in job["orphaned_helpers"]:  # a dead rank's workers hold its sockets
            member_of[left["pid"]] = job["id"]
    by_netns = {}  # type: Dict[int, List[Dict[str, Any]]]
    for proc in candidates:
        try:
            netns = os.stat("%s/%d/ns/net" % (proc_root, proc["pid"])).st_ino
        except OSError:
            continue
        by_netns.setdefault(netns, []).append(proc)
    for members in by_netns.values():
        if len(members) < 2:
            continue
        # any member's view of the namespace will do: one read of its TCP tables
        links = _node_links("%s/%d" % (proc_root, members[0]["pid"]))
        if not links[1]:
            continue
        holder = _socket_holders(members, proc_root)
        ports = _store_ports(links)
        # the oldest listener first (socket inodes grow): a job's TCPStore, opened by
        # init_process_group, names it, not NCCL's bootstrap root (the same shape, for a moment)
        for port in sorted(ports, key=lambda p: min(ports[p]["listeners"])):
            store = ports[port]
            hosts = {holder[i]["pid"] for i in store["listeners"] if i in holder}
            hosts |= {holder[s]["pid"] for s in store["clients"].values() if s in holder}
            clients = {holder[c]["pid"]: holder[c] for c in store["clients"] if c in holder}
            if len(hosts) != 1 or min(hosts) not in clients or len(clients) < 2 \
                    or not all(_torch_loaded(proc, proc_root) for proc in clients.values()):
                continue  # no store served and used by these processes, or not torch's
            _add_found_job("%s:%d" % (store["address"], port), FOUND_BY_STORE,
                           processes[min(hosts)], clients, processes, jobs, member_of,
                           gpu_by_pid, errors, cgroup_root, proc_root)
        _peer_jobs(links, holder, processes, jobs, member_of, gpu_by_pid, errors,
                   cgroup_root, proc_root)


def _peer_jobs(links: _Links, holder: Dict[int, Dict[str, Any]],
               processes: Dict[int, Dict[str, Any]], jobs: Dict[str, Dict[str, Any]],
               member_of: Dict[int, str], gpu_by_pid: Dict[int, float], errors: List[str],
               cgroup_root: str, proc_root: str) -> None:
    """The jobs found by their ranks' peer connections in one network namespace (see
    ``_store_jobs``); a job found by environment whose ranks they join loses the live "ranks"
    they leave out (``_unjoined_out``)."""
    connected = {}  # type: Dict[str, set]  # job found by environment -> its joined ranks
    for group in _peer_groups(links, holder):
        if not all(_torch_loaded(proc, proc_root) for proc in group):
            continue  # not torch's processes
        if any(proc["pid"] in member_of for proc in group):
            owners = {member_of.get(proc["pid"], "") for proc in group}
            owner = owners.pop()
            if owner and not owners:
                connected.setdefault(owner, set()).update(p["pid"] for p in group)
            continue  # a job found already
        oldest = min(group, key=lambda p: (p["starttime"], p["pid"]))
        _add_found_job("peers:%d" % oldest["pid"], FOUND_BY_PEERS, None,
                       {proc["pid"]: proc for proc in group}, processes, jobs, member_of,
                       gpu_by_pid, errors, cgroup_root, proc_root)
    for job_id, joined in connected.items():
        _unjoined_out(jobs.get(job_id), joined)


def _unjoined_out(job: Optional[Dict[str, Any]], joined: set) -> None:
    """Drop from a torch.multiprocessing job found by environment (its ranks carry no number:
    any spawn child of the main process carrying MASTER_PORT is a candidate) the live ranks
    that its ranks' peer connections (``joined``, two or more) leave out: a later child of the
    main process (an evaluator, an uploader) holds none of them, and is no rank. Before round
    22 such a child was listed as a rank, and ``freeze_rank("any")`` froze it."""
    if job is None or job["found_by"] != FOUND_BY_ENV or job["launcher"] != "multiprocessing" \
            or len(joined) < 2 or any(r["rank_source"] is not None for r in job["ranks"]):
        return
    job["ranks"] = [r for r in job["ranks"] if r["pid"] in joined or r["state"] == "zombie"]


def _socket_holders(members: List[Dict[str, Any]], proc_root: str) -> Dict[int, Dict[str, Any]]:
    """Socket inode -> the process holding it; of processes sharing one (a forked copy holds
    its parent's), the oldest."""
    holder = {}  # type: Dict[int, Dict[str, Any]]
    for proc in members:
        try:
            inodes = _socket_inodes("%s/%d/fd" % (proc_root, proc["pid"]))
        except OSError:
            continue
        for inode in inodes:
            known = holder.get(inode)
            if known is None or (proc["starttime"], proc["pid"]) < (known["starttime"],
                                                                     known["pid"]):
                holder[inode] = proc
    return holder


def _add_found_job(job_id: str, found_by: str, host: Optional[Dict[str, Any]],
                   clients: Dict[int, Dict[str, Any]], processes: Dict[int, Dict[str, Any]],
                   jobs: Dict[str, Dict[str, Any]], member_of: Dict[int, str],
                   gpu_by_pid: Dict[int, float], errors: List[str], cgroup_root: str,
                   proc_root: str) -> None:
    """Add a job found by its connections (see ``_store_jobs``: a store's, whose ``host`` is
    rank 0, or peers', with no host) unless a job found by environment already names these
    ranks."""
    known = {member_of[pid] for pid in clients if pid in member_of}
    if job_id in jobs:
        known.add(job_id)
    for other in known:
        ranks = jobs[other]["ranks"]
        if jobs[other]["found_by"] == FOUND_BY_STORE \
                or any(r["rank_source"] not in (None, "store host") for r in ranks) \
                or {r["pid"] for r in ranks} == set(clients):
            return  # another store of a job found already, or named by its environment
    tag = next((jobs[other]["tag"] for other in sorted(known) if jobs[other]["tag"]), None)
    for other in known:
        del jobs[other]
    job = jobs[job_id] = _new_job(job_id)
    job["master"] = job_id if host is not None else None
    job["found_by"] = found_by
    ranks = sorted(clients.values(), key=lambda p: p["pid"])
    for proc in ranks:  # numbered where a launcher's variables show (mpirun, srun)
        _add_rank(job, proc, proc.get("env") or {}, gpu_by_pid, errors, cgroup_root,
                  proc_root)
        entry = job["ranks"][-1]
        entry["helpers"] = _copies_of(proc, processes, clients)
        if proc is host and entry["rank"] is None:
            entry["rank"], entry["rank_source"] = 0, "store host"
        for pid in [proc["pid"]] + entry["helpers"]:
            member_of[pid] = job_id
    job["tag"] = job["tag"] or tag
    _set_task_launcher(job, processes, ranks)
    parents = {proc["ppid"] for proc in ranks}
    parent = processes.get(parents.pop()) if len(parents) == 1 else None
    if job["launcher_pid"] is None and parent is not None and not (
            parent["zombie"] or parent["ns_init"] or parent["pid"] == 1
            or parent["comm"] in KNOWN_SUBREAPERS or parent["comm"] in NOT_TASKS) \
            and all(_spawned_child(proc) or proc.get("cmdline") == parent.get("cmdline")
                    for proc in ranks):
        _set_spawn_parent(job, parent)  # torch.multiprocessing's main process


def _elastic_agent(parent: Dict[str, Any], proc_root: str) -> bool:
    """Whether ``parent``, the parent of torchrun-started ranks that is no torchrun by name, is
    their elastic agent under another name (a script calling torch's launcher API): a live
    Python process with torch loaded. Not the init or subreaper that adopted the ranks of a
    dead agent (PID 1, a namespace's init, tini, systemd, a supervisor written in Python
    without torch): before round 21 such a process was called the job's torchrun, and
    `cleanup_hung_job` sent it SIGTERM."""
    if parent["zombie"] or parent["pid"] == 1 or parent.get("ns_init") \
            or parent["comm"] in KNOWN_SUBREAPERS or not _python_named(parent):
        return False
    return _torch_loaded(parent, proc_root)


def _jobs(processes: Dict[int, Dict[str, Any]], gpu_by_pid: Dict[int, float],
          errors: List[str], cgroup_root: str, hostname: str,
          proc_root: str = "/proc") -> List[Dict[str, Any]]:
    """Distributed-training jobs from the ranks' environment, kept as one job across elastic
    restarts (torchrun's run id) and listed while their launcher lives even with no rank (a
    restart in progress). Rank states here are what one reading shows (alive, stopped, frozen,
    zombie, missing); whether a job is hung is a verdict over time (chaosgpu.job), never this."""
    jobs = {}  # type: Dict[str, Dict[str, Any]]
    launchers = {}  # type: Dict[int, Dict[str, Any]]
    candidates = _job_candidates(processes, jobs, launchers, proc_root)
    for job_id, members in candidates.items():
        ranks, helpers, left = _job_members(processes,
                                            sorted(members, key=lambda p: p["pid"]), proc_root)
        job = jobs[job_id]
        for proc in ranks:
            _add_rank(job, proc, proc.get("env") or {}, gpu_by_pid, errors, cgroup_root,
                      proc_root)
            job["ranks"][-1]["helpers"] = helpers.get(proc["pid"], [])
        job["orphaned_helpers"] = [_orphaned_helper(processes[pid], why)
                                   for pid, why in sorted(left.items())]
        for pid in sorted(left):  # a job whose ranks are gone: what its helpers carry
            _job_shape(job, processes[pid].get("env") or {}, pid)
        _place_ranks(job, processes, ranks, proc_root, gpu_by_pid, errors, cgroup_root)
    attached = set()
    for job in jobs.values():
        for r in job["ranks"]:
            proc = processes[r["pid"]]
            parent = processes.get(proc["ppid"])
            for _ in range(4):  # up through wrappers (a shell that runs the trainer)
                if parent is None or parent["pid"] in launchers \
                        or _job_id(parent.get("env") or {}) != job["_base_id"]:
                    break
                parent = processes.get(parent["ppid"])
            if parent is not None and parent["pid"] not in launchers \
                    and "TORCHELASTIC_RUN_ID" in (proc.get("env") or {}) \
                    and _elastic_agent(parent, proc_root):
                launchers[parent["pid"]] = parent  # an elastic agent by another name
            if parent is not None and parent["pid"] in launchers:
                _set_launcher(job, parent)
        if job["launcher_pid"] is not None:
            attached.add(job["launcher_pid"])
    for pid, launcher in launchers.items():
        if pid in attached:
            continue
        # a torchrun with no rank now: starting, restarting or tearing down. Its run id is in
        # its cmdline only when given (--rdzv-id); otherwise it is named after its PID.
        run_id = _launcher_option(launcher, "--rdzv-id", "--rdzv_id")
        job_id = run_id if run_id and run_id != TORCHRUN_DEFAULT_RUN_ID else "torchrun:%d" % pid
        if job_id in jobs and jobs[job_id]["launcher_pid"] in attached:
            continue  # the agent whose ranks were found stays the job's launcher
        job = jobs.setdefault(job_id, _new_job(job_id))
        _set_launcher(job, launcher)
        job["hidden_ranks"] = sum(1 for p in processes.values() if p["ppid"] == pid
                                  and "env" in (p.get("unreadable") or []))
    _store_jobs(processes, jobs, launchers, gpu_by_pid, errors, cgroup_root, proc_root)
    local_masters = ("127.0.0.1", "localhost", "::1", hostname)
    for job in jobs.values():
        _finish_ranks(job, processes, local_masters)
        del job["_lws"], job["_group"], job["_base_id"]
    return sorted(jobs.values(), key=lambda j: j["id"])


def _own_view(proc: Dict[str, Any], proc_root: str) -> Tuple[int, Optional[int], Optional[int]]:
    """(pid, sid, pgid) of ``proc`` as seen from its own PID namespace: 0 for a session or
    group whose leader is outside that namespace. A record of a nested process that lacks them
    (cached, lite) gets them from one read of its status."""
    nspid = proc.get("nspid")
    if not nspid or len(nspid) == 1:
        return proc["pid"], proc["sid"], proc["pgid"]
    if "_nssid" not in proc:
        try:
            status = read_status(proc["pid"], proc_root)
            proc["_nssid"] = (status["nssid"] or [None])[-1]
            proc["_nspgid"] = (status["nspgid"] or [None])[-1]
        except ProcError:
            proc["_nssid"] = proc["_nspgid"] = None
    return nspid[-1], proc.get("_nssid"), proc.get("_nspgid")


def _same_namespace(proc: Dict[str, Any], parent: Dict[str, Any]) -> bool:
    if proc.get("pid_ns") is not None and parent.get("pid_ns") is not None:
        return bool(proc["pid_ns"] == parent["pid_ns"])
    return len(proc.get("nspid") or [0]) == len(parent.get("nspid") or [0])


def orphan_reason(proc: Dict[str, Any], parent: Optional[Dict[str, Any]], initial_ns: bool,
                  proc_root: str = "/proc") -> Optional[str]:
    """The orphan rule (docs/census.md), judged from the process's own PID namespace so that
    the host and a view from inside that namespace agree: why ``proc`` is an orphan, or None.
    ``parent`` is the record of its parent (None when it is not visible); ``initial_ns`` says
    the process is in the host's (initial) PID namespace, where session 0 is the kernel's own.
    An orphan: its parent, in its own namespace, is that namespace's init or a known
    subreaper, and it is neither a session leader, nor in its parent's session, nor (when its
    session's leader is outside the namespace, as unshare and nsenter leave it, so that the
    session says nothing there) the leader of its own process group."""
    if proc["kthread"] or proc["ns_init"] or proc["pid"] == 1 or parent is None:
        return None
    if not _same_namespace(proc, parent):
        return None  # seen from its namespace its parent is outside it (PPID 0): not judged
    if parent["ns_init"] or parent["pid"] == 1:
        kind = "init of its PID namespace"
    elif parent["comm"] in KNOWN_SUBREAPERS:
        kind = "subreaper"
    else:
        return None
    own, sid, pgid = _own_view(proc, proc_root)
    if sid is None or sid == own:
        return None  # cannot tell (status unreadable), or a session leader: started on purpose
    _, parent_sid, _ = _own_view(parent, proc_root)
    if sid != 0 or initial_ns:
        if sid == parent_sid:
            return None  # in its parent's own session: started by that parent
        return "parent is %s (pid %d, %s); session %d is not its own nor its parent's" % (
            kind, parent["pid"], parent["comm"], sid)
    if pgid == own:
        return None  # its own process group (isolated on purpose, as tini does for its child)
    return ("parent is %s (pid %d, %s); its session's leader is outside its namespace and it "
            "leads no process group of its own" % (kind, parent["pid"], parent["comm"]))


def _mark_orphans(processes: Dict[int, Dict[str, Any]], host_view: bool,
                  proc_root: str = "/proc") -> None:
    for proc in processes.values():
        parent = processes.get(proc["ppid"])
        if parent is None or not (parent["ns_init"] or parent["pid"] == 1
                                  or parent["comm"] in KNOWN_SUBREAPERS):
            continue  # orphan_reason's own first test, without the call for most processes
        initial = host_view and len(proc.get("nspid") or [1]) == 1
        reason = orphan_reason(proc, parent, initial, proc_root)
        if reason is not None:
            proc["orphan"] = True
            proc["orphan_reason"] = reason


def _read_serial(wanted: List[int], proc_root: str, env: bool, fds: Union[bool, str],
                 proc_ns: Optional[str], level: str,
                 cache: Optional[Dict[Tuple[str, int, int], Dict[str, Any]]],
                 cache_before: Optional[int]) -> Tuple[Dict[int, Dict[str, Any]], List[str]]:
    processes = {}  # type: Dict[int, Dict[str, Any]]
    errors = []  # type: List[str]
    if cache is not None and level != "stat":
        wanted = _read_known(wanted, proc_root, env, fds, level == "full", cache, processes)
    elif cache is None and level == "full" and proc_ns is not None:
        wanted = _read_plain(wanted, proc_root, env, fds, proc_ns, processes)
    for pid in wanted:
        try:
            record = read_process(pid, proc_root, env=env, fds=fds, proc_ns=proc_ns,
                                  cache=cache, cache_before=cache_before,
                                  details=level == "full", status=level != "stat")
        except (OSError, ValueError, IndexError) as error:
            errors.append("pid %d: unreadable stat: %s" % (pid, error))
            continue
        if record is not None:
            processes[pid] = record
    return processes, errors


def _read_plain(wanted: List[int], proc_root: str, env: bool, fds: Union[bool, str],
                proc_ns: str, processes: Dict[int, Dict[str, Any]]) -> List[int]:
    """Read in full, without a cache, the processes of ``wanted`` that are plain (a live user
    process of this /proc's PID namespace whose five files all read) into ``processes``, and
    return the others for ``read_process``: a kernel thread, a zombie, a process of a nested
    PID namespace, one with a file that failed (vanished, denied) or a status without the
    lines read here. The record is the one ``read_process`` makes for such a process (a
    snapshot of a busy node is mostly this loop: one frame per process instead of a dozen
    helper calls, ~45% less Python per process)."""
    rest = []  # type: List[int]
    read_bytes = _read_bytes
    for pid in wanted:
        base = "%s/%d" % (proc_root, pid)
        try:
            stat = read_bytes(base + "/stat")
            record = _stat_record(pid, stat)
            if record["kthread"] or record["state"] in ("Z", "X"):
                rest.append(pid)
                continue
            status = read_bytes(base + "/status")
            cmdline = read_bytes(base + "/cmdline")
            environ = read_bytes(base + "/environ") if env else b""
            cgroup = read_bytes(base + "/cgroup")
            uid_at = status.index(b"\nUid:") + 5
            nspid_at = status.index(b"\nNSpid:") + 7
            nspid = status[nspid_at:status.find(b"\n", nspid_at)].split()
            if len(nspid) != 1:  # a nested PID namespace: its session and group are read too
                rest.append(pid)
                continue
            uid = int(status[uid_at:status.find(b"\n", uid_at)].split(None, 1)[0])
            own = int(nspid[0])
        except (OSError, ValueError, IndexError):
            rest.append(pid)  # read_process tells vanished, denied and odd apart
            continue
        record["uid"] = uid
        record["nspid"] = [own]
        record["ns_init"] = own == 1
        record["pid_ns"] = proc_ns
        record["cmdline"] = _split_cmdline(cmdline)
        if env:
            found = _parsed_once(_ENVS, environ, _read_env, 1024)
            record["env"] = dict(found)
            record["tag"] = found.get("CHAOSGPU_TAG")
        paths = _parsed_once(_CGROUPS, cgroup, _cgroup_paths, 4096)
        record["cgroup"] = paths[0]
        record["container"] = _container_of(paths[3], record["env"])
        _read_fds(record, base, fds)
        if record["errors"] and _vanished(record, base):
            continue
        processes[pid] = record
    return rest


def _read_known(wanted: List[int], proc_root: str, env: bool, fds: Union[bool, str],
                details: bool, cache: Dict[Tuple[str, int, int], Dict[str, Any]],
                processes: Dict[int, Dict[str, Any]]) -> List[int]:
    """Read the processes of ``wanted`` whose stat fd is held into ``processes`` (one pread
    each, in one loop under one lock: the polled census of a busy node is mostly this; also
    ``read_process``'s way for one such process); return the others, to be read afresh: those
    without a held fd, reaped ones, and those the cache does not know (any more) or knows
    without the env asked for. A record is the template, what stat says now and the cache
    entry; a stat that reads exactly as at the last census, with the same entry, gives a copy
    of the last record (an idle process costs a pread and a copy)."""
    rest = []  # type: List[int]
    scans = []  # type: List[Dict[str, Any]]
    pread = os.pread
    held_get = _STAT_FDS.get
    cache_get = cache.get
    with _STAT_FDS_LOCK:
        for pid in wanted:
            key = (proc_root, pid)
            slot = held_get(key)
            if slot is None:
                rest.append(pid)
                continue
            try:
                stat = pread(slot[0], 4096, 0)
            except OSError:
                stat = b""
            if not stat:  # reaped: its PID may be someone else's now; read it afresh
                os.close(slot[0])
                del _STAT_FDS[key]
                rest.append(pid)
                continue
            entry = cache_get(slot[5])  # the one authority on what a process keeps for life
            if entry is None or (env and "env" not in entry and not slot[1]["kthread"]):
                rest.append(pid)
                continue
            if entry is slot[4] and stat == slot[2]:  # idle: as at the last census
                record = dict(slot[3])
                record["unreadable"] = []
                record["errors"] = {}
            else:
                if _execed(entry, stat):  # another program now: forget it, read it afresh
                    _forget_execed(cache, slot[5])
                    os.close(slot[0])
                    del _STAT_FDS[key]
                    rest.append(pid)
                    continue
                record = _live_record(pid, stat, slot[1])
                record.update(entry)
                slot[2], slot[3], slot[4] = stat, dict(record), entry
            processes[pid] = record
            if record["kthread"]:
                continue
            if not details:
                record["not_read"] = ["nvidia_fds"]
            elif not fds:
                continue
            elif fds == NO_NVIDIA_DEVICE or record["state"] in ("Z", "X"):
                record["nvidia_fds"] = []
            else:
                scans.append(record)
    for record in scans:  # what can change during a life, read outside the lock
        base = "%s/%d" % (proc_root, record["pid"])
        _read_fds(record, base, fds)
        if _vanished(record, base):
            del processes[record["pid"]]
    return rest


def _fork_work(work: Any) -> Optional[Tuple[int, int]]:
    """Run ``work()`` in a forked child that sends its result (marshalled) over a pipe, closes
    the pipe and exits; return (child pid, read end), or None when the pipe or the fork failed.
    Collect it with ``_collect_work`` (the one way the census forks: its readers and its NVML
    reading)."""
    import marshal

    try:
        read_fd, write_fd = os.pipe()
    except OSError:
        return None
    try:
        child = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return None
    if child == 0:  # pragma: no cover - runs in the forked child
        status = 0
        try:
            os.close(read_fd)
            view = memoryview(marshal.dumps(work()))
            while view:
                view = view[os.write(write_fd, view):]
            # the parent sees the result's end now, not once the exit has torn down this
            # child's memory and closed its files (NVML's: the driver's)
            os.close(write_fd)
        except BaseException:
            status = 1
        os._exit(status)
    os.close(write_fd)
    return child, read_fd


def _reap(child: int) -> int:
    """Wait for a forked child of the census and return its wait status (0 where it was
    reaped already: SIGCHLD ignored)."""
    try:
        return os.waitpid(child, 0)[1]
    except ChildProcessError:
        return 0


def _collect_work(forked: Tuple[int, int], redo: Any,
                  unreaped: Optional[List[int]] = None) -> Any:
    """The result of a ``_fork_work`` child: read to its end, unmarshal, reap the child; a
    child that failed (exit status, a torn result) is redone here by ``redo()``, so a result
    never depends on the fork. With ``unreaped``, a whole result is returned at once and the
    child, still exiting, is added there for the caller to ``_reap`` later (a marshalled
    object cut short does not load, so the result needs no exit status)."""
    import marshal

    child, read_fd = forked
    parts = []
    try:
        while True:
            part = os.read(read_fd, 1 << 20)
            if not part:
                break
            parts.append(part)
    except BaseException:
        _reap(child)
        raise
    finally:
        os.close(read_fd)
    try:
        result = marshal.loads(b"".join(parts))
    except (ValueError, EOFError, TypeError):
        _reap(child)
        return redo()
    if unreaped is not None:
        unreaped.append(child)
        return result
    if _reap(child) != 0:
        return redo()
    return result


#: PIDs a reader of a parallel census takes at a time (``_read_parallel``); more where there
#: would be over BLOCKS_MAX blocks
BLOCK_PIDS = 64
#: blocks at most: their numbers (2 bytes each) are one write no larger than PIPE_BUF into an
#: empty pipe, which never blocks and which the readers share whole
BLOCKS_MAX = 2000


def _queued_blocks(queue: int, taken: List[int]) -> Iterator[int]:
    """The block numbers this reader takes from ``queue`` (2 bytes each, one reader per
    number), each also added to ``taken``, until none is left (end of file)."""
    while True:
        number = os.read(queue, 2)
        if len(number) < 2:
            return
        taken.append(int.from_bytes(number, "little"))
        yield taken[-1]


def _read_parallel(wanted: List[int], proc_root: str, env: bool, fds: Union[bool, str],
                   proc_ns: Optional[str], level: str, workers: int,
                   forked: Any = None, unreaped: Optional[List[int]] = None,
                   ) -> Tuple[Dict[int, Dict[str, Any]], List[str]]:
    """Read ``wanted`` over ``workers`` readers: ``workers - 1`` forked children and this
    process. The PIDs are cut into blocks (``BLOCK_PIDS``) whose numbers wait in a pipe; each
    reader takes the next number (a 2-byte read: each goes to one reader) until none is left,
    so a reader slowed down (a busy CPU, a child's sending of its records) takes fewer blocks
    and none waits for another's fixed share. The blocks that no reader returned (a child
    that failed, or could not be forked) are read here afterwards, so the result never
    depends on the fork. With ``unreaped``, children whose results are taken are left there
    to be reaped once the census is made (see ``_collect_work``)."""
    size = max(BLOCK_PIDS, -(-len(wanted) // BLOCKS_MAX))
    blocks = [wanted[i:i + size] for i in range(0, len(wanted), size)]

    def read_blocks(numbers: Iterable[int]) -> Tuple[Dict[int, Dict[str, Any]], List[str]]:
        processes = {}  # type: Dict[int, Dict[str, Any]]
        errors = []  # type: List[str]
        for number in numbers:
            more, errs = _read_serial(blocks[number], proc_root, env, fds, proc_ns, level,
                                      None, None)
            processes.update(more)
            errors.extend(errs)
        return processes, errors

    def reader(queue: int) -> Any:
        def take() -> Tuple[Dict[int, Dict[str, Any]], List[str], List[int]]:
            taken = []  # type: List[int]
            processes, errors = read_blocks(_queued_blocks(queue, taken))
            return processes, errors, taken
        return take

    try:
        queue, filler = os.pipe()
    except OSError:
        return read_blocks(list(range(len(blocks))))
    try:
        os.write(filler, b"".join(n.to_bytes(2, "little") for n in range(len(blocks))))
    finally:
        os.close(filler)
    children = []  # type: List[Tuple[int, int]]
    try:
        for _ in range(workers - 1):
            child = _fork_work(reader(queue))
            if child is not None:
                children.append(child)
        if forked is not None:
            forked()  # every reader is forked: threads may start now
        processes, errors, done = reader(queue)()
    except BaseException:  # no forked reader outlives a census that failed here
        for child in children:
            _collect_work(child, lambda: None)
        raise
    finally:
        os.close(queue)
    returned = set(done)
    for child in children:
        more, errs, taken = _collect_work(child, lambda: ({}, [], []), unreaped)
        processes.update(more)
        errors.extend(errs)
        returned.update(taken)
    left = [n for n in range(len(blocks)) if n not in returned]
    if left:  # taken by a child that failed: read here
        more, errs = read_blocks(left)
        processes.update(more)
        errors.extend(errs)
    return processes, errors


#: processes per forked reader below which forking does not pay (measured on 2 cores with
#: 1,000 processes: 2 readers 22.5 ms, 1 reader 32.7 ms; a fork and its marshalled records
#: cost ~1-2 ms, reading 250 processes ~10-20 ms: bench/census_bench.py). Forking starts at
#: 1,000 processes (``_read_all``): there a 16-core host takes 4 readers.
PROCESSES_PER_READER = 250


def auto_workers(count: int) -> int:
    """How many readers pay for ``count`` processes: one per PROCESSES_PER_READER processes, at
    most one per CPU this process may run on (its affinity) and at most 8: the reads are
    syscall-bound and scale with CPUs. The load is not consulted: on 2 cores with one CPU kept
    busy by a spinning task, 2 readers against 1 took 144 / 112 ms at 1,000 processes, 498 /
    533 ms at 5,000 and 933 / 1189 ms at 10,000
    (bench/results/census-2026-12-03-cpu2-round5.txt), while a kernel thread busy in bursts
    (memory monitoring) made a runnable-count check pick one reader a quarter of the time
    (docs/census.md, round 5)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8, count // PROCESSES_PER_READER))


def _lite_candidates(processes: Dict[int, Dict[str, Any]], gpu: Dict[str, Any]) -> List[int]:
    """PIDs that lite mode reads in full (see ``census``)."""
    wanted = set()
    for device in gpu.get("devices") or []:
        for entry in device.get("processes") or []:
            if entry.get("pid") in processes:
                wanted.add(entry["pid"])
    inits = {pid for pid, p in processes.items() if p["ns_init"] or pid == 1
             or p["comm"] in KNOWN_SUBREAPERS}
    for pid, proc in processes.items():
        if proc["kthread"]:
            continue
        if proc["zombie"] or proc.get("exiting") or proc["ppid"] in inits \
                or proc["comm"].startswith(_WORKER_NAMES):
            wanted.add(pid)
    return sorted(wanted)


def _attribute(gpu: Dict[str, Any], processes: Dict[int, Dict[str, Any]],
               observer: Dict[str, Any], job_of: Dict[int, Tuple[str, Optional[int]]]
               ) -> List[Dict[str, Any]]:
    """Join NVML's processes to census records. A host observer reads NVML's PIDs as host
    PIDs (they are: the caller is in the initial namespace). A nested observer gets from the
    driver either a PID translated into its own namespace (driver 580 does so when the process
    is visible from the caller's namespace: seen on an H200, NVML said 1 for a namespace's
    PID 1) or an untranslated host PID (the field report's containers); a PID of this /proc is
    trusted only if that process holds /dev/nvidia* fds (or its fds could not be checked, then
    said so in the note), else the entry is "not visible here"."""
    host_view = bool(observer.get("host_view"))
    result = []
    for device in gpu.get("devices") or []:
        for entry in device.get("processes") or []:
            nvml_pid = entry.get("pid")
            proc = processes.get(nvml_pid) if nvml_pid is not None else None
            note = None
            if proc is not None and not host_view:
                if proc.get("nvidia_fds") is None:
                    note = ("matched by PID in this namespace (driver-translated); its fds "
                            "could not be checked")
                elif not proc["nvidia_fds"]:
                    proc = None  # same number, but this process holds no GPU device
            item = {"gpu_index": device.get("index"), "nvml_pid": nvml_pid,
                    "host_pid": nvml_pid if host_view or proc is None else None,
                    "used_mib": entry.get("used_mib"), "visible": proc is not None,
                    "pid": None, "ns_pid": None, "state": None, "uid": None, "comm": None,
                    "container": None, "job": None, "rank": None, "tag": None,
                    "note": note}  # type: Dict[str, Any]
            if proc is None:
                item["note"] = "not visible here"
                if not host_view:
                    item["note"] = ("not visible here: NVML's PID is not a GPU process of this "
                                    "PID namespace (an untranslated host PID)")
            else:
                nspid = proc.get("nspid") or [proc["pid"]]
                item.update({"pid": proc["pid"], "ns_pid": nspid[-1], "state": proc["state"],
                             "uid": proc["uid"], "comm": proc["comm"],
                             "container": proc["container"], "tag": proc["tag"]})
                job = job_of.get(proc["pid"])
                if job is not None:
                    item["job"], item["rank"] = job
            result.append(item)
    return result


#: a cached census lists /proc in full at least this often; in between it reads the processes
#: of its last census and those of the PIDs the kernel allocated since (``_cached_listing``)
FULL_LISTING_S = 10.0
#: more PIDs allocated than this since the last cached census: /proc is listed in full (probing
#: a PID costs about what listing five processes does)
PROBED_PIDS_MAX = 200
#: proc root -> {"since": the kernel's last PID as the census before the last one read it,
#: "last": as the last one read it (each read before that census took its PIDs), "listed_at":
#: when /proc was last listed in full (monotonic), "pids": the PIDs of the last cached census}
_LISTINGS = {}  # type: Dict[str, Dict[str, Any]]


def _processes_among(first: int, last: int) -> Optional[List[int]]:
    """The PIDs from ``first`` to ``last`` that are processes (thread-group leaders) of this
    process's PID namespace now, told by pidfd_open (a thread's ID and a free PID are refused:
    ENOENT, ESRCH); None when it cannot be told here (no pidfd_open: Python < 3.9 or Linux
    < 5.3; out of fds; refused by a seccomp filter)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    found = []  # type: List[int]
    for pid in range(first, last + 1):
        try:
            os.close(pidfd_open(pid))
        except (ProcessLookupError, FileNotFoundError):
            continue
        except OSError:
            return None
        found.append(pid)
    return found


def _cached_listing(proc_root: str) -> Tuple[List[int], str]:
    """The PIDs a cached census reads, and how they were found (the observer's ``listing``).
    Listing /proc costs about 1 us a process (a tenth of a polled census). The kernel hands
    PIDs out in turn (its last one is read before the PIDs are taken), so a process started
    since the census before the last one has a PID allocated since that census read the last
    PID. Between full listings (at most FULL_LISTING_S apart), a census of a /proc of its own
    PID namespace reads the processes of the last census and the processes among those PIDs.
    The range starts a census further back because a fork takes its PID a moment before its
    process shows in /proc: one caught between the two by a census shows to the next. /proc is
    listed in full the first two times, after FULL_LISTING_S, when PIDs wrapped, past
    PROBED_PIDS_MAX PIDs to probe, for another namespace's /proc, or where the PIDs cannot be
    probed. A process given a PID of its choosing (clone3's set_tid, for checkpoint/restore)
    is found at the next full listing."""
    now = time.monotonic()
    try:
        last = last_pid(proc_root)  # type: Optional[int]
    except (OSError, ValueError, IndexError):
        last = None
    previous = _LISTINGS.get(proc_root) or {"last": None}
    since = previous.get("since")
    if last is not None and since is not None and previous["pids"] is not None \
            and now - previous["listed_at"] < FULL_LISTING_S \
            and 0 <= last - since <= PROBED_PIDS_MAX and shows_own_pid_ns(proc_root):
        new = _processes_among(since + 1, last)
        if new is not None:
            previous["since"], previous["last"] = previous["last"], last
            if new:  # most were read by the last census, or their PID is reused: read once
                known = set(previous["pids"])
                new = [pid for pid in new if pid not in known]
            return previous["pids"] + new, ("the last census's processes and %d new among %d "
                                            "PIDs probed" % (len(new), last - since))
    pids = list_pids(proc_root)
    _LISTINGS[proc_root] = {"since": previous["last"], "last": last, "listed_at": now,
                            "pids": None}
    return pids, "full"


def _remember_listing(proc_root: str, wanted: List[int],
                      processes: Dict[int, Dict[str, Any]]) -> None:
    """Keep the PIDs a cached census read for the next one (``_cached_listing``): those it
    found, and those it did not whose /proc entry is still there (a stat that failed)."""
    listing = _LISTINGS.get(proc_root)
    if listing is not None:
        listing["pids"] = [pid for pid in wanted if pid in processes
                           or os.path.exists("%s/%d" % (proc_root, pid))]


def _cache_before(proc_root: str) -> Optional[int]:
    """Clock ticks since boot before which a process is old enough to be cached (2 s ago)."""
    try:
        return int((uptime_s(proc_root) - 2.0) * os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _single_threaded() -> bool:
    """Whether this process has one thread, as the kernel counts them (/proc/self/stat): a
    thread started by a C library (NVML's, CUDA's) counts too, which Python's own count
    misses. Forking is safe for a child that then runs Python only there."""
    try:
        return int(_parse_stat(_read_bytes("/proc/self/stat"))[1][_F_THREADS]) == 1
    except (OSError, ValueError, IndexError):
        return False


class _GpuReading:
    """The GPU section, read by NVML while /proc is read (NVML's init and its process lists
    wait on the driver: on the H200 the init alone costs more than reading 1,000 processes).
    Where no driver is registered, read at once (the answer needs no call to NVML). Else on a
    thread, started only after any reader is forked; or, ``start(fork=True)`` (a one-shot
    census whose readers may be forked: ``workers`` other than 1, no cache), in a child forked
    first thing in the census, when this process is single-threaded (as the kernel counts
    threads) and has not initialised NVML: a snapshot then pays neither NVML's loading nor
    NVML's calls under its own GIL (on the H200 they cost the snapshot 44 ms of its 115 at
    1,000 processes, on a thread), and they overlap the whole census."""

    def __init__(self, gpu: bool, gpu_snapshot: Optional[Dict[str, Any]],
                 unreaped: List[int]) -> None:
        self.section = gpu_snapshot if gpu_snapshot is not None else None
        self.gpu = gpu
        #: forked children whose results are taken, reaped by the census once it is made
        self.unreaped = unreaped
        self.thread = None  # type: Any
        self.child = None  # type: Optional[Tuple[int, int]]
        #: where NVML was read: "forked" (a child process), "thread", "inline" (no driver
        #: registered: the answer needs no call to it), or None (not read here)
        self.reader = None  # type: Optional[str]

    def start(self, fork: bool = False, thread: bool = True) -> None:
        """Start reading NVML: in a forked child where ``fork`` allows it (see the class), else
        on a thread, or (``thread=False``) not yet: a later ``start()`` or ``result()`` does."""
        if self.section is not None or self.thread is not None or self.child is not None \
                or not self.gpu:
            return
        registered = _NVML["module"] is not None or nvidia_registered()
        if not registered:
            # no driver registered: NVML's answer (unavailable, and why) takes no call to the
            # driver nor its library's loading, so it is read here, with no thread (~2 ms of
            # a snapshot's start on 2 cores)
            self.reader = "inline"
            self.section = nvml_snapshot()
            return
        if fork and _NVML["module"] is None and not _NVML["tried"] and registered \
                and _single_threaded():
            self.child = _fork_work(nvml_snapshot)
            if self.child is not None:
                self.reader = "forked"
                return
        if not thread:
            return
        self.reader = "thread"

        def read() -> None:
            self.section = nvml_snapshot()

        import threading

        self.thread = threading.Thread(target=read, name="census-nvml", daemon=True)
        self.thread.start()

    def result(self) -> Dict[str, Any]:
        self.start()
        if self.child is not None:
            self.section = _collect_work(self.child, nvml_snapshot, self.unreaped)
            self.child = None
        if self.thread is not None:
            self.thread.join()
        if self.section is None:
            self.section = _gpu_section(self.gpu, None)
        return self.section

    def close(self) -> None:
        """Reap every forked child of the census: those whose results were taken and still
        exiting, and a forked reading never collected (a census that failed on the way: its
        result is waited for and dropped), so no child outlives the census."""
        if self.child is not None:
            child, self.child = self.child, None
            _collect_work(child, lambda: None)
        while self.unreaped:
            _reap(self.unreaped.pop())


def _read_all(wanted: List[int], proc_root: str, env: bool, fds: Union[bool, str],
              proc_ns: Optional[str], lite: bool, cache: bool, workers: int,
              gpu: _GpuReading) -> Tuple[Dict[int, Dict[str, Any]], List[str], int]:
    """Read every wanted process; return the records, the errors and the readers used."""
    use_cache = _CACHE if cache else None
    cache_before = _cache_before(proc_root) if cache else None
    level = "stat" if lite else "full"
    if workers == 0:
        workers = auto_workers(len(wanted))
    if workers > 1 and not cache and len(wanted) >= 1000:
        readers = workers
        # NVML's child is forked already, or a thread starts once every reader is forked
        processes, errors = _read_parallel(wanted, proc_root, env, fds, proc_ns, level, workers,
                                           gpu.start, gpu.unreaped)
    else:
        readers = 1
        gpu.start()
        processes, errors = _read_serial(wanted, proc_root, env, fds, proc_ns, level, use_cache,
                                         cache_before)
    gpu_section = gpu.result()
    if lite:
        # parents (to know which are namespace inits), then the candidates, in full
        parents = sorted({p["ppid"] for p in processes.values() if p["ppid"] in processes})
        for wave, wave_level in ((parents, "basic"), (None, "full")):
            if wave is None:
                wave = _lite_candidates(processes, gpu_section)
            more_records, more = _read_serial(wave, proc_root, env, fds, proc_ns, wave_level,
                                              use_cache, cache_before)
            errors.extend(more)
            for pid in wave:
                if pid in more_records:
                    processes[pid] = more_records[pid]
                else:
                    processes.pop(pid, None)
    return processes, errors, readers


def _gpu_section(gpu: bool, gpu_snapshot: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    if gpu_snapshot is not None:
        return gpu_snapshot
    if gpu:
        return nvml_snapshot()
    return {"available": False, "reason": "not asked (--no-gpu)", "driver": None, "devices": []}


def _join_jobs(gpu_processes: List[Dict[str, Any]], jobs: List[Dict[str, Any]]) -> None:
    job_of = {}  # type: Dict[int, Tuple[str, Optional[int]]]
    for job in jobs:
        for rank in job["ranks"]:
            if rank["pid"] is not None:
                job_of[rank["pid"]] = (job["id"], rank["rank"])
    for item in gpu_processes:
        if item["pid"] in job_of:
            item["job"], item["rank"] = job_of[item["pid"]]


def census(proc_root: str = "/proc", env: bool = True, fds: Union[bool, str] = True,
           gpu: bool = True,
           gpu_snapshot: Optional[Dict[str, Any]] = None, pids: Optional[Iterable[int]] = None,
           cgroup_root: str = "/sys/fs/cgroup", cache: bool = False,
           detail: str = "full", workers: int = 1) -> Dict[str, Any]:
    """Take the whole census (schema ``chaosgpu.census/1``, docs/census.md): the observer, the
    GPU section (NVML, or ``gpu_snapshot`` when given: a recorded ``gpu`` section, which is how
    tests feed real recordings to the attribution), every process of ``proc_root`` (or only
    ``pids``), GPU processes attributed to observer PID / namespace PID / container / job /
    rank ("not visible here" when NVML's host PID is not in this /proc), zombies, orphans (see
    ``orphan_reason``) and distributed-training jobs with rank states (alive, stopped, frozen,
    zombie, missing) as this one reading shows them. Never raises for an odd node: problems go
    to ``errors``. ``fds`` scans every process's fds for /dev/nvidia* when an NVIDIA driver is
    registered (``nvidia_registered``; otherwise ``nvidia_fds`` is ``[]`` without a scan);
    ``fds="always"`` scans anyway (to measure what a GPU node pays).
    ``cache=True`` keeps, across calls in this process, what does not change during a
    process's life (see ``read_process``): a repeated census (the job observer, an agent, a
    sampler) then reads each known process's stat (and fds) alone, and zombies keep the tag and
    rank they had while alive.
    ``detail="lite"`` reads the stat of every process, the status of every parent (to know
    namespace inits) and the rest only for candidates: NVML's PIDs, zombies, children of
    namespace inits and known subreapers, and processes named like training workers
    (python*, pt_*, torchrun); the others carry ``not_read``. A job whose ranks are none of
    these is missed in lite mode.
    ``workers=N`` (N > 1, without cache, from 1,000 processes) splits the reading over N
    readers (N - 1 forked); ``workers=0`` picks N by ``auto_workers``."""
    if detail not in ("full", "lite"):
        raise ValueError("detail must be 'full' or 'lite', got %r" % (detail,))
    if cache:  # one cached census at a time: the cache is shared by this process's threads
        with _CACHE_LOCK:  # (a timeline's sampler beside the job observer's probes)
            return _census_without_gc(proc_root, env, fds, gpu, gpu_snapshot, pids,
                                      cgroup_root, cache, detail, workers)
    return _census_without_gc(proc_root, env, fds, gpu, gpu_snapshot, pids, cgroup_root, cache,
                              detail, workers)


def _census_without_gc(proc_root: str, env: bool, fds: Union[bool, str], gpu: bool,
                       gpu_snapshot: Optional[Dict[str, Any]], *args: Any) -> Dict[str, Any]:
    import gc

    collecting = gc.isenabled()
    gc.disable()  # tens of thousands of acyclic dicts: the cyclic collector only costs time
    gpu_reading = _GpuReading(gpu, gpu_snapshot, [])
    try:
        return _census(gpu_reading, proc_root, env, fds, *args)
    finally:
        gpu_reading.close()
        if collecting:
            gc.enable()


def _wanted(proc_root: str, pids: Optional[Iterable[int]], cache: bool,
            observer: Dict[str, Any], errors: List[str]) -> List[int]:
    """The PIDs a census reads: ``pids`` when given, else those of ``proc_root`` (by
    ``_cached_listing`` for a cached census, which says how in ``observer["listing"]``); a
    listing that fails or finds no process is said in ``errors``."""
    if pids is not None:
        return list(pids)
    try:
        if cache:
            wanted, observer["listing"] = _cached_listing(proc_root)
        else:
            wanted = list_pids(proc_root)
    except OSError as error:
        errors.append("cannot list %s: %s" % (proc_root, _errno_name(error)))
        return []
    if not wanted:  # a live /proc always shows at least its reader
        errors.append("no process directories under %s: not a /proc" % proc_root)
    return wanted


def _census(gpu_reading: _GpuReading, proc_root: str, env: bool, fds: Union[bool, str],
            pids: Optional[Iterable[int]], cgroup_root: str, cache: bool, detail: str,
            workers: int) -> Dict[str, Any]:
    started = time.monotonic()
    taken_at = time.time()
    errors = []  # type: List[str]
    # a one-shot census whose readers may be forked (a snapshot) forks NVML's child before
    # anything else: on a GPU node NVML's init and handles outlast the reading of 1,000
    # processes (no thread yet: one starts once any reader is forked)
    gpu_reading.start(fork=not cache and workers != 1, thread=False)
    observer = _observer(proc_root)
    proc_ns = _proc_ns(proc_root)
    if fds == "always":  # scan even where no NVIDIA device is registered (what a GPU node pays)
        fd_mode = True  # type: Union[bool, str]
    else:
        fd_mode = fds if not fds or nvidia_registered(proc_root) else NO_NVIDIA_DEVICE
    observer["nvidia_fd_scan"] = ("skipped: " + NO_NVIDIA_DEVICE if fd_mode == NO_NVIDIA_DEVICE
                                  else bool(fds))
    wanted = _wanted(proc_root, pids, cache, observer, errors)
    processes, more, observer["readers"] = _read_all(wanted, proc_root, env, fd_mode, proc_ns,
                                                     detail == "lite", cache, workers,
                                                     gpu_reading)
    gpu_section = gpu_reading.result()
    observer["gpu_reader"] = gpu_reading.reader
    errors.extend(more)
    if cache and pids is None:
        _remember_listing(proc_root, wanted, processes)
        for key in [k for k in _CACHE if k[0] == proc_root and k[1] not in processes]:
            del _CACHE[key]
        _drop_held_stats(proc_root, processes)
    _mark_orphans(processes, bool(observer.get("host_view")), proc_root)
    gpu_processes = _attribute(gpu_section, processes, observer, {})
    gpu_by_pid = {}  # type: Dict[int, float]
    for item in gpu_processes:
        if item["visible"] and item["used_mib"] is not None:
            gpu_by_pid[item["pid"]] = gpu_by_pid.get(item["pid"], 0.0) + item["used_mib"]
    jobs = _jobs(processes, gpu_by_pid, errors, cgroup_root, observer["hostname"], proc_root)
    _join_jobs(gpu_processes, jobs)
    private = ("_nssid", "_nspgid", "_exec")
    ordered = []  # type: List[Dict[str, Any]]
    zombies = []  # type: List[int]
    orphans = []  # type: List[int]
    for pid in sorted(processes):
        record = processes[pid]
        if "not_read" not in record:
            record["not_read"] = []
        for name in private:  # cgroup paths, own-namespace session: not in the document
            if name in record:
                del record[name]
        ordered.append(record)
        if record["zombie"]:
            zombies.append(pid)
        if record["orphan"]:
            orphans.append(pid)
    return {
        "schema": SCHEMA,
        "taken_at": taken_at,
        "duration_ms": (time.monotonic() - started) * 1000.0,
        "observer": observer,
        "gpu": gpu_section,
        "processes": ordered,
        "gpu_processes": gpu_processes,
        "zombies": zombies,
        "orphans": orphans,
        "jobs": jobs,
        "errors": errors,
    }


# --------------------------------------------------------------------------------------------
# program


def _usage_error(message: str) -> int:
    import json

    print(json.dumps({"schema": SCHEMA, "error": message}))
    return 2


class _UsageError(Exception):
    pass


def _load_snapshot(value: str) -> Dict[str, Any]:
    try:
        return load_gpu_snapshot(value)
    except ValueError as error:
        raise _UsageError(str(error)) from None


GPU_SNAPSHOT_SHAPE = ('the census\'s gpu section, {"available": true, "devices": [{"index": 0, '
                      '"memory_used_mib": 1.0, "memory_total_mib": 2.0, "processes": '
                      '[{"pid": 123, "used_mib": 1.0}]}]}, or a recording with it under "held"')


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def gpu_snapshot_problem(snapshot: Any) -> Optional[str]:
    """What makes ``snapshot`` unusable as the census's ``gpu`` section (the shape
    ``nvml_snapshot`` returns), or None when it is usable: the census, the table and the metrics
    read ``devices`` (a list of objects with an integer ``index``, numbers or null for the
    memory and a list of ``processes``, each an object with an integer ``pid`` and a number or
    null ``used_mib``)."""
    if not isinstance(snapshot, dict):
        return "not a JSON object"
    devices = snapshot.get("devices")
    if not isinstance(devices, list):
        return '"devices" is missing or not a list'
    for n, device in enumerate(devices):
        where = "devices[%d]" % n
        if not isinstance(device, dict):
            return "%s is not an object" % where
        index = device.get("index")
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            return "%s.index is not an integer >= 0 (got %r)" % (where, index)
        for key in ("memory_used_mib", "memory_total_mib"):
            if device.get(key) is not None and not _is_number(device[key]):
                return "%s.%s is not a number (got %r)" % (where, key, device[key])
        processes = device.get("processes")
        if processes is None:
            continue
        if not isinstance(processes, list):
            return "%s.processes is not a list" % where
        for m, entry in enumerate(processes):
            if not isinstance(entry, dict):
                return "%s.processes[%d] is not an object" % (where, m)
            pid = entry.get("pid")
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                return "%s.processes[%d].pid is not an integer > 0 (got %r)" % (where, m, pid)
            if entry.get("used_mib") is not None and not _is_number(entry["used_mib"]):
                return "%s.processes[%d].used_mib is not a number (got %r)" % (
                    where, m, entry["used_mib"])
    return None


def load_gpu_snapshot(value: str) -> Dict[str, Any]:
    """Read a recorded ``gpu`` section from the file ``value`` (``-``: standard input), or from
    the ``held`` key of a recording (tests/data/nvml_*.json); ValueError naming the file and
    what is wrong when it cannot be read or has not the shape of ``nvml_snapshot``'s."""
    import json

    try:
        if value == "-":
            snapshot = json.load(sys.stdin)
        else:
            with open(value) as handle:
                snapshot = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError("--gpu-snapshot %r: %s" % (value, error)) from None
    where = ""
    if isinstance(snapshot, dict) and "held" in snapshot and "devices" not in snapshot:
        snapshot, where = snapshot["held"], '"held": '
    problem = gpu_snapshot_problem(snapshot)
    if problem is not None:
        raise ValueError("--gpu-snapshot %r: %s%s; expected %s"
                         % (value, where, problem, GPU_SNAPSHOT_SHAPE))
    return snapshot


def _option_value(options: Dict[str, Any], arg: str, value: str) -> None:
    """Store the value of an option that takes one (raise _UsageError when it is bad)."""
    if arg == "--pid":
        if not value.isdigit() or int(value) <= 0:
            raise _UsageError("--pid needs a positive integer, got %r" % value)
        options["pids"] = (options["pids"] or []) + [int(value)]
    elif arg == "--proc-root":
        if not os.path.isdir(value):
            raise _UsageError("--proc-root %r is not a directory" % value)
        if not any(name.isdigit() for name in os.listdir(value)):
            raise _UsageError("--proc-root %r holds no process directories: not a /proc"
                              % value)
        options["proc_root"] = value.rstrip("/") or "/"
    elif arg in ("--indent", "--workers"):
        if not value.isdigit():
            raise _UsageError("%s needs an integer >= 0, got %r" % (arg, value))
        options[arg[2:]] = int(value)
    else:
        options["gpu_snapshot"] = _load_snapshot(value)


def _parse(args: List[str]) -> Dict[str, Any]:
    options = {"env": True, "fds": True, "gpu": True, "workers": 1, "proc_root": "/proc",
               "pids": None, "gpu_snapshot": None, "indent": None,
               "action": "census"}  # type: Dict[str, Any]
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in ("--no-env", "--no-fds", "--no-gpu"):
            options[arg[5:]] = False
        elif arg == "--scan-fds":
            options["fds"] = "always"
        elif arg in ("--pid", "--proc-root", "--gpu-snapshot", "--indent", "--workers"):
            if index + 1 >= len(args):
                raise _UsageError("%s needs a value" % arg)
            index += 1
            _option_value(options, arg, args[index])
        elif arg in ("-h", "--help", "--tcp-sockets"):
            options["action"] = arg.lstrip("-")
            return options
        else:
            raise _UsageError("unknown argument %r" % arg)
        index += 1
    return options


def main(argv: Optional[List[str]] = None) -> int:
    """Parse ``argv`` (``--no-env --no-fds --scan-fds --no-gpu --pid N --proc-root DIR
    --gpu-snapshot FILE --indent N --workers N``), print one census JSON document and return 0;
    bad arguments print ``{"error": ...}`` and return 2. ``--tcp-sockets`` prints
    ``{"sockets": {inode: ...}}`` (``tcp_sockets``) instead: the view of this program's
    network namespace."""
    import json

    try:
        options = _parse(list(sys.argv[1:] if argv is None else argv))
    except _UsageError as error:
        return _usage_error(str(error))
    if options["action"] in ("h", "help"):
        print(__doc__)
        return 0
    if options["action"] == "tcp-sockets":
        try:
            print(json.dumps({"schema": SCHEMA, "sockets": tcp_sockets()}))
        except OSError as error:
            print(json.dumps({"schema": SCHEMA, "error": "netlink: %s" % error}))
            return 2
        return 0
    document = census(proc_root=options["proc_root"], env=options["env"], fds=options["fds"],
                      gpu=options["gpu"], gpu_snapshot=options["gpu_snapshot"],
                      pids=options["pids"], workers=options["workers"])
    print(json.dumps(document, indent=options["indent"], sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
