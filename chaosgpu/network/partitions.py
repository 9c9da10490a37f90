"""Network partitions of processes with nftables: drop their TCP traffic, no reset, no trace.

A partition drops, in both directions, every packet of the TCP connections a set of processes
holds at the moment of the fault (exact address and port pairs), and every new connection to the
sockets they listen on (its opening packet, a SYN without ACK, to the listening address and port:
a specific address, or any address of the namespace for a wildcard listener; never a port number
alone, so another process using the same port number on another address, or connecting out to
another host, is not touched; nor is an established connection on that port that a process
outside the targets holds, such as a forked child's accepted connection; a port
that a process outside the targets also listens on, or a socket a target shares with an outside
process (an inherited or passed descriptor, found by socket inode in every process's open
files), is left out and reported): their peers see
no reset and no close, only silence, the way a lost host looks to them. (A connection the
process opens after the fault is not dropped.) Rules live in a table of their own,
`inet chaosgpu_<id>`, in the network namespace of the targets (through nsenter when it is not
the runner's), and a record in the state directory (`partitions/<id>.json`) remembers them and
the namespace (its inode), so a rollback, a second rollback, or `chaosgpu cleanup` after a
crashed runner can remove them, reaching the namespace through any process, open file or mount
that still holds it (the target itself may be dead: a node loss). Tables of other names are never
touched.

The listening-socket rules last as long as their targets: once every target has ended, the
partition's liveness check withdraws them, since the port may be reused by anyone; the connection
rules stay until healed (a dead rank's peers must keep seeing silence, not a reset), and a
partition left with no rule is healed. While the runner that made a partition with listening
rules lives, a watcher thread of its own (daemon, `chaosgpu-partition-watch-<id>`) waits on
pidfds of the targets (each opened, then its start time checked: a reused PID counts as ended)
and runs that check as soon as every target has exited; it stops when the partition is healed.
Its errors are logged and kept in the record (`listen_watch_error`), never raised into another
thread. Where pidfds cannot be opened (an old kernel, no permission), the record says so
(`listen_watch`) and the check runs at the next look: `active()`, used by the probes, the job
observer, and every heal (as it also does after the runner has ended). Each record names its
runner; `remove_all` heals this runner's partitions unless told to heal every one.

This module owns writing, listing and removing those rules. Which processes it may target is
decided by the callers (chaosgpu.network.actions, through the experiment's scope); it signals no
process. What it runs (`nft`, `nsenter`, the census in another namespace) runs without the
runner's scope variables (chaosgpu.process.environment.helper_env).
"""

import contextlib
import json
import logging
import os
import select
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from chaosgpu.errors import ActivityError
from chaosgpu.process.environment import helper_env
from chaosgpu.state import list_records, read_record, remove_record, write_record

__all__ = ["PartitionError", "NamespaceGone", "nft_path", "connections_of", "create", "remove",
           "remove_all", "active", "table_exists", "created_here", "runner_identity",
           "targets_alive"]

KIND = "partitions"
TABLE_PREFIX = "chaosgpu_"
NFT_TIMEOUT_S = 10.0
WATCH_THREAD = "chaosgpu-partition-watch-"  # + the partition's id: its watcher thread's name
WATCH_RECHECK_S = 5.0  # how often a watcher looks whether another process healed its partition

logger = logging.getLogger("chaostoolkit")

# This runner's changes to existing records and tables (a watcher's withdraw, active()'s, heals):
# one at a time, so a heal and a withdraw never interleave (a healed record written back).
_LOCK = threading.RLock()


class PartitionError(ActivityError):
    """A partition that cannot be made or removed (no nft, no permission, nothing to drop)."""


def nft_path() -> str:
    """The nft executable, or PartitionError naming what to install."""
    path = shutil.which("nft") or next((p for p in ("/usr/sbin/nft", "/sbin/nft")
                                        if os.access(p, os.X_OK)), None)
    if path is None:
        raise PartitionError("nft (nftables) is not installed: apt-get install nftables")
    return path


def _netns_inode(netns: str | None) -> int | None:
    """The inode of a recorded `net:[inode]`, or None."""
    if not isinstance(netns, str) or not netns.startswith("net:[") or not netns.endswith("]"):
        return None
    try:
        return int(netns[5:-1])
    except ValueError:
        return None


