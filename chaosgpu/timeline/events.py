"""Typed events of a run, as the timeline control writes them into the journal.

The control (chaosgpu.timeline.control) keeps one `ActivityRecord` per activity it saw run
(name, provider, which part of the run, start and end, the faults chaosgpu.faultlog recorded
while it ran, its output) and at the end calls `typed_section`, which returns what the report
reads instead of guessing from activity names:

* `fault`: which activity injected the fault, of what kind, when it started and when the fault
  itself happened (`t`), and how that was known (`source`). The fault activity is, in order: the
  one the control's `fault_activity` argument names; the first method action during which a
  chaosgpu fault action recorded a fault (chaosgpu.faultlog); the first method action whose
  output records a signal sent (a pod deletion, a signal sender). A probe is never the fault.
  Kind: "node-loss" when the rank was partitioned and then killed, else the first recorded
  fault's kind (SIGKILL, SIGSTOP, freezer, partition, a GPU fault...), else the first signal.
* `signals`: every SIGTERM / SIGKILL / SIGSTOP ... sent, when and by which activity, from the
  fault log and from the outputs' own records (`sigterm_sent`, `sigkill_sent`, `delete_sent_at`,
  a per-process `sent_at` with its `signal`, a cleanup's `sigterm` / `sigkill` steps); one
  event per burst (BURST_S): a scope's processes signalled one after another are one send.
* `release`: when memory was back after the fault, as the `memory_release_time` probe measured
  it (null when no probe did: the report then computes it from the timeline and says so).
* `verdicts`: the observed job verdicts (`chaosgpu.job.verdict/1` outputs) with their culprits,
  where the survivors were blocked, and the detection time after the fault.

Times: `at` is a unix time, `t` seconds since the timeline's t0 (when a sampler ran). This module
only reshapes what it is given: it reads nothing and signals nothing (the signal names are the
signalling program's own list, SIGNAL_NAMES, loaded once).
"""

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMAT", "ActivityRecord", "typed_section", "output_signals", "verdict_rows"]

FORMAT = 2  # journal["chaosgpu"]["format"]: 2 = typed events (absent in older journals)
VERDICT_SCHEMA = "chaosgpu.job.verdict/1"


def _signal_names() -> tuple[str, ...]:
    """The signals the one signalling program sends (actions/signal_processes.py's SIGNALS):
    a fault log entry or a cleanup step of one of them is a signal sent."""
    from chaosgpu.intarget import load

    return tuple(load("actions", "signal_processes").SIGNALS)


SIGNAL_NAMES = _signal_names()

# An output's own records of a signal sent (unix time) -> the signal.
OUTPUT_SIGNAL_KEYS = {"sigterm_sent": "SIGTERM", "delete_sent_at": "SIGTERM",
                      "sigkill_sent": "SIGKILL"}
# Instants of one signal from one activity each at most this long after the previous are one
# send: a scope of many processes is signalled one process after another (milliseconds apart on
# a loaded node), and the fault log and the output record the same send at slightly different
# instants.
BURST_S = 1.0


@dataclass
class ActivityRecord:
    """One activity as the control saw it run."""

    name: str
    type: str
    module: str
    func: str
    part: str  # "hypothesis", "method", "rollbacks" or "other"
    at: float
    end_at: float | None = None
    status: str | None = None
    faults: list[dict[str, Any]] = field(default_factory=list)
    output: Any = None


