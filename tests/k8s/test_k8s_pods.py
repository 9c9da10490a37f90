"""GPU-aware selection and pod deletion through the real `kubernetes` client (and chaosk8s) over
real HTTP against the emulator; assertions on the emulator's request log."""

import json
import time
from pathlib import Path
from typing import Any

import chaosk8s
import kmock
import pytest
from chaosk8s.pod.actions import terminate_pods
from kubernetes import client

from chaosgpu.k8s import actions, probes
from chaosgpu.k8s.client import NoCredentialsError, api_client, describe
from chaosgpu.k8s.selection import SelectionError
from k8s.cluster import Cluster
from k8s.k8s_emulator import ServerThread, field_matches, label_matches


def _seed(cluster: Cluster) -> None:
    cluster.add_pod("train-0", labels={"app": "trainer"}, gpus=1, gpu_in="limits")
    cluster.add_pod("train-1", labels={"app": "trainer"}, gpus=2, gpu_in="requests")
    cluster.add_pod("train-cpu", labels={"app": "trainer"}, gpus=0)
    cluster.add_pod("infer-0", labels={"app": "infer"}, gpus=1)


def _deletes(cluster: Cluster) -> list[tuple[str, Any]]:
    return [(r.url.path.rsplit("/", 1)[-1], r.data) for r in cluster.requests("DELETE")]


# ---- isolation ---------------------------------------------------------------------------------

def test_no_real_cluster_is_reachable(no_real_cluster: Path, tmp_path: Path) -> None:
    # A decoy ~/.kube/config pointing at a documentation-only address: it must never be used.
    home = Path(__import__("os").environ["HOME"])
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text("apiVersion: v1\nkind: Config\n"
                                           "clusters: [{name: c, cluster: {server: "
                                           "'https://203.0.113.1'}}]\n")
    assert not no_real_cluster.exists()
    assert chaosk8s.get_config_path() == str(no_real_cluster)
    assert not chaosk8s.has_local_config_file()
    with pytest.raises(NoCredentialsError, match="no Kubernetes credentials"):
        api_client()
    # chaosk8s alone falls back to http://localhost: nothing real there either.
    assert chaosk8s.create_k8s_api_client().configuration.host == "http://localhost"
    assert tmp_path in Path(__import__("os").environ["KUBECONFIG"]).parents


def test_kubeconfig_of_the_cluster_fixture_reaches_the_emulator(cluster: Cluster) -> None:
    _seed(cluster)
    pods = probes.gpu_pods(label_selector="app=trainer")  # no secrets: the kubeconfig
    assert [p["name"] for p in pods] == ["train-0", "train-1"]
    listing = [r for r in cluster.requests("GET") if r.url.path.endswith("/pods")][-1]
    assert listing.headers.get("Authorization") == "Bearer emulator-token"


def test_secrets_win_and_never_appear_in_results(cluster: Cluster) -> None:
    _seed(cluster)
    cluster.emulator.time_scale = 0.01
    result = actions.delete_gpu_pods(name_pattern="infer-0", secrets=cluster.secrets,
                                     timeout=10)
    assert "s3cr3t-token" not in json.dumps(result)
    assert result["api"] == {"host": cluster.url, "verify_ssl": True, "auth": "token"}
    delete = cluster.requests("DELETE")[-1]
    assert delete.headers.get("Authorization") == "Bearer s3cr3t-token"
    assert describe(api_client(cluster.secrets))["auth"] == "token"


# ---- selection ---------------------------------------------------------------------------------

