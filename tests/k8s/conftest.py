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

import pytest
from kubernetes import client
from kubernetes.config import kube_config

from k8s.cluster import Cluster, write_kubeconfig
from k8s.k8s_emulator import PodEmulator, ServerThread
from k8s.k8s_exec_server import ExecHandler, ExecServer

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
