"""A process whose environment names CHAOSGPU_TAG twice goes by the first (what getenv() and
Python's os.environ read); the census took the last, so a process that calls itself "first"
was put in the scope of the tag "second" (outside trial). A real process exec'd with such an
environment (execve through libc); gone afterwards."""

import subprocess
import sys
import uuid

from proc_helpers import finish, proc_state, wait_until

from chaosgpu.node import take_census
from chaosgpu.scope import resolve_scope

EXEC_TWICE = (
    "import ctypes, sys\n"
    "libc = ctypes.CDLL(None)\n"
    "argv = (ctypes.c_char_p * 3)(b'/bin/sleep', b'60', None)\n"
    "env = (ctypes.c_char_p * 3)(('CHAOSGPU_TAG=' + sys.argv[1]).encode(),\n"
    "                            ('CHAOSGPU_TAG=' + sys.argv[2]).encode(), None)\n"
    "libc.execve(b'/bin/sleep', argv, env)\n")


def test_the_first_of_two_tags_is_the_process_tag() -> None:
    first, second = f"dup1-{uuid.uuid4().hex[:8]}", f"dup2-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, "-c", EXEC_TWICE, first, second],
                            stdin=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: _cmdline(proc.pid) == "/bin/sleep 60", 10)
        assert proc_state(proc.pid) in ("S", "R")
        census = take_census(gpu=False, fds=False)
        [entry] = [p for p in census["processes"] if p["pid"] == proc.pid]
        assert entry["tag"] == first, entry
        assert [p["pid"] for p in resolve_scope({"tag": first}, census, observe=True)] \
            == [proc.pid]
        assert resolve_scope({"tag": second}, census, observe=True) == []
    finally:
        finish(proc)


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read().rstrip(b"\0").replace(b"\0", b" ").decode()
