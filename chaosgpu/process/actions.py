"""Chaos Toolkit actions on the processes of a declared scope: signal, freeze, resume.

This module owns the process faults. Which processes a scope covers is decided by
chaosgpu.scope (from the census); every signal is sent by the in-target program
`actions/signal_processes.py` (pidfd + start-time identity + refusal rules). It must not read
/proc itself nor send a signal any other way. Every function that waits has its own deadline.
"""

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional

from chaosgpu.arguments import POSITIVE_SECONDS, SECONDS, checked
from chaosgpu.scope import ScopeError, describe_scope, resolve_scope_detail, validate_scope

__all__ = ["signal_processes", "freeze_processes", "resume_processes"]

logger = logging.getLogger("chaostoolkit")

FREEZER_V1_ROOT = Path("/sys/fs/cgroup/freezer")
FREEZER_PREFIX = "chaosgpu-"


def _signaller() -> Any:
    from chaosgpu.intarget import load

    return load("actions", "signal_processes")


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


def wait_gone(targets: list[dict[str, Any]], deadline_s: float,
              poll_s: float = 0.01) -> dict[str, Any]:
    """Wait until no target is alive (zombies count as dead), at most `deadline_s` seconds."""
    started = time.monotonic()
    remaining = list(targets)
    while remaining:
        remaining = [t for t in remaining if is_alive(t["pid"], t.get("starttime"))]
        if not remaining or time.monotonic() - started >= deadline_s:
            break
        time.sleep(poll_s)
    return {"all_gone": not remaining, "waited_s": round(time.monotonic() - started, 4),
            "still_alive": [t["pid"] for t in remaining]}


def send(processes: list[dict[str, Any]], signal: str, scope: dict[str, Any] | None = None,
         ) -> dict[str, Any]:
    """Send `signal` to census processes through the in-target program; return its report."""
    scope = scope or {}
    targets = [{"pid": p["pid"], "starttime": p.get("starttime")} for p in processes]
    return _signaller().signal_targets(  # type: ignore[no-any-return]
        targets, signal,
        allow_other_users=bool(scope.get("include_other_users")),
        allow_ns_init=bool(scope.get("include_ns_init")))


