"""Tests of `chaosgpu agent` over real HTTP on loopback: authentication, snapshot and timeline
content, malformed parameters, Prometheus metrics, the probes, and the command's bind/token rules.

Real processes (a zombie, a tagged process holding memory, a process placed in a kubelet-style
pod cgroup) and a real server; only NVML is replaced, by a recorded H200 snapshot
(tests/data/nvml_h200_recorded.json), where a test needs GPU processes on this GPU-less machine.
"""

import copy
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from chaosgpu.agent import probes
from chaosgpu.agent import timeline as agent_timeline
from chaosgpu.agent.metrics import render
from chaosgpu.agent.server import (
    AgentConfig,
    AgentServer,
    CensusCache,
    JobWatch,
    TimelineWindow,
    is_loopback,
    parse_listen,
)
from chaosgpu.node import census_module

HERE = Path(__file__).resolve().parent
TOKEN = "test-token-" + uuid.uuid4().hex
RECORDED = json.loads((HERE / "data" / "nvml_h200_recorded.json").read_text())
CGROUP_PIDS = Path("/sys/fs/cgroup/pids")


class Agent:
    def __init__(self, server: AgentServer, timeline: TimelineWindow | None) -> None:
        self.server = server
        self.timeline = timeline
        self.url = server.url

    def get(self, path: str, token: str | None = TOKEN, **params: Any) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return requests.get(self.url + path, params=params, headers=headers, timeout=30)


def _start(census_kwargs: dict[str, Any] | None = None, rate_hz: float = 100.0,
           ttl: float = 0.2, max_inflight: int = 32, jobs: bool = False) -> Agent:
    census = CensusCache(ttl_s=ttl, census_kwargs=census_kwargs)
    timeline = TimelineWindow(rate_hz=rate_hz, process_every=2, retention_s=60,
                              housekeeping_s=0.05) if rate_hz else None
    if timeline is not None:
        census.listeners.append(timeline.remember)
    watch = JobWatch(lambda: census.get_blocking(), every_s=0.5, window_s=2.0) if jobs else None
    server = AgentServer("127.0.0.1", 0, AgentConfig(
        TOKEN, census, timeline, jobs=watch, max_inflight=max_inflight,
        metrics_reuse_s=0.0)).start()  # every scrape rendered anew: assertions see now
    return Agent(server, timeline)


def _agent_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("chaosgpu-agent")
            or t.name == "chaosgpu-timeline"]


def _stop(agent: Agent) -> None:
    agent.server.stop()
    # every thread the agent started is gone (server loop, census, workers, timeline, jobs)
    _wait(lambda: not _agent_threads(), 10, "the agent's threads to end")


@pytest.fixture
def agent() -> Iterator[Agent]:
    running = _start()
    try:
        yield running
    finally:
        _stop(running)


