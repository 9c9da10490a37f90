"""The real node's build cache and package pins, without starting anything (no root needed)."""

import os
import shutil
from pathlib import Path

import pytest

from . import cluster as real


def test_source_key_follows_go_mod_go_sum_cmd_and_flags(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "node"
    shutil.copytree(real.MODULE, module)
    monkeypatch.setattr(real, "MODULE", module)
    key = real.source_key()
    assert key == real.source_key()
    for changed in ("go.sum", "cmd/kubelet/main.go"):
        path = module / changed
        original = path.read_text()
        path.write_text(original + "\n// changed\n")
        assert real.source_key() != key, changed
        path.write_text(original)
        assert real.source_key() == key
    monkeypatch.setattr(real, "_ldflags", lambda: "-s")
    assert real.source_key() != key


def test_cached_binaries_are_reused_only_for_their_key(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real, "BIN", tmp_path)
    for name in real.BINARIES:
        (tmp_path / name).write_text("")
    (tmp_path / "build.json").write_text(f'{{"key": "{real.source_key()}", "seconds": 1}}')
    assert real.build_binaries()["cached"] is True
    (tmp_path / "build.json").write_text('{"key": "stale", "seconds": 1}')
    monkeypatch.setenv("PATH", str(tmp_path / "no-go-here"))
    with pytest.raises(real.ClusterError, match="`go` is not on PATH"):
        real.build_binaries()


def test_the_kubernetes_version_comes_from_go_mod() -> None:
    assert real.kubernetes_version() == "v1.37.2"
    assert "gitVersion=v1.37.2" in real._ldflags() and "gitMinor=37" in real._ldflags()


def _broken_up() -> dict[str, object]:
    raise real.ClusterError("kubelet exited while waiting for kubelet registered")


def test_in_ci_a_node_that_does_not_start_fails(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from .conftest import start_cluster

    monkeypatch.setattr(real, "BIN", tmp_path)  # nothing built
    monkeypatch.setattr(real, "up", _broken_up)
    monkeypatch.setattr(real, "down", lambda quiet=False: [])
    with pytest.raises(pytest.fail.Exception, match="did not start: kubelet exited"):
        start_cluster({"CI": "true"})
    if os.geteuid() == 0:  # outside CI, unbuilt binaries skip with the reason
        with pytest.raises(pytest.skip.Exception, match="binaries are not built"):
            start_cluster({})
        (tmp_path / "build.json").write_text(f'{{"key": "{real.source_key()}"}}')
        with pytest.raises(pytest.fail.Exception, match="did not start"):
            start_cluster({})  # built, but broken: a failure there too
