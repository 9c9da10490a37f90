"""The job-state model: a verdict on a training job from what was observed over time.

This module owns the rules. It is fed observations (chaosgpu.job.observe takes them: census
entries, per-rank /proc activity, TCP counters, exits, Python stacks, Flight Recorder
summaries) and keeps, per job, what each rank did over time; it never reads the node itself,
never sleeps and never signals, so recorded observations can be replayed through it.

Verdicts (docs/faults.md, "Job verdicts"):

* ``running``: some live rank made progress within the window.
* ``hung``: no rank made progress for at least the window while a live rank waits in a
  collective, a barrier, a rendezvous or DDP's backward (or every live rank is stopped or
  frozen); or every rank of the attempt ended, restarts are left, and the elastic agent is
  stopped or frozen, for at least the window: no attempt can start until it resumes. Evidence:
  the blocked ranks and where they wait, since when, and the culprit ranks (exited, stopped,
  frozen, partitioned, missing, or alive elsewhere with their own stack), the agent among
  them (rank None, its PID, ``role`` "launcher") while it is stopped or frozen.
* ``failed``: the ranks ended and some ended badly (non-zero exit, or a signal), with no
  restart to come; when, how soon after the fault (a rank that ended after a fault chaosgpu
  sent it, by PID and start time, is said so: "exit 0 after chaosgpu's SIGTERM"), and the
  error where readable. The culprits are the ranks that ended first of those that failed and
  those chaosgpu sent a signal that ends a process.
* ``restarting``: the elastic agent lives, can act (neither stopped nor frozen) and a new
  attempt is seen on its way: after a rank failed, the attempt's other ranks ending (the
  agent's teardown) or all of them gone, or new ranks not yet past their rendezvous; the job
  keeps its id and counts restarts. A failed rank alone, its peers still live, is not a
  restart seen: the verdict is what the live ranks show, its reason saying a restart is
  expected (an agent that never acts leaves them blocked: hung after the window). An agent
  stopped (SIGSTOP, a debugger) or frozen (cgroup freezer) can neither tear down nor restart
  anything: with live ranks the verdict is what they show, with none "unknown" until the
  window passed, then "hung".
* ``finished``: every rank ended with exit code 0.
* ``unknown``: not enough could be seen (no stacks, another user's processes, ranks waiting on
  the GPU with no Flight Recorder, exit statuses hidden): the reason says which.

Progress is something seen between two observations, never inferred from one instant: bytes
crossing a rank's connections to its peers (the kernel's TCP counters), a Python stack that
moved (frames or simple local values outside the innermost line), CPU time or written bytes
while the rank is not waiting in a known place, or a Flight Recorder collective that completed.

A peer connection is one whose other end is a socket of another live rank of the same job, as
the observer saw them in one reading (`PeerEnds`), or, for a job with ranks whose sockets this
node's table does not show (another host or network namespace), one whose other end is not in
the table at all. A connection to any other process (a metrics collector, a logging or data
service, the rendezvous store) moves no training and never counts, and neither does a
connection to a rank that cannot read (stopped or frozen): the bytes the kernel accepts into its
receive buffer are not a collective's progress.
"""

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from chaosgpu.job.exits import Exit
from chaosgpu.job.stacks import (
    Site,
    SourceLines,
    StackSample,
    classify,
    describe_move,
    is_dataloader_worker,
    render,
    signature,
)

__all__ = ["VERDICTS", "RankTrack", "JobTrack", "PeerEnds", "DEFAULT_WINDOW_S", "rank_key",
           "rank_name", "rank_with_pid", "culprit_text"]

VERDICTS = ("running", "hung", "failed", "restarting", "finished", "unknown")
DEFAULT_WINDOW_S = 3.0
#: The span over which CPU use is measured (seconds).
CPU_SPAN_S = 1.0
#: CPU use (in cores) that counts as computing for a rank not waiting in a known place.
COMPUTING_CORES = 0.1
_HZ = os.sysconf("SC_CLK_TCK")
_EVIDENCE_LIMIT = 60
#: Exits seen this close together were seen by one reading: which came first is not known.
_SAME_MOMENT_S = 0.001
_LIVE = ("alive", "stopped", "frozen")
#: The signals chaosgpu sends that do not ask a process to end (stops, and the resume)
_NOT_ENDING = ("SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGCONT")
#: Sites where a rank waits on its peers (a rank seen there since a peer stopped is tied to it).
_BLOCKING = ("collective", "barrier", "backward", "wait")


def _ranks_text(tracks: "list[RankTrack]") -> str:
    """[0, 1] when every number is known, else each rank's label."""
    if all(t.rank is not None for t in tracks):
        return str([t.rank for t in tracks])
    return "[" + ", ".join(t.label for t in tracks) + "]"


def rank_key(rank: int | None, pid: int | None) -> str:
    """"N", or "? (PID P)" where no process shows the number (a rank started by
    torch.multiprocessing.spawn carries no RANK in its environment): a rank's key in maps."""
    return str(rank) if rank is not None else f"? (PID {pid})"


def rank_name(rank: int | None, pid: int | None) -> str:
    """"rank N", or "rank ? (PID P)" where no process shows the number (see rank_key)."""
    return f"rank {rank_key(rank, pid)}"


def rank_with_pid(rank: int | None, pid: int | None) -> str:
    """Its name with its PID, once: "rank 1 (PID 42)", "rank ? (PID 42)"."""
    return rank_name(rank, pid) if rank is None else f"rank {rank} (PID {pid})"


def culprit_text(culprit: dict[str, Any]) -> str:
    """A culprit as a reason says it: "rank 1 stopped (...)"; a launcher's (`role`
    "launcher", rank None) `why` names it itself: "the elastic agent (PID 9), stopped ..."."""
    if culprit.get("role") == "launcher":
        return str(culprit["why"])
    return f"{rank_name(culprit['rank'], culprit['pid'])} {culprit['why']}"


@dataclass
class PeerEnds:
    """Who holds the other end of a job's connections, from one reading of its ranks' sockets
    (`JobTrack.peer_ends`): the connections whose bytes may count as progress toward peers."""

    #: local end ("addr:port") of each established socket a live rank holds -> that rank's
    #: (pid, start time)
    owners: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: every local end in the node's table: a remote end among them is a process here
    local_ends: set[str] = field(default_factory=set)
    #: the ranks that cannot read in this reading (stopped or frozen), (pid, start time)
    cannot_read: set[tuple[int, int]] = field(default_factory=set)
    #: the job has ranks whose sockets the table does not show (another host or namespace):
    #: a remote end outside the table may be one of them
    elsewhere: bool = False


