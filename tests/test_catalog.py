"""Every experiment of the catalog, run through the real `chaos` CLI on this machine.

Each experiment's tags say what it must end as (`expect:deviated` -> exit 1, deviated;
`expect:completed` -> exit 0). The configuration is scaled for a noisy 2-core machine with
`--var` (short grace periods and timeouts, small memory), never the experiment's logic. After
each run nothing it started may be alive (the autouse fixture checks every process that carries
this test's id) and no sandbox or workload record may be left in the state directory.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chaosgpu import state

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted((REPO / "experiments").glob("*.json"))
# Experiments on a job the user runs (tagged target:existing-job) need one started first: they
# run in tests/test_verdicts_foreign.py against jobs chaosgpu did not launch.
SELF_CONTAINED = [p for p in EXPERIMENTS
                  if "target:existing-job" not in json.loads(p.read_text()).get("tags", [])]
# The chaos CLI of this Python's environment, else the one on PATH (packages installed with
# pip --target put it there).
_BESIDE = Path(sys.executable).with_name("chaos")
CHAOS = str(_BESIDE) if _BESIDE.exists() else (shutil.which("chaos") or str(_BESIDE))

# Scaled for CI: what each experiment gets through --var.
POD_DELETE = {"grace_s": 3.0, "mib": 64}
OVERRIDES: dict[str, dict[str, Any]] = {
    "pod-delete-ignore-sigterm": POD_DELETE,
    "pod-delete-ignore-sigterm-10": {"grace_s": 3.0, "mib": 32},
    "pod-delete-sigterm-handler": POD_DELETE,
    "pod-delete-sigterm-handler-10": {"grace_s": 3.0, "mib": 32},
    "pod-delete-handler-exec": POD_DELETE,
    "non-root-pod-delete": POD_DELETE,
    "driver-api-worker": POD_DELETE,
    "zombies-sleep-pid1": {"mib": 16},
    "zombies-init-pid1": {"mib": 16},
    "nccl-rank-kill": {},
    "rank-freeze": {},
    "nccl-timeout-remediation": {"pg_timeout_s": 5.0, "settle_timeout_s": 40.0},
    # GPU faults (tests/test_gpu_catalog.py checks their figures); those tagged needs:gpu run
    # only where NVML sees a GPU, needs:gpus:2 where it sees two.
    "gpu-rank-hang": {"mode": "hold-gil", "matmul": 64},
    "gpu-rank-hang-nccl-timeout": {},
    "gpu-memory-pressure": {},
    "gpu-memory-pressure-oom-handler": {},
    "gpu-compute-contention": {},
    "gpu-xid": {},
    "gpu-cuda-alloc-fault": {},
    # on a job the test starts (tests/test_verdicts_foreign.py)
    "job-rank-freeze-recovery": {},
}


def run_experiment(path: Path, tmp_path: Path, overrides: dict[str, Any]) -> tuple[int, dict]:
    """Run `chaos run` on `path` and return its exit code and journal."""
    journal = tmp_path / "journal.json"
    var_file = tmp_path / "vars.json"
    var_file.write_text(json.dumps({"configuration": overrides}))
    command = [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "chaostoolkit.log"),
               "run", "--journal-path", str(journal), "--var-file", str(var_file), str(path)]
    done = subprocess.run(command, cwd=tmp_path, env=dict(os.environ), capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert journal.exists(), f"no journal; stderr:\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(journal.read_text())


def outputs(journal: dict) -> dict[str, Any]:
    """Map each method activity's name to its run entry."""
    return {entry["activity"]["name"]: entry for entry in journal.get("run", [])}


def expectation(experiment: dict) -> str:
    tags = [t for t in experiment.get("tags", []) if t.startswith("expect:")]
    assert len(tags) == 1, "every catalog experiment states its expected outcome in a tag"
    return tags[0].split(":", 1)[1]


