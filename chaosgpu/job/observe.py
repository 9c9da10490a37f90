"""Watching training jobs from outside: take the observations the job-state model needs.

This module owns the sampling loop: which jobs are watched (by id, by tag, or every job on the
node), and at which rate each source is read — the census (new ranks, launcher, restarts) every
`census_every_s`, each rank's /proc activity and the node's TCP counters every `tick_s`, Python
stacks every `stack_every_s`, exits through pidfds, the partitions and faults in place — feeding
them to chaosgpu.job.verdict, which decides. It reads the node only through chaosgpu.node (the
census program), py-spy (chaosgpu.job.stacks) and pidfds (chaosgpu.job.exits); it signals
nothing. Every call has a deadline.
"""

import os
import time
from collections.abc import Callable
from typing import Any

from chaosgpu import arguments, faultlog
from chaosgpu.errors import ActivityError
from chaosgpu.job import flight_recorder
from chaosgpu.job.exits import ExitWatch, read_error
from chaosgpu.job.stacks import take_samples
from chaosgpu.job.verdict import DEFAULT_WINDOW_S, JobTrack, RankTrack, rank_name
from chaosgpu.progress import Progress

__all__ = ["JobError", "not_found_message", "Observer", "observe", "select_jobs", "tagged_part",
           "visibility_note", "seen", "missing_allowed"]

DEFAULT_TICK_S = 0.2
DEFAULT_STACK_EVERY_S = 0.5
DEFAULT_CENSUS_EVERY_S = 1.0


class JobError(ActivityError, ValueError):
    """A job selection that is wrong (bad arguments, no such job, job and tag disagree)."""


#: (job id, tag) of every job an observer of this process found: a job seen, then missing,
#: has ended; a selection never seen matches nothing (a typo).
_SEEN: set[tuple[str | None, str | None]] = set()


def remember(job_id: str | None, tag: str | None) -> None:
    """Note that this run saw the job `job_id` (tagged `tag`): once it ends, a probe with
    missing_ok "before-method" may find it missing (see missing_allowed)."""
    _SEEN.add((job_id, tag))


def seen(job: str | None, tag: str | None) -> bool:
    """Whether a job matching this selection was found earlier in this process."""
    return any((job is None or job == j) and (tag is None or tag == t) for j, t in _SEEN)


def missing_allowed(missing_ok: Any, job: str | None, tag: str | None) -> bool:
    """Whether a job selection that matches nothing is acceptable (chaosgpu.arguments'
    missing_allowed: true, or "before-method" before the method starts and afterwards for a
    job this run has seen, which then ended)."""
    return arguments.missing_allowed(missing_ok, seen(job, tag))


def _census() -> dict[str, Any]:
    from chaosgpu.node import take_census

    return take_census(gpu=True, fds=False, cache=True)


def visibility_note(census: dict[str, Any]) -> str | None:
    """For a non-root observer: how many processes of other users could not be inspected
    (their jobs are invisible); None as root or when everything was readable."""
    observer = census.get("observer") or {}
    if observer.get("root"):
        return None
    hidden = [p for p in census.get("processes") or []
              if "env" in (p.get("unreadable") or []) and p.get("uid") != observer.get("uid")]
    if not hidden:
        return None
    return (f"{len(hidden)} processes of other users could not be inspected as UID "
            f"{observer.get('uid')}: their training jobs are invisible to this observer (run as "
            "root, or as the job's user, to see them)")


def check_selector(job: str | None, tag: str | None, allow_all: bool = False) -> None:
    """Refuse a selection that names nothing usable (raise JobError naming the argument): a
    tag is matched exactly, never stripped (chaosgpu.arguments.TAG: no whitespace or control
    character), a job id likewise (NAME: no edge whitespace), as a scope takes them."""
    if job is None and tag is None and not allow_all:
        raise JobError("name the job: give job=<id> (as `chaosgpu jobs` lists it) or "
                       "tag=<the workload's tag>")
    for name, value, rule in (("job", job, arguments.NAME), ("tag", tag, arguments.TAG)):
        if value is None:
            continue
        if isinstance(value, str) and "${" in value:
            raise JobError(f"{name}={value!r} still holds an unsubstituted ${{...}}: the "
                           "experiment's configuration does not define it")
        if not rule.accepts(value):
            raise JobError(f"{name} {rule.must(value)}, got {value!r}")


