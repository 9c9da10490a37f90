"""Local pods ("sandboxes"): create, exec into, terminate and remove them.

A sandbox is a new PID namespace plus a mount namespace with /proc remounted
(`unshare --pid --fork --mount-proc`), whose PID 1 is `sleep` (the field report), an init
(dumb-init, tini) or the workload itself, optionally as a non-root UID. It is started through
`chaosgpu.sandbox.supervisor` (a detached subreaper that reaps everything, so teardown never
stalls) and described by a state record `<state>/sandboxes/<name>.json` so that any later process
can find, terminate or remove it.

This module owns the sandbox lifecycle and its pidfd helpers; process facts come from the census
(chaosgpu.node), plus two tiny readings it lacks (children, pid-namespace inode). It signals only
a sandbox's PID 1 and the processes it started, always through a pidfd opened after checking the
starttime recorded. It must not decide *which* workload processes to fault: that is the
process/job part's business.
"""

import json
import logging
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from chaosgpu import node, state
from chaosgpu.arguments import ID, POSITIVE_SECONDS, SECONDS
from chaosgpu.process import terminate as terminate_
from chaosgpu.process.environment import SCOPE_ENV, helper_env

__all__ = [
    "INITS",
    "SandboxError",
    "build_record",
    "children_of",
    "cleanup_all",
    "create",
    "created_here",
    "exec_in",
    "get_record",
    "helper_env",
    "host_pids",
    "kill",
    "list_sandboxes",
    "process_state",
    "process_starttime",
    "processes",
    "read_cmdline",
    "remove",
    "SCOPE_ENV",
    "sandbox_alive",
    "terminate",
]

logger = logging.getLogger("chaostoolkit")

INITS = ("sleep", "tini", "dumb-init", "none")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # the whole name (fullmatch)
KIND = "sandboxes"
CREATE_TIMEOUT_S = 20.0
KILL_DEADLINE_S = 10.0
_ASKED: set[str] = set()  # the sandbox names this process asked `create` for


class SandboxError(RuntimeError):
    """A sandbox operation could not be done (the message says what and why)."""


# ------------------------------------------------------------------ process facts and pidfds
# Process facts come from the census's readers (chaosgpu.node, the one reading of /proc): one
# read each, typed errors (NoSuchProcess, AccessDenied) turned into "gone"/None here.


def process_starttime(pid: int) -> int | None:
    """Return the process's start time in clock ticks, or None when it is gone."""
    return node.process_starttime(pid)


def process_state(pid: int, starttime: int | None = None) -> str | None:
    """Return the state letter of `pid` (R, S, Z, ...), or None when gone or a reused PID."""
    return node.process_state(pid, starttime=starttime)


def _alive(pid: int, starttime: int | None) -> bool:
    state_letter = process_state(pid, starttime)
    return state_letter is not None and state_letter not in ("Z", "X")


def read_cmdline(pid: int) -> list[str] | None:
    """Return the argv of `pid`, or None when unreadable."""
    try:
        return node.read_cmdline(pid)
    except node.ProcError:
        return None


def children_of(pid: int) -> list[int]:
    """Return the direct children of `pid` (from /proc/PID/task/*/children)."""
    try:
        return node.read_children(pid)
    except node.ProcError:
        return []


def _nspid(pid: int) -> list[int] | None:
    try:
        nspid: list[int] | None = node.read_status(pid)["nspid"]
        return nspid
    except node.ProcError:
        return None


def _pid_ns_inode(pid: int) -> int | None:
    try:
        return node.pid_ns_inode(pid)
    except node.ProcError:
        return None


def _rules() -> terminate_.Rules:
    """A sandbox's own processes may be another user's and are PID 1 of their namespace."""
    return terminate_.Rules(allow_other_users=True, allow_ns_init=True)


def kill(pid: int, starttime: int) -> bool:
    """SIGKILL `pid` if it is still the process recorded with `starttime` (the terminate
    primitive, no wait); True if the kernel accepted the signal."""
    target = terminate_.Target(pid, starttime)
    return terminate_.signal_once([target], "SIGKILL", _rules())[0].result == "sent"


def _env_argv(variables: dict[str, str]) -> list[str]:
    """`env K=V ...`: sets `variables` on what it execs, and on nothing before it (the pod's
    env is set inside the pod, never on the host-side supervisor, `unshare` or `nsenter`)."""
    return [_require("env"), *(f"{key}={value}" for key, value in variables.items())]


