"""Send a signal to a list of processes, safely: the one place in chaosgpu that signals anything.

In-target program (standard library only; sending needs Python 3.9+ on Linux 5.3+ for pidfds,
older ones get every target refused with `no_pidfd`): chaosgpu loads it in place for local
targets and streams it into pods, so the same refusal rules apply everywhere.

For each target `{"pid": P, "starttime": T}` it opens a pidfd first, then re-reads
/proc/P/stat and compares the start time (clock ticks since boot) with T: the pidfd then holds
the very process the caller meant, and a PID reused since the caller looked is refused. The signal
goes through `signal.pidfd_send_signal`, never through a bare PID.

Refused, always: PID 1 of the observer's namespace (the host's init when run on the host), this
program's own process and every ancestor (the runner that called it), kernel threads, and a
target without a start time. Refused unless allowed: PID 1 of any other PID namespace
(`allow_ns_init`), processes of another real or effective UID (`allow_other_users`).

Each target gets one result: `sent`, `refused` (with `reason_code` and `reason`) or `gone` (it
exited or was reaped before the signal; a zombie counts as gone: it is dead and ignores signals).

This program owns sending signals and the identity checks that guard it. It must not decide
which processes are in scope (chaosgpu.scope does) nor read more of /proc than those checks need.

Command line: `python signal_processes.py SIGNAL [TARGETS_JSON] [--allow-other-users]
[--allow-ns-init]`; TARGETS_JSON (a list of targets, or `{"targets": [...]}`) is read from stdin
when absent. Prints one JSON document; exit 0, or 2 with `{"error": ...}` on bad input.
"""

import json
import os
import signal
import sys
import time

__all__ = ["SIGNALS", "signal_targets", "parse_signal", "protected_pids", "main"]

SCHEMA = "chaosgpu.signal/1"
PF_KTHREAD = 0x00200000
# The signals a chaos experiment has a reason to send. Anything else is refused as bad input.
SIGNALS = ("SIGKILL", "SIGTERM", "SIGSTOP", "SIGCONT", "SIGINT", "SIGQUIT", "SIGHUP",
           "SIGUSR1", "SIGUSR2", "SIGABRT", "SIGTSTP")


class SignalInputError(ValueError):
    """Raised for input that names no valid signal or target; nothing was signalled."""


def parse_signal(name):
    """Return the signal number for a name such as 'SIGKILL' or 'KILL' (case-insensitive)."""
    if not isinstance(name, str) or not name.strip():
        raise SignalInputError(f"signal must be a name such as 'SIGKILL', got {name!r}")
    canonical = name.strip().upper()
    if not canonical.startswith("SIG"):
        canonical = "SIG" + canonical
    if canonical not in SIGNALS:
        raise SignalInputError(
            f"unsupported signal {name!r}; expected one of {', '.join(SIGNALS)}")
    return int(getattr(signal, canonical))


