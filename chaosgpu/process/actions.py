"""Chaos Toolkit actions on the processes of a declared scope: signal, freeze, resume.

This module owns the process faults. Which processes a scope covers is decided by
chaosgpu.scope (from the census); every signal is sent and every exit waited for by the terminate
primitive (`actions/signal_processes.py`, typed in chaosgpu.process.terminate: pidfd +
start-time identity + refusal rules, and which signals stop or end a process); the freezers are
chaosgpu.process.freezer. Each process a freeze stops (freeze_processes, or any stop signal sent
by signal_processes) is recorded in chaosgpu.faultlog, and a resume undoes only what this run
froze, never a stop by someone else. It must not read
/proc itself nor send a signal or wait for an exit any other way. Every function that waits
has its own deadline.
"""

import logging
import time
from typing import Any, Dict, Optional, Union

from chaosgpu import faultlog, freezelog
from chaosgpu.arguments import (
    BOOL,
    MISSING_OK,
    POSITIVE_SECONDS,
    SECONDS,
    Rule,
    checked,
    one_of,
)
from chaosgpu.errors import ActivityError
from chaosgpu.process import freezer
from chaosgpu.process.terminate import (
    NULL_SIGNAL,
    Target,
    not_stopped,
    release_frozen,
    wait_exits,
)
from chaosgpu.scope import (
    SCOPE,
    ScopeError,
    describe_scope,
    resolve_observed,
    resolve_scope_detail,
    validate_scope,
)

__all__ = ["signal_processes", "freeze_processes", "resume_processes"]

logger = logging.getLogger("chaostoolkit")

FREEZE_METHODS = ("sigstop", "freezer", "freezer-v1", "freezer-v2")
#: The rule of a freeze's `method` (freeze_processes, chaosgpu.job.actions.freeze_rank).
FREEZE_METHOD = one_of(FREEZE_METHODS)


def _signaller() -> Any:
    """The one signalling program (actions/signal_processes.py), loaded once."""
    from chaosgpu.intarget import load

    return load("actions", "signal_processes")


#: The fault log's kinds for a stop by signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU), as the
#: signalling program names them (its STOP_SIGNALS): a SIGCONT resumes it.
STOP_KINDS = tuple(_signaller().STOP_SIGNALS)
#: How long a stop signal's targets are watched until they are seen stopped (state T), by
#: default: the signalling program's STOP_WAIT_S.
STOP_WAIT_S = float(_signaller().STOP_WAIT_S)
#: The fault log's kinds for a freeze: what resume_processes may undo.
FREEZE_KINDS = (*STOP_KINDS, "freezer")



def _parse_signal(name: Any) -> int:
    """The number of signal `name`, as the one signalling program reads it (its parse_signal:
    SignalInputError, a ValueError, for a name it does not send)."""
    return int(_signaller().parse_signal(name))


#: The rule of signal_processes' `signal`: the signalling program's own parsing (a name such as
#: "SIGKILL" or "KILL", any case, of its SIGNALS, or "0", the null signal: a check only; any
#: other name, a misspelled "SIGALARM" too, is refused with the list it accepts).
SIGNAL = Rule.by_check("a signal the signalling program sends", _parse_signal)


def _census_program() -> Any:
    from chaosgpu.intarget import load

    return load("probes", "node_census")


def is_alive(pid: int, starttime: int | None) -> bool:
    """Whether the process (PID + start time) still runs: not exited, not reused, not a zombie."""
    census = _census_program()
    if starttime is not None and census.process_starttime(pid) != starttime:
        return False
    state = census.process_state(pid)
    return state is not None and state not in ("Z", "X")


def wait_gone(targets: list[dict[str, Any]], deadline_s: float) -> dict[str, Any]:
    """Wait until no target ({"pid", "starttime"}) is alive (zombies count as dead), at most
    `deadline_s` seconds, on pidfds (the terminate primitive's one wait)."""
    started = time.monotonic()
    left = wait_exits([Target(int(t["pid"]), int(t["starttime"])) for t in targets
                       if t.get("starttime") is not None], deadline_s)
    return {"all_gone": not left, "waited_s": round(time.monotonic() - started, 4),
            "still_alive": [t.pid for t in left]}


