"""GPU faults on a machine without a GPU, as far as their logic goes: argument checks against
recorded H200 NVML snapshots (the one thing replayed), the fault programs started for real with
their host backends (the same start, readiness, record and rollback paths as on a GPU), the
duty-cycle schedule, refusals when there is no GPU, `chaosgpu cleanup` after a crash, and the
CUDA injection library built with gcc and its pure parts called through ctypes."""

import ctypes
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import find_tool

from chaosgpu import state
from chaosgpu.errors import ActivityError
from chaosgpu.gpu import actions, cudainject, devices, injector, launch, monitor, probes
from chaosgpu.gpu.contention import run_duty_cycle
from chaosgpu.node import process_state, read_process

DATA = Path(__file__).with_name("data")
RECORDED = DATA / "nvml_h200_recorded.json"
UUID = "GPU-b1b4f2f6-fd6a-9d65-31f9-443c48fa4d5a"


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """NVML replaced by the recorded H200 snapshot (idle: 615 MiB used of 143771)."""
    monkeypatch.setenv(devices.REPLAY_ENV, str(RECORDED))
    yield json.loads(RECORDED.read_text())
    assert not [t for t, r in state.list_records("workloads").items()
                if r.get("kind") in launch.FAULT_KINDS], "a GPU fault record was left behind"


def _no_gpu_faults_left() -> None:
    assert not [t for t, r in state.list_records("workloads").items()
                if r.get("kind") in launch.FAULT_KINDS]


# ---------------------------------------------------------------------------- validation


def test_devices_resolve_by_index_uuid_and_digits(replay: dict) -> None:
    section = devices.gpu_section()
    assert devices.resolve_device(0, section)["uuid"] == UUID
    assert devices.resolve_device(UUID.upper(), section)["index"] == 0
    assert devices.resolve_device("0", section)["index"] == 0
    for bad, match in ((1, "GPU 1 is out of range: this node has 1 GPU"),
                       (7, "out of range"), ("GPU-0000", "no GPU with UUID 'GPU-0000'"),
                       (True, "must be a GPU index or UUID"), (None, "GPU index or UUID"),
                       (1.5, "GPU index or UUID")):
        with pytest.raises(ValueError, match=match):
            devices.resolve_device(bad, section)


def test_mib_and_durations_are_checked_against_the_device(replay: dict) -> None:
    entry = devices.resolve_device(0)
    assert devices.check_mib(entry, mib=1024)["total_mib"] == 143771.0
    assert devices.check_mib(entry, leave_mib=0)["free_mib"] == pytest.approx(143155.94, 0.01)
    for kwargs, match in (({"mib": 143772}, "more than GPU 0 .* has: 143771 MiB"),
                          ({"mib": 0}, "mib must be >= 1"), ({"mib": 2.5}, "integer"),
                          ({"leave_mib": 143771}, "not less than GPU 0 .*'s total memory"),
                          ({"leave_mib": -1}, "leave_mib must be >= 0"),
                          ({}, "exactly one of mib"), ({"mib": 1, "leave_mib": 1}, "exactly one")):
        with pytest.raises(ValueError, match=match):
            devices.check_mib(entry, **kwargs)
    assert devices.check_duration(None) is None
    for bad in (0, -1, 0.0, float("nan"), float("inf"), True, "10"):
        with pytest.raises(ValueError, match="duration_s must be"):
            devices.check_duration(bad)
    with pytest.raises(ValueError, match="duration_s is required"):
        devices.check_duration(None, allow_none=False)


def test_no_nvml_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(devices.REPLAY_ENV, raising=False)
    if _nvml_here():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no GPU visible through NVML"):
        actions.start_memory_pressure(device=0, mib=64)
    with pytest.raises(RuntimeError, match="no GPU visible through NVML"):
        actions.trigger_xid(device=0)
    _no_gpu_faults_left()


