"""The cgroup freezers, v1 (`freezer.state`) and v2 (`cgroup.freeze`): freeze a set of processes
so that they stop without being able to tell, and thaw them again.

v1: a group `chaosgpu-<name>` at the root of the v1 freezer hierarchy (that hierarchy holds only
the freezer controller, so moving a process there changes nothing else); FROZEN is waited for in
`freezer.state`. v2: a child group `chaosgpu-freeze-<name>` of each process's own v2 cgroup (so
its memory and CPU limits, which are its parent's, still apply), `1` written to `cgroup.freeze`,
and `frozen 1` waited for in `cgroup.events`. The v2 hierarchy is /sys/fs/cgroup (unified) or
/sys/fs/cgroup/unified (hybrid). Thawing moves the processes it names back where they were
(which thaws them) and thaws and removes a group once it is empty, so a member it does not name
stays frozen. Where they were: for v2 the parent of chaosgpu's group; for v1 the freezer cgroup
each process was in before the freeze (a container's, which `docker pause` freezes), read before
the move and kept as a state record (chaosgpu.state, kind `freezer_homes`) by PID and start time,
so that a thaw by another process (a rollback, `chaosgpu cleanup`) finds it. A process without
such a record goes back to the root of the hierarchy; one whose cgroup is gone by then too, and
the thaw says so (`home_lost`). A process in a frozen freezer cgroup chaosgpu did not make is not
moved (a move would thaw it): `freeze` lists it under "failed". This module owns the freezer
files; which processes may be frozen is decided by the
caller (scope and the refusal rules of the terminate primitive); it reads a process's cgroup
through the census program, never /proc itself.
"""

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chaosgpu.arguments import SECONDS

__all__ = ["V1_ROOT", "VERSIONS", "freeze", "thaw", "release", "v2_root", "available",
           "check_seconds", "frozen_now", "SETTLE_S"]

logger = logging.getLogger("chaostoolkit")

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = CGROUP_ROOT / "freezer"
V1_PREFIX = "chaosgpu-"
V2_PREFIX = "chaosgpu-freeze-"
#: The state records (chaosgpu.state) of the v1 freezer cgroup each frozen process came from.
HOMES_KIND = "freezer_homes"
VERSIONS = ("auto", "v1", "v2")
#: How long a thaw waits for a group's last members to be gone (a process killed while frozen
#: dies when thawed, and occupies its group until it has exited) before removing the group.
SETTLE_S = 5.0


def _census_program() -> Any:
    from chaosgpu.intarget import load

    return load("probes", "node_census")


def v2_root() -> Path | None:
    """The mount point of the cgroup v2 hierarchy, or None when there is none."""
    for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if (root / "cgroup.controllers").is_file():
            return root
    return None


def available(version: str) -> tuple[str | None, str | None]:
    """(the version to use, "v1" or "v2", or None; the reason when none). "auto" prefers v1 where
    it is mounted (the hybrid layout), else v2."""
    if version not in VERSIONS:
        raise ValueError(f"freezer version must be one of {', '.join(VERSIONS)}, got {version!r}")
    if os.geteuid() != 0:
        return None, "the freezer method needs root (cgroup writes); use method='sigstop'"
    has_v1 = (V1_ROOT / "cgroup.procs").exists()
    root = v2_root()
    has_v2 = root is not None and (root / "cgroup.procs").exists()
    if version in ("auto", "v1") and has_v1:
        return "v1", None
    if version in ("auto", "v2") and has_v2:
        return "v2", None
    wanted = {"v1": "the cgroup v1 freezer is not mounted at /sys/fs/cgroup/freezer",
              "v2": "no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified",
              "auto": "neither the cgroup v1 freezer nor a cgroup v2 hierarchy is mounted"}
    return None, f"{wanted[version]}; use method='sigstop'"


def check_seconds(label: str, value: object) -> float:
    """Return `value` as seconds, or raise InvalidArgument (a ValueError) naming `label`:
    chaosgpu.arguments' SECONDS (negative, NaN, longer than the longest wait, not a number)."""
    SECONDS.require(label, value)
    return float(value)  # type: ignore[arg-type]


