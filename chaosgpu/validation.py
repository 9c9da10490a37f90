"""Static checks of a whole experiment that chaoslib's validation does not make.

chaoslib substitutes `${name}` in arguments from the configuration and secrets, and leaves a
`${name}` that neither defines in place, silently: a typo'd variable reaches the activity as
the literal text "${nmae}" and fails, if at all, only when that activity runs, perhaps in a
rollback. `unresolved_variables` lists every `${name}` in an experiment (its method, steady
state, rollbacks, controls...) that no configuration key, secret or `--var` defines;
`ensure_variables_resolve` raises `chaosgpu.errors.UnknownVariable` naming each and where it
is used. `$${name}` is chaoslib's escape for a literal `${name}` and is not a reference.

`argument_problems` checks the arguments of every chaosgpu activity of the experiment (its
steady state, method and rollbacks) against the activity's own rules (chaosgpu.arguments)
without running it, each as the run will pass it: every `${name}` in it, nested dicts and lists
included, substituted as Chaos Toolkit substitutes it (a whole `${name}` takes the value with
its type, one inside a longer text is formatted into it, and so is a `$name`; a `$name` that
nothing defines stays as written, as chaoslib leaves it) from what is known before the run, the
configuration's literal values (a dict or list too: `"scope": "${scope}"` takes the
configuration's dict as the activity's scope, keys and all) and the `--var`s (`--var
rank:str=1` gives the text "1", which no rank rule takes; a catalog scope `{"tag": "${tag}"}`
with `--var "tag=x y"` is a tag no scope takes). A part only the run can tell (a secret; a
configuration value read from an environment variable, `{"type": "env"}`, or by a probe,
`{"type": "probe"}`: RUN_TIME_TYPES) is left unknown and the rest is still checked: a scope
`{"tag": "${token}", "incude_other_users": true}` is refused for its typo'd key whatever the
token is, never only because a part is unknown. chaoslib's validation checks the names of
arguments, not their values: without this, a bad value failed only when its activity ran, after
the method had started the job.
`ensure_arguments_valid` raises `chaosgpu.errors.InvalidArgument` naming each. The rules are
the activities' own (`chaosgpu.arguments.checked`): a scope's keys, `missing_ok`, a verdict,
phase, signal or mode name, a sandbox or pod name..., each checked by the same code the
activity runs before it touches anything. The timeline control's arguments are checked as the
control checks them when it starts (`chaosgpu.timeline.control.control_problem`: an unknown
argument, a rate or source out of range, a bad scope or flag), with its `fault_activity`, and
so is a control given no scope while no activity names a tag, job or sandbox to track
(`chaosgpu.timeline.control.no_scope_problem`, the decision the control makes when it starts,
in its words): `chaosgpu validate` reports it; the pre-run check leaves it to the control's
start. A target argument whose `${name}` only the run resolves (an environment variable, a
secret) is left to the run; one the configuration or a `--var` sets to null names nothing.
A refused text that a type would make good says how to write it: Chaos Toolkit reads an untyped
`--var rank=1` as the text "1" ("got '1' (text): --var rank=1 gives text; write --var
rank:int=1"; `var_texts` reads how each `--var` was given: `chaosgpu validate`'s own, `chaos
run`'s command line for the pre-run check), and a "1" in the experiment file is written 1.

`unknown_vars` lists the `--var` names an experiment neither declares (configuration, secrets)
nor uses as `${name}`, nor chaosgpu reads from the configuration itself (READ_KEYS):
`chaosgpu validate` refuses them (a typo'd `--var jobb=...` would leave the declared `job` as
it is, silently; `chaos run` gives no warning). Only `chaosgpu validate` can tell: the run's
controls see the variables merged into the configuration.

Where it runs: `chaosgpu validate EXPERIMENT` (chaoslib's own validation, then this), and, as a
Chaos Toolkit control (`"module": "chaosgpu.validation"`, and the timeline control's first
step), before the experiment starts: a typo'd variable or a bad argument value interrupts
`chaos run` before anything is touched.
"""

import argparse
import importlib
import itertools
import json
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from string import Template
from types import MappingProxyType
from typing import Any

from chaosgpu.arguments import argument_problem, rules_of
from chaosgpu.errors import InvalidArgument, UnknownVariable

