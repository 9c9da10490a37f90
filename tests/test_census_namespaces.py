"""The census across PID namespaces, on real "pods" (unshare --pid --fork --mount-proc sleep):
orphans from a backgrounded exec'd shell, host <-> namespace PIDs, the view from inside the pod,
GPU attribution of a recorded NVML snapshot (host PIDs), and a non-root observer."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from census_helpers import PROGRAM, REPO, children, exec_in_pod, pod, run_program, wait_for

from chaosgpu import node

RECORDED = json.loads((REPO / "tests" / "data" / "nvml_h200_recorded.json").read_text())
NOBODY = (65534, 65534)


def _orphan_in(pid1: int) -> int:
    """Start `sleep 1000` in the pod the way the field report did (an exec'd shell that
    backgrounds the worker and exits); return the worker's host PID."""
    result = exec_in_pod(pid1, "sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & exit")
    assert result.returncode == 0, result.stderr
    return wait_for(lambda: [p for p in children(pid1) if node.process_state(p)],
                    what="the orphan to be reparented to the pod's PID 1")[0]


def _by_pid(census: dict) -> dict[int, dict]:
    return {p["pid"]: p for p in census["processes"]}


def test_orphan_in_a_pod_host_view() -> None:
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        census = node.take_census(gpu=False)
        procs = _by_pid(census)
        init, worker = procs[pid1], procs[orphan]
        assert init["ns_init"] and init["nspid"] == [pid1, 1] and not init["orphan"]
        assert pid1 not in census["orphans"]
        assert worker["ppid"] == pid1
        assert worker["nspid"][0] == orphan and worker["nspid"][-1] > 1
        assert worker["pid_ns"] == init["pid_ns"] != census["observer"]["pid_ns"]
        assert worker["orphan"] and orphan in census["orphans"]
        assert "init of its PID namespace" in worker["orphan_reason"]
        # our own children (not reparented) are not orphans, nor are the host's daemons
        assert os.getpid() not in census["orphans"]
        # kill -9 the worker: with `sleep` as PID 1 nobody reaps it -> a zombie, still orphaned
        os.kill(orphan, signal.SIGKILL)
        wait_for(lambda: node.process_state(orphan) == "Z", what="the orphan to be a zombie")
        census = node.take_census(gpu=False)
        assert orphan in census["zombies"] and orphan in census["orphans"]


def test_pod_view_from_inside_sees_namespace_pids() -> None:
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        ns_pid = node.read_process(orphan)["nspid"][-1]
        result = exec_in_pod(pid1, "python3", str(PROGRAM), "--no-gpu")
        assert result.returncode == 0, result.stderr
        inside = json.loads(result.stdout)
        assert inside["observer"]["host_view"] is False
        procs = _by_pid(inside)
        assert procs[1]["comm"] == "sleep" and procs[1]["ns_init"]
        assert procs[ns_pid]["orphan"] and ns_pid in inside["orphans"]
        assert procs[ns_pid]["nspid"] == [ns_pid]  # the pod's /proc shows no host PID
        assert orphan not in procs or procs[orphan]["comm"] != "sleep" or orphan == ns_pid


def _recorded_with(host_pids: list[int]) -> dict:
    """The real H200 recording with its worker's host PID replaced by live host PIDs here."""
    snapshot = copy.deepcopy(RECORDED["held"])
    template = snapshot["devices"][0]["processes"][0]
    snapshot["devices"][0]["processes"] = [dict(template, pid=pid) for pid in host_pids]
    return snapshot


def test_recorded_nvml_attributed_to_namespace_pid_from_the_host() -> None:
    assert RECORDED["nspid"] == {"457": [457, 1]}  # what the real driver said: host PID 457
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        gone = 4_194_000  # above pid_max's default: certainly not a process here
        census = node.take_census(gpu_snapshot=_recorded_with([pid1, orphan, gone]))
        gpu = {g["host_pid"]: g for g in census["gpu_processes"]}
        assert gpu[pid1]["visible"] and gpu[pid1]["pid"] == pid1 and gpu[pid1]["ns_pid"] == 1
        worker = gpu[orphan]
        assert worker["visible"] and worker["pid"] == orphan and worker["note"] is None
        assert worker["ns_pid"] == node.read_process(orphan)["nspid"][-1]
        assert worker["used_mib"] == 2658.0 and worker["gpu_index"] == 0
        assert worker["comm"] == "sleep" and worker["state"] == "S"
        assert gpu[gone]["visible"] is False and gpu[gone]["note"] == "not visible here"
        assert census["gpu"]["devices"][0]["memory_total_mib"] == 143771.0


