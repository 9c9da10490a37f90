"""The timeline control: Chaos Toolkit hooks that run the sampler for the whole experiment.

Declare it in an experiment (or in the settings) as:

    "controls": [{"name": "chaosgpu-timeline", "provider": {"type": "python",
        "module": "chaosgpu.timeline.control",
        "arguments": {"rate_hz": 200, "scope": {"tag": "ring"},
                      "fail_on_missed_steady_state": true}}}]

Arguments (all optional): `rate_hz` (default 200), `process_every` (list processes every N
samples, default 20), `scope` (which processes to track; default this run's own targets: the
tags, jobs and sandboxes its chaosgpu activities name, `own_targets`; with none, the control
cannot start: never every chaosgpu-tagged process on the node, other game-days' included;
`no_scope_problem` decides it, for the start and for `chaosgpu validate` alike),
`source` ("auto" | "nvml" | "host-rss"), `inline_max_points` (default 50,000), `timeline_path`,
`fail_on_missed_steady_state` (default false), `fail_on_failed_activity` (default false: stop
the run, exit 1, when an activity of the method fails; Chaos Toolkit alone carries on, so a
fault that was never injected could pass as a met steady state; and a steady-state probe that
raises after the method makes the run failed, not deviated), `fault_activity` (the name of
the method action that is the fault, when the rules of chaosgpu.timeline.events would not find
it), `sample` (default true; false: this node has nothing of the experiment to sample, a
Kubernetes experiment run from outside the cluster: no sampler and no scope, only the run's
gates above, so a fault that failed still fails the run). Any other argument (a typo'd
name) is refused, and so is a flag that is not true or false.

A control that cannot start (an unknown argument, a bad scope, a rate out of range, NVML asked
for and absent) raises InterruptExecution in before_experiment_control with its own error:
nothing has run yet, `chaos run` exits 1, and the run would otherwise go on unmeasured and end
on some later, misleading error. A scope that matched no process while the method ran (a
typo'd tag) is logged at WARNING at the end of the method, and the timeline probes refuse to
measure such a timeline (chaosgpu.timeline.probes).

What it does: starts the sampler and records the baseline before the experiment; marks every
activity's start and end on the timeline and keeps a typed record of it (provider, part of the
run, start, end, the faults chaosgpu.faultlog recorded while it ran, its output); at the end
writes `journal["chaosgpu"]` = {"timeline" | null, "timeline_file" | null, "events",
"measurements", "summary", "backend", "gating", "format": 2, "fault", "signals", "release",
"verdicts"} (the typed events: chaosgpu.timeline.events says what each is). The timeline is
inline when it holds at most `inline_max_points` numbers, otherwise
it goes to a JSON file next to the journal (`<journal>.timeline.json`, the journal path taken
from `chaos run --journal-path`, else `timeline_path`, else the working directory) and the journal
keeps the path. With `fail_on_missed_steady_state`, a steady-state hypothesis that is not met
BEFORE the method raises InterruptExecution, so `chaos run` exits 1 (Chaos Toolkit alone exits 0
there); one not met AFTER the method is Chaos Toolkit's deviation (exit 1); one not met DURING
the method (`--hypothesis-strategy during-method-only` or `continuously`) marks the run deviated
(Chaos Toolkit alone only logs it). Which check is which comes from when it runs (before the
method started, on Chaos Toolkit's during-method thread, or after), never from counting, so every
`--hypothesis-strategy` gates the same way; `gating` records each check.
Chaos Toolkit swallows exceptions in controls other than InterruptExecution: every other
failure here is logged at ERROR.

This module owns the hooks and the journal section; the sampling is chaosgpu.timeline.sampler.
"""

import inspect
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from string import Template
from typing import Any

from chaosgpu.arguments import checked, unknown_argument_problem
from chaosgpu.errors import InvalidArgument
from chaosgpu.timeline import events as events_mod
from chaosgpu.timeline import sampler as sampler_mod

__all__ = [
    "configure_control", "control_problem", "before_experiment_control", "after_experiment_control",
    "before_hypothesis_control", "after_hypothesis_control", "before_method_control",
    "after_method_control", "before_rollback_control", "after_rollback_control",
    "before_activity_control", "after_activity_control", "cleanup_control", "no_scope_problem",
    "samples",
]

