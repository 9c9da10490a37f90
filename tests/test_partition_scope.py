"""Network partitions stay inside their scope and their lifetime, on real processes, real
nftables tables and real network namespaces: a listening-socket rule never drops a stranger
that uses the same port number on another address; the listening rules end with their targets;
a node loss in another network namespace is healed there (the killed target was the way in) and
never reported gone while its table is loaded; heal_partition refuses an id this run never made;
heal_all_partitions (the catalog's rollback, through the real `chaos` CLI) heals this run's
partitions and leaves a live runner's; the probe's documented tolerance passes. Every test
proves its processes, tables and namespaces are gone afterwards."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import require_tool
from partition_helpers import Servers, connect
from proc_helpers import proc_state

CHAOS = shutil.which("chaos") or str(Path(sys.executable).with_name("chaos"))



@pytest.fixture(autouse=True)
def _root_and_nft() -> None:
    require_tool("nft", install="apt-get install nftables")
    if os.geteuid() != 0:
        pytest.skip("needs root to add nftables rules")




def _tables(prefix: tuple[str, ...] = ()) -> list[str]:
    out = subprocess.run([*prefix, "nft", "list", "tables"], capture_output=True, text=True,
                         check=True)
    return [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]


def _gone(table: str, prefix: tuple[str, ...] = ()) -> None:
    leftover = [t for t in _tables(prefix) if t == table]
    if leftover:
        subprocess.run([*prefix, "nft", "delete", "table", "inet", table], check=False)
    assert not leftover, f"table {table} left behind"


def _heal_everything_of(ids: list[str]) -> None:
    from chaosgpu.network import partitions

    for ident in ids:
        partitions.remove(ident)


def test_a_listening_rule_never_drops_the_same_port_on_another_address(
        servers: Servers) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    target, port = servers.start("127.0.0.1")
    servers.start("127.0.0.2", port)  # a stranger, outside the scope, same port number
    wildcard, wport = servers.start("0.0.0.0")
    cut = network.partition_processes({"pids": [target.pid]})
    cut_all = network.partition_processes({"pids": [wildcard.pid]})
    try:
        assert connect("127.0.0.2", port) == "connected"  # the stranger is untouched
        assert connect("127.0.0.1", port) == "timeout"  # the target is cut
        assert connect("127.0.0.1", wport) == "timeout"  # a wildcard listener on every
        assert connect("127.0.0.7", wport) == "timeout"  # local address of the namespace
        rules = partitions.read_record(partitions.KIND, cut["partition"])["rules"]
        assert rules == [f"ip daddr 127.0.0.1 tcp dport {port} drop"], rules
    finally:
        healed = network.heal_all_partitions()
    assert healed["count"] == 2 and healed["left"] == []
    assert connect("127.0.0.1", port) == "connected"
    for done in (cut, cut_all):
        _gone(done["table"])


def test_a_port_shared_with_a_stranger_is_left_out_not_dropped(servers: Servers) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    target, port = servers.start("0.0.0.0", 0, "self")  # a wildcard listener, one connection
    servers.start("::", port)  # a stranger on the IPv6 wildcard, same port number
    cut = network.partition_processes({"pids": [target.pid]})
    try:
        assert connect("::1", port) == "connected"
        record = partitions.read_record(partitions.KIND, cut["partition"])
        assert record["listen_rules"] == [] and record["connection_rules"], record
        assert "outside the partition" in record["left_out"][0]["reason"]
    finally:
        network.heal_all_partitions()
    _gone(cut["table"])


def test_the_listening_rules_end_with_their_targets(servers: Servers) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions
    from chaosgpu.network import probes as net_probes

    lonely, port = servers.start("127.0.0.1")  # listens, no connection
    talker, tport = servers.start("127.0.0.1", 0, "self")  # listens and holds a connection
    cut = network.partition_processes({"pids": [lonely.pid]})
    cut_talker = network.partition_processes({"pids": [talker.pid]})
    try:
        assert connect("127.0.0.1", port) == "timeout"
        servers.kill(lonely)
        servers.kill(talker)
        in_place = {p["id"]: p for p in net_probes.partitions_in_place()}
        # nothing but a listening rule: healed; the connection rules stay (a node loss)
        assert cut["partition"] not in in_place
        assert in_place[cut_talker["partition"]]["listening_withdrawn_at"] is not None
        record = partitions.read_record(partitions.KIND, cut_talker["partition"])
        assert record["rules"] == record["connection_rules"] and record["rules"]
        listed = subprocess.run(["nft", "list", "table", "inet", cut_talker["table"]],
                                capture_output=True, text=True, check=True).stdout
        drops = [line for line in listed.splitlines() if line.strip().endswith("drop")]
        assert drops and all(" saddr " in line for line in drops), listed  # pairs only
        _gone(cut["table"])
        # whoever binds the port now is reachable
        _, again = servers.start("127.0.0.1", port)
        _, again_t = servers.start("127.0.0.1", tport)
        assert (again, again_t) == (port, tport)
        assert connect("127.0.0.1", port) == "connected"
        assert connect("127.0.0.1", tport) == "connected"
    finally:
        healed = network.heal_all_partitions()
    assert [r["id"] for r in healed["removed"]] == [cut_talker["partition"]]
    _gone(cut_talker["table"])
    assert partitions.active() == []


def test_a_target_that_exited_unreaped_has_ended(servers: Servers) -> None:
    """A zombie target (exited, its parent has not reaped it yet) holds no socket: its
    listening rules go at the next look, not once it is reaped."""
    from chaosgpu.network import actions as network
    from chaosgpu.network import probes as net_probes

    target, port = servers.start("127.0.0.1")
    cut = network.partition_processes({"pids": [target.pid]})
    try:
        target.send_signal(signal.SIGKILL)  # not waited for: a zombie of this process
        deadline = time.monotonic() + 10
        while proc_state(target.pid) != "Z":
            assert time.monotonic() < deadline, "the target did not exit"
            time.sleep(0.02)
        assert [p["id"] for p in net_probes.partitions_in_place()] == []
        assert cut["table"] not in _tables()
        _, again = servers.start("127.0.0.1", port)
        assert connect("127.0.0.1", again) == "connected"
    finally:
        target.wait(timeout=10)
        network.heal_all_partitions()
    _gone(cut["table"])


def _netns_held_by_mount(name: str) -> tuple[tuple[str, ...], Any]:
    subprocess.run(["ip", "netns", "add", name], check=True)
    prefix = ("ip", "netns", "exec", name)
    subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], check=True)

    def drop() -> None:
        subprocess.run(["ip", "netns", "del", name], check=True)
        assert name not in os.listdir("/run/netns")
    return prefix, drop


def _netns_held_by_process(servers: Servers) -> tuple[tuple[str, ...], Any]:
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "600"],
                              stdin=subprocess.DEVNULL)
    servers.procs.append(holder)  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while os.readlink(f"/proc/{holder.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        assert time.monotonic() < deadline, "unshare did not enter a namespace"
        time.sleep(0.02)
    prefix = ("nsenter", f"--net=/proc/{holder.pid}/ns/net", "--")
    subprocess.run([*prefix, "ip", "link", "set", "lo", "up"], check=True)
    inode = os.readlink(f"/proc/{holder.pid}/ns/net")

    def drop() -> None:
        servers.kill(holder)  # type: ignore[arg-type]
        assert not any(os.readlink(f"/proc/{p}/ns/net") == inode for p in _pids())
    return prefix, drop


def _pids() -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                os.readlink(f"/proc/{pid}/ns/net")
                found.append(pid)
            except OSError:
                pass
    return found


HEAL_ELSEWHERE = r"""
import json, sys
from chaosgpu.network import partitions
try:
    print(json.dumps(partitions.remove(sys.argv[1])))
