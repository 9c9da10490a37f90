"""Job faults refuse bad timing arguments before anything is looked at or touched, on a real
rank-like process."""

import os
import subprocess
import sys
import time
import uuid

import pytest
from proc_helpers import alive

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