def _netns_candidates(pid_hint: int | None, denied: list[str]) -> Iterator[str]:
    """Paths that may hold a network namespace, cheapest first: the recorded PID, the named
    namespaces (`ip netns`), every process's namespace, every open namespace file, and every
    nsfs mount of every mount namespace. What could not be read for lack of permission is
    appended to `denied`."""
    if pid_hint is not None:
        yield f"/proc/{pid_hint}/ns/net"
    for name in sorted(_listdir("/run/netns", denied)):
        yield f"/run/netns/{name}"
    pids = [name for name in _listdir("/proc", denied) if name.isdigit()]
    for pid in pids:
        yield f"/proc/{pid}/ns/net"
    for pid in pids:
        for fd in _listdir(f"/proc/{pid}/fd", denied):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if os.readlink(path).startswith("net:["):
                    yield path
            except PermissionError:
                denied.append(path)
            except OSError:
                continue
    seen_mnt: set[str] = set()
    for pid in pids:
        try:
            mnt = os.readlink(f"/proc/{pid}/ns/mnt")
            if mnt in seen_mnt:
                continue
            seen_mnt.add(mnt)
            with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as handle:
                lines = handle.read().splitlines()
        except PermissionError:
            denied.append(f"/proc/{pid}/mountinfo")
            continue
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 4 and fields[3].startswith("net:["):
                yield f"/proc/{pid}/root{fields[4]}"


def _listdir(path: str, denied: list[str]) -> list[str]:
    try:
        return os.listdir(path)
    except PermissionError:
        denied.append(path)
        return []
    except OSError:
        return []


@contextlib.contextmanager
def _netns_fd(record: dict[str, Any]) -> Iterator[int | None]:
    """An open file of the record's network namespace (None: it is the runner's own), found
    through any process, open file or mount that holds it and checked by inode; PartitionError
    when nothing on this node holds it any more (`gone`) or the record names none."""
    if record.get("netns") is None or _netns_of(os.getpid()) == record["netns"]:
        yield None  # a record naming no namespace: the runner's own (a bare table check)
        return
    inode = _netns_inode(record.get("netns"))
    if inode is None:
        raise PartitionError(f"partition {record.get('id')}: its record names network namespace "
                             f"{record.get('netns')!r}: cannot tell where its table is")
    held = _HELD.get(str(record.get("id")))
    if held is not None and os.fstat(held).st_ino == inode:
        yield held  # the namespace as this runner opened it at partition time
        return
    denied: list[str] = []
    for path in _netns_candidates(record.get("netns_pid"), denied):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except PermissionError:
            denied.append(path)
            continue
        except OSError:
            continue
        try:
            if os.fstat(fd).st_ino != inode:
                continue
            yield fd
            return
        finally:
            os.close(fd)
    if denied:  # not everything could be looked at: the namespace may live on, unreachable
        why = ("needs root" if os.geteuid() != 0 else "refused even to root here: a security "
               "module or the process's own protection")
        raise PartitionError(f"network namespace {record['netns']} of partition "
                             f"{record.get('id')} cannot be reached: {len(denied)} place(s) that "
                             f"may hold it are not readable (e.g. {denied[0]}; {why}); "
                             "the partition is kept")
    raise NamespaceGone(f"no process, open file or mount of this node holds network namespace "
                        f"{record['netns']} any more: it is gone, and table {record.get('table')} "
                        "with it")


_HELD: dict[str, int] = {}  # partition id -> this runner's open file of its namespace


def _hold_netns(ident: str, pid: int, netns: str) -> None:
    """Keep the target's network namespace open for this runner's heals (the target may die
    first: a node loss); checked by inode. Nothing is held when it cannot be opened."""
    try:
        fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    if f"net:[{os.fstat(fd).st_ino}]" != netns:
        os.close(fd)
        return
    _HELD[ident] = fd


def _release_netns(ident: str) -> None:
    with _LOCK:  # never under a withdraw that is using it
        fd = _HELD.pop(ident, None)
        if fd is not None:
            os.close(fd)


class NamespaceGone(PartitionError):
    """The partition's network namespace is held by nothing on this node: gone with its rules."""


def _netns_of(pid: int) -> str | None:
    """The network namespace of `pid` as `net:[inode]` (the census's reader), or None."""
    from chaosgpu.node import ProcError, net_ns_inode

    try:
        return f"net:[{net_ns_inode(pid)}]"
    except ProcError:
        return None


