"""Chaos Toolkit actions on distributed-training jobs: kill, freeze, resume, partition or fail
one rank, and clean a hung job up (a rollback).

A job is named by its id (`chaosgpu jobs` lists it: TORCHELASTIC_RUN_ID, CHAOSGPU_JOB, or
MASTER_ADDR:MASTER_PORT, or the address its ranks dialled for a job found by its store's
connections) or by the tag its ranks carry; when both are given they must agree. This
module owns these faults; finding ranks is chaosgpu.job.observe's selection, every signal goes
through the terminate primitive (chaosgpu.process.terminate: pidfds, identity and refusal
checks), and a fault that sent nothing fails (raises) with the kernel's or the scope's reason.
Each fault is recorded in chaosgpu.faultlog (and on the timeline) with the target's PID and
start time, so the observed verdict can say what chaosgpu did and time its effect. Each
function has a deadline.
"""

import logging
import os
import time
from typing import Any, Dict, Optional, Union

from chaosgpu import faultlog
from chaosgpu.arguments import (
    MISSING_OK,
    NAME,
    POSITIVE_SECONDS,
    RANK,
    SECONDS,
    TAG,
    Rule,
    checked,
    missing_advice,
    missing_allowed,
    one_of,
)
from chaosgpu.errors import ActivityError
from chaosgpu.job import hang
from chaosgpu.job.observe import JobError, check_selector, select_jobs, visibility_note
from chaosgpu.job.verdict import rank_with_pid
from chaosgpu.process.actions import (
    FREEZE_KINDS,
    FREEZE_METHOD,
    STOP_WAIT_S,
    _ends,
    _freeze_with_freezer,
    _not_frozen_after_all,
    _note_freezing,
    _signal_name,
    _stops,
    _thaw_freezer_groups,
    freeze_not_held,
    send,
    wait_gone,
)
from chaosgpu.process.actions import _frozen_by_this_run as _not_resumed_yet
from chaosgpu.process.terminate import NULL_SIGNAL, not_stopped
from chaosgpu.scope import remember, seen_in_this_run, validate_scope

__all__ = ["kill_rank", "freeze_rank", "resume_rank", "fail_rank", "cleanup_hung_job"]

logger = logging.getLogger("chaostoolkit")



def _sendable_signals() -> tuple[str, ...]:
    """The signals the one signalling program sends (actions/signal_processes.py's SIGNALS):
    kill_rank takes no other (it once took SIGSEGV while that program refused it; SIGSEGV is
    one of them now)."""
    from chaosgpu.intarget import load

    return tuple(load("actions", "signal_processes").SIGNALS)


SIGNALS = _sendable_signals()
#: fail_rank's ways to fail a rank
FAIL_HOWS = ("auto", "kill", "freeze", "partition", "node-loss")


def _choice(values: tuple[str, ...]) -> Rule:
    """The rule "one of `values`" (chaosgpu.arguments.one_of: checked by the activity, and by
    `chaosgpu validate` and the timeline control before a run: a `--var fault:str=nodeloss` is
    refused before the method starts the job)."""
    return one_of(values)


SIGNAL_NAME = _choice(SIGNALS)
FAIL_HOW = _choice(FAIL_HOWS)
# freeze_rank's `method` is freeze_processes' own rule, chaosgpu.process.actions.FREEZE_METHOD.


#: rank="any": the last live rank in the census's order (ranks by number, then those whose
#: number no process shows, by PID): the highest number, or the newest unnumbered process.
#: For resume_rank: the rank this run froze in the job.
ANY_RANK = "any"


# The fault kinds that freeze a process (faultlog), what resume_rank may undo, are
# chaosgpu.process.actions.FREEZE_KINDS: a stop by any stop signal (SIGSTOP, SIGTSTP, SIGTTIN,
# SIGTTOU: kill_rank(signal="SIGTSTP") is recorded under the signal's name) or the freezer.


