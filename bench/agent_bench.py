"""Load test and soak of `chaosgpu agent` on loopback, against references measured in the same run.

    python bench/agent_bench.py [--clients 4,32] [--requests 2000] [--fresh-requests 64]
                                [--soak-s 180] [--no-write] [--out FILE]

It starts the real agent (`python -m chaosgpu.cli agent`, loopback, a token from the
environment, census TTL 1 s, timeline 100 Hz, job verdicts every 1 s) and two references:

* **stdlib**: the previous agent's server design, a standard-library `ThreadingHTTPServer` (one
  thread per connection, no limit) in its own process, serving the agent's own answers as
  pre-encoded bytes (a lower bound for that design: it does no census, no encoding, no metrics
  rendering) with the same bearer-token check;
* **ps**: `ps -eo pid,ppid,stat,sess,comm,args` run once per request, the plain way to ask a
  node what runs on it, for the `fresh=1` case (a census per question).

Every client is a thread with one keep-alive connection making a fixed number of requests with
a deadline (`--phase-s`); the client count is bounded by `--clients` (at most the agent's
`--max-inflight`, 32 by default, so every request must be answered: errors must be 0). It prints
p50/p99 per endpoint and client count with the reference's figures and the ratios, then a soak
(`--soak-s` of steady mixed load) with the agent's resident memory at start, end and maximum.
Every process it started is stopped and checked gone before it exits (also on errors).
Results go to bench/results/agent-<date>-cpu<N>.txt with the command, date and machine.
"""

import argparse
import datetime
import hmac
import http.client
import http.server
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PS = ["ps", "-eo", "pid,ppid,stat,sess,comm,args"]


# ---------------------------------------------------------------- the stdlib reference server

def _reference_server(port_file: str, bodies_file: str, token: str) -> None:
    """The previous design: ThreadingHTTPServer, a thread per connection, no limit; answers
    GET PATH with the bytes recorded for PATH (one send, TCP_NODELAY, as the old agent did)."""
    bodies = {k: bytes.fromhex(v) for k, v in json.loads(Path(bodies_file).read_text()).items()}
    expected = token.encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = -1

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

        def do_GET(self) -> None:  # noqa: N802
            scheme, _, given = (self.headers.get("Authorization") or "").partition(" ")
            ok = hmac.compare_digest(given.strip().encode(), expected) and scheme == "Bearer"
            body = bodies.get(self.path) if ok else None
            self.send_response(200 if body is not None else (401 if not ok else 404))
            body = body or b"{}"
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 64  # as the old agent had (the stdlib default of 5 drops SYNs)

    server = Server(("127.0.0.1", 0), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    Path(port_file).write_text(str(server.server_address[1]))
    server.serve_forever(poll_interval=0.2)


# ---------------------------------------------------------------- processes

def _wait_file(path: Path, process: subprocess.Popen[bytes], what: str) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not start within 60 s")


def _start_agent(folder: Path, token: str, max_s: float,
                 retention_s: float) -> tuple[subprocess.Popen[bytes], str]:
    ready = folder / "agent.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.cli", "agent", "--listen", "127.0.0.1:0",
         "--census-ttl", "1", "--retention-s", str(retention_s), "--max-seconds", str(max_s),
         "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=open(folder / "agent.err", "wb"),
        env=dict(os.environ, CHAOSGPU_AGENT_TOKEN=token), start_new_session=True)
    return process, json.loads(_wait_file(ready, process, "the agent"))["url"]


def _start_reference(folder: Path, token: str, bodies: dict[str, bytes]
                     ) -> tuple[subprocess.Popen[bytes], str]:
    (folder / "bodies.json").write_text(json.dumps({k: v.hex() for k, v in bodies.items()}))
    port_file = folder / "reference.port"
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--reference-server", str(port_file),
         str(folder / "bodies.json")], env=dict(os.environ, CHAOSGPU_BENCH_TOKEN=token),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    return process, f"http://127.0.0.1:{_wait_file(port_file, process, 'the reference')}"


def _stop(processes: list[subprocess.Popen[bytes]]) -> list[int]:
    """SIGTERM, then SIGKILL after 20 s; returns the PIDs still alive afterwards (none)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    return [p.pid for p in processes if p.poll() is None or os.path.exists(f"/proc/{p.pid}")]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


# ---------------------------------------------------------------- load

class Result:
    """Latencies (ms) and errors of one phase."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def pct(self, p: float) -> float:
        ordered = sorted(self.latencies)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    def line(self) -> str:
        return (f"n={len(self.latencies):5d}  p50={self.pct(50):8.3f}  p99={self.pct(99):8.3f} ms"
                f"  errors={len(self.errors)}")


