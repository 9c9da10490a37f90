"""Job ids that two jobs could share: a job whose master is a loopback address lives in one
network namespace, so one id seen in two namespaces (two pods each running torchrun on
127.0.0.1:29500, or with the same `--rdzv-id`) is two jobs, each id qualified by its
namespace; a non-loopback master (one job across pods) stays one job. Real processes in real
network namespaces (`unshare --net`), read by the real census."""

import contextlib
import os
import subprocess
from collections.abc import Iterator

from proc_helpers import alive, wait_until

from chaosgpu import node


def _net_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


@contextlib.contextmanager
def _ranks(*shapes: tuple[bool, dict[str, str]]) -> Iterator[list[int]]:
    """One `sleep` per shape, in a new network namespace when the shape says so, with the
    shape's environment on top of this one's; all killed and reaped at the end."""
    procs = []
    try:
        for own_namespace, env in shapes:
            command = ["unshare", "--net", "--", "sleep", "600"] if own_namespace \
                else ["sleep", "600"]
            procs.append(subprocess.Popen(command, env=dict(os.environ, **env)))
        pids = [p.pid for p in procs]
        assert wait_until(lambda: all(open(f"/proc/{pid}/comm").read() == "sleep\n"
                                      for pid in pids))
        yield pids
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _jobs_of(pids: list[int]) -> dict[str, list[int]]:
    jobs = node.take_census(gpu=False)["jobs"]
    present = {j["id"]: sorted(r["pid"] for r in j["ranks"] if r["pid"] is not None)
               for j in jobs}
    return {job_id: members for job_id, members in present.items() if set(members) & set(pids)}


def _rank(rank: int, master: str, run_id: str | None = None) -> dict[str, str]:
    address, port = master.rsplit(":", 1)
    env = {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": address, "MASTER_PORT": port}
    return env | ({"TORCHELASTIC_RUN_ID": run_id} if run_id else {})


def test_one_loopback_job_id_in_two_network_namespaces_is_two_jobs() -> None:
    master = "127.0.0.1:29517"
    with _ranks((True, _rank(0, master, "none")), (True, _rank(0, master, "none")),
                (False, _rank(1, master, "none"))) as pids:
        jobs = _jobs_of(pids)
        ids = {pid: next(i for i, members in jobs.items() if pid in members) for pid in pids}
        assert len(jobs) == 3, jobs
        assert ids[pids[0]] == f"{master}@net:{_net_inode(pids[0])}"
        assert ids[pids[1]] == f"{master}@net:{_net_inode(pids[1])}"
        assert ids[pids[2]] == f"{master}@net:{_net_inode(os.getpid())}"
    assert not [pid for pid in pids if alive(pid)]


def test_a_shared_run_id_with_a_loopback_master_is_split_by_namespace() -> None:
    with _ranks((True, _rank(0, "127.0.0.1:29518", "train")),
                (True, _rank(0, "127.0.0.1:29518", "train"))) as pids:
        jobs = _jobs_of(pids)
        assert sorted(jobs) == sorted(f"train@net:{_net_inode(pid)}" for pid in pids)
    assert not [pid for pid in pids if alive(pid)]


def test_a_job_in_one_namespace_keeps_its_plain_id() -> None:
    with _ranks((False, _rank(0, "127.0.0.1:29519", "none")),
                (False, _rank(1, "127.0.0.1:29519", "none"))) as pids:
        assert _jobs_of(pids) == {"127.0.0.1:29519": sorted(pids)}
    assert not [pid for pid in pids if alive(pid)]


def test_a_job_whose_master_is_not_loopback_spans_namespaces() -> None:
    """Two pods of one job dial the master's address: one job, whatever their namespaces."""
    with _ranks((True, _rank(0, "10.11.12.13:29520", "multi-pod")),
                (True, _rank(1, "10.11.12.13:29520", "multi-pod"))) as pids:
        assert _jobs_of(pids) == {"multi-pod": sorted(pids)}
    assert not [pid for pid in pids if alive(pid)]