def _frozen_by_this_run(live: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Of a job's `live` rank entries, the one this runner froze last (a stop signal or the
    freezer), by PID and start time, one still frozen by this run (not resumed since) before
    one it resumed already; None when none."""
    by_key = {(r.get("pid"), r.get("starttime")): r for r in live}
    outstanding = _not_resumed_yet([r for r in live if r.get("starttime") is not None])
    frozen = [by_key[key] for fault in reversed(faultlog.recent())
              if fault.get("kind") in FREEZE_KINDS
              and (key := (fault.get("pid"), fault.get("starttime"))) in by_key]
    return next((r for r in frozen if (r["pid"], r["starttime"]) in outstanding),
                frozen[0] if frozen else None)


def _pick_rank(found: dict[str, Any], rank: Union[int, str],
               frozen: bool = False) -> dict[str, Any] | None:
    """The census entry of `rank` in the job `found`: that number's live process; for "any",
    the rank this run froze when `frozen`, else the last live rank (see ANY_RANK), a running
    one before a stopped or frozen one."""
    live = [r for r in found.get("ranks") or [] if r.get("state") not in ("zombie", "missing")
            and r.get("pid") is not None]
    if rank != ANY_RANK:
        return next((r for r in live if r.get("rank") == rank), None)
    if frozen:
        return _frozen_by_this_run(live)
    running = [r for r in live if r.get("state") == "alive"] or live
    return running[-1] if running else None


def rank_process(job: str | None, tag: str | None, rank: Union[int, str], deadline_s: float,
                 frozen: bool = False
                 ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], int | None]:
    """Find the live process of rank `rank` (a number, or "any": see ANY_RANK) of the job
    named by id or tag, waiting up to `deadline_s` for it; return (census, job, the rank's
    census process, its number: None where no process shows it). Every fault aimed at a rank
    (kill, freeze, partition, in-process GPU faults) finds it here. Raises JobError naming
    what is missing."""
    RANK.require("rank", rank)
    check_selector(job, tag)
    end = time.monotonic() + deadline_s
    while True:
        census = hang._census(gpu=False)
        matches = select_jobs(census, job, tag)
        if len(matches) > 1:
            raise JobError(f"tag {tag!r} matches several jobs {[j['id'] for j in matches]}: "
                           "name one with job=<id>")
        found = matches[0] if matches else None
        if found is not None:
            entry = _pick_rank(found, rank, frozen)
            if entry is not None:
                proc = next(p for p in census["processes"] if p["pid"] == entry["pid"])
                return census, found, proc, entry.get("rank")
        if time.monotonic() >= end:
            what = f"job {job!r}" if job else f"the job tagged {tag!r}"
            if found is None:
                note = visibility_note(census)
                raise JobError(f"{what} is not running on this node (no such job in the census)"
                               + (f"; {note}" if note else ""))
            ranks = [(r.get("rank"), r.get("state")) for r in found["ranks"]]
            if rank == ANY_RANK:
                raise JobError(f"{what} has no live rank (ranks: {ranks})" if not frozen else
                               f"no live rank of {what} was frozen by this run (ranks: {ranks}):"
                               " this run resumes only what it froze (a process stopped "
                               "elsewhere is resumed by signal_processes with SIGCONT and "
                               "its own scope)")
            hidden = [r.get("pid") for r in found["ranks"] if r.get("rank") is None
                      and r.get("pid") is not None]
            raise JobError(f"{what} has no live process for rank {rank} (ranks: {ranks})"
                           + (f"; the numbers of ranks {hidden} (PIDs) are not visible from "
                              "outside (no RANK in their environment: torch.multiprocessing."
                              "spawn passes it as an argument): name one with rank=\"any\", "
                              "or target one by PID with a process fault and the scope "
                              "{\"pids\": [...]}" if hidden else ""))
        time.sleep(0.05)


def watch_peers(census: dict[str, Any], found: dict[str, Any],
                proc: dict[str, Any]) -> list[dict[str, Any]]:
    """Keep a pooled pidfd on the faulted rank and on every other live rank of its job, so
    that how each of them ends stays readable by an observer started later (a gloo survivor
    of a killed peer fails and is reaped by its launcher within ~0.1 s); return the peers as
    the fault's record keeps them (rank, pid, start time, restart count, error file)."""
    from chaosgpu.job.exits import keep_watch

    keep_watch(proc["pid"], proc["starttime"])
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    peers = []
    for entry in found.get("ranks") or []:
        peer = by_pid.get(entry.get("pid"))
        if peer is None or peer["pid"] == proc["pid"] or peer.get("zombie") \
                or entry.get("state") in ("zombie", "missing"):
            continue
        if keep_watch(peer["pid"], peer["starttime"]):
            peers.append({"rank": entry.get("rank"), "pid": peer["pid"],
                          "starttime": peer["starttime"],
                          "restart_count": entry.get("restart_count"),
                          "error_file": (peer.get("env") or {}).get("TORCHELASTIC_ERROR_FILE")})
    return peers


