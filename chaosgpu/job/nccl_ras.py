"""NCCL RAS, asked from outside: the status report NCCL (2.24+) serves on localhost:28028.

NCCL's RAS thread, in every process with an NCCL communicator, listens on a TCP port
(NCCL_RAS_ADDR, 127.0.0.1:28028 by default; the first process of a node to bind it answers for
the node) and speaks a line protocol: the client says `CLIENT PROTOCOL 2`, the server answers
`SERVER PROTOCOL N`; `SET FORMAT json` (newer NCCL) asks for JSON; `STATUS` (or `VERBOSE
STATUS`) returns the report (communicators, ranks, collective operation counts, dead peers)
and closes. This module owns that exchange and nothing else: the report is kept as evidence
with a hang verdict; it changes nothing in the job.
"""

import json
import socket
import time
from typing import Any

__all__ = ["DEFAULT_PORT", "query"]

DEFAULT_PORT = 28028
PROTOCOL = 2


def _line(sock: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


def _ask(host: str, port: int, timeout_s: float, fmt: str | None,
         command: str) -> tuple[str, str | None]:
    """One connection: handshake, optionally SET FORMAT, then `command`; (protocol, text or
    None when the format was refused)."""
    with socket.create_connection((host, port), timeout=min(timeout_s, 2.0)) as sock:
        sock.settimeout(timeout_s)
        sock.sendall(f"CLIENT PROTOCOL {PROTOCOL}\n".encode())
        hello = _line(sock)
        if not hello.upper().startswith("SERVER PROTOCOL"):
            raise ValueError(f"not NCCL RAS: it said {hello[:80]!r}")
        if fmt is not None:
            sock.sendall(f"SET FORMAT {fmt}\n".encode())
            if _line(sock).upper() != "OK":
                return hello.split()[-1], None
        sock.sendall(f"{command}\n".encode())
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        return hello.split()[-1], b"".join(chunks).decode("utf-8", "replace")


def query(host: str = "127.0.0.1", port: int = DEFAULT_PORT, timeout_s: float = 8.0,
          verbose: bool = False) -> dict[str, Any]:
    """Ask NCCL RAS for its status report (JSON where this NCCL offers it, else text).
    Returns {"available": True, "protocol", "format", "report" (parsed JSON or text),
    "took_s"}, or {"available": False, "reason"} when nothing answers there (no NCCL job, RAS
    disabled, another port)."""
    started = time.monotonic()
    command = "VERBOSE STATUS" if verbose else "STATUS"
    try:
        protocol, text = _ask(host, port, timeout_s, "json", command)
        fmt = "json"
        if text is None:  # this NCCL has no JSON output: ask again in text
            protocol, text = _ask(host, port, timeout_s, None, command)
            fmt = "text"
    except (OSError, ValueError) as error:
        return {"available": False, "reason": f"NCCL RAS at {host}:{port}: {error}"}
    report: Any = text
    if fmt == "json":
        try:
            report = json.loads(text or "")
        except ValueError:
            fmt = "text"
    return {"available": True, "protocol": protocol, "format": fmt, "report": report,
            "took_s": round(time.monotonic() - started, 3)}
