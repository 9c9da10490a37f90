"""Chaos Toolkit actions on local pods (sandboxes): create, exec into, terminate, remove.

This module owns only the activity signatures (keyword arguments with defaults, JSON returns);
the work is done by chaosgpu.sandbox.runtime. A sandbox created here records the runner as its
owner, so one left behind by a crashed runner is reported as abandoned. A name that is not
recorded is checked as the probes check it (chaosgpu.sandbox.probes.recorded, `missing_ok`).
"""

import os
from typing import Any, Dict, List, Optional, Union

from chaosgpu.arguments import (
    BOOL,
    COUNT,
    INDEX,
    MISSING_OK,
    POSITIVE_SECONDS,
    SECONDS,
    Rule,
    checked,
    one_of,
)
from chaosgpu.sandbox import probes, runtime
from chaosgpu.sandbox.probes import SANDBOX_NAME

#: the arguments' rules, each the check chaosgpu.sandbox.runtime makes before it starts anything
INIT = one_of(runtime.INITS)
ARGV = Rule("a non-empty list of strings", lambda value: isinstance(value, list) and bool(value)
            and all(isinstance(item, str) for item in value))
ENV = Rule.by_check("a map of environment variable names to strings", runtime._validate_env)
USER = Rule.by_check('a uid or "uid:gid" (integers)', runtime._user_ids)

__all__ = [
    "create_sandbox",
    "exec_in_sandbox",
    "terminate_sandbox",
    "remove_sandbox",
    "remove_all_sandboxes",
]


@checked(name=SANDBOX_NAME, uid=INDEX, gid=INDEX, grace_s=SECONDS, init=INIT, argv=ARGV,
         env=ENV)
def create_sandbox(
    name: str,
    init: str = "sleep",
    argv: Optional[List[str]] = None,
    uid: Optional[int] = None,
    gid: Optional[int] = None,
    env: Optional[Dict[str, str]] = None,
    grace_s: float = 30.0,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Create a local pod `name`: a new PID + mount namespace whose PID 1 is `init` ("sleep" like
    the field report, "tini", "dumb-init", or "none" to make `argv` itself PID 1), optionally as
    user `uid`/`gid`, with `grace_s` as its termination grace period. Returns its state record
    (host PID of PID 1, pid namespace, supervisor)."""
    return runtime.create(
        name, init=init, argv=argv, uid=uid, gid=gid, env=env, grace_s=grace_s,
        owner_pid=os.getpid(),
    )  # fmt: skip


@checked(name=SANDBOX_NAME, count=COUNT, timeout_s=POSITIVE_SECONDS, argv=ARGV, user=USER,
         env=ENV, detached=BOOL)
def exec_in_sandbox(
    name: str,
    argv: List[str],
    detached: bool = False,
    count: int = 1,
    user: Optional[Union[int, str]] = None,
    env: Optional[Dict[str, str]] = None,
    timeout_s: float = 60.0,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Run `argv` inside sandbox `name` like `kubectl exec`: attached (waits up to `timeout_s`,
    returns rc and output) or `detached` as a backgrounded shell job, `count` times, so each
    worker becomes an orphan of the pod's PID 1 as in the field report (returns host and
    namespace PIDs)."""
    if not detached:
        return runtime.exec_in(name, argv, user=user, env=env, timeout_s=timeout_s)
    started = [
        runtime.exec_in(name, argv, detached=True, user=user, env=env, timeout_s=timeout_s)
        for _ in range(count)
    ]
    return {
        "sandbox": name,
        "argv": argv,
        "host_pids": [s["host_pid"] for s in started],
        "ns_pids": [s["ns_pid"] for s in started],
        "workers": started,
    }


@checked(name=SANDBOX_NAME, grace_s=SECONDS, deadline_s=POSITIVE_SECONDS)
def terminate_sandbox(
    name: str,
    grace_s: Optional[float] = None,
    deadline_s: float = 10.0,
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Terminate sandbox `name` with kubelet semantics: SIGTERM to PID 1, wait up to `grace_s`
    (default: the sandbox's own) for the namespace to empty, SIGKILL, wait up to `deadline_s`
    until it is gone. Returns the timings (SIGTERM sent, namespace empty or grace end, SIGKILL
    sent, gone, total) and whether PID 1 exited on SIGTERM."""
    return runtime.terminate(name, grace_s=grace_s, deadline_s=deadline_s)


@checked(name=SANDBOX_NAME, missing_ok=MISSING_OK)
def remove_sandbox(
    name: str,
    missing_ok: Union[bool, str] = "before-method",
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """Remove sandbox `name`: kill it at once if it still runs and delete its record. Safe to run
    twice and after a crash of the runner (a rollback); but a name that is not recorded and that
    this run never created (a typo: the real pod would be left running) fails, naming the
    recorded sandboxes, unless `missing_ok` is true (or "before-method", the default, before
    the method starts)."""
    probes.recorded(name, missing_ok)  # a typo fails here; an allowed absence removes nothing
    return runtime.remove(name)


def remove_all_sandboxes(
    configuration: Optional[Dict[str, Any]] = None,
    secrets: Optional[Dict[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Remove every recorded sandbox, alive or abandoned (a rollback of last resort)."""
    return runtime.cleanup_all()