logger = logging.getLogger("chaostoolkit")
#: how long the end of an activity waits for the sampler to have looked for the processes the
#: activity started (a look takes milliseconds; a listing of a busy node's /proc, tens of ms)
RESCAN_WAIT_S = 1.0

_settings: dict[str, Any] = {}
_in_method = False
_method_started = False
_gating: dict[str, Any] = {}
_gating_lock = threading.Lock()
_stage = "other"  # the part of the run now: "method", "rollbacks" or "other"
_in_hypothesis = threading.local()  # .depth > 0 on a thread running a hypothesis's probes
_open: dict[tuple[str, int], events_mod.ActivityRecord] = {}
_records: list[events_mod.ActivityRecord] = []


def _loud(what: str) -> None:
    logger.error("chaosgpu timeline control: %s failed", what, exc_info=True)


@checked()  # only the names: an unknown (typo'd) argument is refused, naming the known ones
def configure_control(rate_hz: float = 200.0, process_every: int = 20,
                      scope: dict[str, Any] | None = None, source: str = "auto",
                      inline_max_points: int = 50_000, timeline_path: str | None = None,
                      fail_on_missed_steady_state: bool = False,
                      fail_on_failed_activity: bool = False,
                      fault_activity: str | None = None, sample: bool = True) -> None:
    """Read the control's arguments (called again before the experiment with the arguments
    after `${...}` substitution, which Chaos Toolkit does not apply to configure_control).
    An unknown argument, or a flag other than true or false, raises InvalidArgument naming it
    (Chaos Toolkit only logs that here, at debug: before_experiment_control stops the run)."""
    settings = _read_settings(
        rate_hz=rate_hz, process_every=process_every, scope=scope, source=source,
        inline_max_points=inline_max_points, timeline_path=timeline_path,
        fail_on_missed_steady_state=fail_on_missed_steady_state,
        fail_on_failed_activity=fail_on_failed_activity, fault_activity=fault_activity,
        sample=sample)
    _reset()
    _settings.update(settings)


def _read_settings(**arguments: Any) -> dict[str, Any]:
    """The control's settings from its arguments (all given), flags read as true or false
    (InvalidArgument otherwise); touches nothing."""
    return dict(arguments, fault_activity=arguments["fault_activity"] or None,
                fail_on_missed_steady_state=_flag("fail_on_missed_steady_state",
                                                  arguments["fail_on_missed_steady_state"]),
                fail_on_failed_activity=_flag("fail_on_failed_activity",
                                              arguments["fail_on_failed_activity"]),
                sample=_flag("sample", arguments["sample"]))


def _new_sampler(settings: dict[str, Any], own: list[dict[str, Any]]) -> sampler_mod.Sampler:
    """The sampler `settings` ask for, not started: its rate, process count, source and scope
    checked by the sampler itself, and `inline_max_points` made a number (ValueError or
    InvalidArgument naming the argument otherwise)."""
    settings["inline_max_points"] = _number("inline_max_points", settings["inline_max_points"],
                                            int)
    return sampler_mod.Sampler(rate_hz=_number("rate_hz", settings["rate_hz"], float),
                               process_every=_number("process_every",
                                                     settings["process_every"], int),
                               scope=settings["scope"], source=settings["source"], own=own)


def control_problem(arguments: Mapping[str, Any]) -> str | None:
    """Why the control could not start with `arguments` (its provider's arguments): an unknown
    argument, a flag that is not true or false, a rate, count, source or scope the sampler
    refuses; None when it could. The checks before_experiment_control makes before it starts
    the sampler, made here without starting or changing anything: `chaosgpu validate` and the
    pre-run check (chaosgpu.validation) run them on the experiment's control."""
    unknown = unknown_argument_problem(configure_control, arguments)
    if unknown:
        return f"configure_control: {unknown}"  # as the control says it when it starts
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(inspect.unwrap(configure_control)).parameters.items()}
    try:
        settings = _read_settings(**{**defaults, **arguments})
        if settings["sample"]:
            _new_sampler(settings, own=[])
    except (ValueError, TypeError) as error:
        return str(error)
    return None


