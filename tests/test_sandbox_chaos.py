"""The sandbox and workload activities driven by the real `chaos` CLI (a subprocess)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _chaos() -> str:
    found = shutil.which("chaos") or str(Path(sys.executable).parent / "chaos")
    if not os.access(found, os.X_OK):
        pytest.skip("the chaos CLI is not installed")
    return found


def test_report_step3b_as_an_experiment(tmp_path: Path) -> None:
    name, tag = f"exp-{os.getpid()}", f"exp-hold-{os.getpid()}"

    def activity(kind: str, module: str, func: str, **arguments: object) -> dict:  # type: ignore[type-arg]
        return {"type": kind, "name": func, "provider": {
            "type": "python", "module": module, "func": func, "arguments": arguments}}  # fmt: skip

    experiment = {
        "title": "Deleting a pod whose workers ignore SIGTERM waits the whole grace period",
        "description": "The field report's step 3-B on a local pod.",
        "runtime": {"rollbacks": {"strategy": "always"}},
        "steady-state-hypothesis": {
            "title": "no sandbox left",
            "probes": [{**activity("probe", "chaosgpu.sandbox.probes", "sandbox_exists",
                                   name=name), "tolerance": False}],  # fmt: skip
        },
        "method": [
            activity("action", "chaosgpu.sandbox.actions", "create_sandbox", name=name,
                     grace_s=1),  # fmt: skip
            activity("action", "chaosgpu.workloads.actions", "start_holders", count=3, mib=4,
                     via="host", sandbox=name, tag=tag),  # fmt: skip
            activity("probe", "chaosgpu.sandbox.probes", "sandbox_orphans", name=name),
            activity("action", "chaosgpu.sandbox.actions", "terminate_sandbox", name=name),
        ],
        "rollbacks": [
            activity("action", "chaosgpu.workloads.actions", "stop_workload", tag=tag),
            activity("action", "chaosgpu.sandbox.actions", "remove_sandbox", name=name),
        ],
    }
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal = tmp_path / "journal.json"
    done = subprocess.run(
        [_chaos(), "--no-version-check", "--log-file", str(tmp_path / "chaos.log"), "run",
         "--journal-path", str(journal), str(path)],
        cwd=tmp_path, env=dict(os.environ), capture_output=True, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads(journal.read_text())
    assert result["status"] == "completed" and not result["deviated"]
    runs = {r["activity"]["name"]: r for r in result["run"]}
    started = runs["start_holders"]["output"]
    assert sorted(runs["sandbox_orphans"]["output"]) == sorted(started["pids"])
    timings = runs["terminate_sandbox"]["output"]
    assert timings["exited_on_sigterm"] is False and timings["sigkill_sent"] is not None
    assert timings["namespace_empty_or_grace_end_s"] >= 0.95
    assert all(r["status"] == "succeeded" for r in result["rollbacks"])
