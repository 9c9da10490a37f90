"""Reading and validating Chaos Toolkit journals of chaosgpu experiments for the report.

This module owns turning a journal file into a `RunView`: what the run was (title, status,
deviation, fault, remediation, baseline it remediates), its timeline normalised to seconds since
the timeline's t0, its events classified (fault, SIGTERM, SIGKILL, release), and its figures
(`METRICS`) with where each came from. It must not draw, format or write anything, and it never
raises on a bad journal: a file that cannot be used becomes a `Problem` with a clear message.

Where a figure comes from, in order (the first that has it wins):
1. `journal["chaosgpu"]["measurements"]` (written by the timeline control / measurement probes);
2. the outputs of the activities (`run[]` then `rollbacks[]`, dict outputs, last one wins), by
   key (zombies only from activities at or after the first fault action: an action whose name
   or function reads as a kill, terminate, delete or freeze);
3. computed here from the timeline (held, time to release, GiB x s, residual): see `_derive`.
Zombies, orphans, deletion time and hang detection/cleanup are never guessed from a timeline.
"""

import datetime
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EVENT_KINDS",
    "METRICS",
    "Metric",
    "Problem",
    "RunView",
    "classify_event",
    "fault_time",
    "load_journal",
    "load_journals",
    "total_process_series",
]

# Canonical figure name -> (column title, unit, keys accepted in measurements / activity outputs).
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "memory_held_mib": (
        "memory held",
        "MiB",
        ("memory_held_mib", "held_mib", "gpu_held_mib", "peak_held_mib"),
    ),
    "orphans": ("orphans", "", ("orphans", "orphan_count", "orphans_count")),
    "zombies_after_kill": (
        "zombies after kill",
        "",
        ("zombies_after_kill", "zombie_count", "zombies_count", "zombies"),
    ),
    "deletion_s": (
        "deletion time",
        "s",
        ("deletion_s", "deletion_time_s", "termination_s", "terminate_s", "time_to_gone_s",
         "gone_s"),
    ),
    "release_s": (
        "memory back after the fault",
        "s",
        ("release_s", "time_to_release_s", "release_time_s"),
    ),
    "release_after_sigkill_s": (
        "memory back after SIGKILL",
        "s",
        ("release_after_sigkill_s",),
    ),
    "gib_seconds": (
        "wasted",
        "GiB x s",
        ("gib_seconds", "gib_s", "gib_x_s", "wasted_gib_s", "gb_seconds"),
    ),
    "residual_mib": ("residual", "MiB", ("residual_mib", "residual_gpu_mib")),
    "hang_detected": ("hang detected", "", ("hang_detected", "hang_suspected", "hung")),
    "hang_cleaned": ("hang cleaned", "", ("hang_cleaned", "cleaned")),
}

# Marks the timeline control puts around phases (never a fault).
STRUCTURAL_EVENTS = ("experiment", "method", "rollbacks", "steady-state-hypothesis")

# Event kinds, in the order a plot's legend lists them.
EVENT_KINDS = ("fault", "SIGTERM", "SIGKILL", "release", "other")


@dataclass
class Problem:
    """A journal (or part of one) the report could not use, and why."""

    path: str
    message: str


@dataclass
class Metric:
    """One figure of a run: its value (None = unknown) and where it came from."""

    value: Any
    source: str


@dataclass
class RunView:
    """What the report knows about one run, read from its journal."""

    path: str
    name: str
    title: str
    status: str
    deviated: bool | None
    tags: list[str]
    fault: str
    remediation: str
    remediation_of: str | None
    scenario: str | None
    tag_id: str | None
    backend: str | None
    node: str | None
    start: str | None
    end: str | None
    duration_s: float | None
    timeline: dict[str, Any] | None
    events: list[dict[str, Any]]
    metrics: dict[str, Metric]
    missing: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def is_remediation(self) -> bool:
        """Whether this run declares a remediation (anything but none)."""
        return self.remediation.lower() not in ("", "none", "-")


def classify_event(name: str) -> str:
    """Return the kind of an event (one of EVENT_KINDS) from its name."""
    lowered = name.lower()
    if "release" in lowered or "freed" in lowered:
        return "release"
    if "sigkill" in lowered or "kill" in lowered:
        return "SIGKILL"
    if "sigterm" in lowered or "term" in lowered or "delete" in lowered:
        return "SIGTERM"
    if any(word in lowered for word in ("fault", "freeze", "sigstop", "fail")):
        return "fault"
    return "other"


def load_journals(paths: list[str]) -> tuple[list[RunView], list[Problem]]:
    """Load many journals (files, or folders of *.json); bad ones become Problems."""
    runs: list[RunView] = []
    problems: list[Problem] = []
    for path in _expand(paths, problems):
        run, found = load_journal(path)
        problems.extend(found)
        if run is not None:
            runs.append(run)
    return runs, problems


