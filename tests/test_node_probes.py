"""Chaos Toolkit probes of chaosgpu.node and chaosgpu.gpu on real processes (no GPU here)."""

import inspect
import json
import os
import re
import signal
import subprocess

import pytest
from census_helpers import children, exec_in_pod, pod, wait_for

from chaosgpu import node
from chaosgpu.gpu import probes as gpu_probes
from chaosgpu.node import probes as node_probes


@pytest.mark.parametrize("module", [node_probes, gpu_probes])
def test_activity_conventions(module) -> None:  # type: ignore[no-untyped-def]
    for name in module.__all__:
        function = getattr(module, name)
        assert function.__doc__ and len(function.__doc__) > 40, name
        params = list(inspect.signature(function).parameters.values())
        assert [p.name for p in params[-2:]] == ["configuration", "secrets"], name
    assert "from __future__" not in inspect.getsource(module)


def test_zombies_in_scope_by_pids() -> None:
    tag = f"zombie-{os.environ['CHAOSGPU_TEST_ID']}"
    tagged = subprocess.Popen(["sleep", "0"], env=dict(os.environ, CHAOSGPU_TAG=tag))
    other = subprocess.Popen(["sleep", "0"], env=dict(os.environ))
    try:
        wait_for(lambda: node.process_state(tagged.pid) == "Z"
                 and node.process_state(other.pid) == "Z", what="two zombies")
        # a zombie's environment went with its memory: a tag cannot select it (documented), and
        # a tag no process was ever seen carrying is a typo, not "no zombies"
        with pytest.raises(ValueError, match="never met it"):
            node_probes.zombies(scope={"tag": tag})
        assert node_probes.zombies(scope={"tag": tag}, missing_ok=True) == []
        assert {tagged.pid, other.pid} <= {z["pid"] for z in node_probes.zombies()}
        found = node_probes.zombies(scope={"pids": [tagged.pid]})
        assert [z["pid"] for z in found] == [tagged.pid] and found[0]["state"] == "Z"
        record = node.read_process(tagged.pid)
        assert record["env"] is None and "env" in record["unreadable"]
        assert record["errors"]["env"] == "zombie: memory already released"
        assert [z["pid"] for z in node_probes.zombies(scope={"pids": [other.pid]})] == [other.pid]
        json.dumps(found)
    finally:
        tagged.wait()
        other.wait()
    assert node_probes.zombies(scope={"tag": tag}, missing_ok=True) == []


def test_orphans_in_a_pod_by_pids_scope() -> None:
    with pod() as pid1:
        result = exec_in_pod(pid1, "sh", "-c", "sleep 1000 </dev/null >/dev/null 2>&1 & exit")
        assert result.returncode == 0
        [orphan] = wait_for(lambda: children(pid1), what="the orphan")
        found = node_probes.orphans(scope={"pids": [orphan, pid1]})
        assert [o["pid"] for o in found] == [orphan]  # PID 1 of the pod is never an orphan
        assert found[0]["host_pid"] == orphan and found[0]["ns_pid"] > 1
        assert "init of its PID namespace" in found[0]["orphan_reason"]
        os.kill(orphan, signal.SIGKILL)
        wait_for(lambda: node.process_state(orphan) == "Z", what="zombie")
        assert [z["ns_pid"] for z in node_probes.zombies(scope={"pids": [orphan]})] \
            == [found[0]["ns_pid"]]


@pytest.mark.parametrize("scope,message", [
    ("tag", "scope must be a dict"),
    ({"colour": "red"}, "unknown scope key(s) ['colour']"),
])
def test_bad_scope_is_refused(scope: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        node_probes.zombies(scope=scope)  # type: ignore[arg-type]


def test_node_snapshot_and_jobs_are_json() -> None:
    snapshot = node_probes.node_snapshot(gpu=False)
    assert snapshot["schema"] == "chaosgpu.census/1"
    json.dumps(snapshot)
    assert isinstance(node_probes.jobs(), list)
    assert isinstance(node_probes.hung_jobs(), list)


def test_gpu_probes_without_nvml() -> None:
    assert gpu_probes.gpu_available() is False
    with pytest.raises(RuntimeError, match="no GPU visible through NVML"):
        gpu_probes.gpu_memory_used()
    with pytest.raises(RuntimeError, match="no GPU visible through NVML"):
        gpu_probes.gpu_processes(device=0)
    with pytest.raises(ValueError, match="pid must be a positive host PID"):
        gpu_probes.process_gpu_memory(pid=0)


def test_gpu_probes_on_a_recorded_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    from census_helpers import REPO

    recorded = json.loads((REPO / "tests/data/nvml_h200_recorded.json").read_text())["held"]
    recorded["devices"][0]["processes"][0]["pid"] = os.getpid()
    monkeypatch.setattr(gpu_probes, "nvml_snapshot", lambda with_processes=True: recorded)
    assert gpu_probes.gpu_available() is True
    assert gpu_probes.gpu_memory_used() == pytest.approx(3281.875)
    assert gpu_probes.gpu_memory_used(device=0) == pytest.approx(3281.875)
    with pytest.raises(ValueError, match=r"GPU 2 does not exist here; GPUs are \[0\]"):
        gpu_probes.gpu_memory_used(device=2)
    assert gpu_probes.process_gpu_memory(pid=os.getpid()) == 2658.0
    assert gpu_probes.process_gpu_memory(pid=1) == 0.0
    [entry] = gpu_probes.gpu_processes(device=0)
    assert entry["visible"] and entry["pid"] == os.getpid() and entry["used_mib"] == 2658.0
