# ruff: noqa: UP006, UP035, UP045 (chaos discover reads typing.Dict/Optional, not dict | None)
"""Measurement probes over the timeline: baseline, residual memory, release time, GiB x s held,
termination timings.

They read the sampler that the control `chaosgpu.timeline.control` runs in the same `chaos`
process (declare the control in the experiment, or these probes raise a clear error). Memory is
"GPU memory" from NVML, or the tracked processes' resident memory when NVML is unavailable
(source "host-rss", say so when reading figures). Units: MiB = 2**20 bytes; GiB x s with
GiB = 1024 MiB. Residual memory is always measured against the baseline taken before the
experiment, never as `used == 0` (an idle H200 shows 615 MiB used). Each probe also records its
result under `journal["chaosgpu"]["measurements"]` (a record with `value` and `unit`).
Every waiting probe has its own deadline.
No figure from a timeline that tracked nothing: once the method has started, a control whose
scope has matched no process since the experiment began (a typo'd tag) would read 0 MiB held
and an instant release (on host-rss its memory is the tracked processes'); every probe here
then raises ScopeError naming the scope (`_require_matched`). A scope whose processes matched
and then exited is the normal case (memory released), not this.
This module owns these computations' public face and must not sample or signal anything.
"""

import functools
import logging
import statistics
import time
from typing import Any, Dict, Optional, Union

from chaosgpu.arguments import MIB, MISSING_OK, SECONDS, TEXT, checked, missing_allowed, one_of
from chaosgpu.progress import Progress
from chaosgpu.scope import ScopeError
from chaosgpu.timeline import integral
from chaosgpu.timeline import sampler as sampler_mod

__all__ = ["baseline_memory", "residual_gpu_memory", "gpu_memory_at_baseline",
           "memory_release_time", "gb_seconds_held", "termination_timings", "timeline_summary"]

logger = logging.getLogger("chaostoolkit")
#: which moment of an event a probe measures from or to: an activity's start or end, or a
#: point event's time (chaosgpu.timeline.sampler's marks)
PHASES = ("start", "end", "point")
PHASE = one_of(PHASES)


def _sampler() -> sampler_mod.Sampler:
    sampler = sampler_mod.current()
    if sampler is None:
        raise RuntimeError("no timeline is being recorded: add the control "
                           "'chaosgpu.timeline.control' to the experiment's controls")
    if sampler.start_error is not None:
        raise RuntimeError(f"no timeline is being recorded: the timeline control could not "
                           f"start ({sampler.start_error})")
    if sampler.baseline is None:
        sampler.take_baseline()
    return sampler


def _require_matched(sampler: sampler_mod.Sampler, probe: str) -> None:
    """Refuse to measure a timeline whose scope never matched a process, once the method has
    started (before it, the target may not exist yet: the method starts it)."""
    if sampler.event_time("method", "start") is None or sampler.matched():
        return
    raise ScopeError(f"{probe}: the timeline control's scope {sampler.scope_label()} matched "
                     f"no process during the experiment: nothing of the target to measure "
                     f"(a typo in the control's scope?)")


def _record(sampler: sampler_mod.Sampler, name: str, value: Any) -> None:
    sampler.measurements.setdefault(name, []).append(value)


def _current_mib(sampler: sampler_mod.Sampler, window: int = 3) -> float:
    sampler.wait_samples(1, 1.0)
    _, total = sampler.snapshot()
    return float(statistics.median(total[-window:])) if total else 0.0


def _event_t(sampler: sampler_mod.Sampler, name: str, phase: str) -> float:
    PHASE.require("phase", phase)
    t = sampler.event_time(name, phase)
    if t is None:
        known = sorted({e["name"] for e in sampler.events})
        raise ValueError(f"no event {name!r} ({phase}) on the timeline; known events: {known}")
    return t


