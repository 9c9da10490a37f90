"""Job faults refuse bad timing arguments before anything is looked at or touched, on a real
rank-like process."""

import os
import subprocess
import sys
import time
import uuid

import pytest
from proc_helpers import alive

from chaosgpu.errors import InvalidArgument
from chaosgpu.job import actions


@pytest.mark.parametrize("wait_s", [-1, -0.5, float("nan"), "2", True])
def test_kill_rank_refuses_a_bad_wait_before_anything(wait_s: object) -> None:
    tag = f"badwait-{uuid.uuid4().hex[:6]}"
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29917", CHAOSGPU_TAG=tag)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.2)
        with pytest.raises(ValueError, match=r"wait_s must be a number of seconds >= 0"):
            actions.kill_rank(rank=0, tag=tag, wait_s=wait_s)  # type: ignore[arg-type]
        assert rank.poll() is None and alive(rank.pid)
    finally:
        rank.kill()
        rank.wait()


@pytest.mark.parametrize("name, value, must", [
    ("tag", "{tag} ", "must be a tag: a non-empty string without whitespace or control "
                      "characters"),
    ("tag", "{tag}\n", "must be a tag: a non-empty string without whitespace or control "
                       "characters"),
    ("job", " {tag}", "must be a non-empty string without leading or trailing whitespace"),
])
def test_a_selection_that_could_never_match_exactly_is_refused_naming_it(
        name: str, value: str, must: str) -> None:
    # A job selection is matched exactly (as a scope is): "x " never selects the job tagged
    # "x". It was accepted as any non-empty text, and read as "no such job".
    from chaosgpu.job.observe import JobError, check_selector

    tag = f"badtag-{uuid.uuid4().hex[:6]}"
    selection = {name: value.format(tag=tag)}
    expected = f"{name} {must}, got {selection[name]!r}"
    with pytest.raises(JobError) as refused:
        check_selector(selection.get("job"), selection.get("tag"))
    assert str(refused.value) == expected
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29918", CHAOSGPU_TAG=tag, CHAOSGPU_JOB=tag)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                            stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.2)
        # the activities refuse it by their rules (chaosgpu.arguments), naming themselves
        with pytest.raises(InvalidArgument) as refused:
            actions.kill_rank(rank=0, **selection)  # type: ignore[arg-type]
        assert str(refused.value) == f"kill_rank: {expected}"
        with pytest.raises(InvalidArgument) as refused:
            actions.cleanup_hung_job(grace_s=0, missing_ok=True, **selection)
        assert str(refused.value) == f"cleanup_hung_job: {expected}"
        assert rank.poll() is None and alive(rank.pid)
    finally:
        rank.kill()
        rank.wait()
