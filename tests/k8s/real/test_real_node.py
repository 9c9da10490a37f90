"""The real node beyond the catalog: the census's PID -> container -> pod attribution from the
kubelet's real cgroup paths, the exec stream (apiserver -> kubelet -> containerd), the node agent
deployed from experiments/k8s/agent/ and queried, and the runner's RBAC (sufficient; a removed
permission reported clearly)."""

import base64
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from chaosgpu import node
from chaosgpu.k8s import actions
from chaosgpu.k8s import exec as k8s_exec

from . import cluster as real
from .conftest import RealCluster
from .test_real_catalog import CHAOS, IMAGE, NS, REPO

pytestmark = pytest.mark.k8s_real


def _pod(cluster: RealCluster, name: str, command: list[str], ns: str = NS,
         **spec: Any) -> dict[str, Any]:
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": "chaosgpu-real-test"}},
            "spec": {"nodeName": cluster.node, "hostNetwork": True,
                     "terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "main", "image": IMAGE, "command": command}],
                     **spec}}
    core = cluster.core()
    core.create_namespaced_pod(ns, body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pod = core.api_client.sanitize_for_serialization(core.read_namespaced_pod(name, ns))
        statuses = pod["status"].get("containerStatuses") or []
        if statuses and all((s.get("state") or {}).get("running") for s in statuses):
            return pod  # type: ignore[no-any-return]
        time.sleep(0.2)
    raise AssertionError(f"pod {name} not running: {pod['status']}")


def _delete(cluster: RealCluster, name: str, ns: str = NS) -> None:
    core = cluster.core()
    core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_pod(name, ns)
        except client.ApiException as error:
            if error.status == 404:
                return
        time.sleep(0.2)
    raise AssertionError(f"pod {name} not gone")


def test_a_pod_gone_between_two_polls_has_its_end_from_the_event_history(
        real_cluster: RealCluster) -> None:
    """A pod whose worker exits at SIGTERM is gone long before the next poll (every 4 s): its
    containers' end (exit code 0) comes from the API server's event history, not a guess, and
    the record says so; its times are bounded by the poll that found it gone."""
    name = "gone-between-polls"
    _pod(real_cluster, name, ["sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.1; done"],
         terminationGracePeriodSeconds=30)
    try:
        result = actions.delete_gpu_pods(ns=NS, name_pattern=name, gpu_only=False,
                                         grace_period=-1, timeout=30, poll_interval=4.0,
                                         secrets=real_cluster.secrets("runner"))
    except BaseException:
        _delete(real_cluster, name)
        raise
    (pod,) = result["pods"]
    assert pod["gone"] and pod["gone_s"] < 10, pod
    assert pod["containers_seen"].startswith("after the pod was gone"), pod
    assert pod["containers"] == [{"name": "main", "exit_code": 0, "reason": "Completed",
                                  "signal": None}], pod
    assert pod["containers_terminated_s"] == pod["gone_s"], pod


def test_census_attributes_host_pids_to_container_and_pod(real_cluster: RealCluster) -> None:
    pod = _pod(real_cluster, "census-target", ["sleep", "infinity"])
    try:
        uid = pod["metadata"]["uid"]
        container_id = pod["status"]["containerStatuses"][0]["containerID"]
        assert container_id.startswith("containerd://")
        container_id = container_id.split("://", 1)[1]
        folder = next(Path("/sys/fs/cgroup/pids/kubepods").rglob(container_id))
        pids = [int(p) for p in (folder / "cgroup.procs").read_text().split()]
        assert pids, folder
        census = node.take_census(pids=pids, gpu=False, fds=False)
        records = [p for p in census["processes"] if p["pid"] in pids]
        assert records and all(r["container"] == {"runtime": "kubepods", "id": container_id,
                                                  "pod_uid": uid} for r in records), records
        # The kubelet's real paths (cgroupfs driver): v1 hierarchies and the unified line.
        lines = Path(f"/proc/{pids[0]}/cgroup").read_text().splitlines()
        paths = {line.split(":", 2)[2] for line in lines}
        assert any("/kubepods/" in p and p.endswith(container_id) for p in paths), lines
        for path in paths:
            if container_id in path:
                assert node.parse_container(path) == records[0]["container"]
        # The same pod under cgroup v2 (GPU nodes): cgroupfs driver paths are the unified
        # line above; the systemd driver names slices and scopes.
        qos = path.split("/")[2]
        systemd = (f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod"
                   f"{uid.replace('-', '_')}.slice/cri-containerd-{container_id}.scope")
        assert node.parse_container(systemd) == {"runtime": "containerd", "id": container_id,
                                                 "pod_uid": uid}
        guaranteed = f"/kubepods/pod{uid}/{container_id}"
        assert node.parse_container(guaranteed)["pod_uid"] == uid  # type: ignore[index]
    finally:
        _delete(real_cluster, "census-target")


def test_exec_stream_carries_stdout_stderr_exit_code_and_stdin(real_cluster: RealCluster) -> None:
    _pod(real_cluster, "exec-target", ["sleep", "infinity"])
    try:
        core = real_cluster.core("runner")
        done = k8s_exec.run_in_pod(core, "exec-target", NS,
                                   ["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
        assert (done["exit_code"], done["stdout"], done["stderr"]) == (3, "out\n", "err\n")
        # v4.channel.k8s.io cannot close stdin: the reader must know the length (as the
        # in-target programs' bootstrap does), `cat` would wait for an EOF forever.
        read = k8s_exec.run_in_pod(core, "exec-target", NS, ["head", "-c", "100000"],
                                   stdin=b"x" * 100000, timeout=30)
        assert read["exit_code"] == 0 and len(read["stdout"]) == 100000
        # An in-target program streamed in: the census inside the pod, through the exec stream.
        document = k8s_exec.run_program(core, "exec-target", NS, "probes", "node_census",
                                        timeout=60)
        assert document["schema"] == "chaosgpu.census/1"
        assert any(p.get("nspid") == [1] or p.get("pid") == 1 for p in document["processes"])
        with pytest.raises(k8s_exec.ExecTimeout, match="timed out after 2 s"):
            k8s_exec.run_in_pod(core, "exec-target", NS, ["sleep", "30"], timeout=2)
    finally:
        _delete(real_cluster, "exec-target")


def test_agent_daemonset_deployed_and_queried(real_cluster: RealCluster) -> None:
    core = real_cluster.core()
    token = "real-node-agent-token"
    try:
        core.create_namespaced_secret("chaosgpu-system", {
            "metadata": {"name": "chaosgpu-agent-token"}, "stringData": {"token": token}})
    except client.ApiException as error:
        assert error.status == 409
    # What GPU feature discovery and the NVIDIA runtime class would give a GPU node: the label
    # the DaemonSet selects and a RuntimeClass `nvidia` (here: runc, no GPU behind it).
    core.patch_node(real_cluster.node, {"metadata": {"labels": {
        "nvidia.com/gpu.present": "true"}}})
    try:
        client.NodeV1Api(real_cluster.api()).create_runtime_class(
            {"metadata": {"name": "nvidia"}, "handler": "runc"})
    except client.ApiException as error:
        assert error.status == 409
    manifest = yaml.safe_load((REPO / "experiments/k8s/agent/daemonset.yaml").read_text())
    apps = client.AppsV1Api(real_cluster.api())
    daemonset = apps.create_namespaced_daemon_set("chaosgpu-system", manifest)
    # No controller-manager nor scheduler here: create the pod the DaemonSet controller would,
    # from its template, bound to the node.
    template = apps.api_client.sanitize_for_serialization(daemonset.spec.template)
    template["spec"]["nodeName"] = real_cluster.node
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "chaosgpu-agent-real", "labels": template["metadata"]["labels"],
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet",
                             "name": daemonset.metadata.name, "uid": daemonset.metadata.uid,
                             "controller": True}]}, "spec": template["spec"]}
    core.create_namespaced_pod("chaosgpu-system", body)
    target = _pod(real_cluster, "agent-target", ["sleep", "infinity"])
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                health = urllib.request.urlopen("http://127.0.0.1:9464/healthz", timeout=2)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    pod = core.read_namespaced_pod("chaosgpu-agent-real", "chaosgpu-system")
                    try:
                        logs = core.read_namespaced_pod_log("chaosgpu-agent-real",
                                                            "chaosgpu-system", tail_lines=40)
                    except client.ApiException as error:
                        logs = f"(no logs: {error.reason})"
                    pytest.fail(f"the agent never answered /healthz: {pod.status}\n{logs}")
                time.sleep(0.5)
        assert health.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen("http://127.0.0.1:9464/v1/snapshot", timeout=5)
        assert refused.value.code == 401
        # The runner may read the agent's token (agent/rbac.yaml), and nothing else there.
        runner = real_cluster.core("runner")
        secret = runner.read_namespaced_secret("chaosgpu-agent-token", "chaosgpu-system")
        with pytest.raises(client.ApiException) as forbidden:
            runner.list_namespaced_secret("chaosgpu-system")
        assert forbidden.value.status == 403
        read_token = base64.b64decode(secret.data["token"]).decode()
        request = urllib.request.Request("http://127.0.0.1:9464/v1/snapshot",
                                         headers={"Authorization": f"Bearer {read_token}"})
        snapshot = json.loads(urllib.request.urlopen(request, timeout=30).read())
        text = json.dumps(snapshot)
        # hostPID: the agent's census sees the other pod's processes and names its uid.
        assert target["metadata"]["uid"] in text, sorted(snapshot)
    finally:
        core.delete_namespaced_pod("chaosgpu-agent-real", "chaosgpu-system",
                                   grace_period_seconds=0)
        apps.delete_namespaced_daemon_set("chaosgpu-agent", "chaosgpu-system")
        _delete(real_cluster, "agent-target")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                core.read_namespaced_pod("chaosgpu-agent-real", "chaosgpu-system")
            except client.ApiException:
                break
            time.sleep(0.2)


