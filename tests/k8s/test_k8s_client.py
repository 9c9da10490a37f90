"""One Kubernetes client factory: chaosgpu.k8s.client, its order of credential sources, and no
other factory anywhere in chaosgpu or the catalog (chaosk8s's picks them in another order)."""

import ast
import json
from pathlib import Path

import pytest

from chaosgpu.k8s.client import NoCredentialsError, api_client, credential_source, describe
from k8s.cluster import write_kubeconfig

REPO = Path(__file__).resolve().parents[2]
SECRETS = {"KUBERNETES_HOST": "https://198.51.100.7:6443", "KUBERNETES_API_KEY": "from-secrets"}


@pytest.fixture()
def every_source(no_real_cluster: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Environment credentials, CHAOSTOOLKIT_IN_POD, a kubeconfig and a pod's service host."""
    write_kubeconfig(no_real_cluster, "https://198.51.100.8:6443", token="from-kubeconfig")
    monkeypatch.setenv("KUBERNETES_HOST", "https://198.51.100.9:6443")
    monkeypatch.setenv("KUBERNETES_API_KEY", "from-environment")
    monkeypatch.setenv("CHAOSTOOLKIT_IN_POD", "true")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "198.51.100.10")
    return no_real_cluster


def test_the_order_of_credential_sources(every_source: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert credential_source(SECRETS) == "secrets"
    assert credential_source({}) == "environment"
    monkeypatch.delenv("KUBERNETES_HOST")
    assert credential_source({}) == "in-pod"
    monkeypatch.delenv("CHAOSTOOLKIT_IN_POD")
    assert credential_source({}) == f"kubeconfig:{every_source}"
    every_source.unlink()
    assert credential_source({}) == "in-cluster"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(NoCredentialsError, match="no Kubernetes credentials"):
        credential_source({})


def test_each_source_gives_its_own_server_and_token(every_source: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    api = api_client(SECRETS)
    assert api.configuration.host == "https://198.51.100.7:6443"
    assert api.configuration.api_key["authorization"] == "from-secrets"
    api = api_client()  # the environment beats the kubeconfig (chaosk8s: the other way round)
    assert api.configuration.host == "https://198.51.100.9:6443"
    assert api.configuration.api_key["authorization"] == "from-environment"
    monkeypatch.delenv("KUBERNETES_HOST")
    monkeypatch.delenv("CHAOSTOOLKIT_IN_POD")
    api = api_client()
    assert api.configuration.host == "https://198.51.100.8:6443"
    assert describe(api) == {"host": "https://198.51.100.8:6443", "verify_ssl": True,
                             "auth": "token"}


_OTHER_FACTORIES = {"create_k8s_api_client", "load_kube_config", "load_incluster_config",
                    "new_client_from_config", "ApiClient"}


def test_no_other_client_factory_in_chaosgpu() -> None:
    offenders = []
    for path in sorted((REPO / "chaosgpu").rglob("*.py")):
        if path == REPO / "chaosgpu/k8s/client.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.id if isinstance(node, ast.Name) else None)
            if name in _OTHER_FACTORIES or (isinstance(node, ast.ImportFrom)
                                            and (node.module or "").startswith("chaosk8s")):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_no_experiment_uses_chaosk8s_activities() -> None:
    # chaosk8s's activities build their client with chaosk8s's factory: the catalog must not
    # call them, so every experiment gets its credentials in the one order.
    for path in sorted((REPO / "experiments").rglob("*.json")):
        experiment = json.loads(path.read_text())
        for activity in (experiment.get("method") or []) + (experiment.get("rollbacks") or []) + (
                (experiment.get("steady-state-hypothesis") or {}).get("probes") or []):
            module = (activity.get("provider") or {}).get("module") or ""
            assert not module.startswith("chaosk8s"), (path.name, activity["name"])