def test_the_host_backend_runs_on_a_machine_without_a_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """backend="host" (host memory, a CPU core) runs where NVML sees no GPU, as the docs say:
    the same start, readiness and rollback paths (before round 22 both refused: "no GPU
    visible through NVML here"). Nothing is left running."""
    monkeypatch.delenv(devices.REPLAY_ENV, raising=False)
    if _nvml_here():
        pytest.skip("this machine has a GPU")
    pressure = actions.start_memory_pressure(mib=16, backend="host", tag="host-nogpu-p")
    contention = actions.start_compute_contention(backend="host", duration_s=30,
                                                  duty_cycle=0.2, tag="host-nogpu-c")
    try:
        assert pressure["held_mib"] == 16 and pressure["device"] == 0
        assert pressure["uuid"] is None and contention["uuid"] is None
        assert {w["tag"] for w in probes.gpu_faults()} >= {"host-nogpu-p", "host-nogpu-c"}
    finally:
        stopped = [actions.stop_gpu_fault(tag, grace_s=5) for tag in ("host-nogpu-p",
                                                                        "host-nogpu-c")]
    assert all(s["stopped"] for s in stopped), stopped
    for pid in (pressure["pid"], contention["pid"]):
        assert process_state(pid) in (None, "Z")
    with pytest.raises(ValueError, match="device must be a GPU index or UUID"):
        actions.start_memory_pressure(device="first", mib=16, backend="host")
    _no_gpu_faults_left()


def _nvml_here() -> bool:
    from chaosgpu.node import nvml_snapshot

    return bool(nvml_snapshot(with_processes=False).get("available"))


#: Every argument in seconds of the GPU faults, over LONGEST_WAIT_S: (activity, argument, call).
TOO_LONG = [
    ("start_memory_pressure", "duration_s",
     lambda: actions.start_memory_pressure(mib=64, backend="host", duration_s=2e9)),
    ("start_memory_pressure", "timeout_s",
     lambda: actions.start_memory_pressure(mib=64, backend="host", timeout_s=2e9)),
    ("start_compute_contention", "duration_s",
     lambda: actions.start_compute_contention(backend="host", duration_s=2e9)),
    ("start_compute_contention", "period_s",
     lambda: actions.start_compute_contention(backend="host", duration_s=5, period_s=2e9)),
    ("start_compute_contention", "timeout_s",
     lambda: actions.start_compute_contention(backend="host", timeout_s=2e9)),
    ("stop_gpu_fault", "grace_s", lambda: actions.stop_gpu_fault("x", grace_s=2e9)),
    ("stop_gpu_fault", "deadline_s", lambda: actions.stop_gpu_fault("x", deadline_s=2e9)),
    ("stop_all_gpu_faults", "grace_s", lambda: actions.stop_all_gpu_faults(grace_s=2e9)),
    ("stop_all_gpu_faults", "deadline_s", lambda: actions.stop_all_gpu_faults(deadline_s=2e9)),
    ("inject_rank_fault", "duration_s",
     lambda: actions.inject_rank_fault("gpu-hang", tag="x", duration_s=2e9)),
    ("inject_rank_fault", "timeout_s",
     lambda: actions.inject_rank_fault("gpu-hang", tag="x", timeout_s=2e9)),
    ("release_rank_fault", "timeout_s", lambda: actions.release_rank_fault(tag="x", timeout_s=2e9)),
    ("inject_cuda_fault", "timeout_s", lambda: actions.inject_cuda_fault(tag="x", timeout_s=2e9)),
    ("trigger_xid", "watch_s", lambda: actions.trigger_xid(watch_s=2e9)),
    ("trigger_xid", "timeout_s", lambda: actions.trigger_xid(timeout_s=2e9)),
]


