"""Declared scopes: which processes an experiment may touch.

An experiment names its targets with a scope dict (docs/ARCHITECTURE.md "Tags and scope"):
exactly one of `{"sandbox": name}`, `{"job": id}`, `{"tag": tag}`, `{"pids": [..]}`,
`{"pod": "ns/name" | pod uid}`, plus the options `include_other_users` and `include_ns_init`
(both false by default). This module owns validating that dict (clear errors, nothing changed)
and resolving it to the census's process dicts, minus what is never in scope: the host's PID 1,
the runner and its ancestors, kernel threads, other users' processes and namespace inits unless
allowed. It also remembers which selections this run has met (a scope that matched a process, a
workload started under a tag), so that a probe can tell a selection that ended from a typo
(`resolve_observed`, with chaosgpu.arguments.missing_allowed). It must not read /proc itself (the
census does) nor send signals (the in-target program `actions/signal_processes.py` does, and
re-checks every rule at send time).
"""

import logging
import os
from typing import Any

from chaosgpu.arguments import NAME, TAG, Rule, missing_advice
from chaosgpu.errors import InvalidArgument

__all__ = ["ScopeError", "KINDS", "SCOPE", "validate_scope", "resolve_scope",
           "resolve_scope_detail", "describe_scope", "take_census", "remember",
           "seen_in_this_run", "tag_seen", "resolve_observed"]

logger = logging.getLogger("chaostoolkit")

KINDS = ("sandbox", "job", "tag", "pids", "pod")
OPTIONS = ("include_other_users", "include_ns_init")


class ScopeError(InvalidArgument):
    """A scope that cannot be used: missing, malformed or naming nothing resolvable."""


def validate_scope(scope: Any) -> dict[str, Any]:
    """Check a scope dict and return a normalised copy; raise ScopeError naming what is wrong."""
    if scope is None or scope == {} or scope == "":
        raise ScopeError("no scope given: declare a scope, one of "
                         + ", ".join(f'{{"{k}": ...}}' for k in KINDS))
    if not isinstance(scope, dict):
        raise ScopeError(f"a scope must be a dict such as {{\"tag\": \"my-workers\"}}, "
                         f"got {type(scope).__name__} {scope!r}")
    unknown = sorted(set(scope) - set(KINDS) - set(OPTIONS))
    if unknown:
        raise ScopeError(f"unknown scope key(s) {unknown}; expected one of {list(KINDS)} "
                         f"plus optional {list(OPTIONS)}")
    kinds = [k for k in KINDS if k in scope]
    if not kinds:
        raise ScopeError("declare a scope: the scope names no target, expected one of "
                         f"{list(KINDS)}")
    if len(kinds) > 1:
        raise ScopeError(f"a scope names exactly one kind of target, got {kinds}")
    kind = kinds[0]
    value = scope[kind]
    if kind == "pids":
        value = _checked_pids(value)
    else:
        _check_selection(kind, value)
    normalised: dict[str, Any] = {kind: value}
    for option in OPTIONS:
        flag = scope.get(option, False)
        if not isinstance(flag, bool):
            raise ScopeError(f"scope option '{option}' must be true or false, got {flag!r}")
        normalised[option] = flag
    return normalised


#: The rule of an activity's `scope` argument: validate_scope's own check, so a typo'd key
#: or a bad selection is refused by the activity (ScopeError) and, before a run, by
#: `chaosgpu validate` and the control's pre-run check. None passes where the activity
#: declares it (chaosgpu.arguments.checked).
SCOPE = Rule.by_check("a valid scope", validate_scope, error=ScopeError)


def _check_selection(kind: str, value: Any) -> None:
    """Refuse a tag, job id, sandbox name or pod a scope names that could not match exactly: a
    selection is compared as given, never stripped, so `{"tag": "x "}` can never reach the
    processes tagged `x` (TAG; NAME for the others: chaosgpu.arguments)."""
    rule = TAG if kind == "tag" else NAME
    if not rule.accepts(value):
        raise ScopeError(f"scope '{kind}' {rule.must(value)}, got {value!r}")


