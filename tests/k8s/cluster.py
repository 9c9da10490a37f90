"""The emulated cluster as tests see it: URL, a CoreV1Api, secrets, pod seeding, request log."""

from pathlib import Path
from typing import Any

from kubernetes import client

from k8s.k8s_emulator import ServerThread
from k8s.k8s_exec_server import ExecHandler


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
        self.emulator: Any = thread.handler
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
