"""A Kubernetes API emulator for tests: kmock 0.8's KubernetesEmulator plus what it lacks.

kmock serves real HTTP on loopback with stateful CRUD and a request log, but (FACTS.md) ignores
labelSelector, fieldSelector and gracePeriodSeconds and fills no metadata. `PodEmulator` adds, for
pods: metadata (namespace, uid, resourceVersion, creationTimestamp) and a Running status on
create; label and field selectors on list and watch; graceful deletion like the API server and
the kubelet together (deletionTimestamp + deletionGracePeriodSeconds at once, containers
terminated when their process exits — `exit_after[(ns, name)]` seconds after the DELETE, or at
the end of the grace period as a SIGKILL — then the pod removed). `time_scale` shrinks every
emulated wait so a 30 s grace period can be tested in a fraction of it.

kmock is asyncio-only and a synchronous client inside its async fixture deadlocks: `ServerThread`
runs the server on its own event loop in its own thread.
"""

import asyncio
import datetime
import itertools
import re
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import kmock

Key = tuple[str, str]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


_SET = re.compile(r"^([^\s!=]+)\s+(in|notin)\s+\((.*)\)$")
_EQ = re.compile(r"^([^\s!=]+)\s*(==|=|!=)\s*(.*)$")


def label_matches(selector: str | None, labels: dict[str, str]) -> bool:
    """Return whether `labels` satisfy a Kubernetes label selector (equality and set forms)."""
    for term in _split_selector(selector or ""):
        if match := _SET.match(term):
            key, op, values = match.group(1), match.group(2), {
                v.strip() for v in match.group(3).split(",")}
            present = key in labels and labels[key] in values
            if (op == "in") != present:
                return False
        elif match := _EQ.match(term):
            key, op, value = match.group(1), match.group(2), match.group(3).strip()
            if (op == "!=") == (labels.get(key) == value):
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_matches(selector: str | None, obj: dict[str, Any]) -> bool:
    """Return whether an object satisfies a field selector (`a.b=c`, `==`, `!=`)."""
    for term in _split_selector(selector or ""):
        match = _EQ.match(term)
        if not match:
            return False
        value: Any = obj
        for part in match.group(1).split("."):
            value = value.get(part) if isinstance(value, dict) else None
        value = "" if value is None else str(value)
        if (match.group(2) == "!=") == (value == match.group(3).strip()):
            return False
    return True


_EXEC_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/exec$")


