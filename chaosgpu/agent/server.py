"""The node agent's HTTP server: the census, the jobs' verdicts and the timeline over HTTP.

This module owns the server (aiohttp on its own event loop thread), bearer-token
authentication, the query-parameter validation and the bounds on concurrency: at most
`max_inflight` requests are answered at once (more get 503 with `Retry-After`, /healthz
excepted), their blocking work (encoding, metrics, timeline windows) runs on a pool of
`workers` threads, and censuses run one at a time, shared by every request that needs one
(`chaosgpu.agent.cache`). It must not read /proc or NVML itself (everything goes through
`chaosgpu.node`, the sampler and chaosgpu.job) and never signals anything.

Endpoints (docs/agent.md): `GET /healthz` (no auth), `GET /v1/snapshot` (`gpu`, `processes`,
`fresh`), `GET /v1/timeline` (`since`, `until`, `pod_uid`, `pid`), `GET /metrics` (Prometheus
text). Errors are JSON `{"error": ..., "parameter": ...}` with 400, 401, 404, 405, 500 or 503.
"""

import asyncio
import concurrent.futures
import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from chaosgpu.agent.cache import CensusCache
from chaosgpu.agent.jobs import JobWatch
from chaosgpu.agent.timeline import TIMELINE_SCHEMA, TimelineWindow

__all__ = [
    "AgentConfig",
    "AgentServer",
    "BadParameter",
    "CensusCache",
    "JobWatch",
    "TIMELINE_SCHEMA",
    "TimelineWindow",
    "is_loopback",
    "parse_listen",
    "snapshot_document",
]

logger = logging.getLogger("chaostoolkit")

SNAPSHOT_SCHEMA = "chaosgpu.census/1"
ENDPOINTS = ("/healthz", "/v1/snapshot", "/v1/timeline", "/metrics")
#: idle keep-alive connections are closed after this many seconds
KEEPALIVE_S = 15.0
#: a Prometheus exposition is reused for this many seconds (scrapes come every 15 s or more)
METRICS_REUSE_S = 0.25


class _RequestErrorLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's log for errors met while serving a request: a request its HTTP parser
    rejects (answered 400 by aiohttp, before any handler) is the client's doing, so it gets
    one warning line naming the client and the error, not a traceback per request that a
    scanner could flood the log with; anything else keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        error = exc_info if isinstance(exc_info, BaseException) else None
        if isinstance(error, HttpProcessingError):
            parts = [line.strip() for line in str(error.message).splitlines()]
            self.warning("agent: malformed HTTP request from %s (answered %d): %s",
                         args[0] if args else "?", error.code,
                         " ".join(part for part in parts if part.strip("^"))[:300])
            return
        self.error(msg, *args, exc_info=exc_info, **kwargs)


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


class AgentConfig:
    """What the server serves and how: token, census cache, timeline and job watch (None = off),
    and the bounds (`max_inflight` requests at once, `workers` threads for blocking work)."""

    def __init__(self, token: str, census: CensusCache, timeline: TimelineWindow | None,
                 max_window_s: float = 3600.0, jobs: JobWatch | None = None,
                 max_inflight: int = 32, workers: int = 2,
                 metrics_reuse_s: float = METRICS_REUSE_S) -> None:
        if not token:
            raise ValueError("the agent needs a non-empty token")
        if max_inflight < 1 or workers < 1:
            raise ValueError(f"max_inflight and workers must be >= 1, got {max_inflight}, "
                             f"{workers}")
        self.token = token.encode()
        self.census = census
        self.timeline = timeline
        self.jobs = jobs
        self.max_window_s = max_window_s
        self.max_inflight = max_inflight
        self.workers = workers
        self.metrics_reuse_s = metrics_reuse_s
        self.started = time.time()
        self.requests = 0
        self.rejected = 0
        self.inflight = 0
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


def _json_body(document: Any) -> bytes:
    return json.dumps(document, separators=(",", ":"), default=str).encode()