# ------------------------------------------------------------------ records


def _validate_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):  # "box\n" matched `^...$`
        raise ValueError(
            f"invalid sandbox name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def get_record(name: str) -> dict[str, Any] | None:
    """Return the state record of sandbox `name`, or None."""
    return state.read_record(KIND, _validate_name(name))


def build_record(
    name: str, pid1: int, supervisor_pid: int, unshare_pid: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """The state record of a sandbox whose PID 1 is host PID `pid1` (used by the supervisor)."""
    inode = _pid_ns_inode(pid1)
    nspid = _nspid(pid1)
    record = dict(extra)
    record.update(
        name=name,
        pid1=pid1,
        pid1_starttime=process_starttime(pid1),
        pid1_nspid=nspid,
        supervisor_pid=supervisor_pid,
        supervisor_starttime=process_starttime(supervisor_pid),
        unshare_pid=unshare_pid,
        pid_ns=f"pid:[{inode}]" if inode else None,
        pid_ns_inode=inode,
        created_at=time.time(),
        state="running",
    )
    return record


def _is_alive(record: dict[str, Any]) -> bool:
    # No start time recorded: PID 1 was gone when the record was written (the PID is a stranger's).
    starttime = record.get("pid1_starttime")
    return starttime is not None and _alive(int(record["pid1"]), starttime)


def sandbox_alive(name: str) -> bool:
    """Tell whether sandbox `name` has a record and its PID 1 (same starttime) is alive."""
    record = get_record(name)
    return record is not None and _is_alive(record)


def _live_record(name: str) -> dict[str, Any]:
    record = get_record(name)
    if record is None:
        raise SandboxError(f"no sandbox named {name!r}")
    if not _is_alive(record):
        raise SandboxError(f"sandbox {name!r} is not running (its PID 1 is gone)")
    return record


# ------------------------------------------------------------------ create


def _find_binary(init: str) -> str:
    if init == "sleep":
        found = shutil.which("sleep")
    elif init == "tini":
        found = next(
            (p for p in ("/usr/bin/tini", "/usr/bin/tini-static") if os.access(p, os.X_OK)), None
        ) or shutil.which("tini") or shutil.which("tini-static")
    elif init == "dumb-init":
        beside = Path(sys.executable).parent / "dumb-init"
        found = str(beside) if os.access(beside, os.X_OK) else shutil.which("dumb-init")
    else:
        return ""
    if not found:
        hint = {
            "tini": "install tini (apt-get install tini)",
            "dumb-init": "install dumb-init (pip install dumb-init)",
        }.get(init, "install coreutils")
        raise SandboxError(f"init {init!r} not found: {hint}")
    return found


def _require(tool: str) -> str:
    found = shutil.which(tool)
    if not found:
        raise SandboxError(f"{tool!r} not found on PATH (util-linux provides it)")
    return found


def user_namespaces_available() -> tuple[bool, str | None]:
    """Return whether this (non-root) user can create a user namespace, and why not."""
    try:
        limit = int(node.read_sysctl("user.max_user_namespaces"))
        if limit == 0:
            return False, "user namespaces are disabled (user.max_user_namespaces = 0)"
    except (OSError, ValueError):
        pass
    try:
        probe = subprocess.run(
            [_require("unshare"), "--user", "--map-root-user", "true"], env=helper_env(),
            stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, SandboxError) as error:
        return False, str(error)
    if probe.returncode != 0:
        reason = probe.stderr.decode(errors="replace").strip() or f"rc {probe.returncode}"
        return False, f"cannot create a user namespace: {reason}"
    return True, None


def _validate_ids(uid: Any, gid: Any) -> tuple[int | None, int | None]:
    """Check a user and group id (each None or 0 .. 2**32 - 2: -1 would mean "no change" to
    the kernel, a larger one would wrap); a lone uid gives its gid."""
    for label, value in (("uid", uid), ("gid", gid)):
        if value is not None:
            ID.require(label, value)
    if gid is not None and uid is None:
        raise ValueError("gid given without uid")
    if uid is not None and gid is None:
        gid = uid
    return uid, gid


def _setpriv(uid: int, gid: int) -> list[str]:
    return [
        _require("setpriv"), f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
    ]  # fmt: skip


def _validate_create(name: str, init: str, argv: list[str] | None,
                     env: dict[str, str] | None, grace_s: float) -> None:
    """Refuse bad arguments of `create` (ValueError naming the argument) before anything
    is started."""
    _validate_name(name)
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}: choose one of {', '.join(INITS)}")
    SECONDS.require("grace_s", grace_s)
    if argv is not None and (
        not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv)
    ):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    if init == "none" and not argv:
        raise ValueError("init 'none' needs argv: the workload that becomes PID 1")
    if init == "sleep" and argv:
        raise ValueError("init 'sleep' takes no argv (PID 1 is `sleep infinity`)")
    _validate_env(env)


