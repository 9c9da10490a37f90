"""Network partitions of processes with nftables: drop their TCP traffic, no reset, no trace.

A partition drops, in both directions, every packet of the TCP connections a set of processes
holds at the moment of the fault, and every new connection to the ports they listen on: their
peers see no reset and no close, only silence, the way a lost host looks to them. (A connection
the process opens after the fault is not dropped.) Rules live in a table of their own,
`inet chaosgpu_<id>`, in the network namespace of the targets (through nsenter when it is not
the runner's), and a record in the state directory (`partitions/<id>.json`) remembers them, so
a rollback, a second rollback, or `chaosgpu cleanup` after a crashed runner can remove them.
Tables of other names are never touched.

This module owns writing, listing and removing those rules. Which processes it may target is
decided by the callers (chaosgpu.network.actions, through the experiment's scope); it signals no
process. What it runs (`nft`, `nsenter`, the census in another namespace) runs without the
runner's scope variables (chaosgpu.process.environment.helper_env).
"""

import contextlib
import json
import os
import shutil
import subprocess
import time
import uuid
from typing import Any

from chaosgpu.errors import ActivityError
from chaosgpu.process.environment import helper_env
from chaosgpu.state import list_records, read_record, remove_record, write_record

__all__ = ["PartitionError", "nft_path", "connections_of", "create", "remove", "remove_all",
           "active", "table_exists"]

KIND = "partitions"
TABLE_PREFIX = "chaosgpu_"
NFT_TIMEOUT_S = 10.0


class PartitionError(ActivityError):
    """A partition that cannot be made or removed (no nft, no permission, nothing to drop)."""


def nft_path() -> str:
    """The nft executable, or PartitionError naming what to install."""
    path = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft")
                                        if os.access(p, os.X_OK)), None)
    if path is None:
        raise PartitionError("nft (nftables) is not installed: apt-get install nftables")
    return path


def _netns_of(pid: int) -> str | None:
    """The network namespace of `pid` as `net:[inode]` (the census's reader), or None."""
    from chaosgpu.node import ProcError, net_ns_inode

    try:
        return f"net:[{net_ns_inode(pid)}]"
    except ProcError:
        return None


def _run_nft(args: list[str], netns_pid: int | None, stdin: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    argv = [nft_path(), *args]
    if netns_pid is not None:
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            raise PartitionError("nsenter (util-linux) is needed to reach another network "
                                 "namespace")
        argv = [nsenter, f"--net=/proc/{netns_pid}/ns/net", "--", *argv]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                          timeout=NFT_TIMEOUT_S, env=helper_env(), stdin=None if stdin is not None
                          else subprocess.DEVNULL)