@checked(wait_gone_s=SECONDS)
def signal_processes(scope: Dict[str, Any], signal: str = "SIGKILL",
                     wait_gone_s: float = 0.0, require_match: bool = True,
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Send a signal (SIGKILL, SIGTERM, SIGSTOP, SIGCONT, ...) to every process of a declared
    scope (`{"tag": ...}`, `{"sandbox": ...}`, `{"job": ...}`, `{"pids": [...]}`), through
    pidfds after checking each process's identity; the host's PID 1, the runner, kernel threads,
    other users' processes and namespace inits (unless the scope allows them) are refused. With
    `wait_gone_s` > 0 it waits up to that long for the signalled processes to die. Raises when
    the scope matches nothing and `require_match` is true. Returns the per-process results."""
    checked = validate_scope(scope)
    _signaller().parse_signal(signal)  # bad signal name: fail before looking at anything
    if wait_gone_s < 0:
        raise ValueError(f"wait_gone_s must be >= 0, got {wait_gone_s!r}")
    detail = resolve_scope_detail(checked)
    if require_match and not detail["processes"]:
        raise ScopeError(f"scope {describe_scope(checked)} matched no process that may be "
                         f"signalled (excluded: {detail['excluded']}, missing: "
                         f"{detail['missing']})")
    report = send(detail["processes"], signal, checked)
    report.update(scope=checked, excluded=detail["excluded"], missing=detail["missing"])
    if wait_gone_s > 0:
        sent = [r for r in report["results"] if r["result"] == "sent"]
        report["wait"] = wait_gone(sent, wait_gone_s)
    logger.info("chaosgpu: %s to %s: %d sent, %d refused, %d gone", report["signal"],
                describe_scope(checked), report["sent"], report["refused"], report["gone"])
    for result in report["results"]:
        if result["result"] == "refused":
            logger.warning("chaosgpu: refused to signal PID %s: %s", result["pid"],
                           result["reason"])
    return report  # type: ignore[no-any-return]


def _freezer_group(checked: dict[str, Any]) -> Path:
    name = describe_scope(checked)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]
    return FREEZER_V1_ROOT / f"{FREEZER_PREFIX}{safe}"


def _freezer_available() -> str | None:
    if not (FREEZER_V1_ROOT / "cgroup.procs").exists():
        return ("the cgroup v1 freezer is not mounted at /sys/fs/cgroup/freezer; "
                "use method='sigstop'")
    if os.geteuid() != 0:
        return "the freezer method needs root (cgroup writes); use method='sigstop'"
    return None


def _write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _freeze_with_freezer(checked: dict[str, Any], processes: list[dict[str, Any]],
                         deadline_s: float) -> dict[str, Any]:
    problem = _freezer_available()
    if problem:
        raise RuntimeError(problem)
    group = _freezer_group(checked)
    group.mkdir(exist_ok=True)
    moved, failed = [], []
    for proc in processes:
        try:
            _write(group / "cgroup.procs", str(proc["pid"]))
        except OSError as error:
            failed.append({"pid": proc["pid"], "reason": str(error)})
            continue
        # The PID was written, not a pidfd: if it was reused meanwhile, put the stranger back.
        if _census_program().process_starttime(proc["pid"]) != proc.get("starttime"):
            _write(FREEZER_V1_ROOT / "cgroup.procs", str(proc["pid"]))
            failed.append({"pid": proc["pid"], "reason": "PID reused before the move"})
            continue
        moved.append(proc["pid"])
    _write(group / "freezer.state", "FROZEN")
    started = time.monotonic()
    state = ""
    while time.monotonic() - started < deadline_s:
        state = (group / "freezer.state").read_text().strip()
        if state == "FROZEN":
            break
        time.sleep(0.005)
    return {"method": "freezer", "cgroup": str(group), "frozen": moved, "failed": failed,
            "freezer_state": state, "took_s": round(time.monotonic() - started, 4)}


def _thaw_freezer_groups(pids: set[int] | None) -> list[dict[str, Any]]:
    thawed: list[dict[str, Any]] = []
    if not FREEZER_V1_ROOT.is_dir():
        return thawed
    for group in sorted(FREEZER_V1_ROOT.glob(f"{FREEZER_PREFIX}*")):
        try:
            members = {int(x) for x in (group / "cgroup.procs").read_text().split()}
        except OSError:
            continue
        if pids is not None and members and not members & pids:
            continue
        try:
            _write(group / "freezer.state", "THAWED")
            for pid in members:
                try:
                    _write(FREEZER_V1_ROOT / "cgroup.procs", str(pid))
                except OSError:
                    pass
            group.rmdir()
        except OSError as error:
            logger.warning("chaosgpu: could not thaw/remove freezer cgroup %s: %s", group, error)
        thawed.append({"cgroup": str(group), "pids": sorted(members)})
    return thawed


@checked(deadline_s=POSITIVE_SECONDS)
def freeze_processes(scope: Dict[str, Any], method: str = "sigstop",
                     deadline_s: float = 5.0, configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Freeze every process of a declared scope, the way a hung peer looks to its job:
    `method="sigstop"` sends SIGSTOP through pidfds (state T, visible to the process's parent),
    `method="freezer"` moves them into a cgroup v1 freezer group and freezes it (invisible to
    the process; needs root and the v1 freezer). Same refusal rules as signal_processes. Use
    resume_processes (or the job hang cleanup) to thaw them; a frozen process ignores SIGKILL
    until thawed. Returns what was frozen and how."""
    if method not in ("sigstop", "freezer"):
        raise ValueError(f"method must be 'sigstop' or 'freezer', got {method!r}")
    checked = validate_scope(scope)
    detail = resolve_scope_detail(checked)
    if not detail["processes"]:
        raise ScopeError(f"scope {describe_scope(checked)} matched no process to freeze "
                         f"(excluded: {detail['excluded']}, missing: {detail['missing']})")
    if method == "sigstop":
        report = send(detail["processes"], "SIGSTOP", checked)
        report["method"] = "sigstop"
    else:
        # The freezer path does not signal, but the same refusal rules must hold: check them
        # with a harmless SIGCONT through the signal program first.
        check = send(detail["processes"], "SIGCONT", checked)
        allowed = {r["pid"] for r in check["results"] if r["result"] == "sent"}
        report = _freeze_with_freezer(
            checked, [p for p in detail["processes"] if p["pid"] in allowed], deadline_s)
        report["refused"] = [r for r in check["results"] if r["result"] == "refused"]
    report.update(scope=checked, excluded=detail["excluded"])
    return report


def resume_processes(scope: Dict[str, Any],
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Resume the frozen processes of a declared scope: thaw chaosgpu's freezer cgroups that
    hold them and send SIGCONT through pidfds. Safe to run twice and when nothing is frozen
    (a rollback). Returns what was resumed."""
    checked = validate_scope(scope)
    detail = resolve_scope_detail(checked)
    pids = {p["pid"] for p in detail["processes"]}
    thawed = _thaw_freezer_groups(pids) if pids else []
    report = send(detail["processes"], "SIGCONT", checked) if detail["processes"] else {
        "signal": "SIGCONT", "results": [], "sent": 0, "refused": 0, "gone": 0}
    report.update(scope=checked, thawed_cgroups=thawed, excluded=detail["excluded"])
    return report  # type: ignore[no-any-return]