def _run_nft(args: list[str], netns_fd: int | None, stdin: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    """nft with `args`, in the network namespace open as `netns_fd` (None: the runner's)."""
    argv = [nft_path(), *args]
    pass_fds: tuple[int, ...] = ()
    if netns_fd is not None:
        nsenter = shutil.which("nsenter")
        if nsenter is None:
            raise PartitionError("nsenter (util-linux) is needed to reach another network "
                                 "namespace")
        argv = [nsenter, f"--net=/proc/self/fd/{netns_fd}", "--", *argv]
        pass_fds = (netns_fd,)
    return subprocess.run(argv, input=stdin, capture_output=True, text=True,
                          timeout=NFT_TIMEOUT_S, env=helper_env(), pass_fds=pass_fds,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


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
    """The TCP connections (local/remote address and port), listening ports, listening sockets
    (`address:port`) and socket inodes of `pid`."""
    from chaosgpu.node import process_activity

    activity = process_activity(pid, threads=False, sockets=True)
    if activity is None:
        raise PartitionError(f"PID {pid} is gone")
    if activity.get("socket_inodes") is None:
        raise PartitionError(f"cannot list the sockets of PID {pid}: "
                             f"{activity['errors'].get('socket_inodes', 'unreadable')}")
    connections, listening, bound, inodes = [], [], [], []
    for inode in activity["socket_inodes"]:
        sock = sockets.get(inode)
        if sock is None:
            continue
        inodes.append(inode)
        if sock["state"] == "LISTEN":
            listening.append(sock["local_port"])
            bound.append(sock["local"])
        elif sock["state"] not in ("TIME_WAIT", "CLOSE"):
            connections.append((sock["local"], sock["remote"]))
    return {"connections": sorted(set(connections)), "listening": sorted(set(listening)),
            "listening_sockets": sorted(set(bound)), "inodes": sorted(set(inodes))}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host.lower().startswith("::ffff:") and "." in host:  # an IPv4 peer of an IPv6 socket
        host = host[7:]
    return host, int(port)


def _family(host: str) -> str:
    return "ip6" if ":" in host else "ip"


WILDCARDS = ("0.0.0.0", "::")


def _overlaps(a: str, b: str) -> bool:
    """Whether two listening addresses (host parts) may receive the same packets."""
    return a == b or a in WILDCARDS or b in WILDCARDS


def _listen_rules(listening: list[str], others: list[dict[str, Any]]
                  ) -> tuple[list[str], list[dict[str, Any]]]:
    """Rules dropping new connections to the targets' listening sockets (`address:port`; the
    table applies them to a connection's opening packet only, NEW_CONNECTION): a
    specific address is matched with its port; a wildcard with its port and any local address of
    the namespace (`fib daddr type local`: never a connection out to another host). A socket a
    process outside the targets also listens on (`others`: `{"local", "pids", "same"}`, `same`
    when that process holds the target's very socket, an inherited or passed descriptor) at an
    address that may overlap is left out and returned, with why and those PIDs."""
    rules: list[str] = []
    left_out: list[dict[str, Any]] = []
    for address in listening:
        host, port = _split(address)
        shared = [o for o in others
                  if _split(o["local"])[1] == port and _overlaps(_split(o["local"])[0], host)]
        if shared:
            pids = sorted({pid for o in shared for pid in o["pids"]})
            left_out.append({"listening": address, "pids": pids, "reason": (
                "a process outside the partition also listens on "
                + ", ".join(sorted(_held_by(o) for o in shared))
                + ": a rule would drop its connections too")})
            continue
        if host == "0.0.0.0":
            rules.append(f"meta nfproto ipv4 fib daddr type local tcp dport {port} drop")
        elif host == "::":
            rules.append(f"fib daddr type local tcp dport {port} drop")
        else:
            family = _family(host)
            rules.append(f"{family} daddr {host} tcp dport {port} drop")
    return rules, left_out


def _held_by(other: dict[str, Any]) -> str:
    """`address:port (PID 12 (comm), ...)` for a left_out reason."""
    who = ", ".join(_who(pid) for pid in other["pids"]) or "no process this runner can see"
    same = ", the target's own socket, shared with it" if other.get("same") else ""
    return f"{other['local']} ({who}{same})"


def _who(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as handle:
            return f"PID {pid} ({handle.read().strip()})"
    except OSError:
        return f"PID {pid}"


def _outside_holders(inodes: set[int], targets: set[int]
                     ) -> tuple[dict[int, list[int]], list[int]]:
    """Which processes other than `targets` hold any of the socket `inodes` (inode -> their
    PIDs), from every process's open files: a socket a target shares with an outside process (a
    forked parent or child, a passed descriptor) is that process's too. Also returns the PIDs
    whose open files could not be read (no permission): they may hold one unseen."""
    held: dict[int, set[int]] = {}
    unreadable: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in targets:
            continue
        fd_dir = f"/proc/{name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            unreadable.append(int(name))
            continue
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inode = int(link[8:-1])
                if inode in inodes:
                    held.setdefault(inode, set()).add(int(name))
    return {inode: sorted(pids) for inode, pids in held.items()}, sorted(unreadable)


def _connection_rules(connections: list[tuple[str, str]]) -> list[str]:
    rules = []
    for local, remote in connections:
        (lhost, lport), (rhost, rport) = _split(local), _split(remote)
        family = _family(lhost)
        rules.append(f"{family} saddr {lhost} {family} daddr {rhost} tcp sport {lport} "
                     f"tcp dport {rport} drop")
        rules.append(f"{family} saddr {rhost} {family} daddr {lhost} tcp sport {rport} "
                     f"tcp dport {lport} drop")
    return rules


# A listening rule drops a connection's opening packet only (a SYN without ACK; stateless, no
# conntrack): an established connection on that port held by a process outside the targets (a
# forked child that kept an accepted connection) keeps flowing. In both chains every other
# packet leaves the table before the listening rules (this accept ends this table's chain only);
# the targets' own connections are dropped before it, by their connection rules.
NEW_CONNECTION = "tcp flags & (syn | ack) == syn"
_NOT_NEW = "tcp flags & (syn | ack) != syn accept"


def _script(table: str, connection_rules: list[str], listen_rules: list[str],
            replace: bool = False) -> str:
    rules = [*connection_rules, *([_NOT_NEW, *listen_rules] if listen_rules else [])]
    body = "\n".join(f"    {rule}" for rule in rules)
    flush = f"flush table inet {table}\n" if replace else ""
    return (f"{flush}table inet {table} {{\n"
            f"  chain input {{\n    type filter hook input priority -150; policy accept;\n"
            f"{body}\n  }}\n"
            f"  chain output {{\n    type filter hook output priority -150; policy accept;\n"
            f"{body}\n  }}\n}}\n")


_CREATED: set[str] = set()


def runner_identity() -> dict[str, Any]:
    """This runner ({pid, starttime}), as partition records name the runner that made them."""
    from chaosgpu.node import process_starttime

    return {"pid": os.getpid(), "starttime": process_starttime(os.getpid())}


def created_here(ident: str) -> bool:
    """Whether this runner (this process) made partition `ident` (healed since or not)."""
    return ident in _CREATED


def made_here(record: dict[str, Any]) -> bool:
    """Whether this runner made the partition of `record` (an entry of `active()` or a record)."""
    return record.get("id") in _CREATED or record.get("runner") == runner_identity()


def runner_alive(record: dict[str, Any]) -> bool:
    """Whether the runner that made the partition of `record` still runs (its PID with the
    start time recorded; a record naming no runner has none alive)."""
    from chaosgpu.node import process_starttime

    runner = record.get("runner") or {}
    return runner.get("pid") is not None and \
        process_starttime(runner["pid"]) == runner.get("starttime")


def create(targets: list[dict[str, Any]], reason: str = "") -> dict[str, Any]:
    """Partition `targets` (`[{"pid", "starttime", ...}]`, all in one network namespace): drop
    every TCP connection they hold and new connections to their listening sockets (their
    address and port, never the port number alone; a SYN without ACK only, `listen_match`, so
    an established connection on that port held outside the targets is not touched). Returns
    the record (id, table, rules, the
    connections and listening ports and sockets dropped, `left_out`: listening sockets and
    connections not dropped because a process outside the targets also listens there or holds
    the very socket, each with those PIDs and why; `sharing_unchecked`: PIDs whose open files
    could not be read). Raises PartitionError when nothing can be dropped (no TCP connection, no
    permission, no nft)."""
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
    bound: list[str] = []
    inodes: set[int] = set()
    for target in targets:
        if target.get("starttime") is None or \
                process_starttime(target["pid"]) != target["starttime"]:
            raise PartitionError(f"PID {target['pid']} is not the process it was (gone, or "
                                 "its PID was reused): nothing partitioned")
        found = connections_of(target["pid"], sockets)
        connections.extend(tuple(c) for c in found["connections"])
        listening.extend(found["listening"])
        bound.extend(found["listening_sockets"])
        inodes.update(found["inodes"])
    listen_inodes = {i for i, s in sockets.items() if s.get("state") == "LISTEN"}
    outside, unchecked = _outside_holders(inodes | listen_inodes,
                                          {int(t["pid"]) for t in targets})
    if unchecked:
        logger.warning("chaosgpu: partition: the open files of %d process(es) cannot be read "
                       "(e.g. PID %d): a socket they share with a target cannot be seen",
                       len(unchecked), unchecked[0])
    # a socket a target shares with an outside process is that process's too: never dropped
    others = [{"local": s["local"], "pids": outside.get(i, []), "same": i in inodes}
              for i, s in sorted(sockets.items())
              if i in listen_inodes and (i not in inodes or i in outside)]
    left_out: list[dict[str, Any]] = []
    for inode in sorted(inodes & set(outside)):
        sock = sockets[inode]
        pair = (sock["local"], sock["remote"])
        if sock["state"] in ("LISTEN", "TIME_WAIT", "CLOSE") or pair not in connections:
            continue
        connections = [c for c in connections if c != pair]
        left_out.append({"connection": list(pair), "pids": outside[inode], "reason": (
            f"{', '.join(_who(p) for p in outside[inode])}, outside the partition, holds this "
            "same connection (a shared descriptor): a rule would drop its traffic too")})
    connection_rules = _connection_rules(sorted(set(connections)))
    listen_rules, listen_left = _listen_rules(sorted(set(bound)), others)
    left_out.extend(listen_left)
    kept = {x["listening"] for x in listen_left}
    bound = [b for b in bound if b not in kept]  # what is dropped, no more
    listening = [_split(b)[1] for b in bound]
    rules = connection_rules + listen_rules
    if not rules:
        raise PartitionError("the targets hold no TCP connection and listen on no TCP port "
                             "of their own: a partition would drop nothing"
                             + (f" ({'; '.join(x['reason'] for x in left_out)})"
                                if left_out else ""))
    ident = uuid.uuid4().hex[:10]
    table = TABLE_PREFIX + ident
    pidfds, watch = _target_pidfds(targets) if listen_rules else ([], None)
    record = {"id": ident, "table": table, "netns": netns, "netns_pid": netns_pid,
              "targets": targets, "connections": sorted(set(connections)),
              "listening": sorted(set(listening)), "listening_sockets": sorted(set(bound)),
              "left_out": left_out, "rules": rules, "connection_rules": connection_rules,
              "listen_rules": listen_rules,
              "listen_match": NEW_CONNECTION if listen_rules else None,
              "created_at": time.time(), "reason": reason,
              "runner": runner_identity(), "listen_watch": watch,
              "sharing_unchecked": unchecked}
    _CREATED.add(ident)
    if netns_pid is not None and netns is not None:
        _hold_netns(ident, netns_pid, netns)
    try:
        write_record(KIND, ident, record)  # first: a crash after nft still leaves a record
        with _netns_fd(record) as fd:
            out = _run_nft(["-f", "-"], fd, _script(table, connection_rules, listen_rules))
    except BaseException:
        _close(pidfds)
        raise
    if out.returncode != 0:
        _close(pidfds)
        remove_record(KIND, ident)
        _release_netns(ident)
        raise PartitionError(f"nft refused the partition rules: {out.stderr.strip()[-400:]}"
                             + (" (needs root: CAP_NET_ADMIN)" if os.geteuid() != 0 else ""))
    if watch is not None and watch["by"] == "pidfd":
        _start_watch(ident, pidfds)
    return record


def _close(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _target_pidfds(targets: list[dict[str, Any]]) -> tuple[list[int], dict[str, Any]]:
    """Pidfds of the targets that still run, each opened and then its start time checked (a
    target gone, or whose PID is another process's now, has ended: it gets none), and how the
    listening rules will be withdrawn (the record's `listen_watch`): by this runner's watcher
    on those pidfds, or, where pidfds cannot be opened here, by the liveness check at the next
    look (none opened then)."""
    from chaosgpu.node import process_starttime

    fds: list[int] = []
    for target in targets:
        pid, starttime = target.get("pid"), target.get("starttime")
        if pid is None or starttime is None:
            continue  # no identity to check: never watched (the liveness check counts it ended)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue  # gone already
        except (OSError, AttributeError) as error:  # ENOSYS (before Linux 5.3), EPERM ...
            _close(fds)
            return [], {"by": "liveness check", "note": (
                f"pidfd_open is unavailable here ({error}): the listening rules are withdrawn "
                "by the liveness check at the next look once every target has ended (a probe, "
                "the job observer, a heal), not as soon as they end")}
        if process_starttime(pid) != starttime:  # gone, or its PID reused: never watch that
            os.close(fd)
            continue
        fds.append(fd)
    return fds, {"by": "pidfd", "note": (
        "this runner's watcher withdraws the listening rules as soon as every target has "
        "ended (while the runner lives; after it, the liveness check at the next look)")}


class _Watch:
    """One partition's watcher: its thread, and the pipe end whose closing stops it."""

    def __init__(self, thread: threading.Thread, stop: threading.Event, wake: int) -> None:
        self.thread, self.stop, self.wake = thread, stop, wake


_WATCHES: dict[str, _Watch] = {}  # partition id -> its watcher in this runner


def _start_watch(ident: str, pidfds: list[int]) -> None:
    """Start partition `ident`'s watcher on `pidfds` (it owns and closes them)."""
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
    stop = threading.Event()
    thread = threading.Thread(target=_watch, args=(ident, pidfds, wake_r, stop),
                              name=WATCH_THREAD + ident, daemon=True)
    _WATCHES[ident] = _Watch(thread, stop, wake_w)
    try:
        thread.start()
    except BaseException:
        _WATCHES.pop(ident, None)
        _close([*pidfds, wake_r, wake_w])
        raise


def _stop_watch(ident: str) -> None:
    """Stop partition `ident`'s watcher (its partition is healed), and wait for it to end
    unless it is the caller."""
    watch = _WATCHES.pop(ident, None)
    if watch is None:
        return
    watch.stop.set()
    os.close(watch.wake)  # its read end turns readable: the watcher wakes and ends
    if watch.thread is not threading.current_thread():
        watch.thread.join(timeout=NFT_TIMEOUT_S)


def _watch(ident: str, pidfds: list[int], wake: int, stop: threading.Event) -> None:
    """A watcher thread: wait until every target's pidfd is readable (it exited: a zombie's
    sockets are closed already), then run the liveness check on the record as it is now.
    Ends when the partition is healed (`wake` readable, or its record gone). Never raises: an
    error is logged and kept in the record (`listen_watch_error`), where active() reports it."""
    try:
        if _wait_ended(ident, pidfds, wake, stop):
            _check_after_exit(ident, stop)
    except Exception as error:  # kept for active() and logged, never lost in this thread
        _keep_watch_error(ident, f"{type(error).__name__}: {error}", stop)
    finally:
        _close([*pidfds, wake])


def _wait_ended(ident: str, pidfds: list[int], wake: int, stop: threading.Event) -> bool:
    """Whether every pidfd turned readable before the partition was healed."""
    poller = select.poll()
    for fd in (*pidfds, wake):
        poller.register(fd, select.POLLIN)
    waiting = set(pidfds)
    while waiting:
        ready = poller.poll(int(WATCH_RECHECK_S * 1000))
        if stop.is_set() or any(fd == wake for fd, _ in ready):
            return False
        if not ready and read_record(KIND, ident) is None:  # healed by another process
            return False
        for fd, _ in ready:
            poller.unregister(fd)
            waiting.discard(fd)
    return True


def _check_after_exit(ident: str, stop: threading.Event) -> None:
    """The liveness check on the freshly read record, under this runner's lock (given up to a
    heal that stops this watcher meanwhile). The kernel tells a pidfd before /proc may show the
    exit: the check is tried again for up to a second before its failure is kept."""
    for _ in range(20):
        if not _acquire(stop):
            return
        try:
            record = read_record(KIND, ident)
            if stop.is_set() or record is None:
                return
            checked = _withdraw_listen_rules(record)
            if checked is None or checked.get("listen_withdrawn_at") is not None:
                return
        finally:
            _LOCK.release()
        time.sleep(0.05)
    _keep_watch_error(ident, "every target's pidfd says it ended, yet a target still looks "
                             "alive in /proc: the listening rules are left to the liveness "
                             "check at the next look", stop)


def _acquire(stop: threading.Event) -> bool:
    """Take this runner's lock for a watcher, unless its partition is healed meanwhile (a heal
    holding the lock waits for the watcher to end)."""
    while not _LOCK.acquire(timeout=0.05):
        if stop.is_set():
            return False
    return True


def _keep_watch_error(ident: str, error: str, stop: threading.Event) -> None:
    """Log a watcher's failure and keep it in the partition's record (if it still has one)."""
    logger.warning("chaosgpu: the watcher of partition %s could not withdraw its listening "
                   "rules once its targets ended: %s (the liveness check at the next look "
                   "tries again)", ident, error)
    if not _acquire(stop):
        return
    try:
        record = read_record(KIND, ident)
        if record is not None and not stop.is_set():
            write_record(KIND, ident, dict(record, listen_watch_error=error))
    except (OSError, ValueError) as failure:
        logger.warning("chaosgpu: partition %s: its watcher's error could not be recorded: %s",
                       ident, failure)
    finally:
        _LOCK.release()


def table_exists(record: dict[str, Any]) -> bool | None:
    """Whether the record's table is in place (None: its namespace is gone or unreachable)."""
    try:
        with _netns_fd(record) as fd:
            out = _run_nft(["list", "table", "inet", record["table"]], fd)
    except (PartitionError, OSError, subprocess.TimeoutExpired):
        return None
    return out.returncode == 0


def _zombie(pid: int) -> bool:
    """Whether `pid` has exited and waits to be reaped (its sockets are closed already)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] == b"Z"


def targets_alive(record: dict[str, Any]) -> bool:
    """Whether any of the record's targets is still the process it was, and running (a zombie
    has ended: its sockets are closed)."""
    from chaosgpu.node import process_starttime

    return any(t.get("starttime") is not None and t.get("pid") is not None
               and process_starttime(t["pid"]) == t["starttime"] and not _zombie(t["pid"])
               for t in record.get("targets", []))


def _withdraw_listen_rules(record: dict[str, Any]) -> dict[str, Any] | None:
    """The liveness check: once every target has ended, drop the listening-socket rules (the
    port is anyone's now); keep the connection rules (the dead target's peers must keep seeing
    silence); heal a partition left with no rule. Returns the record as it is now (None: healed,
    record removed). Raises PartitionError when nft refuses. Run by active() and by the
    partition's watcher (create), one at a time in this runner, on the record as it is then."""
    with _LOCK:
        current = read_record(KIND, str(record.get("id")))  # a watcher or heal may have run
        return None if current is None else _withdraw_locked(current)


def _withdraw_locked(record: dict[str, Any]) -> dict[str, Any] | None:
    if record.get("listen_withdrawn_at") is not None or targets_alive(record):
        return record
    if "connection_rules" not in record:  # an older record: its rules mix both kinds
        keep = [r for r in record.get("rules", []) if " saddr " in r]
    else:
        keep = list(record["connection_rules"])
    if not keep:
        remove(record["id"])
        return None
    if sorted(keep) == sorted(record.get("rules", [])):  # nothing listened: nothing to withdraw
        record = dict(record, listen_withdrawn_at=time.time())
        write_record(KIND, record["id"], record)
        return record
    if not str(record.get("table", "")).startswith(TABLE_PREFIX):
        raise PartitionError(f"record {record.get('id')} names table {record.get('table')!r}, "
                             "not one of chaosgpu's: refused")
    try:
        with _netns_fd(record) as fd:
            out = _run_nft(["-f", "-"], fd,
                           _script(record["table"], keep, [], replace=True))
    except NamespaceGone:  # nothing holds the namespace any more: gone with its rules
        remove(record["id"])
        return None
    if out.returncode != 0:
        raise PartitionError(f"nft could not withdraw the listening rules of partition "
                             f"{record['id']} (its targets are gone): {out.stderr.strip()[-300:]}")
    record = dict(record, rules=keep, listen_rules=[], listen_withdrawn_at=time.time())
    write_record(KIND, record["id"], record)
    return record


def remove(ident: str) -> dict[str, Any]:
    """Remove partition `ident` (its table, then its record), whichever runner made it (callers
    decide: heal_partition, heal_all_partitions, cleanup). The table is reached in the
    partition's own network namespace through anything that still holds it; the record goes only
    once the table is verified gone, or once nothing on the node holds the namespace any more.
    An unknown id is reported, not raised (the callers decide whether that is an error). Raises
    PartitionError when nft refuses or the table may still be in place. Once the record is gone,
    the partition's watcher in this runner is stopped."""
    with _LOCK:
        out = _remove_locked(ident)
        _stop_watch(ident)
        return out


def _remove_locked(ident: str) -> dict[str, Any]:
    record = read_record(KIND, ident)
    if record is None:
        _release_netns(ident)  # healed by another process (cleanup) meanwhile
        return {"id": ident, "removed": False, "note": "no such partition"}
    if not str(record.get("table", "")).startswith(TABLE_PREFIX):
        raise PartitionError(f"record {ident} names table {record.get('table')!r}, not one of "
                             "chaosgpu's: refused")
    try:
        with _netns_fd(record) as fd:
            out = _run_nft(["delete", "table", "inet", record["table"]], fd)
            if out.returncode != 0:
                still = _run_nft(["list", "table", "inet", record["table"]], fd)
                if still.returncode == 0:
                    raise PartitionError(f"nft could not delete table {record['table']}: "
                                         f"{out.stderr.strip()[-300:]}")
    except NamespaceGone as gone:
        remove_record(KIND, ident)
        _release_netns(ident)
        return {"id": ident, "removed": False, "table": record["table"],
                "healed_at": time.time(), "note": str(gone)}
    remove_record(KIND, ident)
    _release_netns(ident)
    return {"id": ident, "removed": out.returncode == 0, "table": record["table"],
            "healed_at": time.time(),
            "note": None if out.returncode == 0 else "its table was already gone"}


def remove_all(every: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Remove the recorded partitions this runner made (`every`: every recorded partition,
    whoever made it: `chaosgpu cleanup`); tries all, then raises with every failure. Returns
    {"removed": [...], "left": [partitions of other runners, with their runner and whether it
    is alive]}."""
    results, left, failures = [], [], []
    for ident, record in sorted(list_records(KIND).items()):
        if not every and not made_here(record):
            alive = runner_alive(record)
            left.append({"id": ident, "table": record.get("table"),
                         "runner": record.get("runner") or {},
                         "runner_alive": alive,
                         "note": "made by another runner " + ("still running" if alive else
                                                              "no longer running (chaosgpu "
                                                              "cleanup heals it)")})
            continue
        try:
            results.append(remove(ident))
        except (PartitionError, OSError, subprocess.TimeoutExpired) as error:
            failures.append(f"{ident}: {error}")
    if failures:
        raise PartitionError("could not remove every partition: " + "; ".join(failures))
    return {"removed": results, "left": left}


def active() -> list[dict[str, Any]]:
    """The recorded partitions (their tables are assumed in place: checking costs an nft run;
    use table_exists for that), after the liveness check: a partition whose targets have all
    ended has its listening-socket rules withdrawn, or is healed when nothing else is left (a
    failure to do so is kept in the entry's `liveness_error`; one of the partition's watcher in
    its `watch_error`). `listen_watch` says how its listening rules are withdrawn."""
    records = []
    for record in list_records(KIND).values():
        error = None
        try:
            checked = _withdraw_listen_rules(record)
        except (PartitionError, OSError, subprocess.TimeoutExpired) as failure:
            checked, error = record, str(failure)
        if checked is None:
            continue
        with contextlib.suppress(KeyError):
            entry = {"id": checked["id"], "table": checked["table"],
                     "netns": checked.get("netns"), "netns_pid": checked.get("netns_pid"),
                     "targets": checked.get("targets", []),
                     "created_at": checked.get("created_at"),
                     "runner": checked.get("runner"),
                     "listening_withdrawn_at": checked.get("listen_withdrawn_at"),
                     "listen_watch": checked.get("listen_watch")}
            if error:
                entry["liveness_error"] = error
            if checked.get("listen_watch_error"):
                entry["watch_error"] = checked["listen_watch_error"]
            records.append(entry)
    return records