def rank_connections(census: dict[str, Any], found: dict[str, Any],
                     proc: dict[str, Any]) -> dict[str, Any]:
    """What a rank about to be faulted holds, as its fault records it for an observer started
    later: `peer_sockets`, the socket inodes of its connections to other ranks of the job on
    this node, and `own_helpers`, its forked copies ([pid, start time]: DataLoader workers)
    that inherited them; once it ends, a helper still holding one keeps that connection open,
    and its peers see no close. Empty where the node's TCP table cannot be read."""
    from chaosgpu.node import process_activity, tcp_sockets

    own: dict[str, Any] = next((r for r in found.get("ranks") or []
                                if r.get("pid") == proc["pid"]), {})
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    helpers = [[pid, by_pid[pid]["starttime"]] for pid in own.get("helpers") or []
               if pid in by_pid]
    try:
        table = tcp_sockets()
    except OSError:
        return {"peer_sockets": [], "own_helpers": helpers}

    def inodes(pid: int) -> list[int]:
        activity = process_activity(pid, threads=False, sockets=True)
        return list((activity or {}).get("socket_inodes") or [])

    others = {table[inode]["local"] for entry in found.get("ranks") or []
              if entry.get("pid") not in (None, proc["pid"])
              for inode in inodes(entry["pid"]) if "local" in table.get(inode, {})}
    peer = [inode for inode in inodes(proc["pid"])
            if table.get(inode, {}).get("state") == "ESTABLISHED"
            and table[inode].get("remote") in others]
    return {"peer_sockets": sorted(peer), "own_helpers": helpers}


def job_launcher(found: dict[str, Any]) -> dict[str, Any] | None:
    """The job's launcher as a fault records it ({pid, starttime, kind, max_restarts}), with a
    pooled pidfd on it so that how it ended stays readable by a probe that follows (torchrun's
    exit status is the job's outcome once its ranks are gone, a later attempt's included);
    None when the job has no launcher."""
    from chaosgpu.job.exits import keep_watch

    pid, starttime = found.get("launcher_pid"), found.get("launcher_starttime")
    if pid is None or starttime is None:
        return None
    keep_watch(pid, starttime)
    return {"pid": pid, "starttime": starttime, "kind": found.get("launcher"),
            "max_restarts": found.get("max_restarts")}


def job_helpers(census: dict[str, Any], found: dict[str, Any]) -> list[list[int]]:
    """The [pid, start time] of every rank's helpers (its forked copies: DataLoader workers),
    kept with a fault so that an observer started later never takes one left behind by its
    rank for a rank."""
    by_pid = {p["pid"]: p for p in census.get("processes") or []}
    return [[pid, by_pid[pid]["starttime"]] for entry in found.get("ranks") or []
            for pid in entry.get("helpers") or [] if pid in by_pid]


