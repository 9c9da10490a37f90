"""Latency of `chaosgpu agent` on loopback: /v1/snapshot and /metrics (and /v1/timeline).

Starts the real agent (`python -m chaosgpu.cli agent`, loopback, a token from the environment)
once with the census cached (--census-ttl, default 1 s) and once without (--census-ttl 0, a new
census per request), sends a fixed number of sequential keep-alive requests per endpoint, and
prints p50/p95/p99/max in milliseconds. Writes the same text to
bench/results/agent-<UTC date>.txt with the command, date and machine.

    python bench/agent_bench.py [--requests 1000] [--concurrency 4] [--no-write]

Goal (issue 5): snapshot p50 < 5 ms on loopback. The census of the machine's processes (~10-15
ms for ~100 processes on a 2-core machine, more with thousands) dominates an uncached request:
the agent serves a census at most --census-ttl old and refreshes it in the background.
"""

import argparse
import datetime
import http.client
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]

    return (f"n={len(ordered):5d}  p50={pct(50):7.3f}  p95={pct(95):7.3f}  p99={pct(99):7.3f}  "
            f"max={ordered[-1]:7.3f}  mean={statistics.fmean(ordered):7.3f} ms")


def _start(ttl: float, token: str) -> tuple[subprocess.Popen, str]:
    ready = Path(tempfile.mkdtemp(prefix="chaosgpu-agent-bench-")) / "ready.json"
    env = dict(os.environ, CHAOSGPU_AGENT_TOKEN=token)
    process = subprocess.Popen(
        [sys.executable, "-m", "chaosgpu.cli", "agent", "--listen", "127.0.0.1:0",
         "--census-ttl", str(ttl), "--max-seconds", "600", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text():
            return process, json.loads(ready.read_text())["url"]
        if process.poll() is not None:
            raise RuntimeError(f"agent exited: {process.stderr.read().decode()[-2000:]}")
        time.sleep(0.05)
    process.kill()
    raise RuntimeError("agent did not start within 60 s")


def _run(url: str, token: str, path: str, count: int) -> list[float]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Authorization": f"Bearer {token}"}
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        body = response.read()
        latencies.append((time.perf_counter() - started) * 1000)
        if response.status != 200 or not body:
            raise RuntimeError(f"{path}: HTTP {response.status}")
    connection.close()
    return latencies


def _concurrent(url: str, token: str, path: str, count: int, threads: int) -> list[float]:
    results: list[list[float]] = [[] for _ in range(threads)]

    def work(index: int) -> None:
        results[index] = _run(url, token, path, count // threads)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)
    return [x for r in results for x in r]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests per endpoint")
    parser.add_argument("--concurrency", type=int, default=4, help="clients in the parallel run")
    parser.add_argument("--ttl", type=float, default=1.0, help="census TTL of the cached run")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")
    token = secrets.token_urlsafe(24)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"command: python bench/agent_bench.py {given}".rstrip(),
        f"date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}",
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}",
        f"processes on the machine: {sum(1 for e in os.listdir('/proc') if e.isdigit())}",
        "",
    ]
    print("\n".join(lines), flush=True)
    for ttl, label in ((args.ttl, f"census cached (--census-ttl {args.ttl:g})"),
                       (0.0, "no cache (--census-ttl 0: a census per request)")):
        process, url = _start(ttl, token)
        try:
            _run(url, token, "/v1/snapshot", 20)  # warm up (first census, imports)
            block = [f"== {label}"]
            for path in ("/v1/snapshot", "/v1/snapshot?processes=0", "/metrics",
                         "/v1/timeline"):
                count = args.requests if ttl else max(200, args.requests // 5)
                samples = _run(url, token, path, count)
                block.append(f"  {path:28s} sequential  {_percentiles(samples)}")
            for path in ("/v1/snapshot", "/metrics"):
                count = args.requests if ttl else max(200, args.requests // 5)
                samples = _concurrent(url, token, path, count, args.concurrency)
                block.append(f"  {path:28s} {args.concurrency} clients   {_percentiles(samples)}")
            print("\n".join(block), flush=True)
            lines += block
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    if not args.no_write:
        out = HERE / "results" / f"agent-{datetime.datetime.now(datetime.UTC):%Y-%m-%d}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n", encoding="utf-8")
        print(f"\nwritten to {out.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
