"""The timeline sampler: a thread that records memory and process states at a fixed high rate.

This module owns the sampling loop, its in-memory series, the events marked on it, and the
computations over those series (baseline, residual, release time, integral in GiB x s). It
reads the node only through chaosgpu.node: NVML device memory and process list, the census's
/proc readers (state, start time, resident memory from /proc/PID/statm for the "host-rss"
source, uptime) and its per-process record for new PIDs. It must not signal anything, and it
must never let an exception escape the thread silently: errors are logged loudly and counted.

Sources: "nvml" (GPU memory per device every tick: one NVML memory query per device) or, when
NVML is unavailable, "host-rss" (the resident memory of the tracked processes, every tick). In
both, `total` is one number per tick: the sum of the devices' used memory, or of the tracked
processes' RSS. Units: MiB (2**20 bytes); integrals in GiB x s where GiB = 1024 MiB.

Three threads, each owning one stream, so that a slow reading never delays another (NVML's
queries take 0.01 ms on an idle H200 but 180-230 ms while 100 CUDA contexts start and over a
second while they are torn down: bench/results/nvml-calls-*):

* memory (`rate_hz`): one NVML memory query per device, or the tracked processes' RSS;
* GPU processes (NVML source only): the compute-process list every `process_every` periods,
  spaced further when its measured cost would exceed PROCESS_BUDGET of a core: at most to
  MAX_SPACING_S while device memory moves or a tracked process comes or goes (a process
  starting or freeing is seen within a second), at most to STEADY_SPACING_S while memory stays
  within LIST_ON_CHANGE_MIB of the last listing and the tracked set is unchanged (nothing to
  see: on the H200 one list of 100 processes costs ~8 ms of CPU);
* exits: blocked in one poll() over the tracked processes' pidfds (a pidfd turns readable when
  its process exits; no /proc scan), so an exit is stamped when it happens, whatever the other
  threads wait on; between exits it reads the tracked processes' states (one pread each of
  their stat, held open) every `process_every` periods (cost-spaced the same way, at most to
  SWEEP_SPACING_S; at once after an activity) and looks for new PIDs every `rescan_s` and
  after every activity, listing /proc only when the kernel allocated a PID since the last
  listing (FULL_RESCAN_S at the latest).

Tracked processes: those matching the scope (a tag, a sandbox's PID namespace, a job's ranks,
PIDs), or any of several such scopes (`own`: the run's own targets, which the timeline control
finds in its experiment when given no scope), or every chaosgpu-tagged process when given
neither (the agent's node-wide timeline; the control never uses that). New PIDs are examined once
(`rescan_s`), so the cost does not grow with the node's process count at the sampling rate;
a job's ranks are the census's (chaosgpu.scope), taken at a rescan when the kernel allocated
a PID since the last one (a new process, or a rank starting its process group's threads) and
every FULL_RESCAN_S (a cached census), so that a job found by its store's connections or a
rank that joins late is tracked too (docs/timeline.md has its cost).
"""

import logging
import os
import select
import statistics
import sys
import threading
import time
from typing import Any

from chaosgpu.scope import pid_starttimes
from chaosgpu.timeline.integral import GIB_PER_MIB, gib_seconds

__all__ = ["Sampler", "current", "install", "uninstall", "MIB", "GIB_PER_MIB"]

logger = logging.getLogger("chaostoolkit")

MIB = 1024 * 1024
REEXAMINE_S = 2.0
_current: "Sampler | None" = None
_lock = threading.Lock()


def current() -> "Sampler | None":
    """Return the sampler of the running experiment (the control installs it), or None."""
    return _current


def install(sampler: "Sampler") -> None:
    """Make `sampler` the process-wide one the timeline probes read."""
    global _current
    with _lock:
        _current = sampler


def uninstall(sampler: "Sampler") -> None:
    """Forget `sampler` if it is the current one."""
    global _current
    with _lock:
        if _current is sampler:
            _current = None


def _rss_mib(pid: int, fds: dict[int, int] | None = None) -> float | None:
    """Resident set size of `pid` in MiB (the census's statm reader), None when it is gone.
    With `fds`, the file stays open and is re-read with one pread (half the cost of an open
    per sample)."""
    node = _node()
    try:
        if fds is None:
            return float(node.rss_bytes(pid)) / MIB
        fd = fds.get(pid)
        if fd is None:
            fd = fds[pid] = node.open_statm(pid)
        return float(node.rss_bytes(pid, fd)) / MIB
    except node.ProcError:
        return None


