"""The `hold` workload and readiness files, for real: processes, signals, memory."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chaosgpu.workloads import readiness


def _hold(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    ready = tmp_path / f"ready-{time.monotonic_ns()}.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.workloads", "hold", "--ready-file", str(ready), *args],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return process, ready


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_hold_host_memory_is_held_once_ready(tmp_path: Path) -> None:
    process, ready = _hold(tmp_path, "--via", "host", "--mib", "64", "--tag", "t-hold")
    try:
        document = readiness.wait_ready(ready, 30, pid=process.pid)
        assert document["pid"] == process.pid
        assert document["via"] == "host" and document["mib"] == 64
        assert document["tag"] == "t-hold"
        assert _rss_kib(process.pid) >= 64 * 1024
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert b"CHAOSGPU_TAG=t-hold" in environ
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    "mode, survives, code",
    [("ignore", True, None), ("exit", False, -signal.SIGTERM), ("cleanup", False, 0)],
)
def test_hold_sigterm_modes(tmp_path: Path, mode: str, survives: bool, code: int | None) -> None:
    process, ready = _hold(tmp_path, "--via", "host", "--mib", "8", "--on-sigterm", mode)
    try:
        readiness.wait_ready(ready, 30, pid=process.pid)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            rc = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            rc = None
        if survives:
            assert rc is None, "the worker was asked to ignore SIGTERM"
        else:
            assert rc == code
            assert time.monotonic() - sent < 1.0
    finally:
        process.kill()
        process.wait()


def test_hold_without_gpu_says_so(tmp_path: Path) -> None:
    from chaosgpu.workloads.cuda_driver import gpu_count

    if gpu_count() > 0:
        pytest.skip("a GPU is usable here")
    for via in ("auto", "driver", "torch"):
        process, ready = _hold(tmp_path, "--via", via, "--mib", "1")
        _, err = process.communicate(timeout=60)
        assert process.returncode == 3, err
        assert b"hold: " in err and (b"GPU" in err or b"CUDA" in err or b"libcuda" in err)
        assert not ready.exists()


def test_hold_auto_falls_back_to_host_only_when_asked(tmp_path: Path) -> None:
    process, ready = _hold(tmp_path, "--via", "auto", "--mib", "4", "--allow-host-fallback")
    try:
        document = readiness.wait_ready(ready, 60, pid=process.pid)
        assert document["via"] in ("host", "torch", "driver")
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("args", [["--mib", "-1"], ["--via", "magic"], ["--on-sigterm", "x"],
                                  ["--tag", "x "], ["--tag", "x\n"], ["--tag", ""]])
def test_hold_bad_arguments(tmp_path: Path, args: list[str]) -> None:
    process, ready = _hold(tmp_path, "--via", "host", *args)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 2
    assert err
    if args[0] == "--tag":  # a tag no selection could match exactly is refused by name
        assert f"argument --tag: must be a tag: a non-empty string without whitespace or " \
               f"control characters, got {args[1]!r}" in err.decode(), err
    assert not ready.exists()


def test_wait_ready_times_out_clearly(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="never.json"):
        readiness.wait_ready(tmp_path / "never.json", 0.2)
    assert time.monotonic() - started < 1.0


def test_wait_ready_notices_a_dead_process(tmp_path: Path) -> None:
    process = subprocess.Popen(["true"])
    process.wait()
    with pytest.raises(RuntimeError, match="exited before"):
        readiness.wait_ready(tmp_path / "never.json", 10, pid=process.pid)


def test_write_ready_is_atomic_json(tmp_path: Path) -> None:
    path = readiness.write_ready(tmp_path / "r.json", {"pid": 1})
    assert json.loads(path.read_text()) == {"pid": 1}
    assert readiness.read_ready(tmp_path / "missing.json") is None
    (tmp_path / "half.json").write_text('{"pid": ')
    assert readiness.read_ready(tmp_path / "half.json") is None


def test_cli_dispatch() -> None:
    from chaosgpu.workloads.cli import main

    assert main(["--help"]) == 0
    assert main(["nope"]) == 2
