"""In-pod census and rank faults end to end: the real client and the exec protocol against the
emulator, whose exec enters a real local "pod" (a PID + mount namespace whose PID 1 is `sleep`,
workers exec'd and backgrounded, ignoring SIGTERM: the field report's pod), so the in-target
programs really run inside a namespace and really signal its processes."""

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from chaosgpu.k8s import actions, probes
from chaosgpu.k8s.exec import ExecError
from k8s.cluster import Cluster

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("nsenter") is None
                                or os.geteuid() != 0, reason="needs root, unshare and nsenter")

WORKER = ("import signal, time\n"
          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "while True: time.sleep(0.2)\n")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as handle:
            found += [int(p) for p in handle.read().split()]
    return found


@pytest.fixture()
def report_pod(cluster: Cluster) -> Iterator[dict[str, Any]]:
    """Pod default/trainer-0: PID 1 `sleep`, two ranks of job `job-<pid>` started like
    `kubectl exec trainer-0 -- sh -c 'worker & worker & exit'` (so they are orphans)."""
    unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "600"],
                               stdin=subprocess.DEVNULL, start_new_session=True)
    pid1 = None
    try:
        deadline = time.monotonic() + 10
        while pid1 is None and time.monotonic() < deadline:
            children = _children(unshare.pid)
            pid1 = children[0] if children else None
            time.sleep(0.02)
        assert pid1 is not None, "the pod's PID 1 did not start"
        job = f"job-{os.getpid()}-{pid1}"
        env = (f"CHAOSGPU_JOB={job} MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2")
        script = (f"{env} RANK=0 LOCAL_RANK=0 python3 -c '{WORKER}' & "
                  f"{env} RANK=1 LOCAL_RANK=1 python3 -c '{WORKER}' & exit 0")
        subprocess.run(["nsenter", "-t", str(pid1), "-p", "-m", "sh", "-c", script], check=True,
                       timeout=20, stdin=subprocess.DEVNULL)
        cluster.add_pod("trainer-0", gpus=1, labels={"app": "trainer"})
        cluster.exec.pods[("default", "trainer-0")] = pid1
        yield {"pid1": pid1, "job": job, "secrets": cluster.secrets}
    finally:
        if pid1 is not None:
            try:
                os.kill(pid1, signal.SIGKILL)  # the namespace dies with its PID 1
            except ProcessLookupError:
                pass
        unshare.wait(20)


def _ranks(census: dict[str, Any], job: str) -> dict[int, str]:
    chosen = next(j for j in census["jobs"] if j["id"] == job)
    return {r["rank"]: r["state"] for r in chosen["ranks"]}


def _wait_ranks(pod: dict[str, Any], expected: dict[int, str]) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while True:
        census = probes.pod_census(name="trainer-0", secrets=pod["secrets"], timeout=60)
        if _ranks(census, pod["job"]) == expected or time.monotonic() > deadline:
            return census
        time.sleep(0.2)


def test_pod_census_sees_the_pod_from_inside(report_pod: dict[str, Any],
                                             cluster: Cluster) -> None:
    census = _wait_ranks(report_pod, {0: "alive", 1: "alive"})
    assert census["pod"] == "default/trainer-0"
    assert census["pid1"]["comm"] == "sleep"
    assert census["zombie_count"] == 0 and census["process_count"] == 4  # sleep, 2 ranks, census
    job = next(j for j in census["jobs"] if j["id"] == report_pod["job"])
    assert job["world_size"] == 2 and job["dead"] == []
    exec_request = cluster.exec.log[-1]
    assert exec_request["pod"] == "trainer-0" and exec_request["stdin"]
    full = probes.pod_census(name="trainer-0", full=True, secrets=report_pod["secrets"])
    assert full["schema"] == "chaosgpu.census/1"
    workers = [p for p in full["processes"] if p["pid"] in
               {r["pid"] for r in next(j for j in full["jobs"]
                                        if j["id"] == report_pod["job"])["ranks"]}]
    assert len(workers) == 2
    assert all(w["ppid"] == 1 and w["pid"] < 100 for w in workers)  # reparented to `sleep`,
    # PIDs as the pod sees them


def test_pod_census_calls_execd_workers_orphans(report_pod: dict[str, Any]) -> None:
    """The report's observe.sh got this wrong; seen from inside the pod, the two exec'd and
    backgrounded workers are orphans of the pod's `sleep`."""
    census = _wait_ranks(report_pod, {0: "alive", 1: "alive"})
    assert census["orphan_count"] == 2
    assert {o["comm"] for o in census["orphans"]} == {"python3"}
    assert all(o["ppid"] == 1 and o["orphan_reason"] for o in census["orphans"])
    assert census["observer"]["host_view"] is False


