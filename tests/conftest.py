"""Shared test fixtures.

The autouse fixture `no_process_left_behind` proves that every test leaves nothing alive: each
test runs with a unique CHAOSGPU_TEST_ID in the environment (inherited by everything it starts,
including processes inside sandboxes), and afterwards no live process may carry it. Leftovers
are killed (so one failure does not cascade) and the test fails.
"""

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def processes_with_test_id(test_id: str) -> list[tuple[int, str]]:
    """Return (pid, state) of every process whose environment carries CHAOSGPU_TEST_ID=test_id."""
    needle = f"CHAOSGPU_TEST_ID={test_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                environ = handle.read()
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            state = stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3].decode()
            found.append((int(entry), state))
    return found


def _reap_own_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


@pytest.fixture(autouse=True)
def no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Give the test a unique CHAOSGPU_TEST_ID and fail it if any process carrying it survives."""
    test_id = uuid.uuid4().hex[:16]
    previous = os.environ.get("CHAOSGPU_TEST_ID")
    os.environ["CHAOSGPU_TEST_ID"] = test_id
    try:
        yield test_id
    finally:
        if previous is None:
            os.environ.pop("CHAOSGPU_TEST_ID", None)
        else:
            os.environ["CHAOSGPU_TEST_ID"] = previous
    deadline = time.monotonic() + 5.0
    alive: list[tuple[int, str]] = []
    while True:
        _reap_own_children()
        alive = [p for p in processes_with_test_id(test_id) if p[1] != "Z" or p[0] != os.getpid()]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if alive:
        for pid, _ in alive:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _reap_own_children()
        pytest.fail(f"processes left behind by the test: {alive}")


@pytest.fixture(scope="session", autouse=True)
def private_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep chaosgpu's live state (sandboxes, workloads) in a folder private to this test run."""
    path = tmp_path_factory.mktemp("chaosgpu-state")
    previous = os.environ.get("CHAOSGPU_STATE_DIR")
    os.environ["CHAOSGPU_STATE_DIR"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("CHAOSGPU_STATE_DIR", None)
    else:
        os.environ["CHAOSGPU_STATE_DIR"] = previous


def nvml_available() -> bool:
    """Return whether NVML can be initialised here (a GPU and its driver are present)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` cleanly when NVML cannot be initialised."""
    if any("gpu" in item.keywords for item in items) and not nvml_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with NVML (none here)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
