"""`restarting` is said once the elastic agent's restart is seen, not predicted from its
configuration: a rank killed while its peer still lives and the agent has not acted (a slow
`--monitor-interval`) leaves the verdict to what the live rank shows, its reason saying a
restart is expected; the teardown, when it comes, makes it `restarting`. Before, `restarting`
was said in the first reading after the kill (21 ms after it in a trial), before the agent had
done anything.

Real processes: a torchrun gloo job (tests/jobs/train.py) whose ranks meet every 6 s, its agent
looking at them once a minute: the survivor fails at its next collective, and with no rank left
the restart is seen; removed afterwards (the `jobs` fixture)."""

import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_torchrun  # noqa: E402

from chaosgpu.job import actions  # noqa: E402
from chaosgpu.job.observe import Observer  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_killed_rank_is_no_restart_until_the_agent_is_seen_acting(
        tmp_path: Path, jobs: list[Job]) -> None:
    job = start_torchrun(tmp_path, ["--sleep-s", "6.0"], max_restarts=1,
                         launcher_args=["--monitor-interval=60"])
    jobs.append(job)
    job.wait_steps(2)
    observer = Observer(job=job.run_id)
    try:
        observer.tick()
        killed = actions.kill_rank(job=job.run_id, rank=1, signal="SIGKILL", wait_s=0)
        assert killed["result"] == "sent", killed
        early: list[tuple[str, str]] = []
        end = time.monotonic() + 0.8  # the live rank sleeps until its next collective (6 s)
        while time.monotonic() < end:
            observer.tick()
            track = observer.tracks[job.run_id]
            early.append((track.verdict, track.reason))
            time.sleep(observer.tick_s)
        assert all(verdict != "restarting" for verdict, _ in early), early
        assert "a restart is expected, its teardown not seen yet" in early[-1][1], early[-1]
        later: list[str] = []
        end = time.monotonic() + 60
        while time.monotonic() < end:
            observer.tick()
            track = observer.tracks[job.run_id]
            if not later or later[-1] != track.verdict:
                later.append(track.verdict)
            if track.verdict == "restarting":
                break
            time.sleep(observer.tick_s)
        assert later[-1] == "restarting", (later, track.reason)
        assert "rank 1" in track.reason, track.reason
    finally:
        observer.close()
