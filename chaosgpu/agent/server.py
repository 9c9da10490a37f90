"""The node agent's HTTP server: the census and the timeline of this node over HTTP.

This module owns the server (stdlib `ThreadingHTTPServer`), bearer-token authentication, the
query-parameter validation, the census cache and the agent's timeline window (the sampler of
`chaosgpu.timeline.sampler`, trimmed to a retention window, its GPU processes attributed to
pods/containers from the census the first time they are seen). It must not read /proc or NVML
itself (everything goes through `chaosgpu.node` and the sampler) and never signals anything.

Endpoints (docs/agent.md): `GET /healthz` (no auth), `GET /v1/snapshot` (`gpu`, `processes`,
`fresh`), `GET /v1/timeline` (`since`, `until`, `pod_uid`, `pid`), `GET /metrics` (Prometheus
text). Errors are JSON `{"error": ..., "parameter": ...}` with 400, 401, 404, 405 or 500.
"""

import bisect
import hmac
import http.server
import ipaddress
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from typing import Any

__all__ = [
    "AgentConfig",
    "AgentServer",
    "BadParameter",
    "CensusCache",
    "TimelineWindow",
    "is_loopback",
    "parse_listen",
]

logger = logging.getLogger("chaostoolkit")

SNAPSHOT_SCHEMA = "chaosgpu.census/1"
TIMELINE_SCHEMA = "chaosgpu.agent.timeline/1"


