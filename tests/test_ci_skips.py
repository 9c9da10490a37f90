"""In CI (CI=true) a test skipped because a tool is missing fails the run; elsewhere it skips
with its reason. Skips for the machine's nature (not root...) stay skips everywhere. Proved by
running pytest, with this suite's conftest, on a few tests written for it."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest
from conftest import require_tool


def test_needs_a_tool_nobody_has():
    require_tool("chaosgpu-no-such-tool", install="apt-get install nothing")


def test_needs_root_of_another_world():
    pytest.skip("needs root and the cgroup v1 freezer")


@pytest.mark.skipif(True, reason="needs unshare")
def test_marked_needs_a_tool():
    pass


def test_runs():
    assert True
'''

IMPORT_SKIP = '''
import pytest

pytest.importorskip("chaosgpu_no_such_module")


def test_never_runs():
    pass
'''


def _pytest(target: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "CHAOSGPU_TEST_ID")}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           str(target)], capture_output=True, text=True, timeout=300,
                          cwd=target.parent, env=env)


@pytest.fixture()
def sample(tmp_path: Path) -> Path:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_import_skip.py").write_text(IMPORT_SKIP)
    return tmp_path


def test_outside_ci_a_missing_tool_skips_with_its_reason(sample: Path) -> None:
    done = _pytest(sample / "test_sample.py", None)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "missing tool: chaosgpu-no-such-tool (apt-get install nothing)" in out
    assert "1 passed, 3 skipped" in out, out
    done = _pytest(sample / "test_import_skip.py", None)
    assert done.returncode == 5 and "1 skipped" in done.stdout, done.stdout  # 5: no test ran


def test_in_ci_a_missing_tool_fails_and_other_skips_stay(sample: Path) -> None:
    done = _pytest(sample / "test_sample.py", "true")
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "FAILED test_sample.py::test_needs_a_tool_nobody_has" in out, out
    # a skip marker is evaluated at setup: reported as an error there
    assert "ERROR test_sample.py::test_marked_needs_a_tool - skipped in CI" in out, out
    assert "skipped in CI, which must install every tool the tests need" in out
    assert "SKIPPED [1] test_sample.py" in out and "cgroup v1 freezer" in out, out
    assert "PASSED test_sample.py::test_runs" in out
    done = _pytest(sample / "test_import_skip.py", "true")
    assert done.returncode != 0, done.stdout
    assert "ERROR test_import_skip.py - skipped in CI" in done.stdout, done.stdout
