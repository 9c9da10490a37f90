"""The sandbox supervisor: the one host process that owns a sandbox's `unshare`.

`python -m chaosgpu.sandbox.supervisor --name NAME --status-fd FD -- unshare ...` detaches from
its caller (forks, the parent exits at once so the caller never has to reap it), becomes a child
subreaper (prctl PR_SET_CHILD_SUBREAPER), starts `unshare` and identifies the sandbox's PID 1
(the child of unshare, once it has exec'd its init). It writes the sandbox's state record, then
one JSON line on FD (the record, or {"error": ...}), and from then on reaps: unshare, and any
orphan reparented to it, so tearing the namespace down never stalls on an unreaped process (see
the project notes). SIGTERM/SIGINT/SIGHUP make it SIGKILL the sandbox's PID 1; a sandbox never
outlives its supervisor (unshare has PR_SET_PDEATHSIG and --kill-child). It exits once it has no
child left. It must not signal anything but its own sandbox's PID 1.
"""

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from typing import Any

__all__ = ["main"]

PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
PID1_DEADLINE_S = 15.0


def _set_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _find_pid1(unshare_pid: int, deadline: float) -> tuple[int | None, str | None]:
    """Wait for unshare's child to exist and to have exec'd (its cmdline differs from unshare's)."""
    from chaosgpu.sandbox.runtime import children_of, read_cmdline

    unshare_cmdline = read_cmdline(unshare_pid)
    while time.monotonic() < deadline:
        pid, status = os.waitpid(unshare_pid, os.WNOHANG)
        if pid == unshare_pid:
            code = os.waitstatus_to_exitcode(status)
            return None, f"unshare exited with code {code} before the sandbox's PID 1 started"
        kids = children_of(unshare_pid)
        if kids:
            cmdline = read_cmdline(kids[0])
            if cmdline and cmdline != unshare_cmdline:
                return kids[0], None
        time.sleep(0.002)
    return None, f"the sandbox's PID 1 did not start within {PID1_DEADLINE_S:g} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chaosgpu.sandbox.supervisor")
    parser.add_argument("--name", required=True)
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--record-json", required=True, help="fields to add to the record")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if os.fork() != 0:
        os._exit(0)  # the caller reaps this parent at once; the child lives on, detached
    os.setsid()  # a daemon leads its own session: started on purpose, never counted an orphan
    status = os.fdopen(args.status_fd, "w")
    target: dict[str, int] = {}

    def _teardown(signum: int, frame: Any) -> None:
        if target:  # through the terminate primitive (pidfd, start time checked)
            from chaosgpu.sandbox.runtime import kill

            kill(target["pid"], target["starttime"])

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _teardown)
    try:
        _set_subreaper()
        supervisor_pid = os.getpid()
        unshare_pid = os.fork()
        if unshare_pid == 0:
            try:
                # unshare dies with its supervisor, and (--kill-child) the pod with unshare.
                ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                if os.getppid() != supervisor_pid:
                    os._exit(1)
                os.execvp(command[0], command)
            finally:
                os._exit(127)
        pid1, error = _find_pid1(unshare_pid, time.monotonic() + PID1_DEADLINE_S)
        if pid1 is not None:
            from chaosgpu.sandbox.runtime import process_starttime

            starttime = process_starttime(pid1)
            if starttime is not None:
                target.update(pid=pid1, starttime=starttime)
        if pid1 is None:
            status.write(json.dumps({"error": error}) + "\n")
            status.close()
            _reap_all()
            return 1
        from chaosgpu.sandbox.runtime import build_record
        from chaosgpu.state import write_record

        record = build_record(
            args.name, pid1, os.getpid(), unshare_pid, json.loads(args.record_json)
        )
        write_record("sandboxes", args.name, record)
        status.write(json.dumps(record) + "\n")
        status.close()
    except Exception as error:  # report it to the creator, then take the sandbox down
        try:
            status.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
            status.close()
        except OSError:
            pass
        _teardown(signal.SIGKILL, None)
        _reap_all()
        return 1
    _reap_all()
    return 0


def _reap_all() -> None:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())
