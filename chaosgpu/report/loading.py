"""Loading chaosgpu journals for the report: files and folders, JSON, the timeline (inline or
in its file), normalised to seconds since its t0, and the `RunView` of each run.

This module owns turning a journal file into a `RunView`; what the facts and figures are is
chaosgpu.report.events and chaosgpu.report.figures. It never raises on a bad journal: a file
that cannot be used becomes a `Problem` with a clear message. Older journals (without the
control's typed events) still load: their facts are rebuilt and the run says so in its notes.
"""

import json
import math
import os
import re
from typing import Any

from chaosgpu.report import events as events_mod
from chaosgpu.report.figures import run_figures
from chaosgpu.report.model import METRICS, Problem, RunView

__all__ = ["load_journal", "load_journals"]


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


def _process(pid: str, series: dict[str, Any], t0: float) -> dict[str, Any]:
    """One process's series with its times (and its states' times) since t0."""
    t = [x - t0 if x > 1e8 else x for x in _floats(series.get("t"), f"process {pid} t")]
    mib = _floats(series.get("mib"), f"process {pid} mib")
    if len(t) != len(mib):
        raise ValueError(f"process {pid}: t and mib differ in length")
    states = []
    for item in series.get("states") or []:
        if isinstance(item, list | tuple) and len(item) == 2:
            at = float(item[0])
            states.append((at - t0 if at > 1e8 else at, str(item[1])))
    return {"t": t, "mib": mib, "tag": series.get("tag"), "rank": series.get("rank"),
            "states": states}


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
    processes = {str(pid): _process(str(pid), series, t0)
                 for pid, series in (raw.get("processes") or {}).items()}
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


def _declared(journal: dict[str, Any], section: dict[str, Any]) -> dict[str, str | None]:
    """What the experiment declares about itself: fault, remediation (and of what), scenario,
    tag id: from the chaosgpu section, the configuration, the tags."""
    experiment = journal["experiment"]
    tags = _tags(experiment)
    configuration = _configuration(experiment)

    def pick(key: str, tag: str) -> str | None:
        for source in (section.get(key), configuration.get(key), _tag_value(tags, tag)):
            if isinstance(source, str | int | float) and source != "":
                return str(source)  # (the typed section's "fault" is an object: not declared)
        return None

    remediation_of = pick("remediation_of", "remediation-of")
    remediation = pick("remediation", "remediation")
    if remediation is None and ("remediation" in tags or remediation_of):
        # a bare `remediation` tag: the title says which (minus a "Remediation:" prefix)
        title = str(experiment.get("title") or "remediation")
        remediation = title.split(":", 1)[1].strip() if title.lower().startswith(
            "remediation:") else title
    tag_id = configuration.get("tag")
    return {"fault": pick("fault", "fault"), "remediation": remediation or "none",
            "remediation_of": remediation_of, "scenario": pick("scenario", "scenario"),
            "tag_id": tag_id if isinstance(tag_id, str) else None}


def _backend(journal: dict[str, Any], section: dict[str, Any]) -> str | None:
    backend = section.get("backend") if isinstance(section.get("backend"), str) else None
    for entry in journal.get("run") or []:
        output = entry.get("output") if isinstance(entry, dict) else None
        if backend is None and isinstance(output, dict) and isinstance(output.get("backend"), str):
            backend = output["backend"]  # e.g. the ring says which backend it took
    return backend


def _memory_kind(timeline: dict[str, Any] | None) -> str:
    if timeline is None:
        return "unknown (no timeline)"
    if timeline.get("source") == "host-rss" or not timeline["devices"]:
        return "host memory (RSS of the tracked processes, not GPU memory)"
    return "GPU memory (NVML)"


def _fault_text(declared: str | None, fact: dict[str, Any] | None, typed: bool,
                notes: list[str], missing: list[str]) -> tuple[str, str | None]:
    """The fault as the report words it: what was observed (typed facts), else what the
    experiment declares; a disagreement is noted."""
    observed = events_mod.describe_fault(fact)
    kind = fact.get("kind") if fact else None
    if declared and observed and kind and declared != kind:
        notes.append(f"the experiment declares the fault '{declared}'; the journal records "
                     f"{events_mod.describe_fault(fact)}")
    if observed:
        return observed, kind
    if declared:
        return events_mod.KIND_WORDS.get(declared, declared) + " (declared)", declared
    missing.append("fault (no typed fault event, no fault recorded by a chaosgpu action, no "
                   "'fault' tag or configuration)" if not typed else "fault (none recorded)")
    return "unknown", None


def _status(journal: dict[str, Any], missing: list[str], notes: list[str]
            ) -> tuple[str, bool | None]:
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
    failed = [entry for entry in journal.get("rollbacks") or []
              if isinstance(entry, dict) and entry.get("status") == "failed"]
    for entry in failed:
        name = str((entry.get("activity") or {}).get("name", "rollback"))
        error = ("".join(entry.get("exception") or []).strip().splitlines() or [""])[-1]
        # "chaoslib.exceptions.ActivityFailed: chaosgpu.errors.ActivityError: <the message>"
        error = re.sub(r"^(?:[\w.]+(?:Error|Exception|Failed): )+", "", error)
        error = error if len(error) <= 300 else error[:297] + "..."
        notes.append(f"cleanup failed: rollback '{name}' failed ({error}): what it "
                     f"was to remove may still be there; no figure counts from this cleanup")
    return status, deviated


def _view(path: str, journal: dict[str, Any], section: dict[str, Any],
          problems: list[Problem]) -> RunView:
    experiment = journal["experiment"]
    missing: list[str] = []
    notes: list[str] = []
    declared = _declared(journal, section)
    status, deviated = _status(journal, missing, notes)
    timeline = _timeline(path, section, problems, missing)
    facts, typed = events_mod.journal_facts(journal, section, timeline)
    if not typed:
        notes.append(events_mod.LEGACY_NOTE)
    fault, fault_kind = _fault_text(declared["fault"], facts.get("fault"), typed, notes, missing)
    events = events_mod.run_events(timeline, facts)
    metrics, release_at = run_figures(journal, section, facts, timeline, events)
    if release_at is not None and not any(e["kind"] == "release" for e in events):
        events.append({"t": release_at, "name": "memory back", "phase": "point",
                       "activity": None, "kind": "release"})
        events.sort(key=lambda e: e["t"])
    for name, metric in metrics.items():
        if metric.value is None and metric.note is None \
                and not metric.source.startswith("not applicable"):
            missing.append(f"{METRICS[name][0]} ({metric.source})")
    duration = journal.get("duration")
    return RunView(
        path=path, name=os.path.splitext(os.path.basename(path))[0],
        title=str(experiment.get("title") or os.path.basename(path)),
        status=status, deviated=deviated, tags=_tags(experiment), fault=fault,
        remediation=str(declared["remediation"]), remediation_of=declared["remediation_of"],
        scenario=declared["scenario"], tag_id=declared["tag_id"],
        backend=_backend(journal, section), node=_describe_node(section.get("backend")),
        start=journal.get("start") if isinstance(journal.get("start"), str) else None,
        end=journal.get("end") if isinstance(journal.get("end"), str) else None,
        duration_s=float(duration) if isinstance(duration, int | float) else None,
        timeline=timeline, events=events, metrics=metrics, missing=missing, notes=notes,
        fault_kind=fault_kind, typed=typed, memory=_memory_kind(timeline),
        verdicts=list(facts.get("verdicts") or []))