def load_journal(path: str) -> tuple[RunView | None, list[Problem]]:
    """Load one journal file; return its RunView (or None) and the problems found in it."""
    problems: list[Problem] = []
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        return None, [Problem(path, f"cannot read the file: {error.strerror or error}")]
    try:
        journal = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno} column {error.colno}"
        hint = " (truncated?)" if error.pos >= len(text.rstrip()) - 1 else ""
        return None, [Problem(path, f"not valid JSON at {where}{hint}: {error.msg}")]
    if not isinstance(journal, dict) or not isinstance(journal.get("experiment"), dict):
        return None, [Problem(path, "not a Chaos Toolkit journal (no 'experiment' object)")]
    section = journal.get("chaosgpu")
    if section is not None and not isinstance(section, dict):
        problems.append(Problem(path, "the 'chaosgpu' key is not an object: ignored"))
        section = None
    if section is None and not _uses_chaosgpu(journal):
        return None, [
            Problem(path, "not a chaosgpu journal (no 'chaosgpu' section and no chaosgpu activity)")
        ]
    return _view(path, journal, section or {}, problems), problems


def _expand(paths: list[str], problems: list[Problem]) -> list[str]:
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(path, name) for name in os.listdir(path) if name.endswith(".json")
            )
            if not found:
                problems.append(Problem(path, "folder holds no *.json journal"))
            files.extend(found)
        elif os.path.exists(path):
            files.append(path)
        else:
            problems.append(Problem(path, "no such file"))
    return files


def _uses_chaosgpu(journal: dict[str, Any]) -> bool:
    experiment = journal.get("experiment") or {}
    text = json.dumps(
        [experiment.get("method"), experiment.get("steady-state-hypothesis"), experiment.get(
            "rollbacks"), experiment.get("controls")],
        default=str,
    )
    return '"chaosgpu' in text


def _tags(experiment: dict[str, Any]) -> list[str]:
    tags = experiment.get("tags")
    return [str(tag) for tag in tags] if isinstance(tags, list) else []


def _tag_value(tags: list[str], prefix: str) -> str | None:
    for tag in tags:
        if tag.startswith(prefix + ":"):
            return tag[len(prefix) + 1 :]
    return None


def _configuration(experiment: dict[str, Any]) -> dict[str, Any]:
    configuration = experiment.get("configuration")
    if not isinstance(configuration, dict):
        return {}
    nested = configuration.get("chaosgpu")
    merged = dict(configuration)
    if isinstance(nested, dict):
        merged.update(nested)
    return {key: _config_value(value) for key, value in merged.items()}


def _config_value(value: Any) -> Any:
    # Chaos Toolkit configuration entries may be {"type": "env", "key": ..., "default": ...}.
    if isinstance(value, dict) and value.get("type") == "env":
        return value.get("default")
    return value


def _describe_fault(experiment: dict[str, Any]) -> str:
    method = experiment.get("method")
    if not isinstance(method, list):
        return ""
    actions = []
    for activity in method:
        if isinstance(activity, dict) and activity.get("type") == "action":
            provider = activity.get("provider") or {}
            func = provider.get("func") if isinstance(provider, dict) else None
            name = str(activity.get("name") or func or "action")
            text = f"{name} ({func})" if func and func != name else name
            actions.append((text, classify_event(name) != "other"
                            or classify_event(str(func or "")) != "other"))
    # the first action that reads as a fault (kill, terminate, delete, freeze, fail), else the
    # first action
    for text, is_fault in actions:
        if is_fault:
            return text
    return actions[0][0] if actions else ""


def _view(
    path: str, journal: dict[str, Any], section: dict[str, Any], problems: list[Problem]
) -> RunView:
    experiment = journal["experiment"]
    tags = _tags(experiment)
    configuration = _configuration(experiment)
    missing: list[str] = []
    notes: list[str] = []

    def pick(key: str, tag: str) -> str | None:
        for source in (section.get(key), configuration.get(key), _tag_value(tags, tag)):
            if source not in (None, ""):
                return str(source)
        return None

    fault = pick("fault", "fault") or _describe_fault(experiment)
    if not fault:
        fault = "unknown"
        missing.append("fault (no 'fault' tag/configuration and no action in the method)")
    remediation_of = pick("remediation_of", "remediation-of")
    remediation = pick("remediation", "remediation")
    if remediation is None and ("remediation" in tags or remediation_of):
        # a bare `remediation` tag: the title says which (minus a "Remediation:" prefix)
        title = str(experiment.get("title") or "remediation")
        remediation = title.split(":", 1)[1].strip() if title.lower().startswith(
            "remediation:") else title
    remediation = remediation or "none"
    tag_id = configuration.get("tag") if isinstance(configuration.get("tag"), str) else None
    scenario = pick("scenario", "scenario")
    backend = section.get("backend") if isinstance(section.get("backend"), str) else None
    for entry in journal.get("run") or []:
        output = entry.get("output") if isinstance(entry, dict) else None
        if backend is None and isinstance(output, dict) and isinstance(output.get("backend"), str):
            backend = output["backend"]  # e.g. the ring says which backend it took
    node = _describe_node(section.get("backend"))

    status = journal.get("status")
    if not isinstance(status, str):
        status = "unknown"
        missing.append("status")
    deviated = journal.get("deviated")
    if not isinstance(deviated, bool):
        deviated = None
        missing.append("deviated")
    if status in ("interrupted", "aborted", "failed"):
        notes.append(f"the run did not complete (status {status}): figures may be partial")

    timeline = _timeline(path, section, problems, missing)
    events = _events(section, timeline, journal)
    metrics, release_at = _metrics(section, journal, timeline, events)
    _mark_release(events, metrics, release_at)
    for name, metric in metrics.items():
        if metric.value is None:
            missing.append(f"{METRICS[name][0]} ({metric.source})")
    duration = journal.get("duration")
    return RunView(
        path=path,
        name=os.path.splitext(os.path.basename(path))[0],
        title=str(experiment.get("title") or os.path.basename(path)),
        status=status,
        deviated=deviated,
        tags=tags,
        fault=fault,
        remediation=remediation,
        remediation_of=remediation_of,
        scenario=scenario,
        tag_id=tag_id,
        backend=backend,
        node=node,
        start=journal.get("start") if isinstance(journal.get("start"), str) else None,
        end=journal.get("end") if isinstance(journal.get("end"), str) else None,
        duration_s=float(duration) if isinstance(duration, int | float) else None,
        timeline=timeline,
        events=events,
        metrics=metrics,
        missing=missing,
        notes=notes,
    )


