"""The census on real processes of this machine: records, zombies, bad input, NVML absent, CLI."""

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from census_helpers import LEADER_EXITS, PROGRAM, REPO, pod, run_program, wait_for
from conftest import find_tool

from chaosgpu import node
from chaosgpu.node import cli

RECORDED = REPO / "tests" / "data" / "nvml_h200_recorded.json"
census_module = node.census_module()


def test_own_record_matches_the_kernel() -> None:
    record = node.read_process(os.getpid())
    assert record is not None
    assert record["pid"] == os.getpid()
    assert record["ppid"] == os.getppid()
    assert record["uid"] == os.getuid()
    assert record["state"] in ("R", "S")
    # the interpreter's own argv is what the kernel holds in /proc/self/cmdline
    assert record["cmdline"] == sys.orig_argv
    assert record["nspid"][-1] == os.getpid()
    assert record["pid_ns"] == os.readlink("/proc/self/ns/pid")
    assert record["unreadable"] == [] and record["errors"] == {}
    ticks = int(Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19])
    assert node.process_starttime(os.getpid()) == ticks == record["starttime"]


def test_vanished_process_is_none_not_a_crash() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert node.read_process(child.pid) is None
    assert node.process_starttime(child.pid) is None
    assert node.process_state(child.pid) is None


def test_real_zombie_is_reported_then_gone_once_reaped() -> None:
    child = subprocess.Popen(["sleep", "0"], env=dict(os.environ))
    try:
        wait_for(lambda: node.process_state(child.pid) == "Z", what="the child to be a zombie")
        census = node.take_census(gpu=False)
        assert child.pid in census["zombies"]
        record = next(p for p in census["processes"] if p["pid"] == child.pid)
        assert record["zombie"] and record["state"] == "Z"
        assert record["ppid"] == os.getpid()
        assert not record["orphan"]  # its parent (us) is alive and not an init
    finally:
        child.wait()
    assert child.pid not in node.take_census(gpu=False)["zombies"]


def test_stopped_and_environment_keys() -> None:
    env = dict(os.environ, CHAOSGPU_TAG="census-tag", RANK="3", SECRET_TOKEN="nope")
    child = subprocess.Popen(["sleep", "30"], env=env)
    try:
        # right after exec the kernel shows comm before it sets the new environment: poll
        record = wait_for(lambda: (r := node.read_process(child.pid)) and r["tag"] and r,
                          what="sleep to exec")
        assert record["tag"] == "census-tag"
        assert record["env"]["RANK"] == "3"
        assert "SECRET_TOKEN" not in record["env"]  # only job and tag keys are reported
        os.kill(child.pid, 19)  # SIGSTOP
        wait_for(lambda: node.process_state(child.pid) == "T", what="the child to stop")
    finally:
        child.kill()
        child.wait()


def test_malformed_env_values_are_marked_not_fatal() -> None:
    job = f"bad-env-{os.environ['CHAOSGPU_TEST_ID']}"
    env = dict(os.environ, CHAOSGPU_JOB=job, MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
               RANK="abc", WORLD_SIZE="-1", LOCAL_RANK="x", LOCAL_WORLD_SIZE="0")
    child = subprocess.Popen(["sleep", "30"], env=env)
    try:
        wait_for(lambda: ((node.read_process(child.pid) or {}).get("env") or {}).get("RANK"),
                 what="exec")
        census = node.take_census(gpu=False)
        found = [j for j in census["jobs"] if j["id"] == job]
        assert len(found) == 1
        rank = found[0]["ranks"][0]
        assert rank["rank"] is None and rank["invalid_rank"] == "abc"
        assert rank["pid"] == child.pid and rank["state"] == "alive"
        assert found[0]["world_size"] is None
        text = "\n".join(census["errors"])
        assert f"pid {child.pid}: RANK='abc' is not an integer" in text
        assert f"pid {child.pid}: WORLD_SIZE='-1' is below 1" in text
        assert f"pid {child.pid}: LOCAL_WORLD_SIZE='0' is below 1" in text
    finally:
        child.kill()
        child.wait()


def _fake_proc(tmp_path: Path) -> Path:
    """A fake /proc: one readable process, one whose status and environ cannot be read, one
    that vanished (directory without stat) and one with a garbled stat."""
    me = Path(f"/proc/{os.getpid()}")
    good = tmp_path / "100"
    good.mkdir()
    (good / "stat").write_bytes((me / "stat").read_bytes().replace(
        f"{os.getpid()} (".encode(), b"100 (", 1))
    (good / "status").write_bytes(b"Name:\tx\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t100\t7\n")
    (good / "cmdline").write_bytes(b"worker\0--flag\0")
    (good / "cgroup").write_bytes(
        b"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1a2b_3c.slice/"
        b"cri-containerd-" + b"ab" * 32 + b".scope\n")
    (good / "environ").write_bytes(b"RANK=0\0PATH=/bin\0CHAOSGPU_TAG=t1\0")
    (good / "fd").mkdir()
    (good / "fd" / "0").symlink_to("/dev/null")
    (good / "fd" / "5").symlink_to("/dev/nvidia0")
    (good / "fd" / "6").symlink_to("/dev/nvidiactl")
    (good / "ns").mkdir()
    (good / "ns" / "pid").symlink_to("pid:[4026532999]")
    bad = tmp_path / "200"
    bad.mkdir()
    (bad / "stat").write_bytes(b"200 (x y) S 1 200 200 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 555"
                               b" 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n")
    (bad / "status").mkdir()  # reading it fails (EISDIR), like an unreadable entry
    (bad / "environ").mkdir()
    (bad / "cmdline").write_bytes(b"")
    (bad / "cgroup").write_bytes(b"0::/\n")
    (tmp_path / "300").mkdir()  # vanished: no stat any more
    garbled = tmp_path / "400"
    garbled.mkdir()
    (garbled / "stat").write_bytes(b"garbage without parens\n")
    return tmp_path


def test_fake_proc_root_unreadable_entries_are_marked(tmp_path: Path) -> None:
    census = node.take_census(proc_root=str(_fake_proc(tmp_path)), gpu=False)
    by_pid = {p["pid"]: p for p in census["processes"]}
    assert set(by_pid) == {100, 200}  # 300 vanished, 400 unreadable (reported in errors)
    good = by_pid[100]
    assert good["uid"] == 1000 and good["nspid"] == [100, 7] and not good["ns_init"]
    assert good["pid_ns"] == "pid:[4026532999]"
    assert good["cmdline"] == ["worker", "--flag"]
    assert good["container"] == {"runtime": "containerd", "id": "ab" * 32, "pod_uid": "1a2b-3c"}
    assert good["nvidia_fds"] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert good["env"] == {"RANK": "0", "CHAOSGPU_TAG": "t1"} and good["tag"] == "t1"
    assert good["starttime"] == node.process_starttime(os.getpid())
    bad = by_pid[200]
    assert bad["comm"] == "x y" and bad["starttime"] == 555
    assert bad["uid"] is None and bad["nspid"] is None and bad["env"] is None
    for field in ("uid", "nspid", "env"):
        assert field in bad["unreadable"]
        assert bad["errors"][field] == "EISDIR"
    assert bad["cmdline"] == []
    assert any(e.startswith("pid 400: unreadable stat") for e in census["errors"])
    assert node.read_process(300, proc_root=str(tmp_path)) is None


