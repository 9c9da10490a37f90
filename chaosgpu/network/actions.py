"""Chaos Toolkit actions: partition a training rank (or any declared processes) from the
network, and heal the partition (a rollback).

A partition silently drops every TCP packet of the target's connections in both directions, and
new connections to its listening sockets (address and port, never a port number alone; those
rules end with the target: while the runner lives it withdraws them as soon as the target has
exited, and the result's `listen_watch` says how), with nftables in the target's network
namespace: its peers see no connection reset, only silence, which is how a lost host looks to
them, and a gloo or NCCL peer then hangs instead of failing fast.
`partition_rank(..., then_kill=True)` is a node loss: the rank is partitioned, then SIGKILLed,
and its death stays invisible to its peers. This module owns these actions' public
face; the rules are chaosgpu.network.partitions, ranks are found through chaosgpu.job.observe's
selection, processes through the declared scope (chaosgpu.scope), and the kill goes through the
job actions' one signal path.
"""

from typing import Any, Dict, Optional, Union

from chaosgpu import faultlog
from chaosgpu.arguments import BOOL, MISSING_OK, NAME, RANK, TAG, Rule, checked
from chaosgpu.network import partitions
from chaosgpu.scope import SCOPE

__all__ = ["partition_rank", "partition_processes", "heal_partition", "heal_all_partitions"]


def _target(proc: dict[str, Any], rank: int | None = None,
            job: str | None = None) -> dict[str, Any]:
    return {"pid": proc["pid"], "starttime": proc["starttime"], "rank": rank, "job": job,
            "comm": proc.get("comm")}


@checked(rank=RANK, job=NAME, tag=TAG, then_kill=BOOL)
def partition_rank(rank: Union[int, str], job: Optional[str] = None, tag: Optional[str] = None,
                   then_kill: bool = False,
                   configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Partition one rank of a training job (by job id or the ranks' tag) from the network:
    drop every TCP connection it holds and new connections to its listening sockets (their
    address and port), in its network namespace, so its peers see silence and no reset. With
    `then_kill` the rank is then SIGKILLed (a node loss: its death stays invisible to its
    peers). Returns the partition's id (for heal_partition), the connections dropped and, with
    then_kill, the kill. `rank` is a number or "any" (the last live rank, as kill_rank picks
    it; the result names the rank and PID hit). Raises when the rank is not found or nothing
    could be dropped."""
    from chaosgpu.job.actions import rank_process

    census, found, proc, number = rank_process(job, tag, rank, 5.0)
    return partition_found_rank(census, found, proc, number, then_kill)


def partition_found_rank(census: Dict[str, Any], found: Dict[str, Any], proc: Dict[str, Any],
                         number: Optional[int], then_kill: bool = False) -> Dict[str, Any]:
    """Partition the rank process `proc` (rank `number`, None where no process shows it) of
    the census job `found`, as found by chaosgpu.job.actions.rank_process, and with
    `then_kill` SIGKILL it: partition_rank's work once its rank is found (fail_rank found it
    already)."""
    from chaosgpu.job.actions import _signal_process, job_helpers, job_launcher, watch_peers
    from chaosgpu.job.verdict import rank_with_pid

    target = _target(proc, number, found["id"])
    record = partitions.create(
        [target], reason=f"partition {rank_with_pid(number, proc['pid'])} of {found['id']}")
    faultlog.record("partition", job=found["id"], tag=found.get("tag"), rank=number,
                    pid=proc["pid"], starttime=proc["starttime"], partition=record["id"],
                    peers=watch_peers(census, found, proc),
                    helpers=job_helpers(census, found), launcher=job_launcher(found))
    out: dict[str, Any] = {"partition": record["id"], "job": found["id"], "rank": number,
                           "pid": proc["pid"], "connections": record["connections"],
                           "listening": record["listening"], "left_out": record["left_out"],
                           "table": record["table"],
                           "listen_watch": record["listen_watch"], "at": record["created_at"]}
    if then_kill:
        out["kill"] = _signal_process(census, found, number, proc, "SIGKILL", 2.0)
    return out


@checked(scope=SCOPE)
def partition_processes(scope: Dict[str, Any],
                        configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Partition every process of a declared scope (`{"tag": ...}`, `{"sandbox": ...}`,
    `{"pids": [...]}` ...; the scope rules refuse the host's init, the runner and other users'
    processes) from the network: their TCP connections and new connections to their listening
    sockets (address and port: never another process's socket on the same port number) are
    dropped silently; a socket a process outside the scope also listens on or shares (an
    inherited descriptor) is not, and is listed in `left_out`. Returns the partition's id and
    what was dropped. Raises when the scope matches nothing or nothing could be dropped."""
    from chaosgpu.scope import ScopeError, describe_scope, resolve_scope, validate_scope

    checked = validate_scope(scope)
    processes = resolve_scope(checked)
    if not processes:
        raise ScopeError(f"{describe_scope(checked)} matches no process: nothing partitioned")
    targets = [_target(p) for p in processes if not p.get("zombie")]
    record = partitions.create(targets, reason=f"partition {describe_scope(checked)}")
    for target in targets:
        faultlog.record("partition", pid=target["pid"], starttime=target["starttime"],
                        partition=record["id"])
    return {"partition": record["id"], "pids": [t["pid"] for t in targets],
            "connections": record["connections"], "listening": record["listening"],
            "left_out": record["left_out"], "table": record["table"],
            "listen_watch": record["listen_watch"], "at": record["created_at"]}


#: heal_partition's `partition`: the id a partition action returned
PARTITION_ID = Rule("the id a partition action returned (a non-empty string)",
                    lambda value: isinstance(value, str) and bool(value.strip())
                    and "${" not in value)


@checked(partition=PARTITION_ID, missing_ok=MISSING_OK)
def heal_partition(partition: str, missing_ok: Union[bool, str] = False,
                   configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Remove one partition (its nftables table and record) by the id partition_rank or
    partition_processes returned: for Python callers (an experiment cannot pass an earlier
    result's id: its rollback is heal_all_partitions). A partition this run made and healed
    already is a success (`removed` false). An id no partition has and this run never made is
    an error naming the partitions recorded now, unless `missing_ok` allows it (true, or
    "before-method" before the method starts: chaosgpu.arguments.missing_allowed)."""
    from chaosgpu.arguments import missing_allowed

    ident = partition.strip()
    out = partitions.remove(ident)
    if out["removed"] or out.get("table") is not None:
        return out
    if partitions.created_here(ident):
        return dict(out, note="this run's partition, healed already")
    if missing_allowed(missing_ok, False):
        return dict(out, note="no such partition, and this run made none by that id "
                              "(missing_ok)")
    recorded = sorted(p["id"] for p in partitions.active())
    raise partitions.PartitionError(
        f"no partition {ident!r}: this run made none by that id, and none is recorded; "
        f"partitions recorded now: {recorded or 'none'} (an experiment heals its own with "
        "heal_all_partitions)")


@checked(every=BOOL)
def heal_all_partitions(every: bool = False, configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Remove every partition this run made (a rollback that needs no id; safe to run twice).
    Partitions other runners made are left in place and listed under `left` (a concurrent
    game-day's fault is not lifted under it); `every=True` heals every partition recorded on
    this node whoever made it (after a crashed runner: what `chaosgpu cleanup` does). Tables
    chaosgpu did not create are never touched. Returns what was removed and what was left."""
    done = partitions.remove_all(every=every)
    return {"removed": done["removed"], "count": len(done["removed"]), "left": done["left"]}