def _hold(mib: int, tag: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real process holding `mib` MiB of resident memory, tagged for the timeline."""
    code = ("import sys, time\n"
            f"x = bytearray({mib} * 1024 * 1024)\n"
            "for i in range(0, len(x), 4096): x[i] = 1\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\n")
    env = dict(os.environ, CHAOSGPU_TAG=tag, **(extra_env or {}))
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == b"ready"
    return process


def _wait(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


# -- addresses ---------------------------------------------------------------------------------

def test_listen_addresses_are_parsed_and_loopback_is_recognised() -> None:
    assert parse_listen("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_listen("[::1]:80") == ("::1", 80)
    for bad in ("9464", ":9464", "host:port", "1.2.3.4:70000", "[::1]9464"):
        with pytest.raises(ValueError):
            parse_listen(bad)
    assert is_loopback("127.0.0.1") and is_loopback("127.9.9.9") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


# -- authentication ----------------------------------------------------------------------------

def test_healthz_needs_no_token(agent: Agent) -> None:
    response = agent.get("/healthz", token=None)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


@pytest.mark.parametrize("path", ["/v1/snapshot", "/v1/timeline", "/metrics"])
def test_missing_or_wrong_token_is_refused(agent: Agent, path: str) -> None:
    for token in (None, "wrong", TOKEN + "x", ""):
        response = agent.get(path, token=token)
        assert response.status_code == 401, token
        assert "bearer token" in response.json()["error"]
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    basic = requests.get(agent.url + path, headers={"Authorization": f"Basic {TOKEN}"},
                         timeout=10)
    assert basic.status_code == 401
    assert agent.get(path).status_code == 200


def test_unknown_path_is_404_and_writes_are_405(agent: Agent) -> None:
    response = agent.get("/v1/nothing")
    assert response.status_code == 404
    assert "/v1/snapshot" in response.json()["error"]
    post = requests.post(agent.url + "/v1/snapshot", headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=10)
    assert post.status_code == 405


@pytest.mark.parametrize("request_bytes,named", [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
     "Invalid header token: b'Bad Header Line'"),
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
     "Content-Length: b'Content-Length: zz'"),
])
def test_a_request_the_http_parser_rejects_is_400_and_one_log_line(
        agent: Agent, caplog: pytest.LogCaptureFixture, request_bytes: bytes,
        named: str) -> None:
    host, port = urllib.parse.urlsplit(agent.url).netloc.rsplit(":", 1)
    with caplog.at_level(logging.DEBUG, logger="chaostoolkit"):
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(request_bytes)
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        _wait(lambda: [r for r in caplog.records if "malformed" in r.getMessage()], 10,
              "the agent to log the malformed request")
    assert answer.startswith(b"HTTP/1.0 400 Bad Request\r\n")
    [line] = [r for r in caplog.records
              if r.name == "chaostoolkit" and r.levelno >= logging.WARNING]
    assert line.levelno == logging.WARNING and line.exc_info is None
    assert line.getMessage().startswith(
        "agent: malformed HTTP request from 127.0.0.1 (answered 400)")
    assert named in line.getMessage()
    assert agent.get("/healthz").status_code == 200  # still serving


# -- snapshot ----------------------------------------------------------------------------------

def test_snapshot_is_the_census_and_shows_a_real_zombie(agent: Agent) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"], env=dict(os.environ))
    try:
        _wait(lambda: open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] == "Z", 10,
              "the child to be a zombie")
        response = agent.get("/v1/snapshot", fresh=1)
        assert response.status_code == 200
        census = response.json()
        assert census["schema"] == "chaosgpu.census/1"
        assert child.pid in census["zombies"]
        assert any(p["pid"] == os.getpid() for p in census["processes"])
        assert float(response.headers["X-Census-Age"]) < 5
        slim = agent.get("/v1/snapshot", processes=0).json()
        assert "processes" not in slim and "zombies" in slim
    finally:
        child.wait(timeout=10)


def test_snapshot_is_cached_for_its_ttl(agent: Agent) -> None:
    first = agent.get("/v1/snapshot").json()
    second = agent.get("/v1/snapshot").json()
    assert second["taken_at"] == first["taken_at"]  # within the 0.2 s TTL: the same census
    time.sleep(0.3)
    agent.get("/v1/snapshot")  # older than the TTL: answered, and a refresh starts
    _wait(lambda: agent.get("/v1/snapshot").json()["taken_at"] > first["taken_at"], 10,
          "a refreshed census")
    fresh = agent.get("/v1/snapshot", fresh=1).json()
    assert fresh["taken_at"] > first["taken_at"]


def _concurrently(count: int, call: Any) -> list[Any]:
    """`count` threads making `call()` at the same instant; their results."""
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count

    def run(index: int) -> None:
        barrier.wait(30)
        try:
            results[index] = call()
        except Exception as error:  # noqa: BLE001 (reported by the assertions)
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_fresh_requests_share_one_census_in_flight() -> None:
    running = _start(rate_hz=0, ttl=30.0)
    try:
        census = running.server.config.census
        assert running.get("/v1/snapshot", processes=0).status_code == 200
        before, sent = census.censuses, time.time()
        responses = _concurrently(24, lambda: running.get("/v1/snapshot", fresh=1, processes=0))
        assert [r.status_code for r in responses] == [200] * 24, responses
        taken = census.censuses - before
        # 24 fresh requests: the census in flight when a request arrives is not fresh enough
        # for it, the next one is shared by all that arrived meanwhile: a handful, not 24
        assert 1 <= taken <= 4, taken
        stamps = {r.json()["taken_at"] for r in responses}
        assert len(stamps) <= taken
        assert min(stamps) >= sent - 0.01  # each answer began after the requests were sent
    finally:
        _stop(running)


def test_a_census_done_but_not_yet_landed_does_not_spin_a_fresh_request() -> None:
    """Regression: a fresh request that finds the previous census finished (its future done,
    its done callback not run yet) must take a new census, not spin on the event loop (the
    agent stalled for good in a soak)."""
    import asyncio

    cache = CensusCache(ttl_s=30.0, census_kwargs={"pids": [os.getpid()], "gpu": False})
    result: dict[str, Any] = {}

    async def scenario() -> None:
        first = await cache.get()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        done.set_result(first)  # finished, callbacks not run: the state the race leaves
        cache._flight, cache._flight_started = done, time.monotonic() - 1.0
        result["first"] = first
        result["census"] = await asyncio.wait_for(cache.get(fresh=True), 30)

    thread = threading.Thread(target=lambda: asyncio.run(scenario()), daemon=True)
    try:
        thread.start()
        thread.join(30)
        assert not thread.is_alive(), "the fresh request spins on the event loop"
        assert result["census"] is not result["first"]  # a census taken after the request
        assert result["census"]["taken_at"] > result["first"]["taken_at"]
    finally:
        cache.close()


def test_requests_beyond_the_limit_get_503_and_threads_stay_bounded() -> None:
    running = _start(rate_hz=0, ttl=30.0, max_inflight=2)
    try:
        assert running.get("/v1/snapshot", processes=0).status_code == 200
        threads = len(_agent_threads())
        responses = _concurrently(16, lambda: running.get("/v1/snapshot", fresh=1,
                                                          processes=0))
        codes = [getattr(r, "status_code", r) for r in responses]
        assert set(codes) <= {200, 503}, codes
        assert codes.count(200) >= 2 and codes.count(503) >= 1, codes
        busy = next(r for r in responses if r.status_code == 503)
        assert busy.headers["Retry-After"] == "1" and "busy" in busy.json()["error"]
        # no thread per connection: the server loop, one census thread, the workers
        assert len(_agent_threads()) <= max(threads, 4), _agent_threads()
        assert running.get("/healthz", token=None).status_code == 200
        metrics = _parse(running.get("/metrics").text)
        assert metrics["chaosgpu_agent_requests_rejected_total"][0][1] == codes.count(503)
    finally:
        _stop(running)


@pytest.mark.parametrize(
    "params, parameter",
    [
        ({"gpu": "x"}, "gpu"),
        ({"gpu": "-1"}, "gpu"),
        ({"gpu": "7"}, "gpu"),  # no such GPU
        ({"processes": "maybe"}, "processes"),
        ({"fresh": "2"}, "fresh"),
        ({"bogus": "1"}, "bogus"),
    ],
)
def test_snapshot_rejects_malformed_parameters(agent: Agent, params: dict[str, str],
                                               parameter: str) -> None:
    response = agent.get("/v1/snapshot", **params)
    assert response.status_code == 400
    assert response.json()["parameter"] == parameter
    assert parameter in response.json()["error"]


def test_repeated_parameter_is_rejected(agent: Agent) -> None:
    response = requests.get(agent.url + "/v1/snapshot?gpu=0&gpu=1",
                            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert response.status_code == 400
    assert response.json()["parameter"] == "gpu"


# -- timeline ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "params, parameter",
    [
        ({"since": "abc"}, "since"),
        ({"until": "yesterday"}, "until"),
        ({"since": "nan"}, "since"),
        ({"since": "inf"}, "since"),
        ({"since": "200", "until": "100"}, "until"),
        ({"since": "0", "until": "100000"}, "since"),  # window longer than the maximum
        ({"pid": "-3"}, "pid"),
        ({"pid": "one"}, "pid"),
        ({"pod_uid": " "}, "pod_uid"),
        ({"gpu": "0"}, "gpu"),
    ],
)
def test_timeline_rejects_malformed_parameters(agent: Agent, params: dict[str, str],
                                               parameter: str) -> None:
    response = agent.get("/v1/timeline", **params)
    assert response.status_code == 400, response.text
    assert response.json()["parameter"] == parameter


def test_timeline_holds_a_tagged_process_memory_and_its_end(agent: Agent) -> None:
    since = time.time()
    worker = _hold(64, "agent-test")
    try:
        def seen() -> dict[str, Any] | None:
            # host-rss (no NVML): the tagged process's memory; with NVML the process list holds
            # GPU processes only, and this CPU process shows by its states
            window = agent.get("/v1/timeline", since=since).json()
            entry = window["processes"].get(str(worker.pid))
            if window["source"] == "nvml":
                return window if entry and entry["states"] else None
            return window if entry and entry["mib"] and max(entry["mib"]) >= 60 else None

        window = _wait(seen, 20, "the worker's memory in the timeline")
        assert window["schema"] == "chaosgpu.agent.timeline/1"
        assert window["source"] in ("host-rss", "nvml")
        entry = window["processes"][str(worker.pid)]
        assert entry["tag"] == "agent-test"
        assert all(since - window["t0"] - 1e-6 <= t for t in window["t"])
        assert len(window["t"]) == len(window["total_mib"])
        if window["source"] == "host-rss":
            assert window["rate_hz"] is None or window["rate_hz"] > 50
        killed_at = time.time()
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)

        def ended() -> dict[str, Any] | None:
            window = agent.get("/v1/timeline", since=since).json()
            states = window["processes"][str(worker.pid)]["states"]
            return window if states and states[-1][1] == "gone" else None

        window = _wait(ended, 20, "the worker's end in the timeline")
        entry = window["processes"][str(worker.pid)]
        if entry["t"]:
            assert entry["t"][-1] + window["t0"] <= killed_at + 0.5
        # a window that ends before the worker started holds none of it
        early = agent.get("/v1/timeline", since=since - 5, until=since - 4).json()
        assert str(worker.pid) not in early["processes"]
        only = agent.get("/v1/timeline", since=since, pid=worker.pid).json()
        assert list(only["processes"]) == [str(worker.pid)]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(timeout=10)


def test_timeline_retention_trims_old_samples() -> None:
    running = _start()
    try:
        timeline = running.timeline
        assert timeline is not None
        timeline.retention_s = 0.5
        _wait(lambda: timeline.sampler.now() > 3.0, 10, "3 s of samples")
        time.sleep(0.3)
        window = running.get("/v1/timeline", since=time.time() - 30).json()
        assert window["truncated"] is True
        assert window["retained_since"] > time.time() - 2.0
        assert len(timeline.sampler.t) < 2.0 * 100 * 1.2
    finally:
        _stop(running)


def test_a_window_starts_each_process_with_its_last_reading_before_it() -> None:
    """NVML's process list is read seconds apart while memory stays put: a window between two
    readings still shows a live process's memory (its last reading, which holds), and a
    process gone before the window is not brought back."""
    window = agent_timeline.TimelineWindow(rate_hz=10)  # not started: readings set by hand
    sampler = window.sampler
    sampler.t, sampler.total = [1.0, 5.0, 5.5, 6.0, 9.0], [2663.0] * 5
    sampler.processes = {
        4242: {"t": [1.0, 9.0], "mib": [2048.0, 2048.0], "tag": None, "rank": None,
               "comm": "python", "starttime": 1, "states": [[0.5, "S"]]},
        4343: {"t": [1.0], "mib": [512.0], "tag": None, "rank": None, "comm": "python",
               "starttime": 2, "states": [[0.5, "S"], [2.0, "gone"]]}}
    found = window.window(sampler.t0 + 5.0, sampler.t0 + 6.0)
    assert found["t"] == [5.0, 5.5, 6.0]
    assert found["processes"]["4242"]["t"] == [1.0] and found["processes"]["4242"]["mib"] == [
        2048.0]
    assert "4343" not in found["processes"]
    later = window.window(sampler.t0 + 8.0, sampler.t0 + 10.0)  # one reading before, one in
    assert later["processes"]["4242"]["t"] == [1.0, 9.0]


# -- metrics -----------------------------------------------------------------------------------

SAMPLE = re.compile(r'^[a-z_:][a-z0-9_:]*(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? \S+$')
HELP = re.compile(r"^# HELP (\S+) (.*)$")


def _parse(text: str) -> dict[str, list[tuple[str, float]]]:
    out: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert line.startswith(("# HELP ", "# TYPE ")), line
            continue
        assert SAMPLE.match(line), line
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        out.setdefault(name, []).append((name_labels, float(value)))
    return out


def _helps(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in map(HELP.match, text.splitlines()) if m}


def test_metrics_are_prometheus_text_with_zombies(agent: Agent) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"], env=dict(os.environ))
    try:
        _wait(lambda: open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] == "Z", 10,
              "a zombie")
        agent.get("/v1/snapshot", fresh=1)
        response = agent.get("/metrics")
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        metrics = _parse(response.text)
        assert metrics["chaosgpu_zombie_processes"][0][1] >= 1
        for name in ("chaosgpu_gpu_available", "chaosgpu_orphan_processes", "chaosgpu_jobs",
                     "chaosgpu_processes", "chaosgpu_timeline_rate_hz",
                     "chaosgpu_timeline_total_bytes", "chaosgpu_timeline_total_mib",
                     "chaosgpu_agent_requests_total", "chaosgpu_agent_censuses_total",
                     "chaosgpu_agent_inflight_requests", "chaosgpu_census_age_seconds"):
            assert name in metrics, name
        assert "chaosgpu_job_verdict" not in metrics  # this agent runs no job watch
        total = metrics["chaosgpu_timeline_total_bytes"][0][1]
        assert total == pytest.approx(metrics["chaosgpu_timeline_total_mib"][0][1] * 2**20,
                                      rel=0.05) or math.isnan(total)
        bad = agent.get("/metrics", extra="1")
        assert bad.status_code == 400 and bad.json()["parameter"] == "extra"
    finally:
        child.wait(timeout=10)


def test_metrics_are_in_bytes_and_the_mib_names_are_deprecated() -> None:
    census = {"gpu": {"available": True, "devices": [
        {"index": 0, "uuid": "GPU-1", "name": 'odd "name"\n', "memory_used_mib": 1.5,
         "memory_total_mib": 2.0}]},
        "gpu_processes": [{"gpu_index": 0, "host_pid": 7, "ns_pid": 1, "used_mib": 0.5,
                           "visible": True, "container": {"pod_uid": "p1", "id": "c1"}}],
        "processes": [], "zombies": [], "orphans": [], "jobs": [{"id": 'job"1'}]}
    jobs = [{"id": 'job"1', "verdict": "hung", "since": 1000.0, "since_known": True,
             "restart_count": None},
            {"id": "job2", "verdict": "running", "since": 2000.0, "since_known": False,
             "restart_count": None}]
    text = render(census, jobs=jobs).decode()
    metrics = _parse(text)
    helps = _helps(text)
    assert 'name="odd \\"name\\"\\n"' in text  # label values escaped
    assert metrics["chaosgpu_gpu_memory_used_bytes"][0][1] == 1.5 * 2**20
    assert metrics["chaosgpu_gpu_memory_total_bytes"][0][1] == 2 * 2**20
    assert metrics["chaosgpu_gpu_process_memory_bytes"][0][1] == 0.5 * 2**20
    assert metrics["chaosgpu_pod_gpu_memory_bytes"] == [
        ('chaosgpu_pod_gpu_memory_bytes{pod_uid="p1"}', 0.5 * 2**20)]
    for old, new in (("chaosgpu_gpu_memory_used_mib", "chaosgpu_gpu_memory_used_bytes"),
                     ("chaosgpu_gpu_memory_total_mib", "chaosgpu_gpu_memory_total_bytes"),
                     ("chaosgpu_gpu_process_memory_mib", "chaosgpu_gpu_process_memory_bytes"),
                     ("chaosgpu_pod_gpu_memory_mib", "chaosgpu_pod_gpu_memory_bytes"),
                     ("chaosgpu_job_hang_suspected", "chaosgpu_job_verdict")):
        assert helps[old].startswith("DEPRECATED") and new in helps[old], old
        assert not helps[new].startswith("DEPRECATED")
    assert metrics["chaosgpu_gpu_memory_used_mib"][0][1] == 1.5
    # the verdict: one series per verdict, 1 for the current one
    verdicts = {line: value for line, value in metrics["chaosgpu_job_verdict"]}
    assert verdicts['chaosgpu_job_verdict{job="job\\"1",verdict="hung"}'] == 1
    assert verdicts['chaosgpu_job_verdict{job="job2",verdict="running"}'] == 1
    assert sum(verdicts.values()) == 2 and len(verdicts) == 12
    assert metrics["chaosgpu_hung_jobs"][0][1] == 1
    assert metrics["chaosgpu_job_hang_suspected"][0][1] == 1
    since = dict(metrics["chaosgpu_job_verdict_since_timestamp_seconds"])
    assert since['chaosgpu_job_verdict_since_timestamp_seconds{job="job\\"1"}'] == 1000.0
    # running already when first seen: when it began is unknown, not the first sight
    assert math.isnan(since['chaosgpu_job_verdict_since_timestamp_seconds{job="job2"}'])
    assert math.isnan(metrics["chaosgpu_job_restarts"][0][1])  # not an elastic job
    # the old census field is gone: a census job alone says nothing of a hang
    assert "chaosgpu_hung_jobs" not in _parse(render(census).decode())


# -- a pod on this machine: a process in a kubelet-style cgroup ------------------------------

@pytest.fixture
def pod_process() -> Iterator[tuple[subprocess.Popen, str, str]]:
    """A real process holding memory in a kubelet-style pod cgroup (cgroup v1 pids hierarchy),
    `<root>/kubepods/besteffort/pod<uid>/<container id>` as the cgroupfs driver lays pods out
    under a kubelet's `--cgroup-root`. The root is this test's own folder, never /kubepods: a
    real kubelet on the machine (the project's real-Kubernetes tests start one) SIGKILLs the
    processes of pod cgroups it does not know under its /kubepods (orphaned pods)."""
    if not (CGROUP_PIDS.is_dir() and os.access(CGROUP_PIDS, os.W_OK)):
        pytest.skip("needs a writable cgroup v1 pids hierarchy (root, cgroup v1)")
    pod_uid = str(uuid.uuid4())
    container_id = uuid.uuid4().hex + uuid.uuid4().hex
    root = CGROUP_PIDS / f"chaosgpu-test-{uuid.uuid4().hex[:8]}"
    folders = [root, root / "kubepods", root / "kubepods" / "besteffort",
               root / "kubepods" / "besteffort" / f"pod{pod_uid}",
               root / "kubepods" / "besteffort" / f"pod{pod_uid}" / container_id]
    for folder in folders:
        folder.mkdir()
    worker = _hold(48, "agent-pod")
    try:
        (folders[-1] / "cgroup.procs").write_text(str(worker.pid))
        yield worker, pod_uid, container_id
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.wait(timeout=10)
        for folder in reversed(folders):
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.05)


def test_pod_processes_are_attributed_in_snapshot_metrics_and_timeline(
        pod_process: tuple[subprocess.Popen, str, str]) -> None:
    worker, pod_uid, container_id = pod_process
    # Replace NVML by the recorded H200 snapshot, its worker's PID by ours.
    gpu = copy.deepcopy(RECORDED["held"])
    gpu["devices"][0]["processes"][0]["pid"] = worker.pid
    running = _start(census_kwargs={"gpu_snapshot": gpu})
    try:
        census = running.get("/v1/snapshot", gpu=0).json()
        (entry,) = census["gpu_processes"]
        assert entry["host_pid"] == worker.pid
        assert entry["container"]["pod_uid"] == pod_uid
        assert entry["container"]["id"] == container_id
        assert running.get("/v1/snapshot", gpu=1).status_code == 400
        metrics = _parse(running.get("/metrics").text)
        (line, value), = metrics["chaosgpu_gpu_process_memory_bytes"]
        assert f'pod_uid="{pod_uid}"' in line and f'pid="{worker.pid}"' in line
        assert f'container_id="{container_id}"' in line
        assert value == 2658.0 * 2**20
        assert metrics["chaosgpu_pod_gpu_memory_bytes"] == [
            (f'chaosgpu_pod_gpu_memory_bytes{{pod_uid="{pod_uid}"}}', 2658.0 * 2**20)]
        assert metrics["chaosgpu_gpu_memory_used_bytes"][0][1] == 3281.875 * 2**20
        assert metrics["chaosgpu_pod_gpu_memory_mib"][0][1] == 2658.0  # deprecated twin
        secrets = {"agent_token": TOKEN}
        assert probes.pod_gpu_memory(pod_uid, url=running.url, secrets=secrets) == 2658.0
        assert probes.pod_gpu_memory("other", url=running.url, secrets=secrets) == 0.0
        # The timeline (host RSS here: NVML is only replaced in the census) carries the pod.
        _wait(lambda: running.get("/v1/timeline", pod_uid=pod_uid).json()["processes"], 20,
              "the pod's process in the timeline")
        window = running.get("/v1/timeline", pod_uid=pod_uid).json()
        assert list(window["processes"]) == [str(worker.pid)]
        assert window["processes"][str(worker.pid)]["container_id"] == container_id
        assert running.get("/v1/timeline", pod_uid="no-such-pod").json()["processes"] == {}
    finally:
        _stop(running)


def test_probes_measure_a_pod_release_and_its_gib_seconds(
        pod_process: tuple[subprocess.Popen, str, str], agent: Agent) -> None:
    worker, pod_uid, _ = pod_process
    secrets = {"agent_token": TOKEN}
    _wait(lambda: agent.get("/v1/timeline", pod_uid=pod_uid).json()["processes"], 20,
          "the pod in the timeline")
    time.sleep(0.5)
    since = time.time()
    time.sleep(1.0)
    # nothing else ended it (a release before our kill would be someone else's)
    assert worker.poll() is None, f"the pod's worker died before the kill: {worker.returncode}"
    os.kill(worker.pid, signal.SIGKILL)
    killed = time.time()
    worker.wait(timeout=10)
    release = probes.pod_release_time(agent.url, pod_uid=pod_uid, since=since, threshold_mib=8,
                                      timeout_s=20, secrets=secrets)
    assert release is not None
    # released after the kill, well within a second of it (sampling at 100 Hz, listing at 50)
    assert killed - since - 0.05 <= release <= killed - since + 1.0, (release, killed - since)
    waste = probes.pod_gb_seconds(agent.url, pod_uid=pod_uid, since=since, until=killed + 1,
                                  secrets=secrets)
    held_gib = 48 / 1024
    assert held_gib * (killed - since) * 0.8 <= waste <= held_gib * (killed - since + 1) * 1.3
    with pytest.raises(ValueError, match="agent token"):
        probes.pod_gb_seconds(agent.url, pod_uid=pod_uid, since=since, secrets={})
    with pytest.raises(RuntimeError, match="401"):
        probes.agent_snapshot(agent.url, secrets={"agent_token": "wrong"})
    with pytest.raises(ValueError, match="url"):
        probes.agent_snapshot("", secrets=secrets)
    with pytest.raises(RuntimeError, match="400"):
        probes.agent_snapshot(agent.url, gpu=5, secrets=secrets)
    assert probes.agent_snapshot(agent.url, configuration={"chaosgpu_agent_url": agent.url},
                                 secrets=secrets)["schema"] == "chaosgpu.census/1"


def test_release_time_gives_up_at_its_deadline(agent: Agent) -> None:
    worker = _hold(16, "agent-alive")
    try:
        started = time.monotonic()
        value = probes.pod_release_time(agent.url, pod_uid="no-such-pod", since=time.time(),
                                        timeout_s=1.0, secrets={"agent_token": TOKEN})
        assert value is None
        assert time.monotonic() - started < 5
    finally:
        worker.kill()
        worker.wait(timeout=10)


# -- NVML coming up after the agent (a fake NVML: no GPU here) ---------------------------------

class FakeNVML(types.ModuleType):
    """NVML's calls as the census's library makes them (``_load_nvml``), with pynvml's high-level
    listings (no raw symbols), for one GPU: failing with "Driver Not Loaded" until `working`,
    then listing `compute` and `mps` processes (pid, bytes)."""

    class NVMLError_DriverNotLoaded(Exception):  # noqa: N801 (pynvml's naming)
        pass

    def __init__(self, compute: list[tuple[int, int]], mps: list[tuple[int, int]]) -> None:
        super().__init__("pynvml")
        self.working = False
        self.inits = 0
        self.compute, self.mps = compute, mps

    def nvmlInit(self) -> None:  # noqa: N802
        self.inits += 1
        if not self.working:
            raise self.NVMLError_DriverNotLoaded("Driver Not Loaded")

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> tuple[str, int]:  # noqa: N802
        return ("fake", index)

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        return "580.0-fake"

    def nvmlDeviceGetUUID(self, handle: Any) -> str:  # noqa: N802
        return "GPU-fake-0"

    def nvmlDeviceGetName(self, handle: Any) -> str:  # noqa: N802
        return "Fake H200"

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> types.SimpleNamespace:  # noqa: N802
        used = 615 * 2**20 + sum(b for _, b in self.compute) + sum(b for _, b in self.mps[1:])
        return types.SimpleNamespace(used=used, total=143771 * 2**20)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:  # noqa: N802
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.compute]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:  # noqa: N802
        return [types.SimpleNamespace(pid=p, usedGpuMemory=b) for p, b in self.mps]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:  # noqa: N802
        return []


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """NVML replaced by a FakeNVML (the test hands it to the census's loader), a driver said to
    be registered, the census program's NVML state new (and put back after), short retry
    backoffs."""
    module = census_module()
    saved = dict(module._NVML)
    module._NVML.update(module=None, reason=None, handles=None, tried=False, attempts=0,
                        retry_at=0.0, backoff_s=0.0)
    monkeypatch.setattr(module, "NVML_RETRY_FIRST_S", 0.05)
    monkeypatch.setattr(module, "NVML_RETRY_MAX_S", 0.2)
    for memo in ("_NVML_REFUSED", "_NVML_RAW", "_NVML_ROOM"):
        monkeypatch.setattr(module, memo, type(getattr(module, memo))())
    monkeypatch.setattr(agent_timeline, "NVML_CHECK_S", 0.2)
    monkeypatch.setattr(module, "nvidia_registered", lambda proc_root="/proc": True)
    holders = {}
    try:
        yield holders
    finally:
        module._NVML.clear()
        module._NVML.update(saved)


def test_nvml_failing_at_start_is_retried_and_mps_processes_are_listed(
        fake_nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    compute, client = _hold(8, "agent-gpu"), _hold(8, "agent-mps")
    fake = FakeNVML(compute=[(compute.pid, 2**30)],
                    mps=[(compute.pid, 2**30), (client.pid, 512 * 2**20)])
    monkeypatch.setattr(census_module(), "_load_nvml", lambda: fake)
    running = _start(ttl=0.1)
    try:
        snapshot = running.get("/v1/snapshot", fresh=1, processes=0).json()
        assert snapshot["gpu"]["available"] is False
        assert "Driver Not Loaded" in snapshot["gpu"]["reason"]
        assert running.timeline is not None and running.timeline.sampler.source == "host-rss"
        time.sleep(1.0)  # failing for a second: retried with a growing backoff, no storm
        health = running.get("/healthz", token=None).json()
        assert health["nvml"]["available"] is False and health["nvml"]["attempts"] >= 2
        assert fake.inits <= 1.0 / 0.05 + 5, fake.inits
        metrics = _parse(running.get("/metrics").text)
        assert metrics["chaosgpu_gpu_available"][0][1] == 0
        assert metrics["chaosgpu_agent_nvml_init_attempts_total"][0][1] >= 2
        fake.working = True  # the driver is loaded
        snapshot = _wait(lambda: (lambda s: s if s["gpu"]["available"] else None)(
            running.get("/v1/snapshot", fresh=1, processes=0).json()), 10, "NVML to come up")
        pids = sorted(p["host_pid"] for p in snapshot["gpu_processes"])
        assert pids == sorted([compute.pid, client.pid])  # the MPS duplicate listed once
        (mps_entry,) = [p for p in snapshot["gpu_processes"] if p["host_pid"] == client.pid]
        assert mps_entry["used_mib"] == 512.0
        metrics = _parse(running.get("/metrics").text)
        assert metrics["chaosgpu_gpu_available"][0][1] == 1
        (line, value), = [m for m in metrics["chaosgpu_gpu_process_memory_bytes"]
                          if f'pid="{client.pid}"' in m[0]]
        assert value == 512 * 2**20
        assert math.isnan(metrics["chaosgpu_agent_nvml_retry_in_seconds"][0][1])
        # the timeline moves to NVML by itself and lists the MPS client too
        _wait(lambda: running.timeline.sampler.source == "nvml", 10, "the timeline on NVML")
        window = _wait(lambda: (lambda w: w if str(client.pid) in w["processes"] else None)(
            running.get("/v1/timeline", since=time.time() - 5).json()), 10,
            "the MPS client in the timeline")
        assert window["source"] == "nvml"
        assert max(window["processes"][str(client.pid)]["mib"]) == 512.0
        assert running.get("/healthz", token=None).json()["timeline"]["switched_to_nvml_at"]
    finally:
        _stop(running)
        for worker in (compute, client):
            worker.kill()
            worker.wait(timeout=10)


# -- job verdicts (chaosgpu.job) ------------------------------------------------------------------

@pytest.mark.slow
def test_job_verdicts_are_metrics_running_then_hung(tmp_path: Path) -> None:
    """A real two-rank gloo job: the agent's metrics say running, then hung once a rank is
    frozen (the verdict of chaosgpu.job, observed on the agent's shared census)."""
    pytest.importorskip("torch")
    from jobs.launch import start_bare

    from chaosgpu.job import actions

    job = start_bare(tmp_path, [])
    running = _start(rate_hz=0, ttl=0.5, jobs=True)
    try:
        job.wait_steps(3)
        watch = running.server.config.jobs
        assert watch is not None

        def verdict_of_job(wanted: str) -> str | None:
            mine = [j for j in watch.jobs() if j["tag"] == job.tag]
            if not mine:
                return None
            line = f'chaosgpu_job_verdict{{job="{mine[0]["id"]}",verdict="{wanted}"}}'
            values = dict(_parse(running.get("/metrics").text).get("chaosgpu_job_verdict", []))
            return mine[0]["id"] if values.get(line) == 1 else None

        job_id = _wait(lambda: verdict_of_job("running"), 60, "the job running in the metrics")
        actions.freeze_rank(tag=job.tag, rank=1)
        _wait(lambda: verdict_of_job("hung"), 60, "the job hung in the metrics")
        metrics = _parse(running.get("/metrics").text)
        assert metrics["chaosgpu_hung_jobs"][0][1] >= 1
        assert (f'chaosgpu_job_hang_suspected{{job="{job_id}"}}', 1.0) in \
            metrics["chaosgpu_job_hang_suspected"]
        assert running.get("/healthz", token=None).json()["jobs"]["error"] is None
    finally:
        _stop(running)
        job.stop()


# -- the command -------------------------------------------------------------------------------

def _agent_cli(args: list[str], env: dict[str, str] | None = None,
               timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chaosgpu.cli", "agent", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=env if env is not None else dict(os.environ))


def test_cli_refuses_remote_binds_and_bad_arguments(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CHAOSGPU_AGENT_TOKEN"}
    result = _agent_cli(["--listen", "0.0.0.0:0"], env)
    assert result.returncode == 2 and "--allow-remote" in result.stderr
    result = _agent_cli(["--listen", "0.0.0.0:0", "--allow-remote"], env)
    assert result.returncode == 2 and "needs a token" in result.stderr
    result = _agent_cli(["--listen", "localhost"], env)
    assert result.returncode == 2 and "HOST:PORT" in result.stderr
    result = _agent_cli(["--token-file", str(tmp_path / "missing")], env)
    assert result.returncode == 2 and "missing" in result.stderr
    (tmp_path / "empty").write_text("\n")
    result = _agent_cli(["--token-file", str(tmp_path / "empty")], env)
    assert result.returncode == 2 and "empty" in result.stderr
    result = _agent_cli(["--rate-hz", "-5"], env)
    assert result.returncode == 2 and "--rate-hz" in result.stderr
    for args, name in ((["--max-inflight", "0"], "--max-inflight"),
                       (["--max-inflight", "100000"], "--max-inflight"),
                       (["--jobs-every", "-1"], "--jobs-every"),
                       (["--job-window", "0"], "--job-window")):
        result = _agent_cli(args, env)
        assert result.returncode == 2 and name in result.stderr, (args, result.stderr)


def test_cli_serves_with_a_generated_token_and_stops_on_sigterm(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CHAOSGPU_AGENT_TOKEN"}
    env["CHAOSGPU_STATE_DIR"] = str(tmp_path / "state")
    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.cli", "agent", "--listen", "127.0.0.1:0",
         "--max-seconds", "60", "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait(lambda: ready.exists() and ready.read_text(), 30, "the agent to listen")
        info = json.loads(ready.read_text())
        token_file = Path(info["token_file"])
        assert token_file.parent == tmp_path / "state" / "agent"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 32
        url = info["url"]
        assert requests.get(url + "/v1/snapshot", timeout=10).status_code == 401
        ok = requests.get(url + "/v1/snapshot", headers={"Authorization": f"Bearer {token}"},
                          timeout=30)
        assert ok.status_code == 200
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=20)
        assert process.returncode == 0, err
        assert "listening on http://127.0.0.1:" in out and "stopped" in out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_cli_takes_the_token_from_the_environment(tmp_path: Path) -> None:
    env = dict(os.environ, CHAOSGPU_AGENT_TOKEN="from-env-token")
    ready = tmp_path / "ready.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.cli", "agent", "--listen", "127.0.0.1:0",
         "--rate-hz", "0", "--max-seconds", "2", "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait(lambda: ready.exists() and ready.read_text(), 30, "the agent to listen")
        info = json.loads(ready.read_text())
        assert info["token_file"] is None
        headers = {"Authorization": "Bearer from-env-token"}
        assert requests.get(info["url"] + "/metrics", headers=headers, timeout=30).ok
        timeline = requests.get(info["url"] + "/v1/timeline", headers=headers, timeout=10)
        assert timeline.status_code == 503
        process.communicate(timeout=20)  # --max-seconds ends it
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


# -- load ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bench_load_and_soak_have_no_errors_and_leave_nothing_behind(tmp_path: Path) -> None:
    """bench/agent_bench.py against the real agent, briefly: bounded clients, every request
    answered (errors=0), the cached snapshot's p50 under 5 ms on loopback (issue 5), a short
    soak with the RSS printed, and no process nor temporary file left behind."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    result = subprocess.run(
        [sys.executable, str(HERE.parent / "bench" / "agent_bench.py"), "--clients", "2,8",
         "--requests", "400", "--fresh-requests", "16", "--soak-s", "8", "--no-write"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(temporary)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert not list(temporary.iterdir()), list(temporary.iterdir())
    out = result.stdout
    assert "processes left behind: none; phases with errors: 0" in out
    line = next(x for x in out.splitlines() if "/v1/snapshot?processes=0" in x
                and " 2 clients  agent" in x)
    assert "n=  400" in line and "errors=0" in line
    p50 = float(re.search(r"p50=\s*([\d.]+)", line).group(1))  # type: ignore[union-attr]
    assert p50 < 5.0, line
    assert re.search(r"agent RSS \(MiB\): .* max [\d.]+", out), out
    assert "censuses taken" in out and "stdlib" in out
