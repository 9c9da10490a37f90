"""chaosgpu's own processes never carry the runner's scope variables.

A runner started with CHAOSGPU_TAG/JOB/SANDBOX set (a tagged shell, a runner inside a job or a
pod) must not hand them to what chaosgpu starts: `py-spy` reading a rank's stack, `nft` and
`nsenter` writing a partition, a GPU fault program (which carries its own tag only). Otherwise a
kill by the runner's tag hits chaosgpu's machinery. Each test runs the real tool through a
wrapper on PATH that saves its own /proc/PID/environ and execs the real one (same PID, same
environment), so what is checked is the environment the helper process really had.
"""

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_tool
from proc_helpers import alive, wait_until

from chaosgpu.node import census_module
from chaosgpu.process import environment
from chaosgpu.process.environment import SCOPE_ENV, helper_env

RUNNER = {"CHAOSGPU_TAG": "the-runners-tag", "CHAOSGPU_JOB": "the-runners-job",
          "CHAOSGPU_SANDBOX": "the-runners-pod",
          # a runner that itself runs inside a training job (a rank, a Slurm task)
          "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.1.2.3",
          "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "runners-job", "GROUP_RANK": "0",
          "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "OMPI_COMM_WORLD_RANK": "3"}
#: what puts a process in a scope or in a job: the runner's must never reach a helper
CARRIED = frozenset(SCOPE_ENV) | frozenset(census_module().JOB_IDENTITY_KEYS)


def _environ(data: bytes) -> dict[str, str]:
    """A /proc/PID/environ's bytes as a dict."""
    entries = data.decode(errors="replace").split("\0")
    return dict(entry.partition("=")[::2] for entry in entries if "=" in entry)


def _scope(environ: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in environ.items() if key in CARRIED}


@pytest.fixture
def runner_scope(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process (the runner) carries a tag, a job and a sandbox of its own."""
    for key, value in RUNNER.items():
        monkeypatch.setenv(key, value)
    return RUNNER


class Spies:
    """Wrappers named like real tools, first on PATH: each saves its /proc/self/environ under
    `folder` (`<tool>.<pid>`), then execs the real tool."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin = root / "bin"
        self.folder = root / "environs"
        self.bin.mkdir()
        self.folder.mkdir()
        self._monkeypatch = monkeypatch

    def wrap(self, name: str, real: str) -> Path:
        wrapper = self.bin / name
        wrapper.write_text(f'#!/bin/sh\ncat /proc/$$/environ > "{self.folder}/{name}.$$"\n'
                           f'exec "{real}" "$@"\n')
        wrapper.chmod(0o755)
        self._monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        return wrapper

    def seen(self) -> dict[str, dict[str, str]]:
        """`<tool>.<pid>` -> the environment that process had."""
        return {path.name: _environ(path.read_bytes()) for path in sorted(self.folder.iterdir())}


@pytest.fixture
def spies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Spies:
    return Spies(tmp_path, monkeypatch)


def _assert_clean(seen: dict[str, dict[str, str]], tools: set[str]) -> None:
    """Every spied process ran (each of `tools` at least once), with none of the runner's
    scope or job variables and with the rest of the runner's environment (its test id)."""
    assert {name.partition(".")[0] for name in seen} >= tools, sorted(seen)
    for name, environ in seen.items():
        assert _scope(environ) == {}, (name, _scope(environ))
        assert environ.get("CHAOSGPU_TEST_ID") == os.environ["CHAOSGPU_TEST_ID"], name


def test_helper_env_drops_the_scope_variables_and_adds_the_declared_ones(
        runner_scope: dict[str, str]) -> None:
    env = helper_env()
    assert _scope(env) == {} and env["CHAOSGPU_TEST_ID"] == os.environ["CHAOSGPU_TEST_ID"]
    assert _scope(helper_env(CHAOSGPU_TAG="own", PYTHONPATH="/x")) == {"CHAOSGPU_TAG": "own"}
    assert os.environ["CHAOSGPU_TAG"] == RUNNER["CHAOSGPU_TAG"]  # the runner's own is kept


def test_helper_env_drops_the_runners_job_identity(runner_scope: dict[str, str]) -> None:
    """A runner inside a training job: its helpers carry none of the keys by which the census
    makes a process that job's rank (checked by the census itself on the helper's env)."""
    census = census_module()
    assert set(RUNNER) - set(SCOPE_ENV) <= set(census.JOB_IDENTITY_KEYS)
    env = helper_env()
    record = {"pid": 4321, "comm": "py-spy", "cmdline": ["py-spy"], "env": env, "zombie": False}
    assert census._job_id(env) is None and census._numbering(env) is None
    assert census._job_candidates({4321: record}, {}, {}) == {}
    # declared variables are the helper's own (a ring rank's RANK)
    assert _scope(helper_env(RANK="0")) == {"RANK": "0"}
    assert census._job_candidates({4321: dict(record, env=os.environ.copy())}, {}, {})


def test_the_sandbox_runtime_uses_the_one_helper_env() -> None:
    from chaosgpu.sandbox import runtime

    assert runtime.helper_env is environment.helper_env
    assert runtime.SCOPE_ENV is environment.SCOPE_ENV


def test_py_spy_runs_without_the_runners_scope(runner_scope: dict[str, str],
                                                spies: Spies) -> None:
    from chaosgpu.job import stacks

    real = stacks.py_spy_path()
    if real is None:
        require_tool("py-spy", install="pip install py-spy")
    assert real is not None
    spies.wrap("py-spy", real)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"],
                               env=helper_env(), stdin=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        sample = stacks.take_samples([sleeper.pid], timeout_s=20)[sleeper.pid]
        assert sample.error is None, sample.error  # the real py-spy read the real process
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    _assert_clean(spies.seen(), {"py-spy"})


LISTENER = """
import socket, sys, time
server = socket.socket()
server.bind(("0.0.0.0", 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
time.sleep(120)
"""


@pytest.fixture
def listener_in_its_own_netns() -> Iterator[subprocess.Popen[str]]:
    """A process listening on a TCP port in a network namespace of its own (nothing on the
    host's network is touched): partitioning it goes through `nsenter`."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace, nftables)")
    require_tool("unshare", "nsenter", "nft", install="apt-get install util-linux nftables")
    process = subprocess.Popen([shutil.which("unshare") or "unshare", "--net", "--",
                                sys.executable, "-c", LISTENER], env=helper_env(),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline().strip().isdigit()
        yield process
    finally:
        process.kill()
        process.wait(timeout=10)


def test_partition_tools_run_without_the_runners_scope(
        runner_scope: dict[str, str], spies: Spies,
        listener_in_its_own_netns: subprocess.Popen[str]) -> None:
    from chaosgpu.network import partitions
    from chaosgpu.node import process_starttime

    nft = spies.wrap("nft", partitions.nft_path())
    spies.wrap("nsenter", shutil.which("nsenter") or "nsenter")
    assert partitions.nft_path() == str(nft)
    pid = listener_in_its_own_netns.pid
    record = partitions.create([{"pid": pid, "starttime": process_starttime(pid)}],
                               reason="helper env test")
    try:
        assert record["netns_pid"] == pid and record["listening"]  # reached through nsenter
        assert partitions.table_exists(record) is True
    finally:
        assert partitions.remove(record["id"])["removed"] is True
    assert partitions.table_exists(record) is False
    # the runner's own namespace: nft alone, no nsenter
    assert partitions.table_exists({"table": f"chaosgpu_absent{uuid.uuid4().hex[:6]}"}) is False
    _assert_clean(spies.seen(), {"nft", "nsenter"})


def test_gpu_fault_programs_carry_their_own_tag_only(runner_scope: dict[str, str],
                                                     spies: Spies,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault program started by chaosgpu.gpu.launch (host memory: no GPU needed) carries its
    own CHAOSGPU_TAG and none of the runner's tag, job or sandbox; both ways it starts one."""
    from chaosgpu.gpu import launch
    from chaosgpu.workloads.actions import stop_workload

    tag = launch.check_tag(None, "env-pressure")
    args = ["--backend", "host", "--mib", "4", "--chunk-mib", "2", "--duration-s", "0"]
    started = launch.start("memory-pressure", tag, "pressure", args, {"backend": "host"}, 60)
    pid = started["record"]["processes"][0]["pid"]
    try:
        environ = _environ(Path(f"/proc/{pid}/environ").read_bytes())
        assert _scope(environ) == {"CHAOSGPU_TAG": tag}
    finally:
        assert stop_workload(tag, grace_s=0)["stopped"] is True
    assert wait_until(lambda: not alive(pid), 10)
    # run_to_end: the program runs to its end; its environment is seen by a spy interpreter
    monkeypatch.setattr(sys, "executable", str(spies.wrap("python", sys.executable)))
    ready = spies.folder.parent / "ready.json"
    tag = launch.check_tag(None, "env-run")
    done = launch.run_to_end("memory-pressure", tag, "pressure",
                             ["--backend", "host", "--mib", "2", "--chunk-mib", "2",
                              "--duration-s", "0.1", "--ready-file", str(ready)], {}, 60)
    assert done["rc"] == 0, done
    seen = spies.seen()
    assert [name.partition(".")[0] for name in seen] == ["python"]
    assert [_scope(environ) for environ in seen.values()] == [{"CHAOSGPU_TAG": tag}]