def frozen_now(pid: int) -> bool:
    """Whether process `pid` is in a frozen cgroup now (v1 freezer.state FROZEN or FREEZING, v2
    `frozen 1` in cgroup.events), as the census reads it; False when that cannot be told."""
    return bool(_census_program()._frozen({"pid": pid}, str(CGROUP_ROOT), "/proc"))


def _write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:80]


def _v2_home(pid: int, root: Path) -> Path | None:
    """The v2 cgroup directory `pid` is in now, or None when it cannot be read."""
    census = _census_program()
    try:
        _main, _freezer, path = census._pick_cgroup(census._read_bytes(f"/proc/{pid}/cgroup"))
    except OSError:
        return None
    if path is None:
        return None
    home = root / str(path).lstrip("/")
    return home.parent if home.name.startswith(V2_PREFIX) else home  # already in one of ours


#: (the group to move a process into, the cgroup it is in now), or why it is not moved.
GroupOf = Callable[[dict[str, Any]], tuple[Path, Path] | str]


def _move(processes: list[dict[str, Any]], group_of: GroupOf,
          forget: Callable[[dict[str, Any]], None] = lambda proc: None
          ) -> tuple[dict[Path, list[int]], list[dict[str, Any]]]:
    """Move each process into the group `group_of(proc)` names; undo the move of a reused PID.
    `forget(proc)` is called for a process `group_of` answered for but that was not moved."""
    census = _census_program()
    groups: dict[Path, list[int]] = {}
    failed: list[dict[str, Any]] = []
    for proc in processes:
        chosen = group_of(proc)
        if isinstance(chosen, str):
            failed.append({"pid": proc["pid"], "reason": chosen})
            continue
        group, home = chosen
        try:
            group.mkdir(exist_ok=True)
            _write(group / "cgroup.procs", str(proc["pid"]))
        except OSError as error:
            forget(proc)
            failed.append({"pid": proc["pid"], "reason": str(error)})
            continue
        # The PID was written, not a pidfd: if it was reused meanwhile, put the stranger back.
        if census.process_starttime(proc["pid"]) != proc.get("starttime"):
            try:
                _write(home / "cgroup.procs", str(proc["pid"]))
            except OSError:
                pass  # gone as well
            forget(proc)
            failed.append({"pid": proc["pid"], "reason": "PID reused before the move"})
            continue
        groups.setdefault(group, []).append(proc["pid"])
    return groups, failed


def _is_ours_v1(group: Path) -> bool:
    return group.parent == V1_ROOT and group.name.startswith(V1_PREFIX)


def _v1_cgroup(pid: int) -> Path | None:
    """The v1 freezer cgroup directory `pid` is in now, or None when it cannot be read."""
    census = _census_program()
    try:
        _main, path, _v2 = census._pick_cgroup(census._read_bytes(f"/proc/{pid}/cgroup"))
    except OSError:
        return None
    return None if path is None else _v1_dir(str(path))


def _v1_dir(path: str) -> Path | None:
    """The directory of v1 freezer cgroup `path` ("/" is the root), None for one outside it."""
    parts = [part for part in path.split("/") if part]
    if any(part in (".", "..") for part in parts):
        return None
    return V1_ROOT.joinpath(*parts)


def _home_name(pid: int, starttime: object) -> str:
    return f"{pid}-{starttime}"


def _remember_v1_home(proc: dict[str, Any], home: Path) -> str | None:
    """Record `home`, the v1 freezer cgroup `proc` is in before the freeze, for the thaw; return
    why it could not be (None when it is recorded)."""
    from chaosgpu import state

    path = "/" if home == V1_ROOT else "/" + str(home.relative_to(V1_ROOT))
    try:
        state.write_record(HOMES_KIND, _home_name(proc["pid"], proc.get("starttime")),
                           {"pid": proc["pid"], "starttime": proc.get("starttime"),
                            "cgroup": path, "at": time.time()})
    except (OSError, ValueError, state.StateDirError) as error:
        return str(error)
    return None


def _forget_v1_home(pid: int, starttime: object) -> None:
    from chaosgpu import state

    try:
        state.remove_record(HOMES_KIND, _home_name(pid, starttime))
    except (OSError, ValueError, state.StateDirError):
        pass