def samples(arguments: Mapping[str, Any]) -> bool:
    """Whether the control given `arguments` samples this node (its `sample` flag, true unless
    given false); a value that is no flag counts as true here: control_problem refuses it."""
    try:
        return _flag("sample", arguments.get("sample", True))
    except InvalidArgument:
        return True


def _reset() -> None:
    """Forget the previous run: its settings, gating, records and where the run stands."""
    global _method_started, _in_method, _stage
    _method_started = False
    _in_method = False
    _stage = "other"
    _in_hypothesis.depth = 0
    _open.clear()
    _records.clear()
    _gating.clear()
    _settings.clear()


#: what a flag argument may be: a boolean, or its text (`${name}` from an environment variable)
_FLAG_TEXT = {"true": True, "yes": True, "on": True, "1": True,
              "false": False, "no": False, "off": False, "0": False}


def _flag(name: str, value: Any) -> bool:
    """A boolean argument's value; anything but true or false (a typo such as "ture") is
    InvalidArgument rather than silently false."""
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _FLAG_TEXT:
        return _FLAG_TEXT[value.strip().lower()]
    raise InvalidArgument(f"chaosgpu timeline control: {name} must be true or false, "
                          f"got {value!r}")


def _number(name: str, value: Any, kind: type) -> Any:
    """A numeric argument as `kind` (a `${name}` from an environment variable is text)."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"chaosgpu timeline control: {name} must be a number, got "
                              f"{value!r}") from None


def _stop_current() -> None:
    """Stop and forget a sampler left installed (an earlier run in this process)."""
    previous = sampler_mod.current()
    if previous is not None:
        previous.stop()
        sampler_mod.uninstall(previous)


def fault_activity_problem(experiment: Any, fault_activity: Any) -> str | None:
    """Why `fault_activity` names no action of the experiment's method (None when it does, or
    when nothing was given): a typo'd name was silently ignored, and the report then took
    another action (a harmless SIGCONT) for the fault. The message names the method's actions."""
    if fault_activity is None or fault_activity == "":
        return None
    method = experiment.get("method") if isinstance(experiment, dict) else None
    actions = [str(a.get("name")) for a in method or []
               if isinstance(a, dict) and a.get("type") == "action"]
    if isinstance(fault_activity, str) and fault_activity in actions:
        return None
    probes = [str(a.get("name")) for a in method or []
              if isinstance(a, dict) and a.get("type") == "probe"]
    kind = " (a probe: it observes, it is never the fault)" if fault_activity in probes else ""
    return (f"chaosgpu timeline control: fault_activity {fault_activity!r} names no action of "
            f"the method{kind}; the method's actions are {actions}")


#: the arguments of chaosgpu activities that name what they target or start, and the scope
#: kind each names (a `name` names a sandbox in chaosgpu.sandbox's activities only)
TARGET_ARGUMENTS = {"tag": "tag", "job": "job", "sandbox": "sandbox"}


def _named_targets(experiment: Any, configuration: Any = None,
                   secrets: Any = None) -> Iterator[dict[str, Any]]:
    """Each selection an argument of the experiment's chaosgpu activities (steady-state probes,
    method and rollbacks) names, once `${name}` is substituted from the configuration and
    secrets, unchecked: {kind: value} for each `tag`, `job` and `sandbox` argument and the
    `name` of a chaosgpu.sandbox activity, and each `scope` argument as given."""
    hypothesis = experiment.get("steady-state-hypothesis") if isinstance(
        experiment, dict) else None
    activities = [*((hypothesis or {}).get("probes") or [] if isinstance(hypothesis, dict)
                    else []),
                  *(experiment.get("method") or [] if isinstance(experiment, dict) else []),
                  *(experiment.get("rollbacks") or [] if isinstance(experiment, dict) else [])]
    for activity in activities:
        provider = activity.get("provider") if isinstance(activity, dict) else None
        if not isinstance(provider, dict) or provider.get("type") != "python":
            continue
        module = str(provider.get("module") or "")
        arguments = provider.get("arguments")
        if not module.startswith("chaosgpu.") or not isinstance(arguments, dict):
            continue
        if configuration or secrets:
            from chaoslib import substitute

            arguments = substitute(arguments, configuration, secrets)
        yield from ({kind: arguments.get(name)} for name, kind in TARGET_ARGUMENTS.items())
        if module.startswith("chaosgpu.sandbox.") and "sandbox" not in arguments:
            yield {"sandbox": arguments.get("name")}
        if isinstance(arguments.get("scope"), dict):
            yield dict(arguments["scope"])


