"""A run's typed facts (fault, signals, release, verdicts) and its events, for the report.

This module owns reading those facts: from the journal's typed section when the timeline control
wrote one (`journal["chaosgpu"]["format"] >= 2`), else rebuilt from an older journal by the same
rules (chaosgpu.timeline.events) applied to what that journal holds: each activity's provider,
start and output, and the `fault:<kind>` marks chaosgpu's fault actions left on the timeline. No
fault is ever guessed from an activity's name; an older journal whose fault cannot be rebuilt says
so. It also owns the event list the tables and plots show (seconds since the timeline's t0) and
how a verdict row reads (its outcome for a baseline or a remediation).
"""

import datetime
from typing import Any

from chaosgpu.timeline import events as typed

__all__ = ["KIND_WORDS", "describe_fault", "fault_time", "journal_facts", "run_events",
           "verdict_outcome"]


def _stop_words() -> dict[str, str]:
    """How a stop by signal reads: each of the signalling program's STOP_SIGNALS (SIGSTOP,
    SIGTSTP, SIGTTIN, SIGTTOU), which the fault log records under the signal's name as this
    run's freeze, as "freeze (SIGNAL)"."""
    from chaosgpu.intarget import load

    return {name: f"freeze ({name})" for name in load("actions", "signal_processes").STOP_SIGNALS}


# How the report words a fault kind.
KIND_WORDS = {
    "node-loss": "node loss (the rank partitioned, then SIGKILLed: invisible to its peers)",
    "SIGKILL": "kill (SIGKILL)",
    "SIGTERM": "SIGTERM",
    **_stop_words(),
    "freezer": "freeze (cgroup freezer)",
    "partition": "network partition",
    "pod-delete": "pod deletion (SIGTERM, SIGKILL at the grace's end)",
}
LEGACY_NOTE = ("older journal without typed events: fault and signals rebuilt from the "
               "activities' outputs and the fault marks on the timeline")


