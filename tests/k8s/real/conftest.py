"""The session fixture on the real one-node cluster (cluster.py) for tests marked `k8s_real`.

In CI (`CI=true`) a cluster that does not start is a failure. Elsewhere the tests skip, with the
reason, when the binaries have not been built (`python -m tests.k8s.real.cluster build`) or when
not root; a cluster that then fails to start is a failure too. The fixture prepares what a
controller-manager would (the `default` ServiceAccount and `kube-root-ca.crt` in each
namespace), applies the runner's and the agent's RBAC from experiments/k8s/, and the workers
ConfigMap of manifests/workers-host-memory.yaml; at the end of the session it tears the cluster
down and fails if any process, mount or cgroup is left.
"""

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from . import cluster as real

REPO = Path(__file__).resolve().parents[3]
NAMESPACES = ("chaosgpu-experiments", "chaosgpu-system")


class RealCluster:
    """The running cluster as the tests see it: API clients per role, kubeconfigs, helpers."""

    def __init__(self, description: dict[str, Any]) -> None:
        self.info = description
        self.url: str = description["url"]
        self.node: str = description["node"]
        self.kubeconfigs: dict[str, str] = description["kubeconfigs"]
        self.tokens: dict[str, str] = description["tokens"]

    def secrets(self, role: str = "runner") -> dict[str, str]:
        """Experiment secrets for chaosgpu's client factory, as `role` (runner, agent, admin)."""
        return {"KUBERNETES_HOST": self.url, "KUBERNETES_API_KEY": self.tokens[role],
                "KUBERNETES_CA_CERT_FILE": self.info["ca"]}

    def api(self, role: str = "admin") -> client.ApiClient:
        """An ApiClient authenticated as `role`."""
        configuration = client.Configuration()
        configuration.host = self.url
        configuration.ssl_ca_cert = self.info["ca"]
        configuration.api_key["authorization"] = self.tokens[role]
        configuration.api_key_prefix["authorization"] = "Bearer"
        return client.ApiClient(configuration)

    def core(self, role: str = "admin") -> client.CoreV1Api:
        """A CoreV1Api authenticated as `role`."""
        return client.CoreV1Api(self.api(role))

    def apply(self, path: Path, namespace: str = "default") -> list[Any]:
        """Create every object of a YAML file as admin (already existing ones are kept)."""
        created = []
        for document in yaml.safe_load_all(path.read_text()):
            if not document:
                continue
            try:
                created.extend(utils.create_from_dict(self.api(), document, namespace=namespace))
            except utils.FailToCreateError as error:
                if any(getattr(e, "status", None) != 409 for e in error.api_exceptions):
                    raise
        return created

    def spec_overrides(self, **extra: Any) -> str:
        """The JSON merge patch the catalog's pods need here: on this node, host network."""
        return json.dumps({"nodeName": self.node, "hostNetwork": True, **extra})


def _prepare(cluster: RealCluster) -> None:
    core = cluster.core()
    ca = Path(cluster.info["ca"]).read_text()
    for namespace in NAMESPACES:
        try:
            core.create_namespace({"metadata": {"name": namespace}})
        except client.ApiException as error:
            if error.status != 409:
                raise
    for namespace in NAMESPACES + ("default",):
        for create, body in (
                (core.create_namespaced_service_account, {"metadata": {"name": "default"}}),
                (core.create_namespaced_config_map, {"metadata": {"name": "kube-root-ca.crt"},
                                                     "data": {"ca.crt": ca}})):
            try:
                create(namespace, body)
            except client.ApiException as error:
                if error.status != 409:
                    raise
    cluster.apply(REPO / "experiments/k8s/manifests/runner-rbac.yaml")
    cluster.apply(REPO / "experiments/k8s/agent/rbac.yaml")
    cluster.apply(Path(__file__).parent / "manifests/workers-host-memory.yaml",
                  namespace="chaosgpu-experiments")


def start_cluster(environ: Mapping[str, str]) -> RealCluster:
    """Start the node for the session, or skip (outside CI only) or fail, saying why."""
    in_ci = environ.get("CI", "").lower() == "true"
    if not in_ci:
        if os.geteuid() != 0:
            pytest.skip("the real Kubernetes node needs root")
        stamp = real.BIN / "build.json"
        if not stamp.exists() or json.loads(stamp.read_text()).get("key") != real.source_key():
            pytest.skip("the Kubernetes binaries are not built: run "
                        "`python -m tests.k8s.real.cluster build` (several minutes cold)")
    try:
        description = real.up()
    except real.AlreadyRunning as error:
        pytest.fail(f"{error} (python -m tests.k8s.real.cluster down)", pytrace=False)
    except Exception as error:
        left = real.down(quiet=True)
        pytest.fail(f"the real Kubernetes node did not start: {error}"
                    + (f"; left behind: {left}" if left else ""), pytrace=False)
    return RealCluster(description)


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    """Start the real one-node cluster once per session; tear it down and prove it clean."""
    cluster = start_cluster(os.environ)
    try:
        _prepare(cluster)
        yield cluster
    finally:
        left = real.down()
    assert not left, f"teardown left things behind: {left}"