_TICKS = os.sysconf("SC_CLK_TCK")
#: the share of one core each background stream (the GPU-process list, the state sweep, the
#: search for new processes) may take: their cost is measured and they are spaced to keep it
PROCESS_BUDGET = 0.001
#: ... but never spaced further than this: a slow NVML (seen on the H200: 16 ms of CPU per
#: process-list call while CUDA contexts start) must not leave a new GPU process without its
#: memory for seconds; the budget is then exceeded while it lasts
MAX_SPACING_S = 1.0
#: ... except the GPU-process list while device memory stays within LIST_ON_CHANGE_MIB of what
#: it was at the last listing and no tracked process started or exited: no process can start
#: on a GPU (a CUDA context alone is hundreds of MiB) or free memory without moving it, so the
#: list waits up to this long
STEADY_SPACING_S = 15.0
LIST_ON_CHANGE_MIB = 64.0
#: the state sweep's longest spacing (a stop or a freeze no activity of chaosgpu made is seen
#: within it; an exit is seen at once through the pidfd, and every state is read at once
#: after an activity)
SWEEP_SPACING_S = 2.0
#: /proc is listed again for new processes only when the kernel allocated a PID since the last
#: listing (/proc/loadavg), a process seen young is due for its second look, or this long
#: passed (a /proc of another PID namespace than the sampler's: the hint does not apply)
FULL_RESCAN_S = 10.0


def _spaced(base_s: float, cost_s: float, longest_s: float = MAX_SPACING_S) -> float:
    """The period of a sweep that cost `cost_s` of CPU: `base_s`, longer to keep its cost
    under PROCESS_BUDGET of a core, at most `longest_s` (but never under `base_s`)."""
    return max(base_s, min(cost_s / PROCESS_BUDGET, longest_s))


def _uptime_ticks() -> float | None:
    """Seconds since boot in clock ticks (to tell a process's age from its start time)."""
    try:
        return float(_node().uptime_s()) * _TICKS
    except (OSError, ValueError, IndexError):
        return None


def _node() -> Any:
    import chaosgpu.node as node

    return node