def _another_run(track: JobTrack, launcher: tuple[Any, Any]) -> bool:
    """Whether a job seen under the id of `track` with `launcher` (PID, start time) is another
    run of it: a new launcher while the run watched so far has ended (finished or failed) or
    lost its launcher. The same `--rdzv-id` started again under one `chaosgpu jobs --watch`
    (a game-day's next round) is judged afresh; before round 21 the first run's verdict and
    ranks stayed."""
    if launcher[0] is None or track.launcher is None:
        return False
    if (track.launcher["pid"], track.launcher.get("starttime")) == launcher:
        return False
    return track.verdict in ("finished", "failed") or not track.launcher_alive


def select_jobs(census: dict[str, Any], job: str | None = None,
                tag: str | None = None) -> list[dict[str, Any]]:
    """The census jobs a selection names: by id, by tag (a rank's or the launcher's), both
    (they must agree: JobError otherwise), or every job when neither is given. Selected by
    tag, a job is what of it carries the tag (tagged_part): ranks of another job that share
    its id (two jobs on one MASTER_ADDR:MASTER_PORT, the ranks of an earlier job left on
    torchrun's default port) are never in it."""
    jobs = census.get("jobs") or []
    if job is not None:
        matches = [j for j in jobs if j.get("id") == job]
        if tag is not None:
            parts = [tagged_part(census, found, tag) for found in matches]
            for found, part in zip(matches, parts, strict=True):
                if part is None:
                    raise JobError(f"job {job!r} carries tag {found.get('tag')!r}, not {tag!r}: "
                                   "name one of them, or make them agree")
            return [part for part in parts if part is not None]
        return matches
    if tag is not None:
        return [part for j in jobs if (part := tagged_part(census, j, tag)) is not None]
    return list(jobs)


def tagged_part(census: dict[str, Any], job: dict[str, Any],
                tag: str) -> dict[str, Any] | None:
    """The part of the census job `job` that tag `tag` names, or None when none of it carries
    the tag. A rank, launcher or orphaned helper that carries another tag is left out (a
    process's tag is its own declaration of what it belongs to), and so is one whose
    environment was read without any tag while a rank of the job carries one (the rank of
    another job on the same id); one whose environment could not be read (a zombie, another
    user's) stays, and so does a launcher without a tag (one that set it only for its
    children). The job itself when nothing is left out; else a copy with the rank lists
    (survivors, dead, stopped, frozen) of what is left and `other_tags`, the tags left out
    ("(none)" for an untagged process)."""
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    tags = {pid: p.get("tag") for pid, p in by_pid.items()}
    tagged_ranks = any(tags.get(r.get("pid")) for r in job.get("ranks") or [])

    def untagged(pid: Any) -> bool:  # its environment read, and no tag in it
        proc = by_pid.get(pid)
        return proc is not None and tags.get(pid) is None and proc.get("env") is not None \
            and "env" not in (proc.get("unreadable") or [])

    def other(pid: Any, rank: bool = True) -> bool:
        if pid is None:
            return False
        if tags.get(pid) is None:
            return rank and tagged_ranks and untagged(pid)
        return bool(tags.get(pid) != tag)

    ranks = [r for r in job.get("ranks") or [] if not other(r.get("pid"))]
    launcher_other = other(job.get("launcher_pid"), rank=False)
    if len(ranks) == len(job.get("ranks") or []) and not launcher_other:
        return job if job.get("tag") == tag else None
    launcher_tag = None if launcher_other else tags.get(job.get("launcher_pid"))
    if launcher_tag != tag and not any(tags.get(r.get("pid")) == tag for r in ranks):
        return None
    left_out = [r.get("pid") for r in job.get("ranks") or [] if other(r.get("pid"))]
    if launcher_other:
        left_out.append(job.get("launcher_pid"))
    part = dict(job, ranks=ranks, tag=tag,
                other_tags=sorted({str(tags.get(pid) or "(none)") for pid in left_out}),
                orphaned_helpers=[h for h in job.get("orphaned_helpers") or []
                                  if not other(h.get("pid"))])
    if launcher_other:
        part.update(launcher_pid=None, launcher_starttime=None)
    from chaosgpu.node import census_module

    part.update(census_module().rank_lists(ranks))  # as the census lists them for a job
    return part