class PodEmulator(kmock.KubernetesEmulator):
    """kmock's emulator with pod metadata, selectors and graceful deletion (see module doc).

    With `exec_handler` set (an ExecHandler), it also serves the pods' exec subresource over
    websocket, like the API server (404 for a pod that does not exist)."""

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = _EXEC_PATH.match(raw_request.path)
        if match is None or self.exec_handler is None:
            return await super().__call__(raw_request)
        ns, name = match.group(1), match.group(2)
        exists = any(key[1] == ns and key[2] == name and getattr(key[0], "plural", "") == "pods"
                     and not obj.deleted for key, obj in self._objects.items())
        if not exists:
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
                 "reason": "NotFound", "message": f'pods "{name}" not found'}, status=404)
        return await self.exec_handler.handle(raw_request, ns, name)  # type: ignore[no-any-return]

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.exec_handler: Any = None
        self.time_scale = 1.0
        self.exit_after: dict[Key, float] = {}
        self.removal_delay = 0.2  # kubelet's status update -> final removal (not scaled)
        self._versions = itertools.count(1000)
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- helpers -------------------------------------------------------------------------
    def _is_pods(self, request: kmock.Request) -> bool:
        resource = request.resource
        return resource is not None and getattr(resource, "plural", None) == "pods"

    def _find(self, request: kmock.Request) -> Any:
        for (resource, namespace, name), obj in self._objects.items():
            if (resource == request.resource and namespace == request.namespace
                    and name == request.name and not obj.deleted):
                return (resource, namespace, name), obj
        return None, None

    async def _publish(self, resource: Any, kind: str, raw: dict[str, Any]) -> None:
        await self._buses[resource].put({"type": kind, "object": raw})

    # ---- request handling ----------------------------------------------------------------
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._is_pods(request) and isinstance(request.data, dict):
            if request.action == kmock.action.CREATE:
                self._fill_metadata(request)
            elif request.action == kmock.action.UPDATE:
                metadata = request.data.setdefault("metadata", {})
                metadata["resourceVersion"] = str(next(self._versions))
        if self._is_pods(request) and request.action == kmock.action.DELETE and request.name:
            response = await self._graceful_delete(request)
            if response is not None:
                return response
        return await super()._handle(request)

    def _fill_metadata(self, request: kmock.Request) -> None:
        data = request.data
        metadata = data.setdefault("metadata", {})
        metadata.setdefault("namespace", request.namespace or "default")
        metadata.setdefault("uid", str(uuid.uuid4()))
        metadata["resourceVersion"] = str(next(self._versions))
        metadata.setdefault("creationTimestamp", _now())
        containers = (data.get("spec") or {}).get("containers") or []
        status = data.setdefault("status", {})
        status.setdefault("phase", "Running")
        # no probe runs here: a readinessProbe whose command is ["false"] never passes
        status.setdefault("containerStatuses", [
            {"name": c.get("name"), "restartCount": 0,
             "ready": ((c.get("readinessProbe") or {}).get("exec") or {}).get("command")
             != ["false"],
             "image": c.get("image") or "", "imageID": "",
             "containerID": f"containerd://{uuid.uuid4().hex}",
             "state": {"running": {"startedAt": _now()}}} for c in containers])

    def _grace(self, request: kmock.Request, obj: Any) -> int:
        value = None
        if isinstance(request.data, dict):
            value = request.data.get("gracePeriodSeconds")
        if value is None:
            value = request.params.get("gracePeriodSeconds")
        if value is None:
            value = (obj.get("spec") or {}).get("terminationGracePeriodSeconds")
        return 30 if value is None else int(value)

    async def _graceful_delete(self, request: kmock.Request) -> aiohttp.web.StreamResponse | None:
        async with self._lock:
            key, obj = self._find(request)
            if obj is None:
                return None  # kmock answers 404
            metadata = obj.get("metadata") or {}
            grace = self._grace(request, obj)
            if metadata.get("deletionTimestamp"):
                if grace > 0:  # already terminating: a longer or equal grace changes nothing
                    return aiohttp.web.json_response(obj.raw)
                raw = obj.raw  # grace 0 on a terminating pod: force, remove now
                obj.delete()
                await self._publish(key[0], "DELETED", raw)
                return aiohttp.web.json_response(raw)
            if grace <= 0:
                return None  # immediate removal: kmock's own delete
            obj.patch({"metadata": {"deletionTimestamp": _now(),
                                    "deletionGracePeriodSeconds": grace,
                                    "resourceVersion": str(next(self._versions))}})
            raw = obj.raw
            await self._publish(key[0], "MODIFIED", raw)
        task = asyncio.get_running_loop().create_task(self._terminate(key, obj, grace))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return aiohttp.web.json_response(raw)

    async def _terminate(self, key: Any, obj: Any, grace: int) -> None:
        ns, name = key[1], key[2]
        exits = self.exit_after.get((ns, name))
        killed = exits is None or exits >= grace
        await asyncio.sleep((grace if killed else exits) * self.time_scale)
        async with self._lock:
            if obj.deleted:
                return
            statuses = []
            for status in ((obj.get("status") or {}).get("containerStatuses") or []):
                terminated = ({"exitCode": 137, "reason": "Error", "finishedAt": _now()} if killed
                              else {"exitCode": 0, "reason": "Completed", "finishedAt": _now()})
                statuses.append({**status, "ready": False, "state": {"terminated": terminated}})
            obj.patch({"status": {"phase": "Failed" if killed else "Succeeded",
                                  "containerStatuses": statuses},
                       "metadata": {"resourceVersion": str(next(self._versions))}})
            await self._publish(key[0], "MODIFIED", obj.raw)
        await asyncio.sleep(self.removal_delay)
        async with self._lock:
            if obj.deleted:
                return
            raw = obj.raw
            obj.delete()
            await self._publish(key[0], "DELETED", raw)

    # ---- selectors -----------------------------------------------------------------------
    def _selected(self, request: kmock.Request, obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return (label_matches(request.params.get("labelSelector"), labels)
                and field_matches(request.params.get("fieldSelector"), obj))

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        result["items"] = [o for o in result["items"] if self._selected(request, o)]
        result["metadata"] = {"resourceVersion": str(next(self._versions))}
        return result

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and not self._selected(request, event.get("object") or {}):
                continue
            yield event


class ServerThread:
    """Run an aiohttp-based server (a kmock handler or an app factory) on its own loop/thread."""

    def __init__(self, make_handler: Callable[[], Any]) -> None:
        self._make_handler = make_handler
        self.handler: Any = None
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as error:  # surfaced by start()
            self._error = error
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        handler = self._make_handler()
        async with handler, kmock.Server(handler) as server:
            self.handler = handler
            self.url = f"http://{server.host}:{server.port}"
            self._ready.set()
            await self._stop.wait()
            for task in list(getattr(handler, "_tasks", ())):
                task.cancel()

    def call(self, coroutine_function: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run a coroutine function on the server's loop and return its result."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine_function(), self._loop)
        return future.result(timeout)

    def start(self) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(15) or self._error is not None:
            raise RuntimeError(f"emulator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)
