"""The Kubernetes catalog (experiments/k8s/*.json) run with the real `chaos run` CLI against the
real node: kube-apiserver -> kubelet -> containerd -> runc, as the runner's ServiceAccount.

Short grace periods through `--var grace_s:int=...`; the image is the test node's (busybox,
python3, tini); the pods run on the node with host networking (`--var spec_overrides=...`: there
is no scheduler nor CNI). While each experiment runs, a sampler reads the pod's memory cgroup
(cgroup v1 memory controller, the kubelet's cgroupfs path) every 50 ms: that is the "memory back"
figure, host memory here. Figures are written to $CHAOSGPU_K8S_REAL_RESULTS when set.
"""

import datetime
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from . import cluster as real
from .conftest import RealCluster

pytestmark = pytest.mark.k8s_real

REPO = Path(__file__).resolve().parents[3]
CHAOS = shutil.which("chaos") or str(Path(sys.executable).parent / "chaos")
NS = "chaosgpu-experiments"
IMAGE = "chaosgpu.test/node:1"
GRACE = 4
HOLD_MIB = 64


class CgroupMemory(threading.Thread):
    """Sample memory.usage_in_bytes of the pod's memory cgroup (found by its uid)."""

    def __init__(self, cluster: RealCluster, label_selector: str) -> None:
        super().__init__(daemon=True)
        self.core = cluster.core()
        self.selector = label_selector
        self.samples: list[tuple[float, int]] = []
        self.uid: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        folder = None
        while not self.stop.is_set():
            if folder is None:
                pods = self.core.list_namespaced_pod(NS, label_selector=self.selector).items
                if pods:
                    self.uid = pods[0].metadata.uid
                    found = glob.glob(f"/sys/fs/cgroup/memory/kubepods/**/pod{self.uid}",
                                      recursive=True)
                    folder = Path(found[0]) if found else None
            if folder is not None:
                try:
                    self.samples.append((time.time(), int(
                        (folder / "memory.usage_in_bytes").read_text())))
                except OSError:
                    self.samples.append((time.time(), -1))  # the pod's cgroup is gone
                    if self.samples[-2:-1] and self.samples[-2][1] == -1:
                        return
            self.stop.wait(0.05)

    def released_after(self, since: float) -> float | None:
        """Seconds after `since` when the usage fell below half its peak (or the cgroup went)."""
        peak = max((b for _, b in self.samples), default=0)
        for at, used in self.samples:
            if at >= since and used < peak / 2:
                return round(at - since, 3)
        return None


def runtime_signals(pod_uid: str | None) -> dict[str, float | None]:
    """When the runtime sent SIGTERM and SIGKILL to the pod's container, and when it exited
    (epoch seconds), read from the journals: the kubelet names the container it stops, then
    containerd logs "Stop container ... with signal terminated", "Kill container" at the
    deadline, and the exit event."""
    kubelet = (real.LOGS / "kubelet.log").read_text(errors="replace")
    found = re.search(r'"Killing container with a grace period".*podUID="' + str(pod_uid)
                      + r'".*containerID="containerd://([0-9a-f]{64})"', kubelet)
    assert found, f"the kubelet never stopped a container of pod {pod_uid}"
    cid = found.group(1)
    times: dict[str, float | None] = {"sigterm_at": None, "sigkill_at": None,
                                         "exited_at": None}
    for line in (real.LOGS / "containerd.log").read_text(errors="replace").splitlines():
        if cid not in line:
            continue
        stamp = re.match(r'time="([0-9T:.-]+)\d{3}Z"', line)
        if not stamp:
            continue
        at = datetime.datetime.fromisoformat(stamp.group(1)).replace(
            tzinfo=datetime.UTC).timestamp()
        if "with signal terminated" in line and times["sigterm_at"] is None:
            times["sigterm_at"] = at
        elif f'Kill container \\"{cid}' in line and times["sigkill_at"] is None:
            times["sigkill_at"] = at
        elif "received container exit event" in line and times["exited_at"] is None:
            times["exited_at"] = at
    return times