class Sampler:
    """Samples memory (NVML or host RSS) and the tracked processes' states on its own thread."""

    def __init__(self, rate_hz: float = 200.0, process_every: int = 20,
                 scope: dict[str, Any] | None = None, source: str = "auto",
                 rescan_s: float = 0.5, max_samples: int = 2_000_000,
                 own: list[dict[str, Any]] | None = None) -> None:
        """`scope`: the processes to track; None tracks every chaosgpu-tagged process, unless
        `own` is given: then the processes of any of those scopes (the run's own targets, as
        the timeline control finds them in the experiment)."""
        if not isinstance(rate_hz, (int, float)) or not 1 <= rate_hz <= 5000:
            raise ValueError(f"rate_hz must be a number between 1 and 5000, got {rate_hz!r}")
        if not isinstance(process_every, int) or process_every < 1:
            raise ValueError(f"process_every must be a positive integer, got {process_every!r}")
        if source not in ("auto", "nvml", "host-rss"):
            raise ValueError(f"source must be 'auto', 'nvml' or 'host-rss', got {source!r}")
        from chaosgpu.scope import validate_scope

        if scope is not None:
            scope = validate_scope(scope)
        if scope is not None and own:
            raise ValueError("a sampler takes a scope or its run's own targets, not both")
        self.own = [validate_scope(entry) for entry in own or []]
        self._scopes = [scope] if scope is not None else list(self.own)
        self.rate_hz = float(rate_hz)
        self.process_every = process_every
        self.scope = scope
        self.rescan_s = rescan_s  # how often new PIDs are examined (each costs a /proc read)
        self.max_samples = max_samples
        self.source = source
        self.t0 = time.time()
        self._m0 = time.monotonic()
        self.t: list[float] = []
        self.total: list[float] = []
        self.devices: dict[int, list[float]] = {}
        self.processes: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.measurements: dict[str, Any] = {}
        self.errors: list[str] = []
        self.baseline: dict[str, Any] | None = None
        self.cpu_s = 0.0
        self.cpu_s_by_thread: dict[str, float] = {}
        self.wall_s = 0.0
        self._fds: dict[int, int] = {}  # pid -> open /proc/PID/statm (host-rss source)
        self._pidfds: dict[int, int] = {}  # pid -> pidfd of a tracked process (identity, exit)
        self._stat_fds: dict[int, int] = {}  # pid -> its /proc/PID/stat held open (states)
        self._pid_of_fd: dict[int, int] = {}
        self._exited: set[int] = set()  # tracked PIDs seen exited (zombies until reaped)
        self._poller = select.poll()
        self._ticks = 0  # memory samples taken (the memory thread's own count)
        self._listed_total: float | None = None  # device memory when the GPU list was read
        # device memory left LIST_ON_CHANGE_MIB of the last listing, or a tracked process came
        # or went: the GPU-process thread lists again
        self._list_due = threading.Event()
        self._known: dict[int, float] = {}  # pid -> examine again until (monotonic)
        self._young_until = 0.0  # the latest of those: no second look is due after it
        self._last_pid: int | None = None  # the kernel's last PID at the last listing of /proc
        self._listed_at = 0.0  # when /proc was last listed (monotonic)
        self._tracked: dict[int, int | None] = {}  # pid -> starttime of tracked PIDs
        self._job_pids: set[int] = set()  # the scope's job's ranks, as the census finds them
        self._job_found_at = 0.0  # when they were last taken (monotonic)
        self._sandbox_ns: dict[str, str | None] = {}  # sandbox name -> its PID namespace
        self._stop = threading.Event()
        # rescans asked for (after activities) and done: an activity's caller can wait for the
        # processes it started to be tracked before the next activity runs
        self._rescans = threading.Condition()
        self._rescans_asked = 0
        self._rescans_done = 0
        self._threads: list[threading.Thread] = []
        self._m_wall0 = self._m0
        self._wake_r, self._wake_w = -1, -1  # wakes the exit thread out of poll()
        self._data_lock = threading.Lock()
        self._node = _node()
        self._same_pid_ns = self._node.shows_own_pid_ns()  # /proc counts the sampler's PIDs
        self._switch: float | None = None  # the GIL switch interval before start()
        # why this sampler never started, when the control could not start one: it is then
        # installed only to say where the run stands (its method has not started), for
        # chaosgpu.arguments.missing_allowed, and measures nothing
        self.start_error: str | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Pick the source, prime the tracked processes and start the sampling thread."""
        if self.source == "auto":
            self.source = "nvml" if _node().nvml_device_memory() else "host-rss"
        elif self.source == "nvml" and not _node().nvml_device_memory():
            raise RuntimeError("source 'nvml' requested but NVML is not available here")
        self._resolve_scope_keys()
        self._rescan()
        # Every syscall of a tick (a /proc read, an NVML call, the sleep) gives the GIL away; a
        # busy main thread (a `chaos run` driving Kubernetes) then keeps it for the switch
        # interval, 5 ms by default: measured, 100 Hz fell to 66 Hz. A tenth of the period
        # bounds that wait; the old interval comes back at stop().
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(max(0.0005, min(self._switch, 0.1 / self.rate_hz)))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poller.register(self._wake_r, select.POLLIN)
        bodies = [("chaosgpu-timeline", lambda: self._paced(
                      lambda: 1.0 / self.rate_hz, self._memory_step)),
                  ("chaosgpu-timeline-exits", self._run_exits)]
        if self.source == "nvml":
            bodies.append(("chaosgpu-timeline-gpu-processes", self._run_gpu_processes))
        self._m_wall0 = time.monotonic()
        self._threads = [threading.Thread(target=self._run_thread, args=(body,), name=name,
                                          daemon=True) for name, body in bodies]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (waits at most `timeout_s`) and give back the GIL switch interval."""
        self._stop.set()
        self._list_due.set()
        self._wake()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._threads and not self.running:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
        if self._switch is not None:
            sys.setswitchinterval(self._switch)
            self._switch = None

    @classmethod
    def not_started(cls, reason: str) -> "Sampler":
        """A sampler that never starts, standing in for one the control could not start
        (`reason`): its timeline says the method has not started (the run was stopped before
        it), so rollbacks given "before-method" find nothing to undo instead of a typo."""
        sampler = cls(rate_hz=1.0, source="host-rss")
        sampler.start_error = reason
        return sampler

    @property
    def started(self) -> bool:
        """Whether start() ran (its threads were started)."""
        return bool(self._threads)

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def now(self) -> float:
        """Seconds since the sampler's t0 (monotonic)."""
        return time.monotonic() - self._m0

    def request_rescan(self, wait_s: float = 0.0) -> bool:
        """Ask the sampler to read the states and look for new processes now (after an
        activity); with `wait_s`, wait up to that long for it to be done (the processes the
        activity started are then tracked before the next one runs). True when done, or when
        not asked to wait."""
        with self._rescans:
            self._rescans_asked += 1
            wanted = self._rescans_asked
        self._wake()
        if wait_s <= 0 or not self.running:
            return True
        with self._rescans:
            return self._rescans.wait_for(
                lambda: self._rescans_done >= wanted or self._stop.is_set(), timeout=wait_s)

    def mark(self, name: str, phase: str = "point", **extra: Any) -> dict[str, Any]:
        """Record an event on the timeline and return it."""
        event = {"t": round(self.now(), 6), "name": name, "phase": phase}
        event.update(extra)
        with self._data_lock:
            self.events.append(event)
        return event

    # -- scope -----------------------------------------------------------------------------
    def _resolve_scope_keys(self) -> None:
        for scope in self._scopes:
            if "sandbox" in scope:
                self._resolve_sandbox(scope["sandbox"])

    def _resolve_sandbox(self, name: str) -> str | None:
        """The PID namespace of sandbox `name` (None while it is not created: re-tried at each
        rescan)."""
        from chaosgpu.scope import _sandbox_pid_ns

        try:
            ns, init_pid = _sandbox_pid_ns(name)
            if ns is None and init_pid is not None:
                record = _node().read_process(init_pid, env=False, fds=False)
                ns = record.get("pid_ns") if record else None
        except ValueError:
            ns = None
        self._sandbox_ns[name] = ns
        return ns

    def _matches(self, record: dict[str, Any]) -> bool:
        if not self._scopes:
            return record.get("tag") is not None
        return any(self._matches_one(scope, record) for scope in self._scopes)

    def _matches_one(self, scope: dict[str, Any], record: dict[str, Any]) -> bool:
        if "tag" in scope:
            return bool(record.get("tag") == scope["tag"])
        if "pids" in scope:
            wanted = pid_starttimes(scope)
            return record["pid"] in wanted and wanted[record["pid"]] in (
                None, record.get("starttime"))
        if "sandbox" in scope:
            ns = self._sandbox_ns.get(scope["sandbox"])
            if ns is None:
                ns = self._resolve_sandbox(scope["sandbox"])
            return ns is not None and record.get("pid_ns") == ns
        if "job" in scope:
            return bool(record["pid"] in self._job_pids)
        return False

    def _has_job(self) -> bool:
        return any("job" in scope for scope in self._scopes)

    def _find_job(self) -> bool:
        """Take the scope's job's ranks from a census (chaosgpu.scope: the one reading of who
        is a job's rank, however the job was launched: its ranks' environment, its store's
        connections; none while it is not there). Whether one of them is not tracked yet: a
        rank can become known after its process was examined (a store connection is made
        seconds after the process starts), so a rescan then looks at it whatever it saw."""
        from chaosgpu.scope import resolve_scope

        census = self._node.take_census(gpu=False, fds=False, cache=True)
        self._job_found_at = time.monotonic()
        self._job_pids = {p["pid"] for scope in self._scopes if "job" in scope
                          for p in resolve_scope(scope, census, observe=True)}
        untracked = self._job_pids - set(self._tracked)
        for pid in untracked:
            self._known.pop(pid, None)
        return bool(untracked)

    def _new_since_listing(self) -> tuple[bool, range | None]:
        """Whether /proc must be listed again now, and the PIDs the kernel allocated since the
        last listing (None when unknown): a PID of that range may be a reused one, to look at
        again whatever was seen under it before."""
        now = time.monotonic()
        try:
            last = _node().last_pid()
        except (OSError, ValueError, IndexError):
            return True, None
        previous, self._last_pid = self._last_pid, last
        if previous == last and now - self._listed_at < FULL_RESCAN_S:
            return now < self._young_until, range(0)  # nothing new; a young one may be due
        if previous is None or not self._same_pid_ns or last < previous:
            return True, None  # first listing, another namespace's /proc, or PIDs wrapped
        return True, range(previous + 1, last + 1)

    def _rescan(self) -> None:
        node = _node()
        needed, allocated = self._new_since_listing()
        if self._has_job() and (
                needed or time.monotonic() - self._job_found_at >= FULL_RESCAN_S):
            # a census costs tens of ms on a busy node: taken when the kernel allocated a PID
            # (a new process, or a rank starting the threads of its process group) or at the
            # full-rescan period, not at every rescan
            needed = self._find_job() or needed
        if not needed:
            return
        pids = node.list_pids()
        now = self._listed_at = time.monotonic()
        uptime = _uptime_ticks()
        for pid in pids:
            # A process caught between fork and exec still has its parent's environment: a
            # process younger than REEXAMINE_S when first seen is looked at again until then.
            seen = self._known.get(pid)
            if pid in self._tracked:
                continue
            if seen is not None and allocated is not None and pid in allocated:
                seen = None  # the PID was allocated again: another process than the one seen
                del self._known[pid]
            if seen is not None and now >= seen:
                continue
            record = node.read_process(pid, env=True, fds=False)
            if record is None:
                continue
            if seen is None:
                age_s = (uptime - (record.get("starttime") or 0)) / _TICKS if uptime else 99.0
                until = self._known[pid] = now + max(0.0, REEXAMINE_S - age_s)
                self._young_until = max(self._young_until, until)
            if pid != os.getpid() and self._matches(record):
                pidfd = self._open_pidfd(pid, record.get("starttime"))
                if pidfd is None:
                    continue
                self._pidfds[pid] = pidfd
                self._pid_of_fd[pidfd] = pid
                self._hold_stat(pid, record.get("starttime"))
                self._poller.register(pidfd, select.POLLIN)
                self._tracked[pid] = record.get("starttime")
                self._list_due.set()  # its GPU memory, if any, is listed within a second
                with self._data_lock:
                    entry = self.processes.setdefault(pid, {
                        "t": [], "mib": [], "tag": record.get("tag"),
                        "rank": (record.get("env") or {}).get("RANK"),
                        "comm": record.get("comm"), "starttime": record.get("starttime"),
                        "states": []})
                    entry["states"].append([round(self.now(), 6), record.get("state")])
        alive = set(pids)
        for pid in [p for p in self._known if p not in alive]:
            del self._known[pid]

    # -- the threads -----------------------------------------------------------------------
    # Three threads, each owning one stream, so that a slow reading never delays another: the
    # memory thread (device memory or RSS, at rate_hz), the GPU-process thread (NVML's process
    # list, every process_every periods: measured on the H200, both NVML queries take 0.01 ms
    # idle but 180-230 ms while 100 contexts start, and over a second while they are torn
    # down), and the exit thread (blocked in poll() over the tracked pidfds: an exit is seen
    # when it happens, whatever NVML is doing; it also reads the states and examines new PIDs).
    def _run_thread(self, body: Any) -> None:
        cpu0 = time.thread_time()
        try:
            body()
        except Exception as error:  # a thread must never die silently: say so, stop them all
            self._record_error(error)
        finally:
            with self._data_lock:
                spent = time.thread_time() - cpu0
                self.cpu_s += spent
                self.cpu_s_by_thread[threading.current_thread().name] = spent
                self.wall_s = max(self.wall_s, time.monotonic() - self._m_wall0)
            self._stop.set()
            self._list_due.set()
            self._wake()
            with self._rescans:  # a caller waiting for a rescan goes on
                self._rescans.notify_all()

    def _record_error(self, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        if message not in self.errors:
            self.errors.append(message)
            logger.error("chaosgpu timeline: sampling error: %s", message, exc_info=True)

    def _paced(self, period_of: Any, step: Any) -> None:
        """Call `step()` every `period_of()` seconds until stopped; a late tick is made up, a stall
        (more than three periods) is not burst through. Errors are recorded, never fatal."""
        next_at = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            period = period_of()
            if now < next_at:
                # one sleep per tick: each wake-up must take the GIL again, which a busy main
                # thread holds for up to the switch interval: re-checking in a loop pays that
                # more than once a tick
                time.sleep(min(next_at - now, 0.05))  # lighter than Event.wait: no lock
                if self._stop.is_set():
                    return
                if time.monotonic() < next_at - 0.0005:
                    continue  # a long period: wait on in 50 ms steps
            next_at += period
            if next_at < time.monotonic() - 3 * period:
                next_at = time.monotonic() + period
            try:
                if step() is False:
                    return
            except Exception as error:  # keep sampling; say so loudly, once per kind
                self._record_error(error)

    def _memory_step(self) -> bool:
        # a sample is stamped when its reading is complete: it never shows a change (memory
        # freed by a kill) at an instant before that change happened
        if self.source == "nvml":
            total = 0.0
            devices = self._node.nvml_device_memory()
            t = time.monotonic() - self._m0
            with self._data_lock:
                for device in devices:
                    self.devices.setdefault(device["index"], []).append(device["used_mib"])
                    total += device["used_mib"]
                self.t.append(t)
                self.total.append(total)
            if self._listed_total is None:  # the first list came before the first sample
                self._listed_total = total
            elif abs(total - self._listed_total) > LIST_ON_CHANGE_MIB and \
                    not self._list_due.is_set():
                self._list_due.set()  # the GPU-process thread lists again
        else:  # the RSS of each process is read every tick anyway: kept every process_every
            self._sample_rss(self._ticks % self.process_every == 0)
        self._ticks += 1
        if len(self.t) >= self.max_samples:
            logger.error("chaosgpu timeline: %d samples reached, sampling stops",
                         self.max_samples)
            return False
        return True

    def _run_gpu_processes(self) -> None:
        """Read NVML's process list every `process_every` periods, spaced by its measured cost
        (PROCESS_BUDGET of a core): up to MAX_SPACING_S, or STEADY_SPACING_S while device
        memory stays where it was at the last listing. Waits on events, never polls."""
        base = self.process_every / self.rate_hz
        while not self._stop.is_set():
            started, cpu = time.monotonic(), time.thread_time()
            try:
                self._gpu_processes_step()
            except Exception as error:  # keep sampling; say so loudly, once per kind
                self._record_error(error)
            cost = time.thread_time() - cpu
            if self._stop.wait(max(0.0, started + _spaced(base, cost) - time.monotonic())):
                return
            steady_until = started + _spaced(base, cost, STEADY_SPACING_S)
            self._list_due.wait(max(0.0, steady_until - time.monotonic()))

    def _gpu_processes_step(self) -> None:
        with self._data_lock:
            self._listed_total = self.total[-1] if self.total else None
        self._list_due.clear()
        listed = self._node.nvml_gpu_processes()
        t = time.monotonic() - self._m0  # when the reading is complete (see _memory_step)
        per_pid: dict[int, float] = {}
        for entry in listed:
            if entry["pid"] in self._tracked or not self._scopes:
                per_pid[entry["pid"]] = per_pid.get(entry["pid"], 0.0) + (
                    entry["used_mib"] or 0.0)
        with self._data_lock:
            for pid, mib in per_pid.items():
                entry = self.processes.setdefault(
                    pid, {"t": [], "mib": [], "tag": None, "rank": None,
                          "comm": None, "starttime": None, "states": []})
                entry["t"].append(t)
                entry["mib"].append(mib)

    def _run_exits(self) -> None:
        """Wait in poll() for tracked processes to exit; between exits, read every tracked
        process's state each sweep period (cost-spaced: PROCESS_BUDGET of a core at most) and
        examine new PIDs each `rescan_s` (or when asked)."""
        period = self.process_every / self.rate_hz
        next_sweep = next_rescan = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                ready = self._poller.poll(max(0.0, min(next_sweep, next_rescan) - now) * 1000)
                if self._stop.is_set():
                    return
                t = time.monotonic() - self._m0
                exited = [self._pid_of_fd[fd] for fd, _ in ready if fd in self._pid_of_fd
                          and self._pid_of_fd[fd] not in self._exited]
                with self._rescans:  # after an activity: states and PIDs now
                    asked_upto = self._rescans_asked
                asked = asked_upto > self._rescans_done
                try:
                    if any(fd == self._wake_r for fd, _ in ready):
                        os.read(self._wake_r, 4096)
                    if exited:
                        self._sample_states(t, exited)
                    now = time.monotonic()
                    if asked or now >= next_sweep:
                        started = time.thread_time()
                        self._sample_states(t)
                        cost = time.thread_time() - started
                        next_sweep = now + _spaced(period, cost, SWEEP_SPACING_S)
                    if asked or now >= next_rescan:
                        started = time.thread_time()
                        self._rescan()  # O(processes on the node): cost-spaced too
                        cost = time.thread_time() - started
                        next_rescan = now + _spaced(self.rescan_s, cost, 2 * MAX_SPACING_S)
                except Exception as error:  # keep watching; say so loudly, once per kind
                    self._record_error(error)
                    next_sweep = max(next_sweep, time.monotonic() + period)
                if asked:  # done, or failed (recorded): a waiting caller goes on either way
                    with self._rescans:
                        self._rescans_done = asked_upto
                        self._rescans.notify_all()
        finally:
            for fd in [*self._pidfds.values(), *self._stat_fds.values()]:
                os.close(fd)
            self._pidfds.clear()
            self._stat_fds.clear()
            self._pid_of_fd.clear()
            self._poller = select.poll()
            self._tracked.clear()

    def _wake(self) -> None:
        """Wake the exit thread out of poll() (a stop, a rescan request)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed (stopped) or full (already woken)
            pass

    def _sample_rss(self, with_processes: bool) -> None:
        total = 0.0
        readings = []
        for pid in list(self._tracked):
            if pid in self._exited:
                continue
            rss = _rss_mib(pid, self._fds)
            if rss is not None:
                total += rss
                readings.append((pid, rss))
            elif pid in self._fds:
                os.close(self._fds.pop(pid))
        for pid in [pid for pid in self._fds if pid not in self._tracked]:
            os.close(self._fds.pop(pid))  # gone: the exit thread stopped tracking it
        t = time.monotonic() - self._m0  # when the reading is complete (see _memory_step)
        with self._data_lock:
            self.t.append(t)
            self.total.append(total)
            if with_processes:
                for pid, mib in readings:
                    entry = self.processes.get(pid)
                    if entry is not None:
                        entry["t"].append(t)
                        entry["mib"].append(mib)

    def _hold_stat(self, pid: int, starttime: int | None) -> None:
        """Keep the tracked process's stat open: a state sweep is then one pread per process
        instead of an open, a read and a close. Held only once a read through it shows the
        start time tracked (else the path is read each time, with its own check)."""
        try:
            fd = self._node.open_stat(pid)
        except self._node.ProcError:
            return
        if self._node.process_state(pid, starttime=starttime, fd=fd) is None:
            os.close(fd)
            return
        self._stat_fds[pid] = fd

    def _forget_pidfd(self, pid: int) -> None:
        stat_fd = self._stat_fds.pop(pid, None)
        if stat_fd is not None:
            os.close(stat_fd)
        pidfd = self._pidfds.pop(pid)
        if pid in self._exited:
            self._exited.discard(pid)  # out of the poll set since its exit was seen
        else:
            self._poller.unregister(pidfd)
        self._pid_of_fd.pop(pidfd, None)
        os.close(pidfd)

    def _open_pidfd(self, pid: int, starttime: int | None) -> int | None:
        """A pidfd for a tracked process, opened then checked against its start time: it then
        tells the process's exit without any PID-reuse doubt. No start time, no pidfd (fail
        closed: a process whose identity cannot be checked is not tracked)."""
        if starttime is None:
            return None
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return None
        if self._node.process_starttime(pid) != starttime:
            os.close(pidfd)
            return None
        return pidfd

    def _sample_states(self, t: float, pids: list[int] | None = None) -> None:
        node = self._node
        if not self._tracked:
            return
        ready = {fd for fd, _ in self._poller.poll(0)}
        for pid in list(self._tracked) if pids is None else pids:
            pidfd = self._pidfds.get(pid)
            if pidfd is None:
                continue
            if pidfd in ready and pid not in self._exited:
                # an exited process's pidfd stays readable: out of the poll set, or the exit
                # thread would spin while the zombie waits to be reaped
                self._exited.add(pid)
                self._poller.unregister(pidfd)
                self._list_due.set()
            # Not exited: the PID is still this process's, its state is safe to read.
            # Exited: zombie until reaped, then gone (its PID may already be someone else's).
            state = node.process_state(pid, starttime=self._tracked.get(pid),
                                       fd=self._stat_fds.get(pid))
            if pid in self._exited and state not in ("Z", "X"):
                state = None
            elif pid not in self._exited and state in ("Z", "X"):
                # the thread-group leader is a zombie, but its pidfd is not readable: other
                # threads still run or exit (a CUDA process's teardown in the driver takes
                # seconds: seen on the H200). Not dead yet; it holds what it held.
                state = "exiting"
            label = state or "gone"
            entry = self.processes.get(pid)
            if entry is None:
                continue
            states = entry["states"]
            if not states or states[-1][1] != label:
                with self._data_lock:
                    states.append([t, label])
            if label == "gone":
                del self._tracked[pid]
                self._known.pop(pid, None)  # its PID, if it comes back, is another process
                self._forget_pidfd(pid)

    # -- queries ---------------------------------------------------------------------------
    def snapshot(self) -> tuple[list[float], list[float]]:
        """Return copies of (t, total MiB) so far."""
        with self._data_lock:
            return list(self.t), list(self.total)

    def wait_samples(self, count: int, timeout_s: float) -> bool:
        """Wait until at least `count` samples exist (deadline `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while len(self.t) < count and time.monotonic() < deadline:
            time.sleep(0.005)
        return len(self.t) >= count

    def wait_sample_after(self, t: float, timeout_s: float) -> bool:
        """Wait until a memory sample stamped after `t` (seconds since t0) exists, at most
        `timeout_s`: the end of the run's residual is read from such a sample (one taken after
        the rollbacks), never from one taken before they freed anything."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.running:
            with self._data_lock:
                if self.t and self.t[-1] > t:
                    return True
            time.sleep(0.002)
        with self._data_lock:
            return bool(self.t) and self.t[-1] > t

    def take_baseline(self, window_s: float = 0.1, timeout_s: float = 2.0) -> dict[str, Any]:
        """Record the baseline: the median total (and per device) over the first `window_s`."""
        self.wait_samples(max(3, int(window_s * self.rate_hz)), timeout_s)
        with self._data_lock:
            n = max(1, min(len(self.t), int(window_s * self.rate_hz) or 1))
            totals = self.total[-n:]
            devices = {index: statistics.median(series[-n:])
                       for index, series in self.devices.items() if series}
        self.baseline = {
            "source": self.source, "total_mib": statistics.median(totals) if totals else 0.0,
            "devices": [{"index": i, "used_mib": round(v, 3)} for i, v in sorted(devices.items())],
            "taken_at": self.t0 + self.now(), "samples": len(totals)}
        return self.baseline

    def matched(self) -> bool:
        """Whether the scope has matched a process since the sampler started: one was tracked
        at some point (a process that matched and then exited counts: that is a release)."""
        with self._data_lock:
            return bool(self.processes)

    def scope_label(self) -> str:
        """The scope in words, for messages: the control's scope, or the default's meaning."""
        from chaosgpu.scope import describe_scope

        if self.scope is None and self.own:
            return ("(none given: this run's own targets " +
                    ", ".join(repr(describe_scope(scope)) for scope in self.own) + ")")
        if self.scope is None:
            return "(none given: every chaosgpu-tagged process)"
        return repr(describe_scope(self.scope))

    def event_time(self, name: str, phase: str = "start", occurrence: int = -1) -> float | None:
        """Time (s since t0) of the named event's `phase` ('start', 'end' or 'point')."""
        with self._data_lock:
            matches = [e["t"] for e in self.events if e["name"] == name
                       and (phase is None or e["phase"] == phase)]
        if not matches:
            return None
        return matches[occurrence]

    def integral_gib_s(self, t_from: float, t_to: float, above: float) -> float:
        """GiB x s of max(0, total - above) MiB over [t_from, t_to]: chaosgpu.timeline.integral."""
        t, total = self.snapshot()
        return gib_seconds(t, total, t_from, t_to, above)

    # -- export ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Rates, overhead and a few figures of the whole recording."""
        wall = self.wall_s if not self.running else self.now()
        n = len(self.t)
        span = (self.t[-1] - self.t[0]) if n > 1 else 0.0
        cpu = self.cpu_s if not self.running else None
        return {
            "source": self.source, "samples": n, "duration_s": round(span, 4),
            "rate_hz_requested": self.rate_hz,
            "rate_hz": round((n - 1) / span, 2) if span > 0 else None,
            "overhead_cpu_pct": round(100.0 * cpu / wall, 3) if cpu is not None and wall else None,
            "overhead_cpu_pct_by_thread": {
                name.replace("chaosgpu-timeline", "sampler"): round(100.0 * spent / wall, 3)
                for name, spent in self.cpu_s_by_thread.items()} if cpu is not None and wall
            else None,
            "baseline_total_mib": self.baseline["total_mib"] if self.baseline else None,
            "peak_total_mib": max(self.total) if self.total else None,
            "final_total_mib": self.total[-1] if self.total else None,
            "tracked_processes": len(self.processes), "scope": self.scope,
            "own_targets": list(self.own) if self.scope is None else None,
            "scope_matched": bool(self.processes), "errors": list(self.errors),
            "unit": "MiB (2**20 bytes); integrals in GiB x s (GiB = 1024 MiB)"}

    def to_dict(self) -> dict[str, Any]:
        """The timeline document (docs/ARCHITECTURE.md "Timeline in the journal")."""
        summary = self.summary()
        with self._data_lock:
            times = [round(x, 5) for x in self.t]
            return {
                "t0": self.t0, "rate_hz": summary["rate_hz"],
                "overhead_cpu_pct": summary["overhead_cpu_pct"], "source": self.source,
                "unit": "MiB", "t": times, "total_mib": [round(x, 3) for x in self.total],
                "devices": [{"index": i, "t": times, "used_mib": [round(x, 3) for x in series]}
                            for i, series in sorted(self.devices.items())],
                "processes": {str(pid): dict(entry, t=[round(x, 5) for x in entry["t"]],
                                             mib=[round(x, 3) for x in entry["mib"]])
                              for pid, entry in self.processes.items()},
                "events": list(self.events), "baseline": self.baseline}

    def points(self) -> int:
        """How many numbers the timeline holds (to decide inline or file)."""
        return len(self.t) * (1 + len(self.devices)) + sum(
            len(e["t"]) for e in self.processes.values())
