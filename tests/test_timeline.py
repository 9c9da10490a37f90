"""The timeline sampler and its measurement probes: real processes on the host-rss source, a
scripted NVML (the only fake) for exact figures, errors, and a real GPU run (marked gpu)."""

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from census_helpers import LEADER_EXITS

import chaosgpu.node as node
from chaosgpu.scope import ScopeError
from chaosgpu.timeline import probes
from chaosgpu.timeline.sampler import Sampler, current, install, uninstall

HOLD_64 = "import time; x = bytearray(64 * 2**20); x[::4096] = b'x' * len(x[::4096]); " \
          "time.sleep(60)"


@pytest.fixture
def sampler_cleanup() -> Iterator[list[Sampler]]:
    made: list[Sampler] = []
    yield made
    for sampler in made:
        sampler.stop()
        uninstall(sampler)


def _start(tag: str, code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, CHAOSGPU_TAG=tag),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_all_gone(sampler: Sampler, timeout_s: float) -> None:
    """Wait until every process the sampler saw is labelled gone (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            e["states"][-1][1] != "gone" for e in sampler.processes.values()):
        time.sleep(0.05)


def _kill_and_reap(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_host_rss_timeline_tracks_memory_release_and_states(
        sampler_cleanup: list[Sampler]) -> None:
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    sampler = Sampler(rate_hz=200, scope={"tag": tag}, source="host-rss", rescan_s=0.05)
    sampler_cleanup.append(sampler)
    sampler.start()
    install(sampler)
    base = sampler.take_baseline()
    assert base["total_mib"] == 0.0 and base["source"] == "host-rss"
    sampler.mark("start-hold", "start")
    proc = _start(tag, HOLD_64)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not sampler.total or sampler.total[-1] < 64):
            time.sleep(0.02)
        assert sampler.total[-1] >= 64
        sampler.mark("start-hold", "end")
        time.sleep(0.5)
        sampler.mark("kill", "start")
        os.kill(proc.pid, signal.SIGKILL)
        sampler.mark("kill", "end")
        release = probes.memory_release_time(after_event="kill", threshold_mib=4, timeout_s=5)
        assert release is not None and release < 0.5
        held = probes.gb_seconds_held(from_event="start-hold", to_event="kill")
        assert 0.5 * 64 / 1024 * 0.5 < held < 64 / 1024 * 30
        proc.wait()
        timings = probes.termination_timings(after_event="kill", timeout_s=5)
        entry = timings["processes"][str(proc.pid)]
        assert entry["dead_after_s"] is not None and entry["dead_after_s"] < 0.5  # every sample
        assert probes.residual_gpu_memory(tolerance_mib=4, timeout_s=2) <= 4
        assert probes.gpu_memory_at_baseline(tolerance_mib=4, timeout_s=2) is True
    finally:
        proc.kill()
        proc.wait()
    sampler.stop()
    summary = sampler.summary()
    assert summary["rate_hz"] > 100  # asked 200
    assert summary["overhead_cpu_pct"] is not None
    assert set(sampler.measurements) >= {"memory_release_time", "gb_seconds_held",
                                         "termination_timings", "residual_gpu_memory"}
    document = sampler.to_dict()
    assert document["source"] == "host-rss" and str(proc.pid) in document["processes"]


class ScriptedNvml:
    """NVML replaced by a script: 615 MiB idle, +2048 MiB between two instants."""

    def __init__(self, query_s: float = 0.0) -> None:
        self.held_from: float | None = None
        self.held_until: float | None = None
        self.query_s = query_s  # each query blocks this long (the H200 with 100 contexts)

    def used(self) -> float:
        now = time.monotonic()
        if self.held_from is not None and now >= self.held_from and (
                self.held_until is None or now < self.held_until):
            return 615.0 + 2048.0
        return 615.0

    def device_memory(self) -> list[dict[str, Any]]:
        time.sleep(self.query_s)
        return [{"index": 0, "used_mib": self.used(), "total_mib": 143771.0}]

    def gpu_processes(self) -> list[dict[str, Any]]:
        time.sleep(self.query_s)
        return [{"gpu_index": 0, "pid": 4242, "used_mib": self.used() - 615.0}]


def test_scripted_nvml_gives_exact_figures(monkeypatch: pytest.MonkeyPatch,
                                           sampler_cleanup: list[Sampler]) -> None:
    nvml = ScriptedNvml()
    monkeypatch.setattr(node, "nvml_device_memory", nvml.device_memory)
    monkeypatch.setattr(node, "nvml_gpu_processes", nvml.gpu_processes)
    sampler = Sampler(rate_hz=200, process_every=5)
    sampler_cleanup.append(sampler)
    sampler.start()
    install(sampler)
    assert sampler.source == "nvml"
    assert probes.baseline_memory()["total_mib"] == 615.0
    sampler.mark("alloc", "start")
    nvml.held_from = time.monotonic()
    time.sleep(1.0)
    sampler.mark("delete", "start")
    time.sleep(0.3)
    nvml.held_until = time.monotonic()
    sampler.mark("delete", "end")
    release = probes.memory_release_time(after_event="delete", threshold_mib=64, timeout_s=2)
    # the release follows the drop by at most a few samples (5 ms each; a loaded machine can
    # delay the sampler's thread: the bound is for correctness, not speed)
    assert release is not None and 0.25 < release < 0.5, release
    held = probes.gb_seconds_held(from_event="alloc", to_event="delete")
    held_s = nvml.held_until - nvml.held_from  # ~1.3 s; longer when the sleeps overshoot
    assert abs(held - 2.0 * held_s) < 2.0 * 0.1, (held, held_s)  # 2 GiB, sampled every 5 ms
    assert probes.residual_gpu_memory(tolerance_mib=1, timeout_s=1) == 0.0
    sampler.stop()
    document = sampler.to_dict()
    assert document["devices"][0]["index"] == 0
    assert "4242" in document["processes"]
    assert max(document["processes"]["4242"]["mib"]) == 2048.0


def test_probes_need_the_control_and_valid_input(sampler_cleanup: list[Sampler]) -> None:
    previous = current()
    if previous is not None:
        uninstall(previous)
    with pytest.raises(RuntimeError, match="chaosgpu.timeline.control"):
        probes.baseline_memory()
    with pytest.raises(ValueError, match="rate_hz"):
        Sampler(rate_hz=0)
    with pytest.raises(ValueError, match="source"):
        Sampler(source="magic")
    with pytest.raises(ValueError, match="declare a scope"):
        Sampler(scope={})
    sampler = Sampler(rate_hz=100, source="host-rss")
    sampler_cleanup.append(sampler)
    sampler.start()
    install(sampler)
    with pytest.raises(ValueError, match="no event 'nope'"):
        probes.memory_release_time(after_event="nope")
    assert probes.memory_release_time(after_event="nope", missing_ok=True) == 0.0
    with pytest.raises(TypeError, match="from_event"):
        probes.gb_seconds_held()  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="from_event must be a non-empty string"):
        probes.gb_seconds_held(from_event="")
    with pytest.raises(ValueError, match="phase"):
        probes.termination_timings(after_event="x", phase="middle")


@pytest.mark.gpu
def test_gpu_release_after_kill_on_a_real_gpu(sampler_cleanup: list[Sampler]) -> None:
    from chaosgpu.workloads.actions import start_holders, stop_workload

    tag = f"tl-gpu-{uuid.uuid4().hex[:8]}"
    # a GPU process of an earlier test may still be torn down by the driver: the baseline is
    # taken once NVML lists none
    deadline = time.monotonic() + 60
    while node.nvml_gpu_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not node.nvml_gpu_processes(), "GPU processes left by an earlier test"
    sampler = Sampler(rate_hz=200, scope={"tag": tag})
    sampler_cleanup.append(sampler)
    sampler.start()
    install(sampler)
    assert sampler.source == "nvml"
    sampler.take_baseline()
    try:
        sampler.mark("start", "start")
        started = start_holders(count=1, mib=1024, via="auto", tag=tag, timeout_s=120)
        sampler.mark("start", "end")
        time.sleep(0.5)
        sampler.mark("kill", "start")
        for pid in started["pids"]:
            os.kill(pid, signal.SIGKILL)
        sampler.mark("kill", "end")
        release = probes.memory_release_time(after_event="kill", threshold_mib=64, timeout_s=10)
        assert release is not None and release < 2.0
        assert probes.gb_seconds_held(from_event="start", to_event="kill") > 0.4
        assert probes.residual_gpu_memory(tolerance_mib=64, timeout_s=5) <= 64
    finally:
        stop_workload(tag, grace_s=0)


def test_exits_come_from_pidfds_not_per_tick_proc_reads(monkeypatch: pytest.MonkeyPatch,
                                                        sampler_cleanup: list[Sampler]) -> None:
    """30 real tagged processes, SIGKILLed while sampling at 100 Hz: every exit is recorded,
    and the tracked processes' stat is read at the (cost-spaced) sweeps and on exit only, not
    at every tick."""
    nvml = ScriptedNvml()
    monkeypatch.setattr(node, "nvml_device_memory", nvml.device_memory)
    monkeypatch.setattr(node, "nvml_gpu_processes", nvml.gpu_processes)
    reads = []
    real_state = node.process_state

    def counted(pid: int, proc_root: str = "/proc", starttime: int | None = None,
                fd: int | None = None) -> str | None:
        reads.append(pid)
        return real_state(pid, proc_root, starttime=starttime, fd=fd)

    monkeypatch.setattr(node, "process_state", counted)
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    switch = sys.getswitchinterval()
    procs = [_start(tag, "import time; time.sleep(60)") for _ in range(30)]
    try:
        sampler = Sampler(rate_hz=100, process_every=20, scope={"tag": tag}, rescan_s=0.2)
        sampler_cleanup.append(sampler)
        deadline = time.monotonic() + 20
        sampler.start()
        while len(sampler._tracked) < 30 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sampler._tracked) == 30
        time.sleep(0.5)
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
        _wait_all_gone(sampler, 10)
        sampler.stop()
    finally:
        _kill_and_reap(procs)
    ticks = len(sampler.t)
    assert all(e["states"][-1][1] == "gone" for e in sampler.processes.values())
    assert len(sampler.processes) == 30
    # every tick reading every tracked process would be ticks * 30 reads
    assert ticks > 50 and len(reads) < ticks * 30 / 5, (len(reads), ticks)
    assert sys.getswitchinterval() == switch  # given back at stop()


def test_a_process_without_a_start_time_is_not_tracked() -> None:
    """Fail closed: no start time, no pidfd (a PID alone may be a reused one)."""
    proc = subprocess.Popen(["sleep", "30"])
    try:
        sampler = Sampler(rate_hz=10, source="host-rss")
        assert sampler._open_pidfd(proc.pid, None) is None
        wrong = sampler._node.process_starttime(proc.pid) + 1
        assert sampler._open_pidfd(proc.pid, wrong) is None
        fd = sampler._open_pidfd(proc.pid, sampler._node.process_starttime(proc.pid))
        assert fd is not None
        os.close(fd)
    finally:
        proc.kill()
        proc.wait()


def test_a_blocked_nvml_query_does_not_delay_the_exits(monkeypatch: pytest.MonkeyPatch,
                                                      sampler_cleanup: list[Sampler]) -> None:
    """NVML's queries block 400 ms each (on the H200 they took 180-230 ms while 100 contexts
    started, over a second while they were torn down): real tagged processes' exits are still
    stamped when they happen (the exit thread waits in poll(), not behind NVML), and a zombie
    left unreaped for a second does not make that thread spin."""
    nvml = ScriptedNvml(query_s=0.4)
    monkeypatch.setattr(node, "nvml_device_memory", nvml.device_memory)
    monkeypatch.setattr(node, "nvml_gpu_processes", nvml.gpu_processes)
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    procs = [_start(tag, "import time; time.sleep(60)") for _ in range(3)]
    try:
        sampler = Sampler(rate_hz=100, process_every=5, scope={"tag": tag}, rescan_s=0.2)
        sampler_cleanup.append(sampler)
        sampler.start()
        deadline = time.monotonic() + 20
        while len(sampler._tracked) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sampler._tracked) == 3
        time.sleep(0.5)
        killed_at = {}
        for proc in procs:
            killed_at[proc.pid] = sampler.now()  # before the kill: the exit thread may stamp
            proc.kill()  # it before this thread runs again; not reaped yet: a zombie
            time.sleep(0.13)
        cpu_before, wall_before = time.process_time(), time.monotonic()
        time.sleep(1.0)
        spent = (time.process_time() - cpu_before) / (time.monotonic() - wall_before)
        for proc in procs:
            proc.wait()
        _wait_all_gone(sampler, 5)
        sampler.stop()
    finally:
        _kill_and_reap(procs)
    summary = sampler.summary()
    assert summary["rate_hz"] is not None and summary["rate_hz"] < 5  # memory: behind NVML
    for pid, at in killed_at.items():
        states = sampler.processes[pid]["states"]
        seen = next(t for t, label in states if label in ("Z", "gone"))
        assert 0 <= seen - at < 0.35, (pid, at, states)  # not 400 ms behind a query
        assert states[-1][1] == "gone"
    assert spent < 0.3, spent  # no spinning on a readable pidfd while the zombie waits



def test_a_zombie_leader_with_live_threads_is_exiting_not_dead(
        sampler_cleanup: list[Sampler]) -> None:
    """A process whose main thread ended while another thread runs shows state Z in
    /proc/PID/stat (as a CUDA process does while the driver tears its context down), but its
    pidfd is not readable: the timeline labels it "exiting" and keeps tracking it; it is dead
    (Z, then gone) only once its last thread ends."""
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    proc = _start(tag, LEADER_EXITS)
    try:
        sampler = Sampler(rate_hz=100, process_every=2, scope={"tag": tag}, rescan_s=0.1,
                          source="host-rss")
        sampler_cleanup.append(sampler)
        sampler.start()
        install(sampler)
        deadline = time.monotonic() + 10
        while proc.pid not in sampler._tracked and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.pid in sampler._tracked
        while node.process_state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert node.process_state(proc.pid) == "Z"  # the leader only
        time.sleep(0.3)
        labels = [label for _, label in sampler.processes[proc.pid]["states"]]
        assert labels[-1] == "exiting" and "Z" not in labels and "gone" not in labels, labels
        assert proc.pid in sampler._tracked
        sampler.mark("kill", "start")
        proc.kill()  # the last thread ends: now the process is dead
        proc.wait()
        timings = probes.termination_timings(after_event="kill", timeout_s=5)
        assert timings["processes"][str(proc.pid)]["dead_after_s"] is not None
        _wait_all_gone(sampler, 5)  # dead (Z or X) first, gone at the next sweep
        assert sampler.processes[proc.pid]["states"][-1][1] == "gone"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_costly_process_list_waits_while_memory_is_steady_and_not_when_it_moves(
        monkeypatch: pytest.MonkeyPatch, sampler_cleanup: list[Sampler]) -> None:
    """NVML's process list burning 20 ms of CPU a call (the H200 with 100 CUDA contexts) is
    spaced to keep its cost down: up to STEADY_SPACING_S while device memory stays where it was
    at the last listing, but read again within MAX_SPACING_S once it moves (a process starting
    or freeing on the GPU), so its memory is not missing for seconds."""
    from chaosgpu.timeline import sampler as sampler_module

    nvml = ScriptedNvml()

    def costly() -> list[dict[str, Any]]:
        end = time.thread_time() + 0.02
        while time.thread_time() < end:
            pass
        return nvml.gpu_processes()

    monkeypatch.setattr(node, "nvml_device_memory", nvml.device_memory)
    monkeypatch.setattr(node, "nvml_gpu_processes", costly)
    # a tagged process started on this node meanwhile (by anyone) would be tracked, and a newly
    # tracked process is listed at once: this test tracks none, so only memory moves list
    monkeypatch.setattr(Sampler, "_matches", lambda self, record: False)
    sampler = Sampler(rate_hz=100, process_every=5)
    sampler_cleanup.append(sampler)
    sampler.start()
    time.sleep(2.5)  # steady: one list at the start; every 50 ms unspaced, every 1 s before
    listed = sampler.processes[4242]
    assert len(listed["t"]) == 1, listed["t"]
    moved_at = sampler.now()
    nvml.held_from = time.monotonic()  # 2 GiB more on the GPU
    deadline = time.monotonic() + 10
    while listed["mib"][-1] != 2048.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listed["mib"][-1] == 2048.0
    assert listed["t"][-1] - moved_at <= sampler_module.MAX_SPACING_S + 0.5, listed["t"]
    freed_at = sampler.now()
    nvml.held_until = time.monotonic()
    while listed["mib"][-1] != 0.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listed["mib"][-1] == 0.0
    assert listed["t"][-1] - freed_at <= sampler_module.MAX_SPACING_S + 0.5, listed["t"]
    sampler.stop()
    assert len(listed["t"]) == 3, listed["t"]  # nothing read while steady in between
    assert sampler_module.STEADY_SPACING_S >= 5 * sampler_module.MAX_SPACING_S


def test_proc_is_listed_again_only_after_the_kernel_allocated_a_pid(
        monkeypatch: pytest.MonkeyPatch, sampler_cleanup: list[Sampler]) -> None:
    """The search for new processes lists /proc only when /proc/loadavg's last PID moved since
    the last listing (or a process seen young is due for its second look): a quiet node costs
    one small read per search, not a listing. A process started afterwards is still found."""
    listings: list[float] = []
    hints: list[int] = []
    real_list, real_last = node.list_pids, node.last_pid

    def counted_list(proc_root: str = "/proc") -> list[int]:
        listings.append(time.monotonic())
        return real_list(proc_root)

    def recorded_last(proc_root: str = "/proc") -> int:
        hints.append(real_last(proc_root))
        return hints[-1]

    monkeypatch.setattr(node, "list_pids", counted_list)
    monkeypatch.setattr(node, "last_pid", recorded_last)
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    sampler = Sampler(rate_hz=50, scope={"tag": tag}, source="host-rss", rescan_s=0.05)
    sampler_cleanup.append(sampler)
    sampler.start()
    deadline = time.monotonic() + 40  # searches are 50 ms apart once the first listings,
    # which read every process, are spaced by their cost (seconds on a loaded machine); and a
    # second after the last process seen young (another process of this machine, the test
    # runner itself when it just started) had its second look, for a quiet second to be seen
    while (len(hints) < 30 or time.monotonic() < sampler._young_until + 1.0) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    searches = len(hints)
    moves = sum(1 for before, after in zip(hints, hints[1:], strict=False) if after != before)
    assert searches >= 30, searches  # the hint was read at every search
    # listed at the start, once more when the sampler's own threads took PIDs, then only when
    # the kernel allocated one (another process on this machine forking); listings while a
    # process seen young was due for its second look are the other reason, and end with it
    late = [t for t in listings if t > sampler._young_until]
    assert len(late) <= moves + 2, (len(listings), len(late), moves, searches)
    proc = _start(tag, "import time; time.sleep(60)")
    try:
        deadline = time.monotonic() + 5
        while proc.pid not in sampler._tracked and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.pid in sampler._tracked
    finally:
        _kill_and_reap([proc])
    _wait_all_gone(sampler, 5)
    sampler.stop()
    assert proc.pid in sampler.processes and not sampler._tracked


def test_after_an_activity_states_are_read_at_once_whatever_the_sweep_spacing(
        sampler_cleanup: list[Sampler]) -> None:
    """States of processes no fault touched are swept at most every SWEEP_SPACING_S; after an
    activity (the control asks for a rescan) they are read at once: a rank stopped by the
    activity shows T within a fraction of a second."""
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    proc = _start(tag, "import time; time.sleep(60)")
    try:
        # 10 Hz, states every 20 periods: the sweep is 2 s apart
        sampler = Sampler(rate_hz=10, process_every=20, scope={"tag": tag}, source="host-rss")
        sampler_cleanup.append(sampler)
        sampler.start()
        assert proc.pid in sampler._tracked
        time.sleep(0.3)  # past the first sweep
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5  # the activity ends when the kernel shows it stopped
        while node.process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.005)
        stopped_at = sampler.now()
        sampler.request_rescan()
        states = sampler.processes[proc.pid]["states"]
        deadline = time.monotonic() + 1.5
        while states[-1][1] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert states[-1][1] == "T", states
        assert states[-1][0] - stopped_at < 0.5, states
        os.kill(proc.pid, signal.SIGCONT)
    finally:
        _kill_and_reap([proc])
    _wait_all_gone(sampler, 5)
    sampler.stop()
    assert sampler.processes[proc.pid]["states"][-1][1] == "gone"


def test_the_gpu_list_is_read_when_a_tracked_process_starts_though_memory_is_steady(
        monkeypatch: pytest.MonkeyPatch, sampler_cleanup: list[Sampler]) -> None:
    """A tracked process that starts using less than LIST_ON_CHANGE_MIB (an MPS client, a small
    context) does not move device memory enough to ask for the list: its start does. Its memory
    is listed within a second of being found, not after STEADY_SPACING_S."""
    from chaosgpu.timeline import sampler as sampler_module

    tag = f"tl-{uuid.uuid4().hex[:8]}"
    started: list[int] = []

    def memory() -> list[dict[str, Any]]:
        return [{"index": 0, "used_mib": 615.0 + 8.0 * len(started), "total_mib": 143771.0}]

    def processes() -> list[dict[str, Any]]:
        return [{"gpu_index": 0, "pid": pid, "used_mib": 8.0} for pid in started]

    monkeypatch.setattr(node, "nvml_device_memory", memory)
    monkeypatch.setattr(node, "nvml_gpu_processes", processes)
    sampler = Sampler(rate_hz=100, process_every=5, scope={"tag": tag}, rescan_s=0.1)
    sampler_cleanup.append(sampler)
    sampler.start()
    time.sleep(1.5)  # the first list is read; memory then stays steady
    proc = _start(tag, "import time; time.sleep(60)")
    started.append(proc.pid)
    try:
        deadline = time.monotonic() + 10
        while (proc.pid not in sampler.processes or not sampler.processes[proc.pid]["mib"]) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        entry = sampler.processes[proc.pid]
        assert entry["mib"] == [8.0], entry
        found_at = entry["states"][0][0]
        assert entry["t"][0] - found_at <= sampler_module.MAX_SPACING_S + 0.5, entry
        assert sampler_module.STEADY_SPACING_S > 5 * (sampler_module.MAX_SPACING_S + 0.5)
    finally:
        _kill_and_reap([proc])
    _wait_all_gone(sampler, 5)
    sampler.stop()


def test_a_pid_the_kernel_allocated_again_is_examined_anew(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A PID seen before (and judged not in scope) that the kernel allocated again since the
    last listing belongs to another process: it is examined anew, and tracked when it matches.
    The kernel's PID reuse cannot be arranged here: the last PID is scripted, the processes
    and /proc are real."""
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    proc = _start(tag, "import time; time.sleep(60)")
    hint = [proc.pid - 10]
    monkeypatch.setattr(node, "last_pid", lambda proc_root="/proc": hint[0])
    sampler = Sampler(rate_hz=10, scope={"tag": tag}, source="host-rss")
    try:
        time.sleep(0.3)  # past exec: its environment carries the tag
        sampler._known[proc.pid] = 0.0  # seen under this PID before, long ago, not in scope
        sampler._rescan()  # the first listing: a known PID is not read again
        assert proc.pid not in sampler._tracked
        sampler._rescan()  # no PID allocated since: /proc is not even listed
        assert proc.pid not in sampler._tracked
        hint[0] = proc.pid + 5  # the kernel allocated PIDs up to past this one's
        sampler._rescan()
        assert proc.pid in sampler._tracked
    finally:
        _kill_and_reap([proc])
        for fd in [*sampler._pidfds.values(), *sampler._stat_fds.values()]:
            os.close(fd)


