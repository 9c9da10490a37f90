"""The environment of every process chaosgpu starts.

The census puts a process in a declared scope by three environment variables (SCOPE_ENV: its
tag, job and sandbox). A runner may carry them itself (started with CHAOSGPU_TAG=X, inside a
job, inside a pod): a process chaosgpu starts must never inherit them, or a kill by X's tag would
hit chaosgpu's own machinery (the sandbox supervisor, `unshare`, `nsenter`, `nft`, `py-spy`)
and a workload of another tag. A runner that itself runs inside a training job carries its
rank and master (the census's JOB_IDENTITY_KEYS): passed on, py-spy would read as that job's
rank. A workload carries only the scope and job variables it declares.

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
    (SCOPE_ENV) and without the variables that make a process a training job's rank or name
    its job (the census's JOB_IDENTITY_KEYS: RANK, MASTER_ADDR, TORCHELASTIC_RUN_ID, MPI's and
    Slurm's task numbers ...), plus `declared` (a workload's own tag, job or rank, or any other
    variable). A runner started with CHAOSGPU_TAG=X, or inside a job, must not put chaosgpu's
    machinery (the sandbox supervisor, `unshare`, `nsenter`, `nft`, `py-spy`) nor a workload of
    another tag in X's scope or in that job, where a kill by tag or by rank would hit them."""
    dropped = set(SCOPE_ENV).union(_job_identity_keys())
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env.update(declared)
    return env


def _job_identity_keys() -> tuple[str, ...]:
    """The census's JOB_IDENTITY_KEYS (the census is the one authority on what makes a rank)."""
    from chaosgpu.intarget import load

    keys: tuple[str, ...] = load("probes", "node_census").JOB_IDENTITY_KEYS
    return keys