def own_targets(experiment: Any, configuration: Any = None,
                secrets: Any = None) -> list[dict[str, Any]]:
    """The scopes this run's own chaosgpu activities target or start (steady-state probes,
    method and rollbacks): each `tag`, `job` and `sandbox` argument, each `scope` argument, and
    the `name` of a chaosgpu.sandbox activity, once `${name}` is substituted from the
    configuration; one still unresolved, null or not a valid selection names nothing (the
    activity itself refuses a bad one). The timeline control's default scope (it was every
    chaosgpu-tagged process on the node, other game-days' included)."""
    from chaosgpu.scope import ScopeError, validate_scope

    found: dict[str, dict[str, Any]] = {}
    for scope in _named_targets(experiment, configuration, secrets):
        if any(value is None or "${" in json.dumps(value, default=str)
               for value in scope.values()):
            continue
        try:
            scope = validate_scope(scope)
        except (ScopeError, ValueError, TypeError):
            continue
        found.setdefault(json.dumps(scope, sort_keys=True, default=str), scope)
    return list(found.values())


#: why the control cannot start without a scope: nothing of the run would be its to measure
NO_SCOPE = ("chaosgpu timeline control: no scope given, and no activity of the experiment "
            "names a tag, job or sandbox to track: give the control a scope (such as "
            "{\"tag\": \"${tag}\"}); it never measures every chaosgpu-tagged process on the "
            "node (other runs' included)")


def no_scope_problem(experiment: Any, scope: Any, configuration: Any = None,
                     secrets: Any = None, pending: Collection[str] = ()) -> str | None:
    """Why the control, given `scope` (None: no scope given), cannot start for `experiment`:
    no scope, and no activity names a target to track (`own_targets`, with `${name}`
    substituted from `configuration` and `secrets`); None when it has something to track.
    Any other `scope` (a `${name}` not yet resolved included) is a scope: whether it is a valid
    one is `control_problem`'s question. `pending` names the variables whose values only the
    run will know (an environment variable or a secret, before the run): while a target
    argument still uses one, it may name a target then, and the decision is left to the run
    (None). The one decision of the control's start (the run's configuration and secrets,
    nothing pending) and of `chaosgpu validate` (chaosgpu.validation)."""
    if scope is not None or own_targets(experiment, configuration, secrets):
        return None
    waiting = set(pending)
    if waiting and any(
            match.group("braced") in waiting
            for target in _named_targets(experiment, configuration, secrets)
            for value in target.values()
            for match in Template.pattern.finditer(json.dumps(value, default=str))):
        return None
    return NO_SCOPE


def _start(experiment: Any, configuration: Any = None, secrets: Any = None, /,
           **arguments: Any) -> None:
    _stop_current()
    configure_control(**arguments)
    problem = fault_activity_problem(experiment, _settings.get("fault_activity"))
    if problem:
        raise InvalidArgument(problem)
    if not _settings["sample"]:
        logger.info("chaosgpu timeline: not sampling (sample: false); the run's gates apply "
                    "(fail_on_failed_activity %s, fail_on_missed_steady_state %s)",
                    _settings["fail_on_failed_activity"],
                    _settings["fail_on_missed_steady_state"])
        return
    own = own_targets(experiment, configuration, secrets) if _settings["scope"] is None else []
    sampler = _new_sampler(_settings, own)
    problem = no_scope_problem(experiment, _settings["scope"], configuration, secrets)
    if problem:
        raise InvalidArgument(problem)
    sampler.start()
    sampler_mod.install(sampler)
    sampler.mark("experiment", "start")
    baseline = sampler.take_baseline()
    logger.info("chaosgpu timeline: sampling at %.0f Hz from %s, scope %s; baseline %.1f MiB",
                sampler.rate_hz, sampler.source, sampler.scope_label(), baseline["total_mib"])