def _iso_to_unix(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    if parsed.tzinfo is None:  # Chaos Toolkit writes UTC without an offset
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()


def _window(events: list[dict[str, Any]], name: str, after: float) -> tuple[float, float] | None:
    start = next((e["t"] for e in events if e["name"] == name and e.get("phase") == "start"
                  and e["t"] >= after - 1e-9), None)
    if start is None:
        return None
    end = next((e["t"] for e in events if e["name"] == name and e.get("phase") == "end"
                and e["t"] >= start), start)
    return start, end


def _records(journal: dict[str, Any], timeline: dict[str, Any] | None
             ) -> list[typed.ActivityRecord]:
    """Activity records rebuilt from an older journal: the faults are the timeline's
    `fault:<kind>` marks that fall inside the activity's start and end."""
    t0 = timeline["t0"] if timeline else None
    marks = timeline["events"] if timeline else []
    records = []
    cursor = -1e18
    for part in ("run", "rollbacks"):
        for entry in journal.get(part) or []:
            activity = entry.get("activity") if isinstance(entry, dict) else None
            if not isinstance(activity, dict):
                continue
            provider = activity.get("provider")
            provider = provider if isinstance(provider, dict) else {}
            name = str(activity.get("name", "activity"))
            window = _window(marks, name, cursor) if marks else None
            at = (t0 + window[0]) if window and t0 is not None else _iso_to_unix(
                entry.get("start"))
            faults = []
            if window is not None and t0 is not None:
                cursor = window[0]
                faults = [{"kind": e["name"].split(":", 1)[1], "t": t0 + e["t"]}
                          for e in marks if str(e["name"]).startswith("fault:")
                          and e.get("phase") == "point" and window[0] <= e["t"] <= window[1]]
            records.append(typed.ActivityRecord(
                name=name, type=str(activity.get("type") or ""),
                module=str(provider.get("module") or ""), func=str(provider.get("func") or ""),
                part="method" if part == "run" else "rollbacks", at=at or 0.0,
                faults=faults, output=entry.get("output")))
    return records


def _legacy_verdicts(journal: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows from detect_hang outputs written before the verdict schema (hung, faulty ranks,
    detected_after_fault_s)."""
    rows = []
    for part in ("run", "rollbacks"):
        for entry in journal.get(part) or []:
            activity = entry.get("activity") if isinstance(entry, dict) else None
            output = entry.get("output") if isinstance(entry, dict) else None
            if not isinstance(activity, dict) or not isinstance(output, dict) or \
                    output.get("schema") or not isinstance(output.get("hung"), bool) or \
                    (activity.get("provider") or {}).get("func") != "detect_hang":
                continue
            rows.append({"activity": activity.get("name"),
                         "part": "method" if part == "run" else "rollbacks",
                         "job": output.get("job"),
                         "verdict": "hung" if output["hung"] else None,
                         "reason": output.get("note"),
                         "culprits": [{"rank": f.get("rank"), "why": f.get("state")}
                                      for f in output.get("faulty") or []
                                      if isinstance(f, dict)],
                         "culprits_note": None, "blocked_in": None,
                         "after_fault_s": output.get("detected_after_fault_s"),
                         "after_hang_began_s": None})
    return rows


def journal_facts(journal: dict[str, Any], section: dict[str, Any],
                  timeline: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """(facts, typed): the journal's typed section, or the same shape rebuilt (typed False)."""
    fmt = section.get("format")
    if isinstance(fmt, int) and fmt >= typed.FORMAT:
        facts = {key: section.get(key) for key in ("fault", "signals", "release", "verdicts")}
        facts["signals"] = facts["signals"] or []
        facts["verdicts"] = facts["verdicts"] or []
        return facts, True
    marks = timeline["events"] if timeline else []

    def event_t(name: str, phase: str) -> float | None:
        return next((e["t"] for e in marks if e["name"] == name and e.get("phase") == phase),
                    None)

    measurements = section.get("measurements")
    facts = typed.typed_section(_records(journal, timeline),
                                measurements if isinstance(measurements, dict) else {},
                                timeline["t0"] if timeline else None, event_t)
    if not facts["verdicts"]:
        facts["verdicts"] = _legacy_verdicts(journal)
    return facts, False


def describe_fault(fault: dict[str, Any] | None) -> str:
    """'node loss (...) by 'fail-rank-0' (fail_rank)' from the typed fault, or ''."""
    if not fault:
        return ""
    kind = fault.get("kind")
    words = KIND_WORDS.get(str(kind), str(kind or "fault"))
    func = fault.get("func")
    return f"{words} by '{fault.get('activity')}'" + (f" ({func})" if func else "")


def run_events(timeline: dict[str, Any] | None, facts: dict[str, Any]) -> list[dict[str, Any]]:
    """The timeline's marks (kind "other"), the fault ("fault"), the signals (SIGTERM, SIGKILL;
    others "other") and the release ("release"), in seconds since t0, in time order."""
    events = [{"t": e["t"], "name": e["name"], "phase": e.get("phase"),
               "activity": e.get("activity"), "kind": "other"}
              for e in (timeline or {}).get("events", [])
              if not str(e["name"]).startswith("fault:")]
    fault = facts.get("fault") or {}
    if isinstance(fault.get("t"), int | float):
        events.append({"t": float(fault["t"]), "name": f"fault: {fault.get('kind') or '?'}",
                       "phase": "point", "activity": fault.get("activity"), "kind": "fault"})
    for signal in facts.get("signals") or []:
        if not isinstance(signal.get("t"), int | float):
            continue
        kind = signal["signal"] if signal["signal"] in ("SIGTERM", "SIGKILL") else "other"
        events.append({"t": float(signal["t"]), "name": f"{signal['signal']} sent",
                       "phase": "point", "activity": signal.get("activity"), "kind": kind})
    release = facts.get("release") or {}
    if isinstance(release.get("t"), int | float):
        events.append({"t": float(release["t"]), "name": "memory back", "phase": "point",
                       "activity": None, "kind": "release"})
    events.sort(key=lambda e: e["t"])
    return events


def fault_time(events: list[dict[str, Any]]) -> float | None:
    """When the fault happened (seconds since t0): the typed fault event, or None."""
    return next((float(e["t"]) for e in events if e["kind"] == "fault"), None)


def verdict_outcome(row: dict[str, Any], remediation: bool) -> str:
    """How a verdict row reads for this run: for a remediation, survivors that ended by
    themselves (verdict "failed", or all exited within the wait) are the good outcome."""
    verdict = row.get("verdict")
    if remediation:
        if row.get("all_exited") is True or verdict == "failed":
            return "good: the survivors ended by themselves (the remedy worked)"
        if verdict == "hung" or row.get("all_exited") is False:
            return "bad: the survivors did not end by themselves (the remedy did not work)"
        return ""
    if verdict == "hung":
        return "the weakness: the job hangs after the fault"
    return ""
