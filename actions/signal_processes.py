"""Signal and terminate processes safely: the one terminate primitive of chaosgpu.

In-target program (standard library only, Python 3.8 syntax; sending needs Python 3.9+ on Linux
5.3+ for pidfds, older ones get every target refused with `no_pidfd`): chaosgpu loads this very
file in place for local targets (chaosgpu.process.terminate is its typed front) and streams it
into pods, so one algorithm and one set of refusal rules serve everywhere. There is no second
copy to keep in step.

The algorithm (`terminate`): for each target `{"pid": P, "starttime": T}` open a pidfd first,
then re-read /proc/P/stat and compare the start time (clock ticks since boot) with T: the pidfd
then holds the very process the caller meant; a PID reused since the caller looked is refused,
and so is a target without a start time (fail closed). Then, under ONE deadline: optionally
SIGCONT (a stopped process cannot act on SIGTERM), send the first signal of the escalation
(e.g. SIGTERM) through `signal.pidfd_send_signal`, wait up to `grace_s` for the exits by polling
the pidfds, send the next signal (e.g. SIGKILL) to those left, and after the last one wait until
the deadline. Optionally wait, within the same deadline, until the dead are reaped. `signal_targets`
is the same primitive with one signal and no wait; the null signal "0" checks permission only.

A signal that ends a process stays pending, with no effect, while its target sits in a frozen
cgroup. Which signals end a process is decided here, once (`ends_process`): every signal whose
default action (signal(7)) terminates the process or dumps core, i.e. all but SIGCONT, the stop
signals (STOP_SIGNALS: SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) and those ignored by default (SIGCHLD,
SIGURG, SIGWINCH); SIGUSR1, SIGHUP, SIGALRM, SIGPIPE, SIGSEGV or SIGBUS end a process that
does not handle them just as SIGTERM does (FATAL_SIGNALS: those of SIGNALS). The caller may pass
`release`, a function that is given the identified targets before the first such signal and lets
them out of the freezes it owns (chaosgpu passes its freezer's; this program does not touch
cgroups itself): a target let out carries `released_from` in its outcome; one it could not let
out is refused (`reason_code` "frozen") and gets no signal, rather than one that would stay
pending until a later thaw.

Refused, always: PID 1 of the observer's namespace (the host's init when run on the host), this
program's own process and every ancestor (the runner that called it), kernel threads, and a
target without a start time. Refused unless allowed: PID 1 of any other PID namespace
(`allow_ns_init`), processes of another real or effective UID (`allow_other_users`).

Each target gets one outcome: `sent` (signalled, not waited for), `exited` (its exit was seen
before the deadline, `exited_on` names the last signal before it), `alive` (still alive at the
deadline after the last signal), `refused` (with `reason_code` and `reason`) or `gone` (it
exited or was reaped before any signal; a zombie counts as gone: it is dead and ignores signals).

A stop signal sent is not a stop seen: a tracer attached to the target receives the signal
first and may drop it, an uninterruptible call delays it, and SIGTSTP, SIGTTIN and SIGTTOU can be
handled, ignored or blocked by the target, or discarded by the kernel in an orphaned process
group (a session of its own). `wait_stopped` watches the targets until they are stopped (state
T) and says, from /proc, why one is not; `signal_targets` does so with `wait_stopped_s`, and
each sent result then says `stopped`.

This program owns sending signals, waiting for exits and stops, and the identity checks that
guard them. It must not decide which processes are in scope (chaosgpu.scope does) nor read more
of /proc than those checks, and the account of a stop that did not happen, need.

Command line: `python signal_processes.py SIGNAL[,SIGNAL...] [TARGETS_JSON] [--allow-other-users]
[--allow-ns-init] [--grace-s=S] [--deadline-s=S] [--wait-stopped-s=S]`; TARGETS_JSON (a list of
targets, or `{"targets": [...]}`) is read from stdin when absent. SIGNAL is one of SIGNALS
(SIGKILL, SIGTERM, SIGSTOP, SIGCONT, SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2, SIGABRT, SIGTSTP,
SIGTTIN, SIGTTOU, SIGALRM, SIGPIPE, SIGSEGV, SIGBUS; with or without "SIG", any case) or "0", the
null signal; any other name is refused (exit 2, nothing sent). One signal without
--deadline-s signals and returns, after watching the targets of a stop signal until they stop
(at most --wait-stopped-s, STOP_WAIT_S by default; 0: not watched); otherwise it terminates
(escalation, waits). Prints one JSON document; exit 0, or 2 with `{"error": ...}` on bad input.
"""