def _is_unix(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 1e8


def _items(output: Any) -> list[dict[str, Any]]:
    """The output and the dicts one level inside it (per-process records, steps)."""
    items: list[Any] = [output]
    values = list(output.values()) if isinstance(output, dict) else (
        output if isinstance(output, list) else [])
    for value in values:
        items += [value] if isinstance(value, dict) else (
            [v for v in value if isinstance(v, dict)] if isinstance(value, list) else [])
    return [item for item in items if isinstance(item, dict)]


def output_signals(output: Any, started_at: float | None = None) -> list[tuple[str, float]]:
    """(signal, unix time) an activity's output records as sent, one per burst of a signal
    (100 processes signalled one after another are one); cleanup steps (`t` from the action's
    start) count from `started_at` when given."""
    found: list[tuple[str, float]] = []
    signal = output.get("signal") if isinstance(output, dict) else None
    for item in _items(output):
        for key, name in OUTPUT_SIGNAL_KEYS.items():
            if _is_unix(item.get(key)):
                found.append((name, float(item[key])))
        named = item.get("signal") or signal
        if _is_unix(item.get("sent_at")) and isinstance(named, str):
            found.append((named.upper(), float(item["sent_at"])))
        step = str(item.get("step") or "").upper()
        sent = item.get("sent")
        if started_at is not None and step in SIGNAL_NAMES and isinstance(
                item.get("t"), int | float) and (not isinstance(sent, int) or sent > 0):
            found.append((step, started_at + float(item["t"])))
    return _bursts(found)


def _bursts(found: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """One (signal, first instant) per burst of one signal (BURST_S), oldest first."""
    bursts: list[tuple[str, float]] = []
    last: dict[str, float] = {}
    for name, at in sorted(found, key=lambda item: item[1]):
        if name not in last or at - last[name] > BURST_S:
            bursts.append((name, at))
        last[name] = at
    return bursts


def _fault_activity(records: list[ActivityRecord], named: str | None
                    ) -> tuple[ActivityRecord | None, str]:
    actions = [r for r in records if r.part == "method" and r.type == "action"]
    if named:
        for record in actions:
            if record.name == named:
                return record, "the control's fault_activity argument"
    for record in actions:
        if record.faults:
            return record, "chaosgpu.faultlog (recorded by the fault action)"
    for record in actions:
        if output_signals(record.output):
            return record, "the action's output (a signal sent)"
    return None, ""


def _fault_kind(record: ActivityRecord) -> str | None:
    kinds = [str(f.get("kind")) for f in record.faults if f.get("kind")]
    done = record.output.get("done") if isinstance(record.output, dict) else None
    if done == "node-loss" or ("partition" in kinds and "SIGKILL" in kinds[
            kinds.index("partition"):]):
        return "node-loss"
    if kinds:
        return kinds[0]
    signals = output_signals(record.output)
    if isinstance(record.output, dict) and "delete_sent_at" in record.output:
        return "pod-delete"
    if isinstance(record.output, dict) and "sigterm_sent" in record.output and \
            "gone" in record.output:
        return "pod-delete"
    return signals[0][0] if signals else None


def _rel(at: float | None, t0: float | None) -> float | None:
    return None if at is None or t0 is None else round(at - t0, 6)


def _fault(records: list[ActivityRecord], named: str | None,
           t0: float | None) -> dict[str, Any] | None:
    record, source = _fault_activity(records, named)
    if record is None:
        return None
    instants = [float(f["t"]) for f in record.faults if _is_unix(f.get("t"))]
    instants += [at for _, at in output_signals(record.output)]
    at = min(instants) if instants else record.at
    return {"activity": record.name, "module": record.module, "func": record.func,
            "kind": _fault_kind(record), "start_at": record.at, "start_t": _rel(record.at, t0),
            "at": at, "t": _rel(at, t0), "source": source}


def _signals(records: list[ActivityRecord], t0: float | None) -> list[dict[str, Any]]:
    out: dict[tuple[str, float], dict[str, Any]] = {}
    for record in records:
        found = [(str(f["kind"]), float(f["t"])) for f in record.faults
                 if str(f.get("kind")) in SIGNAL_NAMES and _is_unix(f.get("t"))]
        if record.type == "action":  # a probe observes; it sends nothing
            found += output_signals(record.output, record.at)
        for signal, at in _bursts(found):
            out.setdefault((signal, round(at, 2)), {
                "signal": signal, "at": at, "t": _rel(at, t0), "activity": record.name,
                "part": record.part})
    return sorted(out.values(), key=lambda s: s["at"])


def _release(fault: dict[str, Any] | None, measurements: dict[str, Any],
             event_t: Any) -> dict[str, Any] | None:
    """The memory_release_time probe's first measured record timed from the fault activity (or
    from an event at or after the fault's start)."""
    if fault is None or fault.get("t") is None:
        return None
    for record in measurements.get("memory_release_time") or []:
        if not isinstance(record, dict) or record.get("note") or not isinstance(
                record.get("seconds"), int | float):
            continue
        origin = event_t(str(record.get("after_event")), str(record.get("phase") or "start"))
        # the fault activity's own event, or one after it (clocks differ by a few ms)
        if origin is None or (record.get("after_event") != fault["activity"]
                              and origin < float(fault["start_t"]) - 0.05):
            continue
        t = origin + float(record["seconds"])
        return {"t": round(t, 6), "after_fault_s": round(t - float(fault["t"]), 4),
                "unit": "s", "source": f"memory_release_time (from '{record['after_event']}'"
                                       f" {record.get('phase') or 'start'})"}
    return None


def verdict_rows(records: list[tuple[str, str, Any]]) -> list[dict[str, Any]]:
    """One row per observed verdict in (activity, part, output): the verdict, the job, the
    culprits, where the survivors were blocked, detection after the fault, survivors' exits."""
    from chaosgpu.job.verdict import rank_key
    rows = []
    for activity, part, output in records:
        if not isinstance(output, dict) or output.get("schema") != VERDICT_SCHEMA:
            continue
        blocked = output.get("blocked_in")
        blocked = blocked if isinstance(blocked, dict) else {}
        detection = output.get("detection")
        detection = detection if isinstance(detection, dict) else {}
        row = {"activity": activity, "part": part, "job": output.get("id"),
               "verdict": output.get("verdict"), "reason": output.get("reason"),
               "culprits": [{"rank": c.get("rank"), "pid": c.get("pid"), "why": c.get("why"),
                             **({"role": c["role"]} if c.get("role") else {})}
                            for c in output.get("culprit_ranks") or [] if isinstance(c, dict)],
               "culprits_note": output.get("culprits_note"),
               "blocked_in": {k: blocked.get(k) for k in ("kind", "what", "ranks")}
               if blocked.get("kind") else None,
               "after_fault_s": detection.get("after_fault_s"),
               "after_hang_began_s": detection.get("after_hang_began_s")}
        if "all_exited" in output:
            row.update(all_exited=output.get("all_exited"),
                       survivors=output.get("survivors"),
                       still_alive=[s.get("rank") if s.get("rank") is not None
                                    else rank_key(None, s.get("pid"))
                                    for s in output.get("still_alive") or []
                                    if isinstance(s, dict)],
                       exits={rank: (e or {}).get("exit") for rank, e in
                              (output.get("exits") or {}).items()})
        rows.append(row)
    return rows


def typed_section(records: list[ActivityRecord], measurements: dict[str, Any], t0: float | None,
                  event_t: Any, fault_activity: str | None = None) -> dict[str, Any]:
    """The typed part of journal["chaosgpu"]: format, fault, signals, release, verdicts
    (`event_t(name, phase)` gives an event's time on the timeline, or None)."""
    fault = _fault(records, fault_activity, t0)
    return {
        "format": FORMAT,
        "fault": fault,
        "signals": _signals(records, t0),
        "release": _release(fault, measurements, event_t),
        "verdicts": verdict_rows([(r.name, r.part, r.output) for r in records]),
    }