def _checked_pids(value: Any) -> list[Any]:
    """A `pids` scope's entries, sorted by PID: each a positive PID, or {"pid": PID,
    "starttime": clock ticks} (as `chaosgpu snapshot` and the faults' results give them) to
    be matched only while that PID still holds the process started then."""
    if not isinstance(value, list) or not value:
        raise ScopeError(f"scope 'pids' must be a non-empty list of PIDs, got {value!r}")
    entries: dict[int, Any] = {}
    for entry in value:
        pid = entry.get("pid") if isinstance(entry, dict) else entry
        start = entry.get("starttime") if isinstance(entry, dict) else None
        if isinstance(entry, dict) and (set(entry) != {"pid", "starttime"} or isinstance(
                start, bool) or not isinstance(start, int) or start < 0):
            raise ScopeError(f"scope 'pids' entries are a PID or {{\"pid\": PID, \"starttime\": "
                             f"clock ticks}}, got {entry!r}")
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise ScopeError(f"scope 'pids' must hold positive integers, got {pid!r}")
        if pid in entries and entries[pid] != entry:
            raise ScopeError(f"scope 'pids' names PID {pid} twice, as {entries[pid]!r} and "
                             f"{entry!r}")
        entries[pid] = entry
    return [entries[pid] for pid in sorted(entries)]


def pid_starttimes(scope: dict[str, Any]) -> dict[int, int | None]:
    """{PID: the start time it must have, or None for any} of a validated `pids` scope."""
    return {entry["pid"]: entry["starttime"] for entry in scope.get("pids") or []
            if isinstance(entry, dict)} | {entry: None for entry in scope.get("pids") or []
                                           if isinstance(entry, int)}


def describe_scope(scope: dict[str, Any]) -> str:
    """Return a short human description of a validated scope, e.g. `tag=ring-1`."""
    kind = next(k for k in KINDS if k in scope)
    return f"{kind}={scope[kind]}"


def take_census(**kwargs: Any) -> dict[str, Any]:
    """Take the census through chaosgpu.node (or the in-target program itself if absent)."""
    try:
        from chaosgpu.node import take_census as node_take_census
    except ImportError:
        from chaosgpu.intarget import load

        return load("probes", "node_census").census(**kwargs)  # type: ignore[no-any-return]
    return node_take_census(**kwargs)  # type: ignore[no-any-return]


def _protected() -> set[int]:
    from chaosgpu.intarget import load

    return load("actions", "signal_processes").protected_pids()  # type: ignore[no-any-return]


def _is_kernel_thread(proc: dict[str, Any]) -> bool:
    if proc.get("kthread") is not None:
        return bool(proc["kthread"])
    return proc.get("pid") == 2 or (proc.get("ppid") == 2 and not proc.get("cmdline"))


def _sandbox_pid_ns(name: str) -> tuple[str | None, int | None]:
    """Return (pid namespace, host PID of its PID 1) recorded for sandbox `name`."""
    from chaosgpu import state

    try:
        record = state.read_record("sandboxes", name)
    except ValueError as error:
        raise ScopeError(f"invalid sandbox name {name!r}: {error}") from None
    if record is None:
        raise ScopeError(f"no sandbox named {name!r} is recorded in {state.state_dir()}")
    pid_ns = record.get("pid_ns")
    init_pid = None
    for key in ("init_pid", "pid1", "host_pid", "pid"):
        if isinstance(record.get(key), int):
            init_pid = record[key]
            break
    init = record.get("init")
    if init_pid is None and isinstance(init, dict) and isinstance(init.get("pid"), int):
        init_pid = init["pid"]
    return (pid_ns if isinstance(pid_ns, str) else None), init_pid


