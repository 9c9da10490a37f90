"""Observed job verdicts on real torchrun and bare gloo jobs written for the tests
(tests/jobs/train.py): each verdict with its evidence and timing, and no false verdict on
healthy jobs (lockstep compute longer than the window, a normal end, a checkpoint after
destroy_process_group)."""

import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import require_tool

pytest.importorskip("torch")

from jobs.launch import Job, start_bare, start_torchrun  # noqa: E402

from chaosgpu.job import actions, probes  # noqa: E402
from chaosgpu.job.observe import Observer  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def watch(observer: Observer, seconds: float, stop: Any = None) -> list[str]:
    """Tick for `seconds` (or until `stop(track)`), returning every verdict seen."""
    seen: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        observer.tick()
        for track in observer.tracks.values():
            if not seen or seen[-1] != track.verdict:
                seen.append(track.verdict)
            if stop is not None and stop(track):
                return seen
        time.sleep(observer.tick_s)
    return seen


def _require_nft_as_root() -> None:
    """Skip unless nftables can be written here (nft on PATH, root)."""
    require_tool("nft", install="apt-get install nftables")
    if os.geteuid() != 0:
        pytest.skip("needs root to add nftables rules")


def only_track(observer: Observer) -> Any:
    assert len(observer.tracks) == 1, list(observer.tracks)
    return next(iter(observer.tracks.values()))


