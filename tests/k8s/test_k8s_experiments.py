"""The Kubernetes catalog: every experiment validates with the real `chaos` CLI, and the shipped
experiments run end to end with `chaos run` against the emulator (kubeconfig -> loopback),
every activity through chaosgpu's one client factory."""

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaosgpu import progress
from chaosgpu.k8s import actions
from k8s.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = sorted((REPO / "experiments" / "k8s").glob("*.json"))
CHAOS = shutil.which("chaos") or str(Path(sys.executable).parent / "chaos")


def _chaos(*args: str, cwd: Path, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CHAOS, "--no-version-check", "--log-file", os.devnull, *args],
                          cwd=cwd, env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_there_is_a_catalog() -> None:
    names = {p.name for p in EXPERIMENTS}
    assert {"k8s-delete-report-pod.json", "k8s-delete-init-pod.json",
            "k8s-delete-prestop-pod.json", "k8s-delete-sigterm-handler-pod.json",
            "k8s-kill-rank-report-pod.json"} <= names
    manifests = REPO / "experiments" / "k8s" / "manifests"
    for experiment in EXPERIMENTS:
        for activity in json.loads(experiment.read_text())["method"]:
            spec = activity["provider"].get("arguments", {}).get("spec_path")
            if spec:
                assert (REPO / spec).is_file() and (REPO / spec).parent == manifests


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.name)
def test_experiment_validates(path: Path, tmp_path: Path) -> None:
    done = _chaos("validate", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def _journal(tmp_path: Path, experiment: Path, cluster: Cluster) -> dict[str, Any]:
    journal = tmp_path / "journal.json"
    env = dict(os.environ, CHAOSGPU_WARMUP_S="0")
    done = _chaos("run", "--journal-path", str(journal), str(experiment), cwd=REPO, env=env)
    assert journal.exists(), done.stdout + done.stderr
    text = journal.read_text()
    assert "emulator-token" not in text  # the kubeconfig's credential stays out of the journal
    return json.loads(text)  # type: ignore[no-any-return]


def _output(journal: dict[str, Any], name: str) -> Any:
    entry = next(r for r in journal["run"] if r["activity"]["name"] == name)
    assert entry["status"] == "succeeded", entry.get("exception")
    return entry.get("output")


def test_report_pod_experiment_runs_against_the_emulator(cluster: Cluster, tmp_path: Path) -> None:
    cluster.emulator.time_scale = 0.03  # the pod's 30 s grace -> 0.9 s
    journal = _journal(tmp_path, REPO / "experiments/k8s/k8s-delete-report-pod.json", cluster)
    assert journal["status"] == "completed" and not journal["deviated"], [
        (r["activity"]["name"], r["status"], r.get("exception")) for r in journal["run"]]
    created = _output(journal, "create-the-pod")
    assert created["name"] == "gpu-report" and created["gpus"] == 1
    assert created["termination_grace_period_seconds"] == 30
    started = _output(journal, "start-a-worker-with-exec")
    assert started["exit_code"] == 0  # chaosgpu's exec_in_pod through the exec protocol
    census = _output(journal, "census-inside-the-pod-before")
    assert census["schema"] == "chaosgpu.census/1"
    deleted = _output(journal, "delete-the-gpu-pod")
    assert deleted["all_gone"] and deleted["pods"][0]["grace_period_seconds"] == 30
    assert deleted["pods"][0]["containers"][0]["exit_code"] == 137  # SIGKILL at grace's end
    timings = _output(journal, "deletion-timings")
    assert timings["all_gone"] and timings["max_gone_s"] >= 0.8
    assert journal["rollbacks"][0]["output"]["pods"] == []  # nothing left: missing_ok
    deletes = cluster.requests("DELETE")
    assert [d.data["gracePeriodSeconds"] for d in deletes] == [30]
    assert deletes[0].url.path == "/api/v1/namespaces/default/pods/gpu-report"
    lists = [r.params.get("labelSelector") for r in cluster.requests("GET")
             if r.url.path.endswith("/pods")]
    # chaosgpu always lists with the selector (exec_in_pod names its pod: no listing).
    assert set(lists) == {"app=chaosgpu-k8s,variant=report"}
    assert [e["command"][:2] for e in cluster.exec.log] == [["sh", "-c"], ["python3", "-c"]]


def test_sigterm_handler_experiment_runs_against_the_emulator(cluster: Cluster,
                                                              tmp_path: Path) -> None:
    cluster.emulator.exit_after[("default", "gpu-sigterm")] = 0.2  # the worker exits on SIGTERM
    journal = _journal(tmp_path, REPO / "experiments/k8s/k8s-delete-sigterm-handler-pod.json",
                       cluster)
    assert journal["status"] == "completed" and not journal["deviated"]
    pod = _output(journal, "delete-the-gpu-pod")["pods"][0]
    assert pod["gone"] and pod["gone_s"] < 3 and pod["containers"][0]["exit_code"] == 0


def test_create_gpu_pod_refuses_bad_manifests(cluster: Cluster, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: Deployment\nmetadata: {name: x}\n")
    with pytest.raises(ValueError, match="expected one manifest of kind Pod"):
        actions.create_gpu_pod(spec_path=str(bad), secrets=cluster.secrets)
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: [Pod\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        actions.create_gpu_pod(spec_path=str(broken), secrets=cluster.secrets)
    with pytest.raises(ValueError, match="is not a manifest file"):
        actions.create_gpu_pod(spec_path=str(tmp_path / "missing.yaml"), secrets=cluster.secrets)
    good = str(REPO / "experiments/k8s/manifests/report-pod.yaml")
    for kwargs, message in (
            ({"spec_overrides": "{nodeName: x"}, "spec_overrides is not valid JSON"),
            ({"spec_overrides": "[1]"}, "spec_overrides must be an object"),
            ({"grace_period": -2}, "grace_period must be an integer >= 0"),
            ({"grace_period": "3"}, "grace_period must be an integer >= 0"),
            ({"image": " "}, "image must be a non-empty string")):
        with pytest.raises(ValueError, match=message):
            actions.create_gpu_pod(spec_path=good, secrets=cluster.secrets, **kwargs)
    with pytest.raises(ValueError, match="command must be a non-empty list of strings"):
        actions.exec_in_pod("gpu-report", "sh -c true", secrets=cluster.secrets)  # type: ignore[arg-type]
    assert cluster.requests("POST") == []


def test_create_gpu_pod_applies_grace_image_and_spec_overrides(cluster: Cluster) -> None:
    path = REPO / "experiments" / "k8s" / "manifests" / "report-pod.yaml"
    pod = actions.create_gpu_pod(
        spec_path=str(path), secrets=cluster.secrets, timeout=10, grace_period=3,
        image="chaosgpu.test/node:1",
        spec_overrides='{"nodeName": "n1", "hostNetwork": true, "restartPolicy": null}')
    assert pod["termination_grace_period_seconds"] == 3
    assert pod["spec_overrides"] == {"nodeName": "n1", "hostNetwork": True, "restartPolicy": None}
    spec = cluster.requests("POST")[-1].data["spec"]
    assert spec["nodeName"] == "n1" and spec["hostNetwork"] is True
    assert "restartPolicy" not in spec  # null removes (RFC 7386)
    assert spec["containers"][0]["image"] == "chaosgpu.test/node:1"
    assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def test_create_gpu_pod_waits_until_its_containers_are_ready(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A container that never passes its readinessProbe: create_gpu_pod waits for it (a fault
    sent before the workload has set itself up measures something else), says what it waits
    for while it waits, then which container it was at the deadline."""
    caplog.set_level(logging.INFO, logger="chaostoolkit")
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.3)
    manifest = yaml.safe_load((REPO / "experiments/k8s/manifests/sigterm-handler-pod.yaml")
                              .read_text())
    manifest["spec"]["containers"][0]["readinessProbe"] = {"exec": {"command": ["false"]}}
    path = tmp_path / "never-ready.yaml"
    path.write_text(yaml.safe_dump(manifest))
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"gpu-sigterm not running and ready after 1 s "
                                           r"\(phase Running; containers not running and "
                                           r"ready: main: running, not ready\)"):
        actions.create_gpu_pod(spec_path=str(path), secrets=cluster.secrets, timeout=1,
                               poll_interval=0.1)
    assert time.monotonic() - began >= 1
    lines = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert lines and lines[0].startswith(
        "chaosgpu: still waiting for pod default/gpu-sigterm to run with every container "
        "ready: 0 s of at most 1 s; phase Running; containers not running and ready: main: "
        "running, not ready"), lines


def test_create_gpu_pod_says_why_a_pod_is_not_scheduled(cluster: Cluster, tmp_path: Path) -> None:
    """A GPU pod no node can take: the wait ends at its deadline with the scheduler's reason."""
    manifest = yaml.safe_load((REPO / "experiments/k8s/manifests/report-pod.yaml").read_text())
    manifest["status"] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}]}
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(manifest))
    with pytest.raises(TimeoutError, match=r"gpu-report not running and ready after 1 s \(phase "
                                           r"Pending; not scheduled: Unschedulable: 0/1 nodes are "
                                           r"available: 1 Insufficient nvidia.com/gpu.\)"):
        actions.create_gpu_pod(spec_path=str(path), secrets=cluster.secrets, timeout=1,
                               poll_interval=0.1)