def fault_time(events: list[dict[str, Any]], prefer_instant: bool = True) -> float | None:
    """When the fault happened: the first event of kind fault/SIGTERM/SIGKILL; when that is an
    action's start, the first such instant reported during that action (a signal's `sent_at`, a
    `fault:` mark), which is when the signal really went."""
    faults = [e for e in events if e["kind"] in ("fault", "SIGTERM", "SIGKILL")]
    if not faults:
        return None
    first = faults[0]
    if not prefer_instant or first.get("phase") != "start":
        return float(first["t"])
    ends = [e["t"] for e in events if e["name"] == first["name"] and e.get("phase") == "end"
            and e["t"] >= first["t"]]
    end = ends[0] if ends else first["t"]
    instants = [e["t"] for e in faults
                if e.get("phase") == "point" and first["t"] <= e["t"] <= end]
    return float(instants[0] if instants else first["t"])


def _mark_release(events: list[dict[str, Any]], metrics: dict[str, "Metric"],
                  release_at: float | None) -> None:
    """Add the release (when memory was back, seconds since t0) as an event when none was
    recorded."""
    if release_at is None or any(e["kind"] == "release" for e in events):
        return
    release = metrics["release_s"].value
    label = f"+{release:.2f} s" if isinstance(release, int | float) else str(release)
    events.append({"t": release_at, "name": f"memory back ({label})",
                   "phase": "point", "activity": None, "kind": "release"})
    events.sort(key=lambda e: e["t"])


def _describe_node(backend: Any) -> str | None:
    """'NVIDIA H200 x1, driver 580.159' from the control's backend record, or why no GPU."""
    if not isinstance(backend, dict) or not isinstance(backend.get("gpu"), dict):
        return None
    gpu = backend["gpu"]
    if not gpu.get("available"):
        return f"no GPU ({gpu.get('reason') or 'NVML not available'})"
    names = [str(name) for name in gpu.get("devices") or []]
    counted = ", ".join(f"{name} x{names.count(name)}" for name in dict.fromkeys(names))
    return f"{counted or 'GPU'}, driver {gpu.get('driver') or '?'}"


def _timeline(
    path: str, section: dict[str, Any], problems: list[Problem], missing: list[str]
) -> dict[str, Any] | None:
    raw = section.get("timeline")
    pointer = section.get("timeline_file")
    if raw is None and isinstance(pointer, str) and pointer:
        target = pointer if os.path.isabs(pointer) else os.path.join(os.path.dirname(path), pointer)
        beside = os.path.join(os.path.dirname(path), os.path.basename(pointer))
        if not os.path.exists(target) and os.path.exists(beside):
            target = beside  # the journal and its timeline file were moved together
        try:
            with open(target, encoding="utf-8") as handle:
                raw = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            problems.append(Problem(path, f"timeline file {pointer!r} unusable: {error}"))
            raw = None
    if raw is None:
        missing.append("timeline (no 'chaosgpu.timeline' and no readable 'timeline_file')")
        if not pointer:
            problems.append(Problem(path, "no timeline in this journal (declare the control "
                                          "chaosgpu.timeline.control): tables only, no plot"))
        return None
    try:
        return _normalise_timeline(raw)
    except (TypeError, ValueError, KeyError) as error:
        problems.append(Problem(path, f"timeline malformed, ignored: {error}"))
        missing.append("timeline (malformed)")
        return None


def _floats(values: Any, what: str) -> list[float]:
    if not isinstance(values, list):
        raise ValueError(f"{what} is not a list")
    out = []
    for value in values:
        number = float(value)
        if math.isnan(number):
            raise ValueError(f"{what} holds NaN")
        out.append(number)
    return out