def test_kill_rank_leaves_a_zombie_under_sleep(report_pod: dict[str, Any]) -> None:
    """The report's step 3 through the Kubernetes path: kill -9 of a rank; `sleep` as PID 1
    never reaps it."""
    _wait_ranks(report_pod, {0: "alive", 1: "alive"})
    result = actions.kill_rank_in_pod(name="trainer-0", rank=0, job=report_pod["job"],
                                      secrets=report_pod["secrets"])
    assert result["result"] == "sent" and result["signal"] == "SIGKILL"
    assert result["rank"] == 0 and result["pid"] < 100 and result["starttime"] > 0
    # A zombie's environment is empty in /proc, so the census may only call rank 0 missing.
    deadline = time.monotonic() + 15
    while True:
        census = probes.pod_census(name="trainer-0", secrets=report_pod["secrets"])
        if census["zombie_count"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert census["zombie_count"] == 1 and census["zombies"][0]["pid"] == result["pid"]
    assert _ranks(census, report_pod["job"])[0] in ("zombie", "missing")
    assert _ranks(census, report_pod["job"])[1] == "alive"
    job = next(j for j in census["jobs"] if j["id"] == report_pod["job"])
    assert job["dead"] == [0] and job["survivors"]


def test_freeze_then_thaw_a_rank(report_pod: dict[str, Any]) -> None:
    _wait_ranks(report_pod, {0: "alive", 1: "alive"})
    frozen = actions.freeze_rank_in_pod(name="trainer-0", rank=1, job=report_pod["job"],
                                        secrets=report_pod["secrets"])
    assert frozen["signal"] == "SIGSTOP" and frozen["result"] == "sent"
    # seen stopped inside the pod by the signalling program before it answered
    assert frozen["stopped"] is True and frozen["signal_report"]["stopped"] == 1, frozen
    census = _wait_ranks(report_pod, {0: "alive", 1: "stopped"})
    assert _ranks(census, report_pod["job"])[1] == "stopped"
    thawed = actions.thaw_rank_in_pod(name="trainer-0", rank=1, job=report_pod["job"],
                                      secrets=report_pod["secrets"])
    assert thawed["signal"] == "SIGCONT"
    assert _ranks(_wait_ranks(report_pod, {0: "alive", 1: "alive"}),
                  report_pod["job"]) == {0: "alive", 1: "alive"}


def test_rank_faults_refuse_bad_input(report_pod: dict[str, Any], cluster: Cluster) -> None:
    secrets = report_pod["secrets"]
    with pytest.raises(ExecError, match="no job 'nope'"):
        actions.kill_rank_in_pod(name="trainer-0", rank=0, job="nope", secrets=secrets)
    with pytest.raises(ExecError, match="rank 7 of job .* has no process"):
        actions.kill_rank_in_pod(name="trainer-0", rank=7, job=report_pod["job"],
                                 secrets=secrets)
    # refused before the pod is exec'd into (chaosgpu.arguments), no longer by the pod's program
    with pytest.raises(ValueError, match="kill_rank_in_pod: rank must be a non-negative integer"):
        actions.kill_rank_in_pod(name="trainer-0", rank=-1, secrets=secrets)
    with pytest.raises(ValueError, match="invalid pod name"):
        actions.kill_rank_in_pod(name="Trainer_0", rank=0, secrets=secrets)
    with pytest.raises(ValueError, match="kill_rank_in_pod: signal must be one of .*got 'SIGSYS'"):
        actions.kill_rank_in_pod(name="trainer-0", rank=0, job=report_pod["job"],
                                 signal="SIGSYS", secrets=secrets)
    census = _wait_ranks(report_pod, {0: "alive", 1: "alive"})  # nothing was signalled
    assert census["zombie_count"] == 0


def test_thaw_is_safe_when_the_pod_is_gone(report_pod: dict[str, Any], cluster: Cluster) -> None:
    actions.delete_gpu_pods(name_pattern="trainer-0", grace_period=0,
                            secrets=report_pod["secrets"], timeout=10)
    assert actions.thaw_rank_in_pod(name="trainer-0", rank=1, job=report_pod["job"],
                                    secrets=report_pod["secrets"]) == {
        "pod": "default/trainer-0", "rank": 1, "skipped": "pod gone"}