def before_experiment_control(context: Any = None, configuration: Any = None,
                              secrets: Any = None, **kwargs: Any) -> None:
    """Refuse an experiment whose `${name}` resolves to nothing (chaosgpu.validation: the run
    is interrupted before anything starts), then start the sampler and take the memory
    baseline before anything runs. A control that cannot start (an unknown argument, a bad
    scope or rate...) interrupts the run here with its own error: nothing has run yet."""
    from chaoslib.exceptions import InterruptExecution

    from chaosgpu import validation

    try:
        validation.before_experiment_control(context, configuration, secrets)
    except InterruptExecution as error:
        _stop_current()
        _gating.update(interrupted=True, start_error=str(error))
        _install_not_started(str(error))
        raise
    try:
        _start(context if isinstance(context, dict) else None, configuration, secrets,
               **kwargs)
    except Exception as error:
        logger.debug("chaosgpu timeline control: start failed", exc_info=True)
        message = (f"chaosgpu: the timeline control cannot start ({error}); nothing of this "
                   f"run would be measured: stopping it before the steady state and method")
        _stop_current()
        _reset()
        _gating.update(interrupted=True, start_error=str(error))
        _install_not_started(str(error))
        raise InterruptExecution(message) from None


def _install_not_started(reason: str) -> None:
    """Install a sampler that never starts (Sampler.not_started) when the control could not
    start: the run is stopped before its method, and the `always` rollbacks' "before-method"
    must read that (without it they failed with "a typo?" for correct names)."""
    try:
        sampler_mod.install(sampler_mod.Sampler.not_started(reason))
    except Exception:
        _loud("recording that the method has not started")


def _hypothesis_when() -> str:
    """Which check this is: "during" (Chaos Toolkit runs the during-method checks on its own
    thread), "after" once the method has started, else "before". Counting hypotheses would take
    the first after-method check of `--hypothesis-strategy after-method-only` for the gate."""
    if threading.current_thread() is not threading.main_thread():
        return "during"
    return "after" if _method_started else "before"


def before_hypothesis_control(context: Any = None, **kwargs: Any) -> None:
    """Mark the start of a steady-state hypothesis (before, during or after the method)."""
    _in_hypothesis.depth = getattr(_in_hypothesis, "depth", 0) + 1
    _mark("steady-state-hypothesis", "start", when=_hypothesis_when())


def after_hypothesis_control(context: Any = None, state: Any = None, **kwargs: Any) -> None:
    """Mark the end of a hypothesis and record it under `gating`; with
    `fail_on_missed_steady_state`, stop the run (exit 1) when the check BEFORE the method was not
    met, and mark the run deviated when a check DURING the method was not met."""
    when = _hypothesis_when()
    _in_hypothesis.depth = max(0, getattr(_in_hypothesis, "depth", 0) - 1)
    met = state.get("steady_state_met") if isinstance(state, dict) else None
    _mark("steady-state-hypothesis", "end", met=met, when=when)
    strict = bool(_settings.get("fail_on_missed_steady_state"))
    with _gating_lock:
        _gating["fail_on_missed_steady_state"] = strict
        _gating.setdefault("checks", []).append({"when": when, "met": met})
        if when == "during":
            _gating["during_missed"] = int(_gating.get("during_missed", 0)) + (met is False)
            return
        _gating[f"{when}_met"] = met
        if met is False:
            _gating[f"{when}_state"] = state
        if when == "after":
            errored = _errored_probes(state)
            if errored:
                _gating["after_errored"] = errored
    if when == "before" and met is False and strict:
        from chaoslib.exceptions import InterruptExecution

        _gating["interrupted"] = True
        raise InterruptExecution(
            "chaosgpu: the steady state was not met BEFORE the method: the experiment "
            "cannot show anything; failing the run (fail_on_missed_steady_state)")


def _errored_probes(state: Any) -> list[dict[str, Any]]:
    """The probes of a steady-state check that raised (Chaos Toolkit's status "failed": the
    check could not be made) rather than returned a value out of tolerance."""
    probes = state.get("probes") if isinstance(state, dict) else None
    return [{"name": (run.get("activity") or {}).get("name"),
             "error": ("".join(run.get("exception") or []).strip().splitlines() or [""])[-1]}
            for run in probes or [] if isinstance(run, dict) and run.get("status") == "failed"]