def _normalise_timeline(raw: Any) -> dict[str, Any]:
    """Return the timeline with every `t` in seconds since t0 (absolute unix times converted)."""
    if not isinstance(raw, dict):
        raise ValueError("timeline is not an object")
    t0 = float(raw.get("t0") or 0.0)

    def rel(times: list[float]) -> list[float]:
        # Times above 1e8 are unix times (the contract allows either); make them relative.
        return [t - t0 if t > 1e8 else t for t in times]

    devices = []
    for device in raw.get("devices") or []:
        t = rel(_floats(device.get("t"), f"device {device.get('index')} t"))
        used = _floats(device.get("used_mib"), f"device {device.get('index')} used_mib")
        if len(t) != len(used):
            raise ValueError(f"device {device.get('index')}: t and used_mib differ in length")
        devices.append({"index": device.get("index"), "t": t, "used_mib": used})
    processes: dict[str, dict[str, Any]] = {}
    for pid, series in (raw.get("processes") or {}).items():
        t = rel(_floats(series.get("t"), f"process {pid} t"))
        mib = _floats(series.get("mib"), f"process {pid} mib")
        if len(t) != len(mib):
            raise ValueError(f"process {pid}: t and mib differ in length")
        states = []
        for item in series.get("states") or []:
            if isinstance(item, list | tuple) and len(item) == 2:
                at = float(item[0])
                states.append((at - t0 if at > 1e8 else at, str(item[1])))
        processes[str(pid)] = {"t": t, "mib": mib, "tag": series.get("tag"),
                               "rank": series.get("rank"), "states": states}
    total = None
    if raw.get("t") is not None and raw.get("total_mib") is not None:
        total_t = rel(_floats(raw.get("t"), "t"))
        total_mib = _floats(raw.get("total_mib"), "total_mib")
        if len(total_t) != len(total_mib):
            raise ValueError("t and total_mib differ in length")
        total = {"t": total_t, "mib": total_mib}
    baseline = raw.get("baseline")
    baseline_mib = None
    if isinstance(baseline, dict) and isinstance(baseline.get("total_mib"), int | float):
        baseline_mib = float(baseline["total_mib"])
    ends = [d["t"][-1] for d in devices if d["t"]] + [p["t"][-1] for p in processes.values()
                                                       if p["t"]]
    if total and total["t"]:
        ends.append(total["t"][-1])
    end = max(ends) if ends else 0.0
    for series in processes.values():
        # A process is gone one sampling interval after its last sample, when the timeline
        # went on beyond that (else it was still there when the timeline ended).
        times = series["t"]
        step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        gone = times[-1] + step if times else None
        series["gone_t"] = gone if gone is not None and step > 0 and gone <= end else None
    events = []
    for event in raw.get("events") or []:
        if isinstance(event, dict) and isinstance(event.get("t"), int | float):
            at = float(event["t"])
            entry = dict(event)
            entry.update(t=at - t0 if at > 1e8 else at, name=str(event.get("name", "")))
            events.append(entry)
    return {
        "t0": t0,
        "rate_hz": raw.get("rate_hz"),
        "overhead_cpu_pct": raw.get("overhead_cpu_pct"),
        "source": raw.get("source"),
        "devices": devices,
        "processes": processes,
        "events": events,
        "end": end,
        "total": total,
        "baseline_mib": baseline_mib,
    }


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


def _events(
    section: dict[str, Any], timeline: dict[str, Any] | None, journal: dict[str, Any]
) -> list[dict[str, Any]]:
    """Events in seconds since t0, each with a kind; from the timeline, the section, and the
    method's actions (their start) when the sampler recorded none."""
    t0 = timeline["t0"] if timeline else None
    events: list[dict[str, Any]] = []
    seen = set()

    def add(t: float, name: str, event: dict[str, Any]) -> None:
        phase = event.get("phase")
        key = (round(t, 4), name, phase)
        if key in seen:
            return
        seen.add(key)
        kind = "other"
        # Only an action's start (or a point event) can be a fault; probes, ends and the
        # control's structural marks are context.
        if phase in (None, "start", "point") and event.get("type") in (None, "action") \
                and name not in STRUCTURAL_EVENTS:
            kind = classify_event(name)
        events.append({"t": t, "name": name, "phase": phase,
                       "activity": event.get("activity"), "kind": kind})

    for event in (timeline or {}).get("events", []):
        add(event["t"], event["name"], event)
    for event in section.get("events") or []:
        if isinstance(event, dict) and isinstance(event.get("t"), int | float):
            t = float(event["t"])
            if t > 1e8:
                if t0 is None:
                    continue
                t -= t0
            add(t, str(event.get("name", "")), event)
    if t0:
        for entry in (journal.get("run") or []) + (journal.get("rollbacks") or []):
            if not isinstance(entry, dict):
                continue
            activity = entry.get("activity") if isinstance(entry.get("activity"), dict) else {}
            for name, at in _output_instants(entry.get("output")):
                add(at - t0, name, {"activity": (activity or {}).get("name"), "phase": "point"})
    if not [e for e in events if e["kind"] != "other"] and t0:
        for entry in journal.get("run") or []:
            activity = entry.get("activity") if isinstance(entry, dict) else None
            if not isinstance(activity, dict) or activity.get("type") != "action":
                continue
            start = _iso_to_unix(entry.get("start"))
            if start is not None:
                add(start - t0, str(activity.get("name", "action")),
                    {"activity": activity.get("name"), "phase": "start", "type": "action"})
    events.sort(key=lambda e: e["t"])
    return events


# Instants an action reports in its output (unix times), as events: key -> event name.
OUTPUT_INSTANTS = {
    "sigterm_sent": "SIGTERM sent",
    "delete_sent_at": "delete sent (SIGTERM)",
    "sigkill_sent": "SIGKILL sent",
    "gone": "gone",
}


