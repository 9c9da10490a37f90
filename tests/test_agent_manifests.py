"""The agent's DaemonSet and RBAC (experiments/k8s/agent/): what a cluster needs, checked
statically (no cluster can run here): host PIDs, GPU access without a GPU request, loopback
bind by default, the token from a Secret, a ServiceAccount with no API access, and arguments
that the real `chaosgpu agent` accepts."""

from pathlib import Path
from typing import Any

import yaml

from chaosgpu.agent import cli

FOLDER = Path(__file__).resolve().parent.parent / "experiments" / "k8s" / "agent"


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((FOLDER / name).read_text()) if d]


def _container() -> tuple[dict[str, Any], dict[str, Any]]:
    (daemonset,) = _docs("daemonset.yaml")
    assert daemonset["kind"] == "DaemonSet"
    spec = daemonset["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    return spec, container


def test_daemonset_sees_host_pids_and_gpus_without_taking_one() -> None:
    spec, container = _container()
    assert spec["hostPID"] is True
    assert spec["automountServiceAccountToken"] is False
    env = {e["name"]: e for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    resources = container["resources"]
    for section in resources.values():
        assert "nvidia.com/gpu" not in section
    assert "SYS_PTRACE" in container["securityContext"]["capabilities"]["add"]


def test_daemonset_arguments_are_accepted_by_the_agent_and_bind_loopback() -> None:
    _, container = _container()
    assert container["command"] == ["chaosgpu", "agent"]
    args = cli._parser().parse_args(container["args"])
    host, port = cli._check(args)
    assert (host, port) == ("127.0.0.1", 9464)
    assert args.token_file == "/etc/chaosgpu-agent/token"
    assert not args.allow_remote
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/chaosgpu-agent"]["readOnly"] is True
    # the documented opt-in (node IP) is accepted too, only with --allow-remote
    opt_in = cli._parser().parse_args(["--listen=10.1.2.3:9464", "--allow-remote",
                                       "--token-file=/etc/chaosgpu-agent/token"])
    assert cli._check(opt_in) == ("10.1.2.3", 9464)


def test_rbac_gives_the_agent_nothing_and_the_runner_only_the_token() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs("rbac.yaml")}
    account = docs[("ServiceAccount", "chaosgpu-agent")]
    assert account["automountServiceAccountToken"] is False
    bindings = [d for d in docs.values() if d["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    for binding in bindings:
        assert all(s["name"] != "chaosgpu-agent" for s in binding["subjects"])
    (role,) = [d for d in docs.values() if d["kind"] == "Role"]
    (rule,) = role["rules"]
    assert rule == {"apiGroups": [""], "resources": ["secrets"],
                    "resourceNames": ["chaosgpu-agent-token"], "verbs": ["get"]}
    (daemonset,) = _docs("daemonset.yaml")
    volumes = daemonset["spec"]["template"]["spec"]["volumes"]
    assert any(v.get("secret", {}).get("secretName") == "chaosgpu-agent-token" for v in volumes)
