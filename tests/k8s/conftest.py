"""Fixtures for the Kubernetes tests: isolation from any real cluster, the API emulator, and the
exec server.

Isolation (autouse): every test runs with KUBECONFIG pointing at a file that does not exist,
without KUBERNETES_* / CHAOSTOOLKIT_IN_POD / proxy variables, and with the kubernetes client's
default configuration restored afterwards (chaosk8s's factory overwrites it). chaosk8s prefers
$KUBECONFIG over KUBERNETES_HOST, so a test that forgot this could otherwise reach a real cluster
through ~/.kube/config. The `cluster` fixture then writes a kubeconfig for the emulator only.
"""

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_emulator import PodEmulator, ServerThread
from k8s_exec_server import ExecHandler, ExecServer
from kubernetes import client
from kubernetes.config import kube_config

_CLEARED = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "KUBERNETES_HOST",
            "KUBERNETES_API_KEY", "KUBERNETES_API_KEY_PREFIX", "KUBERNETES_CERT_FILE",
            "KUBERNETES_KEY_FILE", "KUBERNETES_USERNAME", "KUBERNETES_PASSWORD",
            "KUBERNETES_CONTEXT", "KUBERNETES_VERIFY_SSL", "KUBERNETES_CA_CERT_FILE",
            "CHAOSTOOLKIT_IN_POD", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
            "NO_PROXY", "no_proxy")


@pytest.fixture(autouse=True)
def no_real_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Make it impossible for a test to reach a real cluster (see the module docstring)."""
    for name in _CLEARED:
        monkeypatch.delenv(name, raising=False)
    missing = tmp_path / "no-such-kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(missing))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # The kubernetes client computed its default kubeconfig path when imported; chaosk8s checks
    # $KUBECONFIG but loads that default: point it at the same (missing) file.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(missing))
    default = client.Configuration.get_default_copy()
    verify = client.Configuration.__dict__.get("verify_ssl")
    yield missing
    client.Configuration.set_default(default)
    if verify is None:
        if "verify_ssl" in client.Configuration.__dict__:
            delattr(client.Configuration, "verify_ssl")
    else:
        client.Configuration.verify_ssl = verify


def write_kubeconfig(path: Path, server: str, token: str = "emulator-token") -> Path:
    """Write a kubeconfig with one context pointing at `server` (the emulator)."""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: emulator\n"
        f"clusters:\n- name: emulator\n  cluster:\n    server: {server}\n"
        "contexts:\n- name: emulator\n  context:\n    cluster: emulator\n    user: tester\n"
        f"users:\n- name: tester\n  user:\n    token: {token}\n", encoding="utf-8")
    return path


class Cluster:
    """The running emulator, its URL, a CoreV1Api on it and helpers to seed pods."""

    def __init__(self, thread: ServerThread) -> None:
        self.thread = thread
        self.emulator: PodEmulator = thread.handler
        self.exec: ExecHandler = thread.handler.exec_handler
        self.url = thread.url
        configuration = client.Configuration()
        configuration.host = self.url
        self.core = client.CoreV1Api(client.ApiClient(configuration))
        self.secrets = {"KUBERNETES_HOST": self.url, "KUBERNETES_API_KEY": "s3cr3t-token"}

    def add_pod(self, name: str, ns: str = "default", gpus: int = 1,
                labels: dict[str, str] | None = None, grace: int | None = 30,
                containers: int = 1, gpu_in: str = "limits") -> dict[str, Any]:
        """Create a pod through the real API (gpus=0: a pod without a GPU request)."""
        spec: dict[str, Any] = {"containers": []}
        for index in range(containers):
            container: dict[str, Any] = {"name": f"worker{index}" if index else "worker",
                                         "image": "pytorch"}
            if gpus and index == 0:
                container["resources"] = {gpu_in: {"nvidia.com/gpu": str(gpus)}}
            spec["containers"].append(container)
        if grace is not None:
            spec["terminationGracePeriodSeconds"] = grace
        body = {"apiVersion": "v1", "kind": "Pod", "spec": spec,
                "metadata": {"name": name, "labels": labels or {"app": "trainer"}}}
        created = self.core.create_namespaced_pod(ns, body)
        return self.core.api_client.sanitize_for_serialization(created)  # type: ignore[no-any-return]

    def requests(self, method: str | None = None) -> list[Any]:
        """Return the emulator's request log (optionally one HTTP method)."""
        return [r for r in list(self.emulator._requests)
                if method is None or str(r.method.value).upper() == method.upper()]


@pytest.fixture()
def cluster(no_real_cluster: Path, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A PodEmulator on loopback, with KUBECONFIG pointing at it."""
    thread = ServerThread(PodEmulator).start()
    try:
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", thread.url)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        thread.handler.resources["v1/pods"] = {}
        thread.handler.exec_handler = ExecHandler()
        yield Cluster(thread)
    finally:
        thread.stop()


@pytest.fixture()
def exec_server() -> Iterator[ExecServer]:
    """A loopback server speaking the exec channel protocol, running commands as subprocesses."""
    server = ExecServer().start()
    try:
        yield server
    finally:
        server.stop()