def _is_unix(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 1e8


def _output_instants(output: Any) -> list[tuple[str, float]]:
    """(event name, unix time) found in an activity's output, one level of nesting deep."""
    found: list[tuple[str, float]] = []
    items: list[Any] = [output]
    if isinstance(output, dict):
        items += [v for v in output.values() if isinstance(v, dict)]
        for value in output.values():
            if isinstance(value, list):
                items += [v for v in value if isinstance(v, dict)]
    elif isinstance(output, list):
        items += [v for v in output if isinstance(v, dict)]
    signal = output.get("signal") if isinstance(output, dict) else None
    for item in items:
        if not isinstance(item, dict):
            continue
        for key, name in OUTPUT_INSTANTS.items():
            if _is_unix(item.get(key)):
                found.append((name, float(item[key])))
        # a signal sender's `sent_at` (per process, the signal named beside or above it)
        named = item.get("signal") or signal
        if _is_unix(item.get("sent_at")) and isinstance(named, str):
            found.append((f"{named} sent", float(item["sent_at"])))
    # one event per (name, instant to the millisecond): 100 processes signalled at once
    # make one mark
    unique: dict[tuple[str, float], tuple[str, float]] = {}
    for name, at in found:
        unique.setdefault((name, round(at, 2)), (name, at))
    return list(unique.values())


def _count(value: Any) -> Any:
    if isinstance(value, list | tuple | set):
        return len(value)
    return value


def _lookup(source: dict[str, Any], keys: tuple[str, ...]) -> tuple[bool, Any]:
    for key in keys:
        if key in source and not isinstance(source[key], dict):
            value = source[key]
            if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                continue  # a probe's list of records (below), not a count
            return True, _count(value)
    return False, None


# The timeline probes record `measurements[<probe>] = [record, ...]`: figure <- (probe, field).
PROBE_RECORDS: dict[str, tuple[tuple[str, str], ...]] = {
    "residual_mib": (("residual_gpu_memory", "residual_mib"),),
    "release_s": (("memory_release_time", "seconds"),
                  ("termination_timings", "memory_released_after_s")),
    "gib_seconds": (("gb_seconds_held", "gib_s"),),
    "deletion_s": (("termination_timings", "all_dead_after_s"),),
}

# Activities whose output is a bare value: provider func -> figure (lists count their items).
FUNC_OUTPUTS: dict[str, str] = {
    "zombies": "zombies_after_kill",
    "zombies_in_scope": "zombies_after_kill",
    "orphans": "orphans",
    "orphans_in_scope": "orphans",
    "memory_release_time": "release_s",
    "gb_seconds_held": "gib_seconds",
    "residual_gpu_memory": "residual_mib",
    "hung_jobs": "hang_detected",
    "sandbox_zombies": "zombies_after_kill",
    "sandbox_orphans": "orphans",
}


def _probe_record(measurements: dict[str, Any], metric: str) -> tuple[bool, Any, str]:
    """First record with a value, e.g. the release time measured after the fault (a second
    measurement after the rollback is not the fault's)."""
    for probe, key in PROBE_RECORDS.get(metric, ()):
        records = measurements.get(probe)
        if not isinstance(records, list):
            continue
        for record in records:
            if isinstance(record, dict) and record.get(key) is not None:
                return True, record[key], f"chaosgpu.measurements.{probe}"
    return False, None, ""


def _activity_outputs(journal: dict[str, Any]) -> list[tuple[str, str, Any, bool, bool]]:
    """(activity name, provider func, output, at or after the fault, in the rollbacks) of run[]
    then rollbacks[]."""
    outputs = []
    after_fault = False
    method_entries = len(journal.get("run") or [])
    for index, entry in enumerate((journal.get("run") or []) + (journal.get("rollbacks") or [])):
        if not isinstance(entry, dict):
            continue
        activity: dict[str, Any] = entry.get("activity") or {}
        if not isinstance(activity, dict):
            activity = {}
        name = str(activity.get("name", "activity"))
        provider: dict[str, Any] = activity.get("provider") or {}
        if not isinstance(provider, dict):
            provider = {}
        func = str(provider.get("func") or "")
        if activity.get("type") == "action" and (
            classify_event(name) != "other" or classify_event(func) != "other"
        ):
            after_fault = True
        if "output" in entry and entry["output"] is not None:
            outputs.append((name, func, entry["output"], after_fault, index >= method_entries))
    return outputs


def _metrics(
    section: dict[str, Any],
    journal: dict[str, Any],
    timeline: dict[str, Any] | None,
    events: list[dict[str, Any]],
) -> tuple[dict[str, Metric], float | None]:
    measurements = section.get("measurements")
    measurements = measurements if isinstance(measurements, dict) else {}
    outputs = _activity_outputs(journal)
    derived = _derive(timeline, events)
    result: dict[str, Metric] = {}
    for metric, (_, _, keys) in METRICS.items():
        found, value = _lookup(measurements, keys)
        if found:
            result[metric] = Metric(value, "chaosgpu.measurements")
            continue
        found, value, source = _probe_record(measurements, metric)
        if found:
            result[metric] = Metric(value, source)
            continue
        counted = metric in ("orphans", "zombies_after_kill")
        best: Metric | None = None
        for name, func, output, after, rollback in reversed(outputs):
            if metric == "zombies_after_kill" and not after:
                continue  # zombies counted before the fault are not "after kill"
            if counted and rollback:
                continue  # what a rollback saw is after the cleanup, not the fault's effect
            if isinstance(output, dict):
                found, value = _lookup(output, keys)
                if not found and metric == "hang_cleaned" and after and isinstance(
                        output.get("removed"), list) and isinstance(output.get("not_removed"),
                                                                    list):
                    # a hang cleanup's record: cleaned when nothing was left behind
                    found, value = True, not output["not_removed"]
                detection = output.get("detection")
                after_fault = detection.get("after_fault_s") if isinstance(detection, dict) \
                    else output.get("detected_after_fault_s")
                if found and metric == "hang_detected" and value is True and isinstance(
                        after_fault, int | float):
                    after_s = float(after_fault)
                    value = f"yes, {after_s:.3f} s after the fault" if after_s < 0.1 \
                        else f"yes, {after_s:.2f} s after the fault"
                if not found and metric == "deletion_s" and _is_unix(output.get("gone")) \
                        and _is_unix(output.get("sigterm_sent")):
                    found, value = True, round(output["gone"] - output["sigterm_sent"], 3)
            else:
                found = FUNC_OUTPUTS.get(func) == metric
                value = _count(output) if found else None
                if found and metric == "hang_detected" and isinstance(value, int) \
                        and not isinstance(value, bool):
                    value = value > 0
            if not found:
                continue
            if not counted:
                best = Metric(value, f"output of '{name}'")
                break
            # counts: the most seen by any such activity
            if best is None or (isinstance(value, int) and value > (best.value or 0)):
                best = Metric(value, f"output of '{name}' (most seen)")
        if best is not None:
            result[metric] = best
        elif metric in derived:
            result[metric] = derived[metric]
        else:
            result[metric] = Metric(None, "not in the journal")
    release_at = _refine(result, journal, measurements, timeline, events, derived)
    return result, release_at


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
            # last sample at or before t
            lo, hi = 0, len(s["t"]) - 1
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if s["t"][mid] <= t:
                    lo = mid
                else:
                    hi = mid - 1
            total += s["mib"][lo]
        totals.append(total)
    return times, totals


def _device_total(timeline: dict[str, Any]) -> tuple[list[float], list[float]]:
    devices = timeline.get("devices") or []
    if not devices:
        return [], []
    if len(devices) == 1:
        return list(devices[0]["t"]), list(devices[0]["used_mib"])
    pseudo = {"processes": {str(i): {"t": d["t"], "mib": d["used_mib"]}
                            for i, d in enumerate(devices)}}
    return total_process_series(pseudo)


def _integral_gib_s(times: list[float], values: list[float], start: float, end: float) -> float:
    """Left-step integral of MiB over [start, end], in GiB x s (MiB / 1024 x s)."""
    total = 0.0
    for i, t in enumerate(times):
        nxt = times[i + 1] if i + 1 < len(times) else end
        lo, hi = max(t, start), min(nxt, end)
        if hi > lo:
            total += values[i] * (hi - lo)
    return total / 1024.0


def _derive(timeline: dict[str, Any] | None, events: list[dict[str, Any]]) -> dict[str, Metric]:
    """Figures computed from the timeline when no probe measured them.

    The memory series is, in order of preference: the sampler's total (`t`/`total_mib`) above
    its recorded baseline (what the timeline probes use); else the processes' summed MiB; else
    the devices' used MiB above their lowest value. held = the series' peak; residual = its last
    value (>= 0). fault = `fault_time` (the first instant a fault action reported, else the
    start of the first fault action); release = the first
    'release' event after the fault, else the first sample after it where the series is within
    min(64 MiB, 5 % of held) (at least 1 MiB) of zero; time to release = release - fault;
    GiB x s = the series' integral from fault to release (to the end when never released).
    Zombies after kill are not computed here (see `_zombies_from_states`)."""
    if timeline is None:
        return {}
    out: dict[str, Metric] = {}
    source = "computed from the timeline"
    total, baseline = timeline.get("total"), timeline.get("baseline_mib")
    if total and total["t"] and baseline is not None:
        series_t, series_v = total["t"], [v - baseline for v in total["mib"]]
        what = "sampler total above its baseline"
    elif timeline["processes"]:
        series_t, series_v = total_process_series(timeline)
        what = "sum of the processes"
    else:
        dev_t, dev_used = _device_total(timeline)
        if not dev_t:
            return out
        series_t, series_v = dev_t, [v - min(dev_used) for v in dev_used]
        what = "device used above its lowest value"
    source = f"{source} ({what})"
    if not series_v:
        return out
    held = max(series_v)
    out["memory_held_mib"] = Metric(round(held, 1), source)
    out["residual_mib"] = Metric(round(max(0.0, series_v[-1]), 1), source)
    fault_at = fault_time(events)
    if fault_at is None:
        return out
    fault_t = fault_at
    release_t = None
    for event in events:
        if event["kind"] == "release" and event["t"] >= fault_t:
            release_t = event["t"]
            break
    if release_t is None:
        threshold = max(1.0, min(64.0, 0.05 * held))
        for t, v in zip(series_t, series_v, strict=True):
            if t >= fault_t and v <= threshold:
                release_t = t
                break
    if release_t is None:
        out["release_s"] = Metric(None, "memory not released before the timeline ends")
        waste = _integral_gib_s(series_t, [max(0.0, v) for v in series_v], fault_t, series_t[-1])
        out["gib_seconds"] = Metric(round(waste, 3), source + ", until its end: not released")
        return out
    out["release_s"] = Metric(round(release_t - fault_t, 3), source)
    waste = _integral_gib_s(series_t, [max(0.0, v) for v in series_v], fault_t, release_t)
    out["gib_seconds"] = Metric(round(waste, 3), source)
    return out


def _entries(journal: dict[str, Any], key: str) -> list[tuple[str, str, dict[str, Any], Any]]:
    """(activity name, provider func, provider arguments, output) of journal[key]."""
    out = []
    for entry in journal.get(key) or []:
        if not isinstance(entry, dict) or not isinstance(entry.get("activity"), dict):
            continue
        activity = entry["activity"]
        provider: dict[str, Any] = activity["provider"] if isinstance(
            activity.get("provider"), dict) else {}
        arguments: dict[str, Any] = provider["arguments"] if isinstance(
            provider.get("arguments"), dict) else {}
        out.append((str(activity.get("name", "activity")), str(provider.get("func") or ""),
                    arguments, entry.get("output")))
    return out


def _event_t(events: list[dict[str, Any]], name: str, phase: str = "start",
             after: float | None = None) -> float | None:
    for event in events:
        if event["name"] == name and event.get("phase") == phase and (
                after is None or event["t"] >= after):
            return float(event["t"])
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _fault_entry(journal: dict[str, Any]) -> tuple[str, str, dict[str, Any], Any] | None:
    """The method's first action that reads as a fault (kill, terminate, delete, freeze)."""
    for name, func, arguments, output in _entries(journal, "run"):
        if classify_event(name) != "other" or classify_event(func) != "other":
            return name, func, arguments, output
    return None


def _kill_entry(journal: dict[str, Any]) -> tuple[int, str] | None:
    """(index in run[], name) of the method's first action that killed (SIGKILL): its output or
    arguments name SIGKILL, or, when neither names a signal, its name or function says kill.
    A pod deletion (SIGTERM, SIGKILL at the grace's end) or a freeze is no kill fault."""
    for index, (name, func, arguments, output) in enumerate(_entries(journal, "run")):
        signal = output.get("signal") if isinstance(output, dict) else None
        if signal is None:
            argument = arguments.get("signal")
            signal = argument if isinstance(argument, str) and "${" not in argument else None
        if isinstance(signal, str):
            if signal.upper() in ("SIGKILL", "KILL", "9"):
                return index, name
            continue
        if "kill" in name.lower() or "kill" in func.lower():
            return index, name
    return None


def _zombies_from_states(timeline: dict[str, Any], kill_t: float, until: float) -> int:
    """Processes still zombies when the teardown starts: their last recorded state at or before
    `until` (the rollbacks' start, else the timeline's end) is Z, entered at or after the kill.
    A process that was a zombie only while being reaped is not counted."""
    count = 0
    for series in timeline["processes"].values():
        seen = [(t, state) for t, state in series.get("states") or [] if t <= until]
        if seen and seen[-1][1] == "Z" and seen[-1][0] >= kill_t:
            count += 1
    return count


def _cleanup_release(output: Any) -> tuple[float | None, float | None, float | None]:
    """(memory back, SIGTERM, SIGKILL), seconds from the cleanup action's start, from a cleanup
    record (`gpu_memory_released` with a `gpu_release` step or `took_s`; steps `sigterm`,
    `sigkill` with `t`; or `memory_back_after_cleanup_s`)."""
    if not isinstance(output, dict):
        return None, None, None
    steps = {str(step.get("step")): step for step in output.get("steps") or []
             if isinstance(step, dict)}
    term = _number(steps.get("sigterm", {}).get("t"))
    kill = _number(steps.get("sigkill", {}).get("t"))
    if steps.get("sigkill", {}).get("sent") in (0, None) and "sent" in steps.get("sigkill", {}):
        kill = None
    back = _number(output.get("memory_back_after_cleanup_s"))
    if output.get("gpu_memory_released") is True:
        release = steps.get("gpu_release", {})
        back = _number(release.get("t")) if release.get("released") else None
        back = back if back is not None else _number(output.get("took_s"))
    return back, term, kill


def _refine(
    result: dict[str, Metric],
    journal: dict[str, Any],
    measurements: dict[str, Any],
    timeline: dict[str, Any] | None,
    events: list[dict[str, Any]],
    derived: dict[str, Metric],
) -> float | None:
    """Replace the generic figures where the journal says more precisely what happened; return
    when memory was back (seconds since t0), or None.

    - memory back after the fault: the method's `memory_release_time` probe (seconds from its
      `after_event`'s start), else a measured record of it (not one noted as unmeasured), else
      the timeline; when memory came back only during the rollbacks, the seconds from the start
      of the rollback action that freed it (its own record when it has one), labelled so.
    - memory back after SIGKILL: memory back minus the last SIGKILL before it (a signal instant
      from an action's output, else a kill action's start); "no SIGKILL" when none was sent.
    - deletion time: the fault action's own record (`total_s`, else `gone - sigterm_sent`).
    - residual: the timeline's last value (after the rollbacks), when there is a timeline.
    - zombies after kill: not applicable without a kill fault; else the figure an activity after
      the kill reported, else `_zombies_from_states` up to the rollbacks' start.
    """
    direct = "chaosgpu.measurements"
    fault = _fault_entry(journal)
    # deletion time
    if fault is not None and result["deletion_s"].source != direct and isinstance(fault[3], dict):
        record = fault[3]
        total = _number(record.get("total_s"))
        if total is None and _is_unix(record.get("gone")) and _is_unix(record.get("sigterm_sent")):
            total = record["gone"] - record["sigterm_sent"]
        if total is not None:
            result["deletion_s"] = Metric(round(total, 3), f"output of '{fault[0]}' (SIGTERM sent "
                                                           "to the pod gone)")
    # residual
    if result["residual_mib"].source != direct and "residual_mib" in derived:
        result["residual_mib"] = Metric(derived["residual_mib"].value,
                                        derived["residual_mib"].source + ": its last value")
    # memory back after the fault
    release_at: float | None = None
    rollbacks_t = _event_t(events, "rollbacks")
    if result["release_s"].source != direct:
        for name, func, arguments, output in _entries(journal, "run"):
            after_event = arguments.get("after_event")
            value = _number(output)
            if func == "memory_release_time" and value is not None and isinstance(
                    after_event, str):
                origin = _event_t(events, after_event)
                if origin is not None:
                    result["release_s"] = Metric(value, f"output of '{name}' (from the start of "
                                                        f"'{after_event}')")
                    release_at = origin + value
                    break
        else:
            for record in measurements.get("memory_release_time") or []:
                value = _number(record.get("seconds")) if isinstance(record, dict) else None
                if value is None or record.get("note") or not isinstance(
                        record.get("after_event"), str):
                    continue
                origin = _event_t(events, record["after_event"], str(record.get("phase")
                                                                     or "start"))
                if origin is not None:
                    result["release_s"] = Metric(value, "chaosgpu.measurements.memory_release_time"
                                                        f" (from the start of "
                                                        f"'{record['after_event']}')")
                    release_at = origin + value
                    break
    fault_t = fault_time(events)
    if release_at is None and fault_t is not None:
        derived_release = _number(derived.get("release_s", Metric(None, "")).value)
        if derived_release is not None:
            release_at = fault_t + derived_release
    extra_kills: list[float] = []
    extra_terms: list[float] = []
    if rollbacks_t is not None and (release_at is None or release_at >= rollbacks_t) \
            and result["release_s"].source != direct:
        for name, _func, _arguments, output in _entries(journal, "rollbacks"):
            back, term, kill = _cleanup_release(output)
            start = _event_t(events, name, after=rollbacks_t)
            if back is None or start is None:
                continue
            result["release_s"] = Metric(f"{back:.2f} after the cleanup started",
                                         f"output of '{name}' (memory back during the rollbacks, "
                                         f"from the start of '{name}')")
            release_at = start + back
            extra_terms += [start + term] if term is not None else []
            extra_kills += [start + kill] if kill is not None else []
            break
        else:
            if release_at is not None:
                starts = [e for e in events if e.get("phase") == "start"
                          and rollbacks_t < e["t"] <= release_at and e["name"] != "rollbacks"]
                if starts:
                    back = release_at - starts[-1]["t"]
                    result["release_s"] = Metric(
                        f"{back:.2f} after the cleanup started",
                        f"computed from the timeline (memory back during the rollbacks, from "
                        f"the start of '{starts[-1]['name']}')")
    # memory back after SIGKILL
    if release_at is not None and result["release_after_sigkill_s"].source != direct:
        kinds = [e for e in events if e["t"] <= release_at + 1e-9]
        points = [e["t"] for e in kinds if e["kind"] == "SIGKILL" and e.get("phase") == "point"]
        kills = sorted(points + extra_kills) or [
            e["t"] for e in kinds if e["kind"] == "SIGKILL"]
        terms = sorted([e["t"] for e in kinds if e["kind"] == "SIGTERM"
                        and e.get("phase") == "point"] + extra_terms)
        if kills:
            result["release_after_sigkill_s"] = Metric(
                round(release_at - kills[-1], 3),
                "memory back (as in the previous column) minus the last SIGKILL sent before it")
        elif terms:
            result["release_after_sigkill_s"] = Metric(
                f"no SIGKILL ({release_at - terms[-1]:.2f} after SIGTERM)",
                "no SIGKILL was sent: memory back minus the last SIGTERM sent before it")
        else:
            result["release_after_sigkill_s"] = Metric("no SIGKILL", "no SIGKILL was sent")
    # zombies after kill
    if result["zombies_after_kill"].source != direct:
        killer = _kill_entry(journal)
        if killer is None:
            result["zombies_after_kill"] = Metric(None, "not applicable: no kill fault")
        elif not result["zombies_after_kill"].source.startswith("output of") \
                and timeline is not None:
            kill_t = _event_t(events, killer[1])
            if kill_t is not None:
                until = rollbacks_t if rollbacks_t is not None else timeline["end"]
                result["zombies_after_kill"] = Metric(
                    _zombies_from_states(timeline, kill_t, until),
                    f"computed from the timeline (process states: still Z when the rollbacks "
                    f"start, after '{killer[1]}')")
    return release_at