def _v1_home(pid: int) -> tuple[Path, int | None, str | None]:
    """(where to move v1 member `pid` back to, its start time, a note when that is not the cgroup
    it was in before the freeze): its recorded cgroup, else the root of the hierarchy."""
    from chaosgpu import state

    starttime = _census_program().process_starttime(pid)
    try:
        record = state.read_record(HOMES_KIND, _home_name(pid, starttime))
    except (OSError, ValueError, state.StateDirError) as error:
        return V1_ROOT, starttime, f"its freezer cgroup could not be looked up ({error})"
    if record is None:
        return V1_ROOT, starttime, "no record of the freezer cgroup it was in"
    home = _v1_dir(str(record.get("cgroup", "")))
    if home is None:
        return V1_ROOT, starttime, f"its recorded cgroup {record.get('cgroup')!r} is invalid"
    if home != V1_ROOT and not home.is_dir():
        return V1_ROOT, starttime, f"the freezer cgroup it was in, {home}, no longer exists"
    return home, starttime, None


def _v1_mover(v1_group: Path) -> tuple[GroupOf, Callable[[dict[str, Any]], None]]:
    """`_move`'s group_of and forget for v1 group `v1_group`: a process's freezer cgroup is read
    and recorded (`_remember_v1_home`) before it is moved; one in a frozen freezer cgroup
    chaosgpu did not make is not moved (the move would thaw it)."""
    recorded: set[int] = set()

    def v1_group_of(proc: dict[str, Any]) -> tuple[Path, Path] | str:
        home = _v1_cgroup(proc["pid"])
        if home is None:
            return "its cgroup could not be read"
        if _is_ours_v1(home):  # already in one of ours: its record says where it came from
            return v1_group, _v1_home(proc["pid"])[0]
        try:
            current = (home / "freezer.state").read_text().strip()
        except OSError:
            current = ""
        if current in ("FROZEN", "FREEZING"):  # a move out would thaw it
            return (f"in a frozen freezer cgroup chaosgpu did not make ({home}): left as it "
                    "is")
        if _census_program().process_starttime(proc["pid"]) != proc.get("starttime"):
            return "PID reused before the move"  # the cgroup read was a stranger's
        problem = _remember_v1_home(proc, home)
        if problem is not None:
            return (f"the freezer cgroup it is in ({home}) could not be recorded for the "
                    f"thaw: {problem}")
        recorded.add(proc["pid"])
        return v1_group, home

    def v1_forget(proc: dict[str, Any]) -> None:
        if proc["pid"] in recorded:
            _forget_v1_home(proc["pid"], proc.get("starttime"))

    return v1_group_of, v1_forget


def _is_frozen(group: Path, version: str) -> bool:
    if version == "v1":
        return (group / "freezer.state").read_text().strip() == "FROZEN"
    return "frozen 1" in (group / "cgroup.events").read_text().splitlines()


