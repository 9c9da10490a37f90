"""An exec the API server refuses is reported in its words on the real node.

Found by a trial run: exec into a container the pod does not have (or without `pods/exec` in
another namespace) failed with the websocket client's whole handshake text, every response
header (audit id, date, content length) between the status and the API server's message, so
the message that says what is wrong came last, after noise. The error now gives the HTTP status
and the Status body's message.
"""

from pathlib import Path

import pytest
import yaml

from chaosgpu.k8s import actions
from chaosgpu.k8s.exec import ExecError

from .conftest import RealCluster
from .test_real_catalog import IMAGE, NS

pytestmark = pytest.mark.k8s_real


def test_a_refused_exec_names_the_api_servers_reason(real_cluster: RealCluster,
                                                     tmp_path: Path) -> None:
    secrets = real_cluster.secrets()
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "trial2-exec", "labels": {"app": "chaosgpu-trial2-exec"}},
        "spec": {"nodeName": real_cluster.node, "hostNetwork": True, "restartPolicy": "Never",
                 "terminationGracePeriodSeconds": 0, "automountServiceAccountToken": False,
                 "containers": [{"name": "main", "image": IMAGE, "command": ["sleep", "1000"],
                                 "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}))
    try:
        actions.create_gpu_pod(str(manifest), ns=NS, timeout=60, secrets=secrets)
        with pytest.raises(ExecError) as missing:
            actions.exec_in_pod("trial2-exec", ["true"], ns=NS, container="nope", timeout=10,
                                secrets=secrets)
        text = str(missing.value)
        assert text.startswith(f"exec in pod {NS}/trial2-exec container nope could not start: "
                               "400 Bad Request: container nope is not valid"), text
        assert "audit-id" not in text and "-+-+-" not in text

        # The runner's Role grants pods/exec in its own namespace only.
        with pytest.raises(ExecError) as forbidden:
            actions.exec_in_pod("trial2-exec", ["true"], ns="default", timeout=10,
                                secrets=secrets)
        text = str(forbidden.value)
        assert "could not start: 403 Forbidden: pods \"trial2-exec\" is forbidden" in text, text
        assert 'cannot get resource "pods/exec"' in text and "audit-id" not in text
    finally:
        actions.delete_gpu_pods(label_selector="app=chaosgpu-trial2-exec", ns=NS,
                                grace_period=0, missing_ok=True, timeout=60, secrets=secrets)
