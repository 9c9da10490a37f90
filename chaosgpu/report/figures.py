"""A run's figures (`METRICS`) from its typed facts, its timeline and its probes' outputs.

This module owns how each figure is obtained (model.FIGURE_NOTES says what each is; every
`Metric` says where it came from). Inputs: the facts of chaosgpu.report.events (which activity
is the fault, its time, the signals, the release, the verdicts), the normalised timeline, and the
journal's activities, read by their provider function (never by their name). Integrals are
chaosgpu.timeline.integral's. Nothing here raises on an odd journal: a figure it cannot obtain
is None with the reason in its source.
"""

from typing import Any

from chaosgpu.report.model import METRICS, Metric
from chaosgpu.timeline.integral import RULE, gib_seconds

__all__ = ["PROJECTION_S", "derive", "end_mark", "failed_rollback_names", "memory_series",
           "run_figures", "total_process_series"]

PROJECTION_S = 600.0  # PyTorch's default NCCL timeout: how long a hang holds memory unaided
ORPHAN_FUNCS = ("orphans", "orphans_in_scope", "sandbox_orphans")
ZOMBIE_FUNCS = ("zombies", "zombies_in_scope", "sandbox_zombies")
KILL_KINDS = ("SIGKILL", "node-loss")


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def total_process_series(timeline: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Sum of every process's MiB over the union of their sample times (a process holds its last
    sampled value until its next sample, and nothing from `gone_t`, one interval after its last
    sample, on)."""
    series = list(timeline.get("processes", {}).values())
    times = sorted({t for s in series for t in s["t"]}
                   | {s["gone_t"] for s in series if s.get("gone_t") is not None})
    totals = []
    for t in times:
        total = 0.0
        for s in series:
            if not s["t"] or t < s["t"][0] or t > s["t"][-1]:
                continue
            lo, hi = 0, len(s["t"]) - 1
            while lo < hi:  # last sample at or before t
                mid = (lo + hi + 1) // 2
                if s["t"][mid] <= t:
                    lo = mid
                else:
                    hi = mid - 1
            total += s["mib"][lo]
        totals.append(total)
    return times, totals


def memory_series(timeline: dict[str, Any]) -> tuple[list[float], list[float], str] | None:
    """(t, MiB above the baseline, what it is): the sampler's total above its baseline; else the
    processes' sum; else the devices' used MiB above their lowest value."""
    total, baseline = timeline.get("total"), timeline.get("baseline_mib")
    if total and total["t"] and baseline is not None:
        return total["t"], [v - baseline for v in total["mib"]], "sampler total above its baseline"
    if timeline["processes"]:
        times, values = total_process_series(timeline)
        return times, values, "sum of the processes"
    devices = timeline.get("devices") or []
    if not devices:
        return None
    if len(devices) == 1:
        times, used = list(devices[0]["t"]), list(devices[0]["used_mib"])
    else:
        times, used = total_process_series({"processes": {
            str(i): {"t": d["t"], "mib": d["used_mib"]} for i, d in enumerate(devices)}})
    if not used:
        return None
    return times, [v - min(used) for v in used], "device used above its lowest value"


def _first_release(times: list[float], values: list[float], after: float) -> float | None:
    """The first sample at or after `after` within min(64 MiB, 5 % of held) (at least 1 MiB)."""
    threshold = max(1.0, min(64.0, 0.05 * max(values)))
    return next((t for t, v in zip(times, values, strict=True) if t >= after and v <= threshold),
                None)


def end_mark(events: list[dict[str, Any]]) -> float | None:
    """When the run's cleanup was over on the timeline: the end of the last rollbacks, else
    the end of the experiment (no rollbacks ran), else None (not marked)."""
    for name in ("rollbacks", "experiment"):
        ends = [float(e["t"]) for e in events if e.get("name") == name
                and e.get("phase") == "end" and isinstance(e.get("t"), int | float)]
        if ends:
            return max(ends)
    return None


def _residual_from(times: list[float], values: list[float], events: list[dict[str, Any]],
                   source: str, cleanup_failed: list[str]) -> Metric:
    """The residual: the series' last value when it was sampled after the rollbacks ended (or
    the experiment, without rollbacks); otherwise unknown, and said so: a sample taken before
    the rollbacks killed anything is no residual (90 MiB read for a process killed after it)."""
    end = end_mark(events)
    note = f"a rollback failed: {', '.join(cleanup_failed)}" if cleanup_failed else None
    if end is None:
        return Metric(None, "unknown: the timeline marks no end of the rollbacks or of the "
                            "experiment to take the residual after", "MiB", note)
    if times[-1] <= end:
        return Metric(None, f"unknown: no sample after the rollbacks ended (the last, at "
                            f"{times[-1]:.2f} s, came before their end at {end:.2f} s)", "MiB",
                      note)
    return Metric(round(max(0.0, values[-1]), 1),
                  source + f": its last value, sampled after the rollbacks ended ({end:.2f} s)",
                  "MiB", note)


def derive(timeline: dict[str, Any] | None, events: list[dict[str, Any]],
           cleanup_t: float | None = None,
           cleanup_failed: list[str] | None = None) -> dict[str, Metric]:
    """Figures computed from the timeline: held (peak), residual (the last value, when it was
    sampled after the rollbacks ended), release (the 'release' event after the fault, else the
    first sample back near zero) and GiB x s from the fault to the release, or to `cleanup_t`
    (the rollbacks' start) when memory was held until then, or to the timeline's end.
    `cleanup_failed` names the rollbacks that failed: memory held until such a cleanup is not
    said to be held "until the cleanup" (it may be held still)."""
    if timeline is None:
        return {}
    found = memory_series(timeline)
    if found is None or not found[1]:
        return {}
    times, values, what = found
    failed = list(cleanup_failed or [])
    source = f"computed from the timeline ({what})"
    out = {"memory_held_mib": Metric(round(max(values), 1), source, "MiB"),
           "residual_mib": _residual_from(times, values, events, source, failed)}
    fault_t = next((e["t"] for e in events if e["kind"] == "fault"), None)
    if fault_t is None:
        return out
    release_t = next((e["t"] for e in events if e["kind"] == "release" and e["t"] >= fault_t),
                     None)
    if release_t is None:
        release_t = _first_release(times, values, fault_t)
    positive = [max(0.0, v) for v in values]
    if failed and cleanup_t is not None and cleanup_t >= fault_t and (
            release_t is None or release_t > cleanup_t):
        # the cleanup failed: no figure counts from it as if it had ended the waste
        until = release_t if release_t is not None else times[-1]
        why = f"the cleanup failed ({', '.join(failed)})"
        out["release_s"] = Metric(None, f"memory not back before the rollbacks, and {why}",
                                  "s", "cleanup failed")
        out["gib_seconds"] = Metric(round(gib_seconds(times, positive, fault_t, until), 3),
                                    source + (", until memory was back" if release_t is not None
                                              else ", until the timeline's end"),
                                    "GiB x s", "cleanup failed")
        return out
    if cleanup_t is not None and cleanup_t >= fault_t and (release_t is None
                                                           or release_t > cleanup_t):
        waste = gib_seconds(times, positive, fault_t, cleanup_t)
        out["gib_seconds"] = Metric(round(waste, 3), source, "GiB x s",
                                    "held until the cleanup")
        out["release_s"] = Metric(None, "memory held until the cleanup", "s",
                                  "held until the cleanup")
        out["_cleanup_release_t"] = Metric(release_t, source, "s")
        return out
    if release_t is None:
        waste = gib_seconds(times, positive, fault_t, times[-1])
        out["release_s"] = Metric(None, "memory not released before the timeline ends", "s",
                                  "not released")
        out["gib_seconds"] = Metric(round(waste, 3), source + ", until its end", "GiB x s",
                                    "not released")
        return out
    out["release_s"] = Metric(round(release_t - fault_t, 3), source, "s")
    out["gib_seconds"] = Metric(round(gib_seconds(times, positive, fault_t, release_t), 3),
                                source, "GiB x s")
    return out


def _entries(journal: dict[str, Any]) -> list[tuple[str, str, str, Any]]:
    """(part, activity name, provider func, output) of run[] then rollbacks[]."""
    out = []
    for part, key in (("method", "run"), ("rollbacks", "rollbacks")):
        for entry in journal.get(key) or []:
            activity = entry.get("activity") if isinstance(entry, dict) else None
            if not isinstance(activity, dict):
                continue
            provider = activity.get("provider")
            func = str(provider.get("func") or "") if isinstance(provider, dict) else ""
            out.append((part, str(activity.get("name", "activity")), func, entry.get("output")))
    return out


def _event_t(events: list[dict[str, Any]], name: str, after: float | None = None) -> float | None:
    return next((float(e["t"]) for e in events if e["name"] == name
                 and e.get("phase") == "start" and (after is None or e["t"] >= after)), None)


def _count(value: Any) -> int | None:
    if isinstance(value, list | tuple):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def _most(journal: dict[str, Any], funcs: tuple[str, ...], after_fault: bool,
          fault: dict[str, Any] | None) -> Metric | None:
    """The most an orphan or zombie probe counted during the method (after the fault)."""
    best: Metric | None = None
    seen_fault = not after_fault
    for part, name, func, output in _entries(journal):
        if part != "method":
            continue
        if fault and name == fault.get("activity"):
            seen_fault = True
        value = _count(output) if func in funcs else None
        if value is None or not seen_fault:
            continue
        if best is None or value > best.value:
            best = Metric(value, f"output of '{name}' (most seen)")
    return best


def _fault_output(journal: dict[str, Any], fault: dict[str, Any] | None) -> Any:
    if not fault:
        return None
    return next((output for part, name, _func, output in _entries(journal)
                 if part == "method" and name == fault.get("activity")), None)


def _deletion(journal: dict[str, Any], fault: dict[str, Any] | None) -> Metric:
    record = _fault_output(journal, fault)
    if not isinstance(record, dict):
        return Metric(None, "no deletion record", "s")
    total = _number(record.get("total_s"))
    gone, sent = _number(record.get("gone")), _number(record.get("sigterm_sent"))
    if total is None and gone is not None and sent is not None:
        total = gone - sent
    if total is None:
        return Metric(None, "no deletion record", "s")
    activity = (fault or {}).get("activity")
    return Metric(round(total, 3), f"output of '{activity}' (SIGTERM sent to the pod gone)", "s")


def _cleanup_release(journal: dict[str, Any], events: list[dict[str, Any]],
                     rollbacks_t: float) -> tuple[float, float, str] | None:
    """(seconds from its start, its start, name) of the rollback action whose own record says
    when memory was back (`gpu_release` step or `took_s`, or `memory_back_after_cleanup_s`)."""
    for part, name, _func, output in _entries(journal):
        if part != "rollbacks" or not isinstance(output, dict):
            continue
        back = _number(output.get("memory_back_after_cleanup_s"))
        if output.get("gpu_memory_released") is True:
            steps = {str(s.get("step")): s for s in output.get("steps") or []
                     if isinstance(s, dict)}
            release = steps.get("gpu_release", {})
            back = _number(release.get("t")) if release.get("released") else None
            back = back if back is not None else _number(output.get("took_s"))
        start = _event_t(events, name, after=rollbacks_t)
        if back is not None and start is not None:
            return back, start, name
    return None


def _release_figures(result: dict[str, Metric], journal: dict[str, Any],
                     facts: dict[str, Any], events: list[dict[str, Any]],
                     derived: dict[str, Metric]) -> float | None:
    """release_s, cleanup_release_s, release_after_sigkill_s; return when memory was back."""
    release = facts.get("release") or {}
    fault = facts.get("fault") or {}
    release_at: float | None = None
    if isinstance(release.get("after_fault_s"), int | float):
        result["release_s"] = Metric(release["after_fault_s"], str(release.get("source")), "s")
        release_at = float(release["t"])
    elif "release_s" in derived:
        result["release_s"] = derived["release_s"]
        if derived["release_s"].value is not None and fault.get("t") is not None:
            release_at = float(fault["t"]) + float(derived["release_s"].value)
    rollbacks_t = _event_t(events, "rollbacks")
    if release_at is None and rollbacks_t is not None and "_cleanup_release_t" in derived:
        found = _cleanup_release(journal, events, rollbacks_t)
        if found is not None:
            back, start, name = found
            result["cleanup_release_s"] = Metric(round(back, 3), f"output of '{name}' (from "
                                                               f"its start)", "s")
            release_at = start + back
        elif isinstance(derived["_cleanup_release_t"].value, float):
            release_at = derived["_cleanup_release_t"].value
            starts = [e for e in events if e.get("phase") == "start" and e["name"] != "rollbacks"
                      and rollbacks_t <= e["t"] <= release_at]
            if starts:
                result["cleanup_release_s"] = Metric(
                    round(release_at - starts[-1]["t"], 3),
                    f"computed from the timeline (from the start of '{starts[-1]['name']}')", "s")
    if release_at is None:
        return None
    sent = [s for s in facts.get("signals") or [] if isinstance(s.get("t"), int | float)
            and s["t"] <= release_at + 1e-9]
    kills = [s["t"] for s in sent if s["signal"] == "SIGKILL"]
    terms = [s["t"] for s in sent if s["signal"] == "SIGTERM"]
    if kills:
        result["release_after_sigkill_s"] = Metric(
            round(release_at - max(kills), 3), "memory back minus the last SIGKILL sent before "
                                               "it", "s")
    elif terms:
        result["release_after_sigkill_s"] = Metric(
            None, "no SIGKILL was sent", "s",
            f"no SIGKILL; {release_at - max(terms):.2f} s after SIGTERM")
    else:
        result["release_after_sigkill_s"] = Metric(None, "no SIGKILL was sent", "s",
                                                   "no SIGKILL")
    return release_at


def _waste(result: dict[str, Metric], section: dict[str, Any], facts: dict[str, Any],
           derived: dict[str, Metric], timeline: dict[str, Any] | None,
           rollbacks_t: float | None) -> None:
    """gib_seconds (measured by gb_seconds_held from the fault activity, else computed) and
    its projection to PROJECTION_S when memory was held until the cleanup."""
    fault = facts.get("fault") or {}
    measurements = section.get("measurements")
    for record in (measurements or {}).get("gb_seconds_held") or [] if isinstance(
            measurements, dict) else []:
        value = record.get("value", record.get("gib_s")) if isinstance(record, dict) else None
        if isinstance(value, int | float) and record.get("from_event") == fault.get("activity"):
            result["gib_seconds"] = Metric(value, "gb_seconds_held (from "
                                                  f"'{record['from_event']}')", "GiB x s")
            break
    else:
        if "gib_seconds" in derived:
            result["gib_seconds"] = derived["gib_seconds"]
    waste = result["gib_seconds"]
    if waste.note != "held until the cleanup" or timeline is None or rollbacks_t is None \
            or fault.get("t") is None:
        return
    held_for = rollbacks_t - float(fault["t"])
    found = memory_series(timeline)
    if found is None or held_for >= PROJECTION_S:
        return
    times, values, _ = found
    at_cleanup = max(0.0, next((v for t, v in zip(times, values, strict=True)
                                if t >= rollbacks_t), values[-1]))
    projected = float(waste.value) + at_cleanup / 1024.0 * (PROJECTION_S - held_for)
    result["gib_seconds_600s"] = Metric(
        round(projected, 1), f"wasted until the cleanup ({held_for:.2f} s after the fault) plus "
                             f"{at_cleanup:.0f} MiB held to {PROJECTION_S:.0f} s", "GiB x s",
        f"projected: the cleanup came {held_for:.2f} s after the fault")


def _hang(result: dict[str, Metric], journal: dict[str, Any], facts: dict[str, Any]) -> None:
    rows = [r for r in facts.get("verdicts") or [] if r.get("part") == "method"]
    hung = [r for r in rows if r.get("verdict") == "hung"]
    if hung:
        result["hang_detected"] = Metric(True, f"verdict of '{hung[0]['activity']}'")
        after = _number(hung[0].get("after_fault_s"))
        if after is not None:
            result["detection_after_fault_s"] = Metric(after, f"verdict of "
                                                              f"'{hung[0]['activity']}'", "s")
    elif rows:
        result["hang_detected"] = Metric(False, f"verdicts of {[r['activity'] for r in rows]}")
    for part, name, _func, output in _entries(journal):
        if part == "rollbacks" and isinstance(output, dict) and isinstance(
                output.get("removed"), list) and isinstance(output.get("not_removed"), list):
            result["hang_cleaned"] = Metric(not output["not_removed"], f"output of '{name}'")


def _zombies(result: dict[str, Metric], journal: dict[str, Any], facts: dict[str, Any],
             timeline: dict[str, Any] | None, rollbacks_t: float | None) -> None:
    fault = facts.get("fault") or {}
    if fault.get("kind") not in KILL_KINDS:
        result["zombies_after_kill"] = Metric(None, "not applicable: no kill fault")
        return
    counted = _most(journal, ZOMBIE_FUNCS, True, fault)
    if counted is not None:
        result["zombies_after_kill"] = counted
        return
    if timeline is None or fault.get("t") is None:
        return
    kill_t = float(fault["t"])
    until = rollbacks_t if rollbacks_t is not None else timeline["end"]
    count = 0
    for series in timeline["processes"].values():
        seen = [(t, state) for t, state in series.get("states") or [] if t <= until]
        if seen and seen[-1][1] == "Z" and seen[-1][0] >= kill_t:
            count += 1
    result["zombies_after_kill"] = Metric(count, "computed from the timeline (process states "
                                                 "still Z when the rollbacks start)")


def _residual(result: dict[str, Metric], section: dict[str, Any],
              derived: dict[str, Metric]) -> None:
    if "residual_mib" in derived:
        result["residual_mib"] = derived["residual_mib"]
        return
    measurements = section.get("measurements")
    records = (measurements or {}).get("residual_gpu_memory") if isinstance(
        measurements, dict) else None
    for record in reversed(records or []):
        value = record.get("value", record.get("residual_mib")) if isinstance(
            record, dict) else None
        if isinstance(value, int | float):
            result["residual_mib"] = Metric(value, "residual_gpu_memory (its last record)", "MiB")
            return


def failed_rollback_names(journal: dict[str, Any]) -> list[str]:
    """The names of the journal's rollbacks that failed (Chaos Toolkit's status "failed")."""
    return [repr(str((entry.get("activity") or {}).get("name", "rollback")))
            for entry in journal.get("rollbacks") or []
            if isinstance(entry, dict) and entry.get("status") == "failed"]


def run_figures(journal: dict[str, Any], section: dict[str, Any], facts: dict[str, Any],
                timeline: dict[str, Any] | None, events: list[dict[str, Any]]
                ) -> tuple[dict[str, Metric], float | None]:
    """Every figure of METRICS (None with its reason when unknown) and when memory was back
    (seconds since t0, or None). A failed rollback leaves no figure counted from the cleanup
    (cleanup_release_s, gib_seconds_600s are then unknown, saying why)."""
    rollbacks_t = _event_t(events, "rollbacks")
    failed = failed_rollback_names(journal)
    derived = derive(timeline, events, rollbacks_t, failed)
    result = {name: Metric(None, "not in the journal", unit) for name, (_, unit)
              in METRICS.items()}
    if "memory_held_mib" in derived:
        result["memory_held_mib"] = derived["memory_held_mib"]
    orphans = _most(journal, ORPHAN_FUNCS, False, None)
    if orphans is not None:
        result["orphans"] = orphans
    result["deletion_s"] = _deletion(journal, facts.get("fault"))
    release_at = _release_figures(result, journal, facts, events, derived)
    _waste(result, section, facts, derived, timeline, rollbacks_t)
    _residual(result, section, derived)
    _hang(result, journal, facts)
    _zombies(result, journal, facts, timeline, rollbacks_t)
    if result["release_s"].value is not None:
        for name in ("cleanup_release_s", "gib_seconds_600s"):
            result[name] = Metric(None, "not applicable: memory came back before any cleanup",
                                  result[name].unit)
    if failed:
        for name in ("cleanup_release_s", "gib_seconds_600s"):
            if result[name].value is None:
                result[name] = Metric(None, f"the cleanup failed: rollback(s) "
                                            f"{', '.join(failed)} failed", result[name].unit,
                                      "cleanup failed")
    if not facts.get("fault"):
        for name in ("release_s", "gib_seconds"):
            if result[name].value is None:
                result[name] = Metric(None, "no fault identified in this journal",
                                      result[name].unit)
    result["gib_seconds"].source += f" [{RULE}]" if result["gib_seconds"].value is not None \
        and result["gib_seconds"].source.startswith("computed") else ""
    return result, release_at