import json
import math
import os
import select
import signal
import sys
import time

__all__ = ["SIGNALS", "FATAL_SIGNALS", "STOP_SIGNALS", "STOP_WAIT_S", "terminate", "signal_targets",
           "wait_exits", "wait_stopped", "stop_missed", "parse_signal", "ends_process",
           "stops_process", "protected_pids", "main"]

SCHEMA = "chaosgpu.signal/1"
PF_KTHREAD = 0x00200000
# The signals a chaos experiment has a reason to send. Anything else is refused as bad input.
# "0" is the null signal: the kernel checks that the signal could be sent and sends nothing.
# By default action (signal(7)): SIGSTOP, SIGTSTP, SIGTTIN and SIGTTOU stop the process
# (STOP_SIGNALS), SIGCONT resumes it, every other one ends it (FATAL_SIGNALS): SIGALRM a stray
# timer, SIGPIPE a broken pipe, SIGSEGV and SIGBUS a crash (a segfault; a bus error, as a bad
# GPU or mmap access gives), dumping core as SIGQUIT and SIGABRT do.
SIGNALS = ("SIGKILL", "SIGTERM", "SIGSTOP", "SIGCONT", "SIGINT", "SIGQUIT", "SIGHUP",
           "SIGUSR1", "SIGUSR2", "SIGABRT", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGALRM",
           "SIGPIPE", "SIGSEGV", "SIGBUS")
NULL_SIGNAL = "0"
# The signals whose default action (signal(7)) stops the process; SIGCONT resumes it.
STOP_SIGNALS = ("SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU")
# The signals whose default action does not end the process: it continues, stops, or ignores
# them. Every other signal (SIGKILL, SIGTERM, SIGUSR1, SIGHUP, SIGALRM, SIGPIPE, SIGSEGV, the
# real-time signals ...) terminates it or dumps core (`ends_process`).
_STOPPING = frozenset(int(getattr(signal, name)) for name in STOP_SIGNALS)
_NOT_ENDING = _STOPPING | frozenset(int(getattr(signal, name)) for name in
                                    ("SIGCONT", "SIGCHLD", "SIGURG", "SIGWINCH"))
UNTIL = ("sent", "exit", "reaped")
# How long the command line watches the targets of a stop signal until they are seen stopped
# (`wait_stopped`), unless --wait-stopped-s says otherwise; chaosgpu's rank freezes wait as long.
STOP_WAIT_S = 5.0
# The longest one poll(2) call waits (a day): its timeout is an int of milliseconds, at most
# 2**31 - 1 (about 24.8 days); a longer grace or deadline is waited for a day at a time.
POLL_SLICE_S = 86400.0


class SignalInputError(ValueError):
    """Raised for input that names no valid signal or target; nothing was signalled."""


def parse_signal(name):
    """Return the signal number for a name such as 'SIGKILL' or 'KILL' (case-insensitive), or 0
    for the null signal "0"."""
    if not isinstance(name, str) or not name.strip():
        raise SignalInputError(f"signal must be a name such as 'SIGKILL', got {name!r}")
    if name.strip() == NULL_SIGNAL:
        return 0
    canonical = name.strip().upper()
    if not canonical.startswith("SIG"):
        canonical = "SIG" + canonical
    if canonical not in SIGNALS:
        raise SignalInputError(
            f"unsupported signal {name!r}; expected one of {', '.join(SIGNALS)} or "
            f"{NULL_SIGNAL!r} (check only)")
    return int(getattr(signal, canonical))