def _sandbox_init_starttime(name: str) -> int | None:
    """The start time recorded for sandbox `name`'s PID 1 (None when not recorded)."""
    from chaosgpu import state

    record = state.read_record("sandboxes", name) or {}
    starttime = record.get("pid1_starttime")
    return starttime if isinstance(starttime, int) else None


# (kind, value) of every tag, job or pod uid this process has met: a scope that matched a process,
# a workload it started. Once met, a selection that matches nothing has ended (not a typo).
_SEEN_SELECTIONS: set[tuple[str, str]] = set()


def remember(kind: str, value: str) -> None:
    """Note that this run met the selection `kind`=`value` ("tag", "job" or "pod"): a workload
    it started, or a scope that matched a process. When it later matches nothing, it ended."""
    _SEEN_SELECTIONS.add((kind, value))


def _workload_record(tag: str) -> dict[str, Any] | None:
    from chaosgpu import state

    try:
        return state.read_record("workloads", tag)
    except ValueError:
        return None


def _sampled_tags() -> set[str]:
    """The tags of the processes the experiment's timeline has tracked (none without one)."""
    from chaosgpu.timeline.sampler import current

    sampler = current()
    if sampler is None:
        return set()
    return {str(entry["tag"]) for entry in list(sampler.processes.values())
            if isinstance(entry, dict) and entry.get("tag")}


def _job_seen(job: str | None, tag: str | None) -> bool:
    try:
        from chaosgpu.job.observe import seen
    except ImportError:  # pragma: no cover (the job modules ship with chaosgpu)
        return False
    return seen(job, tag)


def tag_seen(tag: str) -> bool:
    """Whether this run has met tag `tag`: a workload it started (or one recorded now), a process
    carrying it seen by a scope, the timeline or the job probes. A tag met nowhere is a typo."""
    return (("tag", tag) in _SEEN_SELECTIONS or tag in _SEEN_TAGS.values()
            or _workload_record(tag) is not None or tag in _sampled_tags()
            or _job_seen(None, tag))


def _job_recorded(job: str) -> bool:
    from chaosgpu import state

    return any(isinstance(r, dict) and r.get("job_id") == job
               for r in state.list_records("workloads").values())


def seen_in_this_run(scope: dict[str, Any]) -> bool:
    """Whether the selection of a validated scope is one this run has met (see `tag_seen`; a job
    id, a pod uid likewise; a sandbox: recorded or created by this process). PIDs are numbers
    taken from an earlier result, not names: always true (a PID that is gone has ended)."""
    if "pids" in scope:
        return True
    if "tag" in scope:
        return tag_seen(scope["tag"])
    if "job" in scope:
        return (("job", scope["job"]) in _SEEN_SELECTIONS or _job_seen(scope["job"], None)
                or _job_recorded(scope["job"]))
    if "sandbox" in scope:
        from chaosgpu import state
        from chaosgpu.sandbox import runtime

        try:
            recorded = state.read_record("sandboxes", scope["sandbox"]) is not None
        except ValueError:
            recorded = False
        return recorded or runtime.created_here(scope["sandbox"])
    return ("pod", scope["pod"]) in _SEEN_SELECTIONS


# (pid, starttime) -> tag, for every tagged process this process has seen: a zombie's environment
# cannot be read any more, so its tag is remembered from when it was alive. Only a process whose
# environment cannot be read is matched this way: one that reads without the tag (an exec into
# another environment keeps the PID and start time) is out of the tag's scope.
_SEEN_TAGS: dict[tuple[int, int], str] = {}


def _recorded_members(tag: str) -> set[tuple[int, int]]:
    """(pid, starttime) of the processes a workload record `tag` lists (for zombies)."""
    from chaosgpu import state

    try:
        record = state.read_record("workloads", tag)
    except ValueError:
        return set()
    members: set[tuple[int, int]] = set()
    if not record:
        return members
    entries: list[Any] = []
    for key in ("processes", "workers", "ranks", "pids"):
        value = record.get(key)
        if isinstance(value, list):
            entries.extend(value)
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int) \
                and isinstance(entry.get("starttime"), int):
            members.add((entry["pid"], entry["starttime"]))
    return members