def _read_stat(pid):
    """Return (state, ppid, flags, starttime) from /proc/PID/stat, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(b")") + 2:].split()
    # fields[0] is field 3 (state); ppid is field 4, flags field 9, starttime field 22.
    return fields[0].decode(), int(fields[1]), int(fields[6]), int(fields[19])


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


def _signal_one(target, signum, protected, allow_other_users, allow_ns_init, my_uid):
    pid = target["pid"]
    expected = target.get("starttime")
    if pid in protected:
        if pid == 1:
            return _result(target, "refused", "pid1", "PID 1 of this namespace is never signalled")
        return _result(target, "refused", "runner",
                       f"PID {pid} is the runner or one of its ancestors")
    if expected is None:
        return _result(target, "refused", "no_identity",
                       f"no starttime given for PID {pid}: its identity cannot be checked")
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return _result(target, "refused", "no_pidfd",
                       "this Python has no pidfd support (needs Python 3.9+ on Linux 5.3+): "
                       "signals are never sent by bare PID")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _result(target, "gone", reason_code="exited", reason="no such process")
    except OSError as error:
        return _result(target, "refused", "pidfd", f"pidfd_open failed: {error}")
    try:
        # Identity check AFTER opening: if the start time still matches now, the pidfd holds it.
        stat = _read_stat(pid)
        status = _read_status(pid)
        if stat is None or status is None:
            return _result(target, "gone", reason_code="exited", reason="exited while checked")
        state, _ppid, flags, starttime = stat
        if starttime != expected:
            return _result(target, "refused", "reused",
                           f"PID {pid} now belongs to another process (starttime {starttime}, "
                           f"expected {expected})")
        if flags & PF_KTHREAD:
            return _result(target, "refused", "kernel_thread", f"PID {pid} is a kernel thread")
        uids, nspid = status
        if len(nspid) > 1 and nspid[-1] == 1 and not allow_ns_init:
            return _result(target, "refused", "ns_init",
                           f"PID {pid} is PID 1 of its namespace (set include_ns_init to allow)")
        if not allow_other_users and any(uid != my_uid for uid in uids):
            owner = "/".join(str(u) for u in uids)
            return _result(target, "refused", "other_user",
                           f"PID {pid} belongs to UID {owner}, not {my_uid} "
                           "(set include_other_users to allow)")
        if state in ("Z", "X"):
            return _result(target, "gone", reason_code="zombie",
                           reason="already dead (zombie, not reaped)", state=state)
        try:
            signal.pidfd_send_signal(pidfd, signum)
        except ProcessLookupError:
            return _result(target, "gone", reason_code="exited", reason="exited before the signal")
        except PermissionError as error:
            return _result(target, "refused", "permission", f"the kernel refused: {error}")
        return _result(target, "sent", state=state, sent_at=time.time())
    finally:
        os.close(pidfd)


def signal_targets(targets, signal_name, allow_other_users=False, allow_ns_init=False,
                   runner_pid=None):
    """Signal each target through a pidfd after the identity and refusal checks; return a report.

    `targets` is a list of {"pid", "starttime"} (PIDs as this process sees them). The report is
    {"schema", "signal", "results": [...], "sent", "refused", "gone"} (counts). `runner_pid`
    adds another process whose ancestors are protected (this process's always are). Raises
    SignalInputError on bad input, before anything is sent.
    """
    signum = parse_signal(signal_name)
    checked = _validate_targets(targets)
    protected = protected_pids()
    if runner_pid is not None:
        protected |= protected_pids(runner_pid)
    my_uid = os.getuid()
    results = []
    seen = set()
    for target in checked:
        key = (target["pid"], target.get("starttime"))
        if key in seen:
            continue
        seen.add(key)
        results.append(_signal_one(target, signum, protected, bool(allow_other_users),
                                   bool(allow_ns_init), my_uid))
    counts = {name: sum(1 for r in results if r["result"] == name)
              for name in ("sent", "refused", "gone")}
    report = {"schema": SCHEMA, "signal": signal.Signals(signum).name, "results": results}
    report.update(counts)
    return report


def main(argv=None):
    """Command-line entry: print one JSON document (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    flags = {"--allow-other-users": False, "--allow-ns-init": False}
    positional = []
    for arg in args:
        if arg in flags:
            flags[arg] = True
        elif arg in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            positional.append(arg)
    try:
        if not positional or len(positional) > 2:
            raise SignalInputError("usage: signal_processes.py SIGNAL [TARGETS_JSON] "
                                   "[--allow-other-users] [--allow-ns-init]")
        raw = positional[1] if len(positional) == 2 else sys.stdin.read()
        try:
            targets = json.loads(raw)
        except ValueError as error:
            raise SignalInputError(f"targets are not valid JSON: {error}") from None
        report = signal_targets(targets, positional[0],
                                allow_other_users=flags["--allow-other-users"],
                                allow_ns_init=flags["--allow-ns-init"])
    except SignalInputError as error:
        print(json.dumps({"schema": SCHEMA, "error": str(error)}))
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