def freeze(name: str, processes: list[dict[str, Any]], deadline_s: float,
           version: str = "auto") -> dict[str, Any]:
    """Freeze census `processes` (pid + starttime) in chaosgpu freezer group(s) named after
    `name`, waiting up to `deadline_s` until the kernel reports them frozen. Returns
    {"method", "cgroup_version", "cgroup", "cgroups", "frozen", "failed", "freezer_state",
    "took_s"}; freezer_state is "FROZEN" only when every group is frozen. v1: each process's
    freezer cgroup is recorded before it is moved, for the thaw; one whose cgroup cannot be
    recorded, or is a frozen one chaosgpu did not make, is not moved ("failed" says why)."""
    check_seconds("deadline_s", deadline_s)
    chosen, problem = available(version)
    if chosen is None:
        raise RuntimeError(problem)
    if not processes:  # nothing to freeze: no group is made
        return {"method": "freezer", "cgroup_version": int(chosen[1]), "cgroup": None,
                "cgroups": [], "frozen": [], "failed": [], "freezer_state": None, "took_s": 0.0}
    if chosen == "v1":
        v1_group = V1_ROOT / f"{V1_PREFIX}{_safe(name)}"
        v1_group.mkdir(exist_ok=True)
        groups, failed = _move(processes, *_v1_mover(v1_group))
        groups.setdefault(v1_group, [])
        control, value = "freezer.state", "FROZEN"
    else:
        root = v2_root()
        assert root is not None

        def group_of(proc: dict[str, Any]) -> tuple[Path, Path] | str:
            home = _v2_home(proc["pid"], root)
            if home is None:
                return "its cgroup could not be read"
            return home / f"{V2_PREFIX}{_safe(name)}", home

        groups, failed = _move(processes, group_of)
        control, value = "cgroup.freeze", "1"
    for group in groups:
        if group.is_dir():
            _write(group / control, value)
    started = time.monotonic()
    frozen = False
    while True:
        frozen = all(_is_frozen(group, chosen) for group in groups if group.is_dir())
        if frozen or time.monotonic() - started >= deadline_s:
            break
        time.sleep(0.005)
    listed = sorted(str(g) for g in groups)
    return {"method": "freezer", "cgroup_version": int(chosen[1]),
            "cgroup": listed[0] if listed else None, "cgroups": listed,
            "frozen": [pid for pids in groups.values() for pid in pids], "failed": failed,
            "freezer_state": "FROZEN" if frozen and any(groups.values()) else "FREEZING",
            "took_s": round(time.monotonic() - started, 4)}


def _v2_groups() -> list[Path]:
    root = v2_root()
    if root is None:
        return []
    found = []
    for folder, dirs, _files in os.walk(root):
        for name in list(dirs):
            if name.startswith(V2_PREFIX):
                found.append(Path(folder) / name)
                dirs.remove(name)  # ours have no children
    return sorted(found)


def _members(group: Path) -> set[int] | None:
    try:
        return {int(x) for x in (group / "cgroup.procs").read_text().split()}
    except OSError:
        return None


def _homes(group: Path) -> Callable[[int], tuple[Path, int | None, str | None]]:
    """Where the members of chaosgpu group `group` go back to: (the cgroup, the member's start
    time when it is known, a note when that is not the cgroup it was in)."""
    if _is_ours_v1(group):
        return _v1_home
    return lambda pid: (group.parent, None, None)


def _send_home(pid: int, home: Path, starttime: int | None, v1: bool) -> Path:
    """Move `pid` into `home` (which thaws it unless `home` is frozen itself) and return where it
    went: the v1 root when `home` was removed meanwhile. For v1, its home's record goes once it
    is out (or gone)."""
    try:
        _write(home / "cgroup.procs", str(pid))
    except OSError:
        if v1 and home != V1_ROOT and not home.is_dir():  # removed since it was looked up
            return _send_home(pid, V1_ROOT, starttime, v1)
        # exiting (killed while frozen): it leaves the group as it dies
        if not v1 or _census_program().process_starttime(pid) == starttime:
            return home
    if v1 and starttime is not None:
        _forget_v1_home(pid, starttime)
    return home