def _sockets_in(netns_pid: int | None) -> dict[int, dict[str, Any]]:
    from chaosgpu.intarget import program_path
    from chaosgpu.node import tcp_sockets

    if netns_pid is None:
        return tcp_sockets()
    nsenter = shutil.which("nsenter")
    if nsenter is None:
        raise PartitionError("nsenter (util-linux) is needed to read another network "
                             "namespace's sockets")
    out = subprocess.run([nsenter, f"--net=/proc/{netns_pid}/ns/net", "--", _python(),
                          str(program_path("probes", "node_census")), "--tcp-sockets"],
                         capture_output=True, text=True, timeout=NFT_TIMEOUT_S,
                         env=helper_env(), stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise PartitionError(f"cannot read the sockets of PID {netns_pid}'s network namespace: "
                             f"{out.stderr.strip()[-300:] or out.stdout.strip()[-300:]}")
    return {int(k): v for k, v in json.loads(out.stdout)["sockets"].items()}


def _python() -> str:
    import sys

    return sys.executable


def connections_of(pid: int, sockets: dict[int, dict[str, Any]]) -> dict[str, list[Any]]:
    """The TCP connections (local/remote address and port) and listening ports of `pid`."""
    from chaosgpu.node import process_activity

    activity = process_activity(pid, threads=False, sockets=True)
    if activity is None:
        raise PartitionError(f"PID {pid} is gone")
    if activity.get("socket_inodes") is None:
        raise PartitionError(f"cannot list the sockets of PID {pid}: "
                             f"{activity['errors'].get('socket_inodes', 'unreadable')}")
    connections, listening = [], []
    for inode in activity["socket_inodes"]:
        sock = sockets.get(inode)
        if sock is None:
            continue
        if sock["state"] == "LISTEN":
            listening.append(sock["local_port"])
        elif sock["state"] not in ("TIME_WAIT", "CLOSE"):
            connections.append((sock["local"], sock["remote"]))
    return {"connections": sorted(set(connections)), "listening": sorted(set(listening))}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _family(host: str) -> str:
    return "ip6" if ":" in host else "ip"


def _rules(connections: list[tuple[str, str]], listening: list[int]) -> list[str]:
    rules = []
    for local, remote in connections:
        (lhost, lport), (rhost, rport) = _split(local), _split(remote)
        family = _family(lhost)
        rules.append(f"{family} saddr {lhost} {family} daddr {rhost} tcp sport {lport} "
                     f"tcp dport {rport} drop")
        rules.append(f"{family} saddr {rhost} {family} daddr {lhost} tcp sport {rport} "
                     f"tcp dport {lport} drop")
    for port in listening:
        rules.append(f"tcp dport {port} drop")
    return rules


def _script(table: str, rules: list[str]) -> str:
    body = "\n".join(f"    {rule}" for rule in rules)
    return (f"table inet {table} {{\n"
            f"  chain input {{\n    type filter hook input priority -150; policy accept;\n"
            f"{body}\n  }}\n"
            f"  chain output {{\n    type filter hook output priority -150; policy accept;\n"
            f"{body}\n  }}\n}}\n")


def create(targets: list[dict[str, Any]], reason: str = "") -> dict[str, Any]:
    """Partition `targets` (`[{"pid", "starttime", ...}]`, all in one network namespace): drop
    every TCP connection they hold and new connections to their listening ports. Returns the
    record (id, table, rules, connections). Raises PartitionError when nothing can be dropped
    (no TCP connection, no permission, no nft)."""
    from chaosgpu.node import process_starttime

    if not targets:
        raise PartitionError("no process to partition")
    namespaces = {_netns_of(t["pid"]) for t in targets}
    if None in namespaces or len(namespaces) != 1:
        raise PartitionError("the targets' network namespaces cannot be read, or differ: "
                             "partition processes of one namespace at a time")
    netns = namespaces.pop()
    netns_pid = None if netns == _netns_of(os.getpid()) else targets[0]["pid"]
    sockets = _sockets_in(netns_pid)
    connections: list[tuple[str, str]] = []
    listening: list[int] = []
    for target in targets:
        if target.get("starttime") is None or \
                process_starttime(target["pid"]) != target["starttime"]:
            raise PartitionError(f"PID {target['pid']} is not the process it was (gone, or "
                                 "its PID was reused): nothing partitioned")
        found = connections_of(target["pid"], sockets)
        connections.extend(tuple(c) for c in found["connections"])
        listening.extend(found["listening"])
    rules = _rules(sorted(set(connections)), sorted(set(listening)))
    if not rules:
        raise PartitionError("the targets hold no TCP connection and listen on no TCP port: "
                             "a partition would drop nothing")
    ident = uuid.uuid4().hex[:10]
    table = TABLE_PREFIX + ident
    record = {"id": ident, "table": table, "netns": netns, "netns_pid": netns_pid,
              "targets": targets, "connections": sorted(set(connections)),
              "listening": sorted(set(listening)), "rules": rules,
              "created_at": time.time(), "reason": reason,
              "runner": {"pid": os.getpid(), "starttime": process_starttime(os.getpid())}}
    write_record(KIND, ident, record)  # first: a crash after nft still leaves a record
    out = _run_nft(["-f", "-"], netns_pid, _script(table, rules))
    if out.returncode != 0:
        remove_record(KIND, ident)
        raise PartitionError(f"nft refused the partition rules: {out.stderr.strip()[-400:]}"
                             + (" (needs root: CAP_NET_ADMIN)" if os.geteuid() != 0 else ""))
    return record


def table_exists(record: dict[str, Any]) -> bool | None:
    """Whether the record's table is in place (None: its namespace is gone or unreachable)."""
    netns_pid = record.get("netns_pid")
    if netns_pid is not None and _netns_of(netns_pid) != record.get("netns"):
        return None
    try:
        out = _run_nft(["list", "table", "inet", record["table"]], netns_pid)
    except (PartitionError, OSError, subprocess.TimeoutExpired):
        return None
    return out.returncode == 0


def remove(ident: str) -> dict[str, Any]:
    """Remove partition `ident` (its table, then its record). Idempotent: an unknown id or a
    table already gone is reported, not raised. Raises PartitionError when nft refuses."""
    record = read_record(KIND, ident)
    if record is None:
        return {"id": ident, "removed": False, "note": "no such partition (already healed?)"}
    netns_pid = record.get("netns_pid")
    if netns_pid is not None and _netns_of(netns_pid) != record.get("netns"):
        remove_record(KIND, ident)
        return {"id": ident, "removed": False,
                "note": "its network namespace is gone, and its rules with it"}
    if not str(record.get("table", "")).startswith(TABLE_PREFIX):
        raise PartitionError(f"record {ident} names table {record.get('table')!r}, not one of "
                             "chaosgpu's: refused")
    out = _run_nft(["delete", "table", "inet", record["table"]], netns_pid)
    if out.returncode != 0 and table_exists(record):
        raise PartitionError(f"nft could not delete table {record['table']}: "
                             f"{out.stderr.strip()[-300:]}")
    remove_record(KIND, ident)
    return {"id": ident, "removed": out.returncode == 0, "table": record["table"],
            "healed_at": time.time(),
            "note": None if out.returncode == 0 else "its table was already gone"}


def remove_all() -> list[dict[str, Any]]:
    """Remove every recorded partition; tries all, then raises with every failure."""
    results, failures = [], []
    for ident in list_records(KIND):
        try:
            results.append(remove(ident))
        except (PartitionError, OSError, subprocess.TimeoutExpired) as error:
            failures.append(f"{ident}: {error}")
    if failures:
        raise PartitionError("could not remove every partition: " + "; ".join(failures))
    return results


def active() -> list[dict[str, Any]]:
    """The recorded partitions (their tables are assumed in place: checking costs an nft run;
    use table_exists for that)."""
    records = []
    for record in list_records(KIND).values():
        with contextlib.suppress(KeyError):
            records.append({"id": record["id"], "table": record["table"],
                            "netns": record.get("netns"), "netns_pid": record.get("netns_pid"),
                            "targets": record.get("targets", []),
                            "created_at": record.get("created_at")})
    return records