@dataclass
class RankTrack:
    """What one rank process did over time (one process: a restarted rank is a new track)."""

    rank: int | None
    pid: int
    starttime: int
    restart_count: int | None
    first_seen: float
    state: str = "alive"
    last_seen: float = 0.0
    exit: Exit | None = None
    exited_at: float | None = None
    error: dict[str, Any] | None = None
    last_progress: float | None = None
    progress_how: str | None = None
    cpu_history: deque[tuple[float, int]] = field(default_factory=deque)
    cpu_cores: float | None = None
    wchar_prev: int | None = None
    net_prev: dict[int, int] = field(default_factory=dict)
    net: dict[str, Any] = field(default_factory=dict)
    signature_prev: tuple[Any, ...] | None = None
    stack: StackSample | None = None
    site: Site | None = None
    site_since: float | None = None
    backend: str | None = None
    up: bool = False
    env: dict[str, str] = field(default_factory=dict)
    stderr: str | None = None
    gpu_mib: float | None = None
    stack_error: str | None = None
    #: exited_at is when the end was first seen, not when it happened (an upper bound)
    exit_seen_late: bool = False
    #: its helpers (forked copies: DataLoader workers) as the census saw them, pid -> start time
    helpers: dict[int, int] = field(default_factory=dict)
    #: after its end, the helpers still holding its peer connections ({"pid", "connections"})
    holders: list[dict[str, int]] = field(default_factory=list)
    #: when its state (alive, stopped, frozen) was first seen as it is now
    state_since: float | None = None
    #: the last progress that needs no stack: bytes to its peers, CPU time (its own or its
    #: helpers'), a Flight Recorder collective completed (a stack that moves and written bytes
    #: are also a loop retrying a collective that cannot complete, and its logging)
    last_hard_progress: float | None = None
    #: the last progress with its peers: bytes to them, a Flight Recorder collective completed
    last_peer_progress: float | None = None
    #: CPU use of its helpers (DataLoader workers) together, in cores, and their history
    helper_cores: float | None = None
    helper_cpu: dict[int, deque[tuple[float, int]]] = field(default_factory=dict)
    #: the last collective, barrier or wait it was seen in, and when
    last_wait: Site | None = None
    last_wait_at: float | None = None

    @property
    def label(self) -> str:
        """Its name in reasons and evidence (see rank_name)."""
        return rank_name(self.rank, self.pid)

    @property
    def label_with_pid(self) -> str:
        """Its name with its PID, once (see rank_with_pid)."""
        return rank_with_pid(self.rank, self.pid)

    @property
    def live(self) -> bool:
        """Alive, stopped or frozen (not ended)."""
        return self.state in _LIVE

    def summary(self) -> dict[str, Any]:
        """The rank as a JSON-ready dict (no full stack)."""
        return {"rank": self.rank, "pid": self.pid, "starttime": self.starttime,
                "restart_count": self.restart_count, "state": self.state,
                "backend": self.backend, "up": self.up,
                "last_progress": self.last_progress, "progress": self.progress_how,
                "cpu_cores": None if self.cpu_cores is None else round(self.cpu_cores, 3),
                "waiting_in": self.site.to_json() if self.site else None,
                "waiting_since": self.site_since,
                "exit": self.exit.to_json() if self.exit else None,
                "exited_at": self.exited_at, "error": self.error, "gpu_mib": self.gpu_mib,
                "network": self.net or None, "stack_error": self.stack_error}


def _cpu_rate(history: deque[tuple[float, int]], now: float, ticks: int) -> float | None:
    """CPU use in cores over the last CPU_SPAN_S seconds (None until that much is seen): a
    short burst of a waiting process (a timer, a keep-alive) is not computing."""
    history.append((now, ticks))
    while len(history) > 2 and now - history[1][0] >= CPU_SPAN_S:
        history.popleft()
    first_t, first_ticks = history[0]
    if now - first_t < CPU_SPAN_S * 0.6:
        return None
    return (ticks - first_ticks) / _HZ / (now - first_t)


def _backend_from_threads(threads: list[dict[str, Any]] | None) -> str | None:
    for thread in threads or []:
        name = thread.get("comm") or ""
        if name.startswith("pt_nccl") or name.startswith("NCCL"):
            return "nccl"
    for thread in threads or []:
        name = thread.get("comm") or ""
        if name.startswith("pt_gloo") or name.startswith("gloo"):
            return "gloo"
    return None


