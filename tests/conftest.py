"""Shared test fixtures and the rule on skips.

Skips: a test that needs a tool the machine lacks (tini, nft, ip, unshare, chromium, the chaos
CLI, torch ...) skips with the reason, naming what to install (`require_tool`). In CI (the
environment variable CI set to true, as .ci/run does), which installs everything, such a skip is
a failure: CI fails on any skip for a missing tool. Skips for the machine's nature (not root,
no cgroup v1, an older kernel, no GPU) stay skips. A test never turns its own failure into a
skip.

The autouse fixture `no_process_left_behind` proves that every test leaves nothing alive: each
test runs with a unique CHAOSGPU_TEST_ID in the environment (inherited by everything it starts,
including processes inside sandboxes), and afterwards no live process may carry it. Leftovers
are killed (so one failure does not cascade) and the test fails.
"""

import os
import re
import shutil
import signal
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

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


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background by a shell without job control (`cmd &` in a script,
    `nohup`) inherits SIGINT ignored, and so would every process the tests start: the tests
    that interrupt a `chaos run` or `chaosgpu jobs --watch` with SIGINT would then wait for a
    process that cannot hear it. The tests' processes get SIGINT's default back."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` cleanly when NVML cannot be initialised."""
    if any("gpu" in item.keywords for item in items) and not nvml_available():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU with NVML (none here)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# Where the usual tools live when /usr/sbin is not on a user's PATH.
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
# A skip reason that says a tool is missing (require_tool's, pytest.importorskip's, and the
# phrasings the tests use): in CI such a skip fails the run.
MISSING_TOOL = re.compile(r"^missing tool: |not installed|could not import |^needs [\w-]+$"
                          r"|^no [\w.-]+ here$")


def find_tool(name: str) -> str | None:
    """The path of the executable `name` on PATH or in the usual sbin/bin folders, or None."""
    return shutil.which(name) or next(
        (path for folder in _SBIN if os.access(path := os.path.join(folder, name), os.X_OK)),
        None)


def require_tool(*names: str, install: str) -> None:
    """Skip the test (a failure in CI) unless every executable in `names` is installed;
    `install` says how to get them, e.g. "apt-get install tini"."""
    missing = [name for name in names if find_tool(name) is None]
    if missing:
        pytest.skip(f"missing tool: {', '.join(missing)} ({install})")


def in_ci() -> bool:
    """Whether this run is CI's (CI=true/1/yes), where a skip for a missing tool fails."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_if_missing_tool(report: Any) -> None:
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if MISSING_TOOL.search(reason):
            report.outcome = "failed"
            report.longrepr = (f"skipped in CI, which must install every tool the tests need: "
                               f"{reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, Any, None]:
    """In CI, a test skipped for a missing tool is reported as failed."""
    outcome = yield
    _fail_if_missing_tool(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """In CI, a module skipped at import for a missing tool (importorskip) fails collection."""
    outcome = yield
    _fail_if_missing_tool(outcome.get_result())


@pytest.fixture
def servers() -> Iterator[Any]:
    """Real TCP server processes (partition_helpers.Servers); every one is killed and reaped at
    the end."""
    from partition_helpers import Servers

    started = Servers()
    try:
        yield started
    finally:
        started.stop_all()
    assert all(p.poll() is not None for p in started.procs)


@pytest.fixture
def jobs() -> Iterator[list[Any]]:
    """Training jobs a test starts (tests/jobs/launch.py's Job): each is stopped afterwards,
    whatever happened (SIGCONT + SIGKILL to its process group and to its tag)."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for job in started:
            job.stop()