__all__ = ["defined_names", "unresolved_variables", "ensure_variables_resolve", "unknown_vars",
           "ensure_vars_known", "READ_KEYS", "var_texts", "argument_problems",
           "ensure_arguments_valid", "before_experiment_control", "RUN_TIME_TYPES", "main"]

# The experiment's own declarations of variables: not places where variables are used.
DECLARATIONS = ("configuration", "secrets")
#: The configuration values chaoslib loads when the run starts (chaoslib.configuration): a
#: mapping whose "type" is "env" (an environment variable) or "probe" (a dynamic value). Any
#: other mapping, and any list, is a literal value the run passes as written.
RUN_TIME_TYPES = ("env", "probe")
#: Configuration keys chaosgpu's activities read themselves (not through `${name}`): a `--var`
#: may set one that the experiment never names.
READ_KEYS = ("chaosgpu_agent_url",)


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            label = item.get("name") if isinstance(item, Mapping) else None
            yield from _strings(item, f"{where}[{label!r}]" if label else f"{where}[{index}]")


def _references(text: str) -> Iterator[str]:
    for match in Template.pattern.finditer(text):
        if match.group("braced"):
            yield match.group("braced")


def defined_names(experiment: Mapping[str, Any]) -> set[str]:
    """Every name the experiment itself defines for `${name}`: its configuration keys and the
    keys of every secret scope."""
    names = set(experiment.get("configuration") or {})
    for scope in (experiment.get("secrets") or {}).values():
        if isinstance(scope, Mapping):
            names |= set(scope)
    return names


def unresolved_variables(experiment: Mapping[str, Any],
                         also_defined: set[str] | None = None) -> list[tuple[str, str]]:
    """(name, where) of every `${name}` that resolves to nothing, in document order: neither
    the experiment's configuration and secrets nor `also_defined` (the run's variables)."""
    known = defined_names(experiment) | (also_defined or set())
    found: list[tuple[str, str]] = []
    for key, value in experiment.items():
        if key in DECLARATIONS:
            continue
        for where, text in _strings(value, key):
            found.extend((name, where) for name in _references(text) if name not in known)
    return found


def ensure_variables_resolve(experiment: Mapping[str, Any],
                             also_defined: set[str] | None = None) -> None:
    """Raise UnknownVariable naming every `${name}` the experiment uses and nothing defines."""
    missing = unresolved_variables(experiment, also_defined)
    if missing:
        known = sorted(defined_names(experiment) | (also_defined or set()))
        listed = "; ".join(f"${{{name}}} in {where}" for name, where in missing)
        raise UnknownVariable(f"the experiment refers to variables that no configuration key "
                              f"or secret defines: {listed} (defined: {known})")


def unknown_vars(experiment: Mapping[str, Any], names: set[str]) -> list[str]:
    """The `--var` names of `names` that the experiment neither declares (a configuration key
    or secret), nor uses as `${name}` anywhere, nor chaosgpu reads from the configuration
    (READ_KEYS), sorted: a typo'd variable that `chaos run --var` would silently ignore."""
    used = {name for _, text in _strings(experiment, "") for name in _references(text)}
    return sorted(set(names) - defined_names(experiment) - used - set(READ_KEYS))


def ensure_vars_known(experiment: Mapping[str, Any], names: set[str]) -> None:
    """Raise UnknownVariable naming every `--var` the experiment does not know
    (``unknown_vars``) and the variables it does."""
    unknown = unknown_vars(experiment, names)
    if unknown:
        used = {name for _, text in _strings(experiment, "") for name in _references(text)}
        known = sorted(defined_names(experiment) | used)
        raise UnknownVariable(f"--var gives variables the experiment neither declares nor "
                              f"uses: {', '.join(map(repr, unknown))} (a typo? the "
                              f"experiment's variables: {known})")


