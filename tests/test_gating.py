"""Pre-release gating: a run whose fault was never injected must not pass. With the timeline
control's `fail_on_failed_activity`, a failed method activity stops the run (exit 1, status
interrupted) and the rollbacks still play; without it Chaos Toolkit carries on and the run
completes with the steady state met (the silent pass this option exists to prevent)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = str(Path(sys.executable).with_name("chaos"))


def experiment(fail_on_failed_activity: bool) -> dict:
    return {
        "version": "1.0.0",
        "title": "a fault that cannot be injected",
        "description": "create_sandbox with an unknown init fails; nothing else happens",
        "controls": [{"name": "chaosgpu-timeline", "provider": {
            "type": "python", "module": "chaosgpu.timeline.control",
            "arguments": {"rate_hz": 100, "fail_on_failed_activity": fail_on_failed_activity}}}],
        "steady-state-hypothesis": {"title": "no zombies", "probes": [{
            "type": "probe", "name": "no-zombies", "tolerance": 0,
            "provider": {"type": "python", "module": "chaosgpu.sandbox.probes",
                         "func": "sandbox_zombie_count", "arguments": {"name": "gating-pod"}}}]},
        "method": [{"type": "action", "name": "create-pod", "provider": {
            "type": "python", "module": "chaosgpu.sandbox.actions", "func": "create_sandbox",
            "arguments": {"name": "gating-pod", "init": "no-such-init"}}}],
        "rollbacks": [{"type": "action", "name": "remove-pod", "provider": {
            "type": "python", "module": "chaosgpu.sandbox.actions", "func": "remove_sandbox",
            "arguments": {"name": "gating-pod"}}}],
        "runtime": {"rollbacks": {"strategy": "always"}},
    }


@pytest.mark.parametrize("strict", [True, False])
def test_failed_method_activity(strict: bool, tmp_path: Path) -> None:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment(strict)))
    journal_path = tmp_path / "journal.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "run", "--journal-path", str(journal_path), str(path)],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    journal = json.loads(journal_path.read_text())
    assert journal["run"][0]["status"] == "failed"
    assert "no-such-init" in "".join(journal["run"][0]["exception"])
    assert [r["status"] for r in journal["rollbacks"]] == ["succeeded"]
    if strict:
        assert done.returncode == 1
        assert journal["status"] == "interrupted"
        assert journal["chaosgpu"]["gating"]["failed_activity"]["name"] == "create-pod"
    else:
        assert done.returncode == 0 and journal["status"] == "completed"
        assert journal["deviated"] is False