def _client(url: str, token: str, paths: list[str], count: int, deadline: float,
            result: Result, pause_s: float = 0.0) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Authorization": f"Bearer {token}"}
    latencies, errors = [], []
    for i in range(count):
        if time.monotonic() >= deadline:
            break
        path = paths[i % len(paths)]
        started = time.perf_counter()
        try:
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
            body = response.read()
            if response.status != 200 or not body:
                errors.append(f"{path}: HTTP {response.status}")
        except (OSError, http.client.HTTPException) as error:
            errors.append(f"{path}: {type(error).__name__}: {error}")
            connection.close()
            connection = http.client.HTTPConnection(host, int(port), timeout=60)
        latencies.append((time.perf_counter() - started) * 1000)
        if pause_s:
            time.sleep(pause_s)
    connection.close()
    with result.lock:
        result.latencies += latencies
        result.errors += errors


def _ps_client(count: int, deadline: float, result: Result) -> None:
    latencies, errors = [], []
    for _ in range(count):
        if time.monotonic() >= deadline:
            break
        started = time.perf_counter()
        done = subprocess.run(PS, capture_output=True, timeout=60)
        latencies.append((time.perf_counter() - started) * 1000)
        if done.returncode != 0:
            errors.append(f"ps exited {done.returncode}")
    with result.lock:
        result.latencies += latencies
        result.errors += errors


