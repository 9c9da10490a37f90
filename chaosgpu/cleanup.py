"""`chaosgpu cleanup`: remove everything chaosgpu left behind on this node, after any run,
including one whose runner crashed or was killed.

Order: heal chaosgpu's network partitions (their nftables tables, by record), thaw chaosgpu's
freezer cgroups (a frozen process ignores SIGKILL until thawed), stop
every workload recorded in the state dir (chaosgpu.workloads.actions.stop_workload: SIGCONT,
SIGTERM, grace, SIGKILL, by recorded PID + start time), then remove every recorded sandbox
(chaosgpu.sandbox.actions.remove_sandbox), then, for each `--tag`, every live process carrying
that tag (chaosgpu.job.hang.cleanup), and last removes the GPU injector's trigger files of
processes that are gone. Every workload and sandbox is taken from the state dir's records
(`missing_ok`: one removed between listing and removal, by a rollback running beside it, has
ended: it is no typo); a `--tag` is matched exactly (chaosgpu.arguments.TAG: one with
whitespace or a control character is bad usage). It reports what it removed and, honestly,
what it could not; exit status 0 when nothing is left alive (zombies whose parent has not
reaped them yet are listed, they hold no memory), 1 otherwise, 2 on bad usage.

This module owns the order and the report. It signals nothing itself (the workload, sandbox
and job modules do, through pidfds) and must not remove anything it has no record or tag of.
"""

import argparse
import json
import sys
import time
from typing import Any

from chaosgpu.arguments import POSITIVE_SECONDS, SECONDS, TAG, option

__all__ = ["cleanup_all", "main"]


def _safe(step: str, func: Any, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    try:
        return func(*args, **kwargs), None
    except Exception as error:  # one bad record must not stop the rest of the cleanup
        return None, f"{step}: {type(error).__name__}: {error}"


def cleanup_all(grace_s: float = 2.0, deadline_s: float = 30.0,
                tags: list[str] | None = None) -> dict[str, Any]:
    """Heal every recorded partition, remove every recorded workload and sandbox (and processes
    of `tags`) and stale injector files; return the report {"removed": [...], "not_removed":
    [...], "zombies": [...], "thawed_cgroups": [...], "injector_files_removed", "took_s"}."""
    from chaosgpu import state
    from chaosgpu.process.actions import _thaw_freezer_groups

    started = time.monotonic()
    removed: list[dict[str, Any]] = []
    not_removed: list[dict[str, Any]] = []
    zombies: list[dict[str, Any]] = []
    from chaosgpu.network import partitions

    for ident in sorted(state.list_records(partitions.KIND)):
        healed, error = _safe(f"partition {ident}", partitions.remove, ident)
        if error:
            not_removed.append({"kind": "partition", "name": ident, "reason": error})
        else:
            removed.append({"kind": "partition", "name": ident, "detail": healed})
    thawed, error = _safe("thaw freezer cgroups", _thaw_freezer_groups, None)
    if error:
        not_removed.append({"kind": "freezer", "reason": error})

    from chaosgpu.workloads.actions import stop_workload

    for tag in sorted(state.list_records("workloads")):
        result, error = _safe(f"workload {tag}", stop_workload, tag, grace_s=grace_s,
                              deadline_s=deadline_s, missing_ok=True)
        if error:
            not_removed.append({"kind": "workload", "name": tag, "reason": error})
            continue
        outcomes = (result or {}).get("processes") or {}
        stuck = [pid for pid, what in outcomes.items() if str(what).startswith("still alive")]
        if stuck:
            not_removed.append({"kind": "workload", "name": tag,
                                "reason": f"still alive after SIGKILL: {stuck}"})
        else:
            removed.append({"kind": "workload", "name": tag, "detail": result})

    from chaosgpu.sandbox.actions import remove_sandbox

    for name in sorted(state.list_records("sandboxes")):
        result, error = _safe(f"sandbox {name}", remove_sandbox, name, missing_ok=True)
        if error:
            not_removed.append({"kind": "sandbox", "name": name, "reason": error})
        else:
            removed.append({"kind": "sandbox", "name": name, "detail": result})

    from chaosgpu.job.hang import cleanup as cleanup_tagged

    for tag in tags or []:
        result, error = _safe(f"tag {tag}", cleanup_tagged, tag=tag, grace_s=grace_s,
                              deadline_s=deadline_s)
        if error:
            not_removed.append({"kind": "tag", "name": tag, "reason": error})
            continue
        for item in result.get("not_removed") or []:
            not_removed.append({"kind": "process", "name": tag, **item})
        for item in result.get("zombies") or []:
            zombies.append({"kind": "process", "name": tag, **item})
        if result.get("removed"):
            removed.append({"kind": "tag", "name": tag, "pids": result["removed"]})
    from chaosgpu.gpu import injector

    swept, error = _safe("injector files", injector.sweep, injector.inject_dir())
    if error:
        not_removed.append({"kind": "injector-files", "reason": error})
    return {"removed": removed, "not_removed": not_removed, "zombies": zombies,
            "thawed_cgroups": thawed or [], "injector_files_removed": swept or 0,
            "state_dir": str(state.state_dir()), "took_s": round(time.monotonic() - started, 3)}


def main(argv: list[str] | None = None) -> int:
    """Command line: `chaosgpu cleanup [--grace-s S] [--deadline-s S] [--tag T]... [--json]`."""
    parser = argparse.ArgumentParser(
        prog="chaosgpu cleanup",
        description="Remove every sandbox and workload chaosgpu recorded (safe after a crashed "
                    "run, safe to run twice), and optionally every process carrying a tag.")
    parser.add_argument("--grace-s", type=option(SECONDS), default=2.0,
                        help="SIGTERM grace before SIGKILL (default 2)")
    parser.add_argument("--deadline-s", type=option(POSITIVE_SECONDS), default=30.0,
                        help="how long to wait for processes to die after SIGKILL (default 30)")
    parser.add_argument("--tag", action="append", default=[], type=option(TAG, str),
                        help="also remove live processes carrying CHAOSGPU_TAG=TAG (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    report = cleanup_all(args.grace_s, args.deadline_s, args.tag)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"state dir: {report['state_dir']}")
        if not report["removed"] and not report["not_removed"]:
            print("nothing to clean up")
        for item in report["removed"]:
            print(f"removed {item['kind']} {item.get('name')}")
        for group in report["thawed_cgroups"]:
            print(f"thawed freezer cgroup {group['cgroup']}")
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
