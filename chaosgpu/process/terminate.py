"""The typed front of chaosgpu's one terminate primitive.

Every signal chaosgpu sends and every wait for a process's exit goes through the algorithm of
the in-target program `actions/signal_processes.py` (loaded in place; the same file is streamed
into pods): targets named by (PID, start time), a pidfd opened and its start time re-checked
(fail closed), `pidfd_send_signal`, one deadline, grace then escalation, exits waited for by
polling the pidfds, the refusal rules as parameters. This module only gives it types: `Target`
in, one `Outcome` per target out, and hands it chaosgpu's freezer (`freezer.release`) as the
`release` step: a target sitting in one of chaosgpu's frozen cgroups is let out of it before a
signal that ends it (a frozen process keeps that signal pending until thawed), and its outcome
says so (`released_from`); one in a frozen cgroup chaosgpu did not make is refused ("frozen").
It must not send or wait any other way, nor decide which processes are in scope
(chaosgpu.scope does).
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from chaosgpu.arguments import SECONDS

__all__ = ["Target", "Rules", "SignalSent", "Outcome", "terminate", "signal_once", "wait_exits",
           "not_stopped", "release_frozen", "NULL_SIGNAL"]

NULL_SIGNAL = "0"  # checks that a signal could be sent, sends nothing


@dataclass(frozen=True)
class Target:
    """A process as chaosgpu recorded it: the PID and its start time (clock ticks since boot),
    both mandatory: without the start time there is no identity to check."""

    pid: int
    starttime: int

    def __post_init__(self) -> None:
        for name in ("pid", "starttime"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "pid"):
                raise ValueError(f"Target.{name} must be an integer"
                                 f"{' > 0' if name == 'pid' else ' >= 0'}, got {value!r}")


@dataclass(frozen=True)
class Rules:
    """Which refusals to lift: processes of other users, PID 1 of other PID namespaces, and a
    further process whose ancestors are protected too. PID 1 of this namespace, the caller and
    its ancestors, and kernel threads are always refused."""

    allow_other_users: bool = False
    allow_ns_init: bool = False
    runner_pid: int | None = None


@dataclass(frozen=True)
class SignalSent:
    """A signal the kernel accepted for a target, with its unix time."""

    signal: str
    at: float


@dataclass(frozen=True)
class Outcome:
    """What happened to one target: `result` is "sent", "exited", "alive", "refused" or "gone"
    (see actions/signal_processes.py); `exited_on` names the last signal before the exit;
    `released_from` the frozen cgroup it was let out of before a fatal signal (None if none)."""

    pid: int
    starttime: int | None
    result: str
    reason_code: str | None = None
    reason: str | None = None
    signals: tuple[SignalSent, ...] = field(default_factory=tuple)
    exited_at: float | None = None
    exited_on: str | None = None
    reaped: bool | None = None
    reaped_at: float | None = None
    released_from: dict[str, Any] | None = None

    @property
    def first_sent_at(self) -> float | None:
        """The unix time of the first signal sent, or None when none was."""
        return self.signals[0].at if self.signals else None

    def sent_at(self, signal: str) -> float | None:
        """The unix time `signal` was sent, or None when it was not."""
        return next((s.at for s in self.signals if s.signal == signal), None)


def release_frozen(targets: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The primitive's `release` step for local targets: chaosgpu's freezer lets the targets
    (only them, and the members of a PID namespace whose init is one) out of its frozen groups."""
    from chaosgpu.process import freezer

    return freezer.release(targets)


def _program() -> Any:
    from chaosgpu.intarget import load

    return load("actions", "signal_processes")


def _outcome(raw: dict[str, Any]) -> Outcome:
    return Outcome(
        pid=int(raw["pid"]), starttime=raw.get("starttime"), result=str(raw["result"]),
        reason_code=raw.get("reason_code"), reason=raw.get("reason"),
        signals=tuple(SignalSent(str(s["signal"]), float(s["at"]))
                      for s in raw.get("signals") or []),
        exited_at=raw.get("exited_at"), exited_on=raw.get("exited_on"), reaped=raw.get("reaped"),
        reaped_at=raw.get("reaped_at"), released_from=raw.get("released_from"),
    )  # fmt: skip


def _plain(targets: Sequence[Target]) -> list[dict[str, int]]:
    for target in targets:
        if not isinstance(target, Target):
            raise TypeError(f"targets must be Target(pid, starttime), got {target!r}")
    return [{"pid": t.pid, "starttime": t.starttime} for t in targets]


def terminate(targets: Sequence[Target], signals: Sequence[str], grace_s: float,
              deadline_s: float, rules: Rules, cont_first: bool = False,
              until: str = "exit") -> list[Outcome]:
    """Signal `targets` through identity-checked pidfds, escalating through `signals` (e.g.
    SIGTERM then SIGKILL) with `grace_s` between them, everything within `deadline_s`; wait
    `until` "exit" (pidfds readable) or "reaped" (gone from /proc too), or only "sent".
    Returns one Outcome per distinct target; raises ValueError on bad input, before anything
    is sent. A target in one of chaosgpu's frozen cgroups is let out of it before the first
    signal that ends it (`Outcome.released_from`); one in another frozen cgroup is refused
    (reason_code "frozen")."""
    raw = _program().terminate(
        _plain(targets), list(signals), grace_s=grace_s, deadline_s=deadline_s,
        cont_first=cont_first, until=until, allow_other_users=rules.allow_other_users,
        allow_ns_init=rules.allow_ns_init, runner_pid=rules.runner_pid, release=release_frozen,
    )  # fmt: skip
    return [_outcome(entry) for entry in raw]


def signal_once(targets: Sequence[Target], signal: str, rules: Rules) -> list[Outcome]:
    """Send `signal` once to each target (no wait): the primitive with until="sent"."""
    return terminate(targets, [signal], 0.0, 0.0, rules, until="sent")


def wait_exits(targets: Sequence[Target], deadline_s: float) -> list[Target]:
    """Wait up to `deadline_s` (at most LONGEST_WAIT_S) until no target is alive (zombies and
    reused PIDs count as gone), by polling pidfds; return the targets still alive."""
    SECONDS.require("deadline_s", deadline_s)
    left = _program().wait_exits(_plain(targets), deadline_s)
    return [Target(int(t["pid"]), int(t["starttime"])) for t in left]


def not_stopped(report: dict[str, Any]) -> list[str]:
    """The processes of a stop signal's report (the program's signal_targets with
    `wait_stopped_s`, here or inside a pod) that were sent it and live on without being seen
    stopped, each as "PID p: why" (one that ended meanwhile has nothing left to stop)."""
    return [f"PID {r['pid']}: {r.get('not_stopped')}" for r in report["results"]
            if r.get("result") == "sent" and r.get("stopped") is False
            and r.get("state_after") != "gone"]