def _signal_process(census: dict[str, Any], found: dict[str, Any], rank: int | None,
                    proc: dict[str, Any], signal: str, wait_s: float) -> dict[str, Any]:
    """Send `signal` to the rank's process; raise unless the kernel accepted it."""
    peers = watch_peers(census, found, proc)
    held = rank_connections(census, found, proc) if _ends(signal) else {}
    # a stop is noted on disk before it is sent and watched: a runner killed meanwhile leaves
    # a trace for `chaosgpu cleanup`
    noted = _note_freezing([proc], _signal_name(signal)) if _stops(signal) else []
    report = send([proc], signal, {"job": found["id"]}, STOP_WAIT_S)
    result = report["results"][0]
    if result["result"] != "sent" or result.get("stop_discarded"):
        _not_frozen_after_all(noted, [])
    out = {"job": found["id"], "rank": rank, "pid": proc["pid"], "signal": report["signal"],
           "result": result["result"], "reason": result.get("reason"),
           "sent_at": result.get("sent_at"), "released_from": result.get("released_from")}
    if "stopped" in result:  # a stop signal, watched until the rank is seen stopped
        out["stopped"] = result["stopped"]
    if result["result"] != "sent":
        raise PermissionError(f"{signal} was not sent to {rank_with_pid(rank, proc['pid'])}: "
                              f"{result['result']}: {result.get('reason')}")
    if result.get("stop_discarded"):  # lost for good (ignored, or an orphaned group): no
        # freeze of this run to record; resume_rank must leave a later stop by someone else
        raise ActivityError(f"{signal} was sent to {rank_with_pid(rank, proc['pid'])}, but it "
                            f"will never stop it: {result.get('not_stopped')}; not recorded "
                            "as this run's freeze")
    faultlog.record(signal, job=found["id"], tag=found.get("tag"), rank=rank, pid=proc["pid"],
                    starttime=proc["starttime"], restart_count=_restart_count(found, proc),
                    peers=peers, helpers=job_helpers(census, found),
                    launcher=job_launcher(found), **held)
    missed = not_stopped(report)
    if missed:  # recorded first: the rollback resumes the rank if the stop lands later
        raise ActivityError(f"{signal} was sent to {rank_with_pid(rank, proc['pid'])}, but it "
                            f"was not seen stopped within {STOP_WAIT_S:g} s: {missed[0]}")
    if wait_s > 0 and signal in ("SIGKILL", "SIGTERM"):
        out["wait"] = wait_gone([{"pid": proc["pid"], "starttime": proc["starttime"]}], wait_s)
        if signal == "SIGKILL" and not out["wait"].get("all_gone"):  # lives on: no kill
            raise ActivityError(f"{signal} was sent to {rank_with_pid(rank, proc['pid'])}, but "
                                f"it was still alive after {wait_s:g} s (wait_s): "
                                f"{out['wait']}")
    return out


def _restart_count(found: dict[str, Any], proc: dict[str, Any]) -> int | None:
    entry: dict[str, Any] = next(
        (r for r in found.get("ranks") or [] if r.get("pid") == proc["pid"]), {})
    value = entry.get("restart_count")
    return int(value) if isinstance(value, int) else None


