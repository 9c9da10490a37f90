"""A rank killed while its DataLoader workers (forked after init_process_group) still hold its
peer connections: its peers see no close and wait, and the culprit says why, even for a probe
that starts after the kill and so never saw the rank alive. The fault records the rank's peer
connections and its helpers (rank_connections); before, such a probe named the rank "killed
by SIGKILL" with no word of the helpers (outside trial).

Real processes: a bare 2-rank gloo job (tests/jobs/train.py, --loader-workers 2); removed
afterwards."""

from pathlib import Path

import pytest

pytest.importorskip("torch")

from jobs.launch import Job, start_bare  # noqa: E402

from chaosgpu import faultlog  # noqa: E402
from chaosgpu.job import actions, probes  # noqa: E402

pytestmark = pytest.mark.slow


def test_a_probe_after_the_kill_names_the_helpers_holding_the_connections(
        tmp_path: Path, jobs: list[Job]) -> None:
    job = start_bare(tmp_path, ["--loader-workers", "2", "--sleep-s", "0.2"])
    jobs.append(job)
    job.wait_steps(3)
    killed = actions.kill_rank(tag=job.tag, rank=1, signal="SIGKILL", wait_s=0)
    assert killed["result"] == "sent", killed
    [fault] = [f for f in faultlog.recent() if f.get("pid") == killed["pid"]]
    assert fault["peer_sockets"] and len(fault["own_helpers"]) == 2, fault
    found = probes.detect_hang(tag=job.tag, timeout_s=20, window_s=2)
    # the workers notice their rank's end within seconds and exit, which closes the
    # connections: the survivor then fails; what matters is what was said while they held
    text = " ".join(str(e) for e in found.get("evidence") or [])
    assert "still hold" in text and "of its peer connections" in text, found
    if found["verdict"] == "hung":
        [culprit] = [c for c in found["culprit_ranks"] if c["rank"] == 1]
        assert "its helper processes" in culprit["why"], culprit