def _thaw_one(group: Path, control: str, value: str, pids: set[int] | None,
              settle_s: float = SETTLE_S, untouched: bool = False) -> dict[str, Any] | None:
    """Move the members of `group` that are in `pids` (all with None) back where they were
    (`_homes`), which thaws them; thaw and remove the group once no other member is left in it,
    waiting up to `settle_s` for members that are exiting (killed while frozen) to be gone. The
    answer says where each went ("homes": [{"pid", "cgroup"}], with a "note" for one that did not
    go back to the cgroup it was in; such ones are listed in "home_lost" too), whether the group
    was removed and, when not, why."""
    members = _members(group)
    if members is None:
        return None
    chosen = members if pids is None else members & pids
    if members and not chosen:  # none of it is this thaw's: left as it is
        return None if not untouched else {
            "cgroup": str(group), "pids": [], "left_frozen": sorted(members),
            "removed": False, "homes": [], "home_lost": [],
            "error": "none of its members is among those thawed"}
    others = members - chosen
    done: dict[str, Any] = {"cgroup": str(group), "pids": sorted(chosen),
                            "left_frozen": sorted(others), "removed": False,
                            "homes": [], "home_lost": []}
    try:
        if not others:
            _write(group / control, value)
    except OSError as error:
        done["error"] = f"could not thaw it: {error}"
    home_of = _homes(group)
    v1 = _is_ours_v1(group)
    homes: dict[int, tuple[Path, int | None]] = {}
    for pid in sorted(chosen):
        home, starttime, note = home_of(pid)
        went = _send_home(pid, home, starttime, v1)
        if went != home:
            note, home = f"the freezer cgroup it was in, {home}, no longer exists", went
        homes[pid] = (home, starttime)
        entry: dict[str, Any] = {"pid": pid, "cgroup": str(home)}
        if note is not None and starttime is not None:  # (no start time: gone already)
            entry["note"] = f"{note}: moved to {home}"
            done["home_lost"].append(entry)
            logger.warning("chaosgpu: freezer thaw: PID %s: %s", pid, entry["note"])
        done["homes"].append(entry)
    if others:
        done["error"] = "other members are still frozen in it"
        return done
    end = time.monotonic() + settle_s
    while True:
        try:
            group.rmdir()
            done["removed"] = True
            done.pop("error", None)
            return done
        except FileNotFoundError:
            done["removed"] = True
            return done
        except OSError as error:
            left = _members(group) or set()
            done["error"] = (f"could not remove it: {error}"
                             + (f" (still in it: {sorted(left)})" if left else ""))
            if time.monotonic() >= end:
                break
            for pid in left & chosen:  # a move that failed while it was frozen may work now
                _send_home(pid, *homes[pid], v1)
            time.sleep(0.01)
    logger.warning("chaosgpu: freezer cgroup %s thawed but not removed: %s", group, done["error"])
    return done


def thaw(pids: set[int] | None, settle_s: float = SETTLE_S,
         untouched: bool = False) -> list[dict[str, Any]]:
    """Thaw the processes `pids` (all with None) in chaosgpu's freezer groups (v1 and v2) by
    moving them back where they were; a group is thawed and removed once empty (so are empty
    ones; members exiting are waited for up to `settle_s`), and its other members stay frozen
    ("left_frozen"). Return what was thawed: per group {"cgroup", "pids", "left_frozen",
    "removed", "homes", "home_lost"} (`_thaw_one`) and, for a group not removed, "error"
    (why); with `untouched`, a group none of whose members is in `pids` too (its "pids"
    empty: a cleanup lists what it leaves frozen). The home records of v1 processes that are
    gone are removed."""
    check_seconds("settle_s", settle_s)
    thawed: list[dict[str, Any]] = []
    if V1_ROOT.is_dir():
        for group in sorted(V1_ROOT.glob(f"{V1_PREFIX}*")):
            done = _thaw_one(group, "freezer.state", "THAWED", pids, settle_s, untouched)
            if done is not None:
                thawed.append(done)
        if os.geteuid() == 0:  # only root freezes (and records)
            _prune_v1_homes()
    for group in _v2_groups():
        done = _thaw_one(group, "cgroup.freeze", "0", pids, settle_s, untouched)
        if done is not None:
            thawed.append(done)
    return thawed


def _prune_v1_homes() -> None:
    """Remove the home records of processes that are gone (died while frozen)."""
    from chaosgpu import state

    census = _census_program()
    try:
        records = state.list_records(HOMES_KIND)
    except (OSError, state.StateDirError):
        return
    for name, record in records.items():
        pid, starttime = record.get("pid"), record.get("starttime")
        if not isinstance(pid, int) or census.process_starttime(pid) != starttime:
            try:
                state.remove_record(HOMES_KIND, name)
            except (OSError, ValueError, state.StateDirError):
                pass


def _frozen_group(pid: int) -> tuple[Path | None, bool]:
    """(the frozen cgroup `pid` sits in, or None when it is in none; whether chaosgpu made that
    group), read through the census program."""
    census = _census_program()
    try:
        _main, v1_path, v2_path = census._pick_cgroup(census._read_bytes(f"/proc/{pid}/cgroup"))
    except OSError:
        return None, False
    if v1_path is not None and V1_ROOT.is_dir():
        group = V1_ROOT / str(v1_path).lstrip("/")
        try:
            state = (group / "freezer.state").read_text().strip()
        except OSError:
            state = ""
        if state in ("FROZEN", "FREEZING"):
            return group, group.parent == V1_ROOT and group.name.startswith(V1_PREFIX)
    root = v2_root()
    if v2_path is not None and root is not None:
        group = root / str(v2_path).lstrip("/")
        try:
            frozen = "frozen 1" in (group / "cgroup.events").read_text().splitlines()
        except OSError:
            frozen = False
        if frozen:
            return group, group.name.startswith(V2_PREFIX)
    return None, False