def test_a_rescan_asked_with_a_wait_tracks_the_new_process_before_it_returns(
        sampler_cleanup: list[Sampler]) -> None:
    """The control asks for a rescan at the end of every activity and waits for it: a process
    the activity started is tracked before the next activity (a kill) runs, whatever the
    periodic search's spacing (here 60 s apart)."""
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    sampler = Sampler(rate_hz=50, scope={"tag": tag}, source="host-rss", rescan_s=60.0)
    sampler_cleanup.append(sampler)
    sampler.start()
    time.sleep(0.2)
    proc = _start(tag, "import time; time.sleep(60)")  # returns once it exec'd
    try:
        assert sampler.request_rescan(wait_s=5.0) is True
        assert proc.pid in sampler._tracked
    finally:
        _kill_and_reap([proc])
    _wait_all_gone(sampler, 5)
    sampler.stop()
    assert sampler.request_rescan(wait_s=5.0) is True  # stopped: nothing to wait for


MEASURING_PROBES = [
    ("baseline_memory", lambda: probes.baseline_memory()),
    ("residual_gpu_memory", lambda: probes.residual_gpu_memory(timeout_s=0)),
    ("residual_gpu_memory", lambda: probes.gpu_memory_at_baseline(timeout_s=0)),
    ("memory_release_time", lambda: probes.memory_release_time(after_event="kill", timeout_s=0)),
    ("memory_release_time", lambda: probes.memory_release_time(
        after_event="kill", timeout_s=0, missing_ok="before-method")),
    ("gb_seconds_held", lambda: probes.gb_seconds_held(from_event="kill", to_event="kill")),
    ("termination_timings", lambda: probes.termination_timings(after_event="kill", timeout_s=0)),
    ("timeline_summary", lambda: probes.timeline_summary()),
]