def test_recorded_nvml_from_inside_the_pod_is_not_visible_not_orphaned(tmp_path: Path) -> None:
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        snapshot = tmp_path / "nvml.json"
        snapshot.write_text(json.dumps(_recorded_with([orphan])))
        result = exec_in_pod(pid1, "python3", str(PROGRAM), "--gpu-snapshot", str(snapshot))
        assert result.returncode == 0, result.stderr
        inside = json.loads(result.stdout)
        [entry] = inside["gpu_processes"]
        assert entry["host_pid"] == orphan and entry["visible"] is False
        assert entry["pid"] is None and "not visible here" in entry["note"]
        assert "untranslated host PID" in entry["note"]


def _ensure_nobody_can_run_the_program() -> None:
    result = run_program("--no-gpu", "--pid", "1", user=NOBODY)
    if result.returncode != 0:
        pytest.skip(f"cannot run the census as nobody here: {result.stderr[-300:]}")


def test_non_root_observer_marks_what_it_cannot_read() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to start root-owned processes and switch to nobody")
    _ensure_nobody_can_run_the_program()
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        result = run_program("--no-gpu", user=NOBODY)
        assert result.returncode == 0, result.stderr
        census = json.loads(result.stdout)
        assert census["observer"]["uid"] == 65534 and census["observer"]["root"] is False
        procs = _by_pid(census)
        worker = procs[orphan]  # root-owned, inside a pod: still listed, never "absent"
        assert worker["uid"] == 0 and worker["state"] == "S"
        assert worker["nspid"][0] == orphan  # status is world-readable
        scanned = node.census_module().nvidia_registered()
        for field in ("env", "nvidia_fds", "pid_ns") if scanned else ("env", "pid_ns"):
            assert field in worker["unreadable"], field
            assert worker["errors"][field] == "EACCES"
            assert worker[field] is None
        if not scanned:  # no NVIDIA driver on this kernel: no fd can be a GPU device, a fact
            assert worker["nvidia_fds"] == [] and "nvidia_fds" not in worker["unreadable"]
            assert census["observer"]["nvidia_fd_scan"].startswith("skipped: ")
        assert worker["orphan"]  # the orphan rule needs only stat + status
        me = procs[next(p for p in procs if procs[p]["uid"] == 65534
                        and "node_census.py" in " ".join(procs[p]["cmdline"] or []))]
        assert me["unreadable"] == [] and me["env"] is not None


def test_non_root_observer_gpu_attribution_still_works() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    _ensure_nobody_can_run_the_program()
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        result = run_program("--gpu-snapshot", "-", user=NOBODY,
                             stdin=json.dumps(_recorded_with([orphan])))
        assert result.returncode == 0, result.stderr
        [entry] = json.loads(result.stdout)["gpu_processes"]
        assert entry["visible"] and entry["pid"] == orphan and entry["ns_pid"] > 1


INSIDE = json.loads((REPO / "tests" / "data" / "nvml_h200_inside_namespace.json").read_text())
_attribute = node.census_module()._attribute


def _record(pid: int, nvidia_fds: list[str] | None) -> dict:
    return {"pid": pid, "nspid": [pid], "state": "S", "uid": 0, "comm": "python3",
            "container": None, "tag": None, "nvidia_fds": nvidia_fds}


def test_driver_translated_pid_seen_from_inside_is_attributed() -> None:
    """Real H200 recording: inside the namespace NVML said PID 1 (driver 580 translates)."""
    nested = {"host_view": False}
    [entry] = _attribute(INSIDE["inside"], {1: _record(1, ["/dev/nvidia0", "/dev/nvidiactl"])},
                         nested, {})
    assert entry["visible"] and entry["pid"] == 1 and entry["ns_pid"] == 1
    assert entry["nvml_pid"] == 1 and entry["host_pid"] is None and entry["used_mib"] == 2658.0
    # the same number held by a process without a GPU fd is a coincidence, not the worker
    [entry] = _attribute(INSIDE["inside"], {1: _record(1, [])}, nested, {})
    assert not entry["visible"] and entry["host_pid"] == 1
    assert "not visible here" in entry["note"]
    # fds unreadable (non-root): matched, and the note says it was not checked
    [entry] = _attribute(INSIDE["inside"], {1: _record(1, None)}, nested, {})
    assert entry["visible"] and "could not be checked" in entry["note"]
    # a host observer takes NVML's PIDs as host PIDs
    [entry] = _attribute(INSIDE["inside"], {1: _record(1, [])}, {"host_view": True}, {})
    assert entry["visible"] and entry["host_pid"] == 1