def _load(clients: int, total: int, phase_s: float, target: Any, *args: Any) -> Result:
    result = Result()
    deadline = time.monotonic() + phase_s
    per_client = max(1, total // clients)
    threads = [threading.Thread(target=target, args=(*args, per_client, deadline, result))
               for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(phase_s + 120)
    if any(t.is_alive() for t in threads):
        result.errors.append("a client did not stop")
    return result


def _get(url: str, token: str, path: str) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"{path}: HTTP {response.status}")
    return body


def _censuses(url: str, token: str) -> int:
    """Censuses the agent took so far (/healthz: live, where /metrics may be reused 0.25 s)."""
    count: int = json.loads(_get(url, token, "/healthz"))["censuses"]
    return count


def _ratio(a: float, b: float) -> str:
    return f"{a / b:6.2f}x" if b else "   n/a"


# ---------------------------------------------------------------- the run

def _latency(args: argparse.Namespace, agent: str, reference: str, token: str) -> list[str]:
    lines = ["== latency (cached census, TTL 1 s): agent vs the stdlib reference serving the "
             "same bytes"]
    for clients in args.clients:
        for path in ("/v1/snapshot?processes=0", "/metrics"):
            mine = _load(clients, args.requests, args.phase_s, _client, agent, token, [path])
            ref = _load(clients, args.requests, args.phase_s, _client, reference, token, [path])
            lines.append(f"  {path:26s} {clients:3d} clients  agent  {mine.line()}")
            lines.append(f"  {'':26s} {'':3s}          stdlib {ref.line()}")
            lines.append(f"  {'':26s} {'':3s}          agent/stdlib p50 "
                         f"{_ratio(mine.pct(50), ref.pct(50))}  p99 "
                         f"{_ratio(mine.pct(99), ref.pct(99))}")
            print("\n".join(lines[-3:]), flush=True)
            if mine.errors:
                lines.append(f"  agent errors: {mine.errors[:5]}")
    return lines


def _fresh(args: argparse.Namespace, agent: str, token: str) -> list[str]:
    lines = ["", "== fresh=1 (a census that starts after the request): agent (single flight) "
             "vs `" + " ".join(PS) + "` per request"]
    for clients in args.clients:
        before = _censuses(agent, token)
        mine = _load(clients, args.fresh_requests, args.phase_s, _client, agent, token,
                     ["/v1/snapshot?processes=0&fresh=1"])
        taken = _censuses(agent, token) - before
        ref = _load(clients, args.fresh_requests, args.phase_s, _ps_client)
        lines.append(f"  {clients:3d} clients  agent {mine.line()}  censuses taken: {taken}"
                     f" for {len(mine.latencies)} requests")
        lines.append(f"  {'':3s}          ps    {ref.line()}")
        lines.append(f"  {'':3s}          agent/ps p50 {_ratio(mine.pct(50), ref.pct(50))}  "
                     f"p99 {_ratio(mine.pct(99), ref.pct(99))}")
        print("\n".join(lines[-3:]), flush=True)
    return lines


def _soak(args: argparse.Namespace, agent: str, token: str, pid: int) -> list[str]:
    paths = ["/v1/snapshot?processes=0", "/metrics", "/v1/timeline", "/v1/snapshot",
             "/v1/snapshot?processes=0&fresh=1", "/healthz"]
    result = Result()
    deadline = time.monotonic() + args.soak_s
    threads = [threading.Thread(target=_client, args=(agent, token, paths[i:] + paths[:i],
                                                      10**9, deadline, result, 0.02))
               for i in range(4)]
    for thread in threads:
        thread.start()
    samples: list[tuple[float, float]] = []
    started = time.monotonic()
    while time.monotonic() < deadline:
        samples.append((time.monotonic() - started, _rss_mib(pid)))
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    for thread in threads:
        thread.join(120)
    samples.append((time.monotonic() - started, _rss_mib(pid)))
    # warm-up: until the timeline's retention window is full (its memory is bounded by it)
    warm_s = min(args.retention_s + 30.0, args.soak_s / 2)
    warm = [s for s in samples if s[0] >= warm_s] or samples
    start, end = warm[0][1], samples[-1][1]
    peak = max(s[1] for s in samples)
    peak_warm = max(s[1] for s in warm)
    lines = ["", f"== soak: {args.soak_s:g} s, 4 clients, a request every 20 ms each, mixed "
             f"({', '.join(paths)}); agent --retention-s {args.retention_s:g}",
             f"  {result.line()}",
             f"  agent RSS (MiB): at {samples[0][0]:.0f} s {samples[0][1]:.1f}; after warm-up "
             f"(t={warm[0][0]:.0f} s, retention full) start {start:.1f}; end {end:.1f}; max "
             f"{peak:.1f} (after warm-up {peak_warm:.1f}); growth after warm-up "
             f"{end - start:+.1f} MiB ({100 * (end - start) / start:+.1f} %)",
             "  RSS every sample: " + " ".join(f"{t:.0f}s={m:.1f}" for t, m in samples)]
    print("\n".join(lines), flush=True)
    if result.errors:
        lines.append(f"  errors: {result.errors[:5]}")
    return lines


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="4,32",
                        help="client counts, comma-separated (each <= 32, the agent's "
                        "--max-inflight; default 4,32)")
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests per cached phase (default 2000)")
    parser.add_argument("--fresh-requests", type=int, default=64,
                        help="requests per fresh=1 phase (default 64)")
    parser.add_argument("--phase-s", type=float, default=120.0,
                        help="deadline of each phase in seconds (default 120)")
    parser.add_argument("--soak-s", type=float, default=180.0,
                        help="seconds of soak (default 180; 0 = none)")
    parser.add_argument("--retention-s", type=float, default=60.0,
                        help="the agent's --retention-s (default 60: the soak outlasts it, so "
                        "the timeline's window is full and its memory at its bound)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--out", help="results file (default bench/results/agent-<date>-cpu<N>"
                        ".txt)")
    args = parser.parse_args(argv)
    try:
        args.clients = [int(x) for x in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients must be integers separated by commas, got {args.clients!r}")
    if not all(1 <= c <= 32 for c in args.clients):
        parser.error("each --clients count must be between 1 and 32 (the agent's limit)")
    if args.requests < 1 or args.fresh_requests < 1 or args.phase_s <= 0 or args.soak_s < 0 \
            or args.retention_s <= 0:
        parser.error("--requests and --fresh-requests must be >= 1, --phase-s and "
                     "--retention-s > 0, --soak-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit 1 when any request failed or a process was left behind."""
    args = _parse_args(argv)
    token = secrets.token_urlsafe(24)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    now = datetime.datetime.now(datetime.UTC)
    lines = [
        f"command: python bench/agent_bench.py {given}".rstrip(),
        f"date: {now.isoformat(timespec='seconds')}",
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        f"processes on the machine at start: "
        f"{sum(1 for e in os.listdir('/proc') if e.isdigit())}",
        "",
    ]
    print("\n".join(lines), flush=True)
    folder = Path(tempfile.mkdtemp(prefix="chaosgpu-agent-bench-"))
    started: list[subprocess.Popen[bytes]] = []
    budget = 60 + args.soak_s + 8 * args.phase_s * len(args.clients)
    try:
        agent_process, agent = _start_agent(folder, token, budget, args.retention_s)
        started.append(agent_process)
        bodies = {path: _get(agent, token, path) for path in ("/v1/snapshot?processes=0",
                                                              "/metrics")}
        reference_process, reference = _start_reference(folder, token, bodies)
        started.append(reference_process)
        lines.append(f"snapshot (processes=0) {len(bodies['/v1/snapshot?processes=0'])} bytes, "
                     f"metrics {len(bodies['/metrics'])} bytes")
        lines += _latency(args, agent, reference, token)
        lines += _fresh(args, agent, token)
        if args.soak_s:
            lines += _soak(args, agent, token, agent_process.pid)
    finally:
        left = _stop(started)
        shutil.rmtree(folder, ignore_errors=True)
    errors = sum(1 for line in lines if "errors=" in line and "errors=0" not in line)
    lines += ["", f"processes left behind: {left or 'none'}; phases with errors: {errors}"]
    print(lines[-1], flush=True)
    if not args.no_write:
        out = Path(args.out) if args.out else (
            HERE / "results" / f"agent-{now:%Y-%m-%d}-cpu{os.cpu_count()}.txt")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"\nwritten to {out}")
    return 1 if errors or left else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--reference-server":
        _reference_server(sys.argv[2], sys.argv[3], os.environ["CHAOSGPU_BENCH_TOKEN"])
        sys.exit(0)
    sys.exit(main())