def _validate_env(env: Any) -> None:
    """Refuse an `env` that is not a dict of strings, or whose names `env(1)` cannot set."""
    if env is None:
        return
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError(f"env must map strings to strings, got {env!r}")
    bad_keys = [k for k in env if not k or "=" in k or k.startswith("-")]
    if bad_keys:
        raise ValueError(f"env has invalid variable name(s) {bad_keys!r}")


def _sandbox_command(init: str, argv: list[str] | None, uid: int | None, gid: int | None,
                     env: dict[str, str]) -> tuple[list[str], list[str], bool]:
    """The unshare command line of a sandbox (PID namespace, its init and workload, the
    user to run as, the pod's `env`), the part that runs inside it, and whether it needs a
    user namespace."""
    unshare = _require("unshare")
    init_path = _find_binary(init)
    if init == "none":
        assert argv is not None
        payload = list(argv)
    else:
        child = list(argv) if argv else [_require("sleep"), "infinity"]
        payload = {
            "sleep": [init_path, "infinity"],
            "tini": [init_path, "--", *child],
            "dumb-init": [init_path, *child],
        }[init]
    root = os.geteuid() == 0
    userns = False
    prefix = [unshare]
    if not root:
        if uid is not None and uid != os.geteuid():
            raise SandboxError(
                f"cannot run the sandbox as uid {uid}: chaosgpu runs as uid {os.geteuid()} "
                "(not root); only its own uid is possible"
            )
        ok, reason = user_namespaces_available()
        if not ok:
            raise SandboxError(f"a non-root sandbox needs a user namespace, and {reason}")
        prefix += ["--user", "--map-root-user"]
        userns = True
    prefix += ["--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL", "--"]
    # The pod's env is set inside the pod (`env` execs on as its PID 1), never on the
    # host-side supervisor and `unshare`: a tag there would put them in the tag's scope.
    prefix += _env_argv(env)
    if root and uid is not None:
        assert gid is not None
        prefix += _setpriv(uid, gid)
    # PID 1 leads its own session inside the namespace, as container runtimes make a
    # container's init: the children it forks are then seen, from inside and from the host, as
    # started on purpose (not orphans). It is not a process-group leader here (the supervisor
    # is), so setsid(1) calls setsid() and execs without forking: PID 1 stays the init.
    prefix += [_require("setsid")]
    return prefix + payload, payload, userns


