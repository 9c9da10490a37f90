"""The environment of every process chaosgpu starts.

The census puts a process in a declared scope by three environment variables (SCOPE_ENV: its
tag, job and sandbox). A runner may carry them itself (started with CHAOSGPU_TAG=X, inside a
job, inside a pod): a process chaosgpu starts must never inherit them, or a kill by X's tag would
hit chaosgpu's own machinery (the sandbox supervisor, `unshare`, `nsenter`, `nft`, `py-spy`)
and a workload of another tag. A workload carries only the scope variables it declares.

This module owns that one rule (`helper_env`); it starts nothing itself.
"""

import os

__all__ = ["SCOPE_ENV", "helper_env"]

#: The environment variables that put a process in a declared scope (the census reads a
#: process's tag, job and sandbox from them): chaosgpu's own processes never inherit the
#: runner's (see helper_env); a workload carries only those it declares.
SCOPE_ENV = ("CHAOSGPU_TAG", "CHAOSGPU_JOB", "CHAOSGPU_SANDBOX")


def helper_env(**declared: str) -> dict[str, str]:
    """The environment of a process chaosgpu starts: the caller's without its scope variables
    (SCOPE_ENV), plus `declared` (a workload's own tag or job, or any other variable). A runner
    started with CHAOSGPU_TAG=X must not put chaosgpu's machinery (the sandbox supervisor,
    `unshare`, `nsenter`, `nft`, `py-spy`) nor a workload of another tag in X's scope, where a
    kill by tag would hit them."""
    env = {key: value for key, value in os.environ.items() if key not in SCOPE_ENV}
    env.update(declared)
    return env