def before_method_control(context: Any = None, **kwargs: Any) -> None:
    """Mark the start of the method."""
    global _in_method, _method_started, _stage
    _in_method = True
    _method_started = True
    _stage = "method"
    _mark("method", "start")


def after_method_control(context: Any = None, **kwargs: Any) -> None:
    """Mark the end of the method, and say so loudly when the scope matched no process."""
    global _in_method, _stage
    _in_method = False
    _stage = "other"
    _mark("method", "end")
    _warn_if_nothing_matched()


def _warn_if_nothing_matched() -> None:
    """A WARNING (and `gating.scope_matched_nothing`) when the method ran and the scope has
    matched no process since the experiment began: the timeline holds nothing of the target."""
    sampler = sampler_mod.current()
    if sampler is None or sampler.matched():
        return
    with _gating_lock:
        _gating["scope_matched_nothing"] = sampler.scope_label()
    logger.warning("chaosgpu timeline: the control's scope %s matched no process during the "
                   "experiment: the timeline holds nothing of the target and its probes refuse "
                   "to measure it (a typo in the control's scope?)", sampler.scope_label())


def before_rollback_control(context: Any = None, **kwargs: Any) -> None:
    """Mark the start of the rollbacks."""
    global _stage
    _stage = "rollbacks"
    _mark("rollbacks", "start")


def after_rollback_control(context: Any = None, **kwargs: Any) -> None:
    """Mark the end of the rollbacks."""
    global _stage
    _stage = "other"
    _mark("rollbacks", "end")


def _mark(name: str, phase: str, **extra: Any) -> None:
    sampler = sampler_mod.current()
    if sampler is None:
        return
    try:
        sampler.mark(name, phase, **extra)
    except Exception:
        _loud(f"marking {name} {phase}")


def before_activity_control(context: Any = None, **kwargs: Any) -> None:
    """Mark an activity's start (its name) on the timeline and open its typed record."""
    if isinstance(context, dict):
        _mark(str(context.get("name")), "start", type=context.get("type"))
        provider = context.get("provider")
        provider = provider if isinstance(provider, dict) else {}
        record = events_mod.ActivityRecord(
            name=str(context.get("name")), type=str(context.get("type") or ""),
            module=str(provider.get("module") or ""), func=str(provider.get("func") or ""),
            part=_part(), at=time.time())
        with _gating_lock:
            _open[(record.name, threading.get_ident())] = record


def _part() -> str:
    if getattr(_in_hypothesis, "depth", 0):  # (a background method action is no hypothesis)
        return "hypothesis"
    return _stage


def after_activity_control(context: Any = None, state: Any = None, **kwargs: Any) -> None:
    """Mark an activity's end (with its status), close its typed record (the faults recorded
    while it ran, its output) and look for the processes it started."""
    if isinstance(context, dict):
        status = state.get("status") if isinstance(state, dict) else None
        _mark(str(context.get("name")), "end", type=context.get("type"), status=status)
        _close(str(context.get("name")), state)
    sampler = sampler_mod.current()
    if sampler is not None:
        # the processes the activity started are tracked before the next activity runs (a
        # kill right after a start would otherwise find their memory missing from the totals)
        sampler.request_rescan(wait_s=RESCAN_WAIT_S)
    if (_in_method and _settings.get("fail_on_failed_activity") and isinstance(state, dict)
            and state.get("status") == "failed" and isinstance(context, dict)):
        _fail_run_on_failed_activity(context, state)


def _close(name: str, state: Any) -> None:
    with _gating_lock:
        record = _open.pop((name, threading.get_ident()), None)
    if record is None:
        return
    try:
        from chaosgpu import faultlog

        record.end_at = time.time()
        record.status = state.get("status") if isinstance(state, dict) else None
        record.output = state.get("output") if isinstance(state, dict) else None
        record.faults = [f for f in faultlog.recent(record.at) if f["t"] <= record.end_at]
        with _gating_lock:
            _records.append(record)
    except Exception:
        _loud(f"recording activity {name}")