def run_experiment(cluster: RealCluster, name: str, tmp_path: Path,
                   selector: str, **variables: Any) -> tuple[dict[str, Any], CgroupMemory]:
    """`chaos run` one catalog experiment as the runner, sampling the pod's memory cgroup."""
    journal = tmp_path / f"{name}.journal.json"
    values = {"ns": NS, "grace_s:int": GRACE, "image": IMAGE, "hold_mib": str(HOLD_MIB),
              "warmup_s:int": 1, "spec_overrides": cluster.spec_overrides(), **variables}
    args = [a for k, v in values.items() for a in ("--var", f"{k}={v}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env["KUBECONFIG"] = cluster.kubeconfigs["runner"]
    sampler = CgroupMemory(cluster, selector)
    sampler.start()
    try:
        done = subprocess.run([CHAOS, "--no-version-check", "--log-file",
                               str(tmp_path / f"{name}.log"), "run", "--journal-path",
                               str(journal), *args, str(REPO / "experiments/k8s" / name)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
    finally:
        sampler.stop.set()
        sampler.join(5)
    assert journal.exists(), done.stdout + done.stderr
    text = journal.read_text()
    assert cluster.tokens["runner"] not in text  # the credential stays out of the journal
    record(name, json.loads(text), sampler)
    return json.loads(text), sampler


def record(name: str, journal: dict[str, Any], sampler: CgroupMemory) -> None:
    """Keep the journal and the memory samples as evidence when a results folder is given."""
    folder = os.environ.get("CHAOSGPU_K8S_REAL_RESULTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.journal.json").write_text(json.dumps(journal, indent=1))
        (Path(folder) / f"{name}.memory.json").write_text(json.dumps(
            {"pod_uid": sampler.uid, "samples": sampler.samples}))
        (Path(folder) / f"{name}.signals.json").write_text(json.dumps(
            runtime_signals(sampler.uid)))


def output(journal: dict[str, Any], name: str) -> Any:
    """The output of the activity `name`, which must have succeeded."""
    entry = next(r for r in journal["run"] if r["activity"]["name"] == name)
    assert entry["status"] == "succeeded", entry.get("exception")
    return entry.get("output")


def completed(journal: dict[str, Any]) -> None:
    """The run completed, the hypothesis held, and the rollback found nothing left."""
    assert journal["status"] == "completed" and not journal["deviated"], [
        (r["activity"]["name"], r["status"], r.get("exception")) for r in journal["run"]]


def deleted_pod(journal: dict[str, Any]) -> dict[str, Any]:
    """The one pod delete_gpu_pods deleted, with its measured times."""
    deleted = output(journal, "delete-the-gpu-pod")
    assert deleted["all_gone"] and len(deleted["pods"]) == 1
    pod: dict[str, Any] = deleted["pods"][0]
    assert pod["grace_period_seconds"] == GRACE
    return pod


def test_report_pod_takes_the_whole_grace_period(real_cluster: RealCluster,
                                                 tmp_path: Path) -> None:
    journal, memory = run_experiment(real_cluster, "k8s-delete-report-pod.json", tmp_path,
                                     "app=chaosgpu-k8s,variant=report")
    completed(journal)
    census = output(journal, "census-inside-the-pod-before")
    assert census["pid1"]["comm"] == "sleep"
    # The worker was exec'd and backgrounded: its shell exited, `sleep` (PID 1) is its parent
    # and never reaps: the census calls it an orphan.
    assert census["orphan_count"] >= 1, census
    pod = deleted_pod(journal)
    # PID 1 `sleep` has no SIGTERM handler in its own PID namespace: SIGTERM does nothing,
    # runc SIGKILLs it at the deadline.
    assert pod["containers"][0]["exit_code"] == 137
    assert GRACE - 0.5 <= pod["containers_terminated_s"] <= GRACE + 5
    assert GRACE <= pod["gone_s"] <= GRACE + 10
    released = memory.released_after(pod["delete_sent_at"])
    assert released is not None and released >= GRACE - 0.5, memory.samples[-20:]
    signals = runtime_signals(memory.uid)
    assert signals["sigterm_at"] and signals["sigkill_at"] and signals["exited_at"], signals
    # SIGTERM at the DELETE (give or take the kubelet's reaction), SIGKILL a grace period later.
    assert 0 <= signals["sigterm_at"] - pod["delete_sent_at"] < 3, signals
    assert GRACE - 0.1 <= signals["sigkill_at"] - signals["sigterm_at"] <= GRACE + 1.5, signals


def test_init_as_pid1_does_not_wait_for_the_grace_period(real_cluster: RealCluster,
                                                         tmp_path: Path) -> None:
    journal, memory = run_experiment(real_cluster, "k8s-delete-init-pod.json", tmp_path,
                                     "app=chaosgpu-k8s,variant=init", **{"grace_s:int": 10})
    completed(journal)
    census = output(journal, "census-inside-the-pod-before")
    assert census["pid1"]["comm"] == "tini" and census["zombie_count"] == 0
    pod = output(journal, "delete-the-gpu-pod")["pods"][0]
    assert pod["gone"] and pod["containers_terminated_s"] < 5, pod
    assert pod["containers"][0]["exit_code"] == 143  # tini forwards SIGTERM; sleep dies of it
    signals = runtime_signals(memory.uid)
    assert signals["sigterm_at"] and signals["sigkill_at"] is None, signals  # no SIGKILL needed
    released = memory.released_after(pod["delete_sent_at"])
    assert released is not None and released < 5


def test_prestop_frees_the_memory_at_once(real_cluster: RealCluster, tmp_path: Path) -> None:
    journal, memory = run_experiment(real_cluster, "k8s-delete-prestop-pod.json", tmp_path,
                                     "app=chaosgpu-k8s,variant=prestop", **{"grace_s:int": 10})
    completed(journal)
    pod = output(journal, "delete-the-gpu-pod")["pods"][0]
    # The hook SIGKILLs the workers first: the memory comes back at once; PID 1 is still
    # `sleep`, so the pod itself still lasts the grace period (measured both).
    released = memory.released_after(pod["delete_sent_at"])
    assert released is not None and released < 5, memory.samples[-30:]
    assert pod["containers"][0]["exit_code"] == 137 and pod["containers_terminated_s"] >= 9


def test_sigterm_handler_exits_at_once(real_cluster: RealCluster, tmp_path: Path) -> None:
    journal, memory = run_experiment(real_cluster, "k8s-delete-sigterm-handler-pod.json",
                                     tmp_path, "app=chaosgpu-k8s,variant=sigterm-handler",
                                     **{"grace_s:int": 10})
    completed(journal)
    pod = output(journal, "delete-the-gpu-pod")["pods"][0]
    # the window that matters: ended by its own handler well inside the 10 s grace period, with
    # no SIGKILL (seen at 0.7-1.5 s on a quiet machine, 5.9 s once on a loaded one)
    assert pod["containers"][0]["exit_code"] == 0 and pod["containers_terminated_s"] < 8, pod
    signals = runtime_signals(memory.uid)
    assert signals["sigterm_at"] and signals["sigkill_at"] is None, signals
    released = memory.released_after(pod["delete_sent_at"])
    assert released is not None and released < 8


def test_kill_rank_leaves_a_zombie_under_sleep(real_cluster: RealCluster,
                                               tmp_path: Path) -> None:
    journal, memory = run_experiment(real_cluster, "k8s-kill-rank-report-pod.json", tmp_path,
                                     "app=chaosgpu-k8s,variant=report")
    completed(journal)
    before = output(journal, "census-before")
    assert [j for j in before["jobs"] if j.get("ranks")], before
    killed = output(journal, "kill-rank-0")
    assert killed["result"]["outcome"] if isinstance(killed.get("result"), dict) else killed
    after = output(journal, "census-after-zombie-expected")
    assert after["zombie_count"] >= 1, after  # `sleep` never reaps its orphan
    assert memory.samples, "the pod's memory cgroup was never read"