def test_lite_census_reads_details_only_for_candidates() -> None:
    with pod() as pid1:
        orphan = _orphan_in(pid1)
        plain = subprocess.Popen(["sleep", "30"], env=dict(os.environ))
        try:
            wait_for(lambda: node.process_state(plain.pid) == "S"
                     and node.read_process(plain.pid)["comm"] == "sleep", what="exec")
            census = node.take_census(gpu=False, detail="lite")
            procs = _by_pid(census)
            assert procs[orphan]["orphan"] and procs[orphan]["not_read"] == []
            assert procs[orphan]["cmdline"] == ["sleep", "1000"]
            assert procs[plain.pid]["not_read"] == ["uid", "nspid", "pid_ns", "ns_init",
                                                    "cmdline", "cgroup", "env", "nvidia_fds"]
            assert procs[plain.pid]["cmdline"] is None and procs[plain.pid]["unreadable"] == []
            assert procs[pid1]["ns_init"] and "ns_init" not in procs[pid1]["not_read"]
            with pytest.raises(ValueError, match="detail must be 'full' or 'lite'"):
                node.take_census(detail="medium")
        finally:
            plain.kill()
            plain.wait()


# ---------------------------------------------------------------- one orphan rule, two views


def _pod_members(pid1: int) -> list[int]:
    inode = node.pid_ns_inode(pid1)
    found = []
    for pid in node.list_pids():
        try:
            if node.pid_ns_inode(pid) == inode:
                found.append(pid)
        except node.ProcError:
            continue
    return found


def _views(pid1: int) -> tuple[dict[int, bool], dict[int, bool]]:
    """{namespace PID: orphan} of the pod's processes as the host's census and as a census run
    inside the pod see them (the inside observer and its nsenter left out)."""
    host = node.take_census(gpu=False, fds=False, pids=_pod_members(pid1))
    from_host = {p["nspid"][-1]: p["orphan"] for p in host["processes"]}
    result = exec_in_pod(pid1, "python3", str(PROGRAM), "--no-gpu")
    assert result.returncode == 0, result.stderr
    inside = json.loads(result.stdout)
    observer = inside["observer"]["pid"]
    from_inside = {p["pid"]: p["orphan"] for p in inside["processes"] if p["pid"] != observer}
    return from_host, {pid: flag for pid, flag in from_inside.items() if pid in from_host}


def _ns_pid(host_pid: int) -> int:
    return int(node.read_status(host_pid)["nspid"][-1])