def _fail_run_on_failed_activity(context: dict[str, Any], state: dict[str, Any]) -> None:
    """Stop the run when a method activity failed: Chaos Toolkit alone goes on, and a fault that
    was never injected would let the after-method steady state pass (a silent pass)."""
    from chaoslib.exceptions import InterruptExecution

    name = str(context.get("name"))
    exception = state.get("exception") or []
    reason = str(exception[-1]).strip() if exception else "no exception recorded"
    _gating["failed_activity"] = {"name": name, "reason": reason[-2000:]}
    _gating["interrupted"] = True
    raise InterruptExecution(f"chaosgpu: method activity {name!r} failed ({reason[-300:]}); "
                             "failing the run (fail_on_failed_activity)")


def _journal_path() -> Path | None:
    argv = sys.argv
    for index, arg in enumerate(argv):
        if arg == "--journal-path" and index + 1 < len(argv):
            return Path(argv[index + 1])
        if arg.startswith("--journal-path="):
            return Path(arg.split("=", 1)[1])
    return None


def _timeline_file() -> Path:
    if _settings.get("timeline_path"):
        return Path(_settings["timeline_path"])
    journal = _journal_path()
    if journal is not None:
        return journal.with_name(journal.stem + ".timeline.json")
    return Path.cwd() / f"chaosgpu-timeline-{int(time.time())}.json"


def _backend() -> dict[str, Any]:
    try:
        from chaosgpu.node import nvml_snapshot

        gpu = nvml_snapshot(with_processes=False)
        return {"gpu": {"available": gpu.get("available"), "reason": gpu.get("reason"),
                        "driver": gpu.get("driver"),
                        "devices": [d.get("name") for d in gpu.get("devices") or []]},
                "python": sys.version.split()[0], "pid": os.getpid()}
    except Exception as error:
        return {"error": str(error)}


def after_experiment_control(context: Any = None, state: Any = None, **kwargs: Any) -> None:
    """Stop the sampler and write the timeline, events, measurements and summary into the
    journal (`journal["chaosgpu"]`), inline or as a file it points to."""
    sampler = sampler_mod.current()
    if sampler is not None and not sampler.started:
        sampler = None  # the control could not start: nothing was measured
    try:
        section: dict[str, Any] = {"timeline": None, "timeline_file": None, "events": [],
                                   "measurements": {}, "summary": None,
                                   "backend": _backend(), "gating": dict(_gating)}
        if sampler is not None:
            end = sampler.mark("experiment", "end")
            # the residual is read after the rollbacks: one sample taken after this mark (at
            # 20 Hz the last one could predate the kill the rollback made)
            after = sampler.wait_sample_after(float(end["t"]), 3.0 / sampler.rate_hz + 1.0)
            sampler.stop()
            timeline = sampler.to_dict()
            section["events"] = timeline["events"]
            section["measurements"] = dict(sampler.measurements)
            section["summary"] = sampler.summary()
            section["summary"]["final_after_end"] = after
            if sampler.points() <= int(_settings.get("inline_max_points", 50_000)):
                section["timeline"] = timeline
            else:
                path = _timeline_file()
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(timeline), encoding="utf-8")
                section["timeline_file"] = str(path)
            summary = section["summary"]
            logger.info("chaosgpu timeline: %d samples at %s Hz, CPU overhead %s %%",
                        summary["samples"], summary["rate_hz"], summary["overhead_cpu_pct"])
        elif _settings.get("sample") is False and not _gating.get("start_error"):
            section["summary"] = {"note": "not sampled (the control's sample: false)"}
        else:
            reason = _gating.get("start_error") or "see errors above"
            section["summary"] = {"error": f"the sampler did not run ({reason})"}
        section.update(_typed(sampler))
        if isinstance(state, dict):
            _deviate_on_missed_during(state, section["gating"])
            _fail_on_errored_check(state, section["gating"])
            _fail_on_failed_rollback(state, section["gating"])
            state.setdefault("chaosgpu", {}).update(section)
    except Exception:
        _loud("after_experiment_control")


