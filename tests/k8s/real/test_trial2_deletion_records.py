"""pod_deletion_timings on the real node reports this run's deletions only.

Found by a trial run: an experiment whose delete_gpu_pods matched nothing (a typo'd selector)
still got timings from pod_deletion_timings: the record an earlier `chaos run` had left in the
state directory, another pod's uid and exit codes, reported as this run's evidence. A second
run's timings mixed its own pod with the earlier run's. Each run here is a runner process: the
earlier one a subprocess that deletes a real pod, the later one this test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaosgpu import state
from chaosgpu.k8s import actions, deletion, probes

from .conftest import RealCluster
from .test_real_catalog import IMAGE, NS, REPO

pytestmark = pytest.mark.k8s_real

SELECTOR = "app=chaosgpu-trial2-records"


def _manifest(cluster: RealCluster, folder: Path, name: str) -> str:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "chaosgpu-trial2-records"}},
        "spec": {"nodeName": cluster.node, "hostNetwork": True, "restartPolicy": "Never",
                 "terminationGracePeriodSeconds": 1, "automountServiceAccountToken": False,
                 "containers": [{"name": "main", "image": IMAGE, "command": ["sleep", "1000"],
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}))
    return str(path)


def _earlier_run(cluster: RealCluster, spec_path: str) -> dict[str, Any]:
    """Another runner (a process of its own) creates and deletes a pod, then ends."""
    program = (
        "import json, sys\n"
        "from chaosgpu.k8s import actions\n"
        "secrets = json.loads(sys.argv[1])\n"
        f"actions.create_gpu_pod({spec_path!r}, ns={NS!r}, timeout=60, secrets=secrets)\n"
        f"out = actions.delete_gpu_pods(label_selector={SELECTOR!r}, ns={NS!r}, timeout=60,\n"
        "                               poll_interval=0.1, secrets=secrets)\n"
        "print(json.dumps(out['pods']))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", program, json.dumps(cluster.secrets())],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    pods: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pods) == 1 and pods[0]["gone"]
    return pods[0]


def test_timings_never_report_an_earlier_runs_deletion(real_cluster: RealCluster,
                                                       tmp_path: Path) -> None:
    secrets = real_cluster.secrets()
    try:
        earlier = _earlier_run(real_cluster, _manifest(real_cluster, tmp_path, "trial2-rec-a"))
        assert any(r.get("uid") == earlier["uid"]
                   for r in state.list_records(deletion.RECORD_KIND).values())

        # This run's delete matched nothing (a typo): no timings, whatever an earlier run left.
        with pytest.raises(Exception, match="nothing deleted"):
            actions.delete_gpu_pods(label_selector=SELECTOR + "x", ns=NS, timeout=10,
                                    secrets=secrets)
        with pytest.raises(ValueError, match="recorded by an earlier run, not reported"):
            probes.pod_deletion_timings(label_selector=SELECTOR, ns=NS, timeout=10,
                                        secrets=secrets)

        # This run deletes its own pod: its timings are that pod's alone, and the earlier run's
        # record (its runner is gone) has been removed from the state directory.
        created = actions.create_gpu_pod(_manifest(real_cluster, tmp_path, "trial2-rec-b"),
                                         ns=NS, timeout=60, secrets=secrets)
        deleted = actions.delete_gpu_pods(label_selector=SELECTOR, ns=NS, timeout=60,
                                          poll_interval=0.1, secrets=secrets)
        assert [p["uid"] for p in deleted["pods"]] == [created["uid"]]
        timings = probes.pod_deletion_timings(label_selector=SELECTOR, ns=NS, timeout=10,
                                              secrets=secrets)
        assert [p["uid"] for p in timings["pods"]] == [created["uid"]]
        assert timings["all_gone"] and timings["pods"][0]["containers"][0]["exit_code"] == 137
        left = [r.get("uid") for r in state.list_records(deletion.RECORD_KIND).values()]
        assert earlier["uid"] not in left and created["uid"] in left
    finally:
        actions.delete_gpu_pods(label_selector=SELECTOR, ns=NS, grace_period=0,
                                missing_ok=True, timeout=60, secrets=secrets)