except partitions.PartitionError as error:
    print(json.dumps({"error": str(error)}))
"""


def _heal_in_another_process(ident: str) -> dict[str, Any]:
    """partitions.remove(ident) as `chaosgpu cleanup` runs it: another process, which holds
    nothing open of the partition's namespace."""
    done = subprocess.run([sys.executable, "-c", HEAL_ELSEWHERE, ident], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("healer", ["this-runner", "another-process"])
@pytest.mark.parametrize("held_by", ["ip-netns-mount", "another-process"])
def test_a_node_loss_in_another_namespace_is_healed_there(servers: Servers, held_by: str,
                                                           healer: str) -> None:
    require_tool("ip", install="apt-get install iproute2")
    require_tool("unshare", "nsenter", install="apt-get install util-linux")
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    if held_by == "ip-netns-mount":
        prefix, drop = _netns_held_by_mount(f"chaosgpu-test-{uuid.uuid4().hex[:8]}")
    else:
        prefix, drop = _netns_held_by_process(servers)
    cut: dict[str, Any] = {}
    try:
        target, _ = servers.start("127.0.0.1", 0, "self", prefix=prefix)
        assert os.readlink(f"/proc/{target.pid}/ns/net") != os.readlink("/proc/self/ns/net")
        cut = network.partition_processes({"pids": [target.pid]})
        assert cut["table"] in _tables(prefix)
        servers.kill(target)  # a node loss: the PID the partition reached the namespace by
        if healer == "this-runner":
            healed = network.heal_all_partitions()
            assert [r["id"] for r in healed["removed"]] == [cut["partition"]]
            result = healed["removed"][0]
        else:  # a crashed runner's partition, healed by cleanup: found by its namespace
            partitions._stop_watch(cut["partition"])  # a crashed runner: no watcher,
            partitions._release_netns(cut["partition"])  # nothing held open
            result = _heal_in_another_process(cut["partition"])
        assert result.get("removed") is True, result
        assert cut["table"] not in _tables(prefix)
        assert partitions.active() == []
    finally:
        leftover = bool(cut) and cut["table"] in _tables(prefix)
        if leftover:
            subprocess.run([*prefix, "nft", "delete", "table", "inet", cut["table"]])
        servers.stop_all()
        drop()
        assert not leftover, f"table {cut['table']} left in the namespace"


def test_a_namespace_nothing_holds_is_never_reported_gone_unverified(servers: Servers) -> None:
    """Once nothing holds the namespace, another process's heal says it is gone with its rules,
    or, where it could not look everywhere (processes it may not inspect), keeps the record and
    says why: never "gone" while the table may be loaded."""
    require_tool("unshare", "nsenter", install="apt-get install util-linux")
    from chaosgpu import state
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    prefix, drop = _netns_held_by_process(servers)
    target, _ = servers.start("127.0.0.1", 0, "self", prefix=prefix)
    cut = network.partition_processes({"pids": [target.pid]})
    partitions._stop_watch(cut["partition"])  # a crashed runner: no watcher, nothing held open
    partitions._release_netns(cut["partition"])
    servers.stop_all()
    drop()
    result = _heal_in_another_process(cut["partition"])
    kept = partitions.read_record(partitions.KIND, cut["partition"])
    if "error" in result:
        assert "cannot be reached" in result["error"] and "kept" in result["error"], result
        assert kept is not None
        state.remove_record(partitions.KIND, cut["partition"])  # the namespace is gone
    else:
        assert result["removed"] is False and "holds network namespace" in result["note"]
        assert kept is None


def test_heal_partition_refuses_an_id_this_run_never_made(servers: Servers) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    target, port = servers.start("127.0.0.1")
    cut = network.partition_processes({"pids": [target.pid]})
    try:
        with pytest.raises(partitions.PartitionError) as refused:
            network.heal_partition("partition-1")
        assert "'partition-1'" in str(refused.value) and cut["partition"] in str(refused.value)
        assert connect("127.0.0.1", port) == "timeout"  # still partitioned
        assert network.heal_partition("partition-1", missing_ok=True)["removed"] is False
        with pytest.raises(ValueError):
            network.heal_partition("partition-1", missing_ok="sometimes")
    finally:
        healed = network.heal_partition(cut["partition"])
    assert healed["removed"] is True
    again = network.heal_partition(cut["partition"])  # this run's, healed already: a success
    assert again["removed"] is False and "already" in again["note"]
    assert connect("127.0.0.1", port) == "connected"
    _gone(cut["table"])


OTHER_RUNNER = r"""
import sys, time
from chaosgpu.network import partitions
from chaosgpu.node import process_starttime
pid = int(sys.argv[1])
record = partitions.create([{"pid": pid, "starttime": process_starttime(pid)}], reason="other")
print(record["id"], record["table"], flush=True)
time.sleep(600)
"""


def _other_runner(servers: Servers, target: int) -> tuple["subprocess.Popen[str]", str, str]:
    """Another runner (a process of its own, kept among `servers`) that partitions `target` and
    stays alive: the process, its partition's id and table."""
    other = subprocess.Popen([sys.executable, "-c", OTHER_RUNNER, str(target)],
                             stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    servers.procs.append(other)
    assert other.stdout is not None
    ident, table = other.stdout.readline().split()
    return other, ident, table


def _experiment(tmp_path: Path, pid: int) -> Path:
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps({
        "version": "1.0.0", "title": "a run partitions its target and heals its own",
        "description": "the catalog's routine rollback next to another runner's partition",
        "method": [{"type": "action", "name": "partition", "provider": {
            "type": "python", "module": "chaosgpu.network.actions",
            "func": "partition_processes", "arguments": {"scope": {"pids": [pid]}}}}],
        "rollbacks": [{"type": "action", "name": "heal", "provider": {
            "type": "python", "module": "chaosgpu.network.actions",
            "func": "heal_all_partitions"}}],
        "runtime": {"rollbacks": {"strategy": "always"}}}))
    return path


def test_the_routine_rollback_heals_this_runs_partitions_only(tmp_path: Path,
                                                               servers: Servers) -> None:
    from chaosgpu.network import actions as network
    from chaosgpu.network import partitions

    theirs_target, their_port = servers.start("127.0.0.1")
    ours_target, _ = servers.start("127.0.0.1")
    _, their_id, their_table = _other_runner(servers, theirs_target.pid)
    try:
        done = subprocess.run(
            [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run",
             "--journal-path", str(tmp_path / "journal.json"),
             str(_experiment(tmp_path, ours_target.pid))],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
            stdin=subprocess.DEVNULL)
        journal = json.loads((tmp_path / "journal.json").read_text())
        assert journal["status"] == "completed", done.stdout + done.stderr
        ours = journal["run"][0]["output"]
        heal = journal["rollbacks"][0]["output"]
        assert [r["id"] for r in heal["removed"]] == [ours["partition"]], heal
        assert [(x["id"], x["runner_alive"]) for x in heal["left"]] == [(their_id, True)]
        assert their_table in _tables() and ours["table"] not in _tables()
        assert connect("127.0.0.1", their_port) == "timeout"  # their fault is still on
        # this process made none: its heal leaves theirs; the explicit opt-in heals it
        assert network.heal_all_partitions()["removed"] == []
        everything = network.heal_all_partitions(every=True)
        assert [r["id"] for r in everything["removed"]] == [their_id]
    finally:
        servers.stop_all()
        _heal_everything_of(list(partitions.list_records(partitions.KIND)))
    _gone(their_table)


def test_the_documented_steady_state_tolerance_passes(tmp_path: Path) -> None:
    from chaosgpu.network import probes as net_probes

    doc = net_probes.partitions_in_place.__doc__ or ""
    form = doc[doc.index('"tolerance": ') + len('"tolerance": '):].split("`")[0]
    tolerance = json.loads(form)
    path = tmp_path / "steady.json"
    path.write_text(json.dumps({
        "version": "1.0.0", "title": "no partition left behind",
        "description": "the probe with the tolerance its docstring gives",
        "steady-state-hypothesis": {"title": "no partition", "probes": [{
            "type": "probe", "name": "partitions", "tolerance": tolerance, "provider": {
                "type": "python", "module": "chaosgpu.network.probes",
                "func": "partitions_in_place"}}]},
        "method": []}))
    subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run",
                    "--journal-path", str(tmp_path / "journal.json"), str(path)],
                   cwd=tmp_path, capture_output=True, text=True, timeout=120,
                   stdin=subprocess.DEVNULL)
    journal = json.loads((tmp_path / "journal.json").read_text())
    before = journal["steady_states"]["before"]
    assert before["steady_state_met"] is True, before


def test_no_partition_left_behind_answers_for_this_run_and_dead_runners(
        servers: Servers) -> None:
    """A concurrent live runner's partition is its own game-day's fault: the steady-state probe
    leaves it out (as the routine heal leaves it in place) unless `every`; once that runner no
    longer runs, its partition is left behind and listed."""
    from chaosgpu.network import partitions
    from chaosgpu.network import probes as net_probes

    target, _ = servers.start("127.0.0.1")
    other, their_id, their_table = _other_runner(servers, target.pid)
    try:
        assert net_probes.partitions_in_place() == []
        every = net_probes.partitions_in_place(every=True)
        assert [(p["id"], p["runner_alive"]) for p in every] == [(their_id, True)]
        servers.kill(other)  # the runner crashed: its partition is now left behind
        behind = net_probes.partitions_in_place()
        assert [(p["id"], p["runner_alive"]) for p in behind] == [(their_id, False)]
        with pytest.raises(ValueError, match="every must be true or false, got 'yes'"):
            net_probes.partitions_in_place(every="yes")
    finally:
        servers.stop_all()
        _heal_everything_of(list(partitions.list_records(partitions.KIND)))
    _gone(their_table)