def _typed(sampler: sampler_mod.Sampler | None) -> dict[str, Any]:
    """The typed events (chaosgpu.timeline.events): fault, signals, release, verdicts."""
    try:
        with _gating_lock:
            records = list(_records)
        if sampler is None:
            return events_mod.typed_section(records, {}, None, lambda name, phase: None,
                                            _settings.get("fault_activity"))
        return events_mod.typed_section(records, dict(sampler.measurements), sampler.t0,
                                        sampler.event_time, _settings.get("fault_activity"))
    except Exception:
        _loud("recording the typed events")
        return {"format": events_mod.FORMAT, "fault": None, "signals": [], "release": None,
                "verdicts": [], "error": "the typed events could not be recorded (see log)"}


def _deviate_on_missed_during(journal: dict[str, Any], gating: dict[str, Any]) -> None:
    """With `fail_on_missed_steady_state`, a check DURING the method that was not met makes the
    run deviated (Chaos Toolkit alone only logs it, and `chaos run` exits 0)."""
    missed = int(gating.get("during_missed") or 0)
    if not missed or not _settings.get("fail_on_missed_steady_state"):
        return
    checks = sum(1 for check in gating.get("checks") or [] if check.get("when") == "during")
    gating["deviated_by"] = f"{missed} of {checks} checks during the method not met"
    journal["deviated"] = True


def _fail_on_errored_check(journal: dict[str, Any], gating: dict[str, Any]) -> None:
    """With `fail_on_failed_activity`, a steady-state probe that raised AFTER the method (a
    typo'd tag or sandbox name, a target it could not read) makes the run failed, not
    deviated: Chaos Toolkit counts such a probe as a missed tolerance, and a baseline that must
    deviate would pass on a check that was never made."""
    errored = gating.get("after_errored")
    if not errored or not _settings.get("fail_on_failed_activity"):
        return
    names = ", ".join(repr(entry["name"]) for entry in errored)
    gating["failed_by"] = (f"the steady-state probe(s) {names} raised after the method: the "
                           f"check was not made, which is no deviation")
    logger.error("chaosgpu: %s; the run is failed, not deviated (fail_on_failed_activity)",
                 gating["failed_by"])
    journal["status"] = "failed"
    journal["deviated"] = False


def failed_rollbacks(journal: Any) -> list[dict[str, Any]]:
    """The rollbacks of a journal that failed (Chaos Toolkit's status "failed"), each as
    {"name", "error"} (the last line of its exception)."""
    runs = journal.get("rollbacks") if isinstance(journal, dict) else None
    return [{"name": (run.get("activity") or {}).get("name"),
             "error": ("".join(run.get("exception") or []).strip().splitlines() or [""])[-1]}
            for run in runs or [] if isinstance(run, dict) and run.get("status") == "failed"]


def _fail_on_failed_rollback(journal: dict[str, Any], gating: dict[str, Any]) -> None:
    """A rollback that failed is recorded under `gating.failed_rollbacks` and logged at ERROR
    (Chaos Toolkit alone ends the run "completed", exit 0, whatever its cleanup did); with
    `fail_on_failed_activity` a completed run is then failed, not deviated: the cleanup that
    proves the node came back clean did not work."""
    failed = failed_rollbacks(journal)
    if not failed:
        return
    gating["failed_rollbacks"] = failed
    names = ", ".join(f"{entry['name']!r} ({entry['error'][-300:]})" for entry in failed)
    logger.error("chaosgpu: rollback(s) failed: %s: the cleanup did not work and what it was "
                 "to remove may still be there", names)
    if not _settings.get("fail_on_failed_activity"):
        return
    reason = (f"the rollback(s) {', '.join(repr(e['name']) for e in failed)} failed: the "
              f"cleanup did not work")
    gating["failed_by"] = f"{gating['failed_by']}; {reason}" if gating.get("failed_by") \
        else reason
    if journal.get("status") in ("completed", "failed"):
        logger.error("chaosgpu: %s; the run is failed, not deviated (fail_on_failed_activity)",
                     reason)
        journal["status"] = "failed"
        journal["deviated"] = False


def cleanup_control(control: Any = None, **kwargs: Any) -> None:
    """Stop the sampler if it still runs (an interrupted run) and forget it."""
    sampler = sampler_mod.current()
    if sampler is not None:
        try:
            sampler.stop()
        except Exception:
            _loud("cleanup_control")
        sampler_mod.uninstall(sampler)
    _settings.clear()
