"""The state directory: a directory someone else could have prepared is refused, for real (real
directories of the wrong owner or mode, a real symlink, and the /tmp fallback as another user)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chaosgpu import state

NOBODY = 65534


@pytest.fixture
def explicit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "state"
    monkeypatch.setenv("CHAOSGPU_STATE_DIR", str(path))
    return path


def test_a_new_directory_is_created_private(explicit: Path) -> None:
    old = os.umask(0)  # even with umask 0 the directory is 0700
    try:
        assert state.state_dir() == explicit
    finally:
        os.umask(old)
    info = os.lstat(explicit)
    assert info.st_mode & 0o777 == 0o700 and info.st_uid == os.geteuid()


def test_a_directory_open_to_others_is_refused(explicit: Path) -> None:
    explicit.mkdir(mode=0o700)
    explicit.chmod(0o755)
    with pytest.raises(state.StateDirError, match=rf"{explicit}.*mode 0755.*group or others"):
        state.state_dir()
    explicit.chmod(0o770)
    with pytest.raises(state.StateDirError, match="mode 0770"):
        state.write_record("workloads", "x", {"pid": 1})
    assert not (explicit / "workloads").exists()  # nothing was written


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to nobody")
def test_a_directory_of_another_owner_is_refused(explicit: Path) -> None:
    explicit.mkdir(mode=0o700)
    os.chown(explicit, NOBODY, NOBODY)
    with pytest.raises(state.StateDirError, match=rf"{explicit}.*owned by UID {NOBODY}"):
        state.list_records("workloads")


def test_a_symlink_is_refused_even_to_a_private_directory(explicit: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    explicit.symlink_to(real)
    with pytest.raises(state.StateDirError, match=rf"{explicit}.*symbolic link"):
        state.state_dir()
    explicit.unlink()
    explicit.write_text("")
    with pytest.raises(state.StateDirError, match="not a directory"):
        state.state_dir()


FALLBACK_SCRIPT = """
import json
from chaosgpu import state
try:
    print(json.dumps({"path": str(state.state_dir())}))
except state.StateDirError as error:
    print(json.dumps({"error": str(error)}))
"""


def _as_nobody(tmpdir: Path) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items()
           if k not in ("CHAOSGPU_STATE_DIR", "XDG_RUNTIME_DIR")}
    env.update(TMPDIR=str(tmpdir), PYTHONPATH=str(Path(state.__file__).parent.parent))
    done = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                           "--", sys.executable, "-c", FALLBACK_SCRIPT],
                          env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"cannot run Python as nobody here: {done.stderr[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run as nobody")
def test_the_tmp_fallback_as_another_user() -> None:
    import tempfile

    tmpdir = Path(tempfile.mkdtemp(prefix="chaosgpu-statetest-"))
    try:
        tmpdir.chmod(0o1777)  # like /tmp: anyone may create the fallback before the user does
        fallback = tmpdir / f"chaosgpu-{NOBODY}"
        assert _as_nobody(tmpdir) == {"path": str(fallback)}  # created, private, by nobody
        info = os.lstat(fallback)
        assert info.st_uid == NOBODY and info.st_mode & 0o777 == 0o700
        fallback.rmdir()
        fallback.mkdir(mode=0o700)  # prepared by root (another user) in the sticky folder
        out = _as_nobody(tmpdir)
        assert f"refusing the state directory {fallback}" in out["error"]
        assert "owned by UID 0" in out["error"]
        fallback.rmdir()
        target = tmpdir / "elsewhere"
        target.mkdir(mode=0o700)
        os.chown(target, NOBODY, NOBODY)
        fallback.symlink_to(target)  # a symlink planted by another user
        assert "symbolic link" in _as_nobody(tmpdir)["error"]
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