@checked(rank=RANK, wait_s=SECONDS, signal=SIGNAL_NAME, job=NAME, tag=TAG)
def kill_rank(rank: Union[int, str], job: Optional[str] = None, tag: Optional[str] = None,
              signal: str = "SIGKILL", wait_s: float = 2.0,
              configuration: Optional[Dict[str, Any]] = None,
              secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Kill one rank of a training job (by job id or the ranks' tag) with `signal` through a
    pidfd: SIGKILL (a crash) by default, SIGTERM for a polite stop, SIGSEGV or SIGBUS for a
    crash as a segfault or a bus error shows it (core dumped), or any other the signalling
    program sends (SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2, SIGABRT, SIGALRM, SIGPIPE; the stop
    signals SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU; SIGCONT). After a SIGKILL or SIGTERM it waits
    up to `wait_s` for the rank to die (another signal is sent, not waited for). The other
    ranks are untouched: gloo peers see the connection close and fail fast; NCCL peers hang
    in their next collective. `rank` is a number, or "any": the last
    live rank (the highest number; where no process shows its number, as in a
    torch.multiprocessing.spawn or file:// job, the newest such rank); the result names the
    rank and PID hit. Fails when the signal could not be sent (gone, refused by the scope
    rules, or by the kernel: the reason is given), when a SIGKILL waited for (`wait_s` > 0)
    left the rank alive, or when a stop signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) left it
    running for STOP_WAIT_S (5 s): the result's `stopped` says it was seen stopped, and the
    failure why not (a tracer, SIGTSTP, SIGTTIN or SIGTTOU handled or ignored, an orphaned
    process group)."""
    census, found, proc, number = rank_process(job, tag, rank, 2.0)
    return _signal_process(census, found, number, proc, signal, float(wait_s))


@checked(rank=RANK, method=FREEZE_METHOD, job=NAME, tag=TAG)
def freeze_rank(rank: Union[int, str], job: Optional[str] = None, tag: Optional[str] = None,
                method: str = "sigstop", configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Freeze one rank of a training job (SIGSTOP, or the cgroup freezer with
    method="freezer"): a peer that stops answering while its connections stay open, so its
    peers wait in their next collective. `rank` is a number or "any" (as kill_rank takes it).
    Resume it with resume_rank, or clean the job up with cleanup_hung_job. The freeze must be
    seen to hold within 5 s (STOP_WAIT_S: the rank in state T, or its freezer group FROZEN),
    else the activity fails and says why (a tracer holding the rank, an uninterruptible
    call); what was done is recorded first, so resume_rank undoes it."""
    census, found, proc, number = rank_process(job, tag, rank, 5.0)
    if method == "sigstop":
        out = _signal_process(census, found, number, proc, "SIGSTOP", 0)
    else:
        # The refusal rules hold for the freezer too: checked with the null signal (a SIGCONT
        # would resume a rank stopped on purpose).
        check = send([proc], NULL_SIGNAL, {"job": found["id"]})["results"][0]
        if check["result"] != "sent":
            raise PermissionError(f"{rank_with_pid(number, proc['pid'])} may not be frozen: "
                                  f"{check['result']}: {check.get('reason')}")
        version = "auto" if method == "freezer" else method[len("freezer-"):]
        which = f"rank{number}" if number is not None else f"pid{proc['pid']}"
        _note_freezing([proc], "freezer")  # before the wait for FROZEN (see _signal_process)
        frozen = _freeze_with_freezer({"job": f"{found['id']}-{which}"}, [proc], STOP_WAIT_S,
                                      version)
        faultlog.record("freezer", job=found["id"], tag=found.get("tag"), rank=number,
                        pid=proc["pid"],
                        starttime=proc["starttime"], restart_count=_restart_count(found, proc),
                        peers=watch_peers(census, found, proc),
                        helpers=job_helpers(census, found), launcher=job_launcher(found))
        missed = freeze_not_held(frozen, STOP_WAIT_S)
        if missed:  # recorded first: resume_rank thaws what holds later
            raise ActivityError(f"the freeze of {rank_with_pid(number, proc['pid'])} did not "
                                f"hold: {missed[0]}")
        out = {"job": found["id"], "rank": number, "pid": proc["pid"], "result": "frozen",
               **frozen}
    out["method"] = method
    return out


@checked(rank=RANK, job=NAME, tag=TAG)
def resume_rank(rank: Union[int, str], job: Optional[str] = None, tag: Optional[str] = None,
                configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Resume a rank this run froze (thaw its freezer cgroup, SIGCONT through a pidfd), never
    one stopped by someone else. `rank` is a number, or "any": the rank of this job that this
    run froze last (by PID and start time). Where this run froze no rank at all (a run
    interrupted before its method) there is nothing to undo: `"result": "none frozen by this
    run"`; a numbered rank this run did not freeze is left as it is: `"result": "not frozen
    by this run"` (its state in `state`); one this run resumed since (the method resumed it,
    this is the rollback) is not resumed again: `"result": "already resumed by this run"`, so
    a stop by someone else in between stays. Nothing is sent then. A rank this run froze whose
    job the census no longer shows (its peers ended, and a job found by its connections goes
    with them) is still resumed, found from the fault log by PID and start time: the rollback
    never leaves this run's freeze behind; one that has ended since is `"result": "ended since
    it was frozen: nothing left to resume"`. Fails when the SIGCONT could not be sent, or, for
    "any", when this run froze no rank of the job named."""
    if rank == ANY_RANK and not any(f.get("kind") in FREEZE_KINDS for f in faultlog.recent()):
        check_selector(job, tag)
        return {"job": job, "tag": tag, "rank": None, "pid": None,
                "result": "none frozen by this run", "thawed_cgroups": []}
    try:
        _, found, proc, number = rank_process(job, tag, rank, 5.0, frozen=True)
        job_id = found["id"]
    except JobError:
        # the job is no longer what the census shows (its other ranks ended: a spawn job found
        # by its connections leaves the census with them), but the rank this run froze may
        # still be stopped: the fault log names it, by PID and start time
        left = _frozen_left_by_this_run(job, tag, rank)
        if left is None:
            raise
        proc, number, job_id = left
        if proc["state"] in (None, "Z", "X"):
            return {"job": job_id, "rank": number, "pid": proc["pid"],
                    "result": "ended since it was frozen: nothing left to resume",
                    "thawed_cgroups": []}
    if not any(f.get("kind") in FREEZE_KINDS for f in faultlog.for_pid(proc["pid"],
                                                                      proc["starttime"])):
        return {"job": job_id, "rank": number, "pid": proc["pid"],
                "result": "not frozen by this run", "state": proc.get("state"),
                "thawed_cgroups": []}
    key = (proc["pid"], proc["starttime"])
    if key not in _not_resumed_yet([proc]):  # this run resumed it since (the method did):
        # a stop seen now is someone else's (an operator, a debugger), left as found
        return {"job": job_id, "rank": number, "pid": proc["pid"],
                "result": "already resumed by this run", "state": proc.get("state"),
                "thawed_cgroups": []}
    thawed = _thaw_freezer_groups({proc["pid"]})
    report = send([proc], "SIGCONT", {"job": job_id})
    result = report["results"][0]
    if result["result"] != "sent":
        raise PermissionError(f"SIGCONT was not sent to {rank_with_pid(number, proc['pid'])}: "
                              f"{result['result']}: {result.get('reason')}")
    faultlog.resumed([key])  # resume_processes and a later resume_rank send nothing
    return {"job": job_id, "rank": number, "pid": proc["pid"], "result": "sent",
            "thawed_cgroups": thawed}


def _frozen_left_by_this_run(job: str | None, tag: str | None, rank: Union[int, str]
                             ) -> tuple[dict[str, Any], int | None, str] | None:
    """The process this run froze last as rank `rank` ("any": whichever) of the job named by
    id or tag, from the fault log alone (same PID and start time): one that lives, not resumed
    since, before one this run resumed already, before one that has ended (its entry's
    `state` None, Z or X): (its census-like entry, its rank number, the job's id); None when
    this run froze no such rank."""
    from chaosgpu.node import process_state

    resumed = ended = None
    for fault in reversed(faultlog.recent()):
        if fault.get("kind") not in FREEZE_KINDS or not fault.get("job") \
                or (job is not None and fault["job"] != job) \
                or (tag is not None and fault.get("tag") != tag) \
                or (rank != ANY_RANK and fault.get("rank") != rank):
            continue
        pid, starttime = fault.get("pid"), fault.get("starttime")
        if not isinstance(pid, int) or not isinstance(starttime, int):
            continue
        state = process_state(pid, starttime=starttime)
        found = ({"pid": pid, "starttime": starttime, "state": state}, fault.get("rank"),
                 str(fault["job"]))
        if state is None or state in ("Z", "X"):
            ended = ended or found  # nothing of it left frozen
        elif fault["seq"] > faultlog.resumed_at((pid, starttime)):
            return found
        else:
            resumed = resumed or found
    return resumed or ended


def _partition_unavailable() -> Optional[str]:
    """Why this runner cannot partition a rank (None when it can)."""
    from chaosgpu.network.partitions import PartitionError, nft_path

    if os.geteuid() != 0:
        return "chaosgpu is not root (nftables needs CAP_NET_ADMIN)"
    try:
        nft_path()
    except PartitionError as error:
        return str(error)
    return None


@checked(rank=RANK, how=FAIL_HOW, job=NAME, tag=TAG)
def fail_rank(rank: Union[int, str], job: Optional[str] = None, tag: Optional[str] = None,
              how: str = "auto", configuration: Optional[Dict[str, Any]] = None,
              secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Make one rank fail: how="kill" (SIGKILL: gloo peers fail fast, NCCL peers hang),
    "freeze" (SIGSTOP: the rank stops answering), "partition" (its TCP traffic is dropped
    silently while it lives), "node-loss" (partition, then SIGKILL: its death is invisible to
    its peers, as when a host is lost), or "auto": kill under NCCL, node-loss under gloo (a
    gloo peer of a killed rank sees the connection close and fails, so the hang needs a
    silent loss), or freeze under gloo where a partition cannot be made (not root, or no
    nftables; the result's `note` says so). `rank` is a number or "any" (as kill_rank picks
    it). The result says which backend was seen, what was done, and the rank and PID hit."""
    census, found, proc, number = rank_process(job, tag, rank, 5.0)
    backend = hang.job_backend(census, found)
    chosen = how if how != "auto" else ("kill" if backend == "nccl" else "node-loss")
    note = None
    if how == "auto" and chosen == "node-loss":
        why_not = _partition_unavailable()
        if why_not:
            chosen = "freeze"
            note = (f"a node loss needs a network partition, and {why_not}: the rank was "
                    "frozen instead (its peers hang the same way, and it stays alive)")
            logger.warning("chaosgpu: %s", note)
    if chosen == "kill":
        out = _signal_process(census, found, number, proc, "SIGKILL", 2.0)
    elif chosen == "freeze":
        out = _signal_process(census, found, number, proc, "SIGSTOP", 0)
    else:
        from chaosgpu.network.actions import partition_found_rank

        out = partition_found_rank(census, found, proc, number, then_kill=chosen == "node-loss")
    out.update(backend=backend, how=how, done=chosen, note=note)
    logger.info("chaosgpu: failed %s of %s (%s) by %s", rank_with_pid(number, proc["pid"]),
                found["id"], backend, chosen)
    return out


@checked(grace_s=SECONDS, deadline_s=POSITIVE_SECONDS, job=NAME, tag=TAG, missing_ok=MISSING_OK)
def cleanup_hung_job(job: Optional[str] = None, tag: Optional[str] = None,
                     grace_s: float = 5.0, deadline_s: float = 30.0,
                     missing_ok: Union[bool, str] = "before-method",
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Roll back a hung job: thaw frozen ranks (a frozen process ignores SIGKILL until thawed),
    SIGTERM every remaining process of the job (ranks, launcher, and with a tag everything
    carrying it), wait `grace_s`, SIGKILL what is left, wait until they are dead and NVML no
    longer lists them (when NVML is available), all within `deadline_s`. Idempotent: a second
    call, or one for a job this run met that ended, finds nothing and says so; but a job id or
    tag this run never met that matches nothing (a typo: the real job would be left running)
    fails, naming the jobs and tags on the node, unless `missing_ok` is true (or
    "before-method", the default, before the method starts). The network partitions this run
    made against the job are healed once their targets have ended (`healed_partitions`).
    Reports what it removed and, honestly, what it could not."""
    check_selector(job, tag)
    missing_allowed(missing_ok, True)  # a bad value is refused before anything is touched
    report = hang.cleanup(job=job, tag=tag, grace_s=grace_s, deadline_s=deadline_s)
    report["healed_partitions"] = _heal_partitions_of(report.get("job") or job, tag)
    # The tag decides when given (a job given with it must agree); else the job id.
    kind, value = ("tag", tag) if tag is not None else ("job", str(job))
    if report["found"]:
        remember(kind, value)  # found once: a later call that finds nothing is fine
    elif not missing_allowed(missing_ok, seen_in_this_run(validate_scope({kind: value}))):
        raise JobError(_never_met(kind, value, missing_ok))
    return report


def _heal_partitions_of(job_id: Optional[str], tag: Optional[str]) -> list[dict[str, Any]]:
    """Heal the network partitions this run made against the job (`job_id` or `tag`: the fault
    log's partition records) whose targets have all ended: their connection rules would outlive
    the job (the partitions' liveness check withdraws only the listening rules). A partition
    with a live target stays. Returns what was healed."""
    from chaosgpu.network import partitions

    made = {f.get("partition") for f in faultlog.recent() if f.get("kind") == "partition"
            and f.get("partition") and ((job_id is not None and f.get("job") == job_id)
                                        or (tag is not None and f.get("tag") == tag))}
    healed = []
    for record in partitions.active():
        if record["id"] not in made or partitions.targets_alive(record):
            continue
        try:
            healed.append(partitions.remove(record["id"]))
        except partitions.PartitionError as error:
            healed.append({"id": record["id"], "removed": False, "error": str(error)})
    return healed


def _never_met(kind: str, value: str, missing_ok: Any) -> str:
    """The error for a cleanup selection that matches nothing and that this run never met,
    with the jobs and tags on the node now (what was probably meant)."""
    census = hang._census(gpu=False)
    jobs = sorted(f"{j.get('id')} (tag {j.get('tag')!r})" for j in census.get("jobs") or [])
    tags = sorted({str(p["tag"]) for p in census.get("processes") or [] if p.get("tag")})
    note = visibility_note(census)
    return (f"{kind} {value!r} matches no process, and this run never met it (no workload it "
            f"started, no process or job seen carrying it): a typo? Jobs on this node: "
            f"{jobs or 'none'}; tags carried: {tags or 'none'}" + (f"; {note}" if note else "")
            + ". A job that may be absent " + missing_advice(missing_ok))