def test_a_typod_selector_never_reads_as_no_pod_terminating(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The steady-state probes count 0 for a selection that matches nothing only before the
    method's first action, or for a selection this run met (its pods were deleted); a typo'd
    selector fails afterwards instead of passing as "no pod terminating"."""
    from chaosgpu.errors import InvalidArgument
    from chaosgpu.k8s import selection

    monkeypatch.setattr(selection, "_ACTED", [False])  # a fresh run: nothing met, no action
    monkeypatch.setattr(selection, "_MET", set())
    monkeypatch.setattr(selection, "_CREATED", [])
    _seed(cluster)
    cluster.emulator.time_scale = 0.01
    secrets = cluster.secrets
    assert probes.gpu_pods_terminating(label_selector="app=trainr", secrets=secrets) == 0
    result = actions.delete_gpu_pods(name_pattern="infer-0", secrets=secrets, timeout=10)
    assert result["all_gone"]
    # the method has begun: the deleted selection reads 0, a typo fails
    assert probes.gpu_pods_terminating(name_pattern="infer-0", secrets=secrets) == 0
    assert probes.gpu_pod_count(name_pattern="infer-0", secrets=secrets) == 0
    with pytest.raises(SelectionError, match=r"app=trainr.*never met that selection"):
        probes.gpu_pods_terminating(label_selector="app=trainr", secrets=secrets)
    with pytest.raises(SelectionError, match="a typo"):
        probes.gpu_pod_count(label_selector="app=trainr", secrets=secrets)
    assert probes.gpu_pods_terminating(label_selector="app=trainr", secrets=secrets,
                                       missing_ok=True) == 0
    with pytest.raises(InvalidArgument, match="missing_ok must be"):
        probes.gpu_pods_terminating(label_selector="app=trainer", secrets=secrets,
                                    missing_ok="sometimes")
    assert probes.gpu_pod_count(label_selector="app=trainer", secrets=secrets) == 2


def test_gpu_selection_by_label_name_and_gpu_request(cluster: Cluster) -> None:
    _seed(cluster)
    secrets = cluster.secrets
    by_label = probes.gpu_pods(label_selector="app=trainer", secrets=secrets)
    assert [(p["name"], p["gpus"]) for p in by_label] == [("train-0", 1), ("train-1", 2)]
    assert by_label[0]["uid"] and by_label[0]["namespace"] == "default"
    everything = probes.gpu_pods(label_selector="app=trainer", gpu_only=False, secrets=secrets)
    assert [p["name"] for p in everything] == ["train-0", "train-1", "train-cpu"]
    by_name = probes.gpu_pods(name_pattern="(train|infer)-0", secrets=secrets)
    assert [p["name"] for p in by_name] == ["infer-0", "train-0"]
    assert probes.gpu_pods(name_pattern="train", secrets=secrets) == []  # whole-name match
    assert probes.gpu_pod_count(label_selector="app in (trainer,infer)", secrets=secrets) == 3
    selectors = [r.params.get("labelSelector") for r in cluster.requests("GET")
                 if r.url.path.endswith("/pods")]
    assert "app=trainer" in selectors and "app in (trainer,infer)" in selectors


@pytest.mark.parametrize("label_selector,name_pattern", [(None, None), ("", ""), ("  ", None)])
def test_empty_selector_is_refused_and_nothing_is_sent(cluster: Cluster, label_selector: Any,
                                                       name_pattern: Any) -> None:
    _seed(cluster)
    before = len(cluster.requests())
    with pytest.raises(SelectionError, match="refusing an empty selector"):
        actions.delete_gpu_pods(label_selector=label_selector, name_pattern=name_pattern,
                                secrets=cluster.secrets)
    with pytest.raises(SelectionError, match="refusing an empty selector"):
        probes.gpu_pods(label_selector=label_selector, name_pattern=name_pattern,
                        secrets=cluster.secrets)
    assert len(cluster.requests()) == before  # refused before any request


def test_chaosk8s_terminate_pods_without_selector_takes_any_pod(cluster: Cluster) -> None:
    """Why the guard exists: chaosk8s, over the same HTTP, deletes a pod with no selector."""
    _seed(cluster)
    deleted = terminate_pods(ns="default", grace_period=0)  # kubeconfig -> emulator
    assert len(deleted) == 1 and deleted[0] in {"infer-0", "train-0", "train-1", "train-cpu"}
    assert cluster.requests("DELETE")[-1].data == {"gracePeriodSeconds": 0}
    assert "labelSelector" not in [r for r in cluster.requests("GET")
                                   if r.url.path.endswith("/pods")][-1].params


@pytest.mark.parametrize("kwargs,message", [
    ({"ns": "Bad_NS", "label_selector": "app=x"}, "invalid namespace"),
    ({"name_pattern": "("}, "invalid name_pattern"),
    ({"label_selector": "app=trainer", "grace_period": -2}, "grace_period must be"),
    ({"label_selector": "app=trainer", "grace_period": 1.5}, "grace_period must be"),
    ({"label_selector": "app=trainer", "timeout": 0}, "timeout must be"),
    ({"label_selector": "app=trainer", "qty": 0}, "qty must be"),
    ({"label_selector": "app=nothing"}, "no GPU pod in namespace"),
    ({"label_selector": "app=trainer", "name_pattern": "train-cpu"}, "no GPU pod"),
])
def test_bad_input_changes_nothing(cluster: Cluster, kwargs: dict[str, Any], message: str) -> None:
    _seed(cluster)
    with pytest.raises(ValueError, match=message):
        actions.delete_gpu_pods(secrets=cluster.secrets, **kwargs)
    assert cluster.requests("DELETE") == []
    assert len(probes.gpu_pods(name_pattern=".*", gpu_only=False, secrets=cluster.secrets)) == 4


# ---- deletion ----------------------------------------------------------------------------------

def test_delete_with_the_pods_own_grace_period_workers_ignoring_sigterm(cluster: Cluster) -> None:
    """The report's pod: nothing exits on SIGTERM, the whole grace period passes, then SIGKILL."""
    _seed(cluster)
    cluster.emulator.time_scale = 0.03  # 30 s grace -> 0.9 s
    result = actions.delete_gpu_pods(label_selector="app=trainer", secrets=cluster.secrets,
                                     timeout=20, poll_interval=0.05)
    uids = [p["uid"] for p in result["pods"]]
    assert _deletes(cluster) == [
        ("train-0", {"gracePeriodSeconds": 30, "preconditions": {"uid": uids[0]}}),
        ("train-1", {"gracePeriodSeconds": 30, "preconditions": {"uid": uids[1]}})]
    assert result["all_gone"] and [p["name"] for p in result["pods"]] == ["train-0", "train-1"]
    for pod in result["pods"]:
        assert pod["grace_period_seconds"] == 30 and pod["grace_period_source"] == "pod"
        assert pod["delete_status"] == "sent" and pod["deletion_timestamp"]
        assert pod["deletion_timestamp_seen_s"] < 0.5
        assert 0.8 <= pod["containers_terminated_s"] <= pod["gone_s"] < 5
        assert pod["containers"] == [{"name": "worker", "exit_code": 137, "reason": "Error",
                                      "signal": None}]
    remaining = probes.gpu_pods(name_pattern=".*", gpu_only=False, secrets=cluster.secrets)
    assert [p["name"] for p in remaining] == ["infer-0", "train-cpu"]


def test_delete_with_a_given_grace_period_and_a_sigterm_handler(cluster: Cluster) -> None:
    """The remediation: workers exit on SIGTERM, so the pod is gone long before the grace ends."""
    cluster.add_pod("handled", gpus=1, grace=30)
    cluster.emulator.exit_after[("default", "handled")] = 0.1
    result = actions.delete_gpu_pods(name_pattern="handled", grace_period=10,
                                     secrets=cluster.secrets, timeout=20, poll_interval=0.02)
    assert _deletes(cluster)[0][1]["gracePeriodSeconds"] == 10
    pod = result["pods"][0]
    assert pod["grace_period_source"] == "given" and pod["grace_period_seconds"] == 10
    assert pod["containers"][0]["exit_code"] == 0
    assert pod["gone"] and pod["gone_s"] < 2.0


def test_a_pod_gone_between_two_polls_claims_no_end_it_did_not_see(cluster: Cluster) -> None:
    """Polled once a second, a pod whose worker exits 0.1 s after the DELETE is gone at the
    second poll: its end is asked of the API server's event history, which this emulator does
    not keep, so the record says its containers' end was never seen and claims no exit code
    (the real node's history gives it: tests/k8s/real/test_real_catalog.py)."""
    cluster.add_pod("quick", gpus=1, grace=30)
    cluster.emulator.exit_after[("default", "quick")] = 0.1
    result = actions.delete_gpu_pods(name_pattern="quick", grace_period=10,
                                     secrets=cluster.secrets, timeout=20, poll_interval=1.0)
    pod = result["pods"][0]
    assert pod["gone"] and pod["containers_terminated_s"] is None and pod["containers"] == []
    assert pod["containers_seen"].startswith("never"), pod


def test_qty_deletes_the_first_by_name(cluster: Cluster) -> None:
    _seed(cluster)
    result = actions.delete_gpu_pods(label_selector="app=trainer", qty=1, grace_period=0,
                                     secrets=cluster.secrets, timeout=10)
    assert [p["name"] for p in result["pods"]] == ["train-0"]
    assert _deletes(cluster)[0][0] == "train-0" and len(_deletes(cluster)) == 1
    assert result["pods"][0]["gone"]


def test_wait_deadline_then_timings_probe_finishes_the_wait(cluster: Cluster) -> None:
    cluster.add_pod("slow", gpus=1, grace=30, labels={"app": "slow"})
    cluster.emulator.time_scale = 0.05  # 1.5 s
    started = time.monotonic()
    result = actions.delete_gpu_pods(label_selector="app=slow", timeout=0.3,
                                     secrets=cluster.secrets, poll_interval=0.05)
    assert time.monotonic() - started < 1.4  # the action kept its own deadline
    pod = result["pods"][0]
    assert pod["timed_out"] and not pod["gone"] and not result["all_gone"]
    assert pod["deletion_timestamp"] and pod["containers_terminated_s"] is None
    timings = probes.pod_deletion_timings(label_selector="app=slow", timeout=10,
                                          poll_interval=0.05, secrets=cluster.secrets)
    assert timings["all_gone"] and 1.3 <= timings["max_gone_s"] < 6
    assert timings["pods"][0]["containers"][0]["exit_code"] == 137
    again = probes.pod_deletion_timings(name_pattern="slow", wait=False)
    assert again["max_gone_s"] == timings["max_gone_s"]
    with pytest.raises(ValueError, match="no pod deletion recorded"):
        probes.pod_deletion_timings(name_pattern="never-deleted")


def test_wait_false_sends_and_returns_at_once(cluster: Cluster) -> None:
    cluster.add_pod("later", gpus=1, grace=30)
    cluster.emulator.time_scale = 0.02
    result = actions.delete_gpu_pods(name_pattern="later", wait=False, secrets=cluster.secrets)
    assert not result["waited"] and result["pods"][0]["delete_status"] == "sent"
    assert probes.pod_deletion_timings(name_pattern="later", timeout=10,
                                       secrets=cluster.secrets)["all_gone"]


# ---- the emulator itself -----------------------------------------------------------------------

def test_selector_matching_rules() -> None:
    labels = {"app": "trainer", "tier": "gpu"}
    assert label_matches("app=trainer,tier", labels)
    assert label_matches("app==trainer,!missing,tier in (gpu,cpu)", labels)
    assert not label_matches("app!=trainer", labels)
    assert not label_matches("tier notin (gpu)", labels)
    pod = {"metadata": {"name": "a"}, "status": {"phase": "Running"}}
    assert field_matches("metadata.name=a,status.phase!=Failed", pod)
    assert not field_matches("metadata.name=b", pod)


def test_field_selector_is_served(cluster: Cluster) -> None:
    _seed(cluster)
    items = cluster.core.list_namespaced_pod("default", field_selector="metadata.name=train-1")
    assert [p.metadata.name for p in items.items] == ["train-1"]


def test_kmock_gaps_are_still_there() -> None:
    """Pins kmock 0.8's gaps that PodEmulator fills: when an upgrade fixes one, this fails, and
    the subclass should shrink."""
    assert kmock.__version__.startswith("0.8")

    def plain() -> Any:
        handler = kmock.KubernetesEmulator()
        handler.resources["v1/pods"] = {}
        return handler

    thread = ServerThread(plain).start()
    try:
        configuration = client.Configuration()
        configuration.host = thread.url
        core = client.CoreV1Api(client.ApiClient(configuration))
        for name, app in (("a", "x"), ("b", "y")):
            core.create_namespaced_pod("default", {"apiVersion": "v1", "kind": "Pod",
                                                   "metadata": {"name": name,
                                                                "labels": {"app": app}},
                                                   "spec": {"containers": []}})
        listed = core.list_namespaced_pod("default", label_selector="app=x").items
        assert sorted(p.metadata.name for p in listed) == ["a", "b"]  # selector ignored
        assert listed[0].metadata.uid is None  # no metadata filled
        core.delete_namespaced_pod("a", "default",
                                   body=client.V1DeleteOptions(grace_period_seconds=30))
        names = [p.metadata.name for p in core.list_namespaced_pod("default").items]
        assert names == ["b"]  # grace period ignored: gone at once
    finally:
        thread.stop()


def test_a_pod_recreated_under_the_same_name_counts_as_gone(cluster: Cluster) -> None:
    """A controller may recreate the pod at once: the deleted pod is gone when its uid is."""
    old = cluster.add_pod("stateful-0", gpus=1, grace=30)
    cluster.emulator.time_scale = 1.0
    actions.delete_gpu_pods(name_pattern="stateful-0", wait=False, secrets=cluster.secrets)
    cluster.core.delete_namespaced_pod("stateful-0", "default",
                                       body=client.V1DeleteOptions(grace_period_seconds=0))
    new = cluster.add_pod("stateful-0", gpus=1, grace=30)
    timings = probes.pod_deletion_timings(name_pattern="stateful-0", timeout=10,
                                          secrets=cluster.secrets)
    pod = timings["pods"][0]
    assert pod["gone"] and pod["uid"] == old["metadata"]["uid"]
    assert pod["replaced_by_uid"] == new["metadata"]["uid"] != pod["uid"]
    # the rollback's missing_ok covers "nothing left"; the new pod is still there
    assert probes.gpu_pod_count(name_pattern="stateful-0", secrets=cluster.secrets) == 1