def test_a_proc_root_without_processes_is_refused_and_a_copied_tree_is_no_host_view(
        tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_program("--proc-root", str(empty), "--no-gpu")
    assert result.returncode == 2
    assert json.loads(result.stdout)["error"] == (
        f"--proc-root {str(empty)!r} holds no process directories: not a /proc")
    census = node.take_census(proc_root=str(empty), gpu=False)
    assert census["errors"] == [f"no process directories under {empty}: not a /proc"]
    (tmp_path / "copied").mkdir()
    copied = node.take_census(proc_root=str(_fake_proc(tmp_path / "copied")), gpu=False)
    assert copied["observer"]["host_view"] is False  # no self: which namespace is unknown
    assert node.take_census(gpu=False)["observer"]["host_view"] is (
        os.readlink("/proc/self/ns/pid") == "pid:[4026531836]")


def test_missing_proc_root_is_an_error_not_a_crash(tmp_path: Path) -> None:
    census = node.take_census(proc_root=str(tmp_path / "nope"), gpu=False)
    assert census["processes"] == []
    assert census["errors"] == [f"cannot list {tmp_path / 'nope'}: ENOENT"]
    result = run_program("--proc-root", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "is not a directory" in json.loads(result.stdout)["error"]


@pytest.mark.parametrize("path,expected", [
    ("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod12ab_34cd.slice/"
     "cri-containerd-" + "a" * 64 + ".scope", ("containerd", "a" * 64, "12ab-34cd")),
    ("/kubepods.slice/kubepods-pod12ab_34cd.slice/crio-" + "b" * 64 + ".scope",
     ("cri-o", "b" * 64, "12ab-34cd")),
    ("/kubepods/burstable/pod12ab-34cd/" + "c" * 64, ("kubepods", "c" * 64, "12ab-34cd")),
    ("/kubepods/pod12ab-34cd/" + "c" * 64, ("kubepods", "c" * 64, "12ab-34cd")),
    ("/kubepods/besteffort/pod99/" + "d" * 64 + "/sub", ("kubepods", "d" * 64, "99")),
    ("/system.slice/docker-" + "e" * 64 + ".scope", ("docker", "e" * 64, None)),
    ("/docker/" + "f" * 64, ("docker", "f" * 64, None)),
    ("/kubepods-besteffort-pod77_88.slice", ("kubepods", None, "77-88")),
    ("/chaosgpu/pod-a", ("sandbox", "pod-a", None)),
])
def test_container_identity_from_cgroup_paths(path: str, expected: tuple) -> None:
    result = node.parse_container(path)
    assert result is not None
    assert (result["runtime"], result["id"], result["pod_uid"]) == expected


@pytest.mark.parametrize("path", [None, "", "/", "/user.slice/user-0.slice/session-1.scope",
                                  "/system.slice/ssh.service"])
def test_no_container_for_host_cgroups(path: str | None) -> None:
    assert node.parse_container(path) is None


def test_cgroup_v1_and_v2_lines_pick_the_container_path() -> None:
    pick = census_module._pick_cgroup
    v1 = (b"12:freezer:/kubepods/burstable/pod1/" + b"a" * 64 + b"\n"
          b"11:pids:/kubepods/burstable/pod1/" + b"a" * 64 + b"\n0::/\n")
    main, freezer, v2 = pick(v1)
    assert main == "/kubepods/burstable/pod1/" + "a" * 64 and freezer == main and v2 == "/"
    main, freezer, v2 = pick(b"0::/system.slice/docker-" + b"b" * 64 + b".scope\n")
    assert main == v2 == "/system.slice/docker-" + "b" * 64 + ".scope" and freezer is None


def test_nvml_missing_is_a_value_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = node.nvml_snapshot()
    assert snapshot["available"] is False and snapshot["reason"]
    assert node.nvml_device_memory() == [] and node.nvml_gpu_processes() == []
    assert "no NVIDIA character device" in snapshot["reason"]
    # a driver registered but its library missing (a container without it mounted): the
    # loader's error is the reason, and no pynvml is imported for it
    monkeypatch.setitem(census_module._NVML, "tried", False)
    monkeypatch.setitem(census_module._NVML, "module", None)
    monkeypatch.setattr(census_module, "nvidia_registered", lambda proc_root="/proc": True)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it would raise
    snapshot = node.nvml_snapshot()
    assert snapshot == {"available": False, "driver": None, "devices": [],
                        "reason": snapshot["reason"]}
    assert snapshot["reason"].startswith("NVML unavailable: ")
    assert "libnvidia-ml.so.1" in snapshot["reason"]
    assert census_module.nvml_init_state()["retry_in_s"] is not None  # tried again later
    monkeypatch.setitem(census_module._NVML, "tried", False)


class _RawListingNVML:
    """pynvml's raw side as the census's one-call listing uses it: the entry struct, the
    function-pointer lookup and the return codes. The "driver function" is a real C-callable
    (ctypes) that keeps NVML's contract: *count in is the room, out is the entries written,
    or the entries needed with NVML_ERROR_INSUFFICIENT_SIZE when they do not fit."""

    NVML_SUCCESS, NVML_ERROR_INSUFFICIENT_SIZE, NVML_ERROR_NOT_SUPPORTED = 0, 7, 3

    class NVMLError(Exception):
        def __init__(self, code: int) -> None:
            super().__init__(code)
            self.value = code  # as pynvml's NVMLError keeps it

    def __init__(self, processes: list[tuple[int, int]], refuse: str = "") -> None:
        import ctypes

        class Entry(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                        ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

        self.c_nvmlProcessInfo_v3_t = Entry
        self.processes, self.refuse, self.calls = processes, refuse, 0
        self.rooms: list[int] = []
        signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint),
                                     ctypes.POINTER(Entry))
        self._functions = {}
        for name in ("nvmlDeviceGetComputeRunningProcesses_v3",
                     "nvmlDeviceGetMPSComputeRunningProcesses_v3"):
            self._functions[name] = signature(lambda handle, count, entries, name=name:
                                              self._list(name, count, entries))

    def _list(self, name: str, count: Any, entries: Any) -> int:
        self.calls += 1
        if name.startswith(self.refuse or "-"):
            return self.NVML_ERROR_NOT_SUPPORTED
        self.rooms.append(count[0])
        if count[0] < len(self.processes):
            count[0] = len(self.processes)
            return self.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, used) in enumerate(self.processes):
            entries[i].pid, entries[i].usedGpuMemory = pid, used
        count[0] = len(self.processes)
        return self.NVML_SUCCESS

    def _nvmlGetFunctionPointer(self, name: str) -> Any:  # noqa: N802
        return self._functions[name]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> None:  # noqa: N802
        raise AssertionError("the raw listing must be used")

    nvmlDeviceGetMPSComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses  # noqa: N815


def test_a_process_listing_is_one_driver_call_into_room_grown_from_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML's process list is read with one call into room sized from the previous listing;
    a listing that outgrew it is asked again with the count the driver gave (pynvml's own
    function asks twice every time). A listing the driver refuses is not asked again."""
    for memo in ("_NVML_REFUSED", "_NVML_RAW", "_NVML_ROOM"):
        monkeypatch.setattr(census_module, memo, type(getattr(census_module, memo))())
    processes = [(1000 + i, (i + 1) * 2**20) for i in range(100)]
    fake = _RawListingNVML(processes, refuse="nvmlDeviceGetMPS")
    monkeypatch.setitem(census_module._NVML, "module", fake)
    monkeypatch.setitem(census_module._NVML, "handles", ["gpu0"])
    listed = node.nvml_gpu_processes()
    assert [(p["pid"], p["used_mib"], p["gpu_index"]) for p in listed] == [
        (pid, used / 2**20, 0) for pid, used in processes]
    # compute: the default room (64) was short, asked again with room for 2 x 100 + 16;
    # MPS: refused as not supported (an old driver), once
    assert fake.rooms == [64, 216] and fake.calls == 3
    fake.calls, fake.rooms = 0, []
    processes.append((2000, 2**30))  # a process started: still fits the room
    assert len(node.nvml_gpu_processes()) == 101
    assert fake.calls == 1 and fake.rooms == [216]
    fake.processes = []
    assert node.nvml_gpu_processes() == []


@pytest.fixture
def nvml_standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The census's NVML library on tests/data/nvml_standin.c (NVML's C calls for two GPUs,
    built here with gcc): a driver said to be registered, NVML's state new."""
    compiler = find_tool("gcc") or find_tool("cc")
    if compiler is None:
        pytest.skip("missing tool: gcc (apt-get install gcc)")
    assert compiler is not None  # (pytest.skip does not return)
    library = tmp_path / "libnvml_standin.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library),
                    str(Path(__file__).parent / "data" / "nvml_standin.c")], check=True,
                   timeout=120)
    for memo in ("_NVML_REFUSED", "_NVML_RAW", "_NVML_ROOM"):
        monkeypatch.setattr(census_module, memo, type(getattr(census_module, memo))())
    for key, value in (("module", None), ("reason", None), ("handles", None), ("tried", False),
                       ("attempts", 0), ("retry_at", 0.0), ("backoff_s", 0.0)):
        monkeypatch.setitem(census_module._NVML, key, value)
    monkeypatch.setattr(census_module, "nvidia_registered", lambda proc_root="/proc": True)
    import ctypes

    monkeypatch.setattr(census_module, "_load_nvml", lambda: census_module._NvmlLibrary(
        ctypes, ctypes.CDLL(str(library))))
    return library