def baseline_memory(configuration: Optional[Dict[str, Any]] = None,
                    secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Return the memory baseline recorded when the experiment started: the total in MiB, per
    GPU when NVML is the source, and the source ("nvml" or "host-rss")."""
    sampler = _sampler()
    _require_matched(sampler, "baseline_memory")
    assert sampler.baseline is not None
    _record(sampler, "baseline_memory", sampler.baseline)
    return dict(sampler.baseline)


@checked(tolerance_mib=MIB, timeout_s=SECONDS)
def residual_gpu_memory(tolerance_mib: float = 64.0, timeout_s: float = 10.0,
                        configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> float:
    """Return the memory still held above the experiment's baseline, in MiB (median of the
    last samples). Waits up to `timeout_s` for it to fall to `tolerance_mib` or below (memory
    is freed a little after the processes die), then returns the value either way: use a range
    tolerance such as [-100000, 64] in a steady state."""
    if timeout_s < 0 or tolerance_mib < 0:
        raise ValueError("timeout_s and tolerance_mib must be >= 0")
    sampler = _sampler()
    _require_matched(sampler, "residual_gpu_memory")
    assert sampler.baseline is not None
    base = float(sampler.baseline["total_mib"])
    deadline = time.monotonic() + timeout_s
    waiting = Progress(f"GPU memory to fall within {tolerance_mib:g} MiB of the baseline",
                       timeout_s)
    residual = _current_mib(sampler) - base
    while residual > tolerance_mib and time.monotonic() < deadline:
        waiting.update(f"{residual:.1f} MiB above it")
        time.sleep(0.02)
        residual = _current_mib(sampler) - base
    residual = round(residual, 3)
    _record(sampler, "residual_gpu_memory", {"value": residual, "unit": "MiB",
                                             "residual_mib": residual, "baseline_mib": base,
                                             "source": sampler.source,
                                             "tolerance_mib": tolerance_mib})
    return residual


@checked(tolerance_mib=MIB, timeout_s=SECONDS)
def gpu_memory_at_baseline(tolerance_mib: float = 64.0, timeout_s: float = 10.0,
                           configuration: Optional[Dict[str, Any]] = None,
                           secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when memory is back within `tolerance_mib` MiB of the baseline taken before the
    experiment (waiting up to `timeout_s`): the steady state "no residual GPU memory"."""
    return residual_gpu_memory(tolerance_mib, timeout_s) <= tolerance_mib


@checked(after_event=TEXT, threshold_mib=MIB, timeout_s=SECONDS, phase=PHASE,
         missing_ok=MISSING_OK)