def _namespace_members(pid: int) -> dict[int, Path]:
    """The members of chaosgpu's freezer groups that live in the PID namespace `pid` is PID 1
    of (empty when it is PID 1 of none but the host's): a fatal signal to that init ends them
    all, and the init cannot finish exiting while one of them stays frozen. {member: its group}."""
    census = _census_program()
    try:
        nspid = census.read_status(pid).get("nspid") or []
        inode = census.pid_ns_inode(pid)
    except Exception:  # gone or unreadable: nothing to add
        return {}
    if len(nspid) < 2 or nspid[-1] != 1 or inode is None:
        return {}
    groups = sorted(V1_ROOT.glob(f"{V1_PREFIX}*")) if V1_ROOT.is_dir() else []
    found: dict[int, Path] = {}
    for group in groups + _v2_groups():
        for member in _members(group) or set():
            try:
                if member != pid and census.pid_ns_inode(member) == inode:
                    found[member] = group
            except Exception:
                continue
    return found


def release(targets: list[dict[str, Any]], settle_s: float = SETTLE_S) -> dict[int, dict[str, Any]]:
    """Let `targets` ([{"pid", "starttime"}], identified by the caller) out of the frozen cgroups
    they sit in, before a signal that must reach them (the terminate primitive's `release`): a
    frozen process keeps a SIGKILL pending until thawed. Only chaosgpu's groups are touched, and
    only the targets are moved out of them (`thaw` with their PIDs: the other members stay
    frozen); a target that is PID 1 of a PID namespace takes the members of its namespace along
    (they end with it). Returns {pid: {"released": true, "cgroup", "left_frozen", "removed",
    "with_members"}} for a target let out, {pid: {"released": false, "cgroup", "reason"}} for one
    in a frozen cgroup chaosgpu did not make or that stayed frozen; a target in no frozen cgroup
    is left out."""
    census = _census_program()
    answers: dict[int, dict[str, Any]] = {}
    ours: dict[int, Path] = {}
    for target in targets:
        pid = int(target["pid"])
        group, owned = _frozen_group(pid)
        if group is None or census.process_starttime(pid) != target.get("starttime"):
            continue  # not frozen (or no longer this process: the caller's check decides)
        if not owned:
            answers[pid] = {"released": False, "cgroup": str(group),
                            "reason": "a frozen cgroup chaosgpu did not make: left as it is"}
            continue
        ours[pid] = group
    if not ours:
        return answers
    members = {pid: _namespace_members(pid) for pid in ours}
    # Only the groups that hold what is moved are touched (never another run's empty group).
    moving: dict[Path, set[int]] = {}
    for pid, group in ours.items():
        moving.setdefault(group, set()).add(pid)
        for member, its_group in members[pid].items():
            moving.setdefault(its_group, set()).add(member)
    by_group: dict[str, dict[str, Any]] = {}
    for group, pids in moving.items():
        v1 = group.parent == V1_ROOT
        done = _thaw_one(group, "freezer.state" if v1 else "cgroup.freeze",
                         "THAWED" if v1 else "0", pids, settle_s)
        if done is not None:
            by_group[str(group)] = done
    for pid, group in ours.items():
        entry = by_group.get(str(group), {})
        still, _owned = _frozen_group(pid)
        if still is not None:
            answers[pid] = {"released": False, "cgroup": str(still),
                            "reason": "still in a frozen cgroup after it was moved out"}
            continue
        answers[pid] = {"released": True, "cgroup": str(group),
                        "left_frozen": entry.get("left_frozen", []),
                        "removed": entry.get("removed", False),
                        "with_members": sorted(members[pid])}
    return answers