@pytest.mark.parametrize("source", ["host-rss", "nvml"])
def test_a_scope_that_never_matched_gives_no_measurement_once_the_method_started(
        source: str, monkeypatch: pytest.MonkeyPatch, sampler_cleanup: list[Sampler]) -> None:
    """A typo'd scope tracks nothing: on host-rss that is 0 MiB held and an instant "release"
    (before the fix: memory_release_time 0.008 s, 0.0 GiB x s, the run completed); on NVML the
    device's memory is real but none of it is the target's. Before the method nothing needs to
    have matched yet (the method starts the target)."""
    if source == "nvml":
        nvml = ScriptedNvml()  # its one GPU process (pid 4242) is not in the scope
        monkeypatch.setattr(node, "nvml_device_memory", nvml.device_memory)
        monkeypatch.setattr(node, "nvml_gpu_processes", nvml.gpu_processes)
    tag = f"tl-typo-{uuid.uuid4().hex[:8]}"
    sampler = Sampler(rate_hz=100, process_every=2, scope={"tag": tag}, source=source)
    sampler_cleanup.append(sampler)
    sampler.start()
    install(sampler)
    assert probes.residual_gpu_memory(timeout_s=0) == 0.0  # before the method: fine
    assert probes.memory_release_time(after_event="kill", missing_ok="before-method") == 0.0
    sampler.mark("method", "start")
    sampler.mark("kill", "start")
    sampler.mark("kill", "end")
    assert sampler.wait_samples(5, 5.0) and sampler.request_rescan(wait_s=5.0)
    assert not sampler.matched()
    for name, measure in MEASURING_PROBES:
        with pytest.raises(ScopeError) as refused:
            measure()
        assert str(refused.value) == (
            f"{name}: the timeline control's scope 'tag={tag}' matched no process during the "
            f"experiment: nothing of the target to measure (a typo in the control's scope?)")
    # an event that is not there is still said first, and missing_ok true still allows it
    with pytest.raises(ValueError, match="no event 'nope'"):
        probes.memory_release_time(after_event="nope", timeout_s=0)
    assert probes.memory_release_time(after_event="nope", missing_ok=True) == 0.0
    assert sampler.summary()["scope_matched"] is False
    assert "4242" not in sampler.to_dict()["processes"]