def test_runner_rbac_is_sufficient_and_a_removed_permission_is_named(
        real_cluster: RealCluster, tmp_path: Path) -> None:
    # Sufficient: the catalog runs as the runner (test_real_catalog). Here: without pods/exec.
    rbac = client.RbacAuthorizationV1Api(real_cluster.api())
    role = rbac.read_namespaced_role("chaosgpu-runner", NS)
    original = rbac.api_client.sanitize_for_serialization(role)["rules"]
    rbac.patch_namespaced_role("chaosgpu-runner", NS, {"rules": [
        r for r in original if "pods/exec" not in r["resources"]]})
    journal = tmp_path / "journal.json"
    try:
        time.sleep(1)  # the RBAC authorizer reads roles from an informer
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = real_cluster.kubeconfigs["runner"]
        variables = {"ns": NS, "grace_s:int": 1, "image": IMAGE, "warmup_s:int": 0,
                     "spec_overrides": real_cluster.spec_overrides()}
        subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run",
                        "--journal-path", str(journal),
                        *[a for k, v in variables.items() for a in ("--var", f"{k}={v}")],
                        str(REPO / "experiments/k8s/k8s-delete-report-pod.json")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
                       stdin=subprocess.DEVNULL)
    finally:
        rbac.patch_namespaced_role("chaosgpu-runner", NS, {"rules": original})
    document = json.loads(journal.read_text())
    failed = next(r for r in document["run"] if r["status"] == "failed")
    assert failed["activity"]["name"] == "start-a-worker-with-exec"
    message = "".join(failed.get("exception") or [])
    assert "pods/exec" in message and "forbidden" in message.lower(), message
    assert real_cluster.tokens["runner"] not in journal.read_text()
    # The rollback (delete: still permitted) removed the pod.
    assert document["rollbacks"][0]["status"] == "succeeded"
    assert actions.__name__  # the activities above are chaosgpu's


def test_the_leftover_check_sees_the_running_node(real_cluster: RealCluster) -> None:
    # The session's teardown must find nothing left; that means something only if the same
    # check sees every kind of thing while the node runs: processes, mounts, cgroups.
    _pod(real_cluster, "leftover-target", ["sleep", "infinity"])
    try:
        left = real.leftovers()
        for name in ("etcd", "kube-apiserver", "containerd", "kubelet"):
            pid = real._records()[name]["pid"]
            assert any(item.startswith(f"pid {pid} ") for item in left), (name, left)
        assert any(item.startswith("mount ") and "/containerd/" in item for item in left), left
        assert any(item.startswith("cgroup /sys/fs/cgroup/memory/kubepods") for item in left)
        assert any(" in /sys/fs/cgroup/" in item for item in left), left  # the pod's processes
    finally:
        _delete(real_cluster, "leftover-target")