class Observer:
    """Watches the selected jobs and keeps one JobTrack per job."""

    def __init__(self, job: str | None = None, tag: str | None = None,
                 window_s: float = DEFAULT_WINDOW_S, tick_s: float = DEFAULT_TICK_S,
                 stack_every_s: float = DEFAULT_STACK_EVERY_S,
                 census_every_s: float = DEFAULT_CENSUS_EVERY_S, stacks: bool = True,
                 all_jobs: bool = False,
                 census: Callable[[], dict[str, Any]] | None = None) -> None:
        """`census` gives the census to read (default: take one); the node agent passes its
        own shared census so that observing jobs adds no census of its own."""
        check_selector(job, tag, allow_all=all_jobs)
        for name, value in (("window_s", window_s), ("tick_s", tick_s),
                            ("stack_every_s", stack_every_s),
                            ("census_every_s", census_every_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        self.job, self.tag, self.all_jobs = job, tag, all_jobs
        self.window_s = float(window_s)
        self.tick_s = float(tick_s)
        self.stack_every_s = float(stack_every_s)
        self.census_every_s = float(census_every_s)
        self.stacks = stacks
        self.tracks: dict[str, JobTrack] = {}
        self._by_launcher: dict[tuple[Any, Any], str] = {}
        self._exits = ExitWatch()
        self._last_census = 0.0
        self._last_stacks = 0.0
        self._frozen: dict[tuple[int, int], bool] = {}
        self._gpu_pids: set[int] = set()
        self.started = time.time()
        self.visibility: str | None = None
        self.census_errors: list[str] = []
        self._census_source = census or _census

    def close(self) -> None:
        """Release the pidfds."""
        self._exits.close()

    # ---------------------------------------------------------------- one round

    def tick(self) -> None:
        """Take one round of observations and update every job's verdict."""
        now = time.time()
        if now - self._last_census >= self.census_every_s or not self.tracks:
            self._take_census(now)
        sockets = self._sockets()
        faults = faultlog.recent(self.started - 600)
        self._track_faulted_jobs(faults, now)
        partitions = _partitions()
        for track in self.tracks.values():
            track.update_faults(faults)
            self._adopt_faulted(track, faults, now)
            self._observe_processes(track, sockets, time.time())
            track.update_partitions(partitions, now)
        self._read_flight_recorders()
        if self.stacks and time.time() - self._last_stacks >= self.stack_every_s:
            self._last_stacks = time.time()
            self._take_stacks()
        now = time.time()
        for track in self.tracks.values():
            track.evaluate(now)
            if track.verdict == "hung" and track.nccl_ras is None and any(
                    r.backend == "nccl" for r in track.current_ranks()):
                from chaosgpu.job import nccl_ras

                track.nccl_ras = nccl_ras.query()
                if track.nccl_ras.get("available"):
                    track.sources.add("nccl-ras")
                    track.note(now, "nccl-ras", "NCCL RAS status report taken "
                               f"({track.nccl_ras['format']})")

    def _take_census(self, now: float) -> None:
        census = self._census_source()
        self._last_census = now
        self.visibility = visibility_note(census)
        self.census_errors = list(census.get("errors") or [])[:10]
        processes = {p["pid"]: p for p in census.get("processes") or []}
        self._gpu_pids = {p["pid"] for p in processes.values() if p.get("nvidia_fds")} | {
            g["pid"] for g in census.get("gpu_processes") or [] if g.get("pid") is not None}
        faults = faultlog.recent(self.started - 600)
        for fault in faults:  # a launcher this run's fault recorded is that job's, whatever
            # id the census gives it now (torchrun:PID between attempts or tearing down)
            launcher = fault.get("launcher")
            if fault.get("job") and isinstance(launcher, dict):
                self._by_launcher.setdefault((launcher.get("pid"), launcher.get("starttime")),
                                             str(fault["job"]))
        for entry in select_jobs(census, self.job, self.tag) if self.job or self.tag \
                else census.get("jobs") or []:
            track = self._track_for(entry, now)
            for fault in faults:  # helpers a fault saw: never ranks, even once theirs is gone
                if fault.get("job") == track.id:
                    track.helper_keys.update(tuple(h) for h in fault.get("helpers") or [])
            track.update_census(entry, processes, now)
            remember(track.id, entry.get("tag"))
            for rank in entry.get("ranks") or []:
                if rank.get("pid") is not None and rank.get("starttime") is not None:
                    self._frozen[(rank["pid"], rank["starttime"])] = rank.get("state") == "frozen"
        self._launchers_frozen()
        if self.job is None and self.tag is not None:
            return
        if self.job is not None and self.job not in self.tracks:
            # the job may be known under its launcher while it restarts (no rank, no run id)
            for entry in census.get("jobs") or []:
                key = (entry.get("launcher_pid"), entry.get("launcher_starttime"))
                if key in self._by_launcher and self._by_launcher[key] == self.job:
                    self.tracks[self.job].update_census(entry, processes, now)

    def _launchers_frozen(self) -> None:
        """Whether each watched job's live launcher is in a frozen cgroup, read with the census
        as a rank's freezer state is (the census program's reading, through
        chaosgpu.process.freezer.frozen_now: the census's job entry gives no launcher state)."""
        from chaosgpu.process import freezer

        for track in self.tracks.values():
            launcher = track.launcher or {}
            if track.launcher_alive and launcher.get("starttime") is not None:
                self._frozen[(launcher["pid"], launcher["starttime"])] = \
                    freezer.frozen_now(launcher["pid"])

    def _track_for(self, entry: dict[str, Any], now: float) -> JobTrack:
        job_id = entry["id"]
        key = (entry.get("launcher_pid"), entry.get("launcher_starttime"))
        known = self._by_launcher.get(key) if key[0] is not None else None
        if known is not None and known != job_id:
            track = self.tracks.get(known)
            if track is None:  # known from this run's fault record, first seen here so
                track = self.tracks[known] = JobTrack(known, self.window_s, now)
                track.note(now, "faultlog", f"{job_id} is the launcher of {known}, as "
                           "chaosgpu's fault record names it: judged as that job")
            if job_id.startswith("torchrun:"):
                return track  # the launcher between two attempts: keep the run id
            if known.startswith("torchrun:"):  # first seen without ranks: take the run id
                track.id = job_id
                self.tracks[job_id] = self.tracks.pop(known)
                self._by_launcher[key] = job_id
            return track
        existing = self.tracks.get(job_id) or self._track_of_ranks(entry)
        rerun = existing is not None and _another_run(existing, key)
        if existing is None or rerun:
            if existing is not None:
                self.tracks.pop(existing.id, None)
            existing = self.tracks[job_id] = JobTrack(job_id, self.window_s, now)
            if rerun:
                existing.note(now, "proc", f"a new run of {job_id} (launcher PID {key[0]}): "
                              "judged afresh")
        track = existing
        if key[0] is not None:
            self._by_launcher[key] = job_id
        return track

    def _track_of_ranks(self, entry: dict[str, Any]) -> JobTrack | None:
        """The track of a job seen before under another id, now found again by the same rank
        processes: a store's job whose host (rank 0) is gone is found by its other ranks'
        own connections (``peers:PID``); those ranks are still that job's."""
        keys = {(r["pid"], r["starttime"]) for r in entry.get("ranks") or []
                if r.get("pid") is not None and r.get("starttime") is not None}
        if not keys:
            return None
        owners = [t for t in self.tracks.values() if keys <= set(t.ranks)]
        return owners[0] if len(owners) == 1 else None

    def _sockets(self) -> dict[int, dict[str, Any]] | None:
        from chaosgpu.node import tcp_sockets

        try:
            return tcp_sockets()
        except OSError:
            return None

    def _observe_processes(self, track: JobTrack, sockets: dict[int, dict[str, Any]] | None,
                           now: float) -> None:
        from chaosgpu.node import process_activity, process_state

        # every live rank is read first: whose socket is at the other end of a connection,
        # and whether that rank can read, is known for this reading before any byte counts
        readings: dict[tuple[int, int], dict[str, Any] | None] = {}
        for rank in list(track.ranks.values()):
            if not rank.live:
                if rank.helpers:
                    self._check_holders(track, rank, now)
                continue
            self._exits.watch(rank.pid, rank.starttime)
            activity = process_activity(rank.pid)
            if activity is not None and activity.get("state") in ("Z", "X"):
                self._exits.note_zombie(rank.pid, rank.starttime, activity.get("exit_code"))
            readings[(rank.pid, rank.starttime)] = activity
        frozen = {key for key in readings if self._is_frozen(track, key)}
        ends = track.peer_ends(readings, sockets, frozen)
        for key, activity in readings.items():
            rank = track.ranks[key]
            if rank.helpers:
                track.update_helper_activity(rank, self._helper_ticks(rank.helpers), now)
            track.update_activity(rank, activity, sockets, now, frozen=key in frozen,
                                  peers=ends)
            if not rank.live:
                self._record_exit(track, rank, now)
        if track.launcher is not None and track.launcher.get("starttime") is not None:
            pid, start = track.launcher["pid"], track.launcher["starttime"]
            self._exits.watch(pid, start)
            # one read of its stat, start time checked (None: gone, or its PID reused)
            state = process_state(pid, starttime=start)
            alive = state is not None and state not in ("Z", "X")
            exit_info = None if alive else self._exits.exit_of(pid, start)
            # whether the agent can act: stopped (T, t) from this stat, frozen as a rank's
            # freeze is known (the census's freezer state, or a freeze this runner recorded)
            can_act = None if not alive else "stopped" if state in ("T", "t") \
                else "frozen" if self._is_frozen(track, (pid, start)) else "alive"
            track.update_launcher(alive, exit_info, now, state=can_act, stat=state)

    def _is_frozen(self, track: JobTrack, key: tuple[int, int]) -> bool:
        """Whether a rank (or the launcher) is frozen by a cgroup freezer: as the last census
        saw it, or frozen by this runner (its fault log) since that census began (a frozen
        process's /proc state does not show it, and the census that will is still to come)."""
        if self._frozen.get(key, False):
            return True
        return any(f.get("kind") == "freezer" and (f.get("pid"), f.get("starttime")) == key
                   and float(f.get("t") or 0) >= self._last_census for f in track.faults)

    @staticmethod
    def _helper_ticks(helpers: dict[int, int]) -> dict[int, int | None]:
        """The CPU ticks of a rank's helpers (pid -> start time), None for one gone."""
        from chaosgpu.node import process_activity

        ticks: dict[int, int | None] = {}
        for pid, start in helpers.items():
            activity = process_activity(pid, threads=False, sockets=False)
            alive = activity is not None and activity.get("starttime") == start \
                and activity.get("state") not in ("Z", "X")
            ticks[pid] = activity.get("cpu_ticks") if alive and activity else None
        return ticks

    def _check_holders(self, track: JobTrack, rank: RankTrack, now: float) -> None:
        """An ended rank's helpers (forked copies: DataLoader workers) that still hold its
        peer connections keep those connections open: its peers see no close and wait."""
        from chaosgpu.node import process_activity

        holders = []
        for pid, start in list(rank.helpers.items()):
            activity = process_activity(pid, threads=False, sockets=True)
            if activity is None or activity["starttime"] != start \
                    or activity["state"] in ("Z", "X"):
                del rank.helpers[pid]  # gone: never looked at again
                continue
            shared = set(activity.get("socket_inodes") or []) & set(rank.net_prev)
            if shared:
                holders.append({"pid": pid, "connections": len(shared)})
        track.update_holders(rank, holders, now)

    def _track_faulted_jobs(self, faults: list[dict[str, Any]], now: float) -> None:
        """The job this observer was asked for, not in the census but faulted by this runner,
        is still judged, from the fault's record and the pooled pidfds of its ranks: a gloo
        job whose survivors fail within ~0.1 s of a kill and whose launcher then exits is gone
        before a probe that follows the fault takes its first census."""
        if self.tracks or (self.job is None and self.tag is None):
            return
        for fault in faults:
            job_id = fault.get("job")
            if job_id and fault.get("pid") is not None and (
                    job_id == self.job if self.job is not None else fault.get("tag") == self.tag):
                if job_id not in self.tracks:
                    self.tracks[job_id] = JobTrack(job_id, self.window_s, now)
                    self.tracks[job_id].note(now, "faultlog", "not in the census: judged from "
                                             "chaosgpu's fault record and its ranks' pidfds")

    def _adopt_faulted(self, track: JobTrack, faults: list[dict[str, Any]], now: float) -> None:
        """A rank chaosgpu faulted before this observer saw it (killed, then reaped at once by
        its launcher) joins the job from the fault's record, so its end is accounted for; so do
        the peers the fault recorded (a gloo survivor fails and is reaped within ~0.1 s), whose
        ends their pooled pidfds still tell."""
        for fault in faults:
            if fault.get("job") != track.id or fault.get("pid") is None \
                    or fault.get("starttime") is None:
                continue
            launcher = fault.get("launcher")
            if track.launcher is None and isinstance(launcher, dict) \
                    and launcher.get("starttime") is not None:
                # the job's launcher as the fault saw it: its end (and exit status, through
                # the pidfd the fault pooled) is read from here on
                track.launcher = {"pid": launcher["pid"], "starttime": launcher["starttime"],
                                  "kind": launcher.get("kind")}
                track.launcher_alive = True
                if track.max_restarts is None:
                    track.max_restarts = launcher.get("max_restarts")
                track.note(now, "faultlog", f"launcher ({launcher.get('kind')}) is PID "
                           f"{launcher['pid']}, as chaosgpu's fault record names it")
            self._adopt_gone(track, fault, fault, faults, now)
            for peer in fault.get("peers") or []:
                self._adopt_gone(track, peer, fault, faults, now)

    def _adopt_gone(self, track: JobTrack, who: dict[str, Any], fault: dict[str, Any],
                    faults: list[dict[str, Any]], now: float) -> None:
        from chaosgpu.node import process_activity, process_state

        key = (who["pid"], who["starttime"])
        target = who is fault
        if key in track.ranks:
            known = track.ranks[key]
            if target and not known.live and not known.net_prev:  # seen only once ended
                known.helpers = known.helpers or {
                    int(pid): int(start) for pid, start in fault.get("own_helpers") or []}
                known.net_prev = {int(inode): 0 for inode in fault.get("peer_sockets") or []}
            return
        env = {"TORCHELASTIC_ERROR_FILE": who["error_file"]} if who.get("error_file") else {}
        state = process_state(who["pid"], starttime=who["starttime"])
        if state == "Z":  # ended, not reaped yet: its stat holds its wait status (a pidfd
            # tells it only once it is reaped)
            activity = process_activity(who["pid"], threads=False, sockets=False)
            if activity is not None and activity.get("starttime") == who["starttime"]:
                self._exits.note_zombie(who["pid"], who["starttime"], activity.get("exit_code"))
        if state is not None and state not in ("Z", "X"):
            if not target:  # alive, but this census did not list it: watched from here on
                track.ranks[key] = RankTrack(who.get("rank"), who["pid"], who["starttime"],
                                             who.get("restart_count"), now, last_seen=now,
                                             env=env)
            return
        seen_at = fault["t"] if target else now
        rank = RankTrack(who.get("rank"), who["pid"], who["starttime"], who.get("restart_count"),
                         seen_at, state="exited", last_seen=seen_at, exited_at=seen_at)
        rank.exit_seen_late = not target
        if target:  # its helpers and peer connections as the fault saw them: a helper still
            # holding one is found as for a rank this observer saw alive (_check_holders)
            rank.helpers = {int(pid): int(start) for pid, start in fault.get("own_helpers") or []}
            rank.net_prev = {int(inode): 0 for inode in fault.get("peer_sockets") or []}
        track.ranks[key] = rank
        exit_info = self._exits.exit_or_fault(who["pid"], who["starttime"], faults)
        error = None
        if env and exit_info.clean is not True:
            roots = ((f"/proc/{track.launcher['pid']}/root",) if track.launcher else ()) + ("",)
            error = read_error(who["pid"], env, None, roots)
        track.update_exit(rank, exit_info, error, now,
                          ended_at=self._exits.ended_at(rank.pid, rank.starttime))
        how = (f"{fault['kind']} by chaosgpu at {fault['t']:.3f}" if target else
               f"a peer of {rank_name(fault.get('rank'), fault.get('pid'))} at chaosgpu's "
               f"{fault['kind']}; ended before "
               f"this observer saw it, time is when it was seen gone")
        track.note(now, exit_info.source or "faultlog",
                   f"{rank.label_with_pid} ({how}) {exit_info.describe()}"
                   + (f": {error['text'].splitlines()[-1][:160]}" if error else ""), rank.rank)

    def _record_exit(self, track: JobTrack, rank: RankTrack, now: float) -> None:
        exit_info = self._exits.exit_or_fault(rank.pid, rank.starttime, track.faults)
        stderr = rank.stderr if rank.stderr and rank.stderr.startswith("/") else None
        if stderr is not None and any(other.stderr == stderr for other in track.ranks.values()
                                      if other is not rank):
            stderr = None  # a log shared with other ranks says nothing of this one's error
        roots = ((f"/proc/{track.launcher['pid']}/root",) if track.launcher else ()) + ("",)
        if exit_info.signal is not None:
            stderr = None  # a signalled process's last lines were not its own account
        error = read_error(rank.pid, rank.env, stderr, roots) if exit_info.clean is not True \
            else None
        track.update_exit(rank, exit_info, error, now,
                          ended_at=self._exits.ended_at(rank.pid, rank.starttime))
        track.note(now, exit_info.source or "proc", f"{rank.label} {exit_info.describe()}"
                   + (f": {error['text'].splitlines()[-1][:160]}" if error else ""), rank.rank)
        self._exits.forget(rank.pid, rank.starttime)

    def _take_stacks(self) -> None:
        owners: dict[int, tuple[JobTrack, RankTrack]] = {}
        for track in self.tracks.values():
            for rank in track.current_ranks():
                if rank.live:
                    owners[rank.pid] = (track, rank)
        if not owners:
            return
        samples = take_samples(owners, timeout_s=min(3.0, max(1.0, self.window_s)))
        now = time.time()
        for pid, sample in samples.items():
            track, rank = owners[pid]
            track.update_stack(rank, sample, now, gpu=pid in self._gpu_pids)

    def _read_flight_recorders(self) -> None:
        """Each live rank's Flight Recorder, where its job enables one: a dump asked for at
        most every REQUEST_EVERY_S, read as soon as a new one lands. A stream of its own: it
        waits neither for stacks (py-spy can take seconds) nor on them being asked for."""
        for track in self.tracks.values():
            for rank in track.current_ranks():
                if rank.live:
                    summary = flight_recorder.summary_for(rank.pid, rank.env, rank.rank)
                    if summary is not None:
                        track.update_flight_recorder(rank, summary, time.time())

    # ---------------------------------------------------------------- the loop

    def run(self, until: Callable[["Observer"], bool], timeout_s: float,
            min_s: float = 0.0, waiting_for: str = "a verdict on {jobs}") -> None:
        """Tick until `until(self)` holds (after at least `min_s`) or `timeout_s` passes;
        `waiting_for` says what for in the progress lines ({jobs}: the jobs watched)."""
        if timeout_s < 0 or min_s < 0:
            raise ValueError("timeout_s and min_s must be >= 0")
        start = time.monotonic()
        jobs = ("every job on this node" if self.all_jobs
                else f"job {self.job!r}" if self.job else f"the job tagged {self.tag!r}")
        waiting = Progress(waiting_for.format(jobs=jobs), timeout_s)
        while True:
            began = time.monotonic()
            self.tick()
            elapsed = time.monotonic() - start
            if (elapsed >= min_s and until(self)) or elapsed >= timeout_s:
                return
            waiting.update(self._seen_now)
            self.pause(self.tick_s - (time.monotonic() - began))

    def pause(self, seconds: float) -> None:
        """Wait between two ticks, noting meanwhile the moment each watched rank ends (its
        pidfd: ``ExitWatch.wait``)."""
        self._exits.wait(seconds)

    def _seen_now(self) -> str:
        """What the observed jobs are now, for a progress line."""
        if not self.tracks:
            return "no job seen now"
        return "; ".join(f"{track.id}: {track.verdict} ({track.reason})"
                         for track in self.tracks.values())


def _partitions() -> list[dict[str, Any]]:
    from chaosgpu.network import partitions

    try:
        return partitions.active()
    except OSError:  # no readable state directory (another user's): no partition of ours
        return []


def observe(job: str | None = None, tag: str | None = None,
            until: Callable[[Observer], bool] | None = None, timeout_s: float = 10.0,
            min_s: float = 0.0, window_s: float = DEFAULT_WINDOW_S,
            appear_s: float = 5.0, missing_ok: bool = False, stacks: bool = True,
            all_jobs: bool = False, waiting_for: str = "a verdict on {jobs}") -> Observer:
    """Watch a job (by id or tag; every job with `all_jobs`) until `until` holds or
    `timeout_s` passes. The job must appear within `appear_s`, or JobError is raised (with
    `missing_ok` the observer is returned with no job). Returns the observer (its `tracks`)."""
    observer = Observer(job, tag, window_s=window_s, stacks=stacks, all_jobs=all_jobs)
    try:
        deadline = time.monotonic() + appear_s
        while True:
            observer.tick()
            if observer.tracks or all_jobs:
                break
            if time.monotonic() >= deadline:
                if missing_ok:
                    return observer
                raise JobError(not_found_message(job, tag, observer))
            observer.pause(observer.tick_s)
        observer.run(until or (lambda o: False), timeout_s, min_s, waiting_for)
        return observer
    finally:
        observer.close()


def not_found_message(job: str | None, tag: str | None, observer: Observer) -> str:
    """Why a job selection matched nothing, with what to check (an id or a tag)."""
    what = f"job {job!r}" if job else f"a job tagged {tag!r}"
    check = "the id" if job else "the tag (CHAOSGPU_TAG in the ranks' environment)"
    message = (f"{what} is not running on this node (no rank or launcher of it in the "
               f"census); check {check} with `chaosgpu jobs`")
    if observer.visibility:
        message += "; " + observer.visibility
    if os.geteuid() != 0 and not observer.visibility:
        message += "; as non-root, other users' jobs are invisible"
    return message