def create(
    name: str,
    init: str = "sleep",
    argv: list[str] | None = None,
    uid: int | None = None,
    gid: int | None = None,
    env: dict[str, str] | None = None,
    grace_s: float = 30.0,
    owner_pid: int | None = None,
    timeout_s: float = CREATE_TIMEOUT_S,
) -> dict[str, Any]:
    """Create sandbox `name` and return its state record.

    `init`: "sleep" (PID 1 is `sleep infinity`, like the report), "tini" or "dumb-init" (running
    `argv`, default `sleep infinity`, as their child), or "none" (`argv` itself is PID 1).
    `uid`/`gid`: run PID 1 (and, by default, everything exec'd) as that user. The pod's
    environment is the caller's without its scope variables (helper_env), plus `env`, plus
    CHAOSGPU_SANDBOX=<name>; the host-side supervisor and `unshare` carry none of these (a
    kill by the runner's or the pod's tag never reaches them). `grace_s` is the default grace
    period of `terminate`. `owner_pid`: a process whose death makes the sandbox "abandoned".
    """
    _ASKED.add(_validate_name(name))
    _validate_create(name, init, argv, env, grace_s)
    uid, gid = _validate_ids(uid, gid)
    existing = get_record(name)
    if existing is not None:
        if _is_alive(existing):
            raise SandboxError(
                f"sandbox name {name!r} is already in use (PID 1 {existing['pid1']})"
            )
        logger.info("chaosgpu: replacing the stale record of sandbox %s", name)
        _remove_dead(name, existing)

    pod_env = dict(env or {}, CHAOSGPU_SANDBOX=name)
    command, payload, userns = _sandbox_command(init, argv, uid, gid, pod_env)
    root = os.geteuid() == 0
    extra = {
        "init": init,
        "argv": payload,
        "uid": uid if uid is not None else (None if root else os.geteuid()),
        "gid": gid if gid is not None else (None if root else os.getegid()),
        "userns": userns,
        "grace_s": float(grace_s),
        "env": dict(env or {}),
        "owner": _owner(owner_pid),
        "created_by_uid": os.geteuid(),
    }
    log_path = state.state_dir() / KIND / f"{name}.log"
    log_path.parent.mkdir(mode=0o700, exist_ok=True)
    extra["log"] = str(log_path)
    read_fd, write_fd = os.pipe()
    try:
        with open(log_path, "ab") as log:
            launcher = subprocess.Popen(
                [
                    sys.executable, "-m", "chaosgpu.sandbox.supervisor",
                    "--name", name, "--status-fd", str(write_fd),
                    "--record-json", json.dumps(extra), "--", *command,
                ],
                env=helper_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, pass_fds=(write_fd,),
            )  # fmt: skip
        os.close(write_fd)
        write_fd = -1
        launcher.wait(timeout=timeout_s)  # the supervisor's first half exits at once
        line = _read_line(read_fd, timeout_s)
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    if not line:
        record = get_record(name)
        if record is not None:
            _remove_dead(name, record, force=True)
        raise SandboxError(f"sandbox {name!r} did not start within {timeout_s:g} s"
                           + _printed(log_path))
    document = json.loads(line)
    if "error" in document:
        raise SandboxError(f"sandbox {name!r} could not start: {document['error']}"
                           + _printed(log_path))
    return dict(document)


def _printed(log_path: Path, limit: int = 2000) -> str:
    """What a sandbox that failed to start printed (its PID 1's exec error, say), as the end of
    an error message; its log is removed (no record refers to it)."""
    try:
        text = log_path.read_bytes()[-limit:].decode(errors="replace").strip()
        log_path.unlink()
    except OSError:
        return ""
    return f"; it printed: {text}" if text else ""


def created_here(name: str) -> bool:
    """Whether this process asked `create` for a sandbox called `name` (even if it failed):
    the name is the experiment's own, not a typo, when its record is gone."""
    return name in _ASKED


def _owner(owner_pid: int | None) -> dict[str, Any] | None:
    if owner_pid is None:
        return None
    return {"pid": owner_pid, "starttime": process_starttime(owner_pid)}