class BadParameter(ValueError):
    """A request parameter is malformed: answered with 400 naming it."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def parse_listen(listen: str) -> tuple[str, int]:
    """Split 'HOST:PORT' (IPv6 as '[::1]:PORT') into (host, port); ValueError when malformed."""
    if not isinstance(listen, str) or ":" not in listen:
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    if listen.startswith("["):
        host, _, rest = listen[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"--listen must be [IPV6]:PORT, got {listen!r}")
        port_text = rest[1:]
    else:
        host, _, port_text = listen.rpartition(":")
    if not host:
        raise ValueError(f"--listen needs a host (127.0.0.1 for loopback), got {listen!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--listen port must be a number, got {port_text!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--listen port must be 0..65535, got {port}")
    return host, port


def is_loopback(host: str) -> bool:
    """Whether `host` names only the loopback interface (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CensusCache:
    """The census, taken at most once per `ttl_s`: a request older than the TTL triggers one
    refresh in the background and is answered from the cached census (stale by at most
    `ttl_s` + one census); only a census older than `max_stale_s` (or none yet, or `fresh`)
    is taken in the request. `taken_at`/`age_s` in the answer say how fresh it is."""

    def __init__(self, ttl_s: float = 1.0, max_stale_s: float = 10.0,
                 census_kwargs: dict[str, Any] | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_stale_s = max(max_stale_s, ttl_s)
        self.census_kwargs = dict(census_kwargs or {})
        self._census: dict[str, Any] | None = None
        self._taken_mono = 0.0
        self._lock = threading.Lock()  # guards the cached census and the refresh flag
        self._refreshing = False
        self.censuses = 0
        self.listeners: list[Any] = []  # called with each new census

    def _take(self) -> dict[str, Any]:
        from chaosgpu.node import take_census

        census = take_census(**self.census_kwargs)
        with self._lock:
            self._census = census
            self._taken_mono = time.monotonic()
            self.censuses += 1
        for listener in list(self.listeners):
            try:
                listener(census)
            except Exception:
                logger.error("chaosgpu agent: census listener failed", exc_info=True)
        return census

    def _refresh_in_background(self) -> None:
        try:
            self._take()
        except Exception:
            logger.error("chaosgpu agent: census failed", exc_info=True)
        finally:
            with self._lock:
                self._refreshing = False

    def get(self, fresh: bool = False) -> dict[str, Any]:
        """Return a census no older than the rules above."""
        with self._lock:
            census, age = self._census, time.monotonic() - self._taken_mono
            start_refresh = (census is not None and not fresh and self.ttl_s < age
                             <= self.max_stale_s and not self._refreshing)
            if start_refresh:
                self._refreshing = True
        if census is None or fresh or self.ttl_s <= 0 or age > self.max_stale_s:
            return self._take()
        if start_refresh:
            threading.Thread(target=self._refresh_in_background, name="chaosgpu-agent-census",
                             daemon=True).start()
        return census

    def age_s(self) -> float | None:
        """Seconds since the cached census was taken (None before the first)."""
        return None if self._census is None else time.monotonic() - self._taken_mono


class TimelineWindow:
    """The agent's timeline: a `chaosgpu.timeline.sampler.Sampler` (every GPU process when NVML
    is there, else chaosgpu-tagged processes' RSS) kept to the last `retention_s` seconds, with
    each process attributed (pod uid, container id, namespace PID) the first time it is seen."""

    def __init__(self, rate_hz: float = 100.0, process_every: int = 5,
                 retention_s: float = 600.0, housekeeping_s: float = 0.25) -> None:
        from chaosgpu.timeline.sampler import Sampler

        if not isinstance(retention_s, int | float) or retention_s <= 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s!r}")
        # The retention bounds memory; max_samples only guards against a stuck trim.
        self.sampler = Sampler(rate_hz=rate_hz, process_every=process_every,
                               max_samples=int(rate_hz * retention_s * 4) + 10_000)
        self.retention_s = float(retention_s)
        self.housekeeping_s = housekeeping_s
        self.attribution: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start sampling and the housekeeping thread (trim + attribution)."""
        self.sampler.start()
        self._thread = threading.Thread(target=self._housekeeping, name="chaosgpu-agent-timeline",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop both threads (each waits at most `timeout_s`)."""
        self._stop.set()
        self.sampler.stop(timeout_s)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _housekeeping(self) -> None:
        while not self._stop.wait(self.housekeeping_s):
            try:
                self.attribute_new()
                self.trim()
            except Exception:
                logger.error("chaosgpu agent: timeline housekeeping failed", exc_info=True)

    def remember(self, census: dict[str, Any]) -> None:
        """Attribute every GPU process of a census (a CensusCache listener)."""
        for entry in census.get("gpu_processes") or []:
            pid = entry.get("host_pid")
            if isinstance(pid, int) and pid not in self.attribution:
                container = entry.get("container") or {}
                self.attribution[pid] = {
                    "pod_uid": container.get("pod_uid"), "container_id": container.get("id"),
                    "ns_pid": entry.get("ns_pid"), "job": entry.get("job"),
                    "rank": entry.get("rank")}

    def attribute_new(self) -> None:
        """Read the container identity of processes the sampler saw for the first time."""
        from chaosgpu.node import read_process

        with self.sampler._data_lock:
            pids = [pid for pid in self.sampler.processes if pid not in self.attribution]
        for pid in pids:
            record = read_process(pid, env=False, fds=False)
            if record is None:
                self.attribution[pid] = {"pod_uid": None, "container_id": None, "ns_pid": None,
                                         "note": "gone before it could be attributed"}
                continue
            container = record.get("container") or {}
            nspid = record.get("nspid") or []
            self.attribution[pid] = {"pod_uid": container.get("pod_uid"),
                                     "container_id": container.get("id"),
                                     "ns_pid": nspid[-1] if nspid else None}

    def trim(self) -> None:
        """Drop samples older than the retention window."""
        sampler = self.sampler
        cutoff = sampler.now() - self.retention_s
        with sampler._data_lock:
            cut = bisect.bisect_left(sampler.t, cutoff)
            if cut >= max(100, len(sampler.t) // 10):
                del sampler.t[:cut]
                del sampler.total[:cut]
                for series in sampler.devices.values():
                    del series[:cut]
            for pid in list(sampler.processes):
                entry = sampler.processes[pid]
                if entry["t"] and entry["t"][-1] < cutoff and (
                        not entry["states"] or entry["states"][-1][0] < cutoff):
                    del sampler.processes[pid]
                    self.attribution.pop(pid, None)
                    continue
                pcut = bisect.bisect_left(entry["t"], cutoff)
                if pcut:
                    del entry["t"][:pcut]
                    del entry["mib"][:pcut]
            sampler.events[:] = [e for e in sampler.events if e["t"] >= cutoff]

    def window(self, since: float, until: float, pod_uid: str | None = None,
               pid: int | None = None) -> dict[str, Any]:
        """The timeline between two unix times, in the journal's timeline shape (times relative
        to t0), optionally only the processes of one pod or one PID."""
        sampler = self.sampler
        t0 = sampler.t0
        lo, hi = since - t0, until - t0
        with sampler._data_lock:
            a = bisect.bisect_left(sampler.t, lo)
            b = bisect.bisect_right(sampler.t, hi)
            t = sampler.t[a:b]
            total = sampler.total[a:b]
            devices = [{"index": index, "t": t, "used_mib": series[a:b]}
                       for index, series in sorted(sampler.devices.items())]
            oldest = sampler.t[0] + t0 if sampler.t else None
            processes = {}
            for key, entry in sampler.processes.items():
                who = self.attribution.get(key, {})
                if pid is not None and key != pid:
                    continue
                if pod_uid is not None and who.get("pod_uid") != pod_uid:
                    continue
                pa = bisect.bisect_left(entry["t"], lo)
                pb = bisect.bisect_right(entry["t"], hi)
                states = [s for s in entry["states"] if lo <= s[0] <= hi]
                if pa == pb and not states:
                    continue
                processes[str(key)] = {
                    "t": entry["t"][pa:pb], "mib": entry["mib"][pa:pb], "tag": entry.get("tag"),
                    "rank": entry.get("rank"), "comm": entry.get("comm"), "states": states,
                    "pod_uid": who.get("pod_uid"), "container_id": who.get("container_id"),
                    "ns_pid": who.get("ns_pid")}
            events = [dict(e) for e in sampler.events if lo <= e["t"] <= hi]
        summary = sampler.summary()
        return {
            "schema": TIMELINE_SCHEMA, "t0": t0, "since": since, "until": until,
            "source": sampler.source, "rate_hz": summary["rate_hz"],
            "rate_hz_requested": sampler.rate_hz, "process_every": sampler.process_every,
            "unit": "MiB", "t": t, "total_mib": total, "devices": devices,
            "processes": processes, "events": events,
            "retained_since": oldest, "retention_s": self.retention_s,
            "truncated": oldest is None or since < oldest,
            "errors": list(sampler.errors)}


class AgentConfig:
    """What the server serves and how: token, census cache, timeline (None = no timeline)."""

    def __init__(self, token: str, census: CensusCache, timeline: TimelineWindow | None,
                 max_window_s: float = 3600.0) -> None:
        if not token:
            raise ValueError("the agent needs a non-empty token")
        self.token = token.encode()
        self.census = census
        self.timeline = timeline
        self.max_window_s = max_window_s
        self.started = time.time()
        self.requests = 0
        self.lock = threading.Lock()
        # encoded snapshots by (census id, gpu, processes): a census is serialised once
        self.encoded: dict[tuple[int, int | None, bool], tuple[dict[str, Any], bytes]] = {}


def _number(params: dict[str, list[str]], name: str, default: float | None) -> float | None:
    values = params.get(name)
    if not values:
        return default
    try:
        value = float(values[0])
    except ValueError:
        raise BadParameter(name, f"{name} must be a number (unix seconds), "
                                 f"got {values[0]!r}") from None
    if math.isnan(value) or math.isinf(value):
        raise BadParameter(name, f"{name} must be a finite number, got {values[0]!r}")
    return value


def _flag(params: dict[str, list[str]], name: str, default: bool) -> bool:
    values = params.get(name)
    if not values:
        return default
    value = values[0].lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise BadParameter(name, f"{name} must be 0 or 1, got {values[0]!r}")


def _integer(params: dict[str, list[str]], name: str) -> int | None:
    values = params.get(name)
    if not values:
        return None
    try:
        value = int(values[0])
    except ValueError:
        raise BadParameter(name, f"{name} must be an integer, got {values[0]!r}") from None
    if value < 0:
        raise BadParameter(name, f"{name} must be >= 0, got {value}")
    return value


def _params(query: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    try:
        params = urllib.parse.parse_qs(query, keep_blank_values=True, strict_parsing=bool(query),
                                       max_num_fields=20)
    except ValueError as error:
        raise BadParameter("query", f"malformed query string: {error}") from None
    for name, values in params.items():
        if name not in allowed:
            raise BadParameter(name, f"unknown parameter {name!r}; this endpoint takes "
                                     f"{', '.join(allowed) or 'none'}")
        if len(values) > 1:
            raise BadParameter(name, f"{name} given {len(values)} times")
    return params


def snapshot_document(census: dict[str, Any], gpu: int | None,
                      processes: bool) -> dict[str, Any]:
    """The census answered by /v1/snapshot, limited to one GPU and/or without the process list."""
    document = dict(census)
    if gpu is not None:
        gpu_section = dict(census.get("gpu") or {})
        devices = [d for d in gpu_section.get("devices") or [] if d.get("index") == gpu]
        if not devices:
            known = [d.get("index") for d in gpu_section.get("devices") or []]
            raise BadParameter("gpu", f"gpu={gpu}: no such GPU on this node "
                                      f"(GPUs: {known or 'none'})")
        gpu_section["devices"] = devices
        document["gpu"] = gpu_section
        document["gpu_processes"] = [p for p in census.get("gpu_processes") or []
                                     if p.get("gpu_index") == gpu]
    if not processes:
        document.pop("processes", None)
    return document


class _Handler(http.server.BaseHTTPRequestHandler):
    server: "AgentServer"
    protocol_version = "HTTP/1.1"
    server_version = "chaosgpu-agent"
    timeout = 30
    # Buffer the response (headers + body go out in one send at the flush after each request)
    # and disable Nagle: otherwise a keep-alive client waits ~40 ms for a delayed ACK.
    wbufsize = -1

    def setup(self) -> None:
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib signature)
        logger.debug("chaosgpu agent: %s %s", self.address_string(), format % args)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if code == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="chaosgpu-agent"')
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, code: int, document: Any) -> None:
        body = json.dumps(document, separators=(",", ":"), default=str).encode()
        self._send(code, body, "application/json")

    def _error(self, code: int, message: str, parameter: str | None = None) -> None:
        document: dict[str, Any] = {"error": message, "status": code}
        if parameter is not None:
            document["parameter"] = parameter
        self._json(code, document)

    def _authorised(self) -> bool:
        header = self.headers.get("Authorization") or ""
        scheme, _, credential = header.partition(" ")
        expected = self.server.config.token
        given = credential.strip().encode()
        # compare_digest even when the scheme is wrong, so timing says nothing either way
        ok = hmac.compare_digest(given, expected)
        return ok and scheme.lower() == "bearer"

    def do_HEAD(self) -> None:  # noqa: N802 (stdlib naming)
        self.do_GET()

    def do_POST(self) -> None:  # noqa: N802
        self._error(405, "the agent is read-only: use GET")

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

    def do_GET(self) -> None:  # noqa: N802
        config = self.server.config
        with config.lock:
            config.requests += 1
        url = urllib.parse.urlsplit(self.path)
        routes = {"/healthz": self._healthz, "/v1/snapshot": self._snapshot,
                  "/v1/timeline": self._timeline, "/metrics": self._metrics}
        route = routes.get(url.path)
        if route is None:
            self._error(404, f"no such endpoint {url.path!r}; endpoints: {', '.join(routes)}")
            return
        if url.path != "/healthz" and not self._authorised():
            self._error(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
            return
        try:
            route(url.query)
        except BadParameter as error:
            self._error(400, str(error), error.parameter)
        except Exception as error:
            logger.error("chaosgpu agent: %s failed", url.path, exc_info=True)
            self._error(500, f"{type(error).__name__}: {error}")

    def _healthz(self, query: str) -> None:
        config = self.server.config
        timeline = config.timeline
        self._json(200, {
            "status": "ok", "uptime_s": round(time.time() - config.started, 3),
            "census_age_s": config.census.age_s(),
            "timeline": None if timeline is None else {
                "running": timeline.sampler.running, "source": timeline.sampler.source}})

    def _snapshot(self, query: str) -> None:
        params = _params(query, ("gpu", "processes", "fresh"))
        gpu = _integer(params, "gpu")
        processes = _flag(params, "processes", True)
        fresh = _flag(params, "fresh", False)
        config = self.server.config
        census = config.census.get(fresh=fresh)
        key = (id(census), gpu, processes)
        with config.lock:
            cached = config.encoded.get(key)
        if cached is None or cached[0] is not census:
            document = snapshot_document(census, gpu, processes)
            body = json.dumps(document, separators=(",", ":"), default=str).encode()
            with config.lock:
                if len(config.encoded) > 16:  # old censuses: drop them all
                    config.encoded.clear()
                config.encoded[key] = (census, body)
        else:
            body = cached[1]
        age = max(0.0, time.time() - float(census.get("taken_at") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Census-Age", f"{age:.4f}")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _timeline(self, query: str) -> None:
        config = self.server.config
        params = _params(query, ("since", "until", "pod_uid", "pid"))
        now = time.time()
        since = _number(params, "since", now - 10.0)
        until = _number(params, "until", now)
        assert since is not None and until is not None
        if until < since:
            raise BadParameter("until", f"until ({until}) is before since ({since})")
        if until - since > config.max_window_s:
            raise BadParameter("since", f"window of {until - since:.0f} s exceeds the maximum "
                                        f"{config.max_window_s:.0f} s")
        pod_values = params.get("pod_uid")
        pod_uid = pod_values[0] if pod_values else None
        if pod_uid is not None and not pod_uid.strip():
            raise BadParameter("pod_uid", "pod_uid is empty")
        pid = _integer(params, "pid")
        if config.timeline is None:
            self._error(503, "this agent runs without a timeline (--rate-hz 0)")
            return
        self._json(200, config.timeline.window(since, until, pod_uid, pid))

    def _metrics(self, query: str) -> None:
        from chaosgpu.agent.metrics import render

        _params(query, ())
        config = self.server.config
        census = config.census.get()
        body = render(census, config.timeline, census_age_s=config.census.age_s(),
                      requests=config.requests).encode()
        self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")


class AgentServer(http.server.ThreadingHTTPServer):
    """The agent's HTTP server (one thread per connection, daemon threads)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, host: str, port: int, config: AgentConfig) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.config = config
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. http://127.0.0.1:9464."""
        address = self.server_address
        host = address[0].decode() if isinstance(address[0], bytes) else str(address[0])
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{address[1]}"