def skip_unless_hardware(experiment: dict) -> None:
    """Skip an experiment tagged needs:gpu (needs:gpus:N) where NVML sees fewer GPUs."""
    needed = 0
    for tag in experiment.get("tags", []):
        if tag == "needs:gpu":
            needed = max(needed, 1)
        elif tag.startswith("needs:gpus:"):
            needed = max(needed, int(tag.rsplit(":", 1)[1]))
    if not needed:
        return
    from chaosgpu.node import nvml_snapshot

    seen = len(nvml_snapshot(with_processes=False).get("devices") or [])
    if seen < needed:
        pytest.skip(f"needs {needed} GPU(s), NVML sees {seen}")


def test_catalog_is_complete() -> None:
    """The catalog covers every scenario and remediation of the field report."""
    names = {p.stem for p in EXPERIMENTS}
    assert names == set(OVERRIDES), "add the new experiment to OVERRIDES (and to the README)"
    for path in EXPERIMENTS:
        experiment = json.loads(path.read_text())
        assert expectation(experiment) in ("deviated", "completed")
        assert experiment["runtime"]["rollbacks"]["strategy"] == "always"
        assert experiment["description"]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.stem for p in EXPERIMENTS])
def test_chaos_validate(path: Path, tmp_path: Path) -> None:
    """`chaos validate` accepts every experiment of the catalog."""
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "validate", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("path", SELF_CONTAINED, ids=[p.stem for p in SELF_CONTAINED])
def test_catalog_experiment(path: Path, tmp_path: Path) -> None:
    """Run the experiment for real; check outcome, measurements and that nothing is left."""
    experiment = json.loads(path.read_text())
    skip_unless_hardware(experiment)
    expected = expectation(experiment)
    code, journal = run_experiment(path, tmp_path, OVERRIDES[path.stem])
    log = (tmp_path / "chaostoolkit.log").read_text()[-4000:]

    assert journal["status"] == "completed", log
    assert journal["deviated"] is (expected == "deviated"), log
    assert code == (1 if expected == "deviated" else 0), log
    for entry in journal["run"]:
        assert entry["status"] == "succeeded", (entry["activity"]["name"], entry.get("exception"))
    for entry in journal.get("rollbacks", []):
        assert entry["status"] == "succeeded", (entry["activity"]["name"], entry.get("exception"))
    assert journal.get("chaosgpu", {}).get("summary"), "the timeline control wrote no summary"

    check_measurements(path.stem, experiment, outputs(journal), OVERRIDES[path.stem])
    assert not state.list_records("sandboxes"), "a sandbox record was left behind"
    assert not state.list_records("workloads"), "a workload record was left behind"


def check_measurements(name: str, experiment: dict, out: dict[str, Any],
                       overrides: dict[str, Any]) -> None:
    """Assert the figures each scenario exists to measure, with bounds for a noisy machine."""
    config = {**experiment["configuration"], **overrides}
    if name.startswith("gpu-"):
        from test_gpu_catalog import check_gpu_measurements

        check_gpu_measurements(name, out, config)
    elif name.startswith(("pod-delete", "non-root", "driver-api")):
        grace = float(config["grace_s"])
        release = out["release-time-after-delete"]["output"]
        held = out["gb-seconds-held-during-delete"]["output"]
        orphans = out["orphans-after-start"]["output"] if "orphans-after-start" in out else None
        if "expect:deviated" in experiment["tags"]:
            assert release is not None and grace * 0.8 <= release <= grace + 3.0, release
            assert held > 0
            assert orphans == config["workers"]
        else:
            assert release is not None and release < 1.0, release
    elif name.startswith("zombies"):
        zombies = out["zombies-after-kill"]["output"]
        assert out["orphans-after-start"]["output"] == config["workers"]
        if config["init"] == "sleep":
            assert len(zombies) == config["workers"]
        else:
            assert zombies == []
    elif name == "nccl-timeout-remediation":
        settle = out["survivors-end-by-themselves"]["output"]
        assert settle["all_exited"] and settle["verdict"] == "failed", settle["reason"]
        assert out["memory-back-after-the-fault"]["output"] is not None
    else:
        hang = out["detect-hang"]["output"]
        assert hang["hung"] is True, hang["reason"]
        assert hang["detection"]["after_fault_s"] <= 8.0, hang["detection"]
        assert hang["blocked_in"]["kind"] in ("collective", "wait"), hang["blocked_in"]
