"""What the partition tests share: a real TCP server process (listens, optionally holds a
connection to itself), `Servers`, which starts them and kills and reaps every one at the end
(conftest's `servers` fixture), and a connect that tells a silent drop from a refusal."""

import socket
import subprocess
import sys

# a server: listens on ADDR:PORT (0: any free port), optionally also connects to itself and
# keeps that connection, prints its port, then accepts and keeps whatever connects
SERVER = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if ":" in host:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
s.bind((host, port)); s.listen(16)
kept = []
if "self" in sys.argv[3:]:
    kept.append(socket.create_connection(("127.0.0.1", s.getsockname()[1])))
    kept.append(s.accept()[0])
print(s.getsockname()[1], flush=True)
while True:
    kept.append(s.accept()[0])
"""


class Servers:
    """The processes a test starts; all killed and reaped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, host: str, port: int = 0, *extra: str, prefix: tuple[str, ...] = ()
              ) -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen([*prefix, sys.executable, "-c", SERVER, host, str(port), *extra],
                                stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.isdigit(), f"server on {host}:{port} did not start ({line!r})"
        return proc, int(line)

    def kill(self, proc: subprocess.Popen[str]) -> None:
        proc.kill()
        proc.wait(timeout=10)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)


def connect(host: str, port: int, timeout: float = 1.0) -> str:
    """connected, timeout (dropped silently) or refused."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "connected"
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