def _activities(experiment: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(where, activity) of each activity the run may play: steady-state probes, the method,
    the rollbacks (a reference to another activity by name is that one's)."""
    hypothesis = experiment.get("steady-state-hypothesis")
    parts = [("steady-state-hypothesis", (hypothesis or {}).get("probes")
              if isinstance(hypothesis, Mapping) else None),
             ("method", experiment.get("method")), ("rollbacks", experiment.get("rollbacks"))]
    for part, activities in parts:
        for index, activity in enumerate(activities if isinstance(activities, list) else []):
            if isinstance(activity, Mapping):
                yield f"{part}[{activity.get('name', index)!r}]", activity


def _run_time(value: Any) -> bool:
    """Whether a configuration value is one only the run can tell (RUN_TIME_TYPES, or _LATER),
    not a literal value."""
    return value is _LATER or (isinstance(value, Mapping)
                               and value.get("type") in RUN_TIME_TYPES)


class _Unknown:
    """A part of an argument that only the run can tell, as written: a `${name}` (or `$name`)
    that a secret, an environment variable or a probe's value at run time gives. `stand_in` is the
    text with such references replaced by _STAND_IN when it is text whatever they are (a
    reference inside a longer text), None when it may be any value (a whole `${name}`).
    Shown as written, so a refusal shows the argument as the experiment holds it."""

    def __init__(self, written: str, stand_in: str | None) -> None:
        self.written = written
        self.stand_in = stand_in

    def __repr__(self) -> str:
        return repr(self.written)


#: What stands for a part of an argument that only the run can tell while its other parts are
#: checked: a text, a number, a flag, a list (a scope's tag, PID, option, PIDs). A refusal is
#: kept only when no stand-in passes and the rule's reason names none of them (_MARKS): what
#: was refused is then some other part of the argument (a typo'd scope key, a bad literal).
_STAND_IN = "chaosgpu-unknown"
_STAND_INS: tuple[Any, ...] = (_STAND_IN, 4093, True, [4093])
_MARKS = (_STAND_IN, "4093", "True")
#: Beyond this many unknown parts in one argument, it is left to the run (4 stand-ins each).
_MOST_UNKNOWN = 5


def _whole_reference(text: str) -> str | None:
    """The name of a text that is one `${name}` and nothing else, as chaoslib matches it (no
    space around it), else None."""
    whole = Template.pattern.fullmatch(text)
    return None if whole is None else whole.group("braced")


def _substituted(text: str, values: Mapping[str, Any]) -> Any:
    """`text` as Chaos Toolkit substitutes it (chaoslib's substitute_string: a whole `${name}`
    takes the value with its type, a reference inside a longer text, `${name}` or `$name`, is
    replaced by str(value), `$$` is `$`), from `values`; an _Unknown where a reference is one
    only the run can tell (a value of _run_time, such as {"type": "env", ...}, or a `${name}`
    that `values` lacks: a secret, a variable given at run time). A literal dict or list is a
    value like any other: a whole `${name}` takes it as it is (chaoslib substitutes nothing
    inside it), a longer text takes str() of it. A `$name` that `values` lacks (no
    configuration key, secret or `--var` of that name) stays as written, as chaoslib leaves it:
    the activity gets the text "$name", and its rule decides."""
    def plain(name: str) -> bool:
        return name in values and not _run_time(values[name])

    name = _whole_reference(text)
    if name is not None:
        return values[name] if plain(name) else _Unknown(text, None)
    unknown = False

    def replace(match: Any, stand_in: str | None = None) -> str:
        nonlocal unknown
        name = match.group("named") or match.group("braced")
        if name is None:  # `$$` is chaoslib's escape for `$`; anything else stays
            return "$" if match.group("escaped") is not None else str(match.group())
        if plain(name):
            return str(values[name])
        if name in values or match.group("braced") is not None:
            unknown = True
            return str(match.group()) if stand_in is None else stand_in
        return str(match.group())

    result = Template.pattern.sub(replace, text)
    if not unknown:
        return result
    return _Unknown(text, Template.pattern.sub(lambda m: replace(m, _STAND_IN), text))


def _resolved(value: Any, values: Mapping[str, Any]) -> Any:
    """An argument as the run will pass it (chaoslib's substitute: into every text of nested
    dicts and lists, keys as written), each part only the run can tell an _Unknown."""
    if isinstance(value, str):
        return _substituted(value, values)
    if isinstance(value, Mapping):
        return {key: _resolved(item, values) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_resolved(item, values) for item in value]
    return value


def _unknowns(value: Any) -> Iterator[_Unknown]:
    """The _Unknown parts of a resolved argument, in order."""
    if isinstance(value, _Unknown):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _unknowns(item)
    elif isinstance(value, list):
        for item in value:
            yield from _unknowns(item)


#: What a name of `later`, or a secret's, stands for (_value, argument_problems): a value only
#: the run can tell (_run_time), so _substituted leaves it to the run.
_LATER: Mapping[str, Any] = MappingProxyType({})


def _value(value: Any, values: Mapping[str, Any],
           later: Collection[str] = ()) -> tuple[bool, Any]:
    """(known, value) of an argument before the run, resolved as the run will resolve it from
    `values` (the configuration and `--var` values known now; _resolved); (False, the value
    with its unknown parts as _Unknown) when some part only the run can tell. A name of
    `later` (an environment variable's, read as the run started) resolves a whole `${name}`
    argument only: inside a nested or longer value it is left to the run, as `chaosgpu
    validate` leaves it."""
    if later and not (isinstance(value, str) and _whole_reference(value)):
        values = {**values, **{name: _LATER for name in later}}
    resolved = _resolved(value, values)
    return next(_unknowns(resolved), None) is None, resolved


def _filled(value: Any, stand_ins: Mapping[int, Any]) -> Any:
    """A resolved argument with each _Unknown replaced by its stand-in (by the part's id)."""
    if isinstance(value, _Unknown):
        return stand_ins[id(value)]
    if isinstance(value, Mapping):
        return {key: _filled(item, stand_ins) for key, item in value.items()}
    if isinstance(value, list):
        return [_filled(item, stand_ins) for item in value]
    return value


def _refused_whatever_unknown(value: Any,
                              refusal: Callable[[Any], tuple[bool, str | None]]) -> str | None:
    """Why `value` (resolved, some parts _Unknown, not wholly unknown) is refused whatever its
    unknown parts turn out to be, or None when it may pass. `refusal(candidate)` says whether
    a candidate is refused and why (None: no reason given). Each unknown part takes each
    stand-in (a text within a text takes its stand-in text): when one combination passes, or
    no refusal gives a reason that names no stand-in, the value is left to the run; never is a
    value refused only because a part of it is unknown."""
    parts = list(_unknowns(value))
    if not parts or isinstance(value, _Unknown) or len(parts) > _MOST_UNKNOWN:
        return None
    choices = [(part.stand_in,) if part.stand_in is not None else _STAND_INS
               for part in parts]
    reason = None
    for combination in itertools.product(*choices):
        refused, why = refusal(_filled(value, {id(part): stand_in for part, stand_in
                                               in zip(parts, combination, strict=True)}))
        if not refused:
            return None
        if reason is None and why and not any(mark in why for mark in _MARKS):
            reason = why
    return reason


def _argument_problem(function: Any, name: str, value: Any, known: bool) -> str | None:
    """What is wrong with the resolved argument `name`: argument_problem when all of it is
    known; when a part only the run can tell, what its rule refuses whatever that part is
    (a typo'd scope key, a bad literal option beside a `${tag}`), said as its rule says it,
    with the argument as written."""
    if known:
        return argument_problem(function, name, value)
    rule = rules_of(function).get(name)
    if rule is None:
        return None
    prefix = f"must be {rule.what} ("

    def refusal(candidate: Any) -> tuple[bool, str | None]:
        if rule.accepts(candidate):
            return False, None
        must = rule.must(candidate)  # "must be WHAT (WHY)" where the rule says why
        return True, must[len(prefix):-1] if must.startswith(prefix) else None

    why = _refused_whatever_unknown(value, refusal)
    return None if why is None else f"{name} {prefix}{why}), got {value!r}"


def _activity_function(provider: Mapping[str, Any]) -> Any:
    """The chaosgpu function a python provider names (None for anything else, or a name that
    does not resolve: chaoslib's validation reports that one)."""
    module = provider.get("module")
    if provider.get("type") != "python" or not isinstance(module, str) \
            or not (module == "chaosgpu" or module.startswith("chaosgpu.")):
        return None
    try:
        return getattr(importlib.import_module(module), str(provider.get("func")), None)
    except ImportError:
        return None


def var_texts(argv: list[str]) -> dict[str, str | None]:
    """The `--var` options of a command line (`--var NAME=VALUE`, `--var=NAME=VALUE`), read as
    chaoslib's convert_vars reads them: NAME -> the VALUE text for one given without a type
    (Chaos Toolkit passes it as that text), None for one given with a type (`NAME:TYPE=VALUE`);
    the last one given for a name counts."""
    found: dict[str, str | None] = {}
    for index, word in enumerate(argv):
        if word == "--var" and index + 1 < len(argv):
            text = argv[index + 1]
        elif word.startswith("--var="):
            text = word[len("--var="):]
        else:
            continue
        if "=" not in text:
            continue
        key, value = text.split("=", 1)
        if ":" in key:
            found[key.rsplit(":", 1)[0]] = None
        else:
            found[key] = value
    return found


#: The types a `--var` text may be given (chaoslib's convert_to_type), in the order tried when
#: a text is refused: "1" is an int before a float.
_TYPED = (("int", int), ("float", float),
          ("bool", lambda text: {"true": True, "false": False}[text.strip().lower()]))


def _typed_fix(function: Any, name: str, text: str) -> tuple[str, Any] | None:
    """(type, value) of the first type that makes the refused text `text` of argument `name`
    a value its rule accepts ("1" an int, "0.5" a float, "true" a bool), or None when no type
    would help."""
    for type_name, convert in _TYPED:
        try:
            value = convert(text)
        except (ValueError, KeyError):
            continue
        if argument_problem(function, name, value) is None:
            return type_name, value
    return None


def _text_hint(function: Any, name: str, raw: Any, value: Any, experiment: Mapping[str, Any],
               cli_vars: Mapping[str, str | None]) -> str:
    """How to give the refused text `value` of argument `name` (written `raw` in the experiment)
    as the typed value its rule takes, or "" when typing would not help or the text's source is
    unknown: an untyped `--var rank=1` is written `--var rank:int=1`; a "1" in the experiment
    (the argument itself, or the configuration key its whole `${name}` takes) is written 1."""
    if not isinstance(value, str):
        return ""
    fix = _typed_fix(function, name, value)
    if fix is None:
        return ""
    type_name, typed = fix
    written = f"write {json.dumps(typed)}, not {json.dumps(value)},"
    references = list(_references(raw)) if isinstance(raw, str) else []
    if not references:
        return f" (text): {written} in the experiment"
    variable = references[0]
    if variable in cli_vars:
        if cli_vars[variable] != value:  # a typed --var (`:str`), or a value changed since
            return ""
        return (f" (text): --var {variable}={value} gives text; write "
                f"--var {variable}:{type_name}={value}")
    configuration = experiment.get("configuration")
    if isinstance(configuration, Mapping) and configuration.get(variable) == value:
        return f" (text): {written} for configuration key {variable!r} in the experiment"
    return ""


def argument_problems(experiment: Mapping[str, Any], values: Mapping[str, Any] | None = None,
                      *, control_scope: bool = True,
                      cli_vars: Mapping[str, str | None] | None = None,
                      later: Collection[str] = ()) -> list[str]:
    """What is wrong with the arguments of the experiment's chaosgpu activities, each as
    "WHERE: FUNC: NAME must be ..., got VALUE", checked by the activity's own rules before
    anything runs; `values` are the configuration and `--var` values a `${name}` takes, as
    Chaos Toolkit substitutes it, in nested dicts and lists too (a whole `${name}` the value
    with its type, one inside a longer text formatted into it). What only the run can resolve
    (a secret, an environment variable; a name of `later`, read as the run started, except
    as a whole `${name}` argument) is left to the activity, but the rest of the argument is
    still checked: a scope `{"tag": "${token}", "incude_other_users": true}` is refused for
    its typo'd key whatever the token is, never for what is unknown. With
    `control_scope`, a timeline control with nothing to track (no scope, and no activity names
    a target) is one too; the pre-run check leaves that to the control's own start.

    `cli_vars` (var_texts: each `--var` given, NAME -> its text when untyped, None when typed),
    where the caller knows them, adds to a refused text that a type would make good how to
    write it: "got '1' (text): --var rank=1 gives text; write --var rank:int=1" for an untyped
    `--var`, "got '1' (text): write 1, not "1", in the experiment" for a text the experiment
    file holds; nothing for a typed `--var` or a text no type would make good."""
    known = {key: value for key, value in (experiment.get("configuration") or {}).items()}
    known.update(values or {})
    # a secret is left to the run, `$name` too (chaoslib substitutes it): never its name as text
    known.update({name: _LATER for name in defined_names(experiment) - set(known)})
    problems = []
    for where, activity in _activities(experiment):
        provider = activity.get("provider")
        if not isinstance(provider, Mapping):
            continue
        function = _activity_function(provider)
        arguments = provider.get("arguments")
        if function is None or not isinstance(arguments, Mapping):
            continue
        for name, raw in arguments.items():
            resolved, value = _value(raw, known, later)
            problem = _argument_problem(function, name, value, resolved)
            if problem:
                if cli_vars is not None and resolved:
                    problem += _text_hint(function, name, raw, value, experiment, cli_vars)
                problems.append(f"{where}: {provider.get('func')}: {problem}")
    return problems + _control_problems(experiment, known, control_scope, later)


def _control_problems(experiment: Mapping[str, Any], known: Mapping[str, Any],
                      control_scope: bool = True, later: Collection[str] = ()) -> list[str]:
    """What is wrong with the timeline control's arguments: what would stop it from starting
    (control_problem: an unknown argument, a bad rate, source, scope or flag), and what only
    the experiment can tell, a `fault_activity` naming no action of the method (it was silently
    ignored), and (with `control_scope`) no scope while no activity names a target to track
    (no_scope_problem, the control's own decision). An argument only the run can resolve is
    left to the control, and so is a target argument that uses a variable only the run
    resolves (an environment variable or a secret)."""
    from chaosgpu.timeline.control import (
        control_problem,
        fault_activity_problem,
        no_scope_problem,
        samples,
    )

    plain = {name: value for name, value in known.items() if not _run_time(value)}
    pending = {name for _, text in _strings(experiment, "")
               for name in _references(text)} - set(plain)
    problems = []
    for control in experiment.get("controls") or []:
        provider = control.get("provider") if isinstance(control, Mapping) else None
        if not isinstance(provider, Mapping) or \
                provider.get("module") != "chaosgpu.timeline.control":
            continue
        arguments = provider.get("arguments") or {}
        if not isinstance(arguments, Mapping):
            continue
        where = f"controls[{control.get('name')!r}]"
        values, partly = {}, {}
        for name, value in arguments.items():
            resolved, value = _value(value, known, later)
            if resolved:
                values[name] = value
            else:
                partly[name] = value
        problem = control_problem(values)
        for name, value in partly.items():  # a scope {"tag": "${secret}", "typo": true}
            if problem:
                break
            problem = _refused_whatever_unknown(value, _control_refusal(values, name))
        if problem:
            problems.append(f"{where}: the timeline control cannot start ({problem})")
        problem = fault_activity_problem(dict(experiment), values.get("fault_activity"))
        if problem:
            problems.append(f"{where}: {problem}")
        if control_scope and samples(values):  # sample: false has no scope to want
            resolved, scope = _value(arguments.get("scope"), known, later)  # unresolved: a scope
            problem = no_scope_problem(dict(experiment), scope if resolved else
                                       arguments["scope"], plain, None, pending)
            if problem:
                problems.append(f"{where}: the timeline control cannot start ({problem})")
    return problems


def _control_refusal(values: Mapping[str, Any],
                     name: str) -> Callable[[Any], tuple[bool, str | None]]:
    """Whether the timeline control given `values` and `name` set to a candidate could not
    start, and why (control_problem): the refusal _refused_whatever_unknown asks of an
    argument with a part only the run can tell."""
    from chaosgpu.timeline.control import control_problem

    def refusal(candidate: Any) -> tuple[bool, str | None]:
        problem = control_problem({**values, name: candidate})
        return problem is not None, problem

    return refusal


def ensure_arguments_valid(experiment: Mapping[str, Any],
                           values: Mapping[str, Any] | None = None, *,
                           control_scope: bool = True,
                           cli_vars: Mapping[str, str | None] | None = None,
                           later: Collection[str] = ()) -> None:
    """Raise InvalidArgument naming every bad argument value (``argument_problems``)."""
    problems = argument_problems(experiment, values, control_scope=control_scope,
                                 cli_vars=cli_vars, later=later)
    if problems:
        raise InvalidArgument("bad argument values, refused before anything runs: "
                              + "; ".join(problems))


def before_experiment_control(context: Any = None, configuration: Any = None,
                              secrets: Any = None, **kwargs: Any) -> None:
    """Chaos Toolkit control: interrupt the run before anything starts when a `${name}` of the
    experiment resolves to nothing (configuration as loaded, `--var` included, and secrets),
    or when an argument of a chaosgpu activity has a value its rules refuse."""
    from chaoslib.exceptions import InterruptExecution

    defined = set(configuration or {})
    for scope in (secrets or {}).values():
        if isinstance(scope, Mapping):
            defined |= set(scope)
    try:
        ensure_variables_resolve(context or {}, defined)
        # a timeline control with nothing to track is refused by its own start, in its words
        # `chaos run`'s own --var options: an untyped one is text (configuration holds the
        # values merged, not how each was given)
        # a configuration key read from the environment (not overridden by a --var) is known
        # now, but only a whole `${name}` argument takes it here: inside a scope it is left to
        # the activity (and to the timeline control's own start), as `chaosgpu validate`
        # leaves it
        given = var_texts(sys.argv)
        declared = (context or {}).get("configuration") or {}
        later = {name for name, value in declared.items()
                 if _run_time(value) and name not in given}
        ensure_arguments_valid(context or {}, configuration or {}, control_scope=False,
                               cli_vars=given, later=later)
    except (UnknownVariable, InvalidArgument) as error:
        raise InterruptExecution(str(error)) from None


def _var(text: str) -> tuple[str, Any, str]:
    """The argparse type of `--var`: `NAME=VALUE` or `NAME:TYPE=VALUE`, converted as
    `chaos run --var` converts it (chaoslib's convert_vars: str, int, float, bool, bytes, json):
    (NAME, the value, the option's text)."""
    from chaoslib import convert_vars

    usage = f"expects NAME=VALUE or NAME:TYPE=VALUE, got {text!r}"
    if "=" not in text:
        raise argparse.ArgumentTypeError(usage)
    try:
        ((key, value),) = convert_vars([text]).items()
    except ValueError as error:  # a bad type, or a value that is not of it (json's errors too)
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    if not key:
        raise argparse.ArgumentTypeError(usage)
    return key, value, text


def _load(source: str) -> Any:
    """chaoslib's loading of an experiment (file or URL), every failure a ChaosException."""
    from chaoslib.exceptions import InvalidSource
    from chaoslib.loader import load_experiment
    from requests import RequestException

    try:
        experiment = load_experiment(source, verify_tls=True)
    except RequestException as error:  # a URL: unreachable, refused, bad TLS
        raise InvalidSource(f"cannot be fetched: {error}") from None
    except (OSError, ValueError) as error:  # a folder, bad JSON, an empty file
        raise InvalidSource(f"cannot be read as an experiment: {error}") from None
    if not isinstance(experiment, Mapping):
        raise InvalidSource(f"is not an experiment: a JSON/YAML object is expected, got "
                            f"{type(experiment).__name__}")
    return experiment


def main(argv: list[str] | None = None) -> int:
    """`chaosgpu validate EXPERIMENT [--var NAME[:TYPE]=VALUE]...`: chaoslib's validation, then
    every `--var` must be a variable of the experiment, every `${name}` must resolve and every
    argument value of a chaosgpu activity or control must pass its rules. Exit 0 when valid, 1
    with the reason on stderr when not."""
    parser = argparse.ArgumentParser(
        prog="chaosgpu validate",
        description="Validate an experiment as `chaos validate` does, and check that every "
                    "${name} it uses is a configuration key, a secret or a --var, that every "
                    "--var is a variable the experiment declares or uses, and that every "
                    "argument of a chaosgpu activity or control passes the checks the "
                    "activity makes before it touches anything.")
    parser.add_argument("experiment", help="the experiment file (JSON or YAML)")
    parser.add_argument("--var", action="append", default=[], type=_var,
                        metavar="NAME[:TYPE]=VALUE",
                        help="a variable the run will be given (as `chaos run --var`; TYPE: "
                             "str, int, float, bool, bytes or json)")
    args = parser.parse_args(argv)
    from chaoslib.exceptions import ChaosException
    from chaoslib.experiment import ensure_experiment_is_valid

    extra = {key: value for key, value, _ in args.var}
    given = var_texts([word for _, _, text in args.var for word in ("--var", text)])
    try:
        experiment = _load(args.experiment)
        ensure_experiment_is_valid(experiment)
        ensure_vars_known(experiment, set(extra))
        ensure_variables_resolve(experiment, set(extra))
        ensure_arguments_valid(experiment, extra, cli_vars=given)
    except ChaosException as error:
        print(f"chaosgpu validate: {args.experiment}: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"experiment": args.experiment, "valid": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
