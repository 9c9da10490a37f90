"""The sandbox and workload activities driven by the real `chaos` CLI (a subprocess)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chaosgpu import state

REPO = Path(__file__).resolve().parent.parent

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
            # checked before the method creates the pod, without the timeline control
            # (which would tell before from after): missing_ok true says it may be absent
            "probes": [{**activity("probe", "chaosgpu.sandbox.probes", "sandbox_exists",
                                   name=name, missing_ok=True), "tolerance": False}],  # fmt: skip
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


def _run(experiment: Path, tmp_path: Path, configuration: dict[str, object],
         env: dict[str, str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    """`chaos run` of `experiment` with `configuration` (--var-file) in `env`: (rc, journal)."""
    variables = tmp_path / "vars.json"
    variables.write_text(json.dumps({"configuration": configuration}))
    journal = tmp_path / "journal.json"
    done = subprocess.run(
        [_chaos(), "--no-version-check", "--log-file", str(tmp_path / "chaos.log"), "run",
         "--journal-path", str(journal), "--var-file", str(variables), str(experiment)],
        cwd=tmp_path, env=env, capture_output=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert journal.exists(), done.stderr.decode()[-2000:]
    return done.returncode, json.loads(journal.read_text())


def _names(tmp_path: Path) -> dict[str, object]:
    """A pod and tag of the zombies experiment unique to this test (no other run's match)."""
    suffix = f"{os.getpid()}-{tmp_path.name[-12:]}".replace("_", "-")
    return {"pod": f"zp-{suffix}", "tag": f"zt-{suffix}", "mib": 16}


def test_a_runner_carrying_the_tag_kills_only_the_workers(tmp_path: Path) -> None:
    # `CHAOSGPU_TAG=<tag> chaos run zombies-sleep-pid1.json`: the kill by tag hit the sandbox
    # supervisor and `unshare` (which inherited it from the runner) too: the pod died, took
    # its zombies with it, and the baseline ended completed instead of deviated.
    names = _names(tmp_path)
    rc, journal = _run(REPO / "experiments" / "zombies-sleep-pid1.json", tmp_path, names,
                       dict(os.environ, CHAOSGPU_TAG=str(names["tag"])))
    runs = {r["activity"]["name"]: r for r in journal["run"]}
    workers = sorted(runs["start-workers"]["output"]["pids"])
    hit = runs["kill-workers"]["output"]["results"]
    assert sorted(r["pid"] for r in hit if r["result"] == "sent") == workers, hit
    assert sorted(runs["zombies-after-kill"]["output"]) == workers
    assert rc == 1 and journal["deviated"] is True, (rc, journal["status"])
    assert all(r["status"] == "succeeded" for r in journal["rollbacks"])
    assert state.list_records("sandboxes") == {} and state.list_records("workloads") == {}


def test_rollbacks_with_a_typo_fail_and_say_so(tmp_path: Path) -> None:
    # The tester's z-rb-sandbox-typo: remove_sandbox(name="zombie-pod-slep") said "no such
    # sandbox" and succeeded, and the real pod was left. The typo'd rollbacks must fail naming
    # the typo and what exists; the correct ones played after them clean up.
    names = _names(tmp_path)
    pod, tag = str(names["pod"]), str(names["tag"])
    experiment = json.loads((REPO / "experiments" / "zombies-sleep-pid1.json").read_text())
    correct = experiment["rollbacks"]
    typos = json.loads(json.dumps(correct).replace("${pod}", pod + "-slep")
                       .replace("${tag}", tag + "-typo"))
    experiment["rollbacks"] = typos + correct
    path = tmp_path / "typos.json"
    path.write_text(json.dumps(experiment))
    _, journal = _run(path, tmp_path, names, dict(os.environ))
    rollbacks = journal["rollbacks"]
    assert [r["status"] for r in rollbacks] == ["failed", "failed", "succeeded", "succeeded"]
    assert f"no sandbox named '{pod}-slep' is recorded, and this run never created it: a " \
           f"typo? Recorded sandboxes: ['{pod}']" in rollbacks[0]["exception"][-1]
    assert f"no workload tagged '{tag}-typo' is recorded, and this run never met that tag" \
           in rollbacks[1]["exception"][-1]
    assert f"a typo? Recorded workloads: ['{tag}']" in rollbacks[1]["exception"][-1]
    assert rollbacks[2]["output"]["removed"] is True
    assert state.list_records("sandboxes") == {} and state.list_records("workloads") == {}
