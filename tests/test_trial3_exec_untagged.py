"""A process that carried a tag and then exec'd a program whose environment has no
CHAOSGPU_TAG is out of the tag's scope: a tag scope is "every process whose environment has
CHAOSGPU_TAG=tag" (docs/faults.md, "Scopes"), and the census reads no tag in it. Only a process
whose environment cannot be read (a zombie, an unreadable one) is recognised by the PID and
start time it had while it carried the tag. Before, any untagged process this runner had once
seen tagged (same PID and start time: an exec keeps both) stayed in scope: signal_processes
SIGKILLed it and processes_in_scope listed it with tag None.

Real processes (bash, then sleep after the exec), real signals; all gone afterwards."""

import os
import signal
import subprocess
from pathlib import Path

from proc_helpers import alive, unique, wait_until

from chaosgpu.process import actions, probes


def _tagged_env(tag: str) -> dict[str, str]:
    return {**os.environ, "CHAOSGPU_TAG": tag}


def _has_tag(pid: int, tag: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"CHAOSGPU_TAG={tag}".encode() in environ.split(b"\0")


def test_a_tagged_process_that_execs_without_the_tag_leaves_the_scope() -> None:
    tag = unique("trial3-exec")
    # tagged bash, until told to exec `sleep` without the tag (same PID, same start time)
    execer = subprocess.Popen(
        ["bash", "-c", "read line; exec env -u CHAOSGPU_TAG sleep 60"],
        env=_tagged_env(tag), stdin=subprocess.PIPE)
    member = subprocess.Popen(["sleep", "60"], env=_tagged_env(tag))
    try:
        assert wait_until(lambda: _has_tag(execer.pid, tag) and _has_tag(member.pid, tag))
        seen = {p["pid"] for p in probes.processes_in_scope({"tag": tag})}
        assert {execer.pid, member.pid} <= seen, seen  # this runner saw both tagged
        assert execer.stdin is not None
        execer.stdin.write(b"go\n")
        execer.stdin.close()
        assert wait_until(lambda: Path(f"/proc/{execer.pid}/comm").read_text().strip()
                          == "sleep" and not _has_tag(execer.pid, tag))

        listed = probes.processes_in_scope({"tag": tag})
        assert [p["pid"] for p in listed] == [member.pid], listed
        report = actions.signal_processes({"tag": tag}, "SIGKILL", wait_gone_s=5)
        assert [r["pid"] for r in report["results"]] == [member.pid], report
        assert report["wait"]["all_gone"], report
        assert member.wait(5) == -signal.SIGKILL
        assert alive(execer.pid), "the process outside the tag was killed"
    finally:
        for proc in (execer, member):
            if proc.poll() is None:
                proc.kill()
            proc.wait(5)
    assert not alive(execer.pid) and not alive(member.pid)