def test_nvml_is_called_through_ctypes_with_nvmls_codes(
        nvml_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The census reads NVML through its own ctypes calls (no pynvml): driver, UUIDs, names,
    memory, the process listings (_v3, else _v2; one a driver lacks is skipped); a call that
    fails is NVMLError with NVML's code and text, kept as that GPU's error."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it would raise
    monkeypatch.setenv("NVML_STANDIN_PID", str(os.getpid()))
    section = node.nvml_snapshot()
    assert section["available"] is True and section["driver"] == "580.0-standin"
    first, second = section["devices"]
    assert first == {"index": 0, "uuid": "GPU-standin-0", "name": "Stand-in H200",
                     "memory_used_mib": 1639.0, "memory_total_mib": 143771.0,
                     "processes": [{"pid": os.getpid(), "used_mib": 1024.0}]}
    assert second["uuid"] == "GPU-standin-1" and second["name"] is None
    assert second["error"] == "Not Supported" and section["errors"] == ["GPU 1: Not Supported"]
    assert node.nvml_gpu_processes() == [{"pid": os.getpid(), "used_mib": 1024.0,
                                          "gpu_index": 0}]
    assert [m["used_mib"] for m in node.nvml_device_memory()] == [1639.0, 0.0]
    library = census_module._NVML["module"]
    with pytest.raises(census_module.NVMLError) as failed:
        library.nvmlDeviceGetHandleByIndex(7)
    assert failed.value.value == 2 and str(failed.value) == "Unknown Error"
    with pytest.raises(census_module.NVMLError) as missing:
        library._nvmlGetFunctionPointer("nvmlDeviceGetGraphicsRunningProcesses_v3")
    assert missing.value.value == 13
    # the graphics listing: neither _v3 nor _v2 in this library, so not asked
    assert census_module._NVML_RAW["nvmlDeviceGetGraphicsRunningProcesses"] is None
    assert census_module._NVML_RAW["nvmlDeviceGetMPSComputeRunningProcesses"] is not None


def test_the_gpu_layer_reads_utilisation_samples_and_xids_through_the_census_nvml(
        nvml_standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """chaosgpu.gpu.nvml calls NVML through the census's library (no pynvml): utilisation
    rates, the driver's samples newer than a timestamp (none newer: []; the value read by its
    type), an XID watch that gets the event NVML delivers and says which GPU refused to
    register; an unknown GPU index is a ValueError naming it."""
    from chaosgpu.gpu import nvml

    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it would raise
    assert nvml.available() == (True, None)
    assert {k: v for k, v in nvml.utilization(0).items() if k != "t"} == {
        "gpu_pct": 37, "memory_pct": 12}
    assert nvml.utilization_samples(0) == [[1000, 10], [2000, 20], [3000, 30]]
    assert nvml.utilization_samples(0, "memory", since_us=2000) == [[3000, 30]]
    assert nvml.utilization_samples(0, since_us=3000) == []
    with pytest.raises(ValueError, match="kind must be"):
        nvml.utilization_samples(0, "power")
    with pytest.raises(ValueError, match="no GPU 5: NVML sees 2"):
        nvml.utilization(5)
    watch = nvml.XidWatch()
    try:
        seen = watch.wait(10.0)
    finally:
        watch.stop()
    watch.stop()  # twice: nothing more to free
    assert watch.registered == [0] and list(watch.unsupported) == ["1"]
    assert "Not Supported" in watch.unsupported["1"] and watch.error is None
    assert [(e["device"], e["event_type"], e["xid"]) for e in seen] == [(0, 8, 79)]


def test_program_prints_one_json_document() -> None:
    result = run_program("--no-gpu", "--pid", str(os.getpid()))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["schema"] == "chaosgpu.census/1"
    assert [p["pid"] for p in document["processes"]] == [os.getpid()]
    assert document["gpu"]["available"] is False


@pytest.mark.parametrize("args,message", [
    (["--pid", "abc"], "--pid needs a positive integer"),
    (["--pid"], "--pid needs a value"),
    (["--bogus"], "unknown argument '--bogus'"),
    (["--gpu-snapshot", "/nonexistent.json"], "--gpu-snapshot '/nonexistent.json'"),
])
def test_program_bad_arguments(args: list[str], message: str) -> None:
    result = run_program(*args)
    assert result.returncode == 2
    assert message in json.loads(result.stdout)["error"]


def test_program_runs_under_python38_syntax() -> None:
    import ast

    ast.parse(PROGRAM.read_text(), feature_version=(3, 8))


def test_cli_unknown_device_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--device", "3"]) == 2
    assert "GPU 3 does not exist here" in capsys.readouterr().err
    assert cli.main(["--gpu-snapshot", str(RECORDED), "--device", "1"]) == 2
    assert "GPU 1 does not exist here; GPUs are [0]" in capsys.readouterr().err
    assert cli.main(["--device", "-1"]) == 2
    assert cli.main(["--gpu-snapshot", "/nonexistent.json"]) == 2


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--gpu-snapshot", str(RECORDED), "--device", "0"]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA H200" in text and "143,771" in text and "not visible here" in text
    assert cli.main(["--json", "--no-gpu"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == "chaosgpu.census/1"
    assert os.getpid() in [p["pid"] for p in document["processes"]]


def test_chaosgpu_snapshot_command() -> None:
    """The command's JSON is UTF-8 whatever the locale: a command line that is not ASCII
    comes out as it is, under LANG=C too (and a process with invalid UTF-8 in its argv does
    not break the output)."""
    chaosgpu = Path(sys.executable).parent / "chaosgpu"
    argv = [sys.executable.encode(), b"-c", b"import time; time.sleep(30)",
            "gr\u00fc\u00dfe-\u03bb".encode(), b"\xff\xfe"]
    named = subprocess.Popen(argv)
    try:
        wait_for(lambda: len(node.read_cmdline(named.pid)) == 5, what="exec")
        result = subprocess.run([str(chaosgpu), "snapshot", "--json", "--no-gpu"],
                                capture_output=True, timeout=60, check=False,
                                env=dict(os.environ, LANG="C", LC_ALL="C"))
    finally:
        named.kill()
        named.wait()
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout.decode("utf-8"))
    assert document["gpu"]["reason"] == "not asked (--no-gpu)"
    mine = [p for p in document["processes"] if p["pid"] == named.pid]
    assert mine and mine[0]["cmdline"][3:] == ["gr\u00fc\u00dfe-\u03bb", "\ufffd\ufffd"], mine
    assert not os.path.exists(f"/proc/{named.pid}")


def test_the_snapshot_program_ends_once_its_output_is_flushed(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The command run as a program leaves without freeing the census (os._exit once the
    output is flushed): JSON and table come out whole through a pipe; called as a function it
    returns."""
    chaosgpu = Path(sys.executable).parent / "chaosgpu"
    for argv in (["snapshot", "--json", "--no-gpu"], ["snapshot", "--no-gpu"]):
        result = subprocess.run([str(chaosgpu), *argv], capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert result.stdout.endswith("\n") and len(result.stdout) > 100
        if "--json" in argv:
            assert json.loads(result.stdout)["schema"] == "chaosgpu.census/1"
    from chaosgpu import cli as program

    assert program.main(["snapshot", "--json", "--no-gpu"]) == 0
    assert json.loads(capsys.readouterr().out)["schema"] == "chaosgpu.census/1"


# The snapshot program as its console script runs it, telling which modules were imported when
# it ends (it ends with os._exit once its output is written)
IMPORTS_AT_EXIT = """
import os, sys
exit_now = os._exit
def tell_and_exit(code):
    sys.stderr.write(" ".join(sorted(sys.modules)))
    sys.stderr.flush()
    exit_now(code)
os._exit = tell_and_exit
sys.argv = ["chaosgpu", "snapshot", "--json", "--no-gpu"]
from chaosgpu.cli import main
sys.exit(main())
"""


def test_the_snapshot_program_starts_without_json_argparse_threading_or_re() -> None:
    """What the snapshot program imports: neither json nor argparse nor threading (their
    imports were a fifth of what `ps` takes at 1,000 processes on 2 cores), and re only where
    a process's cgroup names a container."""
    result = subprocess.run([sys.executable, "-c", IMPORTS_AT_EXIT], capture_output=True,
                            text=True, timeout=60, check=True)
    imported = set(result.stderr.split())
    assert "chaosgpu.node.cli" in imported, result.stderr
    assert not imported & {"json", "argparse", "threading"}, imported
    document = json.loads(result.stdout)
    if not any(p["container"] for p in document["processes"]):
        assert "re" not in imported


@pytest.mark.parametrize("piece", [250, 7, 1])
def test_the_snapshots_json_is_what_json_dumps_writes(monkeypatch: pytest.MonkeyPatch,
                                                      piece: int) -> None:
    """The snapshot's encoder (json's C encoder, without importing json, a long list in
    pieces) writes what json.dumps writes, for a census and for values of every kind."""
    from chaosgpu.node import cli as snapshot_cli

    monkeypatch.setattr(snapshot_cli, "PIECE_RECORDS", piece)
    assert snapshot_cli._encode({}) == "{}"
    assert snapshot_cli._encode({"a": [], "b": [1] * piece, "c": [2] * (piece + 1)}) == \
        json.dumps({"a": [], "b": [1] * piece, "c": [2] * (piece + 1)}, separators=(",", ":"))
    document: dict[str, Any] = node.take_census(gpu=False)
    document["odd"] = ["\u00e9\u2028\x00\"\\\ud7ff", 1.5, float("inf"), float("nan"), -0.0, 10**30,
                       True, False, None, {"1": [], "": {}}, (1, 2), 2**63]
    assert snapshot_cli._encode(document) == json.dumps(
        document, separators=(",", ":"), check_circular=False, ensure_ascii=False)
    with pytest.raises(TypeError, match="not JSON serializable"):
        snapshot_cli._encode({"x": object()})


def test_a_snapshot_whose_reader_goes_away_ends_without_a_traceback() -> None:
    """`chaosgpu snapshot --json | head -c 100`: the reader closes its end; the snapshot ends
    as a program that SIGPIPE ended (141), and says nothing on stderr."""
    snapshot = subprocess.Popen([sys.executable, "-m", "chaosgpu.cli", "snapshot", "--json",
                                 "--no-gpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert snapshot.stdout is not None and snapshot.stderr is not None
    snapshot.stdout.close()  # before anything is written: the first write finds no reader
    try:
        assert snapshot.stderr.read() == b""
        assert snapshot.wait(timeout=60) == 141
    finally:
        if snapshot.poll() is None:
            snapshot.kill()
            snapshot.wait()
        snapshot.stderr.close()


def test_census_is_fast_here() -> None:
    started = time.monotonic()
    census = node.take_census(gpu=False)
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, f"census of {len(census['processes'])} processes took {elapsed:.3f}s"


def test_cache_keeps_what_a_zombie_had_while_alive() -> None:
    census_module._CACHE.clear()
    env = dict(os.environ, CHAOSGPU_TAG="cached-tag", RANK="5")
    child = subprocess.Popen(["sleep", "30"], env=env)
    try:
        wait_for(lambda: (node.read_process(child.pid) or {}).get("tag"), what="exec")
        time.sleep(2.2)  # only processes older than 2 s are cached (fork/exec races)
        first = node.take_census(gpu=False, cache=True)
        assert any(k[1] == child.pid for k in census_module._CACHE)
        assert next(p for p in first["processes"] if p["pid"] == child.pid)["tag"] == "cached-tag"
        child.kill()
        wait_for(lambda: node.process_state(child.pid) == "Z", what="zombie")
        warm = node.take_census(gpu=False, cache=True)
        zombie = next(p for p in warm["processes"] if p["pid"] == child.pid)
        assert zombie["zombie"] and zombie["tag"] == "cached-tag"
        assert zombie["env"]["RANK"] == "5" and zombie["nvidia_fds"] == []
        cold = node.take_census(gpu=False)
        assert next(p for p in cold["processes"] if p["pid"] == child.pid)["env"] is None
    finally:
        child.wait()
    node.take_census(gpu=False, cache=True)
    assert not any(k[1] == child.pid for k in census_module._CACHE)  # pruned once gone


def test_forked_readers_give_the_same_census() -> None:
    children = [subprocess.Popen(["sleep", "30"], env=dict(os.environ)) for _ in range(5)]
    try:
        pids = node.list_pids()
        wanted = pids * (1 + 1000 // max(1, len(pids)))  # >= 1000 entries to use readers
        proc_ns = census_module._proc_ns("/proc")
        serial = census_module._read_serial(wanted, "/proc", True, True, proc_ns, "full", None,
                                            None)
        parallel = census_module._read_parallel(wanted, "/proc", True, True, proc_ns, "full", 3)
        for child in children:
            assert serial[0][child.pid]["starttime"] == parallel[0][child.pid]["starttime"]
            assert parallel[0][child.pid]["cmdline"] in (["sleep", "30"], serial[0][child.pid]
                                                         ["cmdline"])
        assert set(serial[0]) - set(parallel[0]) <= {p for p in serial[0]
                                                      if node.process_state(p) is None}
        census = node.take_census(gpu=False, workers=2)
        assert {c.pid for c in children} <= {p["pid"] for p in census["processes"]}
    finally:
        for child in children:
            child.kill()
            child.wait()


@pytest.mark.parametrize("failure", ["dies after one block", "cannot be forked"])
def test_blocks_no_forked_reader_returned_are_read_here(
        monkeypatch: pytest.MonkeyPatch, failure: str) -> None:
    """The readers take blocks of PIDs from one queue; a reader that dies with a block taken
    (or a fork that fails) leaves nothing unread: the census reads those blocks itself, and
    the dead reader is reaped."""
    module = census_module
    pids = node.list_pids()
    proc_ns = module._proc_ns("/proc")
    monkeypatch.setattr(module, "BLOCK_PIDS", 4)  # many blocks for a few dozen processes
    forked: list[int] = []
    if failure == "cannot be forked":
        monkeypatch.setattr(module, "_fork_work", lambda work: None)
    else:
        reader = os.getpid()
        read_serial = module._read_serial
        fork_work = module._fork_work

        def dies_in_a_child(*args: Any) -> Any:
            if os.getpid() != reader:
                os._exit(3)  # its first block taken, nothing sent
            return read_serial(*args)

        def fork_and_remember(work: Any) -> Any:
            child = fork_work(work)
            if child is not None:
                forked.append(child[0])
            return child

        monkeypatch.setattr(module, "_read_serial", dies_in_a_child)
        monkeypatch.setattr(module, "_fork_work", fork_and_remember)
    parallel, errors = module._read_parallel(pids, "/proc", True, True, proc_ns, "full", 3)
    monkeypatch.undo()
    serial, _ = module._read_serial(pids, "/proc", True, True, proc_ns, "full", None, None)
    gone = {pid for pid in pids if node.process_state(pid) is None}
    assert set(serial) - gone <= set(parallel) <= set(pids), "a block was left unread"
    both = set(serial) & set(parallel)
    assert {pid: parallel[pid]["starttime"] for pid in both} == \
        {pid: serial[pid]["starttime"] for pid in both}
    assert not errors or gone
    assert len(forked) == (2 if failure == "dies after one block" else 0)
    for child in forked:
        assert node.process_state(child) is None  # reaped, nothing left behind


@pytest.mark.parametrize("env", [True, False], ids=["env", "no-env"])
def test_the_snapshots_plain_loop_makes_the_records_read_process_makes(env: bool) -> None:
    """The uncached full reading takes plain processes in one loop and leaves the others
    (kernel threads, zombies, nested PID namespaces) to read_process: both give the same
    record, field for field and in the same order."""
    module = census_module
    proc_ns = module._proc_ns("/proc")
    tagged_env = dict(os.environ, RANK="3", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29533", CHAOSGPU_TAG="plain-loop")
    sleeper = "import time; time.sleep(60)"
    started = [subprocess.Popen(["sleep", "60"]),
               subprocess.Popen([sys.executable, "-c", sleeper], env=tagged_env),
               subprocess.Popen([sys.executable, "-c", sleeper, "x" * 70_000]),  # > 64 KiB
               subprocess.Popen(["true"])]  # left unreaped: a zombie
    try:
        with pod() as pid1:
            plain = [p.pid for p in started[:3]]
            zombie = started[3].pid
            wait_for(lambda: node.process_state(zombie) == "Z", what="the zombie")
            wait_for(lambda: all((node.read_process(pid) or {}).get("cmdline", [])[:2] in (
                ["sleep", "60"], [sys.executable, "-c"]) for pid in plain), what="the exec")
            # Each sleeper asleep, so its state read twice is one letter (a Python still
            # importing reads R once and S the next time).
            wait_for(lambda: all(node.process_state(pid) == "S" for pid in plain),
                     what="the sleepers asleep")
            wanted = [*plain, zombie, pid1, 2, 999_999_999]
            records: dict[int, dict[str, Any]] = {}
            rest = module._read_plain(wanted, "/proc", env, module.NO_NVIDIA_DEVICE, proc_ns,
                                      records)
            assert rest == [zombie, pid1, 2, 999_999_999]
            assert sorted(records) == sorted(plain)
            for pid in plain:
                expected = module.read_process(pid, env=env, fds=module.NO_NVIDIA_DEVICE,
                                               proc_ns=proc_ns)
                assert records[pid] == expected
                assert list(records[pid]) == list(expected)
            assert len("".join(records[plain[2]]["cmdline"])) > 70_000
            if env:
                assert records[plain[1]]["tag"] == "plain-loop"
                assert records[plain[1]]["env"]["RANK"] == "3"
            else:
                assert records[plain[1]]["env"] is None
            serial, _ = module._read_serial(wanted, "/proc", env, module.NO_NVIDIA_DEVICE,
                                            proc_ns, "full", None, None)
            assert serial[zombie]["zombie"] and serial[pid1]["ns_init"]
            assert serial[2]["kthread"] and 999_999_999 not in serial
    finally:
        for process in started:
            process.kill()
            process.wait()
    assert all(node.process_state(p.pid) is None for p in started)


# A single-threaded census with forked readers, told that a driver is registered (none is
# here): the GPU section is then read by a forked child, and by a thread with one reader.
FORKED_NVML = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import node_census as census
census.nvidia_registered = lambda proc_root="/proc": True
pids = census.list_pids()
wanted = pids * (1 + 1000 // len(pids))
out = {}
for workers, chosen in ((0, pids[:5]), (2, wanted), (1, wanted)):
    document = census.census(pids=chosen, workers=workers, fds=False)
    out[workers] = {"reader": document["observer"]["gpu_reader"], "gpu": document["gpu"],
                    "tried": census._NVML["tried"], "readers": document["observer"]["readers"]}
out["children"] = os.listdir("/proc/%d/task/%d" % (os.getpid(), os.getpid())) and \
    open("/proc/%d/task/%d/children" % (os.getpid(), os.getpid())).read().split()
print(json.dumps(out))
"""


def test_a_one_shot_census_with_forked_readers_reads_nvml_in_a_forked_child() -> None:
    """pynvml's import and NVML's calls off the snapshot's GIL: the same GPU section as a
    thread gives, this process's NVML state untouched, no child left; a one-shot census
    whose readers may be forked (automatic readers: one picked for 5 processes) forks NVML's
    child too, first thing; the census of a process that reads NVML on a thread (one reader)
    says so."""
    result = subprocess.run([sys.executable, "-c", FORKED_NVML, str(PROGRAM.parent)],
                            capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(result.stdout)
    assert out["0"]["reader"] == "forked" and out["0"]["readers"] == 1
    assert out["2"]["reader"] == "forked" and out["1"]["reader"] == "thread"
    assert out["0"]["tried"] is False and out["2"]["tried"] is False  # the child's NVML
    assert out["0"]["gpu"] == out["1"]["gpu"]
    assert out["2"]["gpu"] == out["1"]["gpu"] and out["1"]["gpu"]["available"] is False
    assert out["children"] == []
    assert node.take_census(pids=[os.getpid()], gpu=False)["observer"]["gpu_reader"] is None


# A census that fails after forking NVML's child (told a driver is registered; the listing
# of /proc made to raise): the error reaches the caller and no child is left.
FAILED_AFTER_FORK = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import node_census as census
census.nvidia_registered = lambda proc_root="/proc": True
def broken(proc_root="/proc"):
    raise RuntimeError("the listing broke")
census.list_pids = broken
try:
    census.census(workers=0, fds=False)
except RuntimeError as error:
    raised = str(error)
me = os.getpid()
print(json.dumps({"raised": raised,
                  "children": open("/proc/%d/task/%d/children" % (me, me)).read().split()}))
"""


# The same where the census's own share of the reading raises once its readers are forked
# (told 2,000 processes: readers are forked from 1,000).
FAILED_AFTER_READERS = FAILED_AFTER_FORK.replace("census.list_pids = broken\n", """
parent, read_serial = os.getpid(), census._read_serial
def serial_broken_here(*args):
    if os.getpid() == parent:
        raise RuntimeError("the listing broke")
    return read_serial(*args)
census._read_serial = serial_broken_here
pids = census.list_pids()
census.list_pids = lambda proc_root="/proc": pids * (1 + 2000 // len(pids))
""")


@pytest.mark.parametrize("script", [FAILED_AFTER_FORK, FAILED_AFTER_READERS],
                         ids=["nvml-child", "readers"])
def test_a_census_that_fails_after_forking_leaves_no_child(script: str) -> None:
    """A census that raises after forking (NVML's child, its readers) reaps them first."""
    result = subprocess.run([sys.executable, "-c", script, str(PROGRAM.parent)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) == {"raised": "the listing broke", "children": []}


def test_a_forked_work_that_fails_is_redone_here() -> None:
    module = census_module

    def broken() -> None:
        raise RuntimeError("in the child")

    forked = module._fork_work(broken)
    assert forked is not None
    assert module._collect_work(forked, lambda: "redone") == "redone"
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # reaped
    good = module._fork_work(lambda: {"pid": os.getpid()})
    assert good is not None
    assert module._collect_work(good, lambda: "redone") == {"pid": good[0]}


def test_a_forked_works_result_is_taken_before_its_child_is_reaped() -> None:
    """With a list for the unreaped, a whole result comes back at its pipe's end (closed by
    the child before it exits) and the child is left there; ``_reap`` collects it."""
    module = census_module
    unreaped = []  # type: list
    forked = module._fork_work(lambda: {"pid": os.getpid()})
    assert forked is not None
    assert module._collect_work(forked, lambda: "redone", unreaped) == {"pid": forked[0]}
    assert unreaped == [forked[0]]
    assert module._reap(forked[0]) == 0
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # reaped
    assert module._reap(forked[0]) == 0  # reaped already: nothing to wait for
    torn = module._fork_work(lambda: os._exit(3))  # nothing written: redone, reaped at once
    assert torn is not None
    assert module._collect_work(torn, lambda: "redone", unreaped) == "redone"
    assert unreaped == [forked[0]]
    with pytest.raises(ChildProcessError):
        os.waitpid(torn[0], os.WNOHANG)


# A census that succeeds with NVML's child and two forked readers (told a driver is
# registered and 2,000 processes): every child is reaped by the time it returns.
SUCCEEDED_WITH_FORKS = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import node_census as census
census.nvidia_registered = lambda proc_root="/proc": True
pids = census.list_pids()
census.list_pids = lambda proc_root="/proc": pids * (1 + 2000 // len(pids))
document = census.census(workers=2, fds=False)
me = os.getpid()
print(json.dumps({"readers": document["observer"]["readers"],
                  "gpu_reader": document["observer"]["gpu_reader"],
                  "children": open("/proc/%d/task/%d/children" % (me, me)).read().split()}))
"""


def test_a_census_that_forks_leaves_no_child() -> None:
    """NVML's child and the readers hand their results over before they exit; the census
    reaps them all before it returns."""
    result = subprocess.run([sys.executable, "-c", SUCCEEDED_WITH_FORKS, str(PROGRAM.parent)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout) == {"readers": 2, "gpu_reader": "forked", "children": []}


def test_program_is_self_contained_without_site_packages() -> None:
    """In a bare container: no chaosgpu, no pynvml (python -I -S): still one JSON document,
    NVML read with the standard library (here: no driver, and the reason says so)."""
    result = subprocess.run([sys.executable, "-I", "-S", str(PROGRAM), "--pid", str(os.getpid())],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["gpu"]["available"] is False
    assert document["gpu"]["reason"].startswith("NVML unavailable: ")
    assert document["processes"][0]["pid"] == os.getpid()


# ---------------------------------------------------------------- the low-level /proc readers


def test_readers_give_typed_errors_with_one_read_per_check() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env=dict(os.environ, CHAOSGPU_TAG="readers", RANK="3"))
    try:
        # right after exec the kernel shows an empty argv for a moment
        wait_for(lambda: node.read_cmdline(child.pid), what="the child's argv")
        stat = node.read_stat(child.pid)
        assert stat["ppid"] == os.getpid() and stat["state"] in ("R", "S")
        assert stat["starttime"] == node.process_starttime(child.pid)
        # the start time identifies the process: another one raises NoSuchProcess
        with pytest.raises(node.NoSuchProcess):
            node.read_stat(child.pid, starttime=stat["starttime"] + 1)
        assert node.process_state(child.pid, starttime=stat["starttime"] + 1) is None
        assert node.read_cmdline(child.pid)[:2] == [sys.executable, "-c"]
        assert node.read_environ(child.pid, keys=("CHAOSGPU_TAG", "RANK")) == {
            "CHAOSGPU_TAG": "readers", "RANK": "3"}
        assert child.pid in node.read_children(os.getpid())
        status = node.read_status(child.pid)
        assert status["uid"] == os.getuid() and status["nspid"] == [child.pid]
        assert node.read_pid_ns(child.pid) == os.readlink("/proc/self/ns/pid")
        assert node.pid_ns_inode(child.pid) == os.stat("/proc/self/ns/pid").st_ino
        fd = node.open_statm(child.pid)
        try:
            assert node.rss_bytes(child.pid, fd) > 0 and node.rss_bytes(child.pid) > 0
        finally:
            os.close(fd)
    finally:
        child.kill()
        child.wait()
    for reader in (node.read_stat, node.read_status, node.read_cmdline, node.read_environ,
                   node.read_children, node.read_pid_ns, node.pid_ns_inode, node.rss_bytes):
        with pytest.raises(node.NoSuchProcess) as caught:
            reader(child.pid)
        assert caught.value.pid == child.pid
    assert node.process_state(child.pid) is None and node.process_starttime(child.pid) is None
    assert node.uptime_s() > 0 and int(node.read_sysctl("kernel.pid_max")) > 0
    with pytest.raises(ValueError, match="invalid sysctl name"):
        node.read_sysctl("../../etc/passwd")


def test_last_pid_moves_with_every_new_process_and_only_then(tmp_path: Path) -> None:
    """/proc/loadavg's last PID: a new process moves it (to its PID, unless another took one
    meanwhile); ``shows_own_pid_ns`` tells whether a /proc counts the reader's PIDs."""
    before = node.last_pid()
    proc = subprocess.Popen(["true"])
    proc.wait()
    after = node.last_pid()
    assert after != before and (after >= proc.pid or after < before)  # or PIDs wrapped
    assert node.shows_own_pid_ns()
    assert not node.shows_own_pid_ns(str(tmp_path))  # a folder without a self link
    (tmp_path / "loadavg").write_text("0.00 0.01 0.05 1/123 4567\n")
    assert node.last_pid(str(tmp_path)) == 4567


def test_reader_access_denied_is_typed() -> None:
    """Another user's environ is closed to a non-root reader: AccessDenied, not 'gone'."""
    if os.geteuid() != 0:
        pytest.skip("needs root to read as nobody")
    code = (f"import sys; sys.path.insert(0, {str(PROGRAM.parent)!r}); import node_census as n\n"
            f"try:\n    n.read_environ({os.getpid()})\nexcept n.AccessDenied as e:\n"
            "    print('denied', e.pid, e.what)\n")
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                             sys.executable, "-I", "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.stdout.split() == ["denied", str(os.getpid()), "environ"], result.stderr


def test_package_reads_proc_only_through_the_census_readers() -> None:
    """No string naming a path under /proc is left in the modules converted to the readers (their
    docstrings and comments may still name what they read)."""
    import ast

    for relative in ("chaosgpu/sandbox/runtime.py", "chaosgpu/timeline/sampler.py",
                     "chaosgpu/sandbox/probes.py", "chaosgpu/node/__init__.py"):
        tree = ast.parse((REPO / relative).read_text())
        docstrings = {id(node_.body[0].value) for node_ in ast.walk(tree)
                      if isinstance(node_, (ast.Module, ast.FunctionDef, ast.ClassDef))
                      and node_.body and isinstance(node_.body[0], ast.Expr)}
        for item in ast.walk(tree):
            if isinstance(item, ast.Constant) and isinstance(item.value, str) \
                    and id(item) not in docstrings:
                assert "/proc/" not in item.value, (relative, item.value)


def test_snapshot_json_is_compact_off_a_terminal_and_fd_scan_is_said(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--json", "--no-gpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line: the C encoder, one write
    census = json.loads(out)
    scan = census["observer"]["nvidia_fd_scan"]
    if node.nvidia_registered():
        assert scan is True
    else:  # no NVIDIA driver here: no fd can be a GPU device, so none is read, and it is said
        assert scan.startswith("skipped: ") and all(p["nvidia_fds"] == [] for p in
                                                     census["processes"] if not p["kthread"])
    assert cli.main(["--json", "--no-gpu", "--no-env", "--indent", "2"]) == 0
    assert capsys.readouterr().out.startswith('{\n  "schema"')
    assert cli.main(["--json", "--indent", "-1"]) == 2
    assert "--indent must be >= 0" in capsys.readouterr().err
    text_only = io.StringIO()  # a caller's text stream, without the byte buffer under it
    with contextlib.redirect_stdout(text_only):
        assert cli.main(["--json", "--no-gpu"]) == 0
    assert json.loads(text_only.getvalue())["schema"] == "chaosgpu.census/1"


@pytest.mark.parametrize("held", [True, False], ids=["held-stat-fd", "no-held-fd"])
def test_a_process_that_execs_after_it_was_cached_is_read_again(
        held: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached process that execs another program (a wrapper that waits, then execs the
    trainer with its rank) shows the new program's command line, environment and job at the
    next census, through its held stat fd or without one; it is cached again afterwards."""
    census_module._CACHE.clear()
    if not held:  # no fd room: the cached process is read by its stat alone
        monkeypatch.setattr(census_module, "_STAT_FDS_MAX", [0])
    wrapper = subprocess.Popen(
        ["bash", "-c", "read -r go; exec env RANK=3 WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 "
                       "MASTER_PORT=29517 sleep 30"], stdin=subprocess.PIPE)
    assert wrapper.stdin is not None

    def reading() -> tuple[dict[str, Any], dict[str, Any]]:
        census = node.take_census(gpu=False, cache=True)
        return census, next(p for p in census["processes"] if p["pid"] == wrapper.pid)

    try:
        wait_for(lambda: node.read_cmdline(wrapper.pid)[:1] == ["bash"], what="bash")
        time.sleep(2.2)  # cached from 2 s of age
        reading()
        _, before = reading()
        key = ("/proc", wrapper.pid, before["starttime"])
        assert key in census_module._CACHE
        assert (("/proc", wrapper.pid) in census_module._STAT_FDS) is held
        assert before["cmdline"][0] == "bash" and "RANK" not in (before["env"] or {})
        wrapper.stdin.write(b"go\n")
        wrapper.stdin.flush()
        wait_for(lambda: node.read_cmdline(wrapper.pid)[:1] == ["sleep"], what="the exec")
        census, after = reading()
        assert after["cmdline"] == ["sleep", "30"], after
        assert {k: v for k, v in after["env"].items() if not k.startswith("CHAOSGPU_")} == {
            "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
        assert "_exec" not in after
        jobs = {j["id"]: j for j in census["jobs"]}
        ranks = jobs["127.0.0.1:29517"]["ranks"]
        assert [r["pid"] for r in ranks if r["pid"] is not None] == [wrapper.pid]
        reading()
        _, again = reading()  # cached again, as the program it is now
        assert census_module._CACHE[key]["cmdline"] == ["sleep", "30"]
        assert again["cmdline"] == ["sleep", "30"] and again["env"]["RANK"] == "3"
    finally:
        wrapper.kill()
        wrapper.wait()
    assert not os.path.exists(f"/proc/{wrapper.pid}")


def test_held_stat_fds_follow_their_process_and_are_closed_once_it_is_gone() -> None:
    """A process the cache knows is re-read through its kept /proc/PID/stat fd: a stop, a
    continue and its death show through it, its record equals a fresh full reading, and once
    it is reaped the fd is closed (none leaks, none reads a later owner of the PID)."""
    census_module._CACHE.clear()
    fds_before = set(os.listdir("/proc/self/fd"))
    child = subprocess.Popen(["sleep", "30"], env=dict(os.environ, CHAOSGPU_TAG="held-fd"))
    key = ("/proc", child.pid)
    try:
        wait_for(lambda: (node.read_process(child.pid) or {}).get("tag"), what="exec")
        time.sleep(2.2)  # cached from 2 s of age
        node.take_census(gpu=False, cache=True)  # cached
        node.take_census(gpu=False, cache=True)  # known: its stat fd is kept
        assert key in census_module._STAT_FDS

        def polled() -> dict:
            census = node.take_census(gpu=False, cache=True)
            return next(p for p in census["processes"] if p["pid"] == child.pid)

        fresh = node.read_process(child.pid, fds=False)
        assert fresh is not None
        kept = polled()
        kept.pop("not_read", None)
        private = ("_nssid", "_nspgid")  # not in the census
        assert kept == {k: v for k, v in dict(fresh, nvidia_fds=kept["nvidia_fds"]).items()
                        if k not in private}
        # an idle process's record is a copy of the last one: what a caller does to it stays
        kept.update(orphan=True, comm="changed")
        kept["errors"]["x"] = "y"
        kept["unreadable"].append("x")
        again = polled()
        assert (again["orphan"], again["comm"], again["errors"], again["unreadable"]) == (
            False, fresh["comm"], {}, [])
        child.send_signal(19)  # SIGSTOP
        wait_for(lambda: polled()["state"] == "T", what="stopped, seen through the held fd")
        child.send_signal(18)  # SIGCONT
        wait_for(lambda: polled()["state"] == "S", what="running again")
        child.kill()
        wait_for(lambda: polled()["state"] == "Z", what="zombie")
        assert polled()["tag"] == "held-fd" and polled()["zombie"]
    finally:
        child.kill()
        child.wait()
    census = node.take_census(gpu=False, cache=True)
    assert child.pid not in {p["pid"] for p in census["processes"]}
    assert key not in census_module._STAT_FDS
    assert not any(k[1] == child.pid for k in census_module._CACHE)
    leaked = set(os.listdir("/proc/self/fd")) - fds_before - {
        str(slot[0]) for slot in census_module._STAT_FDS.values()}
    assert not [os.readlink(f"/proc/self/fd/{fd}") for fd in leaked
                if os.path.exists(f"/proc/self/fd/{fd}")
                and os.readlink(f"/proc/self/fd/{fd}").endswith(f"/{child.pid}/stat")]


def test_a_cached_census_reads_env_when_asked_and_equals_a_fresh_one() -> None:
    """A process cached by a census without env is read again when a later census asks for env
    (its tag is not lost: a regression, the tag read None); and every record of the polled
    census (held stat fds, the cache, kernel threads included) equals a fresh reading."""
    census_module._CACHE.clear()
    child = subprocess.Popen(["sleep", "30"], env=dict(os.environ, CHAOSGPU_TAG="env-later"))
    try:
        wait_for(lambda: (node.read_process(child.pid) or {}).get("tag"), what="exec")
        time.sleep(2.2)  # cached from 2 s of age
        for _ in range(2):
            node.take_census(gpu=False, env=False, cache=True)
        for _ in range(2):
            polled = node.take_census(gpu=False, env=True, cache=True)
            record = next(p for p in polled["processes"] if p["pid"] == child.pid)
            assert record["tag"] == "env-later" and record["env"]["CHAOSGPU_TAG"] == "env-later"
        fresh = {p["pid"]: p for p in node.take_census(gpu=False)["processes"]}
        compared = 0
        for kept in polled["processes"]:
            other = fresh.get(kept["pid"])
            if other is None or other["starttime"] != kept["starttime"]:
                continue  # came or went between the two censuses
            # what may change between two readings; a kernel worker's name too: it carries the
            # workqueue it serves now ("kworker/1:3-events_freezable", then "-mm_percpu_wq")
            changing = ("state", "zombie", "nvidia_fds") + (("comm",) if kept["kthread"] else ())
            assert {k: v for k, v in kept.items() if k not in changing} == \
                {k: v for k, v in other.items() if k not in changing}, kept["pid"]
            compared += 1
        assert compared >= 10
    finally:
        child.kill()
        child.wait()



def test_cached_censuses_from_several_threads_neither_fail_nor_mix() -> None:
    """The cache is shared by a process's threads (a timeline's sampler takes its job scope's
    census beside the job observer's probes): cached censuses taken at once from four threads,
    while processes come and go (the cache's pruning), all succeed and each sees a tagged
    process with its tag."""
    import threading

    census_module._CACHE.clear()
    tagged = subprocess.Popen(["sleep", "60"], env=dict(os.environ, CHAOSGPU_TAG="threads"))
    failures: list[BaseException] = []
    tags: list[str | None] = []
    stop = threading.Event()

    def churn() -> None:  # processes that come and go: the cache drops what left
        while not stop.is_set():
            subprocess.run(["true"], check=False)

    def poll() -> None:
        try:
            for _ in range(15):
                census = node.take_census(gpu=False, fds=False, cache=True)
                tags.extend(p["tag"] for p in census["processes"] if p["pid"] == tagged.pid)
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            failures.append(error)

    churner = threading.Thread(target=churn)
    pollers = [threading.Thread(target=poll) for _ in range(4)]
    try:
        wait_for(lambda: (node.read_process(tagged.pid) or {}).get("tag"), what="exec")
        time.sleep(2.2)  # old enough to be cached
        churner.start()
        for thread in pollers:
            thread.start()
        for thread in pollers:
            thread.join(120)
    finally:
        stop.set()
        if churner.is_alive():
            churner.join()
        tagged.kill()
        tagged.wait()
    assert not failures, failures
    assert tags == ["threads"] * 60


def test_a_leader_that_ended_before_its_threads_is_exiting_not_a_zombie() -> None:
    """State Z with a live thread (a CUDA process in its driver teardown looks so) is
    `exiting`, not a zombie, in a fresh and in a cached census; once its last thread ends
    and it is not reaped, it is a zombie."""
    census_module._CACHE.clear()
    proc = subprocess.Popen([sys.executable, "-c", LEADER_EXITS])
    try:
        wait_for(lambda: node.process_state(proc.pid) == "Z", what="leader ended")
        time.sleep(2.2)  # old enough to be cached
        for cache in (False, True, True, True):
            record = next(p for p in node.take_census(gpu=False, cache=cache)["processes"]
                          if p["pid"] == proc.pid)
            assert record["state"] == "Z" and record["exiting"] and not record["zombie"]
        assert proc.pid not in node.take_census(gpu=False)["zombies"]
        proc.kill()  # the last thread ends; nobody reaps it yet
        wait_for(lambda: next(p for p in node.take_census(gpu=False, cache=True)["processes"]
                              if p["pid"] == proc.pid)["zombie"], what="a real zombie")
        record = next(p for p in node.take_census(gpu=False)["processes"] if p["pid"] == proc.pid)
        assert record["zombie"] and not record["exiting"]
    finally:
        proc.kill()
        proc.wait()


def test_files_served_a_page_at_a_time_are_read_to_their_end() -> None:
    """/proc/PID/task/*/children and /proc/PID/net/tcp are seq files: one read returns about a
    page of them. A parent of 900 children and a listener past the first page of the TCP table
    are still seen whole."""
    census = node.census_module()
    listeners = []
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys\n"
         "kids = []\n"
         "for _ in range(900):\n"
         "    pid = os.fork()\n"
         "    if pid == 0:\n"
         "        signal.pause()\n"
         "        os._exit(0)\n"
         "    kids.append(pid)\n"
         "print(len(kids), flush=True)\n"
         "sys.stdin.read()\n"
         "for pid in kids:\n"
         "    os.kill(pid, signal.SIGKILL)\n"
         "for pid in kids:\n"
         "    os.waitpid(pid, 0)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "900"
        kids = node.read_children(parent.pid)
        assert len(kids) == 900, len(kids)
        started = {pid: node.process_starttime(pid) for pid in kids}
        for _ in range(80):  # 80 lines of ~150 bytes: the last is well past the first page
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            listeners.append(sock)
        with open(f"/proc/{os.getpid()}/net/tcp", "rb") as handle:
            table = handle.read()
        assert len(table) > 3 * 4096
        last_port = listeners[-1].getsockname()[1]
        me = {"pid": os.getpid()}
        assert census._listening_on(me, str(last_port), "/proc")
    finally:
        for sock in listeners:
            sock.close()
        assert parent.stdin is not None
        parent.stdin.close()
        assert parent.wait(timeout=60) == 0
    # every child was killed and reaped by the parent: none is left
    assert [pid for pid, start in started.items()
            if node.process_state(pid, starttime=start) is not None] == []


def _polled_pids() -> tuple[set[int], str]:
    census = node.take_census(gpu=False, cache=True)
    return {p["pid"] for p in census["processes"]}, census["observer"]["listing"]


def test_a_polled_census_finds_new_processes_among_the_pids_allocated_since_the_last() -> None:
    """Between full listings a cached census reads the last one's processes and the processes
    among the PIDs the kernel allocated since: a new process is found, a new thread is not a
    process, an exited process is gone, and the PIDs equal a full listing's."""
    import threading

    census_module._LISTINGS.clear()
    assert [_polled_pids()[1] for _ in range(2)] == ["full", "full"]  # the first two times
    release = threading.Event()
    tids: list[int] = []
    def work() -> None:
        tids.append(threading.get_native_id())
        release.wait(30)

    worker = threading.Thread(target=work)
    child = subprocess.Popen(["sleep", "30"])
    worker.start()
    try:
        wait_for(lambda: tids, what="the thread's ID")
        before = set(node.list_pids())
        pids, listing = _polled_pids()
        after = set(node.list_pids())
        assert listing.startswith("the last census's processes and "), listing
        assert child.pid in pids and tids[0] not in pids and os.getpid() in pids
        assert before & after <= pids <= before | after  # a full listing's, up to churn
        # as if that census had read the kernel's last PID after the child's fork took its PID
        # but before the child showed in /proc: the next census still finds it
        state = census_module._LISTINGS["/proc"]
        state["pids"] = [pid for pid in state["pids"] if pid != child.pid]
        pids, listing = _polled_pids()
        assert child.pid in pids and listing != "full"
        child.kill()
        child.wait()
        pids, listing = _polled_pids()
        assert child.pid not in pids and listing != "full"
    finally:
        release.set()
        worker.join()
        child.kill()
        child.wait()
    assert not os.path.exists(f"/proc/{child.pid}")


def test_a_polled_census_lists_proc_in_full_when_the_pids_since_cannot_be_trusted(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """/proc is listed in full: past FULL_LISTING_S, past PROBED_PIDS_MAX new PIDs, when the
    last PID went back (PIDs wrapped), without pidfd_open, and for a /proc of another
    namespace (a copied tree)."""
    census_module._LISTINGS.clear()
    _polled_pids()
    _polled_pids()

    def new_process_then_listing() -> str:
        subprocess.run(["true"], check=True)
        return _polled_pids()[1]

    assert new_process_then_listing() != "full"
    monkeypatch.setattr(census_module, "PROBED_PIDS_MAX", 0)
    assert new_process_then_listing() == "full"
    monkeypatch.undo()
    _polled_pids()
    _polled_pids()
    census_module._LISTINGS["/proc"].update(since=node.last_pid() + 1000,
                                            last=node.last_pid() + 1000)
    assert new_process_then_listing() == "full"  # as if PIDs wrapped
    _polled_pids()
    monkeypatch.setattr(census_module, "FULL_LISTING_S", 0.0)
    assert new_process_then_listing() == "full"
    monkeypatch.undo()
    monkeypatch.delattr(census_module.os, "pidfd_open")
    assert new_process_then_listing() == "full"
    monkeypatch.undo()

    def refused(pid: int) -> int:
        raise PermissionError(1, "refused by a seccomp filter")

    monkeypatch.setattr(census_module.os, "pidfd_open", refused)
    assert new_process_then_listing() == "full"
    monkeypatch.undo()
    fake = _fake_proc(tmp_path)
    for _ in range(2):
        census = node.take_census(gpu=False, cache=True, proc_root=str(fake))
        assert census["observer"]["listing"] == "full"
    census_module._LISTINGS.clear()
