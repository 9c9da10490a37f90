"""GiB x s has one definition (chaosgpu.timeline.integral) and every figure uses it: the
sampler, the node agent's probe and the report agree on the same samples."""

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from chaosgpu.agent import probes as agent_probes
from chaosgpu.report import figures
from chaosgpu.timeline import sampler as sampler_mod
from chaosgpu.timeline.integral import gib_seconds

# 1 GiB held from t=1 to t=3, released between the samples at 3 and 4.
TIMES = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
MIB = [0.0, 1024.0, 1024.0, 1024.0, 0.0, 0.0]
STEP_T = [0.0, 1.0, 2.0, 3.0]
STEP_MIB = [1024.0, 1024.0, 0.0, 0.0]


def test_trapezoid_rule() -> None:
    # the ramps 0->1 and 3->4 count half: 0.5 + 2 + 0.5
    assert gib_seconds(TIMES, MIB, 0.0, 5.0) == pytest.approx(3.0)
    # a window inside a ramp: linear between the samples
    assert gib_seconds(TIMES, MIB, 0.5, 1.0) == pytest.approx(0.5 * (0.5 + 1.0) / 2)
    # above a baseline, clipped at zero
    assert gib_seconds(TIMES, MIB, 1.0, 3.0, above=512.0) == pytest.approx(1.0)
    assert gib_seconds(TIMES, MIB, 0.0, 5.0, above=4096.0) == 0.0
    # the last value is held to the end; nothing before the first sample
    assert gib_seconds([10.0, 11.0], [1024.0, 1024.0], 0.0, 13.0) == pytest.approx(3.0)
    assert gib_seconds([], [], 0.0, 1.0) == 0.0
    assert gib_seconds(TIMES, MIB, 3.0, 3.0) == 0.0
    # a release between two samples counts half the interval (a left step would count all: 2.0)
    assert gib_seconds(STEP_T, STEP_MIB, 0.0, 3.0) == pytest.approx(1.5)


def test_bad_series_is_refused() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        gib_seconds([0.0, 1.0], [1.0], 0.0, 1.0)
    with pytest.raises(ValueError, match="ascending"):
        gib_seconds([1.0, 0.0], [1.0, 1.0], 0.0, 1.0)


def test_sampler_uses_the_definition() -> None:
    sampler = sampler_mod.Sampler(rate_hz=10, source="host-rss")
    sampler.t, sampler.total = list(STEP_T), list(STEP_MIB)
    assert sampler.integral_gib_s(0.0, 3.0, 0.0) == pytest.approx(1.5)
    assert sampler.integral_gib_s(0.0, 3.0, 512.0) == pytest.approx(0.75)


def test_report_uses_the_definition() -> None:
    timeline = {"t0": 0.0, "devices": [], "processes": {}, "events": [], "end": 5.0,
                "total": {"t": list(TIMES), "mib": list(MIB)}, "baseline_mib": 0.0}
    events = [{"t": 1.0, "name": "kill", "phase": "point", "kind": "fault"}]
    derived = figures.derive(timeline, events)
    # from the fault (t=1) to the release (the first sample near zero, t=4): 1 + 1 + 0.5
    assert derived["gib_seconds"].value == pytest.approx(2.5)


class _Timeline(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        # the agent's window: the pod's one process, listed every second, seen last at t=3
        body = json.dumps({"t0": 1000.0, "rate_hz": 10, "process_every": 10,
                           "t": [0.0, 1.0, 2.0, 3.0, 4.0], "processes": {"42": {
                               "t": STEP_T, "mib": STEP_MIB, "pod_uid": "uid-1"}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def agent_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Timeline)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_agent_probe_uses_the_definition(agent_url: str) -> None:
    waste = agent_probes.pod_gb_seconds(agent_url, pod_uid="uid-1", since=1000.0, until=1003.0,
                                        secrets={"agent_token": "token"})
    assert waste == pytest.approx(1.5)