@pytest.mark.parametrize("call, match", [
    (lambda: actions.start_memory_pressure(device=1, mib=64), "GPU 1 is out of range"),
    (lambda: actions.start_memory_pressure(device="GPU-nope", mib=64), "no GPU with UUID"),
    (lambda: actions.start_memory_pressure(mib=200000), "more than GPU 0"),
    (lambda: actions.start_memory_pressure(leave_mib=200000), "not less than"),
    (lambda: actions.start_memory_pressure(mib=64, duration_s=0),
     "start_memory_pressure: duration_s must be a number of seconds > 0, got 0"),
    (lambda: actions.start_memory_pressure(mib=64, duration_s=-5),
     "duration_s must be a number of seconds > 0"),
    (lambda: actions.start_memory_pressure(mib=64, backend="cuda"),
     "backend must be one of 'driver', 'host', got 'cuda'"),
    (lambda: actions.start_memory_pressure(leave_mib=64, backend="host"), "needs mib"),
    (lambda: actions.start_memory_pressure(mib=64, timeout_s=0),
     "timeout_s must be a number of seconds > 0"),
    (lambda: actions.start_memory_pressure(mib=64, tag="bad tag"), "invalid tag"),
    (lambda: actions.start_compute_contention(device=3), "GPU 3 is out of range"),
    (lambda: actions.start_compute_contention(duration_s=0),
     "duration_s must be a number of seconds > 0"),
    (lambda: actions.start_compute_contention(duration_s=None),
     "duration_s must be a number of seconds > 0, got None"),
    (lambda: actions.start_compute_contention(duty_cycle=0),
     r"duty_cycle must be a number in \(0, 1\], got 0"),
    (lambda: actions.start_compute_contention(duty_cycle=1.5),
     r"duty_cycle must be a number in \(0, 1\], got 1.5"),
    (lambda: actions.start_compute_contention(duration_s=1, period_s=2), "must not exceed"),
    (lambda: actions.start_compute_contention(target="tensor"),
     "target must be one of 'sm', 'memory', 'both', got 'tensor'"),
    (lambda: actions.trigger_xid(device=2), "GPU 2 is out of range"),
    (lambda: actions.trigger_xid(kind="ecc"),
     "kind must be one of 'illegal-address', 'trap', got 'ecc'"),
    (lambda: actions.trigger_xid(watch_s=-1), "watch_s must be a number of seconds >= 0"),
    (lambda: actions.stop_gpu_fault("x", grace_s=-1), "grace_s must be a number of seconds >= 0"),
    (lambda: actions.stop_gpu_fault("x", deadline_s=0),
     "deadline_s must be a number of seconds > 0"),
    *[(call, f"^{name}: {argument} must be at most 1e\\+09 s \\(the longest wait chaosgpu "
       f"makes\\), got 2000000000.0$") for name, argument, call in TOO_LONG],
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_input_is_refused_and_nothing_starts(replay: dict, call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
    _no_gpu_faults_left()


# ---------------------------------------------------------------------- programs, for real


def test_memory_pressure_host_backend_start_stop_and_idempotent(replay: dict) -> None:
    out = actions.start_memory_pressure(device=UUID, mib=32, backend="host", tag="press-t1")
    assert out["held_mib"] == 32 and out["device"] == 0 and out["uuid"] == UUID
    pid = out["pid"]
    record = state.read_record("workloads", "press-t1")
    assert record["kind"] == "memory-pressure" and record["processes"][0]["pid"] == pid
    proc = read_process(pid)
    assert proc is not None and proc["tag"] == "press-t1"
    listed = probes.gpu_faults()
    assert [w["tag"] for w in listed] == ["press-t1"] and listed[0]["alive"] == [pid]
    with pytest.raises(ValueError, match="already in use"):
        actions.start_memory_pressure(mib=8, backend="host", tag="press-t1")
    stopped = actions.stop_gpu_fault("press-t1", grace_s=5)
    assert stopped["processes"] == {str(pid): "exited on SIGTERM"}, stopped
    assert process_state(pid) in (None, "Z")
    assert actions.stop_gpu_fault("press-t1")["stopped"] is False  # this run met that tag
    with pytest.raises(ActivityError, match="this run never met that tag .* a typo"):
        actions.stop_gpu_fault("press-t1-typo")  # a typo'd rollback never reads as stopped
    assert actions.stop_gpu_fault("press-t1-typo", missing_ok=True)["stopped"] is False
    with pytest.raises(ValueError, match="tag must be a tag"):
        actions.stop_gpu_fault("press-t1 ")
    with pytest.raises(ValueError, match="not a GPU fault"):
        from chaosgpu.workloads.actions import start_holders, stop_workload

        start_holders(count=1, mib=1, via="host", tag="hold-not-gpu")
        try:
            actions.stop_gpu_fault("hold-not-gpu")
        finally:
            stop_workload("hold-not-gpu", grace_s=0)


def test_memory_pressure_ends_by_itself_after_its_duration(replay: dict) -> None:
    out = actions.start_memory_pressure(mib=8, backend="host", duration_s=1.0)
    deadline = time.monotonic() + 30
    while process_state(out["pid"]) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_state(out["pid"]) in (None, "Z")
    assert actions.stop_gpu_fault(out["tag"])["processes"] == {str(out["pid"]): "already gone"}


def test_driver_backend_without_a_gpu_fails_cleanly(replay: dict) -> None:
    if _nvml_here():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="did not start: .*no usable GPU"):
        actions.start_memory_pressure(mib=64, timeout_s=60)
    with pytest.raises(RuntimeError, match="did not start: .*no usable GPU"):
        actions.start_compute_contention(duration_s=5, timeout_s=60)
    with pytest.raises(RuntimeError, match="the XID program found no usable GPU"):
        actions.trigger_xid(device=0, watch_s=0, check=False)


def test_compute_contention_host_backend_keeps_its_duty_cycle(replay: dict) -> None:
    out = actions.start_compute_contention(duration_s=3.0, duty_cycle=0.5, period_s=0.2,
                                           backend="host", tag="cont-t1")
    assert out["ready"]["target"] == "sm" and out["ready"]["duty_cycle"] == 0.5
    deadline = time.monotonic() + 40
    while process_state(out["pid"]) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    stopped = actions.stop_gpu_fault("cont-t1")
    result = stopped["result"]
    assert result is not None and 0.3 <= result["achieved_duty_cycle"] <= 0.75, result
    assert result["periods"] >= 8 and not result["stopped_by_sigterm"]


def test_compute_contention_stops_at_once_on_rollback(replay: dict) -> None:
    out = actions.start_compute_contention(duration_s=120.0, backend="host")
    started = time.monotonic()
    stopped = actions.stop_gpu_fault(out["tag"], grace_s=5)
    assert time.monotonic() - started < 5.0
    assert stopped["processes"] == {str(out["pid"]): "exited on SIGTERM"}
    assert stopped["result"]["stopped_by_sigterm"] is True


def test_a_stop_with_a_grace_longer_than_one_poll_can_take(replay: dict) -> None:
    # A grace of 3e6 s (more than poll(2)'s 24.8 days, less than LONGEST_WAIT_S) is accepted
    # and ends at the exit; it once sent SIGTERM, then raised OverflowError. A grace over
    # LONGEST_WAIT_S is refused by name, the holder left as it was.
    out = actions.start_memory_pressure(mib=8, backend="host", tag="press-long")
    with pytest.raises(ValueError, match=r"^stop_gpu_fault: grace_s must be at most 1e\+09 s"):
        actions.stop_gpu_fault("press-long", grace_s=2e9)
    assert process_state(out["pid"]) == "S"
    assert state.read_record("workloads", "press-long") is not None
    started = time.monotonic()
    stopped = actions.stop_gpu_fault("press-long", grace_s=3e6, deadline_s=3e6)
    assert time.monotonic() - started < 5.0
    assert stopped["processes"] == {str(out["pid"]): "exited on SIGTERM"}, stopped


def test_duty_cycle_schedule_on_a_simulated_clock() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    def work(until: float) -> int:
        units = 0
        while now[0] < until:
            now[0] += 0.005
            units += 1
        return units

    result = run_duty_cycle(work, 0.25, 0.1, 2.0, lambda: False, clock=clock, sleep=sleep)
    assert result["periods"] == 20
    assert result["achieved_duty_cycle"] == pytest.approx(0.25, abs=0.03)
    stop_after = iter([False] * 3 + [True] * 100)
    short = run_duty_cycle(work, 1.0, 0.1, 10.0, lambda: next(stop_after), clock=clock,
                           sleep=sleep)
    assert short["periods"] <= 3


def test_cleanup_removes_a_fault_left_by_a_crashed_runner(replay: dict, tmp_path: Path) -> None:
    script = (
        "import os\n"
        "from chaosgpu.gpu import actions\n"
        "out = actions.start_memory_pressure(mib=16, backend='host', tag='press-crash')\n"
        "print(out['pid'], flush=True)\n"
        "os._exit(9)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert done.returncode == 9, done.stderr
    pid = int(done.stdout.split()[0])
    assert process_state(pid) not in (None, "Z"), "the holder should outlive its runner"
    from chaosgpu.cleanup import cleanup_all

    report = cleanup_all(grace_s=2)
    assert any(r["kind"] == "workload" and r["name"] == "press-crash" for r in report["removed"])
    deadline = time.monotonic() + 10
    while process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_state(pid) in (None, "Z")


def test_pressure_program_refuses_bad_arguments() -> None:
    base = [sys.executable, "-m", "chaosgpu.gpu", "pressure", "--ready-file", "/nonexistent/x"]
    for extra, code in ((["--mib", "0"], 2), (["--leave-mib", "-1"], 2),
                        (["--leave-mib", "5", "--backend", "host"], 2),
                        (["--mib", "5", "--chunk-mib", "1"], 2),
                        (["--mib", "5", "--duration-s", "-1"], 2)):
        done = subprocess.run(base + extra, capture_output=True, text=True, timeout=60)
        assert done.returncode == code, (extra, done.stderr)
    done = subprocess.run(base + ["--mib", "5", "--duration-s", "2e9"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--duration-s: must be at most 1e+09 s" in done.stderr
    contention = [sys.executable, "-m", "chaosgpu.gpu", "contention", "--ready-file",
                  "/nonexistent/x"]
    for extra, words in ((["--duration-s", "0"], "--duration-s: must be a number of seconds > 0"),
                         (["--duration-s", "2e9"], "--duration-s: must be at most 1e+09 s"),
                         (["--duration-s", "5", "--period-s", "2e9"],
                          "--period-s: must be at most 1e+09 s"),
                         (["--duration-s", "5", "--period-s", "nan"], "--period-s: must be"),
                         (["--duration-s", "5", "--duty-cycle", "1.5"],
                          "--duty-cycle: must be a number in (0, 1]")):
        done = subprocess.run(contention + extra, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr, (extra, done.stderr)
    done = subprocess.run([sys.executable, "-m", "chaosgpu.gpu", "nothing"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "usage" in done.stderr


# ------------------------------------------------------------------ monitor logic, on values


def test_progress_rates_name_stalled_ranks_and_stragglers() -> None:
    before = {0: {"iteration": 100}, 1: {"iteration": 100}, 2: {"iteration": 100}}
    after = {0: {"iteration": 120}, 1: {"iteration": 104}, 2: {"iteration": 121, "ooms": 2}}
    rates = monitor.progress_rates(before, after, 2.0)
    assert rates["ranks"]["0"]["rate_per_s"] == 10.0 and rates["straggler_rank"] == 1
    assert rates["progressing"] is True and rates["ranks"]["2"]["ooms"] == 2
    stuck = monitor.progress_rates(before, {0: {"iteration": 100}, 1: {"iteration": 130},
                                            2: {"iteration": 130}}, 2.0)
    assert stuck["stalled_ranks"] == [0] and stuck["progressing"] is False
    missing = monitor.progress_rates(before, {0: {"iteration": 110}}, 1.0)
    assert missing["progressing"] is False and missing["ranks"]["1"]["rate_per_s"] is None


def test_utilization_summary_and_oom_lines() -> None:
    readings = [{"t": 10.0 + i, "gpu_pct": p, "memory_pct": m}
                for i, (p, m) in enumerate([(0, 0), (100, 40), (100, 60), (50, 10)])]
    summary = monitor.summarize_utilization(readings)
    assert summary["gpu_pct"] == {"mean": 62.5, "min": 0.0, "max": 100.0}
    assert summary["busy_share"] == 0.5 and summary["series"]["t"] == [0.0, 1.0, 2.0, 3.0]
    text = ("step 1\nrank 1: CUDA out of memory at iteration 7 (1 so far): "
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\nok\n"
            "RuntimeError: CUDA error: out of memory\ncudaErrorMemoryAllocation\n")
    lines = monitor.oom_lines(text)
    assert len(lines) == 2 and lines[0].startswith("rank 1: CUDA out of memory")


def test_cuda_oom_seen_reads_the_injector_marks_of_a_tag(tmp_path: Path) -> None:
    folder = injector.inject_dir()
    mark = folder / "1-2-3.oom.jsonl"
    mark.write_text(json.dumps({"t": 1.0, "device": 0, "requested": 1 << 30, "tag": "victim-a",
                                "rank": "1"}) + "\n" + json.dumps({"t": 2.0, "tag": "other"}) +
                    "\n")
    try:
        seen = probes.cuda_oom_seen("victim-a")
        assert seen["seen"] is True and len(seen["torch_observer"]) == 1
        with pytest.raises(ValueError, match="never met that tag"):
            probes.cuda_oom_seen("nobody")  # a typo never reads as "no OOM"
        assert probes.cuda_oom_seen("nobody", missing_ok=True)["seen"] is False
    finally:
        mark.unlink()
    with pytest.raises(ValueError, match="tag must be a tag: a non-empty string"):
        probes.cuda_oom_seen("")
    with pytest.raises(ValueError, match="no chaosgpu ring workload tagged"):
        probes.job_progress("nobody", window_s=0.1)
    with pytest.raises(ValueError, match="never met that tag"):
        probes.job_stalled("nobody", window_s=0.1)  # a typo never reads as "not stalled"
    assert probes.job_stalled("nobody", window_s=0.1, missing_ok=True) is False


# ------------------------------------------------------------- the CUDA injection library


@pytest.fixture(scope="module")
def cuda_library() -> Path:
    if find_tool("gcc") is None and find_tool("cc") is None:
        pytest.skip("missing tool: gcc (apt-get install gcc)")
    return cudainject.build()  # a failed build fails the tests that need it


def test_cuda_library_builds_and_its_key_matches_chaosgpu(cuda_library: Path) -> None:
    lib = ctypes.CDLL(str(cuda_library))
    buffer = ctypes.create_string_buffer(128)
    assert lib.chaosgpu_inject_key(buffer, 128) == 0
    own = read_process(os.getpid())
    assert own is not None and buffer.value.decode() == injector.process_key(own)
    assert cudainject.build() == cuda_library  # cached by the source's hash
    what, ident, count = ctypes.create_string_buffer(16), ctypes.create_string_buffer(64), \
        ctypes.c_int(0)
    assert lib.chaosgpu_inject_parse(b"alloc 3 abc-1", what, ctypes.byref(count), ident) == 0
    assert (what.value, count.value, ident.value) == (b"alloc", 3, b"abc-1")
    assert lib.chaosgpu_inject_parse(b"launch 1", what, ctypes.byref(count), ident) == 0
    assert ident.value == b"noid"
    for bad, code in ((b"free 1 x", -2), (b"alloc 0 x", -3), (b"alloc 2 a/b", -4), (b"", -1)):
        assert lib.chaosgpu_inject_parse(bad, what, ctypes.byref(count), ident) == code


def test_cuda_library_without_cupti_or_dir_is_not_armed(cuda_library: Path,
                                                        tmp_path: Path) -> None:
    call = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "print(lib.InitializeInjection())")
    env = {k: v for k, v in os.environ.items() if k != "CHAOSGPU_INJECT_DIR"}
    done = subprocess.run([sys.executable, "-c", call, str(cuda_library)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "1" and "not armed" in done.stderr
    env.update(CHAOSGPU_INJECT_DIR=str(tmp_path), CHAOSGPU_CUPTI_LIBRARY="/nonexistent.so",
               LD_LIBRARY_PATH="/nonexistent")
    done = subprocess.run([sys.executable, "-c", call, str(cuda_library)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    armed = [json.loads(p.read_text()) for p in tmp_path.glob("*.cuda-armed")]
    assert len(armed) == 1 and armed[0]["state"] == "not armed"
    assert "libcupti" in armed[0]["error"] or armed[0]["error"]


def test_every_ptx_kernel_compiles_for_hopper() -> None:
    """The PTX the fault programs and the injector load compiles for sm_90 (ptxas from triton's
    wheel where it is installed; the driver compiles the same text at load time)."""
    import glob
    import importlib.util

    from chaosgpu.gpu import driver

    found = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "triton",
                                   "backends", "nvidia", "bin", "ptxas"))
    if not found:
        pytest.skip("no ptxas here")
    spec = importlib.util.spec_from_file_location(
        "injector_ptx", injector.SITE_DIR / "chaosgpu_injector.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, ptx in (("spin", driver.PTX_SPIN), ("bad_write", driver.PTX_BAD_WRITE),
                      ("trap", driver.PTX_TRAP), ("fill", driver.PTX_FILL),
                      ("hang", module.HANG_PTX)):
        source = Path(os.environ.get("TMPDIR", "/tmp")) / f"chaosgpu-{name}-{os.getpid()}.ptx"
        source.write_text(ptx)
        try:
            done = subprocess.run([found[0], "-arch=sm_90", str(source), "-o",
                                   str(source.with_suffix(".cubin"))], capture_output=True,
                                  text=True, timeout=60)
        finally:
            source.unlink()
            source.with_suffix(".cubin").unlink(missing_ok=True)
        assert done.returncode == 0, (name, done.stderr)


def test_recorded_h200_readings_read_as_the_faults_they_were() -> None:
    """Readings recorded on the H200 (tests/data/nvml_h200_gpu_faults.json) fed to the logic:
    a GPU-hung rank and SM contention read as a device 100 % busy, memory copies at a 0.5 duty
    cycle as a partly busy memory controller, and the XIDs as what they are."""
    data = json.loads((DATA / "nvml_h200_gpu_faults.json").read_text())
    hung = monitor.summarize_utilization(data["utilization_gpu_hang"])
    assert hung["gpu_pct"]["min"] == 100 and hung["busy_share"] == 1.0
    loaded = monitor.summarize_utilization(data["utilization_sm_contention"])
    assert loaded["busy_share"] == 1.0 and loaded["memory_pct"]["max"] < 20
    copies = monitor.summarize_utilization(data["utilization_memory_contention_duty_0_5"])
    assert 0 < copies["busy_share"] < 1 and copies["memory_pct"]["max"] > copies["gpu_pct"]["min"]
    assert data["memory_contention_result"]["copy_gb_per_s"] > 1000
    illegal = monitor.describe_xids(data["xid_illegal_address"]["xids"])
    assert [x["xid"] for x in illegal] == [31] and "page fault" in illegal[0]["meaning"]
    trap = monitor.describe_xids(data["xid_trap"]["xids"], after=0.0)
    assert [x["xid"] for x in trap] == [43] and "stopped processing" in trap[0]["meaning"]
    assert monitor.describe_xids(trap, after=trap[0]["t"] + 1) == []
    assert monitor.describe_xids([{"t": 1.0, "xid": 999}])[0]["meaning"] == \
        "not in chaosgpu's list"


def test_memory_pressure_inside_a_local_pod(replay: dict) -> None:
    """The holder can run inside a local pod (its own PID namespace), recorded by host PID."""
    import uuid

    from chaosgpu.sandbox import actions as sandbox

    name = f"presspod{uuid.uuid4().hex[:6]}"
    sandbox.create_sandbox(name=name, init="sleep", grace_s=1.0)
    try:
        out = actions.start_memory_pressure(mib=16, backend="host", sandbox=name,
                                            tag="press-pod")
        record = state.read_record("workloads", "press-pod")
        entry = record["processes"][0]
        assert entry["pid"] == out["pid"] and entry["ns_pid"] not in (None, out["pid"])
        proc = read_process(out["pid"])
        assert proc is not None and proc["env"].get("CHAOSGPU_SANDBOX") == name
        stopped = actions.stop_gpu_fault("press-pod", grace_s=5)
        assert stopped["processes"] == {str(out["pid"]): "exited on SIGTERM"}, stopped
    finally:
        sandbox.remove_sandbox(name=name)
    with pytest.raises(ValueError, match="no sandbox named"):
        actions.start_memory_pressure(mib=16, backend="host", sandbox="no-such-pod")