def test_a_healthy_job_is_running_and_never_hung(workdir: Path, jobs: list[Job]) -> None:
    job = start_torchrun(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    state = probes.job_state(job=job.run_id)
    assert state["verdict"] == "running", state["reason"]
    assert state["found"] and state["restart_count"] == 0 and state["backend"] == "gloo"
    assert {r["rank"] for r in state["ranks"]} == {0, 1}
    observer = Observer(job=job.run_id)
    try:
        seen = watch(observer, 8.0)
    finally:
        observer.close()
    assert "hung" not in seen and seen[-1] == "running", seen
    track = only_track(observer)
    assert {"proc", "tcp", "py-spy"} <= track.sources
    assert all(r.last_progress and time.time() - r.last_progress < 2.0
               for r in track.current_ranks())


def test_lockstep_compute_longer_than_the_window_then_a_normal_end(workdir: Path,
                                                                   jobs: list[Job]) -> None:
    job = start_torchrun(workdir, ["--steps", "2", "--compute-s", "20", "--sleep-s", "0"])
    jobs.append(job)
    observer = Observer(tag=job.tag)
    try:
        seen = watch(observer, 120.0, stop=lambda t: t.verdict in ("finished", "failed"))
    finally:
        observer.close()
    track = only_track(observer)
    assert "hung" not in seen, (seen, track.history)
    assert track.verdict == "finished", (track.reason, job.logs())
    assert all(r.exit is not None and r.exit.code == 0 for r in track.current_ranks())
    assert job.wait_exit(20) == [0]


def test_a_checkpoint_after_destroy_process_group_is_not_a_hang(workdir: Path,
                                                                 jobs: list[Job]) -> None:
    job = start_torchrun(workdir, ["--steps", "6", "--checkpoint-rank", "0",
                                   "--checkpoint-s", "7"])
    jobs.append(job)
    observer = Observer(job=job.run_id)
    try:
        seen = watch(observer, 120.0, stop=lambda t: t.verdict in ("finished", "failed"))
    finally:
        observer.close()
    track = only_track(observer)
    assert "hung" not in seen, (seen, track.history)
    assert track.verdict == "finished", track.reason
    ranks = {r.rank: r for r in track.current_ranks()}
    assert ranks[0].exited_at - ranks[1].exited_at > 4.0  # rank 0 saved alone for seconds


def test_sigkill_of_a_gloo_rank_is_a_failed_job_not_a_hung_one(workdir: Path,
                                                               jobs: list[Job]) -> None:
    job = start_torchrun(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(job=job.run_id, rank=1, wait_s=0)
    assert killed["result"] == "sent"
    started = time.monotonic()
    found = probes.detect_hang(job=job.run_id, timeout_s=20)
    assert time.monotonic() - started < 5.0
    assert found["verdict"] == "failed" and found["hung"] is False, found["reason"]
    ranks = {r["rank"]: r for r in found["ranks"]}
    assert ranks[1]["exit"]["signal"] == "SIGKILL"
    assert "chaosgpu's fault" in found["reason"]
    assert ranks[0]["exit"]["text"] != "exit status not visible"
    assert_survivor_failed_on_the_lost_peer(ranks[0])
    assert found["detection"]["after_fault_s"] < 5.0


def assert_survivor_failed_on_the_lost_peer(rank: dict[str, Any]) -> None:
    """The gloo survivor raised on the closed connection (its torchelastic error file says so);
    only when torchrun's teardown SIGTERMed it before it raised is there no error to read."""
    if rank["error"] is None:
        assert rank["exit"]["signal"] == "SIGTERM", rank
    else:
        assert "Connection" in rank["error"]["text"], rank


def test_a_job_gone_before_the_probe_is_judged_from_the_fault_record(workdir: Path,
                                                                      jobs: list[Job]) -> None:
    """The job ends entirely (survivor failed, launcher exited) before the probe's first
    census: the verdict comes from the fault's record and the pooled pidfds of every rank."""
    job = start_torchrun(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    actions.kill_rank(job=job.run_id, rank=1, wait_s=0)
    assert job.wait_exit(30) == [1], job.logs()  # torchrun itself is gone
    found = probes.detect_hang(job=job.run_id, timeout_s=10)
    assert found["verdict"] == "failed" and found["hung"] is False, found["reason"]
    ranks = {r["rank"]: r for r in found["ranks"]}
    assert set(ranks) == {0, 1}, found["ranks"]
    assert ranks[1]["exit"]["signal"] == "SIGKILL"
    assert ranks[0]["exit"]["source"] == "pidfd", ranks[0]
    assert_survivor_failed_on_the_lost_peer(ranks[0])
    assert "gone by" in found["reason"], found["reason"]
    assert any("fault record" in e["what"] for e in found["evidence"]), found["evidence"]


def test_a_stopped_rank_hangs_its_peers_with_evidence(workdir: Path, jobs: list[Job]) -> None:
    job = start_torchrun(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    assert probes.job_hung(job=job.run_id) is False
    actions.freeze_rank(job=job.run_id, rank=1)
    found = probes.detect_hang(job=job.run_id, timeout_s=20)
    assert found["verdict"] == "hung", found["reason"]
    assert found["detection"]["after_fault_s"] < 5.0
    assert found["blocked_in"]["kind"] == "collective"
    assert found["blocked_in"]["what"] == "all_reduce" and found["blocked_in"]["ranks"] == [0]
    (culprit,) = found["culprit_ranks"]
    assert culprit["rank"] == 1 and culprit["why"].startswith("stopped")
    (blocked,) = found["blocked"]
    assert "all_reduce" in blocked["stack"] and "train.py" in blocked["stack"]
    assert probes.job_hung(job=job.run_id) is True
    report = actions.cleanup_hung_job(job=job.run_id, grace_s=1, deadline_s=20)
    assert report["not_removed"] == [], report
    gone = probes.job_state(job=job.run_id, missing_ok=True)
    assert gone["found"] is False or gone["verdict"] in ("failed", "unknown")


def test_a_rank_stalled_in_python_is_the_culprit_of_a_hang(workdir: Path,
                                                           jobs: list[Job]) -> None:
    job = start_torchrun(workdir, ["--stall-rank", "1", "--stall-at", "8", "--stall-s", "300"])
    jobs.append(job)
    job.wait_steps(3)
    found = probes.detect_hang(job=job.run_id, timeout_s=30)
    assert found["verdict"] == "hung", found["reason"]
    stalled_at = job.progress()[1]["t"]  # rank 1's last step: the hang began after it
    assert found["confirmed_at"] - stalled_at < 6.0
    assert found["detection"]["after_hang_began_s"] < 5.0
    assert found["since_known"] is True  # the last progress was seen: the hang began then
    (culprit,) = found["culprit_ranks"]
    assert culprit["rank"] == 1 and culprit["why"].startswith("alive, not in a collective")
    assert "time.sleep" in culprit["why"] and "time.sleep" not in (found["blocked"][0]["stack"])
    assert found["blocked_in"]["what"] == "all_reduce"


def test_ddp_hang_shows_the_main_thread_in_backward(workdir: Path, jobs: list[Job]) -> None:
    job = start_torchrun(workdir, ["--ddp"])
    jobs.append(job)
    job.wait_steps(3)
    assert probes.job_state(job=job.run_id)["verdict"] == "running"
    actions.freeze_rank(job=job.run_id, rank=1)
    found = probes.detect_hang(job=job.run_id, timeout_s=20)
    assert found["verdict"] == "hung", found["reason"]
    assert found["blocked_in"]["kind"] == "backward"
    assert "_engine_run_backward" in found["blocked_in"]["frame"]
    assert "backward" in found["blocked"][0]["stack"]


def test_ranks_blocked_in_ddps_constructor_are_hung_with_the_late_rank_as_culprit(
        workdir: Path, jobs: list[Job]) -> None:
    """DDP's constructor runs collectives of its own (parameter shapes verified across ranks,
    module states broadcast): a rank that never gets there hangs its peers inside it."""
    job = start_torchrun(workdir, ["--ddp", "--ddp-delay-rank", "1"])
    jobs.append(job)
    found = probes.wait_job_verdict(["hung", "failed"], job=job.run_id, timeout_s=90)
    assert found["verdict"] == "hung", found["reason"]
    assert found["blocked_in"]["kind"] == "collective", found["blocked_in"]
    assert found["blocked_in"]["what"].startswith("DDP "), found["blocked_in"]
    assert found["blocked_in"]["ranks"] == [0]
    (culprit,) = found["culprit_ranks"]
    assert culprit["rank"] == 1 and "time.sleep" in culprit["why"], culprit
    assert "after_hang_began_s" in found["detection"]


def test_an_elastic_restart_keeps_the_job_and_counts_restarts(workdir: Path,
                                                              jobs: list[Job]) -> None:
    job = start_torchrun(workdir, [], max_restarts=2)
    jobs.append(job)
    job.wait_steps(3)
    observer = Observer(job=job.run_id)
    try:
        watch(observer, 2.0)
        actions.kill_rank(job=job.run_id, rank=1, wait_s=0)
        seen = watch(observer, 90.0, stop=lambda t: t.verdict in ("failed", "hung")
                     or (t.verdict == "running" and (t.restart_count() or 0) > 0))
    finally:
        observer.close()
    track = only_track(observer)
    assert track.id == job.run_id
    assert "restarting" in seen, seen
    assert (track.restart_count() or 0) >= 1
    restarted = [t for t in track.ranks.values() if (t.restart_count or 0) >= 1]
    assert restarted and all(t.pid not in {r.pid for r in track.ranks.values()
                                           if not r.restart_count} for t in restarted)
    # torch's own restart then either runs, sticks in its rendezvous or fails: each is said
    # with its evidence
    assert track.verdict in ("running", "hung", "failed"), track.reason


def test_an_elastic_agent_waiting_for_its_first_rendezvous_is_not_restarting(
        workdir: Path, jobs: list[Job]) -> None:
    """torchrun --nnodes=1:2 waits (last_call_timeout) for a second node before it starts any
    rank: nothing has restarted, and the verdict says what is seen (before round 22 every
    torchrun job's first verdict was "restarting")."""
    job = start_torchrun(workdir, [], launcher_args=[
        "--nnodes=1:2", "--rdzv-conf=last_call_timeout=30,join_timeout=60"])
    jobs.append(job)
    observer = Observer(job=job.run_id)
    try:
        deadline = time.monotonic() + 20
        while not observer.tracks and time.monotonic() < deadline:
            observer.tick()
            observer.pause(observer.tick_s)
        seen = watch(observer, 3.0)
        track = only_track(observer)
    finally:
        observer.close()
    assert job.progress() == {}, job.progress()  # no rank has started (ground truth)
    assert track.launcher_alive and not track.ranks
    assert seen == ["unknown"], (seen, track.history)
    assert "seen no rank of it yet" in track.reason, track.reason


def test_ranks_stuck_in_the_rendezvous_are_hung_with_the_missing_rank_as_culprit(
        workdir: Path, jobs: list[Job]) -> None:
    job = start_torchrun(workdir, ["--delay-rank", "1"])
    jobs.append(job)
    found = probes.wait_job_verdict(["hung", "failed"], job=job.run_id, timeout_s=90)
    assert found["verdict"] == "hung", found["reason"]
    assert found["blocked_in"]["kind"] == "rendezvous", found["blocked_in"]
    assert found["blocked_in"]["ranks"] == [0]
    (culprit,) = found["culprit_ranks"]
    assert culprit["rank"] == 1 and "time.sleep" in culprit["why"], culprit


def test_a_partitioned_rank_hangs_its_peers_and_healing_resumes_the_job(
        workdir: Path, jobs: list[Job]) -> None:
    _require_nft_as_root()
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    job = start_torchrun(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    # "any": the last live rank, rank 1 of two, as kill_rank picks it
    cut = network.partition_rank(rank="any", job=job.run_id)
    try:
        assert cut["rank"] == 1 and cut["connections"], cut
        found = probes.detect_hang(job=job.run_id, timeout_s=20)
        assert found["verdict"] == "hung", found["reason"]
        culprits = {c["rank"]: c["why"] for c in found["culprit_ranks"]}
        assert culprits.get(1, "").startswith("partitioned"), culprits
        assert found["partitions"] and found["partitions"][0]["id"] == cut["partition"]
    finally:
        healed = network.heal_partition(partition=cut["partition"])
    assert healed["removed"] is True
    assert partitions.active() == []
    back = probes.wait_job_verdict(["running"], job=job.run_id, timeout_s=60)
    assert back["reached"], back["reason"]
    assert network.heal_partition(partition=cut["partition"])["removed"] is False


def test_node_loss_partition_then_kill_hangs_a_gloo_job(workdir: Path, jobs: list[Job]) -> None:
    _require_nft_as_root()
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    job = start_bare(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    try:
        failed = actions.fail_rank(tag=job.tag, rank="any", how="auto")
        assert failed["done"] == "node-loss" and failed["kill"]["result"] == "sent"
        assert failed["rank"] == failed["kill"]["rank"] == 1, failed
        found = probes.detect_hang(tag=job.tag, timeout_s=20)
        assert found["verdict"] == "hung", found["reason"]
        culprit = {c["rank"]: c["why"] for c in found["culprit_ranks"]}[1]
        assert culprit.startswith("partitioned"), culprit
        # a node loss: cut off, then killed (before round 22 only "partitioned" was said)
        assert "then ended: killed by SIGKILL (chaosgpu's fault)" in culprit, culprit
        ranks = {r["rank"]: r for r in found["ranks"]}
        assert ranks[1]["state"] == "exited" and ranks[1]["exit"]["signal"] == "SIGKILL"
    finally:
        network.heal_all_partitions()
    assert partitions.active() == []


def test_under_torchrun_the_rank_killed_from_outside_failed_first(workdir: Path,
                                                                   jobs: list[Job]) -> None:
    """Rank 1 is SIGKILLed from outside (not by chaosgpu) while the observer waits between two
    readings; torchrun then stops rank 0 with SIGTERM (its teardown, 0.1 s later at the
    soonest). The next reading finds both gone, but the pidfds told the observer when each
    ended: rank 1 alone failed first (before round 22 both were culprits, "failed first")."""
    import signal
    import threading

    job = start_torchrun(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    observer = Observer(job=job.run_id)
    try:
        observer.tick()
        victim = job.progress()[1]["pid"]
        killer = threading.Timer(0.05, os.kill, (victim, signal.SIGKILL))
        killer.start()
        observer.pause(3.0)  # rank 1 is killed and torchrun tears rank 0 down meanwhile
        killer.join()
        observer.run(lambda o: only_track(o).verdict == "failed", 30.0)
        track = only_track(observer)
        found = track.to_json()
    finally:
        observer.close()
    assert found["verdict"] == "failed", (found["reason"], track.history)
    ranks = {r["rank"]: r for r in found["ranks"]}
    assert ranks[1]["pid"] == victim and ranks[1]["exit"]["signal"] == "SIGKILL", ranks[1]
    assert ranks[0]["exit"]["source"] == "pidfd", ranks[0]
    assert 0.01 < ranks[0]["exited_at"] - ranks[1]["exited_at"] < 3.0, ranks
    assert [c["rank"] for c in found["culprit_ranks"]] == [1], found["culprit_ranks"]
    assert "s after rank 1" in found["reason"], found["reason"]
    assert any(e["source"] == "pidfd" and "ended at" in e["what"]
               for e in found["evidence"]), found["evidence"]


def test_cleanup_hung_job_heals_the_partition_of_the_ranks_it_removes(
        workdir: Path, jobs: list[Job]) -> None:
    """A node loss (partition, then SIGKILL) hangs a gloo job; cleanup_hung_job removes the
    job and heals the partition this run made against it: its connection rules would outlive
    the job (before round 22 only heal_partition or chaosgpu cleanup removed them)."""
    _require_nft_as_root()
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    job = start_bare(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    try:
        failed = actions.fail_rank(tag=job.tag, rank="any", how="node-loss")
        ident = failed["partition"]
        assert ident in {p["id"] for p in partitions.active()}, failed
        report = actions.cleanup_hung_job(tag=job.tag, grace_s=1, deadline_s=20)
        assert report["not_removed"] == [], report
        assert [(h["id"], h["removed"]) for h in report["healed_partitions"]] == [(ident, True)]
        assert ident not in {p["id"] for p in partitions.active()}
    finally:
        network.heal_all_partitions()
    assert partitions.active() == []


def test_a_bare_job_whose_rank_is_killed_fails_with_exit_codes(workdir: Path,
                                                              jobs: list[Job]) -> None:
    job = start_bare(workdir, [])
    jobs.append(job)
    job.wait_steps(3)
    actions.kill_rank(tag=job.tag, rank=0, wait_s=0)
    found = probes.wait_survivors_exit(tag=job.tag, timeout_s=30)
    assert found["all_exited"] and found["verdict"] == "failed", found["reason"]
    exits = found["exits"]
    assert exits["0"]["exit"]["signal"] == "SIGKILL"
    assert exits["1"]["exit"]["code"] == 1


def test_a_rank_in_its_own_network_namespace_is_partitioned_there(workdir: Path,
                                                                  jobs: list[Job]) -> None:
    import subprocess
    import uuid

    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    require_tool("ip", install="apt-get install iproute2")
    _require_nft_as_root()
    name = f"chaosgpu-test-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
                       check=True)
        job = start_bare(workdir, [], netns=name)
        jobs.append(job)
        job.wait_steps(3)
        cut = network.partition_rank(rank=1, tag=job.tag)
        record = next(p for p in partitions.active() if p["id"] == cut["partition"])
        assert record["netns_pid"] is not None  # the rules live in the job's namespace
        host = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
        assert cut["table"] not in host.stdout  # and not in the runner's
        inside = subprocess.run(["ip", "netns", "exec", name, "nft", "list", "tables"],
                                capture_output=True, text=True, check=True)
        assert cut["table"] in inside.stdout
        found = probes.detect_hang(tag=job.tag, timeout_s=30)
        assert found["verdict"] == "hung", found["reason"]
        assert {c["rank"] for c in found["culprit_ranks"]} == {1}
        network.heal_partition(partition=cut["partition"])
        after = subprocess.run(["ip", "netns", "exec", name, "nft", "list", "tables"],
                               capture_output=True, text=True, check=True)
        assert cut["table"] not in after.stdout
    finally:
        for job in jobs:
            job.stop()
        subprocess.run(["ip", "netns", "del", name], check=False)


@pytest.mark.parametrize("unknown_for_s, known", [(1.0, False), (30.0, True)])
def test_a_verdict_after_a_long_unknown_was_seen_as_it_came(unknown_for_s: float,
                                                             known: bool) -> None:
    """A first verdict right after the first look's "unknown" may have held before the watch
    began (`since_known` false); one after an "unknown" that outlasted a window (ranks idle,
    then stepping again) was seen as it came. Before round 21 both read "already when first
    seen"."""
    from chaosgpu.job.verdict import JobTrack

    track = JobTrack("a-job", window_s=10.0, now=1000.0)
    decisions = iter([("unknown", "idle or sleeping?", None, {}),
                      ("running", "its ranks make progress", None, {})])
    track._decide = lambda now: next(decisions)  # type: ignore[method-assign]
    assert track.evaluate(1000.0) == "unknown"
    assert track.evaluate(1000.0 + unknown_for_s) == "running"
    assert track.since_known is known and track.since == 1000.0 + unknown_for_s
