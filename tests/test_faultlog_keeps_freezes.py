"""The fault log keeps every fault of a large run: the rollbacks read it to undo what the run
froze, so a freeze of thousands of processes must not lose its first entries (before, the log
kept the last 1,000: resume_processes after freezing more left the oldest frozen)."""

from chaosgpu import faultlog


def test_a_freeze_of_five_thousand_processes_keeps_its_first_entry() -> None:
    faultlog.clear()
    try:
        for pid in range(100_000, 105_000):
            faultlog.record("SIGSTOP", pid=pid, starttime=7, scope="tag=big")
        assert [f["pid"] for f in faultlog.for_pid(100_000, 7)] == [100_000]
        assert len(faultlog.recent()) == 5_000
    finally:
        faultlog.clear()
