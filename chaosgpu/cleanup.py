"""`chaosgpu cleanup`: remove everything chaosgpu left behind on this node, after any run,
including one whose runner crashed or was killed, and nothing of a run still in progress.

What is left behind: a record (partition, workload, sandbox, a pod deletion's timings) whose
runner is gone, and the freezes such a runner never resumed (chaosgpu.freezelog: processes it
stopped are sent SIGCONT, those it left in chaosgpu's freezer groups are thawed). A record
whose runner still lives (same PID and start time, not this process) belongs to a run in
progress, maybe another team's game-day sharing the state dir: it is kept and listed under
"kept" (`--include-running` removes it too). chaosgpu's freezer groups are host-wide (another
state dir's run may own one): only the processes this cleanup removes (those of the workloads
and sandboxes it removes, and those of `--tag`) are thawed out of them; other frozen members are
listed under "left_frozen" (`--thaw-all` thaws every chaosgpu freezer group, as before round
22).

Order: heal chaosgpu's network partitions (their nftables tables, by record), resume the
freezes of runners that are gone, thaw chaosgpu's freezer cgroups (a frozen process ignores
SIGKILL until thawed), stop
every workload recorded in the state dir (chaosgpu.workloads.actions.stop_workload: SIGCONT,
SIGTERM, grace, SIGKILL, by recorded PID + start time), then remove every recorded sandbox
(chaosgpu.sandbox.actions.remove_sandbox), then, for each `--tag`, every live process carrying
that tag (chaosgpu.job.hang.cleanup), then the pod deletion records (evidence only) of ended
runs, and last the GPU injector's trigger files of processes that are gone. Every workload and
sandbox is taken from the state dir's records (`missing_ok`: one removed between listing and
removal, by a rollback running beside it, has ended: it is no typo); a `--tag` is matched
exactly (chaosgpu.arguments.TAG: one with whitespace or a control character is bad usage).
It reports what it removed and, honestly, what it could not; exit status 0 when nothing is
left alive (zombies whose parent has not reaped them yet are listed, they hold no memory), 1
otherwise, 2 on bad usage.

This module owns the order and the report. It signals nothing itself (the workload, sandbox
and job modules do, through pidfds) and must not remove anything it has no record or tag of.
"""

import argparse
import json
import os
import sys
import time
from typing import Any

from chaosgpu.arguments import POSITIVE_SECONDS, SECONDS, TAG, option

__all__ = ["cleanup_all", "main"]

#: chaosgpu.k8s.deletion.RECORD_KIND (not imported here: that loads the Kubernetes client).
K8S_DELETION_RECORDS = "k8s_deletions"


