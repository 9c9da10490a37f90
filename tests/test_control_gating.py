"""The timeline control's gate and the report, on real `chaos run` subprocesses of experiments
written here, with real host-memory holders (started with the test's CHAOSGPU_TEST_ID: the
autouse fixture proves none is left alive).

* A rollback that failed: recorded in the journal (`gating.failed_rollbacks`); with
  `fail_on_failed_activity` the run is failed, not deviated (Chaos Toolkit alone ends it
  "completed", exit 0); the report names it and counts no figure from that cleanup.
* The residual is read from a sample taken after the rollbacks ended (at 20 Hz the last sample
  came before the rollback's kill: 90 MiB claimed for a killed holder).
* A `fault_activity` naming no action of the method is refused before anything runs.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from chaosgpu.sandbox import runtime
from chaosgpu.scope import resolve_scope

BIN = Path(sys.executable).parent
CHAOS, CHAOSGPU = str(BIN / "chaos"), str(BIN / "chaosgpu")


def _control(strict: bool, tag: str, rate_hz: int = 20, **extra: Any) -> list[dict[str, Any]]:
    arguments = {"rate_hz": rate_hz, "scope": {"tag": tag}, "fail_on_failed_activity": strict,
                 "fail_on_missed_steady_state": True} | extra
    return [{"name": "chaosgpu-timeline", "provider": {
        "type": "python", "module": "chaosgpu.timeline.control", "arguments": arguments}}]


def _action(title: str, module: str, func: str, pause_after: float = 0, **arguments: Any
            ) -> dict[str, Any]:
    action: dict[str, Any] = {"type": "action", "name": title, "provider": {
        "type": "python", "module": module, "func": func, "arguments": arguments}}
    if pause_after:
        action["pauses"] = {"after": pause_after}
    return action


def _start(tag: str, mib: int, pause_after: float = 0) -> dict[str, Any]:
    return _action("start", "chaosgpu.workloads.actions", "start_holders", pause_after,
                   count=1, mib=mib, via="host", tag=tag)


def _stop(name: str, tag: str) -> dict[str, Any]:
    return _action(name, "chaosgpu.workloads.actions", "stop_workload", tag=tag, grace_s=0)


def _experiment(title: str, controls: list[dict[str, Any]], method: list[dict[str, Any]],
                rollbacks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": "1.0.0", "title": title, "description": "written by the test",
            "controls": controls, "method": method, "rollbacks": rollbacks,
            "runtime": {"rollbacks": {"strategy": "always"}}}


def _run(tmp_path: Path, experiment: dict[str, Any]
         ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any] | None]:
    """`chaos run` of `experiment` in `tmp_path`: the process and its journal (None if none)."""
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(experiment))
    journal = tmp_path / "journal.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "run", "--journal-path", str(journal), str(path)],
                          cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    return done, json.loads(journal.read_text()) if journal.exists() else None


def _report(tmp_path: Path) -> str:
    """`chaosgpu report` of the run's journal: its report.md."""
    out = tmp_path / "report"
    done = subprocess.run([CHAOSGPU, "report", str(tmp_path / "journal.json"), "--out",
                           str(out), "--no-plots"], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr
    return (out / "report.md").read_text()


def _row(report: str) -> str:
    """The run's row of the report's comparison table."""
    return next(line for line in report.splitlines() if line.startswith("| journal | host"))


def _columns(report: str) -> tuple[list[str], list[str]]:
    """(header, the run's row) of the report's comparison table, cell by cell."""
    header = next(line for line in report.splitlines()
                  if line.startswith("| run | memory measured"))
    return ([cell.strip() for cell in header.strip("|").split("|")],
            [cell.strip() for cell in _row(report).strip("|").split("|")])


def _tagged(tag: str) -> list[int]:
    return [p["pid"] for p in resolve_scope({"tag": tag}, observe=True) if not p.get("zombie")]


def _tag() -> str:
    return f"gate-{uuid.uuid4().hex[:8]}"


def _failed_cleanup(strict: bool, tag: str) -> dict[str, Any]:
    """A holder frozen by the method (its memory held), a typo'd rollback that fails (this run
    never met that tag), then the rollback that kills the holder."""
    return _experiment(
        "a cleanup that fails", _control(strict, tag),
        [_start(tag, 32),
         _action("freeze", "chaosgpu.process.actions", "freeze_processes", 1.0,
                 scope={"tag": tag}, method="sigstop")],
        [_stop("stop-typo", tag + "x"), _stop("stop", tag)])


def test_a_failed_rollback_fails_the_gated_run_and_shows_in_the_report(tmp_path: Path) -> None:
    # Before the fix: exit 0, "completed", an empty gating, and the report's waste "held until
    # the cleanup" with a projection counted from the cleanup that failed.
    tag = _tag()
    done, journal = _run(tmp_path, _failed_cleanup(True, tag))
    assert journal is not None, done.stdout + done.stderr
    assert [r["status"] for r in journal["rollbacks"]] == ["failed", "succeeded"]
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    assert journal["status"] == "failed" and journal["deviated"] is False
    gating = journal["chaosgpu"]["gating"]
    (failed,) = gating["failed_rollbacks"]
    assert failed["name"] == "stop-typo" and f"{tag}x" in failed["error"]
    assert "'stop-typo' failed" in gating["failed_by"]
    assert "rollback(s) failed" in (tmp_path / "log").read_text()
    report = _report(tmp_path)
    assert f"cleanup failed: rollback 'stop-typo' failed (no workload tagged '{tag}x'" in report
    row = _row(report)
    assert "held until the cleanup" not in row and "projected" not in row
    assert "cleanup failed" in row
    assert not _tagged(tag)


def test_a_failed_rollback_without_the_gate_is_recorded(tmp_path: Path) -> None:
    tag = _tag()
    done, journal = _run(tmp_path, _failed_cleanup(False, tag))
    assert journal is not None, done.stdout + done.stderr
    assert done.returncode == 0 and journal["status"] == "completed"
    assert [e["name"] for e in journal["chaosgpu"]["gating"]["failed_rollbacks"]] == [
        "stop-typo"]
    assert "failed_by" not in journal["chaosgpu"]["gating"]
    assert "cleanup failed: rollback 'stop-typo' failed" in _report(tmp_path)
    assert not _tagged(tag)


def test_the_residual_is_sampled_after_the_rollbacks(tmp_path: Path) -> None:
    # Before the fix the last sample came before the rollback's kill: residual 90 MiB for a
    # 64 MiB holder the rollback had killed (at 20 Hz; at 1 Hz, here, nearly always).
    tag = _tag()
    done, journal = _run(tmp_path, _experiment(
        "a holder killed by the rollback", _control(True, tag, rate_hz=1),
        [_start(tag, 64, pause_after=2.5)], [_stop("stop", tag)]))
    assert journal is not None and done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    section = journal["chaosgpu"]
    timeline = section["timeline"]
    end = max(e["t"] for e in timeline["events"]
              if e["name"] == "rollbacks" and e["phase"] == "end")
    assert max(timeline["total_mib"]) - timeline["baseline"]["total_mib"] > 60  # it was held
    header, row = _columns(_report(tmp_path))
    assert row[header.index("residual (MiB)")] == "0.0", row
    assert section["summary"]["final_total_mib"] - timeline["baseline"]["total_mib"] < 1
    assert timeline["t"][-1] > end and section["summary"]["final_after_end"] is True
    assert not _tagged(tag)


def test_a_fault_activity_naming_no_action_is_refused_before_anything_runs(
        tmp_path: Path) -> None:
    # Before the fix "kil-workers" was ignored and the report took the SIGCONT of 'nudge' for
    # the fault.
    tag = _tag()
    experiment = _experiment(
        "a typo'd fault_activity", _control(True, tag, fault_activity="kil-workers"),
        [_start(tag, 16),
         _action("nudge", "chaosgpu.process.actions", "signal_processes",
                 scope={"tag": tag}, signal="SIGCONT"),
         _action("kill-workers", "chaosgpu.process.actions", "signal_processes",
                 scope={"tag": tag}, signal="SIGKILL", wait_gone_s=5)],
        [_stop("stop", tag)])
    done, journal = _run(tmp_path, experiment)
    assert journal is not None, done.stdout + done.stderr
    assert done.returncode == 1
    assert journal["status"] == "interrupted" and journal["run"] == []
    log = (tmp_path / "log").read_text()
    assert "fault_activity 'kil-workers' names no action of the method" in log
    assert "['start', 'nudge', 'kill-workers']" in log
    assert [r["status"] for r in journal["rollbacks"]] == ["succeeded"]  # a no-op
    assert not _tagged(tag)
    validated = subprocess.run([CHAOSGPU, "validate", str(tmp_path / "experiment.json")],
                               capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
    assert validated.returncode == 1
    assert "fault_activity 'kil-workers' names no action" in validated.stderr


def test_rollbacks_of_a_run_whose_control_cannot_start_are_no_ops(tmp_path: Path) -> None:
    # Before the fix: the `always` rollbacks failed with "a typo?" for their correct names
    # (nothing told "before-method" that the method never started).
    tag, pod = _tag(), f"pod-{uuid.uuid4().hex[:8]}"
    experiment = _experiment(
        "a control that cannot start", _control(True, tag, rate_hz=0),
        [_start(tag, 16),
         _action("create-pod", "chaosgpu.sandbox.actions", "create_sandbox", name=pod)],
        [_stop("stop", tag),
         _action("remove-pod", "chaosgpu.sandbox.actions", "remove_sandbox", name=pod)])
    done, journal = _run(tmp_path, experiment)
    assert journal is not None, done.stdout + done.stderr
    assert done.returncode == 1
    assert journal["status"] == "interrupted" and journal["run"] == []
    assert "the timeline control cannot start (rate_hz" in (tmp_path / "log").read_text()
    assert [r["status"] for r in journal["rollbacks"]] == ["succeeded", "succeeded"], \
        [r.get("exception") for r in journal["rollbacks"]]
    assert journal["rollbacks"][0]["output"]["stopped"] is False
    section = journal["chaosgpu"]
    assert section["timeline"] is None and "did not run" in section["summary"]["error"]
    assert "failed_rollbacks" not in section["gating"]
    assert not _tagged(tag)


def _exists(name: str, probe_name: str) -> dict[str, Any]:
    return {"type": "probe", "name": probe_name, "tolerance": False, "provider": {
        "type": "python", "module": "chaosgpu.sandbox.probes", "func": "sandbox_exists",
        "arguments": {"name": name}}}


def test_a_pod_is_gone_steady_state_does_not_pass_on_a_typo(tmp_path: Path) -> None:
    # Before the fix sandbox_exists("<typo>") was false: "the pod is gone" was met after the
    # method, and the run completed.
    tag, pod = _tag(), f"pod-{uuid.uuid4().hex[:8]}"
    experiment = _experiment(
        "a pod that is gone", _control(True, tag),
        [_start(tag, 16),
         _action("create-pod", "chaosgpu.sandbox.actions", "create_sandbox", name=pod,
                 grace_s=1),
         _action("remove-pod", "chaosgpu.sandbox.actions", "remove_sandbox", name=pod)],
        [_stop("stop", tag)])
    experiment["steady-state-hypothesis"] = {"title": "the pod is gone", "probes": [
        _exists(pod, "pod-gone"), _exists(pod + "-typo", "typo-gone")]}
    done, journal = _run(tmp_path, experiment)
    assert journal is not None, done.stdout + done.stderr
    assert done.returncode == 1, (done.stdout + done.stderr)[-3000:]
    assert [r["status"] for r in journal["run"]] == ["succeeded"] * 3
    assert journal["steady_states"]["before"]["steady_state_met"] is True  # before the method
    after = journal["steady_states"]["after"]["probes"]
    assert [p["status"] for p in after] == ["succeeded", "failed"]
    assert f"no sandbox named '{pod}-typo'" in "".join(after[1]["exception"])
    assert journal["status"] == "failed" and journal["deviated"] is False
    assert [e["name"] for e in journal["chaosgpu"]["gating"]["after_errored"]] == ["typo-gone"]
    assert runtime.get_record(pod) is None  # the pod was removed (its processes: the fixture)
    assert not _tagged(tag)


def test_without_the_control_the_missing_ok_error_names_the_control(tmp_path: Path) -> None:
    # Before the fix the error advised "before-method ... before the method starts": what was
    # given, before the method.
    pod = f"pod-{uuid.uuid4().hex[:8]}"
    experiment = _experiment(
        "no timeline control", [],
        [_action("create-pod", "chaosgpu.sandbox.actions", "create_sandbox", name=pod)], [])
    del experiment["controls"], experiment["rollbacks"], experiment["runtime"]
    experiment["steady-state-hypothesis"] = {"title": "no zombies", "probes": [{
        "type": "probe", "name": "no-zombies", "tolerance": 0, "provider": {
            "type": "python", "module": "chaosgpu.sandbox.probes",
            "func": "sandbox_zombie_count", "arguments": {"name": pod}}}]}
    done, journal = _run(tmp_path, experiment)
    assert journal is not None, done.stdout + done.stderr
    assert journal["run"] == []  # the pod was never created
    (probe,) = journal["steady_states"]["before"]["probes"]
    error = "".join(probe["exception"])
    assert f"no sandbox named '{pod}'" in error
    assert "only with the timeline control (chaosgpu.timeline.control)" in error
    assert "before the method starts" not in error


def test_without_a_scope_the_control_measures_only_this_runs_targets(tmp_path: Path) -> None:
    # Before the fix the default scope was every chaosgpu-tagged process on the node: another
    # game-day's 64 MiB holder was tracked and counted in the baseline.
    tag, stranger = _tag(), _tag()
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; held = bytearray(64 << 20); held[::4096] = "
         "b'x' * len(held[::4096]); print('ready', flush=True); time.sleep(120)"],
        env=dict(os.environ, CHAOSGPU_TAG=stranger), stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
        controls = _control(True, tag)
        del controls[0]["provider"]["arguments"]["scope"]
        done, journal = _run(tmp_path, _experiment(
            "no scope given", controls, [_start(tag, 16, pause_after=1.0)],
            [_stop("stop", tag)]))
        assert other.poll() is None  # the other game-day's holder ran throughout
    finally:
        other.kill()
        other.wait()
    assert journal is not None and done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    section = journal["chaosgpu"]
    summary = section["summary"]
    tags = {entry["tag"] for entry in section["timeline"]["processes"].values()}
    assert tags == {tag}, tags
    assert str(other.pid) not in section["timeline"]["processes"]
    assert summary["baseline_total_mib"] < 32  # the stranger's 64 MiB are not in it
    assert summary["scope"] is None
    assert [entry["tag"] for entry in summary["own_targets"]] == [tag]
    assert f"tag={tag}" in (tmp_path / "log").read_text()
    assert not _tagged(tag)


def test_without_a_scope_or_a_target_the_control_cannot_start(tmp_path: Path) -> None:
    experiment = _experiment(
        "nothing to track", [{"name": "chaosgpu-timeline", "provider": {
            "type": "python", "module": "chaosgpu.timeline.control",
            "arguments": {"rate_hz": 20}}}],
        [{"type": "probe", "name": "jobs", "provider": {
            "type": "python", "module": "chaosgpu.node.probes", "func": "jobs"}}], [])
    done, journal = _run(tmp_path, experiment)
    assert journal is not None, done.stdout + done.stderr
    assert done.returncode == 1 and journal["status"] == "interrupted" and journal["run"] == []
    assert "no scope given, and no activity of the experiment names a tag, job or sandbox" \
        in journal["chaosgpu"]["gating"]["start_error"]