_MAIN = {"name": "main", "ready": False, "image": "a::b", "imageID": "", "restartCount": 0}


@pytest.mark.parametrize("status, message", [
    ({"phase": "Pending", "containerStatuses": [{**_MAIN, "state": {
        "waiting": {"reason": "InvalidImageName",
                    "message": 'couldn\'t parse image name "a::b"'}}}]},
     r"gpu-report cannot start, the kubelet will not retry: main: InvalidImageName "
     r"\(couldn't parse image name \"a::b\"\) \(left for the rollback to delete\)"),
    ({"phase": "Failed", "containerStatuses": [{**_MAIN, "state": {
        "terminated": {"exitCode": 127, "reason": "Error"}}}]},
     r"gpu-report ended \(Failed\) before running: main exited 127 \(Error\)"),
])
def test_create_gpu_pod_fails_at_once_for_a_pod_that_cannot_run(
        cluster: Cluster, tmp_path: Path, status: dict[str, Any], message: str) -> None:
    """A pod that will never run (an image name the runtime refuses, a container that ended):
    an error at once that says why, not a wait to the deadline. (The emulator keeps a status
    given at creation: that is how these states are set here.)"""
    manifest = yaml.safe_load((REPO / "experiments/k8s/manifests/report-pod.yaml").read_text())
    manifest["status"] = status
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(manifest))
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=message):
        actions.create_gpu_pod(spec_path=str(path), secrets=cluster.secrets, timeout=30,
                               poll_interval=0.1)
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("manifest", ["report-pod.yaml", "init-pod.yaml", "prestop-pod.yaml",
                                      "sigterm-handler-pod.yaml"])
def test_manifests_create_gpu_pods(cluster: Cluster, manifest: str) -> None:
    path = REPO / "experiments" / "k8s" / "manifests" / manifest
    pod = actions.create_gpu_pod(spec_path=str(path), secrets=cluster.secrets, timeout=10)
    assert pod["gpus"] == 1 and pod["termination_grace_period_seconds"] == 30
    assert pod["labels"]["app"] == "chaosgpu-k8s" and pod["containers"] == ["main"]
    body = cluster.requests("POST")[-1].data
    command = body["spec"]["containers"][0]["command"]
    pid1 = {"report-pod.yaml": "sleep", "init-pod.yaml": "/usr/bin/tini",
            "prestop-pod.yaml": "sleep", "sigterm-handler-pod.yaml": "python3"}[manifest]
    assert command[0] == pid1
    assert body["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