class JobTrack:
    """One job over time: its ranks (every attempt), its launcher, the verdict and evidence."""

    def __init__(self, job_id: str, window_s: float = DEFAULT_WINDOW_S,
                 now: float | None = None) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.id = job_id
        self.window_s = float(window_s)
        self.first_seen = time.time() if now is None else now
        self.ranks: dict[tuple[int, int], RankTrack] = {}
        self.launcher: dict[str, Any] | None = None
        #: every helper (forked copy of a rank: a DataLoader worker) seen, (pid, start time)
        self.helper_keys: set[tuple[int, int]] = set()
        self.launcher_alive = False
        self.launcher_exit: Exit | None = None
        #: the live launcher's state as the observer last read it: "alive", "stopped" (T, t:
        #: SIGSTOP or a debugger) or "frozen" (cgroup freezer); None: not read (its census
        #: entry only). Stopped or frozen, it can neither tear down nor restart the ranks.
        self.launcher_state: str | None = None
        #: when the launcher was first seen in that state
        self.launcher_state_since: float | None = None
        self.world_size: int | None = None
        self.expected_ranks: list[int] | None = None
        self.max_restarts: int | None = None
        self.tag: str | None = None
        self.store_port: int | None = None
        self.hidden_ranks = 0
        self.verdict = "unknown"
        self.reason = "not observed yet"
        self.since: float | None = None
        #: False when the verdict already held as this observer began to see the job: `since`
        #: is then when it was first seen so, not when it began
        self.since_known = False
        self.confirmed_at: float | None = None
        self.evidence: list[dict[str, Any]] = []
        self.history: list[dict[str, Any]] = []
        self.partitions: list[dict[str, Any]] = []
        self.flight_recorder: dict[int, dict[str, Any]] = {}
        self.nccl_ras: dict[str, Any] | None = None
        self.faults: list[dict[str, Any]] = []
        self.observations = 0
        self.stack_samples = 0
        self.sources: set[str] = set()
        self._details: dict[str, Any] = {}
        self._sources = SourceLines()

    # ---------------------------------------------------------------- feeding observations

    def note(self, now: float, source: str, what: str, rank: int | None = None,
             **extra: Any) -> None:
        """Add a line of evidence (kept in order, the oldest dropped past a limit)."""
        entry = {"t": round(now, 4), "source": source, "rank": rank, "what": what, **extra}
        self.evidence.append(entry)
        if len(self.evidence) > _EVIDENCE_LIMIT:
            del self.evidence[1:len(self.evidence) - _EVIDENCE_LIMIT + 1]

    def update_census(self, entry: dict[str, Any], processes: dict[int, dict[str, Any]],
                      now: float) -> None:
        """Take the job's census entry: new rank processes, launcher, world size."""
        self.observations += 1
        self.world_size = entry.get("world_size") or self.world_size
        self.expected_ranks = entry.get("expected_ranks") or self.expected_ranks
        if entry.get("max_restarts") is not None:
            self.max_restarts = entry["max_restarts"]
        self.tag = entry.get("tag") or self.tag
        self.hidden_ranks = int(entry.get("hidden_ranks") or 0)
        if entry.get("master") and ":" in entry["master"]:
            port = entry["master"].rsplit(":", 1)[1]
            self.store_port = int(port) if port.isdigit() else self.store_port
        if entry.get("launcher_pid") is not None:
            launcher = {"pid": entry["launcher_pid"], "starttime": entry.get("launcher_starttime"),
                        "kind": entry.get("launcher")}
            if self.launcher is None or self.launcher["pid"] != launcher["pid"]:
                self.launcher = launcher
                self.launcher_state = self.launcher_state_since = None
                self.note(now, "proc", f"launcher ({launcher['kind']}) is PID {launcher['pid']}")
            self.launcher_alive = True
        for rank in entry.get("ranks") or []:
            if rank.get("pid") is None or rank.get("starttime") is None or rank.get("inferred"):
                continue
            key = (rank["pid"], rank["starttime"])
            track = self.ranks.get(key)
            if track is None and key in self.helper_keys:
                continue  # a rank's helper, left behind by its rank: never a rank itself
            if track is None:
                proc = processes.get(rank["pid"]) or {}
                track = RankTrack(rank.get("rank"), rank["pid"], rank["starttime"],
                                  rank.get("restart_count"), now, last_seen=now,
                                  env=dict(proc.get("env") or {}))
                self.ranks[key] = track
                self.note(now, "proc", f"{track.label} is PID {track.pid}"
                          + (f" (restart {track.restart_count})" if track.restart_count else ""),
                          track.rank)
            elif track.rank is None and rank.get("rank") is not None:  # numbered once seen
                track.rank = rank["rank"]
                self.note(now, "proc", f"PID {track.pid} is rank {track.rank} "
                          f"({rank.get('rank_source')})", track.rank)
            track.gpu_mib = rank.get("gpu_mib")
            if track.live:
                track.helpers = {pid: processes[pid]["starttime"]
                                 for pid in rank.get("helpers") or [] if pid in processes}
                self.helper_keys.update(track.helpers.items())

    def update_holders(self, track: RankTrack, holders: list[dict[str, int]],
                       now: float) -> None:
        """After a rank ended: which of its helpers still hold its peer connections."""
        if holders != track.holders:
            if holders:
                self.note(now, "proc", f"{track.label} ended but its helpers "
                          f"{[h['pid'] for h in holders]} still hold "
                          f"{sum(h['connections'] for h in holders)} of its peer connections "
                          "(inherited when they were forked): its peers see no close",
                          track.rank)
            elif track.holders:
                self.note(now, "proc", f"{track.label}'s helpers released its peer "
                          "connections", track.rank)
        track.holders = holders

    def peer_ends(self, readings: dict[tuple[int, int], dict[str, Any] | None],
                  sockets: dict[int, dict[str, Any]] | None,
                  frozen: set[tuple[int, int]] | None = None) -> PeerEnds:
        """Who is on the other end of this job's connections, from one reading of its live
        ranks (`readings`: (pid, start time) -> their /proc sample with socket inodes, None
        where gone) and the node's TCP table; `frozen`: the ranks known frozen (the census's
        freezer state, or a freeze this runner recorded since the last census)."""
        ends = PeerEnds()
        if sockets is None:
            return ends
        ends.local_ends = {s["local"] for s in sockets.values() if "local" in s}
        here = 0
        for key, activity in readings.items():
            if activity is None or activity.get("starttime") != key[1] \
                    or activity.get("state") in ("Z", "X"):
                continue
            if activity.get("state") in ("T", "t") or key in (frozen or set()):
                ends.cannot_read.add(key)
            shown = [sockets[i] for i in activity.get("socket_inodes") or [] if i in sockets]
            if shown:
                here += 1
            for sock in shown:
                if sock.get("state") == "ESTABLISHED" and "local" in sock:
                    ends.owners[sock["local"]] = key
        live = sum(1 for t in self.current_ranks() if t.live)
        ends.elsewhere = (self.world_size is not None and self.world_size > here) \
            or live > here
        return ends

    def update_activity(self, track: RankTrack, activity: dict[str, Any] | None,
                        sockets: dict[int, dict[str, Any]] | None, now: float,
                        frozen: bool = False, peers: PeerEnds | None = None) -> None:
        """One /proc sample of a rank (None: it is gone) with the node's TCP table and who
        holds the other ends of its connections (`peers`, from `peer_ends`; without it no
        connection is known to reach a peer, so no byte counts as progress)."""
        if not track.live:
            return
        if activity is None or activity.get("starttime") != track.starttime:
            self._ended(track, now, "proc", "is gone")
            return
        track.last_seen = now
        self.sources.add("proc")
        if not self._update_state(track, activity, now, frozen):
            return
        ticks = activity.get("cpu_ticks")
        moved: list[str] = []
        hard = False
        if ticks is not None:
            track.cpu_cores = _cpu_rate(track.cpu_history, now, ticks)
        wchar = activity.get("wchar")
        wrote = wchar is not None and track.wchar_prev is not None and wchar > track.wchar_prev
        if wchar is not None:
            track.wchar_prev = wchar
        if sockets is not None and activity.get("socket_inodes") is not None:
            self.sources.add("tcp")
            net_bytes = self._network(track, activity["socket_inodes"], sockets, now,
                                      peers or PeerEnds())
            if net_bytes:
                moved.append(f"{net_bytes} bytes crossed its peer connections")
                hard = True
                track.last_peer_progress = now
        if track.state != "alive":
            return  # a stopped or frozen process makes no progress, whatever a counter says
        # CPU time is progress unless the rank waits where a loop may spin or poll (a collective,
        # a barrier, a rendezvous, a `.wait()`, the GPU); in backward() it is the gradients'
        # computation (a DDP rank blocked there on its all_reduce uses none)
        waiting = track.site is not None and track.site.kind != "backward"
        if not waiting and track.cpu_cores is not None and track.cpu_cores >= COMPUTING_CORES:
            moved.append(f"computing ({track.cpu_cores:.2f} cores"
                         + (", in backward)" if track.site is not None else ", not waiting)"))
            hard = True
        # a rank waiting for its DataLoader: its workers' CPU time is its step being prepared
        if not waiting and track.helper_cores is not None \
                and track.helper_cores >= COMPUTING_CORES:
            moved.append(f"its helper processes (DataLoader workers) compute "
                         f"({track.helper_cores:.2f} cores)")
            hard = True
        if not waiting and wrote:
            moved.append("writing (bytes written, not waiting)")
        if moved:
            self._progress(track, now, "; ".join(moved), hard=hard)

    def update_helper_activity(self, track: RankTrack, ticks: dict[int, int | None],
                               now: float) -> None:
        """The CPU ticks of a live rank's helpers (pid -> ticks, None: gone), read with its
        own /proc sample (update_activity then counts their CPU use as its progress while the
        rank itself waits for them, not in a collective)."""
        rates = []
        for pid, value in ticks.items():
            if value is None:
                track.helper_cpu.pop(pid, None)
                continue
            rate = _cpu_rate(track.helper_cpu.setdefault(pid, deque()), now, value)
            if rate is not None:
                rates.append(rate)
        for pid in set(track.helper_cpu) - set(ticks):
            del track.helper_cpu[pid]
        track.helper_cores = sum(rates) if rates else None

    def _update_state(self, track: RankTrack, activity: dict[str, Any], now: float,
                      frozen: bool) -> bool:
        """A rank's process state, stderr and backend from one sample; False once it ended."""
        state = activity["state"]
        new_state = ("exited" if state in ("Z", "X") else "stopped" if state in ("T", "t")
                     else "frozen" if frozen else "alive")
        if new_state == "exited":
            self._ended(track, now, "proc", "is a zombie (ended, not reaped yet)")
            return False
        if new_state != track.state:
            self.note(now, "proc", f"{track.label} is {new_state} (state {state})",
                      track.rank)
            track.state = new_state
            track.state_since = now
        elif track.state_since is None:
            track.state_since = now
        if activity.get("stderr"):
            track.stderr = activity["stderr"]
        backend = _backend_from_threads(activity.get("threads"))
        if backend and track.backend is None:
            track.backend = backend
            self.note(now, "proc", f"{track.label} has a {backend} process group (its "
                      "threads)", track.rank)
        return True

    def _peer_of(self, track: RankTrack, sock: dict[str, Any],
                 ends: PeerEnds) -> tuple[int, int] | None | bool:
        """The rank at the other end of `sock` ((pid, start time)); True for a rank not in the
        node's table (another host or namespace, where the job has ranks); None: no peer."""
        if self.store_port is not None and self.store_port in (sock["local_port"],
                                                                sock["remote_port"]):
            return None  # the rendezvous store's connection is not training traffic
        owner = ends.owners.get(sock["remote"])
        if owner is not None:
            return owner if owner != (track.pid, track.starttime) else None
        if sock["remote"] in ends.local_ends or not ends.elsewhere:
            return None  # a process here that is no rank of the job (metrics, logging, data)
        return True

    def _network(self, track: RankTrack, inodes: list[int],
                 sockets: dict[int, dict[str, Any]], now: float, ends: PeerEnds) -> int:
        total = 0
        stalled = []
        peers = 0
        others = 0
        unread = 0
        peer_inodes = []
        for inode in inodes:
            sock = sockets.get(inode)
            if sock is None or sock.get("state") != "ESTABLISHED" or "bytes_acked" not in sock:
                continue
            owner = self._peer_of(track, sock, ends)
            if owner is None:
                if self.store_port is None or self.store_port not in (sock["local_port"],
                                                                      sock["remote_port"]):
                    others += 1
                continue
            if not track.up:
                track.up = True
                self.note(now, "tcp", f"{track.label} is connected to its peers "
                          f"({sock['local']} -> {sock['remote']})", track.rank)
            peers += 1
            peer_inodes.append(inode)
            count = sock["bytes_acked"] + sock["bytes_received"]
            before = track.net_prev.get(inode)
            track.net_prev[inode] = count
            if owner is not True and owner in ends.cannot_read:
                # bytes into a peer that cannot read land in its kernel buffer: no collective
                # moved (its resume starts counting afresh from here)
                unread += 1
            elif before is not None and count > before:
                total += count - before
            if sock.get("unacked") or sock.get("retransmits"):
                stalled.append({"local": sock["local"], "remote": sock["remote"],
                                "unacked_segments": sock.get("unacked"),
                                "retransmits": sock.get("retransmits"),
                                "ms_since_data_received": sock.get("ms_since_data_received")})
        track.net = {"peer_connections": peers,
                     "other_connections": others,
                     "to_peers_that_cannot_read": unread,
                     "ms_since_data_received": min(
                         (sockets[i].get("ms_since_data_received", 0) for i in peer_inodes),
                         default=None),
                     "stalled_connections": stalled[:8]}
        return total

    def update_stack(self, track: RankTrack, sample: StackSample, now: float,
                     gpu: bool = False) -> None:
        """One Python stack sample of a rank."""
        if not track.live:
            return
        self.stack_samples += 1
        if sample.error:
            track.stack_error = sample.error
            return
        self.sources.add("py-spy")
        if is_dataloader_worker(sample) and track.state == "alive":
            # a rank's helper the census took for a rank (its rank gone, nothing shows whose)
            del self.ranks[(track.pid, track.starttime)]
            self.helper_keys.add((track.pid, track.starttime))
            self.note(now, "py-spy", f"PID {track.pid} runs a DataLoader worker loop: a "
                      "helper left behind by a rank, not a rank", None)
            return
        track.stack_error = None
        track.stack = sample
        site = classify(sample, self._sources, gpu=gpu)
        if site != track.site:
            if site is not None:
                self.note(now, "py-spy", f"{track.label} waits in {site.describe()} "
                          f"at {site.caller or site.frame}", track.rank,
                          source_line=site.source)
                track.site_since = now
            elif track.site is not None:
                self.note(now, "py-spy", f"{track.label} left {track.site.what}", track.rank)
                track.site_since = None
            track.site = site
        if site is not None and site.kind in _BLOCKING and track.state == "alive":
            track.last_wait, track.last_wait_at = site, now
        if not track.up and track.backend is not None and (site is None
                                                            or site.kind != "rendezvous"):
            track.up = True
            self.note(now, "py-spy", f"{track.label} is past its rendezvous", track.rank)
        # Only the thread that does the job's work moves it forward: the one waiting in a known
        # site, else the main thread. Background pollers (a watchdog, a logger's heartbeat, an
        # injector's watcher) change their locals forever, which is not the job's progress.
        sig = signature(sample, {site.thread} if site is not None and site.thread
                        else {"MainThread"}, site)
        before = track.signature_prev
        track.signature_prev = sig
        if before is not None and sig != before and track.state == "alive":
            self._progress(track, now, f"its Python stack moved ({describe_move(before, sig)})")

    def update_flight_recorder(self, track: RankTrack, summary: dict[str, Any],
                               now: float) -> None:
        """A Flight Recorder summary of a rank: the last completed collective's sequence
        number grew = progress; a collective started and not completed = where it waits."""
        if not track.live or track.rank is None:
            return
        self.sources.add("flight-recorder")
        before = self.flight_recorder.get(track.rank)
        self.flight_recorder[track.rank] = summary
        done = summary.get("last_completed_seq")
        if before is not None and done is not None and done > (before.get("last_completed_seq")
                                                               or -1):
            self._progress(track, now, f"Flight Recorder: collective {done} completed",
                           hard=True)
            track.last_peer_progress = now

    def update_exit(self, track: RankTrack, exit_info: Exit, error: dict[str, Any] | None,
                    now: float, ended_at: float | None = None) -> None:
        """How an ended rank ended (exit status, error text); `ended_at`: when its pidfd said
        it ended (the observer's pause between two readings), earlier than the reading that
        found it gone: the rank's end is then that moment."""
        if ended_at is not None and track.exited_at is not None and ended_at < track.exited_at:
            self.note(now, "pidfd", f"{track.label} ended at {ended_at:.3f} "
                      f"({track.exited_at - ended_at:.3f} s before the reading that found it "
                      "gone)", track.rank)
            track.exited_at = ended_at
        track.exit = exit_info
        if error is not None:
            track.error = error
        self.sources.add(exit_info.source or "proc")

    def update_launcher(self, alive: bool, exit_info: Exit | None, now: float,
                        state: str | None = None, stat: str | None = None) -> None:
        """Whether the launcher lives (and how it ended); `state`, for a live one: "alive",
        "stopped" or "frozen" (a launcher stopped or frozen can neither tear down nor restart
        the ranks), `stat` the one-letter state its /proc stat showed."""
        if self.launcher_alive and not alive:
            self.note(now, "proc", "launcher ended" + (f" ({exit_info.describe()})"
                                                       if exit_info else ""))
            self.launcher_exit = exit_info
        self.launcher_alive = alive
        if not alive or state is None or state == self.launcher_state:
            return
        shown = f", state {stat}" if stat else ""
        if state in ("stopped", "frozen"):
            how = ("stopped (SIGSTOP or a debugger" if state == "stopped"
                   else "frozen (cgroup freezer")
            self.note(now, "proc", f"launcher {how}{shown}): {self._agent_name()} can neither "
                      "tear down nor restart the ranks while it is")
        elif self.launcher_state is not None:
            self.note(now, "proc", f"launcher resumed ({self._agent_name()}{shown}) after "
                      f"{now - (self.launcher_state_since or now):.1f} s "
                      f"{self.launcher_state}")
        self.launcher_state = state
        self.launcher_state_since = now

    def _agent_name(self) -> str:
        """"the elastic agent (PID n)" (torchrun's), else "the launcher (kind, PID n)"."""
        launcher = self.launcher or {}
        if launcher.get("kind") == "torchrun":
            return f"the elastic agent (PID {launcher.get('pid')})"
        return f"the launcher ({launcher.get('kind')}, PID {launcher.get('pid')})"

    def agent_can_act(self) -> bool:
        """Whether the launcher can tear down and restart ranks: it lives and is neither
        stopped nor frozen (as the observer last read it)."""
        return self.launcher_alive and self.launcher_state not in ("stopped", "frozen")

    def update_partitions(self, partitions: list[dict[str, Any]], now: float) -> None:
        """The network partitions in place on the node (chaosgpu's nftables records)."""
        mine = {(t.pid, t.starttime) for t in self.ranks.values()}
        found = [p for p in partitions
                 if any((t.get("pid"), t.get("starttime")) in mine for t in p.get("targets", []))]
        if found and not self.partitions:
            self.note(now, "nftables", "a network partition drops the traffic of "
                      + ", ".join(rank_name(t.get("rank"), t.get("pid")) for p in found
                                  for t in p.get("targets", [])))
        self.partitions = found

    def update_faults(self, faults: list[dict[str, Any]]) -> None:
        """The faults this runner injected (chaosgpu.faultlog)."""
        mine = {(t.pid, t.starttime) for t in self.ranks.values()}
        if self.launcher is not None and self.launcher.get("starttime") is not None:
            mine.add((self.launcher["pid"], self.launcher["starttime"]))
        self.faults = [f for f in faults if (f.get("pid"), f.get("starttime")) in mine
                       or f.get("job") == self.id]

    def _ended(self, track: RankTrack, now: float, source: str, how: str) -> None:
        track.state = "exited"
        track.exited_at = now
        track.site = None
        self.note(now, source, f"{track.label_with_pid} {how}", track.rank)

    def _progress(self, track: RankTrack, now: float, how: str, hard: bool = False) -> None:
        if track.last_progress is None or now - track.last_progress >= self.window_s / 2:
            self.note(now, "progress", f"{track.label}: {how}", track.rank)
        track.last_progress = now
        track.progress_how = how
        if hard:
            track.last_hard_progress = now

    # ---------------------------------------------------------------- the verdict

    def current_ranks(self) -> list[RankTrack]:
        """The ranks of the newest attempt (the highest restart count seen)."""
        if not self.ranks:
            return []
        newest = max((t.restart_count or 0) for t in self.ranks.values())
        return sorted((t for t in self.ranks.values() if (t.restart_count or 0) == newest),
                      key=lambda t: (t.rank is None, t.rank or 0, t.pid))

    def restart_count(self) -> int | None:
        """How many times the elastic agent restarted the ranks (None: not an elastic job)."""
        counts = [t.restart_count for t in self.ranks.values() if t.restart_count is not None]
        return max(counts) if counts else None

    def evaluate(self, now: float) -> str:
        """Decide the verdict from everything observed so far; returns it."""
        verdict, reason, since, details = self._decide(now)
        if verdict != self.verdict:
            self.history.append({"t": round(now, 4), "verdict": verdict, "reason": reason})
            self.note(now, "verdict", f"{verdict}: {reason}")
            self.confirmed_at = now
            # a time the evidence gives (a last progress, an exit) after the watch began, or a
            # change seen from another verdict; not a first look that followed "unknown",
            # unless that unknown outlasted a window: then it was a finding (ranks idle), and
            # what follows was seen as it came (before round 21: "already when first seen")
            self.since_known = (since > self.first_seen if since is not None
                                else self.verdict != "unknown"
                                or now - self.first_seen > self.window_s)
            self.since = since if since is not None else now
        self.verdict, self.reason, self._details = verdict, reason, details
        return verdict

    def _decide(self, now: float) -> tuple[str, str, float | None, dict[str, Any]]:
        ranks = self.current_ranks()
        live = [t for t in ranks if t.live]
        restarts = self.restart_count()
        if not ranks:
            if self.launcher_alive and self.hidden_ranks:
                return ("unknown", f"the launcher's {self.hidden_ranks} child processes cannot "
                        "be inspected by this observer (another user's): their ranks are "
                        "invisible", None, {})
            if self.launcher_alive and (self.launcher or {}).get("kind") == "torchrun":
                if not self.ranks:  # no attempt seen: nothing seen to restart (before
                    # round 22 "restarting", the first verdict of every torchrun job)
                    return ("unknown", "the elastic agent lives and this watch has seen no "
                            "rank of it yet: it is starting (its rendezvous waits for "
                            "--nnodes MIN nodes) or between two attempts", None, {})
                if not self.agent_can_act():
                    return self._agent_cannot_restart(ranks, restarts, now)
                return ("restarting", "the elastic agent lives with no rank: the ranks of "
                        "the last attempt ended and the next ones are not started yet", None,
                        {})
            return "unknown", "no rank of this job has been seen", None, {}
        if not live:
            return self._ended_verdict(ranks, restarts, now)
        last = max((t.last_progress for t in live if t.last_progress is not None), default=None)
        never = last is None
        stuck, soft_only, last, early = self._peer_cannot_answer(live, last, now)
        if early is not None:
            return early
        quiet_since = last if last is not None else max(self.first_seen,
                                                         min(t.first_seen for t in live))
        quiet_for = now - quiet_since
        if quiet_for >= self.window_s:
            decided = self._no_progress(ranks, live, quiet_since, quiet_for, never, stuck,
                                        soft_only, now)
            if decided is not None:
                return decided
        failed_here = [t for t in ranks if not t.live and t.exit is not None
                       and t.exit.clean is False]
        can_restart = self.max_restarts is None or (restarts or 0) < self.max_restarts
        # a launcher stopped or frozen restarts nothing: the verdict is what the ranks show
        expected = ""
        if self.agent_can_act() and self.launcher is not None and failed_here and can_restart:
            first_failure = min(t.exited_at or now for t in failed_here)
            torn_down = [t for t in ranks if not t.live and t.exited_at is not None
                         and t.exited_at - first_failure >= _SAME_MOMENT_S]
            if torn_down:  # the agent's teardown seen: ranks ending after the failure
                return ("restarting", f"attempt {restarts or 0}: "
                        + ", ".join(f"{t.label} {t.exit.describe() if t.exit else ''}"
                                    for t in failed_here)
                        + "; the elastic agent lives (max restarts "
                        f"{self.max_restarts}) and is tearing the attempt down ("
                        + ", ".join(t.label for t in torn_down) + " ended since)",
                        first_failure, {})
            # a restart is what torchrun does next, but nothing of it is seen yet: the
            # verdict stays what the live ranks show (an agent that never acts leaves them
            # blocked: hung once the window passes)
            expected = (f"; the elastic agent lives with restarts left (max "
                        f"{self.max_restarts}): a restart is expected, its teardown not seen "
                        "yet")
        if self.agent_can_act() and restarts and not all(t.up for t in live):
            return ("restarting", f"attempt {restarts}: new ranks not past their rendezvous yet",
                    min(t.first_seen for t in live), {})
        ended = [t for t in ranks if not t.live]
        extra = ""
        if ended:
            extra = "; ended: " + ", ".join(f"{t.label} {t.exit.describe() if t.exit else ''}"
                                             for t in ended)
        if last is None:
            return ("unknown", f"watching: observed for {now - quiet_since:.1f} s, no progress "
                    f"seen yet (window {self.window_s:g} s)" + extra + expected, None, {})
        return "running", f"progress {now - last:.2f} s ago" + extra + expected, None, {}

    def _ended_verdict(self, ranks: list[RankTrack], restarts: int | None,
                       now: float) -> tuple[str, str, float | None, dict[str, Any]]:
        bad = [t for t in ranks if t.exit is not None and t.exit.clean is False]
        unknown = [t for t in ranks if t.exit is None or t.exit.clean is None]
        first_end = min((t.exited_at for t in ranks if t.exited_at is not None), default=None)
        can_restart = self.max_restarts is None or (restarts or 0) < self.max_restarts
        if self.launcher_alive and bad and can_restart and self.launcher is not None:
            if not self.agent_can_act():
                return self._agent_cannot_restart(ranks, restarts, now, bad)
            return ("restarting", f"every rank of attempt {restarts or 0} ended ("
                    + ", ".join(f"{t.label} {t.exit.describe() if t.exit else 'exit not seen'}"
                                for t in sorted(ranks, key=lambda t: t.exited_at or now))
                    + f"); the elastic agent lives (max restarts {self.max_restarts})",
                    first_end, {})
        if bad and not self.launcher_alive and self.max_restarts is not None and can_restart \
                and (self.launcher or {}).get("kind") == "torchrun":
            decided = self._agent_ended_with_restarts_left(ranks, bad, restarts, first_end)
            if decided is not None:
                return decided
        if bad:
            story = self._failure_story(ranks, bad)
            agent = self.launcher_exit if not self.launcher_alive \
                and (self.launcher or {}).get("kind") == "torchrun" else None
            if agent is not None and self.max_restarts is not None and can_restart:
                # restarts were left after the attempt seen: the agent started later ones,
                # which ended the job; their ranks, and so the culprits, were not seen here
                return ("failed", f"the elastic agent ended ({agent.describe()}) "
                        f"after attempt {restarts or 0}, the last this watch saw, failed with "
                        f"restarts left (max {self.max_restarts}): the attempts after it, not "
                        f"seen here, ended the job; attempt {restarts or 0}: {story}",
                        first_end, {"culprit_ranks": [], "culprits_note": "the ranks of the "
                                    "attempt that ended the job were not seen by this watch"})
            if agent is not None:
                story += f"; the elastic agent then ended: {agent.describe()}"
            return ("failed", story, first_end,
                    {"culprit_ranks": self._first_failures(ranks, bad)})
        if unknown:
            return ("unknown", "the ranks ended but their exit status is not visible: "
                    + "; ".join(f"{t.label}: {t.exit.describe() if t.exit else 'not seen'}"
                                for t in unknown), first_end, {})
        return "finished", f"every rank exited 0 ({len(ranks)} ranks)", first_end, {}

    def _agent_ended_with_restarts_left(self, ranks: list[RankTrack], bad: list[RankTrack],
                                        restarts: int | None, first_end: float | None
                                        ) -> tuple[str, str, float | None, dict[str, Any]] | None:
        """The ranks seen here failed with restarts left, and the elastic agent has ended
        since: the attempts after them (their ranks never seen by this watch: a probe that
        came late) ended as the agent's exit status says. Exit 0: "finished"; not visible:
        "unknown"; another exit: None (failed, the story told by the caller, which the agent's
        exit joins)."""
        attempt = f"attempt {restarts or 0} failed ({self._failure_story(ranks, bad)})"
        agent = self.launcher_exit
        if agent is not None and agent.clean is True:
            return ("finished", f"{attempt}; the elastic agent then exited 0 with restarts left "
                    f"(max {self.max_restarts}): a later attempt finished, its ranks not seen by "
                    "this watch", first_end, {})
        if agent is None or agent.clean is None:
            return ("unknown", f"{attempt} with restarts left (max {self.max_restarts}), and the "
                    "elastic agent has ended, its exit status not visible: how the attempts "
                    "after it ended is not seen", None, {})
        return None

    def _agent_culprit(self) -> dict[str, Any] | None:
        """The launcher as a culprit (rank None, its PID, why) while it lives stopped or
        frozen: it can neither tear down nor restart the ranks; None when it can act."""
        if self.launcher is None or not self.launcher_alive \
                or self.launcher_state not in ("stopped", "frozen"):
            return None
        how = ("stopped (SIGSTOP or a debugger)" if self.launcher_state == "stopped"
               else "frozen (cgroup freezer)")
        return {"rank": None, "pid": self.launcher["pid"], "role": "launcher",
                "why": f"{self._agent_name()}, {how}: it can neither tear down nor restart "
                       "the ranks", "stack": None}

    def _agent_cannot_restart(self, ranks: list[RankTrack], restarts: int | None, now: float,
                              bad: list[RankTrack] | None = None
                              ) -> tuple[str, str, float | None, dict[str, Any]]:
        """No live rank, restarts left, and the launcher lives stopped or frozen: no attempt
        can start until it resumes. "unknown" until that has held for the window (from the
        later of its stop and the last rank's end), then "hung" with the launcher as culprit
        and `since` that moment (the ranks made progress until they ended)."""
        stopped_at = self.launcher_state_since if self.launcher_state_since is not None else now
        ended = [t.exited_at for t in ranks if t.exited_at is not None]
        since = max([stopped_at, *ended])
        held_for = now - stopped_at
        attempt = f"attempt {restarts or 0}"
        what = (f"every rank of {attempt} ended" if ranks
                else "the ranks of the last attempt ended and none of the next is seen")
        story = f" ({self._failure_story(ranks, bad)})" if ranks and bad else ""
        agent = f"{self._agent_name()} is {self.launcher_state}"
        if now - since < self.window_s:
            return ("unknown", f"{what}{story} and {agent} ({held_for:.1f} s): it restarts "
                    f"nothing while it is; watching for {self.window_s:g} s", None, {})
        culprit = self._agent_culprit()
        culprits = [culprit] if culprit is not None else []
        reason = (f"{what}{story} and {agent} for {held_for:.1f} s: no attempt can start until "
                  "it resumes" + "".join(f"; culprits: {culprit_text(c)}" for c in culprits))
        return ("hung", reason, since,
                {"blocked_in": {"kind": None, "what": None, "frame": None, "ranks": []},
                 "blocked": [], "culprit_ranks": culprits, "culprits_note": None})

    def _faults_on(self, track: RankTrack) -> list[dict[str, Any]]:
        """The faults this run sent the rank's very process: the fault log's entries for its
        PID and start time (oldest first)."""
        return [f for f in self.faults if f.get("pid") == track.pid
                and f.get("starttime") == track.starttime and f.get("kind") != "release"]

    @staticmethod
    def _fault_name(fault: dict[str, Any]) -> str:
        """"chaosgpu's SIGTERM", "chaosgpu's freeze (cgroup freezer)", ..."""
        kind = str(fault.get("kind"))
        if kind.startswith("SIG"):
            return f"chaosgpu's {kind}"
        return {"freezer": "chaosgpu's freeze (cgroup freezer)",
                "partition": "chaosgpu's network partition"}.get(kind, f"chaosgpu's {kind} fault")

    def _by_us(self, track: RankTrack) -> str:
        """What chaosgpu did to an ended rank, as its exit reads in a story: " (chaosgpu's
        fault)" for a death by the signal chaosgpu sent, " after chaosgpu's SIGTERM" for an
        exit (a handler's exit 0, an error) or another signal that followed a fault of ours,
        " (not sent by this run's chaosgpu)" for a signal death with no fault in this
        process's fault log (another process's run may have sent it: `chaosgpu jobs` beside a
        `chaos run` cannot tell); else ""."""
        faults = self._faults_on(track)
        signal = track.exit.signal if track.exit else None
        if signal and any(f.get("kind") == signal for f in faults):
            return " (chaosgpu's fault)"
        if faults:
            return f" after {self._fault_name(faults[-1])}"
        return " (not sent by this run's chaosgpu)" if signal else ""

    def _first_ends(self, ranks: list[RankTrack], bad: list[RankTrack]) -> list[RankTrack]:
        """The ranks that ended first of those that failed and those chaosgpu sent a signal
        that asks a process to end (a rank that exited 0 on chaosgpu's SIGTERM ended on our
        fault, and its peers failed on its loss); several when one reading saw them end."""
        candidates = bad + [t for t in ranks if t not in bad and not t.live and any(
            str(f.get("kind")).startswith("SIG") and f.get("kind") not in _NOT_ENDING
            for f in self._faults_on(t))]
        first = min((t.exited_at for t in candidates if t.exited_at is not None), default=None)
        return [t for t in ranks if t in candidates and (
            first is None or t.exited_at is None or t.exited_at - first < _SAME_MOMENT_S)]

    def _first_failures(self, ranks: list[RankTrack],
                        bad: list[RankTrack]) -> list[dict[str, Any]]:
        """The ranks whose end was seen first (several when one reading saw them end): the
        culprits of a failed job, as far as exits and chaosgpu's faults can tell."""
        culprits = []
        for track in self._first_ends(ranks, bad):
            how = track.exit.describe() if track.exit else "ended"
            if track in bad:
                why = f"failed first: {how}" + (
                    " (chaosgpu's fault)" if self._by_us(track) == " (chaosgpu's fault)" else "")
            else:  # it ended on our fault (exit 0 after SIGTERM): its peers failed on its loss
                why = (f"ended first, {how}{self._by_us(track)}: its peers lost it")
            culprits.append({"rank": track.rank, "pid": track.pid, "why": why})
        return culprits

    def _failure_story(self, ranks: list[RankTrack], bad: list[RankTrack]) -> str:
        first = min(self._first_ends(ranks, bad) or bad, key=lambda t: t.exited_at or 0)
        parts = []
        for track in sorted(ranks, key=lambda t: t.exited_at or 0):
            after = ""
            if track is not first and first.exited_at and track.exited_at:
                gap = track.exited_at - first.exited_at
                if abs(gap) < _SAME_MOMENT_S:  # seen ended by one reading: no order is known
                    after = f", seen ended together with {first.label}"
                else:
                    after = (f", {'gone by ' if track.exit_seen_late else ''}"
                             f"{abs(gap):.2f} s {'after' if gap > 0 else 'before'} "
                             f"{first.label}")
            parts.append(f"{track.label} {track.exit.describe() if track.exit else 'ended'}"
                         f"{self._by_us(track)}{after}")
        return "; ".join(parts)

    def _peer_cannot_answer(self, live: list[RankTrack], last: float | None, now: float
                            ) -> tuple[list[RankTrack], list[RankTrack], float | None,
                                       tuple[str, str, float | None, dict[str, Any]] | None]:
        """With a rank that cannot answer (stopped, frozen, idle): the ranks stuck, those
        moving only on their own, the last progress that counts, and a verdict to give now
        (unknown, while a stop is younger than the window and the others move only so)."""
        stuck = self._stuck(live, now)
        stopped = [t for t in live if t.state in ("stopped", "frozen")]
        soft_only: list[RankTrack] = []
        if stuck or stopped:
            # A peer stopped or frozen (or idle) cannot complete a collective: what the others
            # show then counts only where it needs no peer (bytes between live ranks, CPU
            # time, Flight Recorder). A stack that moves and log lines are also a loop
            # retrying a collective that fails, which is no progress.
            stopped_at = min(map(self._stuck_since, stuck or stopped))

            def hard_of(track: RankTrack) -> float | None:
                # seen in a collective since its peer stopped, and no byte crossed since: that
                # collective failed, and the CPU time of its error handling is no progress
                if track.last_wait_at is not None and track.last_wait_at >= stopped_at and (
                        track.last_peer_progress is None
                        or track.last_peer_progress <= track.last_wait_at):
                    return track.last_peer_progress
                return track.last_hard_progress

            hard = max((h for h in map(hard_of, live) if h is not None), default=None)
            soft_only = [t for t in live if t.last_progress is not None
                         and now - t.last_progress < self.window_s
                         and (hard_of(t) is None or now - (hard_of(t) or 0) >= self.window_s)]
            if stuck:
                last = hard
            elif soft_only and (hard is None or now - hard >= self.window_s):
                # stopped for less than the window yet: no "running" on such moves alone
                why = (f"{_ranks_text(stopped)} stopped or frozen {now - stopped_at:.1f} s "
                       f"ago; ranks {_ranks_text(soft_only)} move only on their own (a stack "
                       "that moves, lines written), with no byte to their peers: watching for "
                       f"{self.window_s:g} s")
                return stuck, soft_only, last, ("unknown", why, None, {})
        return stuck, soft_only, last, None

    def _stuck(self, live: list[RankTrack], now: float) -> list[RankTrack]:
        """The ranks that cannot answer a collective: stopped or frozen for at least the
        window, or alive and idle outside any waiting place (no progress of any kind, its stack
        read and unchanged) for at least the window. Their `state_since` says since when."""
        found = [t for t in live if t.state in ("stopped", "frozen")
                 and t.state_since is not None and now - t.state_since >= self.window_s]
        for track in live:
            if track.state != "alive" or track.site is not None or track.stack is None:
                continue
            if now - self._stuck_since(track) >= self.window_s:
                found.append(track)
        return found

    @staticmethod
    def _stuck_since(track: RankTrack) -> float:
        """Since when a rank cannot answer: its stop, or the end of its last progress."""
        if track.state != "alive" and track.state_since is not None:
            return track.state_since
        return max(track.last_progress or track.first_seen, track.state_since or 0.0)

    def _no_progress(self, ranks: list[RankTrack], live: list[RankTrack], since: float,
                     quiet_for: float, never: bool, stuck: list[RankTrack] | None = None,
                     soft_only: list[RankTrack] | None = None, now: float | None = None
                     ) -> tuple[str, str, float | None, dict[str, Any]] | None:
        alive = [t for t in live if t.state == "alive"]
        waiting = [t for t in alive if t.site is not None and t.site.kind != "gpu-wait"]
        retrying: list[RankTrack] = []
        if stuck:
            # between two attempts at a collective that fails at once (its peer connection
            # closed after a timeout), a rank sits in its own code: seen in the collective
            # since its peer stopped, it is tied to that peer
            stopped_at = min(map(self._stuck_since, stuck))
            retrying = [t for t in alive if t not in waiting and t.site is None
                        and t.last_wait is not None and t.last_wait_at is not None
                        and t.last_wait_at >= stopped_at]
            waiting = waiting + retrying
        gpu_waiting = [t for t in alive if t.site is not None and t.site.kind == "gpu-wait"]
        fr_pending = [t for t in alive if t.rank in self.flight_recorder
                      and self.flight_recorder[t.rank].get("pending")]
        if not alive and not (self.stack_samples or "proc" in self.sources):
            return None
        if not waiting and not fr_pending and alive:
            if all(t.stack is None for t in alive):
                errors = sorted({t.stack_error for t in alive if t.stack_error})
                return ("unknown", f"no progress for {quiet_for:.1f} s and no stack could be "
                        "read to tell where the ranks wait" + (f" ({errors[0]})" if errors else ""),
                        since, {})
            if gpu_waiting:
                return ("unknown", f"no progress seen for {quiet_for:.1f} s; ranks "
                        f"{_ranks_text(gpu_waiting)} wait on the GPU, and without Flight "
                        "Recorder a long kernel cannot be told from a hung one", since, {})
            return ("unknown", f"no progress for {quiet_for:.1f} s, but no rank waits in a "
                    "collective, barrier or rendezvous (idle or sleeping?)"
                    + "".join(f"; {t.label} {t.state}" for t in stuck or []
                              if t.state != "alive"), since, {})
        blocked = waiting + [t for t in fr_pending if t not in waiting]
        details = self._hang_details(ranks, live, blocked, since, retrying)
        strongest = details.pop("site", None)
        if blocked:
            places: dict[str, list[RankTrack]] = {}
            for track in blocked:  # where each waits: not all in one place is the finding
                site = track.last_wait if track in retrying else track.site
                places.setdefault(site.describe() if site is not None
                                  else "collective (Flight Recorder: pending)", []).append(track)
            if len(places) > 1:
                details["blocked_in"]["places"] = [
                    {"what": where, "ranks": [t.rank for t in tracks]}
                    for where, tracks in places.items()]
                reason = ("; ".join(f"ranks {_ranks_text(tracks)} wait in {where}"
                                    for where, tracks in places.items())
                          + " (not the same call: a mismatch, or ranks at different steps) "
                          f"with no progress for {quiet_for:.1f} s")
            else:
                where = strongest.describe() if strongest is not None \
                    else "collective (Flight Recorder: pending)"
                reason = (f"ranks {_ranks_text(blocked)} wait in {where} "
                          f"with no progress for {quiet_for:.1f} s")
        else:
            reason = f"every live rank is stopped or frozen, for {quiet_for:.1f} s"
        if retrying and now is not None:
            reason += ("; " + ", ".join(
                f"{t.label} retries it (last seen in it {now - (t.last_wait_at or now):.1f} s "
                "ago, in its own code between attempts)" for t in retrying))
        if soft_only:
            reason += (f"; ranks {_ranks_text(soft_only)} move only on their own (a stack that "
                       "moves, lines written, error handling) with no byte to their peers, "
                       "while " + ", ".join(t.label for t in stuck or []) + " cannot answer")
        if details["culprit_ranks"]:
            reason += "; culprits: " + "; ".join(
                culprit_text(c) for c in details["culprit_ranks"])
        if never:
            reason += " (no progress seen since the observation began)"
        return "hung", reason, since, details

    def _culprit_why(self, track: RankTrack, partition: str | None,
                     blocked: list[RankTrack]) -> str | None:
        """Why `track` is a culprit of the hang (partition: the id of a partition that cuts it
        off), or None when it is not one (a blocked rank)."""
        why = None
        if partition is not None:
            why = f"partitioned: its TCP traffic is dropped (nftables, partition {partition})"
            if not track.live:  # a node loss: cut off, then ended (its peers never knew)
                why += ", then ended: " + (track.exit.describe() if track.exit
                                           else "exit not seen")
                if self._faults_on(track):
                    why += self._by_us(track)
        elif not track.live:
            why = "ended: " + (track.exit.describe() if track.exit else "exit not seen")
            if self._faults_on(track):  # " (chaosgpu's fault)", " after chaosgpu's SIGTERM"
                why += self._by_us(track)
            if track.holders:
                why += (f"; its helper processes {[h['pid'] for h in track.holders]} "
                        "(forked copies: DataLoader workers) outlive it holding "
                        f"{sum(h['connections'] for h in track.holders)} of its peer "
                        "connections, so its peers see no close until they exit")
        elif track.state == "stopped":
            why = "stopped (SIGSTOP or a debugger)"
        elif track.state == "frozen":
            why = "frozen (cgroup freezer)"
        elif track not in blocked:
            why = "alive, not in a collective" + self._where(track)
        return why

    def _hang_details(self, ranks: list[RankTrack], live: list[RankTrack],
                      blocked: list[RankTrack], since: float,
                      retrying: list[RankTrack] | None = None) -> dict[str, Any]:
        retrying = retrying or []

        def site_of(track: RankTrack) -> Site | None:
            return track.last_wait if track in retrying else track.site

        blocked_in: dict[str, Any] = {"kind": None, "what": None, "frame": None, "ranks": []}
        strongest: Site | None = None
        if blocked:
            sites = [site_of(t) for t in blocked]
            known = [s for s in sites if s is not None]
            if known:
                strongest = min(known, key=lambda s: ("collective", "barrier", "rendezvous",
                                                      "backward", "wait").index(s.kind)
                                if s.kind in ("collective", "barrier", "rendezvous", "backward",
                                              "wait") else 9)
                blocked_in.update(strongest.to_json())
            else:
                blocked_in.update(kind="collective", what="(Flight Recorder: pending)")
            blocked_in["ranks"] = [t.rank for t in blocked]
        culprits = []
        partitioned = {(t.get("pid"), t.get("starttime")): p.get("id")
                       for p in self.partitions for t in p.get("targets", [])}
        for track in ranks:
            why = self._culprit_why(track, partitioned.get((track.pid, track.starttime)),
                                    blocked)
            if why is not None:
                culprits.append({"rank": track.rank, "pid": track.pid, "why": why,
                                 "stack": render(track.stack) if track.stack else None})
        present = {t.rank for t in ranks}
        for missing in sorted(set(self.expected_ranks or []) - present):
            culprits.append({"rank": missing, "pid": None, "why": "missing (never seen here)",
                             "stack": None})
        agent = self._agent_culprit()
        if agent is not None:  # it could not tear the ranks down, nor restart them
            culprits.append(agent)
        if not culprits and blocked:
            culprits_note = ("every rank seen here waits: the culprit is elsewhere (another "
                             "node, or the network between them)")
        else:
            culprits_note = None
        return {"blocked_in": blocked_in, "site": strongest,
                "blocked": [{"rank": t.rank, "pid": t.pid,
                             "waiting_in": site.to_json() if site else None,
                             "retrying": t in retrying,
                             "waiting_since": t.last_wait_at if t in retrying else t.site_since,
                             "network": t.net or None,
                             "stack": render(t.stack) if t.stack else None,
                             "flight_recorder": self.flight_recorder.get(t.rank)
                             if t.rank is not None else None}
                            for t, site in ((b, site_of(b)) for b in blocked)],
                "culprit_ranks": culprits, "culprits_note": culprits_note}

    def _where(self, track: RankTrack) -> str:
        thread = track.stack.main_thread() if track.stack is not None else None
        if thread is None:
            return ""
        inner = thread.frames[0]
        source = self._sources.line(track.pid, inner.filename, inner.line)
        where = f": at {inner.where()}" + (f" `{source}`" if source else "")
        loader = next((f for f in thread.frames
                       if f.filename.endswith("torch/utils/data/dataloader.py")), None)
        if loader is not None:
            where += (f"; it waits for its DataLoader ({loader.where()})"
                      + (f", whose workers {sorted(track.helpers)} use "
                         f"{track.helper_cores or 0:.2f} cores" if track.helpers else ""))
        return where

    # ---------------------------------------------------------------- reporting

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """The job's verdict with its evidence (`chaosgpu.job.verdict/1`)."""
        now = time.time() if now is None else now
        details = self._details
        fault = self.faults[-1] if self.faults else None
        detection: dict[str, Any] = {}
        if self.verdict == "hung" and self.confirmed_at is not None and self.since is not None:
            detection["after_hang_began_s"] = round(self.confirmed_at - self.since, 4)
        if fault is not None and self.confirmed_at is not None \
                and self.confirmed_at >= fault["t"]:
            detection["after_fault_s"] = round(self.confirmed_at - fault["t"], 4)
        return {
            "schema": "chaosgpu.job.verdict/1",
            "id": self.id, "verdict": self.verdict, "reason": self.reason,
            "since": self.since, "since_known": self.since_known,
            "confirmed_at": self.confirmed_at,
            "window_s": self.window_s, "observed_for_s": round(now - self.first_seen, 3),
            "restart_count": self.restart_count(), "max_restarts": self.max_restarts,
            "world_size": self.world_size, "tag": self.tag,
            "launcher": dict(self.launcher or {}, alive=self.launcher_alive,
                             state=(self.launcher_state if self.launcher_alive else "exited"),
                             state_since=self.launcher_state_since if self.launcher_alive
                             else None,
                             exit=self.launcher_exit.to_json() if self.launcher_exit else None)
            if self.launcher else None,
            "backend": next((t.backend for t in self.current_ranks() if t.backend), None),
            "ranks": [t.summary() for t in self.current_ranks()],
            "earlier_attempts": [t.summary() for t in self.ranks.values()
                                 if t not in self.current_ranks()],
            "blocked_in": details.get("blocked_in"),
            "blocked": details.get("blocked", []),
            "culprit_ranks": details.get("culprit_ranks", []),
            "culprits_note": details.get("culprits_note"),
            "detection": detection,
            "fault": fault,
            "partitions": self.partitions,
            "flight_recorder": {str(k): v for k, v in self.flight_recorder.items()} or None,
            "nccl_ras": self.nccl_ras,
            "evidence": list(self.evidence),
            "history": list(self.history),
            "sources": sorted(self.sources),
            "observations": self.observations, "stack_samples": self.stack_samples,
        }
