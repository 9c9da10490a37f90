"""The field report's step 2, step 3 and step 3-B, reproduced on a CPU machine.

Each scenario runs a local pod whose PID 1 is `sleep` (the report) or an init, workers started as
backgrounded exec'd shells (so they are orphans of PID 1), holding host memory instead of GPU
memory, as root and as an unprivileged user, with 1 and 10 workers. Observations come from the
node census (chaosgpu.node); the termination timings from the sandbox runtime.
"""

import os
import pwd
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import require_tool
from proc_helpers import wait_until as _wait

from chaosgpu.node import take_census
from chaosgpu.sandbox import runtime
from chaosgpu.workloads import actions as workloads
from chaosgpu.workloads.readiness import wait_ready

GRACE_S = 2.0


def _unprivileged_uid() -> int:
    try:
        return pwd.getpwnam("chaosuser").pw_uid
    except KeyError:
        if os.geteuid() != 0:
            pytest.skip("no unprivileged test user and not root")
        subprocess.run(["useradd", "-m", "chaosuser"], check=True)
        return pwd.getpwnam("chaosuser").pw_uid


def _census(name: str) -> dict[str, object]:
    pids = runtime.host_pids(name)
    census = take_census(fds=False, gpu=False, pids=pids)
    by_pid = {p["pid"]: p for p in census["processes"]}
    return {"pids": set(pids), "by_pid": by_pid, "zombies": set(census["zombies"]),
            "orphans": set(census["orphans"])}  # fmt: skip



@pytest.fixture
def pod(request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"rep-{os.getpid()}-{time.monotonic_ns() % 10**9}"
    yield name
    for listed in workloads.list_workloads():
        if listed.get("sandbox") == name:
            workloads.stop_workload(listed["tag"], grace_s=0)
    runtime.remove(name)


SCENARIOS = [(1, "root"), (10, "root"), (1, "uid"), (10, "uid")]


@pytest.mark.parametrize("workers, user", SCENARIOS)
def test_step2_and_step3_sleep_as_pid1(pod: str, workers: int, user: str) -> None:
    uid = _unprivileged_uid() if user == "uid" else None
    runtime.create(pod, init="sleep", uid=uid, grace_s=GRACE_S)
    started = workloads.start_holders(
        count=workers, mib=4, via="host", on_sigterm="ignore", sandbox=pod, timeout_s=120
    )
    worker_pids = set(started["pids"])
    # Step 2: every worker is an orphan (PPID 1 inside the pod), no zombies yet.
    seen = _census(pod)
    assert seen["orphans"] == worker_pids
    assert not seen["zombies"]
    for pid in worker_pids:
        record = seen["by_pid"][pid]  # type: ignore[index]
        assert record["nspid"][-1] > 1 and record["tag"] == started["tag"]
        if uid is not None:
            assert record["uid"] == uid
    # Step 3: kill -9 of every worker: each stays a zombie (sleep never reaps).
    for pid in worker_pids:
        assert runtime.kill(pid, runtime.process_starttime(pid))
    assert _wait(lambda: _census(pod)["zombies"] == worker_pids)
    time.sleep(0.3)
    seen = _census(pod)
    assert seen["zombies"] == worker_pids, "zombies must stay while sleep is PID 1"
    # Deleting the pod clears them all.
    timings = runtime.terminate(pod)
    assert timings["gone"] is not None
    assert not any(os.path.exists(f"/proc/{pid}") for pid in worker_pids)


@pytest.mark.parametrize("init", ["tini", "dumb-init"])
@pytest.mark.parametrize("workers", [1, 10])
def test_step3_an_init_reaps(pod: str, init: str, workers: int) -> None:
    if init == "tini":
        require_tool("tini", install="apt-get install tini")
    runtime.create(pod, init=init, grace_s=GRACE_S)
    started = workloads.start_holders(count=workers, mib=4, via="host", sandbox=pod, timeout_s=120)
    assert _census(pod)["orphans"] == set(started["pids"])
    killed = time.monotonic()
    for pid in started["pids"]:
        runtime.kill(pid, runtime.process_starttime(pid))
    assert _wait(lambda: not (set(started["pids"]) & _census(pod)["pids"]), 5.0)  # type: ignore[operator]
    assert time.monotonic() - killed < 2.0
    assert not _census(pod)["zombies"]


@pytest.mark.parametrize("workers, user", SCENARIOS)
def test_step3b_delete_with_workers_alive(pod: str, workers: int, user: str) -> None:
    uid = _unprivileged_uid() if user == "uid" else None
    runtime.create(pod, init="sleep", uid=uid, grace_s=GRACE_S)
    started = workloads.start_holders(
        count=workers, mib=4, via="host", on_sigterm="ignore", sandbox=pod, timeout_s=120
    )
    timings = runtime.terminate(pod)
    print(f"\nstep 3-B, {workers} worker(s) as {user}: {timings}")
    # SIGTERM did nothing: the whole grace period was waited, then SIGKILL freed everything fast.
    assert timings["exited_on_sigterm"] is False
    assert GRACE_S - 0.05 <= timings["namespace_empty_or_grace_end_s"] < GRACE_S + 1.0
    assert timings["sigkill_sent"] is not None
    assert timings["gone_after_sigkill_s"] < 2.0
    assert not any(os.path.exists(f"/proc/{pid}") for pid in started["pids"])
    assert runtime.host_pids(pod) == []


@pytest.mark.parametrize("workers", [1, 10])
def test_scenario4_sigterm_cleanup_ends_termination_at_once(
    pod: str, workers: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The report's remediation: workers that free and exit on SIGTERM, with SIGTERM reaching
    them (the worker is PID 1, or an init forwards SIGTERM to its process group)."""
    ready_dir = tmp_path_factory.mktemp("ready")
    hold = [sys.executable, "-m", "chaosgpu.workloads", "hold", "--via", "host", "--mib", "4",
            "--on-sigterm", "cleanup"]  # fmt: skip
    if workers == 1:
        ready = ready_dir / "w0.json"
        runtime.create(pod, init="none", argv=[*hold, "--ready-file", str(ready)], grace_s=30)
        wait_ready(ready, 60)
    else:
        script = " ".join(
            f"{' '.join(hold)} --ready-file {ready_dir}/w{i}.json &" for i in range(workers)
        )
        runtime.create(pod, init="dumb-init", argv=["sh", "-c", script + " wait"], grace_s=30)
        for i in range(workers):
            wait_ready(ready_dir / f"w{i}.json", 120)
    timings = runtime.terminate(pod)
    print(f"\nscenario 4, {workers} worker(s): {timings}")
    assert timings["exited_on_sigterm"] is True
    assert timings["sigkill_sent"] is None
    assert timings["total_s"] < GRACE_S * 0.75  # at once, not the grace (a loaded CI: bound)