def _read_line(fd: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    chunks = b""
    while b"\n" not in chunks:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks += chunk
    return chunks.split(b"\n", 1)[0].decode(errors="replace") if b"\n" in chunks else ""


# ------------------------------------------------------------------ exec


def _enter_prefix(record: dict[str, Any], user: Any) -> list[str]:
    command = [_require("nsenter"), "-t", str(record["pid1"])]
    if record.get("userns"):
        command += ["-U", "--preserve-credentials"]
    command += ["-p", "-m", "--"]
    if user is not None:
        uid, gid = _user_ids(user)
    else:
        uid, gid = record.get("uid"), record.get("gid")
    if uid is not None and not record.get("userns"):
        uid_i = int(uid)
        gid_i = int(gid) if gid is not None else uid_i
        if uid_i != 0 or os.geteuid() != 0:
            command += _setpriv(uid_i, gid_i)
    return command


def _user_ids(user: Any) -> tuple[int | None, int | None]:
    """The (uid, gid) of an exec's `user`: an id, or "uid:gid"; ValueError when out of range."""
    if isinstance(user, str):
        uid_text, _, gid_text = user.partition(":")
        try:
            uid = int(uid_text)
            gid = int(gid_text) if gid_text else None
        except ValueError:
            raise ValueError(f"user must be a uid or \"uid:gid\" (integers), got {user!r}") \
                from None
        return _validate_ids(uid, gid)
    return _validate_ids(user, None)


def exec_in(
    name: str,
    argv: list[str],
    detached: bool = False,
    user: int | str | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    log_path: str | None = None,
) -> dict[str, Any]:
    """Run `argv` inside sandbox `name`, like `kubectl exec`.

    Attached: `nsenter` into the sandbox's PID and mount namespaces, wait (up to `timeout_s`),
    return {"rc", "stdout", "stderr"}. Detached: a shell inside the sandbox backgrounds `argv`
    and exits, so the worker is reparented to the sandbox's PID 1 (the report's orphans); returns
    {"host_pid", "ns_pid", "starttime"}. `user` (uid or "uid:gid") defaults to the sandbox's user;
    the environment is the caller's without its scope variables (helper_env), plus the
    sandbox's `env`, plus `env`, set inside the sandbox: the host-side `nsenter` carries none.
    Output of a detached worker goes to `log_path` (default /dev/null).
    """
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    POSITIVE_SECONDS.require("timeout_s", timeout_s)
    _validate_env(env)
    if user is not None:
        _user_ids(user)  # a bad user is refused before the sandbox is looked up
    record = _live_record(name)
    command = _enter_prefix(record, user)
    inside = dict(record.get("env") or {})  # the pod's env, as `kubectl exec` gives
    inside.update(env or {})
    inside["CHAOSGPU_SANDBOX"] = name
    if not detached:
        rc, out, err = _run(command + _env_argv(inside) + argv, timeout_s, argv)
        return {"sandbox": name, "argv": argv, "rc": rc, "stdout": out, "stderr": err}
    marker = uuid.uuid4().hex
    inside["CHAOSGPU_EXEC_ID"] = marker
    inside["CHAOSGPU_EXEC_LOG"] = log_path or "/dev/null"
    # A program that cannot be run is refused before the fork: its failed child would be a
    # zombie of PID 1 (which `sleep` never reaps) and the exec would look successful.
    script = ('command -v "$1" >/dev/null 2>&1 || { echo "$1: not found or not executable" >&2;'
              ' exit 127; }; "$@" </dev/null >>"$CHAOSGPU_EXEC_LOG" 2>&1 & echo $!; exit 0')
    shell = ["sh", "-c", script, "chaosgpu-exec", *argv]
    rc, out, err = _run(command + _env_argv(inside) + shell, timeout_s, argv)
    if rc != 0 or not out.strip().isdigit():
        raise SandboxError(
            f"detached exec of {argv!r} in sandbox {name!r} failed (rc {rc}): {err.strip()}"
        )
    ns_pid = int(out.strip())
    host_pid = _host_pid_of(record, ns_pid, marker)
    if host_pid is None:
        raise SandboxError(
            f"the detached worker (pid {ns_pid} in sandbox {name!r}) exited before it was found"
        )
    return {
        "sandbox": name,
        "argv": argv,
        "ns_pid": ns_pid,
        "host_pid": host_pid,
        "starttime": process_starttime(host_pid),
    }


def _run(command: list[str], timeout_s: float, shown: list[str]) -> tuple[int, str, str]:
    """Run `command` (nsenter ... `shown`, in helper_env) in its own process group; kill the
    group and raise SandboxError naming `shown` when it does not finish within `timeout_s`."""
    process = subprocess.Popen(
        command, env=helper_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # nsenter and what it started (same group)
        except ProcessLookupError:
            pass
        process.communicate()
        raise SandboxError(f"`{shlex.join(shown)}` did not finish within {timeout_s:g} s "
                           "(killed)") from None
    return process.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def _host_pid_of(record: dict[str, Any], ns_pid: int, marker: str) -> int | None:
    candidates = children_of(int(record["pid1"]))
    for pid in candidates:
        nspid = _nspid(pid)
        if nspid and nspid[-1] == ns_pid:
            return pid
    # Not (yet) a child of PID 1: look for the marker among the namespace's processes.
    for pid in host_pids(str(record["name"])):
        nspid = _nspid(pid)
        if not nspid or nspid[-1] != ns_pid:
            continue
        try:
            if node.read_environ(pid, keys=("CHAOSGPU_EXEC_ID",)).get("CHAOSGPU_EXEC_ID") \
                    == marker:
                return pid
        except node.NoSuchProcess:
            continue
        except node.ProcError:
            return pid  # its environ is closed to us: the namespace PID matched, take it
    return None


# ------------------------------------------------------------------ observe


def host_pids(name: str) -> list[int]:
    """Return the host PIDs of every process in sandbox `name`'s PID namespace (zombies too)."""
    record = get_record(name)
    if record is None:
        raise SandboxError(f"no sandbox named {name!r}")
    inode = record.get("pid_ns_inode")
    if not inode or not _is_alive(record):
        return []
    return sorted(pid for pid in node.list_pids() if _pid_ns_inode(pid) == inode)


def processes(name: str) -> list[dict[str, Any]]:
    """Describe each process of sandbox `name`: host pid, namespace pid and ppid, state."""
    described = []
    for pid in host_pids(name):
        record = node.read_process(pid, env=False, fds=False)
        if not record:
            continue
        nspid = record.get("nspid")
        ppid_host = int(record.get("ppid") or 0)
        ppid_nspid = _nspid(ppid_host) if ppid_host else None
        described.append(
            {
                "pid": pid,
                "ns_pid": nspid[-1] if nspid else None,
                "ppid": ppid_host,
                "ns_ppid": ppid_nspid[-1] if ppid_nspid and len(ppid_nspid) > 1 else 0,
                "state": record.get("state"),
                "zombie": bool(record.get("zombie")),
                "uid": record.get("uid"),
                "cmdline": record.get("cmdline"),
                "starttime": record.get("starttime"),
            }
        )
    return described


def list_sandboxes() -> list[dict[str, Any]]:
    """Every recorded sandbox with `alive`, `supervisor_alive` and `abandoned` (see the docs)."""
    listed = []
    for name, record in state.list_records(KIND).items():
        alive = _is_alive(record)
        supervisor_alive = _alive(
            int(record.get("supervisor_pid") or 0), record.get("supervisor_starttime")
        )
        owner = record.get("owner")
        owner_gone = isinstance(owner, dict) and not _alive(
            int(owner["pid"]), owner.get("starttime")
        )
        abandoned = (alive and (not supervisor_alive or owner_gone)) or not alive
        listed.append(
            dict(
                record,
                name=name,
                alive=alive,
                supervisor_alive=supervisor_alive,
                owner_gone=owner_gone,
                abandoned=abandoned,
            )
        )
    return listed


# ------------------------------------------------------------------ terminate / remove


def terminate(
    name: str, grace_s: float | None = None, deadline_s: float = KILL_DEADLINE_S
) -> dict[str, Any]:
    """Terminate sandbox `name` like the kubelet, and return the timings.

    SIGTERM to PID 1; wait up to `grace_s` (default: the sandbox's) for it to exit (which empties
    the namespace); then SIGKILL PID 1 (the kernel kills the whole namespace); wait up to
    `deadline_s` until it is gone (reaped). Times are unix times; `*_s` fields are seconds after
    SIGTERM. A sandbox already gone returns {"already_gone": true}. A pod frozen in chaosgpu's
    freezer (a frozen process keeps SIGTERM and SIGKILL pending) is let out of it first, PID 1
    and every process of its namespace ("released_from_freezer" says from where); a PID 1 in a
    frozen cgroup chaosgpu did not make is refused (SandboxError), never signalled in vain.
    """
    POSITIVE_SECONDS.require("deadline_s", deadline_s)
    if grace_s is not None:
        SECONDS.require("grace_s", grace_s)
    record = get_record(name)
    if record is None:
        raise SandboxError(f"no sandbox named {name!r}")
    if grace_s is None:
        grace_s = record.get("grace_s", 30.0)
        if not SECONDS.accepts(grace_s):  # a record written before create refused it
            raise SandboxError(f"sandbox {name!r} records grace_s {grace_s!r}, not "
                               f"{SECONDS.what}: give grace_s")
    pid1, starttime = int(record["pid1"]), record.get("pid1_starttime")
    result: dict[str, Any] = {"sandbox": name, "pid1": pid1, "grace_s": float(grace_s)}
    outcome = None
    if starttime is not None:  # no start time: PID 1 was gone when recorded, nothing to signal
        start = time.monotonic()
        outcome = terminate_.terminate(
            [terminate_.Target(pid1, int(starttime))], ["SIGTERM", "SIGKILL"], grace_s,
            grace_s + deadline_s, _rules(), until="reaped")[0]
        total = time.monotonic() - start
    if outcome is None or outcome.result in ("gone", "refused"):
        if outcome is not None and outcome.reason_code not in ("exited", "zombie", "reused"):
            raise SandboxError(f"sandbox {name!r}: PID 1 ({pid1}) refused: {outcome.reason}")
        _finish_supervisor(record, deadline_s)
        _mark(name, record, "terminated")
        return dict(result, already_gone=True)
    if outcome.result != "exited":
        raise SandboxError(
            f"sandbox {name!r}: PID 1 ({pid1}) still there {deadline_s:g} s after SIGKILL")
    _finish_supervisor(record, deadline_s)
    _mark(name, record, "terminated")
    result.update(already_gone=False, **_timings(outcome, total))
    if outcome.released_from is not None:  # frozen in chaosgpu's freezer: let out first
        result["released_from_freezer"] = outcome.released_from
    return result


def _timings(outcome: terminate_.Outcome, total: float) -> dict[str, Any]:
    """The kubelet-like timings of a sandbox's termination, from the primitive's outcome."""
    sigterm_at = outcome.sent_at("SIGTERM") or 0.0
    sigkill_at = outcome.sent_at("SIGKILL")
    exited_on_sigterm = outcome.exited_on == "SIGTERM"
    empty_or_grace_end = (outcome.exited_at if exited_on_sigterm else sigkill_at) or sigterm_at
    gone_at = outcome.reaped_at
    return {
        "sigterm_sent": sigterm_at,
        "namespace_empty_or_grace_end": empty_or_grace_end,
        "sigkill_sent": sigkill_at,
        "gone": gone_at,
        "exited_on_sigterm": exited_on_sigterm,
        "namespace_empty_or_grace_end_s": round(empty_or_grace_end - sigterm_at, 6),
        "sigkill_sent_s": round(sigkill_at - sigterm_at, 6) if sigkill_at else None,
        "gone_after_sigkill_s": (round(gone_at - sigkill_at, 6)
                                 if sigkill_at and gone_at is not None else None),
        "total_s": round(total, 6),
    }


def _finish_supervisor(record: dict[str, Any], deadline_s: float) -> None:
    """Wait (with a deadline) for the supervisor to exit on its own; SIGKILL it if it does not:
    the primitive with the null signal first (wait, send nothing), then SIGKILL."""
    pid, starttime = int(record.get("supervisor_pid") or 0), record.get("supervisor_starttime")
    if not pid or starttime is None:  # no start time: no identity to wait on or signal
        return
    grace = min(deadline_s, 5.0)
    outcome = terminate_.terminate([terminate_.Target(pid, int(starttime))],
                                   [terminate_.NULL_SIGNAL, "SIGKILL"], grace, grace + deadline_s,
                                   _rules())[0]
    if outcome.sent_at("SIGKILL") is not None:
        logger.warning("chaosgpu: sandbox supervisor %s did not exit; killed it", pid)


def _mark(name: str, record: dict[str, Any], status: str) -> None:
    if state.read_record(KIND, name) is not None:
        state.write_record(KIND, name, dict(record, state=status, state_changed_at=time.time()))


def _remove_dead(name: str, record: dict[str, Any], force: bool = False) -> None:
    if force and record.get("pid1_starttime") is not None:
        kill(int(record["pid1"]), int(record["pid1_starttime"]))
    _finish_supervisor(record, KILL_DEADLINE_S)
    state.remove_record(KIND, name)
    log = record.get("log")
    if log:
        _unlink(log)


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove(name: str, deadline_s: float = KILL_DEADLINE_S) -> dict[str, Any]:
    """Remove sandbox `name`: SIGKILL it if alive (grace 0), delete its record; idempotent."""
    _validate_name(name)
    record = get_record(name)
    if record is None:
        _unlink(state.state_dir() / KIND / f"{name}.log")  # a failed create's, if any
        return {"sandbox": name, "removed": False, "note": "no such sandbox"}
    termination = None
    if _is_alive(record):
        termination = terminate(name, grace_s=0, deadline_s=deadline_s)
    _remove_dead(name, record)
    return {"sandbox": name, "removed": True, "termination": termination}


def cleanup_all(deadline_s: float = KILL_DEADLINE_S) -> list[dict[str, Any]]:
    """Remove every recorded sandbox (alive or not); return what was done for each. One that
    cannot be removed does not stop the others: the first error is raised once all were tried."""
    done: list[dict[str, Any]] = []
    errors: list[Exception] = []
    for name in state.list_records(KIND):
        try:
            done.append(remove(name, deadline_s))
        except Exception as error:  # the next sandboxes must still be removed
            logger.warning("chaosgpu: could not remove sandbox %s: %s", name, error)
            errors.append(error)
    if errors:
        raise errors[0]
    return done