def test_orphan_rule_agrees_from_host_and_from_inside_a_pod() -> None:
    with pod() as pid1:
        # the field report: an exec'd shell backgrounds the worker and exits (session outside)
        reported = _orphan_in(pid1)
        before = set(children(pid1))
        # job control: the worker leads its own process group (set up on purpose, like tini)
        assert exec_in_pod(pid1, "bash", "-c", "set -m; sleep 1001 </dev/null >/dev/null 2>&1 &"
                           " exit").returncode == 0
        grouped = wait_for(lambda: [p for p in children(pid1) if p not in before], what="grouped")
        # setsid: the worker leads its own session
        before = set(children(pid1))
        assert exec_in_pod(pid1, "sh", "-c", "setsid sleep 1002 </dev/null >/dev/null 2>&1 &"
                           " exit").returncode == 0
        leader = wait_for(lambda: [p for p in children(pid1) if p not in before], what="leader")
        # exec'd from outside, its parent (nsenter, outside the namespace) alive: not judged
        entered = subprocess.Popen(["nsenter", "-t", str(pid1), "-p", "-m", "sleep", "1003"],
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            inner = wait_for(lambda: children(entered.pid), what="the nsenter'd sleep")[0]
            from_host, from_inside = _views(pid1)
            assert from_host == from_inside  # the one rule, both views
            assert from_host[_ns_pid(reported)] is True
            assert from_host[_ns_pid(grouped[0])] is False
            assert from_host[_ns_pid(leader[0])] is False
            assert from_host[_ns_pid(inner)] is False
            assert from_host[1] is False
        finally:
            entered.kill()
            entered.wait()
    wait_for(lambda: node.process_state(reported) is None, what="the pod to be gone")


def test_orphan_rule_agrees_under_an_init_that_starts_a_session() -> None:
    dumb_init = shutil.which("dumb-init") or str(Path(sys.executable).parent / "dumb-init")
    if not os.access(dumb_init, os.X_OK):
        pytest.skip("dumb-init is not installed (pip install dumb-init)")
    inner = "sleep 1000 </dev/null >/dev/null 2>&1 & sleep 1001 </dev/null >/dev/null 2>&1 & wait"
    with pod((dumb_init, "sh", "-c", f"sh -c '{inner}' & sleep 1002")) as pid1:
        main = wait_for(lambda: children(pid1), what="dumb-init's child")[0]
        shell = wait_for(lambda: children(main), what="the inner shell")[0]
        sleeps = wait_for(lambda: len(children(shell)) == 2 and children(shell), what="sleeps")
        from_host, from_inside = _views(pid1)
        assert from_host == from_inside
        assert not any(from_host.values())  # dumb-init's child leads a session; its children
        os.kill(shell, signal.SIGKILL)  # their parent dies: the sleeps go to the pod's PID 1
        wait_for(lambda: all(p in children(pid1) for p in sleeps), what="the reparenting")
        # and the killed shell reaped by its parent: else one view may still list its zombie
        # and the other, a moment later, not (seen once in a clean-clone CI run)
        wait_for(lambda: not os.path.exists(f"/proc/{shell}"), what="the shell reaped")
        from_host, from_inside = _views(pid1)
        assert from_host == from_inside
        assert all(from_host[_ns_pid(p)] for p in sleeps)  # another session than PID 1's
        assert from_host[1] is False and from_host[_ns_pid(main)] is False


def test_sandbox_supervisor_and_its_pod_init_are_not_orphans() -> None:
    from chaosgpu.sandbox import probes as sandbox_probes
    from chaosgpu.sandbox import runtime

    name = f"census-orphans-{os.getpid()}"
    record = runtime.create(name, grace_s=1)
    try:
        census = node.take_census(gpu=False, fds=False)
        procs = _by_pid(census)
        supervisor = procs[record["supervisor_pid"]]
        assert not supervisor["orphan"], supervisor["orphan_reason"]
        assert record["pid1"] not in census["orphans"]
        worker = runtime.exec_in(name, ["sleep", "1000"], detached=True)
        orphans = sandbox_probes.sandbox_orphans(name)
        assert orphans == [worker["host_pid"]]
        census = node.take_census(gpu=False, fds=False)
        assert set(orphans) == {p for p in census["orphans"] if p in runtime.host_pids(name)}
    finally:
        runtime.remove(name)
    for pid, start in ((record["pid1"], record["pid1_starttime"]),
                       (record["supervisor_pid"], record["supervisor_starttime"])):
        wait_for(lambda: node.process_state(pid, starttime=start) is None,  # noqa: B023
                 what=f"PID {pid} to be reaped")


def test_children_forked_by_a_sandbox_init_are_not_orphans_in_either_view() -> None:
    """chaosgpu's sandbox makes its PID 1 a session leader inside the namespace (as container
    runtimes do): what that init forks was started on purpose, from the host and from inside."""
    import uuid

    from chaosgpu.sandbox import runtime

    name = f"orph-{uuid.uuid4().hex[:6]}"
    record = runtime.create(name, init="none", grace_s=1,
                            argv=["sh", "-c", "sleep 1004 & sleep 1005 & wait"])
    pid1 = record["pid1"]
    try:
        assert int(node.read_status(pid1)["nspid"][-1]) == 1
        forked = wait_for(lambda: children(pid1) if len(children(pid1)) == 2 else [],
                          what="the init's two children")
        from_host, from_inside = _views(pid1)
        assert from_host == from_inside
        assert all(from_host[_ns_pid(child)] is False for child in forked), from_host
    finally:
        runtime.terminate(name)
        runtime.remove(name)
    wait_for(lambda: node.process_state(pid1) is None, what="the sandbox to be gone")