def _error(code: int, message: str, parameter: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    document: dict[str, Any] = {"error": message, "status": code}
    if parameter is not None:
        document["parameter"] = parameter
    return web.Response(status=code, body=_json_body(document), content_type="application/json",
                        headers={"Cache-Control": "no-store", **(headers or {})})


def _nvml_state() -> dict[str, Any] | None:
    from chaosgpu.node import census_module

    state = getattr(census_module(), "nvml_init_state", None)
    return None if state is None else dict(state())


class _App:
    """The request handlers of one server (one per AgentServer)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.pool = concurrent.futures.ThreadPoolExecutor(
            config.workers, thread_name_prefix="chaosgpu-agent-worker")
        self.routes: dict[str, Callable[[web.Request], Awaitable[web.Response]]] = {
            "/healthz": self.healthz, "/v1/snapshot": self.snapshot,
            "/v1/timeline": self.timeline, "/metrics": self.metrics}
        self._metrics: tuple[float, bytes] | None = None
        self._rendering: asyncio.Future[bytes] | None = None

    async def _work(self, function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, function, *args)

    def _authorised(self, request: web.Request) -> bool:
        scheme, _, credential = (request.headers.get("Authorization") or "").partition(" ")
        # compare_digest even when the scheme is wrong, so timing says nothing either way; the
        # parser keeps bytes that are not UTF-8 as surrogates: back to those bytes (no match)
        ok = hmac.compare_digest(credential.strip().encode("utf-8", "surrogateescape"),
                                 self.config.token)
        return ok and scheme.lower() == "bearer"

    async def dispatch(self, request: web.Request) -> web.Response:
        """Route, authenticate, bound and answer one request."""
        config = self.config
        config.requests += 1
        if request.method not in ("GET", "HEAD"):
            return _error(405, "the agent is read-only: use GET",
                          headers={"Allow": "GET, HEAD"})
        route = self.routes.get(request.path)
        if route is None:
            return _error(404, f"no such endpoint {request.path!r}; endpoints: "
                               f"{', '.join(ENDPOINTS)}")
        if request.path == "/healthz":
            return await self._answer(route, request)
        if not self._authorised(request):
            return _error(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                          headers={"WWW-Authenticate": 'Bearer realm="chaosgpu-agent"'})
        if config.inflight >= config.max_inflight:
            config.rejected += 1
            return _error(503, f"busy: {config.max_inflight} requests in flight already; "
                               "retry shortly", headers={"Retry-After": "1"})
        config.inflight += 1
        try:
            return await self._answer(route, request)
        finally:
            config.inflight -= 1

    async def _answer(self, route: Callable[[web.Request], Awaitable[web.Response]],
                      request: web.Request) -> web.Response:
        """The route's answer; a bad parameter is 400 naming it, any other failure 500."""
        try:
            return await route(request)
        except BadParameter as error:
            return _error(400, str(error), error.parameter)
        except Exception as error:
            logger.error("chaosgpu agent: %s failed", request.path, exc_info=True)
            return _error(500, f"{type(error).__name__}: {error}")

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness and what the agent sees (no auth, never refused for load; no parameters)."""
        _params(request.query_string, ())
        config = self.config
        timeline = config.timeline
        jobs = config.jobs
        document = {
            "status": "ok", "uptime_s": round(time.time() - config.started, 3),
            "census_age_s": config.census.age_s(), "census_in_flight": config.census.in_flight,
            "censuses": config.census.censuses,
            "census_error": config.census.last_error, "nvml": _nvml_state(),
            "timeline": None if timeline is None else {
                "running": timeline.sampler.running, "source": timeline.sampler.source,
                "switched_to_nvml_at": timeline.switched_to_nvml_at},
            "jobs": None if jobs is None else {"jobs": len(jobs.jobs()), "ticks": jobs.ticks,
                                               "error": jobs.last_error},
            "inflight": config.inflight, "max_inflight": config.max_inflight}
        return web.Response(body=_json_body(document), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    def _encode(self, census: dict[str, Any], gpu: int | None, processes: bool) -> bytes:
        config = self.config
        key = (id(census), gpu, processes)
        cached = config.encoded.get(key)
        if cached is not None and cached[0] is census:
            return cached[1]
        body = _json_body(snapshot_document(census, gpu, processes))
        if len(config.encoded) > 16:  # old censuses: drop them all
            config.encoded.clear()
        config.encoded[key] = (census, body)
        return body

    async def snapshot(self, request: web.Request) -> web.Response:
        """The census (`chaosgpu.census/1`), optionally one GPU's, without processes, fresh."""
        params = _params(request.query_string, ("gpu", "processes", "fresh"))
        gpu = _integer(params, "gpu")
        processes = _flag(params, "processes", True)
        fresh = _flag(params, "fresh", False)
        census = await self.config.census.get(fresh=fresh)
        body = await self._work(self._encode, census, gpu, processes)
        age = max(0.0, time.time() - float(census.get("taken_at") or 0))
        return web.Response(body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store", "X-Census-Age": f"{age:.4f}"})

    async def timeline(self, request: web.Request) -> web.Response:
        """The timeline window between `since` and `until`."""
        config = self.config
        params = _params(request.query_string, ("since", "until", "pod_uid", "pid"))
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
            return _error(503, "this agent runs without a timeline (--rate-hz 0)")
        window = config.timeline.window
        body = await self._work(lambda: _json_body(window(since, until, pod_uid, pid)))
        return web.Response(body=body, content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def metrics(self, request: web.Request) -> web.Response:
        """The Prometheus exposition: reused for `metrics_reuse_s`, one rendering shared by
        concurrent scrapes."""
        from chaosgpu.agent.metrics import CONTENT_TYPE

        _params(request.query_string, ())
        now = time.monotonic()
        if self._metrics is not None and now - self._metrics[0] <= self.config.metrics_reuse_s:
            body = self._metrics[1]
        else:
            if self._rendering is None:
                self._rendering = asyncio.ensure_future(self._render())
            rendering = self._rendering
            try:
                body = await asyncio.shield(rendering)
            finally:
                if self._rendering is rendering and rendering.done():
                    self._rendering = None
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE,
                                                "Cache-Control": "no-store"})

    async def _render(self) -> bytes:
        from chaosgpu.agent.metrics import render

        config = self.config
        census = await config.census.get()
        nvml = _nvml_state() or {}
        agent = {"census_age_s": config.census.age_s(), "censuses": config.census.censuses,
                 "census_failures": config.census.failures, "requests": config.requests,
                 "rejected": config.rejected, "inflight": config.inflight,
                 "nvml_attempts": nvml.get("attempts"),
                 "nvml_retry_in_s": nvml.get("retry_in_s")}
        jobs = None if config.jobs is None else config.jobs.jobs()
        summary = None if config.timeline is None else config.timeline.summary()
        body: bytes = await self._work(render, census, jobs, summary, agent)
        self._metrics = (time.monotonic(), body)
        return body


class AgentServer:
    """The agent: the HTTP server on its own event-loop thread, with the census cache, the
    timeline and the job watch of its config; `start()` binds (OSError when it cannot),
    `stop()` ends every thread it started."""

    def __init__(self, host: str, port: int, config: AgentConfig) -> None:
        self.host, self.port = host, port
        self.config = config
        self._app = _App(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None

    async def _serve(self, ready: "concurrent.futures.Future[tuple[str, int]]") -> None:
        app = web.Application(client_max_size=4096)
        app.router.add_route("*", "/{tail:.*}", self._app.dispatch)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S,
                               handle_signals=False, shutdown_timeout=2.0,
                               logger=_RequestErrorLog(logger, {}))
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, backlog=128, reuse_address=True)
        try:
            await site.start()
        except BaseException as error:
            await runner.cleanup()
            ready.set_exception(error)
            return
        self._runner = runner
        address = runner.addresses[0]
        ready.set_result((str(address[0]), int(address[1])))

    def start(self, timeout_s: float = 30.0) -> "AgentServer":
        """Bind and serve; start the timeline and the job watch. Returns self."""
        loop = asyncio.new_event_loop()
        self._loop = loop
        self.config.census.loop = loop
        ready: concurrent.futures.Future[tuple[str, int]] = concurrent.futures.Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.create_task(self._serve(ready))
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="chaosgpu-agent-http", daemon=True)
        self._thread.start()
        try:
            self._address = ready.result(timeout_s)
        except BaseException:
            self._stop_loop()
            raise
        if self.config.timeline is not None:
            self.config.timeline.start()
        if self.config.jobs is not None:
            self.config.jobs.start()
        return self

    def _stop_loop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None:
            return
        if self._runner is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), loop).result(10.0)
            except concurrent.futures.TimeoutError:
                logger.error("chaosgpu agent: the HTTP server did not close within 10 s")
            self._runner = None
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(10.0)
        loop.close()
        self._thread = None

    def stop(self) -> None:
        """Stop the job watch, the timeline, the server and the census and worker threads."""
        if self.config.jobs is not None:
            self.config.jobs.stop()
        if self.config.timeline is not None:
            self.config.timeline.stop()
        self._stop_loop()
        self._app.pool.shutdown(wait=True, cancel_futures=True)
        self.config.census.close()

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. http://127.0.0.1:9464."""
        if self._address is None:
            raise RuntimeError("the server is not started")
        host, port = self._address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"