def memory_release_time(after_event: str, threshold_mib: float = 64.0,
                        timeout_s: float = 30.0, phase: str = "start",
                        missing_ok: Union[bool, str] = False,
                        configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> Optional[float]:
    """Seconds from an event on the timeline (an activity's name; its `phase` "start" by
    default) to the first sample where memory is back within `threshold_mib` of the baseline.
    Waits up to `timeout_s` for that to happen; returns None (and logs why) when it did not.
    An event not on the timeline fails (a typo'd name never reads as released), unless
    `missing_ok` allows it: "before-method" (the catalog's form: a steady state checked before
    the method, when nothing was faulted yet) or true (always); then it gives 0.0: nothing has
    been released because nothing was faulted (chaosgpu.arguments.missing_allowed)."""
    if not after_event:
        raise ValueError("after_event must name an activity on the timeline")
    missing_allowed(missing_ok, True)  # a bad missing_ok is refused whether or not it applies
    sampler = _sampler()
    assert sampler.baseline is not None
    if sampler.event_time(after_event, phase) is None \
            and missing_allowed(missing_ok, False):
        _record(sampler, "memory_release_time", {
            "after_event": after_event, "phase": phase, "seconds": 0.0, "value": 0.0, "unit": "s",
            "note": "event not on the timeline (yet): nothing to release"})
        return 0.0
    t_event = _event_t(sampler, after_event, phase)
    _require_matched(sampler, "memory_release_time")
    limit = float(sampler.baseline["total_mib"]) + threshold_mib
    deadline = time.monotonic() + timeout_s
    waiting = Progress(f"GPU memory to come back within {threshold_mib:g} MiB of the baseline "
                       f"after {after_event}", timeout_s)
    checked = 0
    while True:
        t, total = sampler.snapshot()
        if total:
            waiting.update(f"{total[-1] - (limit - threshold_mib):.1f} MiB above it")
        for i in range(checked, len(t)):
            if t[i] >= t_event and total[i] <= limit:
                value = round(t[i] - t_event, 4)
                _record(sampler, "memory_release_time", {
                    "after_event": after_event, "phase": phase, "seconds": value,
                    "value": value, "unit": "s", "threshold_mib": threshold_mib,
                    "source": sampler.source})
                return value
        checked = len(t)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    logger.warning("chaosgpu: memory not back within %.0f MiB of baseline %.1fs after %s",
                   threshold_mib, timeout_s, after_event)
    _record(sampler, "memory_release_time", {"after_event": after_event, "seconds": None,
                                             "value": None, "unit": "s",
                                             "timed_out_s": timeout_s})
    return None


@checked(from_event=TEXT, to_event=TEXT, from_phase=PHASE, to_phase=PHASE)
def gb_seconds_held(from_event: str, to_event: Optional[str] = None,
                    from_phase: str = "start", to_phase: str = "end",
                    configuration: Optional[Dict[str, Any]] = None,
                    secrets: Optional[Dict[str, Any]] = None) -> float:
    """GiB x seconds of memory held above the baseline between two events (activity names;
    from the first's start to the second's end, or to now when `to_event` is omitted): the
    integral of (memory - baseline) over time by chaosgpu.timeline.integral. The field
    report's "GB x s wasted" during a pod's 30 s grace period is this figure."""
    if not from_event:
        raise ValueError("from_event must name an activity on the timeline")
    sampler = _sampler()
    assert sampler.baseline is not None
    t_from = _event_t(sampler, from_event, from_phase)
    t_to = _event_t(sampler, to_event, to_phase) if to_event else sampler.now()
    if t_to < t_from:
        raise ValueError(f"{to_event!r} ({to_phase}) comes before {from_event!r} ({from_phase})")
    _require_matched(sampler, "gb_seconds_held")
    value = round(sampler.integral_gib_s(t_from, t_to, float(sampler.baseline["total_mib"])), 4)
    _record(sampler, "gb_seconds_held", {
        "from_event": from_event, "to_event": to_event, "gib_s": value, "value": value,
        "unit": "GiB x s", "seconds": round(t_to - t_from, 4), "rule": integral.RULE,
        "source": sampler.source})
    return value


@checked(after_event=TEXT, threshold_mib=MIB, timeout_s=SECONDS, phase=PHASE)
def termination_timings(after_event: str, phase: str = "start",
                        threshold_mib: float = 64.0, timeout_s: float = 5.0,
                        configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """How long after an event (an activity's start by default) each tracked process died
    (first seen zombie or gone) and memory came back within `threshold_mib` of the baseline:
    {"after_event", "processes": {pid: {"dead_after_s", "gone_after_s", "tag", "rank"}},
    "all_dead_after_s", "memory_released_after_s"}. Waits up to `timeout_s` for the sampler to
    see every process that was alive at the event die (states are sampled at rate_hz /
    process_every, see "state_sampling_hz")."""
    if not after_event:
        raise ValueError("after_event must name an activity on the timeline")
    if timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    waiting = Progress(f"the processes alive at {after_event} to die", timeout_s)
    while True:
        result = _termination(after_event, phase, threshold_mib)
        done = result["all_dead_after_s"] is not None or not result["processes"]
        if done or time.monotonic() >= deadline:
            break
        waiting.update(functools.partial(_still_alive, result))
        time.sleep(0.02)
    _record(_sampler(), "termination_timings", result)
    return result


def _still_alive(result: Dict[str, Any]) -> str:
    alive = [pid for pid, entry in result["processes"].items() if entry["dead_after_s"] is None]
    return f"{len(alive)} of {len(result['processes'])} still alive: PIDs {', '.join(alive[:10])}" \
        + (" ..." if len(alive) > 10 else "")


def _termination(after_event: str, phase: str, threshold_mib: float) -> Dict[str, Any]:
    sampler = _sampler()
    assert sampler.baseline is not None
    t_event = _event_t(sampler, after_event, phase)
    _require_matched(sampler, "termination_timings")
    per_process: dict[str, Any] = {}
    dead_times: list[float | None] = []
    for pid, entry in list(sampler.processes.items()):
        states = list(entry.get("states") or [])
        alive_at_event = any(t <= t_event and s not in ("Z", "X", "gone") for t, s in states) \
            or (states and states[0][0] > t_event)
        if not alive_at_event:
            continue
        dead = next((t for t, s in states if t >= t_event and s in ("Z", "X", "gone")), None)
        gone = next((t for t, s in states if t >= t_event and s == "gone"), None)
        per_process[str(pid)] = {
            "dead_after_s": None if dead is None else round(dead - t_event, 4),
            "gone_after_s": None if gone is None else round(gone - t_event, 4),
            "tag": entry.get("tag"), "rank": entry.get("rank")}
        dead_times.append(dead)
    t, total = sampler.snapshot()
    limit = float(sampler.baseline["total_mib"]) + threshold_mib
    released = next((ti for ti, v in zip(t, total, strict=False) if ti >= t_event and v <= limit),
                    None)
    result = {
        "after_event": after_event, "phase": phase, "processes": per_process,
        "all_dead_after_s": (round(max(d for d in dead_times if d is not None) - t_event, 4)
                             if dead_times and None not in dead_times else None),
        "memory_released_after_s": None if released is None else round(released - t_event, 4),
        "state_sampling_hz": round(sampler.rate_hz / sampler.process_every, 2), "unit": "s",
        "source": sampler.source}
    return result


def timeline_summary(configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The timeline so far: samples, real rate, source, baseline, peak and current memory."""
    sampler = _sampler()
    _require_matched(sampler, "timeline_summary")
    summary = sampler.summary()
    summary["current_total_mib"] = _current_mib(sampler)
    return summary