def _safe(step: str, func: Any, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    try:
        return func(*args, **kwargs), None
    except Exception as error:  # one bad record must not stop the rest of the cleanup
        return None, f"{step}: {type(error).__name__}: {error}"


def _run_in_progress(record: dict[str, Any]) -> dict[str, Any] | None:
    """The runner of `record` (a workload's or partition's "runner", a sandbox's "owner") when
    it still lives and is not this process: the record belongs to a run in progress. None when
    the runner is gone, is this process, or is not recorded."""
    from chaosgpu.node import process_starttime

    runner = record.get("runner") or record.get("owner")
    if not isinstance(runner, dict) or not isinstance(runner.get("pid"), int):
        return None
    pid = runner["pid"]
    if pid == os.getpid() or runner.get("starttime") is None:
        return None
    return runner if process_starttime(pid) == runner["starttime"] else None


def _record_pids(record: dict[str, Any]) -> set[int]:
    """The host PIDs a workload or sandbox record names (its processes, its PID 1 and
    supervisor): those a cleanup that removes it may thaw out of a freezer group."""
    pids = {p.get("pid") for p in record.get("processes") or [] if isinstance(p, dict)}
    for key in ("pid", "init_pid", "host_pid", "supervisor_pid"):
        pids.add(record.get(key))
    for key in ("init", "supervisor"):
        if isinstance(record.get(key), dict):
            pids.add(record[key].get("pid"))
    return {pid for pid in pids if isinstance(pid, int)}


def _kept(kind: str, name: str, runner: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "name": name, "runner": runner,
            "reason": f"its run is in progress (runner PID {runner['pid']} lives): "
                      "--include-running removes it too"}


class _Report:
    """What a cleanup removed, could not remove, kept (runs in progress) and found dead."""

    def __init__(self) -> None:
        self.removed: list[dict[str, Any]] = []
        self.not_removed: list[dict[str, Any]] = []
        self.kept: list[dict[str, Any]] = []
        self.zombies: list[dict[str, Any]] = []

    def outcome(self, kind: str, name: str, step: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one removal step; note it removed (its result as detail) or not (its error)."""
        result, error = _safe(f"{kind} {name}", step, *args, **kwargs)
        if error:
            self.not_removed.append({"kind": kind, "name": name, "reason": error})
        return result if error is None else None


def _ended_runs(kind: str, include_running: bool, report: _Report) -> dict[str, dict[str, Any]]:
    """The records of `kind` whose run has ended (all with `include_running`); the others go
    to the report's "kept"."""
    from chaosgpu import state

    chosen: dict[str, dict[str, Any]] = {}
    for name, record in sorted(state.list_records(kind).items()):
        runner = None if include_running else _run_in_progress(record)
        if runner is not None:
            report.kept.append(_kept(kind.rstrip("s"), name, runner))
        else:
            chosen[name] = record
    return chosen


def _undo_freezes(include_running: bool, report: _Report) -> set[int]:
    """Resume what runners that are gone froze and never resumed (chaosgpu.freezelog): a
    SIGCONT to each such process still stopped (same PID and start time); return the PIDs
    they left in chaosgpu's freezer groups, for _thaw. A runner's file goes once nothing of
    it is left to resume; one of a run in progress is kept."""
    from chaosgpu import freezelog
    from chaosgpu.node import process_starttime, process_state
    from chaosgpu.process.actions import STOP_KINDS, send

    in_freezer: set[int] = set()
    for name, run in (report.outcome("freezes", "folder", freezelog.runs) or {}).items():
        runner = None if include_running else _run_in_progress(run)
        left = report.outcome("freeze", name, freezelog.outstanding, name)
        if left is None:
            continue  # unreadable or not trusted (the report says why): nothing resumed by it
        live = [e for e in left if process_starttime(e["pid"]) == e["starttime"]]
        if runner is not None:
            if live:  # a run in progress that holds processes frozen: its own to resume
                report.kept.append(_kept("freeze", name, runner))
            continue
        if not live:  # what it froze has ended: nothing to resume
            freezelog.remove(name)
            continue
        in_freezer |= {e["pid"] for e in live if "freezer" in e["kinds"]}
        stopped = [e for e in live if set(e["kinds"]) & set(STOP_KINDS)
                   and process_state(e["pid"], starttime=e["starttime"]) == "T"]
        # the record names these very processes (PID and start time) as this chaosgpu's
        # freezes: resuming them is undoing its own fault, whoever owns them
        sent = report.outcome("freeze", name, send, stopped, "SIGCONT",
                              {"include_other_users": True, "include_ns_init": True}) \
            if stopped else {"results": []}
        if sent is None:
            continue  # not resumed (the report says why): the file stays for a later cleanup
        failed = [r for r in sent["results"] if r["result"] not in ("sent", "gone")]
        for result in failed:
            report.not_removed.append({"kind": "freeze", "name": name, "pid": result["pid"],
                                       "reason": f"SIGCONT not sent: {result['result']}: "
                                                 f"{result.get('reason')}"})
        if not failed:
            freezelog.remove(name)
        report.removed.append({"kind": "freeze", "name": name, "detail": {
            "resumed": [r["pid"] for r in sent["results"] if r["result"] == "sent"],
            "in_freezer": sorted(e["pid"] for e in live if "freezer" in e["kinds"])}})
    return in_freezer


def _thaw(records: list[dict[str, Any]], tags: list[str], thaw_all: bool,
          report: _Report, pids: set[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Thaw out of chaosgpu's freezer groups `pids` and the processes of `records` and of
    `tags` (every member of every group with `thaw_all`): (thawed groups, members left
    frozen)."""
    from chaosgpu.process.actions import _thaw_freezer_groups

    thawing: set[int] | None = None
    if not thaw_all:
        from chaosgpu.scope import resolve_scope

        thawing = set(pids)
        for record in records:
            thawing |= _record_pids(record)
        for tag in tags:
            found = report.outcome("tag", tag, resolve_scope, {"tag": tag}, observe=True)
            thawing |= {p["pid"] for p in found or []}
    thawed = report.outcome("freezer", "groups", _thaw_freezer_groups, thawing,
                            untouched=True) or []
    left = [{"cgroup": g["cgroup"], "pids": g["left_frozen"]} for g in thawed
            if g.get("left_frozen")]
    return [g for g in thawed if g.get("pids")], left


def _stop_workload(tag: str, grace_s: float, deadline_s: float, report: _Report) -> None:
    """Stop one recorded workload (stop_workload raises, keeping its record, while a process
    of it survives: that is "not removed", with the survivors named)."""
    from chaosgpu.workloads.actions import stop_workload

    result = report.outcome("workload", tag, stop_workload, tag, grace_s=grace_s,
                            deadline_s=deadline_s, missing_ok=True)
    if result is not None:
        report.removed.append({"kind": "workload", "name": tag, "detail": result})


def _clean_tag(tag: str, grace_s: float, deadline_s: float, report: _Report) -> None:
    from chaosgpu.job.hang import cleanup as cleanup_tagged

    result = report.outcome("tag", tag, cleanup_tagged, tag=tag, grace_s=grace_s,
                            deadline_s=deadline_s)
    if result is None:
        return
    for item in result.get("not_removed") or []:
        report.not_removed.append({"kind": "process", "name": tag, **item})
    for item in result.get("zombies") or []:
        report.zombies.append({"kind": "process", "name": tag, **item})
    ended = result.get("ended_by_themselves") or []
    if result.get("removed") or ended:
        report.removed.append({"kind": "tag", "name": tag, "pids": result["removed"],
                               "ended_by_themselves": ended, "detail": result})


def cleanup_all(grace_s: float = 2.0, deadline_s: float = 30.0,
                tags: list[str] | None = None, include_running: bool = False,
                thaw_all: bool = False) -> dict[str, Any]:
    """Heal every recorded partition, remove every recorded workload and sandbox (and processes
    of `tags`) and stale injector files, leaving alone records whose runner still lives (a run
    in progress: "kept") unless `include_running`; thaw out of chaosgpu's freezer groups only
    the processes this cleanup removes, unless `thaw_all`. Return the report {"removed": [...],
    "not_removed": [...], "kept": [...], "zombies": [...], "thawed_cgroups": [...],
    "left_frozen": [...], "injector_files_removed", "took_s"}."""
    from chaosgpu import state
    from chaosgpu.gpu import injector
    from chaosgpu.network import partitions
    from chaosgpu.sandbox.actions import remove_sandbox

    started = time.monotonic()
    report = _Report()
    for ident in _ended_runs(partitions.KIND, include_running, report):
        healed = report.outcome("partition", ident, partitions.remove, ident)
        if healed is not None:
            report.removed.append({"kind": "partition", "name": ident, "detail": healed})
    workloads = _ended_runs("workloads", include_running, report)
    sandboxes = _ended_runs("sandboxes", include_running, report)
    left_by_crashed_runs = _undo_freezes(include_running, report)
    thawed, left_frozen = _thaw([*workloads.values(), *sandboxes.values()], tags or [],
                                thaw_all, report, left_by_crashed_runs)
    for tag in workloads:
        _stop_workload(tag, grace_s, deadline_s, report)
    for name in sandboxes:
        result = report.outcome("sandbox", name, remove_sandbox, name, missing_ok=True)
        if result is not None:
            report.removed.append({"kind": "sandbox", "name": name, "detail": result})
    for tag in tags or []:
        _clean_tag(tag, grace_s, deadline_s, report)
    for name, record in sorted(state.list_records(K8S_DELETION_RECORDS).items()):
        # evidence, not a resource: a later run's probes never read another run's timings;
        # those of a run in progress are its own, left alone without a word (nothing is held)
        if not include_running and _run_in_progress(record) is not None:
            continue
        removed = report.outcome("k8s-deletion-record", name, state.remove_record,
                                 K8S_DELETION_RECORDS, name)
        if removed is not None:
            report.removed.append({"kind": "k8s-deletion-record", "name": name,
                                   "detail": {"removed": removed}})
    swept = report.outcome("injector-files", "stale", injector.sweep, injector.inject_dir())
    return {"removed": report.removed, "not_removed": report.not_removed, "kept": report.kept,
            "zombies": report.zombies, "thawed_cgroups": thawed, "left_frozen": left_frozen,
            "injector_files_removed": swept or 0, "state_dir": str(state.state_dir()),
            "took_s": round(time.monotonic() - started, 3)}


def main(argv: list[str] | None = None) -> int:
    """Command line: `chaosgpu cleanup [--grace-s S] [--deadline-s S] [--tag T]...
    [--include-running] [--thaw-all] [--json]`."""
    parser = argparse.ArgumentParser(
        prog="chaosgpu cleanup",
        description="Remove every partition, sandbox and workload chaosgpu recorded whose run "
                    "has ended (its runner is gone: safe after a crashed run, safe to run "
                    "twice, never a run in progress), and optionally every process carrying a "
                    "tag.")
    parser.add_argument("--grace-s", type=option(SECONDS), default=2.0,
                        help="SIGTERM grace before SIGKILL (default 2)")
    parser.add_argument("--deadline-s", type=option(POSITIVE_SECONDS), default=30.0,
                        help="how long to wait for processes to die after SIGKILL (default 30)")
    parser.add_argument("--tag", action="append", default=[], type=option(TAG, str),
                        help="also remove live processes carrying CHAOSGPU_TAG=TAG (repeatable)")
    parser.add_argument("--include-running", action="store_true",
                        help="also remove the records of runs still in progress (their runner "
                             "lives: maybe another team's game-day)")
    parser.add_argument("--thaw-all", action="store_true",
                        help="thaw every chaosgpu freezer group on the host, not only the "
                             "processes this cleanup removes (other state dirs' runs too)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    from chaosgpu.state import StateDirError

    try:
        report = cleanup_all(args.grace_s, args.deadline_s, args.tag,
                             include_running=args.include_running, thaw_all=args.thaw_all)
    except StateDirError as error:  # its records cannot be trusted: nothing was touched
        print(f"chaosgpu cleanup: {error}; nothing was removed", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"state dir: {report['state_dir']}")
        if not report["removed"] and not report["not_removed"] and not report["kept"]:
            print("nothing to clean up")
        for item in report["removed"]:
            print(f"removed {item['kind']} {item.get('name')}")
            for ended in item.get("ended_by_themselves") or []:
                print(f"  PID {ended['pid']}: {ended['note']}")
        for group in report["thawed_cgroups"]:
            print(f"thawed freezer cgroup {group['cgroup']}: PIDs {group['pids']}")
        for group in report["left_frozen"]:
            print(f"left frozen (not this cleanup's: --thaw-all thaws them): PIDs "
                  f"{group['pids']} in {group['cgroup']}")
        for item in report["kept"]:
            print(f"kept {item['kind']} {item['name']}: {item['reason']}")
        for item in report["zombies"]:
            print(f"dead, not yet reaped by its parent: PID {item['pid']} ({item['name']})")
        for item in report["not_removed"]:
            print(f"NOT removed {item['kind']} {item.get('name', '')}: {item.get('reason')}")
        if report["injector_files_removed"]:
            print(f"removed {report['injector_files_removed']} stale GPU injector file(s)")
        print(f"took {report['took_s']} s")
    return 1 if report["not_removed"] else 0


if __name__ == "__main__":
    sys.exit(main())