def send(processes: list[dict[str, Any]], signal: str, scope: dict[str, Any] | None = None,
         wait_stopped_s: float = 0.0) -> dict[str, Any]:
    """Send `signal` to census processes through the in-target program; return its report. A
    process in one of chaosgpu's frozen cgroups is let out of it first when the signal ends
    processes (its result has `released_from`; chaosgpu.process.terminate.release_frozen), and
    one in a frozen cgroup chaosgpu did not make is refused ("frozen"). With a stop signal and
    `wait_stopped_s` > 0 each process sent it is watched until it is stopped, at most that
    long: its result says `stopped`, and when not, why (`not_stopped`)."""
    scope = scope or {}
    targets = [{"pid": p["pid"], "starttime": p.get("starttime")} for p in processes]
    return _signaller().signal_targets(  # type: ignore[no-any-return]
        targets, signal,
        allow_other_users=bool(scope.get("include_other_users")),
        allow_ns_init=bool(scope.get("include_ns_init")), release=release_frozen,
        wait_stopped_s=wait_stopped_s)


@checked(scope=SCOPE, signal=SIGNAL, wait_gone_s=SECONDS, require_match=BOOL,
         wait_stopped_s=POSITIVE_SECONDS)
def signal_processes(scope: Dict[str, Any], signal: str = "SIGKILL",
                     wait_gone_s: float = 0.0, require_match: bool = True,
                     wait_stopped_s: float = STOP_WAIT_S,
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Send a signal to every process of a declared scope (`{"tag": ...}`, `{"sandbox": ...}`,
    `{"job": ...}`, `{"pids": [...]}`): one of SIGKILL, SIGTERM, SIGSTOP, SIGCONT, SIGINT,
    SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2, SIGABRT, SIGTSTP, SIGTTIN, SIGTTOU, SIGALRM, SIGPIPE,
    SIGSEGV, SIGBUS (with or without "SIG", any case), or "0" (checks only; any other name is
    refused before anything is sent), through pidfds after checking each process's identity;
    the host's PID 1, the runner, kernel threads, other users' processes and namespace inits
    (unless the scope allows them) are refused. With
    `wait_gone_s` > 0 it waits up to that long for the signalled processes to die. Raises when
    the scope matches nothing, or when the signal reached none of the processes it matched
    (every one refused, or already dead), and `require_match` is true: nothing sent is never a
    success. A stop signal sent (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU: those whose default action
    stops the process) is recorded in the fault log, under the signal's name, as this run's
    freeze (resume_processes resumes it; a SIGCONT sent here ends it), and each process sent it
    is watched until it is stopped, at most `wait_stopped_s`: a sent stop is not a stop (a
    tracer may drop it; SIGTSTP, SIGTTIN and SIGTTOU may be handled or ignored, and the kernel
    discards them in an orphaned process group); each result says `stopped`, and `not_stopped`
    why not; the activity fails when none of them stopped (with `require_match`); a signal that
    ends a process (any whose default action terminates it or dumps core: SIGKILL, SIGTERM,
    SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2, SIGABRT, SIGALRM, SIGPIPE, SIGSEGV, SIGBUS; not
    SIGCONT nor a stop signal) to a process in one of chaosgpu's frozen cgroups lets it
    out of the freeze first (its result has `released_from`: a frozen process keeps the signal
    pending until thawed), and one in a frozen cgroup chaosgpu did not make is refused. Returns
    the per-process results."""
    checked = validate_scope(scope)  # normalised (its rule, SCOPE, refused a bad one)
    detail = resolve_scope_detail(checked)
    if require_match and not detail["processes"]:
        raise ScopeError(f"scope {describe_scope(checked)} matched no process that may be "
                         f"signalled (excluded: {detail['excluded']}, missing: "
                         f"{detail['missing']})")
    # Who was stopped before this stop signal: never recorded as this run's freeze.
    before = {}
    stops = _stops(signal)
    if stops:
        for proc in detail["processes"]:
            if (stopped := _stopped_how(proc)) is not None:
                before[proc["pid"]] = stopped
    noted = _note_freezing([p for p in detail["processes"] if p["pid"] not in before],
                           _signal_name(signal)) if stops else []
    try:
        report = send(detail["processes"], signal, checked, wait_stopped_s if stops else 0.0)
    except BaseException:
        _not_frozen_after_all(noted, [])
        raise
    report.update(scope=checked, excluded=detail["excluded"], missing=detail["missing"])
    if require_match and not report["sent"]:
        _not_frozen_after_all(noted, [])
        why = "; ".join(f"PID {r['pid']}: {r['result']} ({r.get('reason')})"
                        for r in report["results"])
        raise ScopeError(f"{report['signal']} reached no process of scope "
                         f"{describe_scope(checked)}: nothing was sent ({why})")
    sent = [r for r in report["results"] if r["result"] == "sent"]
    if stops:
        recorded = _record_stops(sent, before, describe_scope(checked), report)
        _not_frozen_after_all(noted, recorded)  # noted before the send, not this run's freeze
        # One stopped or frozen before it is left as found: its state is not this signal's.
        missed = not_stopped({"results": [r for r in report["results"]
                                          if r["pid"] not in before]})
        if require_match and missed and report.get("stopped") == 0:
            raise ActivityError(f"{report['signal']} was sent to {len(sent)} process(es) of "
                                f"scope {describe_scope(checked)}, and none was seen stopped "
                                f"within {wait_stopped_s:g} s (wait_stopped_s): "
                                + "; ".join(missed))
        for line in missed:
            logger.warning("chaosgpu: %s sent, not seen stopped: %s", report["signal"], line)
    elif report["signal"] == "SIGCONT":  # this run's stops of them are over (a resume)
        faultlog.resumed([key for key, kinds in _frozen_by_this_run(sent).items()
                          if kinds <= set(STOP_KINDS)])  # SIGCONT does not undo the freezer
    if wait_gone_s > 0:
        report["wait"] = wait_gone(sent, wait_gone_s)
    logger.info("chaosgpu: %s to %s: %d sent, %d refused, %d gone", report["signal"],
                describe_scope(checked), report["sent"], report["refused"], report["gone"])
    for result in report["results"]:
        if result["result"] == "refused":
            logger.warning("chaosgpu: refused to signal PID %s: %s", result["pid"],
                           result["reason"])
    return report  # type: ignore[no-any-return]


def _note_freezing(processes: list[dict[str, Any]], kind: str) -> list[tuple[int, int]]:
    """Note on disk (chaosgpu.freezelog), before a stop signal or a freezer freeze that waits
    for it to hold, that this run freezes `processes`: a runner killed during that wait leaves
    a trace `chaosgpu cleanup` resumes. Returns the (pid, starttime) noted."""
    keys = [(p["pid"], p["starttime"]) for p in processes if p.get("starttime") is not None]
    freezelog.frozen(keys, kind)
    return keys


def _not_frozen_after_all(noted: list[tuple[int, int]], frozen: list[dict[str, Any]]) -> None:
    """Drop from the disk trace the processes noted before a freeze that it did not freeze
    (refused, gone, already stopped, a stop lost for good): never this run's to resume."""
    done = {(p["pid"], p["starttime"]) for p in frozen}
    freezelog.resumed([key for key in noted if key not in done])


def _signal_name(signal: str) -> str:
    """The signalling program's name for `signal` ("SIGSTOP" for "sigstop" or 19)."""
    program = _signaller()
    return str(program.name_of(program.parse_signal(signal)))


def _ends(signal: str) -> bool:
    """Whether `signal` ends a process that neither handles nor ignores it, as the one
    signalling program decides it (its `ends_process`)."""
    program = _signaller()
    return bool(program.ends_process(program.parse_signal(signal)))


def _stops(signal: str) -> bool:
    """Whether `signal` is a stop signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU), as the one
    signalling program decides it (its `stops_process`)."""
    program = _signaller()
    return bool(program.stops_process(program.parse_signal(signal)))


def _record_stops(sent: list[dict[str, Any]], before: dict[int, str], scope: str,
                  report: dict[str, Any]) -> list[dict[str, Any]]:
    """Record each stop signal `sent` (the report's `signal`) as this run's freeze (the fault
    log, kind the signal's name, as freeze_processes records a SIGSTOP), except where the
    process was already stopped or frozen before it (`before`): that stop is someone else's,
    and resume_processes must leave it; nor where the signal was lost for good (the result's
    `stop_discarded`: ignored by the process, or discarded by the kernel for an orphaned process
    group), listed in the report's `stop_discarded`: a later stop is someone else's too.
    Returns the results recorded."""
    name = report["signal"]
    report["already_stopped"] = []
    report["stop_discarded"] = []
    recorded = []
    for result in sent:
        if result["pid"] in before:
            report["already_stopped"].append(
                {"pid": result["pid"], "starttime": result["starttime"],
                 "reason": f"{before[result['pid']]} before this {name}: not recorded as this "
                           "run's freeze (resume_processes leaves it as found)"})
            continue
        if result.get("stop_discarded"):  # lost for good: a later stop is someone else's
            report["stop_discarded"].append(
                {"pid": result["pid"], "starttime": result["starttime"],
                 "reason": f"{result.get('not_stopped')}: this {name} will never stop it, so it "
                           "is not recorded as this run's freeze (resume_processes leaves a "
                           "later stop by someone else as found)"})
            continue
        faultlog.record(name, pid=result["pid"], starttime=result["starttime"], scope=scope)
        recorded.append(result)
    return recorded


def _stopped_how(proc: dict[str, Any]) -> str | None:
    """How a census process is stopped now: "stopped (state T)" (SIGSTOP, or "t": a tracer),
    "in a frozen cgroup", or None when it is not."""
    if proc.get("state") in ("T", "t"):
        return f"stopped (state {proc['state']})"
    if freezer.frozen_now(proc["pid"]):
        return "in a frozen cgroup"
    return None


def _frozen_by_this_run(processes: list[dict[str, Any]]) -> dict[tuple[int, int], set[str]]:
    """For each of `processes` this run froze and has not resumed since, how (a stop signal's
    name such as "SIGSTOP", "freezer", or both): the fault log's freeze entries
    (freeze_processes, freeze_rank, fail_rank, signal_processes' stop signals) by PID and start
    time, newer than its last resume (resume_processes, or a SIGCONT through
    signal_processes)."""
    keys = {(p["pid"], p.get("starttime")) for p in processes}
    how: dict[tuple[int, int], set[str]] = {}
    for fault in faultlog.recent():
        key = (fault.get("pid", 0), fault.get("starttime", 0))
        if fault["kind"] in FREEZE_KINDS and key in keys \
                and fault["seq"] > faultlog.resumed_at(key):
            how.setdefault(key, set()).add(fault["kind"])
    return how


def _freeze_with_freezer(checked: dict[str, Any], processes: list[dict[str, Any]],
                         deadline_s: float, version: str = "auto") -> dict[str, Any]:
    """Freeze `processes` in chaosgpu's freezer group named after the scope `checked`."""
    return freezer.freeze(describe_scope(checked), processes, deadline_s, version)


def _thaw_freezer_groups(pids: set[int] | None,
                         untouched: bool = False) -> list[dict[str, Any]]:
    """Thaw chaosgpu's freezer groups (v1 and v2) holding any of `pids` (with `untouched`,
    the others are listed too, as freezer.thaw says)."""
    return freezer.thaw(pids, untouched=untouched)


@checked(scope=SCOPE, method=FREEZE_METHOD, deadline_s=POSITIVE_SECONDS)
def freeze_processes(scope: Dict[str, Any], method: str = "sigstop",
                     deadline_s: float = 5.0, configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Freeze every process of a declared scope, the way a hung peer looks to its job:
    `method="sigstop"` sends SIGSTOP through pidfds (state T, visible to the process's parent),
    `method="freezer"` moves them into a cgroup freezer group and freezes it (invisible to the
    process; needs root; the v1 freezer where it is mounted, else cgroup v2's cgroup.freeze;
    "freezer-v1" or "freezer-v2" choose). Same refusal rules as signal_processes. A process
    already stopped (state T) or in a frozen cgroup is left as found (`already_stopped` says
    why). Each process frozen is recorded in the fault log, and resume_processes resumes only
    those; a frozen process ignores SIGKILL until thawed. The freeze must be seen to hold
    within `deadline_s`: every process sent SIGSTOP stopped (state T; each result says
    `stopped`), or the freezer group FROZEN; otherwise the activity fails and says why, from
    /proc (a tracer holding the process, an uninterruptible call). Returns what was frozen and
    how."""
    checked = validate_scope(scope)
    version = "auto" if method in ("sigstop", "freezer") else method[len("freezer-"):]
    if method != "sigstop":
        problem = freezer.available(version)[1]
        if problem is not None:  # before anything is looked at or touched
            raise RuntimeError(problem)
    detail = resolve_scope_detail(checked)
    if not detail["processes"]:
        raise ScopeError(f"scope {describe_scope(checked)} matched no process to freeze "
                         f"(excluded: {detail['excluded']}, missing: {detail['missing']})")
    already = []
    targets = []
    for proc in detail["processes"]:
        how = _stopped_how(proc)
        if how is None:
            targets.append(proc)
        else:
            already.append({"pid": proc["pid"], "starttime": proc.get("starttime"),
                            "reason": f"{how} before this freeze: left as found"})
    kind = "SIGSTOP" if method == "sigstop" else "freezer"
    noted = _note_freezing(targets, kind)  # before: a runner killed while it waits leaves it
    if method == "sigstop":
        report = send(targets, "SIGSTOP", checked, deadline_s)
        report["method"] = "sigstop"
        frozen = [r for r in report["results"] if r["result"] == "sent"]
    else:
        # The freezer path does not signal, but the same refusal rules must hold: check them
        # with the null signal (permission and identity only; a SIGCONT would resume a process
        # stopped on purpose) through the terminate primitive first.
        check = send(targets, NULL_SIGNAL, checked)
        allowed = {r["pid"] for r in check["results"] if r["result"] == "sent"}
        report = _freeze_with_freezer(
            checked, [p for p in targets if p["pid"] in allowed], deadline_s, version)
        report["refused"] = [r for r in check["results"] if r["result"] == "refused"]
        frozen = [p for p in targets if p["pid"] in report["frozen"]]
    for proc in frozen:  # what resume_processes may resume
        faultlog.record(kind, pid=proc["pid"], starttime=proc["starttime"],
                        scope=describe_scope(checked))
    _not_frozen_after_all(noted, frozen)
    report.update(scope=checked, excluded=detail["excluded"], already_stopped=already)
    missed = freeze_not_held(report, deadline_s)
    if missed:  # recorded first: the rollback resumes whatever of it holds later
        raise ActivityError(f"the freeze of scope {describe_scope(checked)} did not hold within "
                            f"{deadline_s:g} s (deadline_s): " + "; ".join(missed))
    return report


def freeze_not_held(report: dict[str, Any], deadline_s: float) -> list[str]:
    """What of a freeze did not hold: each live process sent SIGSTOP and not seen stopped ("PID
    p: why"), or, for the freezer, its group not FROZEN by the deadline."""
    if report.get("method") == "sigstop":
        return not_stopped(report)
    if report.get("frozen") and report.get("freezer_state") != "FROZEN":
        return [f"the freezer group is still {report.get('freezer_state')} after "
                f"{deadline_s:g} s (a process in an uninterruptible call delays it)"]
    return []


@checked(scope=SCOPE, missing_ok=MISSING_OK)
def resume_processes(scope: Dict[str, Any], missing_ok: Union[bool, str] = "before-method",
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Resume the processes of a declared scope that this run froze (the fault log:
    freeze_processes, freeze_rank, fail_rank, a stop signal through signal_processes: SIGSTOP,
    SIGTSTP ...) and has not resumed since: move them out of chaosgpu's freezer cgroups (which
    thaws them) or send SIGCONT through pidfds, as they were frozen. A process stopped or
    frozen by someone else, before the freeze or after a resume, is left as found
    (`left_stopped` says why). Safe to run twice and when nothing is frozen (a rollback), also
    once the processes are gone; but a scope this run never met (a typo'd tag: it would leave
    the frozen processes frozen) fails, unless `missing_ok` is true (or "before-method", the
    default, before the method starts; chaosgpu.scope.resolve_observed).
    Returns what was resumed."""
    detail = resolve_observed(scope, missing_ok, observe=False)
    checked = detail["scope"]
    how = _frozen_by_this_run(detail["processes"])
    ours, left_stopped = [], []
    for proc in detail["processes"]:
        key = (proc["pid"], proc.get("starttime"))
        if key in how:
            ours.append(proc)
        elif (stopped := _stopped_how(proc)) is not None:
            left_stopped.append({"pid": proc["pid"], "starttime": proc.get("starttime"),
                                 "reason": f"{stopped}, but not frozen by this run (or resumed "
                                           "since): left as found"})
    in_freezer = {p["pid"] for p in ours if "freezer" in how[(p["pid"], p["starttime"])]}
    thawed = _thaw_freezer_groups(in_freezer) if in_freezer else []
    report = send([p for p in ours if how[(p["pid"], p["starttime"])] & set(STOP_KINDS)],
                  "SIGCONT", checked)
    faultlog.resumed([(proc["pid"], proc["starttime"]) for proc in ours])
    report.update(scope=checked, thawed_cgroups=thawed, excluded=detail["excluded"],
                  left_stopped=left_stopped)
    for entry in left_stopped:
        logger.warning("chaosgpu: resume_processes: PID %s: %s", entry["pid"], entry["reason"])
    return report  # type: ignore[no-any-return]