def name_of(signum):
    """The name of signal number `signum` ("0" for the null signal)."""
    return NULL_SIGNAL if signum == 0 else signal.Signals(signum).name


def ends_process(signum):
    """Whether signal number `signum` ends a process that neither handles nor ignores it (its
    default action terminates the process or dumps core): every signal but SIGCONT, the stop
    signals and SIGCHLD, SIGURG and SIGWINCH (ignored by default); never the null signal 0. A
    target in a frozen cgroup is let out of it before such a signal (`release`)."""
    return signum != 0 and int(signum) not in _NOT_ENDING


def stops_process(signum):
    """Whether signal number `signum` is a stop signal (STOP_SIGNALS): its default action stops
    the process until a SIGCONT. SIGSTOP cannot be caught; SIGTSTP, SIGTTIN and SIGTTOU can be
    handled or ignored, and the kernel discards them for a process of an orphaned process
    group."""
    return int(signum) in _STOPPING


# The signals of SIGNALS that end a process (`ends_process`).
FATAL_SIGNALS = tuple(name for name in SIGNALS if ends_process(int(getattr(signal, name))))


def _read_stat(pid):
    """Return (state, ppid, flags, starttime, pgrp, session) from /proc/PID/stat, or None when
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    # fields[0] is field 3 (state); ppid is field 4, pgrp 5, session 6, flags 9, starttime 22.
    return (fields[0].decode(), int(fields[1]), int(fields[6]), int(fields[19]),
            int(fields[2]), int(fields[3]))


def _read_status(pid):
    """Return (uids [real, effective], nspid list) from /proc/PID/status, or None when gone."""
    uids, nspid = None, None
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("Uid:"):
                    uids = [int(v) for v in line.split()[1:3]]
                elif line.startswith("NSpid:"):
                    nspid = [int(v) for v in line.split()[1:]]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return uids or [], nspid or [pid]


def protected_pids(pid=None):
    """Return the PIDs that are never signalled: 1, this process (or `pid`) and its ancestors."""
    protected = {1}
    current = os.getpid() if pid is None else int(pid)
    while current > 1 and current not in protected:
        protected.add(current)
        stat = _read_stat(current)
        if stat is None:
            break
        current = stat[1]
    return protected


def _result(target, result, reason_code=None, reason=None, **extra):
    entry = {"pid": target.get("pid"), "starttime": target.get("starttime"), "result": result}
    if reason_code is not None:
        entry["reason_code"] = reason_code
        entry["reason"] = reason
    entry.update(extra)
    return entry


def _validate_targets(targets):
    if isinstance(targets, dict) and "targets" in targets:
        targets = targets["targets"]
    if not isinstance(targets, list):
        raise SignalInputError("targets must be a list of {pid, starttime} objects, got "
                               f"{type(targets).__name__}")
    checked = []
    for index, target in enumerate(targets):
        if not isinstance(target, dict):
            raise SignalInputError(
                f"target #{index} must be an object with pid and starttime, got {target!r}")
        pid = target.get("pid")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise SignalInputError(f"target #{index}: pid must be a positive integer, got {pid!r}")
        starttime = target.get("starttime")
        if starttime is not None and (isinstance(starttime, bool)
                                      or not isinstance(starttime, int)):
            raise SignalInputError(
                f"target #{index}: starttime must be an integer (clock ticks), got {starttime!r}")
        checked.append(dict(target))
    return checked


def _seconds(label, value):
    """A finite number of seconds >= 0 (nan and inf refused: a wait must end)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise SignalInputError(f"{label} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _refusal(target, stat, status, rules):
    """The refusal that applies to a live, identified target (None when it may be signalled)."""
    pid = target["pid"]
    state, flags = stat[0], stat[2]
    if flags & PF_KTHREAD:
        return _result(target, "refused", "kernel_thread", f"PID {pid} is a kernel thread")
    uids, nspid = status
    if len(nspid) > 1 and nspid[-1] == 1 and not rules["allow_ns_init"]:
        return _result(target, "refused", "ns_init",
                       f"PID {pid} is PID 1 of its namespace (set include_ns_init to allow)")
    if not rules["allow_other_users"] and any(uid != rules["uid"] for uid in uids):
        owner = "/".join(str(u) for u in uids)
        return _result(target, "refused", "other_user",
                       f"PID {pid} belongs to UID {owner}, not {rules['uid']} "
                       "(set include_other_users to allow)")
    if state in ("Z", "X"):
        return _result(target, "gone", reason_code="zombie",
                       reason="already dead (zombie, not reaped)", state=state)
    return None


def _open_checked(target, rules):
    """Return (pidfd, state) on the very process `target` names, or (None, outcome)."""
    pid = target["pid"]
    expected = target.get("starttime")
    if pid in rules["protected"]:
        if pid == 1:
            return None, _result(target, "refused", "pid1",
                                 "PID 1 of this namespace is never signalled")
        return None, _result(target, "refused", "runner",
                             f"PID {pid} is the runner or one of its ancestors")
    if expected is None:
        return None, _result(target, "refused", "no_identity",
                             f"no starttime given for PID {pid}: its identity cannot be checked")
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return None, _result(target, "refused", "no_pidfd",
                             "this Python has no pidfd support (needs Python 3.9+ on Linux "
                             "5.3+): signals are never sent by bare PID")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None, _result(target, "gone", reason_code="exited", reason="no such process")
    except OSError as error:
        return None, _result(target, "refused", "pidfd", f"pidfd_open failed: {error}")
    # Identity check AFTER opening: if the start time still matches now, the pidfd holds it.
    stat, status = _read_stat(pid), _read_status(pid)
    refusal = None
    if stat is None or status is None:
        refusal = _result(target, "gone", reason_code="exited", reason="exited while checked")
    elif stat[3] != expected:
        refusal = _result(target, "refused", "reused",
                          f"PID {pid} now belongs to another process (starttime {stat[3]}, "
                          f"expected {expected})")
    else:
        refusal = _refusal(target, stat, status, rules)
    if refusal is not None:
        os.close(pidfd)
        return None, refusal
    return pidfd, stat[0]


def _poll_exits(pidfds, timeout_s):
    """Wait up to `timeout_s` on the pidfds {key: fd}; return the keys whose process exited (a
    pidfd turns readable when its process has exited, zombie or reaped). Each poll(2) waits at
    most POLL_SLICE_S, so any finite `timeout_s` is waited for in full."""
    exited = set()  # type: set[str]
    poller = select.poll()
    by_fd = {}
    for key, fd in pidfds.items():
        poller.register(fd, select.POLLIN)
        by_fd[fd] = key
    end = time.monotonic() + timeout_s
    while len(exited) < len(pidfds):
        remaining = end - time.monotonic()
        for fd, _events in poller.poll(min(max(0.0, remaining), POLL_SLICE_S) * 1000.0):
            exited.add(by_fd[fd])
            poller.unregister(fd)
        if remaining <= 0:
            break
    return exited


def _reaped(pid, starttime):
    stat = _read_stat(pid)
    return stat is None or stat[3] != starttime


def _wait_reaped(entries, end):
    """Wait until the given exited targets are reaped (gone from /proc) or `end` passes."""
    pending = list(entries)
    for entry in entries:
        entry["reaped"] = False
    while pending:
        for entry in [e for e in pending if _reaped(e["pid"], e["starttime"])]:
            entry.update(reaped=True, reaped_at=time.time())
            pending.remove(entry)
        if not pending or time.monotonic() >= end:
            return
        time.sleep(0.001)


def _send(pidfd, signum, entry):
    """Send one signal on an open pidfd; record it in the outcome `entry`; False when refused."""
    at = time.time()  # before the send: its effects (an exit, memory freed) never precede it
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        return True  # reaped meanwhile: the exit wait sees it at once
    except PermissionError as error:
        entry.update(result="refused", reason_code="permission",
                     reason=f"the kernel refused: {error}")
        return False
    entry["signals"].append({"signal": name_of(signum), "at": at})
    return True


def _rules(allow_other_users, allow_ns_init, runner_pid):
    protected = protected_pids()
    if runner_pid is not None:
        protected |= protected_pids(runner_pid)
    return {"protected": protected, "allow_other_users": bool(allow_other_users),
            "allow_ns_init": bool(allow_ns_init), "uid": os.getuid()}


def _release(held, release):
    """Let the held targets out of frozen cgroups through the caller's `release` before a fatal
    signal; refuse (and let go of) those it could not let out."""
    answers = release([{"pid": entry["pid"], "starttime": entry["starttime"]}
                       for _fd, entry in held.values()]) or {}
    for key in list(held):
        fd, entry = held[key]
        answer = answers.get(entry["pid"])
        if answer is None:
            continue  # not frozen
        if answer.get("released"):
            entry["released_from"] = answer
            continue
        entry.update(result="refused", reason_code="frozen", frozen_in=answer.get("cgroup"),
                     reason="PID {} is in the frozen cgroup {} and could not be let out ({}): a "
                     "signal would stay pending until it is thawed, so none was sent".format(
                         entry["pid"], answer.get("cgroup"), answer.get("reason")))
        os.close(fd)
        del held[key]


def _escalate(held, signums, grace_s, end, until):
    """Send each signal in turn to the held targets not yet exited; wait between and after."""
    pending = dict(held)
    for index, signum in enumerate(signums):
        for key in list(pending):
            fd, entry = pending[key]
            if not _send(fd, signum, entry):
                del pending[key]
        if until == "sent":
            continue
        last = index == len(signums) - 1
        wait_s = max(0.0, end - time.monotonic())
        exited = _poll_exits({k: v[0] for k, v in pending.items()},
                             wait_s if last else min(grace_s, wait_s))
        now = time.time()
        for key in exited:
            entry = pending.pop(key)[1]
            entry.update(result="exited", exited_at=now, exited_on=name_of(signum))
    for _fd, entry in pending.values():
        entry["result"] = "sent" if until == "sent" else "alive"


def terminate(targets, signals=("SIGTERM", "SIGKILL"), grace_s=5.0, deadline_s=10.0,
              cont_first=False, until="exit", allow_other_users=False, allow_ns_init=False,
              runner_pid=None, release=None):
    """The one terminate primitive: signal each target through an identity-checked pidfd,
    escalating through `signals` with `grace_s` between them, all within `deadline_s`.

    `targets`: a list of {"pid", "starttime"} (PIDs as this process sees them; the start time is
    mandatory). `cont_first`: SIGCONT first (a stopped process cannot act on SIGTERM). `until`:
    "sent" (send the signals in turn without waiting), "exit" (wait for exits, escalating)
    or "reaped" (then also wait, within the deadline, until the dead are gone from /proc:
    `reaped` and `reaped_at` say when). `release`: called once, before the first signal that
    ends a process (`ends_process`), with the identified targets ([{"pid", "starttime"}]); it
    returns {pid: {"released": true, ...}} for each target it let out of a frozen cgroup (kept
    in the outcome as `released_from`) and {pid: {"released": false, "cgroup", "reason"}} for
    one it could not (refused, `reason_code` "frozen"); targets not frozen are left out of its
    answer.
    Returns one outcome per distinct target (see the module docstring); every outcome has
    `signals`, the list of {"signal", "at"} sent. Raises SignalInputError on bad input, before
    anything is sent.
    """
    signums = [parse_signal(name) for name in (signals or [])]
    if not signums:
        raise SignalInputError("signals must name at least one signal, e.g. ['SIGTERM', 'SIGKILL']")
    grace = _seconds("grace_s", grace_s)
    deadline = _seconds("deadline_s", deadline_s)
    if until not in UNTIL:
        raise SignalInputError(f"until must be one of {', '.join(UNTIL)}, got {until!r}")
    checked = _validate_targets(targets)
    end = time.monotonic() + deadline
    rules = _rules(allow_other_users, allow_ns_init, runner_pid)
    outcomes, held, seen = [], {}, set()
    try:
        for target in checked:
            key = (target["pid"], target.get("starttime"))
            if key in seen:
                continue
            seen.add(key)
            pidfd, found = _open_checked(target, rules)
            if pidfd is None:
                found.setdefault("signals", [])
                outcomes.append(found)
                continue
            entry = _result(target, "sent", state=found, signals=[])
            outcomes.append(entry)
            held[key] = (pidfd, entry)
        if release is not None and held and any(ends_process(s) for s in signums):
            _release(held, release)
        if cont_first:
            for fd, _entry in held.values():
                try:
                    signal.pidfd_send_signal(fd, signal.SIGCONT)
                except OSError:
                    pass
        _escalate(held, signums, grace, end, until)
    finally:
        for fd, _entry in held.values():
            os.close(fd)
    if until == "reaped":
        _wait_reaped([e for e in outcomes if e["result"] == "exited"], end)
    return outcomes


def wait_exits(targets, deadline_s):
    """Wait up to `deadline_s` until none of `targets` ({"pid", "starttime"}) is alive (a zombie
    counts as dead, a PID reused by another process too); return those still alive."""
    deadline = _seconds("deadline_s", deadline_s)
    fds = {}
    try:
        for target in _validate_targets(targets):
            key = (target["pid"], target.get("starttime"))
            if key in fds or target.get("starttime") is None:
                continue
            try:
                fd = os.pidfd_open(target["pid"])
            except OSError:
                continue  # reaped already
            stat = _read_stat(target["pid"])
            if stat is None or stat[3] != target["starttime"]:
                os.close(fd)  # gone, and the PID is someone else's now
                continue
            fds[key] = fd
        exited = _poll_exits(fds, deadline)
    finally:
        for fd in fds.values():
            os.close(fd)
    return [{"pid": key[0], "starttime": key[1]} for key in fds if key not in exited]


def _signal_status(pid):
    """Return TracerPid and the SigBlk, SigIgn and SigCgt masks (ints) of /proc/PID/status
    ({} when gone)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key == "TracerPid":
                    found[key] = int(value)
                elif key in ("SigBlk", "SigIgn", "SigCgt"):
                    found[key] = int(value.strip(), 16)
    except (FileNotFoundError, ProcessLookupError):
        return {}
    return found


def _group_orphaned(pgrp, session):
    """Whether process group `pgrp` of `session` is orphaned (POSIX: no member has a parent in
    another group of the same session), as every member's and parent's /proc/PID/stat say."""
    members, groups = [], {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat is not None:
                groups[int(name)] = (stat[4], stat[5])
                if stat[4] == pgrp:
                    members.append(stat[1])
    for ppid in members:
        parent = groups.get(ppid)
        if parent is not None and parent[0] != pgrp and parent[1] == session:
            return False
    return True


def stop_missed(pid, signum, state):
    """Why a live process sent the stop signal `signum` is not stopped (state `state`), and
    whether that signal is lost for good, so that no later stop of it can be its doing:
    (reason, discarded). The reason is what its /proc entries show of a tracer, an
    uninterruptible call, and for SIGTSTP, SIGTTIN and SIGTTOU its own handling of the signal
    or an orphaned process group (each file read once). Lost for good: SIGTSTP, SIGTTIN or
    SIGTTOU that the process ignores (dropped when sent), or that the kernel discards for its
    orphaned process group (when it is delivered: an uninterruptible call only delays that),
    neither blocked (pending) nor held by a tracer (which sees it first). SIGSTOP, and a
    signal the process handles (its handler may stop it), are never said lost."""
    name = name_of(signum)
    bit = 1 << (signum - 1)
    status = _signal_status(pid)
    reasons = []
    held = False  # a tracer sees the signal first and may deliver it as it likes: not lost
    if status.get("TracerPid"):
        held = True
        reasons.append(f"it is traced by PID {status['TracerPid']}: a stop signal goes to the "
                       "tracer first, which may hold it or drop it")
    if state == "D":
        reasons.append("it is in an uninterruptible call (state D, as in a driver or on a "
                       "network file system): the stop takes effect when the call returns")
    discarded = False
    if signum != signal.SIGSTOP:
        if status.get("SigIgn", 0) & bit:
            discarded = not held and not status.get("SigBlk", 0) & bit
            reasons.append(f"it ignores {name}")
        elif status.get("SigCgt", 0) & bit:
            reasons.append(f"it handles {name} itself (its handler did not stop it)")
        elif status.get("SigBlk", 0) & bit:
            reasons.append(f"it blocks {name}: the signal stays pending")
        elif status:
            stat = _read_stat(pid)
            if stat is not None and _group_orphaned(stat[4], stat[5]):
                discarded = not held
                reasons.append(f"its process group {stat[4]} is orphaned (no member has a "
                               "parent in another group of its session, as in a session of "
                               f"its own): the kernel discards {name} for it")
    if not reasons:
        reasons.append("nothing in /proc says why (a SIGCONT from someone else may have "
                       "resumed it)")
    return "; ".join(reasons), discarded


def wait_stopped(targets, deadline_s, signal_name="SIGSTOP"):
    """Wait up to `deadline_s` until each of `targets` ({"pid", "starttime"}) sent the stop
    signal `signal_name` is stopped by it (state T: a group stop; state t is a tracer's stop,
    whose signal the tracer may drop). Return one entry per target not seen stopped: its
    `state` ("gone" once it ended, or its PID is another process's), `reason`
    (stop_missed's for a live one) and `discarded` (stop_missed's: the signal is lost for
    good, it will never stop the process). SIGSTOP stops any process that no tracer holds nor an
    uninterruptible call delays; SIGTSTP, SIGTTIN and SIGTTOU may be handled, ignored or
    blocked by their target, and the kernel discards them in an orphaned process group."""
    deadline = _seconds("deadline_s", deadline_s)
    signum = parse_signal(signal_name)
    pending = {}
    for target in _validate_targets(targets):
        pending[(target["pid"], target.get("starttime"))] = "?"
    end = time.monotonic() + deadline
    pause = 0.001
    while True:
        for key in list(pending):
            stat = _read_stat(key[0])
            if stat is None or stat[3] != key[1] or stat[0] in ("Z", "X"):
                pending[key] = "gone"
            elif stat[0] == "T":
                del pending[key]
            else:
                pending[key] = stat[0]
        if not [state for state in pending.values() if state != "gone"] \
                or time.monotonic() >= end:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    missed = []
    for (pid, starttime), state in pending.items():
        reason, discarded = (("it ended before it was seen stopped", False) if state == "gone"
                             else stop_missed(pid, signum, state))
        missed.append({"pid": pid, "starttime": starttime, "state": state, "reason": reason,
                       "discarded": discarded})
    return missed


def signal_targets(targets, signal_name, allow_other_users=False, allow_ns_init=False,
                   runner_pid=None, release=None, wait_stopped_s=0.0):
    """Signal each target once through a pidfd after the identity and refusal checks (the
    terminate primitive with one signal and no wait); return a report.

    `targets` is a list of {"pid", "starttime"} (PIDs as this process sees them). The report is
    {"schema", "signal", "results": [...], "sent", "refused", "gone"} (counts); a sent result
    has `sent_at`. `runner_pid` adds another process whose ancestors are protected (this
    process's always are). `release`: as for `terminate` (a target let out of a frozen cgroup
    has `released_from`). With a stop signal and `wait_stopped_s` > 0, every target sent it
    is watched until it is stopped (`wait_stopped`), at most that long: each sent result says
    `stopped` (true or false; when false, `state_after`, its state then, `not_stopped`:
    why, and `stop_discarded`: whether the signal is lost for good), and the report counts
    `stopped` and `not_stopped`. Raises SignalInputError on bad input, before anything
    is sent.
    """
    signum = parse_signal(signal_name)
    confirm = _seconds("wait_stopped_s", wait_stopped_s) > 0 and stops_process(signum)
    results = terminate(targets, [signal_name], deadline_s=0, until="sent",
                        allow_other_users=allow_other_users, allow_ns_init=allow_ns_init,
                        runner_pid=runner_pid, release=release)
    for result in results:
        sent = result.pop("signals")
        if result["result"] == "sent":
            result["sent_at"] = sent[0]["at"]
    counts = {name: sum(1 for r in results if r["result"] == name)
              for name in ("sent", "refused", "gone")}
    report = {"schema": SCHEMA, "signal": name_of(signum), "results": results}
    report.update(counts)
    if confirm:
        sent = [r for r in results if r["result"] == "sent"]
        left = {(e["pid"], e["starttime"]): e
                for e in wait_stopped(sent, wait_stopped_s, signal_name)}
        for result in sent:
            missed = left.get((result["pid"], result["starttime"]))
            result["stopped"] = missed is None
            if missed is not None:
                result.update(state_after=missed["state"], not_stopped=missed["reason"],
                              stop_discarded=missed["discarded"])
        report["stopped"] = len(sent) - len(left)
        report["not_stopped"] = len(left)
    return report


def _parse_args(args):
    flags = {"--allow-other-users": False, "--allow-ns-init": False}
    seconds = {}
    positional = []
    for arg in args:
        if arg in flags:
            flags[arg] = True
        elif arg.startswith(("--grace-s=", "--deadline-s=", "--wait-stopped-s=")):
            key, _, value = arg.partition("=")
            try:
                seconds[key[2:].replace("-", "_")] = float(value)
            except ValueError:
                raise SignalInputError(f"{key} needs a number of seconds, got {value!r}") from None
        else:
            positional.append(arg)
    if not positional or len(positional) > 2:
        raise SignalInputError("usage: signal_processes.py SIGNAL[,SIGNAL...] [TARGETS_JSON] "
                               "[--allow-other-users] [--allow-ns-init] [--grace-s=S] "
                               "[--deadline-s=S] [--wait-stopped-s=S]")
    return flags, seconds, positional


def main(argv=None):
    """Command-line entry: print one JSON document (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    try:
        flags, seconds, positional = _parse_args(args)
        raw = positional[1] if len(positional) == 2 else sys.stdin.read()
        try:
            targets = json.loads(raw)
        except ValueError as error:
            raise SignalInputError(f"targets are not valid JSON: {error}") from None
        names = positional[0].split(",")
        rules = {"allow_other_users": flags["--allow-other-users"],
                 "allow_ns_init": flags["--allow-ns-init"]}
        wait_stopped_s = seconds.pop("wait_stopped_s", None)
        if len(names) == 1 and "deadline_s" not in seconds:
            report = signal_targets(
                targets, names[0], wait_stopped_s=STOP_WAIT_S if wait_stopped_s is None
                else wait_stopped_s, **rules)
        elif wait_stopped_s is not None:
            raise SignalInputError("--wait-stopped-s applies to one stop signal sent alone, "
                                   "not to an escalation (--deadline-s or several signals)")
        else:
            report = {"schema": SCHEMA, "signals": names,
                      "results": terminate(targets, names, **seconds, **rules)}
    except SignalInputError as error:
        print(json.dumps({"schema": SCHEMA, "error": str(error)}))
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