def _tagged(tag: str, processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    recorded: set[tuple[int, int]] | None = None
    for proc in processes:
        key = (proc.get("pid"), proc.get("starttime"))
        if proc.get("tag") is not None:
            if isinstance(key[0], int) and isinstance(key[1], int):
                _SEEN_TAGS[key] = proc["tag"]  # type: ignore[index]
            if proc["tag"] == tag:
                found.append(proc)
            continue
        if not (proc.get("zombie") or proc.get("state") in ("Z", "X")
                or "env" in (proc.get("unreadable") or [])):
            continue  # its environment reads without the tag: not in the tag's scope
        if _SEEN_TAGS.get(key) == tag:  # type: ignore[arg-type]
            found.append(proc)
            continue
        if recorded is None:
            recorded = _recorded_members(tag)
        if key in recorded:
            found.append(proc)
    return found


def _candidates(scope: dict[str, Any], census: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                                        list[dict[str, Any]]]:
    processes: list[dict[str, Any]] = census.get("processes") or []
    by_pid = {p["pid"]: p for p in processes}
    missing: list[dict[str, Any]] = []
    if "pids" in scope:
        found = []
        for pid, start in pid_starttimes(scope).items():
            if pid not in by_pid:
                missing.append({"pid": pid, "reason": "no such process (or not visible here)"})
            elif start is not None and by_pid[pid].get("starttime") != start:
                missing.append({"pid": pid, "reason": f"PID reused: the process started at "
                                f"{start} ended; PID {pid} now holds another, started at "
                                f"{by_pid[pid].get('starttime')}"})
            else:
                found.append(by_pid[pid])
        return found, missing
    if "tag" in scope:
        return _tagged(scope["tag"], processes), missing
    if "job" in scope:
        jobs = [j for j in census.get("jobs") or [] if j.get("id") == scope["job"]]
        if not jobs:
            return [], [{"job": scope["job"], "reason": "no such job in the census"}]
        pids = [r.get("pid") for r in jobs[0].get("ranks", []) if r.get("pid") is not None]
        return [by_pid[pid] for pid in pids if pid in by_pid], missing
    if "sandbox" in scope:
        pid_ns, init_pid = _sandbox_pid_ns(scope["sandbox"])
        # The recorded namespace is the sandbox's only while its PID 1 (same start time) still
        # exists: the kernel reuses a freed namespace's inode number for the next one created.
        init = by_pid.get(init_pid) if init_pid is not None else None
        if init is None or init.get("starttime") != _sandbox_init_starttime(scope["sandbox"]):
            return [], [{"sandbox": scope["sandbox"],
                         "reason": "its PID 1 is gone (the sandbox is not running)"}]
        if pid_ns is None:
            pid_ns = init.get("pid_ns")
        if pid_ns is None:
            return [], [{"sandbox": scope["sandbox"],
                         "reason": "its PID namespace is not known (the sandbox is gone?)"}]
        return [p for p in processes if p.get("pid_ns") == pid_ns], missing
    # pod: a pod uid seen in the container identity of local processes.
    pod = scope["pod"]
    found = [p for p in processes
             if isinstance(p.get("container"), dict) and p["container"].get("pod_uid") == pod]
    if not found:
        missing.append({"pod": pod, "reason": "no local process carries this pod uid; pods by "
                        "namespace/name are resolved by chaosgpu.k8s on the cluster"})
    return found, missing


def resolve_scope_detail(scope: Any, census: dict[str, Any] | None = None,
                         observe: bool = False) -> dict[str, Any]:
    """Resolve a scope to census processes; return {"scope", "processes", "excluded", "missing"}.

    `excluded` lists processes the scope named but that may not be touched, each with a reason
    (host PID 1, the runner or an ancestor, a kernel thread, another user, a namespace init);
    `missing` lists what the scope named but the census did not find. With `observe` (probes
    that only look), other users' processes and namespace inits are kept.
    """
    checked = validate_scope(scope)
    if census is None:
        census = take_census(gpu=False)
    candidates, missing = _candidates(checked, census)
    kind = next(k for k in KINDS if k in checked)
    if candidates and kind in ("tag", "job", "pod"):
        remember(kind, checked[kind])
    protected = _protected()
    uid = os.getuid()
    kept: list[dict[str, Any]] = []
    excluded: list[dict[str, Any]] = []
    for proc in candidates:
        pid = proc.get("pid")
        reason = None
        if pid == 1:
            reason = "PID 1 of the observer's namespace is never in scope"
        elif pid in protected:
            reason = "the runner or one of its ancestors"
        elif _is_kernel_thread(proc):
            reason = "a kernel thread"
        elif proc.get("uid") is not None and proc.get("uid") != uid \
                and not (checked["include_other_users"] or observe):
            reason = f"owned by UID {proc.get('uid')} (set include_other_users to allow)"
        elif proc.get("ns_init") and not (checked["include_ns_init"] or observe):
            reason = "PID 1 of its namespace (set include_ns_init to allow)"
        if reason:
            excluded.append({"pid": pid, "comm": proc.get("comm"), "reason": reason})
        else:
            kept.append(proc)
    return {"scope": checked, "processes": kept, "excluded": excluded, "missing": missing}


def resolve_scope(scope: Any, census: dict[str, Any] | None = None,
                  observe: bool = False) -> list[dict[str, Any]]:
    """Return the census process dicts a scope resolves to, minus those never in scope."""
    return resolve_scope_detail(scope, census, observe)["processes"]  # type: ignore[no-any-return]


def resolve_observed(scope: Any, missing_ok: Any, census: dict[str, Any] | None = None,
                     observe: bool = True) -> dict[str, Any]:
    """resolve_scope_detail for an activity that reports on a scope (a probe, a rollback): a
    scope that matches nothing (no process, none excluded) is accepted only where
    chaosgpu.arguments' missing_allowed(missing_ok, seen) allows it, `seen` being whether this
    run has met the selection (`seen_in_this_run`: a workload it started, a process once
    matched); otherwise ScopeError, so a typo'd tag, job, pod or sandbox never reads as "nothing
    there". A sandbox that is not recorded reads as empty on the same terms. A bad `missing_ok`
    is refused before anything is read. The detail gains "matched" (false when nothing was)."""
    from chaosgpu.arguments import missing_allowed

    checked = validate_scope(scope)
    missing_allowed(missing_ok, True)  # a bad value is refused whatever the scope matches
    try:
        detail = resolve_scope_detail(checked, census, observe)
    except ScopeError as error:
        if "sandbox" not in checked or "no sandbox named" not in str(error):
            raise
        if not missing_allowed(missing_ok, seen_in_this_run(checked)):
            raise ScopeError(f"{error}: a typo? A sandbox that may be absent "
                             f"{missing_advice(missing_ok)}") from None
        return {"scope": checked, "processes": [], "excluded": [], "matched": False,
                "missing": [{"sandbox": checked["sandbox"], "reason": "not recorded"}]}
    detail["matched"] = bool(detail["processes"] or detail["excluded"])
    if detail["matched"] or missing_allowed(missing_ok, seen_in_this_run(checked)):
        return detail
    raise ScopeError(
        f"scope {describe_scope(checked)} matches no process, and this run never met it (no "
        f"workload it started, no process seen carrying it): a typo? Check it with `chaosgpu "
        f"snapshot`. A selection that may be absent {missing_advice(missing_ok)}; missing: "
        f"{detail['missing']}")
