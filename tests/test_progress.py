"""Progress lines of long waits (chaosgpu.progress): one line per interval, none before it, the
text asked for only when a line is due, and a bad interval refused."""

import logging
import time

import pytest

from chaosgpu import progress


def test_a_line_per_interval_and_none_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chaostoolkit")
    asked: list[float] = []

    def seen() -> str:
        asked.append(time.monotonic())
        return "3 pods still there"

    waiting = progress.Progress("the pods to be gone", timeout_s=30, every_s=0.2)
    waiting.update(seen)
    assert not caplog.records and not asked  # a short wait prints nothing
    deadline = time.monotonic() + 0.7
    while time.monotonic() < deadline:
        waiting.update(seen)
        time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert 2 <= len(lines) <= 4 and len(asked) == len(lines) == waiting.lines, lines
    assert lines[0].startswith("chaosgpu: still waiting for the pods to be gone: 0 s of at "
                               "most 30 s; 3 pods still there"), lines


def test_the_interval_can_be_set_and_a_bad_one_is_refused(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="chaostoolkit")
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.05)
    waiting = progress.Progress("a file")
    time.sleep(0.1)
    waiting.update("not written yet")
    assert [r.getMessage() for r in caplog.records] == [
        "chaosgpu: still waiting for a file: 0 s; not written yet"]
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="every_s must be > 0"):
            progress.Progress("x", every_s=bad)
