"""A loopback server speaking the Kubernetes exec channel protocol (v4.channel.k8s.io).

`GET /api/v1/namespaces/NS/pods/NAME/exec?command=..&stdin=..&stdout=..&stderr=..&container=..`
upgrades to a websocket; every message is one channel byte then data: 0 stdin (client to
server), 1 stdout, 2 stderr, 3 the final status as JSON (`{"status": "Success"}` or a Failure
with reason NonZeroExitCode and the code in details.causes[ExitCode]). The requested command
really runs, as a local subprocess in its own session with this process's environment (so the
in-target programs really run and the leak fixture sees everything); when the client closes the
stream first, the subprocess's process group is SIGKILLed and reaped. An unknown executable gets
the API server's Failure without an exit code. Each request is logged in `log`.
"""

import asyncio
import json
import os
import signal
import socket
import struct
from typing import Any

import aiohttp
import aiohttp.web

from k8s.k8s_emulator import ServerThread

PROTOCOL = "v4.channel.k8s.io"
V5_PROTOCOL = "v5.channel.k8s.io"  # v4 framing plus a close-channel message (255) on stdin


class _App:
    """Adapter so ServerThread can run a plain aiohttp application."""

    def __init__(self, owner: "ExecServer") -> None:
        self.owner = owner
        self.runner: aiohttp.web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> "_App":
        app = aiohttp.web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/exec", self.owner._route)
        app.router.add_post("/api/v1/namespaces/{ns}/pods/{name}/exec", self.owner._route)
        # Go's net/http (the API server) accepts request lines up to 1 MiB; aiohttp 8 KiB.
        self.runner = aiohttp.web.AppRunner(app, max_line_size=1 << 20,
                                            max_field_size=1 << 20)
        await self.runner.setup()
        site = aiohttp.web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


class _Thread(ServerThread):
    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with self._make_handler() as app:
            self.handler = app
            self.url = f"http://127.0.0.1:{app.port}"
            self._ready.set()
            await self._stop.wait()


class ExecHandler:
    """The exec endpoint: `handle(request, ns, name)`; `log` of requests; `pods` maps
    (ns, name) to the host PID of a local "pod"'s PID 1, whose PID and mount namespaces the
    command then enters (nsenter), so it sees what a process in that pod sees."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []
        self.pids: list[int] = []
        self.pods: dict[tuple[str, str], int] = {}
        # v4 only by default; add V5_PROTOCOL to answer like API servers >= 1.30 (the client
        # offers both and takes the first the server accepts).
        self.protocols: tuple[str, ...] = (PROTOCOL,)
        # "after-status": send the exit status and the close frame, then reset the connection
        # at once, without waiting for the client's answering close (proxies can do this);
        # "before-status": reset it when the command ends, before any exit status is sent.
        self.abrupt_close: str | None = None

    async def _route(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        return await self.handle(request, request.match_info["ns"], request.match_info["name"])

    @staticmethod
    async def _feed(ws: aiohttp.web.WebSocketResponse, proc: Any) -> None:
        """Channel 0 of the client's messages to the command's stdin (v5: 255 0 closes it)."""
        async for message in ws:
            if message.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                continue
            data = message.data if isinstance(message.data, bytes) else message.data.encode()
            if data[:2] == b"\xff\x00" and proc.stdin is not None:  # v5: close stdin
                proc.stdin.close()
            elif data[:1] == b"\x00" and proc.stdin is not None:
                try:
                    proc.stdin.write(data[1:])
                    await proc.stdin.drain()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the command is gone or closed its stdin: drop the input

    async def handle(self, request: Any, ns: str, name: str) -> aiohttp.web.StreamResponse:
        """Serve one exec request for pod ns/name (request: an aiohttp request)."""
        query = request.query
        command = query.getall("command", [])
        argv = list(command)
        pid1 = self.pods.get((ns, name))
        if pid1 is not None and command:
            argv = ["nsenter", "-t", str(pid1), "-p", "-m", "--", *command]
        entry = {"namespace": ns, "pod": name,
                 "container": query.get("container"), "command": command,
                 "stdin": query.get("stdin") == "true", "tty": query.get("tty") == "true",
                 "authorization": request.headers.get("Authorization"),
                 "protocol": None, "exit_code": None, "killed": False}
        self.log.append(entry)
        ws = aiohttp.web.WebSocketResponse(protocols=self.protocols)
        await ws.prepare(request)
        entry["protocol"] = ws.ws_protocol
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE if entry["stdin"] else
                asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, env=dict(os.environ))
        except (FileNotFoundError, PermissionError, IndexError) as error:
            await self._status(ws, {"status": "Failure", "reason": "InternalError",
                                    "message": f"exec: {command[:1]!r}: {error}"})
            await ws.close()
            return ws
        self.pids.append(proc.pid)

        async def pump(reader: asyncio.StreamReader | None, channel: int) -> None:
            assert reader is not None
            while chunk := await reader.read(65536):
                await ws.send_bytes(bytes([channel]) + chunk)

        async def finish() -> int:
            await asyncio.gather(pump(proc.stdout, 1), pump(proc.stderr, 2))
            return await proc.wait()

        finisher = asyncio.ensure_future(finish())
        feeder = asyncio.ensure_future(self._feed(ws, proc))
        await asyncio.wait({finisher, feeder}, return_when=asyncio.FIRST_COMPLETED)
        if not finisher.done():  # the client went away first: kill what it started
            entry["killed"] = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()
            finisher.cancel()
            feeder.cancel()
            return ws
        code = finisher.result()
        if code < 0:  # killed by a signal: report it like a container runtime (128 + signal)
            code = 128 - code
        entry["exit_code"] = code
        if self.abrupt_close == "before-status":
            return self._reset(request, ws, feeder)
        if code == 0:
            await self._status(ws, {"metadata": {}, "status": "Success"})
        else:
            await self._status(ws, {
                "metadata": {}, "status": "Failure",
                "message": f"command terminated with non-zero exit code: exit status {code}",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": str(code)}]}})
        if self.abrupt_close == "after-status":
            await ws._writer.send_frame(b"\x03\xe8", aiohttp.WSMsgType.CLOSE)  # 1000, normal
            return self._reset(request, ws, feeder)
        await ws.close()
        feeder.cancel()
        return ws

    @staticmethod
    def _reset(request: Any, ws: aiohttp.web.WebSocketResponse,
               feeder: "asyncio.Future[None]") -> aiohttp.web.WebSocketResponse:
        """Drop the connection with a TCP reset (linger 0), no closing handshake."""
        sock = request.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        request.transport.abort()
        feeder.cancel()
        return ws

    @staticmethod
    async def _status(ws: aiohttp.web.WebSocketResponse, status: dict[str, Any]) -> None:
        await ws.send_bytes(b"\x03" + json.dumps(status).encode())


class ExecServer(ExecHandler):
    """The exec endpoint alone on loopback, in its own thread; `url` to point a client at."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = _Thread(lambda: _App(self))
        self.url = ""

    def start(self) -> "ExecServer":
        self._thread.start()
        self.url = self._thread.url
        return self

    def stop(self) -> None:
        self._thread.stop()