def test_a_scope_whose_processes_matched_and_exited_is_measured(
        sampler_cleanup: list[Sampler]) -> None:
    """The normal case: the scope's processes were tracked, then killed (memory released):
    nothing is tracked any more, and every probe measures."""
    tag = f"tl-{uuid.uuid4().hex[:8]}"
    sampler = Sampler(rate_hz=100, process_every=2, scope={"tag": tag}, source="host-rss")
    sampler_cleanup.append(sampler)
    sampler.start()
    install(sampler)
    sampler.mark("method", "start")
    proc = _start(tag, HOLD_64)
    try:
        deadline = time.monotonic() + 10  # a look caught before its exec looks again
        while proc.pid not in sampler._tracked and time.monotonic() < deadline:
            sampler.request_rescan(wait_s=1.0)
        assert proc.pid in sampler._tracked
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not sampler.total or sampler.total[-1] < 64):
            time.sleep(0.02)
        sampler.mark("kill", "start")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        sampler.mark("kill", "end")
    finally:
        _kill_and_reap([proc])
    _wait_all_gone(sampler, 5)
    assert not sampler._tracked and sampler.matched()
    release = probes.memory_release_time(after_event="kill", threshold_mib=4, timeout_s=5)
    assert release is not None and release < 1.0
    assert probes.gpu_memory_at_baseline(tolerance_mib=4, timeout_s=2) is True
    assert probes.termination_timings(after_event="kill")["all_dead_after_s"] is not None
    assert probes.gb_seconds_held(from_event="kill", to_event="kill") >= 0.0
    assert probes.timeline_summary()["scope_matched"] is True


def test_a_pids_scope_with_start_times_tracks_only_those_processes() -> None:
    """The sampler matches a `{"pid", "starttime"}` entry only while the PID holds the process
    started then (a reused PID is another process); a bare PID matches whatever holds it."""
    from chaosgpu.timeline.sampler import Sampler

    sampler = Sampler(rate_hz=10, scope={"pids": [{"pid": 123, "starttime": 5}, 7]})
    assert sampler._matches({"pid": 123, "starttime": 5})
    assert not sampler._matches({"pid": 123, "starttime": 6})
    assert sampler._matches({"pid": 7, "starttime": 1})
    assert not sampler._matches({"pid": 8, "starttime": 5})
