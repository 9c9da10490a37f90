"""Job ids that two jobs could share: a job whose master is a loopback address lives in one
network namespace, so one id seen in two namespaces (two pods each running torchrun on
127.0.0.1:29500, or with the same `--rdzv-id`) is two jobs, each id qualified by its
namespace; a non-loopback master (one job across pods) stays one job. Real processes in real
network namespaces (`unshare --net`), read by the real census."""

import contextlib
import os
import subprocess
import time
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
    assert wait_until(lambda: not [pid for pid in pids if alive(pid)])


def test_a_shared_run_id_with_a_loopback_master_is_split_by_namespace() -> None:
    with _ranks((True, _rank(0, "127.0.0.1:29518", "train")),
                (True, _rank(0, "127.0.0.1:29518", "train"))) as pids:
        jobs = _jobs_of(pids)
        assert sorted(jobs) == sorted(f"train@net:{_net_inode(pid)}" for pid in pids)
    assert wait_until(lambda: not [pid for pid in pids if alive(pid)])


def test_a_job_in_one_namespace_keeps_its_plain_id() -> None:
    with _ranks((False, _rank(0, "127.0.0.1:29519", "none")),
                (False, _rank(1, "127.0.0.1:29519", "none"))) as pids:
        assert _jobs_of(pids) == {"127.0.0.1:29519": sorted(pids)}
    assert wait_until(lambda: not [pid for pid in pids if alive(pid)])


def test_a_job_whose_master_is_not_loopback_spans_namespaces() -> None:
    """Two pods of one job dial the master's address: one job, whatever their namespaces."""
    with _ranks((True, _rank(0, "10.11.12.13:29520", "multi-pod")),
                (True, _rank(1, "10.11.12.13:29520", "multi-pod"))) as pids:
        assert _jobs_of(pids) == {"multi-pod": sorted(pids)}
    assert wait_until(lambda: not [pid for pid in pids if alive(pid)])


@contextlib.contextmanager
def _launched(*envs: dict[str, str]) -> Iterator[list[int]]:
    """One `sleep` per environment, each started by a shell of its own that does not carry it
    (as torchrun's agent does not carry its ranks' variables); yields the sleeps' PIDs. Every
    shell's session is SIGKILLed at the end."""
    shells = []
    try:
        for env in envs:
            assignments = " ".join(f"{key}={value}" for key, value in env.items())
            shells.append(subprocess.Popen(["sh", "-c", f"env {assignments} sleep 600; true"],
                                           start_new_session=True))
        pids: list[int] = []

        def started() -> bool:
            pids[:] = [int(child) for shell in shells for child in
                       open(f"/proc/{shell.pid}/task/{shell.pid}/children").read().split()]
            return len(pids) == len(shells) and all(
                open(f"/proc/{pid}/comm").read() == "sleep\n" for pid in pids)

        assert wait_until(started)
        yield list(pids)
    finally:
        for shell in shells:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, 9)
            shell.wait()


def test_one_run_id_with_two_masters_and_two_launchers_is_two_jobs() -> None:
    """Two torchruns given one `--rdzv-id` and two endpoints: two jobs, each id followed by
    its master; before, one job of four ranks in which one job's hang went unseen."""
    with _launched(_rank(0, "127.0.0.1:29521", "same"),
                   _rank(0, "127.0.0.1:29522", "same")) as pids:
        assert _jobs_of(pids) == {"same@127.0.0.1:29521": [pids[0]],
                                  "same@127.0.0.1:29522": [pids[1]]}
    assert wait_until(lambda: not [pid for pid in pids if alive(pid)])


def test_one_run_id_whose_ranks_share_a_parent_stays_one_job() -> None:
    """Ranks of one agent seen with two masters (an elastic restart moving its master): one
    job, as before."""
    with _ranks((False, _rank(0, "127.0.0.1:29523", "moving")),
                (False, _rank(1, "127.0.0.1:29524", "moving"))) as pids:
        assert _jobs_of(pids) == {"moving": sorted(pids)}
    assert wait_until(lambda: not [pid for pid in pids if alive(pid)])


def test_a_dead_rank_stays_in_its_job() -> None:
    """A zombie's namespace links are gone: a rank that died (seen alive before: the cached
    census keeps its environment) stays in its job under the plain id, never split off as a
    job of an unknown namespace."""
    master = "127.0.0.1:29525"
    live = subprocess.Popen(["sleep", "600"],
                            env=dict(os.environ, **_rank(0, master, "zombie-rank")))
    dying = subprocess.Popen(["sh", "-c", "read line; exit 3"], stdin=subprocess.PIPE,
                             env=dict(os.environ, **_rank(1, master, "zombie-rank")))
    try:
        time.sleep(2.5)  # the cache keeps processes older than 2 s
        assert _cached_ids([live.pid, dying.pid]) == {"zombie-rank"}
        assert dying.stdin is not None
        dying.stdin.close()  # it exits, unreaped: a zombie
        assert wait_until(lambda: open(f"/proc/{dying.pid}/stat").read().split(") ")[1][0] == "Z")
        jobs = node.take_census(gpu=False, cache=True)["jobs"]
        [job] = [j for j in jobs if j["id"].startswith("zombie-rank")]
        assert job["id"] == "zombie-rank"
        assert {r["pid"]: r["state"] for r in job["ranks"]} == {live.pid: "alive",
                                                               dying.pid: "zombie"}
    finally:
        live.kill()
        live.wait()
        dying.wait()
    assert wait_until(lambda: not alive(live.pid))


def _cached_ids(pids: list[int]) -> set[str]:
    """The ids of the jobs holding `pids` in a cached census (processes older than 2 s keep
    what they showed alive)."""
    jobs = node.take_census(gpu=False, cache=True)["jobs"]
    return {j["id"] for j in jobs if {r["pid"] for r in j["ranks"]} & set(pids)}
