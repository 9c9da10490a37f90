"""The one place where an activity's arguments are checked before it runs.

An activity (a function exposed to experiments) is decorated with `checked(...)`, naming a
rule for each of its arguments that has one. The rules run before the activity's body, so a bad
argument raises `chaosgpu.errors.InvalidArgument` naming the activity, the argument, what it
must be and what it was, and nothing is touched. An argument whose default is None, or typed
Optional, may be None; any other None is refused. Signatures are left as they are (the wrapper
keeps `__wrapped__`), so `chaos discover` and `chaos validate` see the activity's own.
"""

import argparse
import functools
import inspect
import math
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar, cast

from chaosgpu.errors import InvalidArgument

__all__ = ["Rule", "checked", "rules_of", "argument_problem", "unknown_argument_problem",
           "option", "one_of", "missing_allowed", "MISSING_OK", "SECONDS", "POSITIVE_SECONDS",
           "COUNT", "INDEX", "RANK", "MIB", "TEXT", "PID",
           "FRACTION", "POSITIVE", "NON_NEGATIVE", "DEVICE", "ID", "PORT", "LISTEN_PORT",
           "LONGEST_WAIT_S", "TAG", "NAME", "UNIX_TIME", "BOOL"]

F = TypeVar("F", bound=Callable[..., Any])


class Rule:
    """A named predicate on one argument's value; `what` completes "NAME must be ...". With
    `at_most`, a number the predicate accepts is refused above that many seconds, and the
    refusal says so ("NAME must be at most ..."). `error` is the InvalidArgument subclass a
    `checked` activity raises when the rule refuses a value (chaosgpu.scope's ScopeError for a
    scope). `Rule.by_check` makes a rule of an existing check function."""

    def __init__(self, what: str, accepts: Callable[[Any], bool],
                 at_most: float | None = None,
                 error: type[InvalidArgument] = InvalidArgument) -> None:
        self.what = what
        self._accepts = accepts
        self.at_most = at_most
        self.error = error
        self._why: Callable[[Any], str | None] | None = None

    @classmethod
    def by_check(cls, what: str, check: Callable[[Any], object],
                 error: type[InvalidArgument] = InvalidArgument) -> "Rule":
        """The rule of an activity's own check: `check(value)` raises ValueError (or
        InvalidArgument, TypeError) saying why a value is refused, and returns otherwise. The
        rule accepts what the check lets through, and a refusal says "must be WHAT (WHY)", so
        the activity, `chaosgpu validate` and the control's pre-run check run the one check."""

        def why(value: Any) -> str | None:
            try:
                check(value)
            except (ValueError, TypeError) as refused:
                return str(refused)
            return None

        rule = cls(what, lambda value: why(value) is None, error=error)
        rule._why = why
        return rule

    def __repr__(self) -> str:
        return f"Rule({self.what!r})"

    def accepts(self, value: Any) -> bool:
        """Whether the rule accepts `value`."""
        return self._accepts(value) and not self._too_large(value)

    def _too_large(self, value: Any) -> bool:
        return self.at_most is not None and value > self.at_most

    def must(self, value: Any) -> str:
        """What a refused `value` had to be: "must be ...", completed by ", got VALUE"."""
        if self._accepts(value) and self._too_large(value):
            return f"must be at most {self.at_most:g} s (the longest wait chaosgpu makes)"
        why = self._why(value) if self._why is not None else None
        return f"must be {self.what} ({why})" if why else f"must be {self.what}"

    def require(self, label: str, value: Any) -> None:
        """Raise InvalidArgument ("LABEL must be ..., got VALUE") unless the rule accepts
        `value`: the check for library functions that are not `checked` activities."""
        if not self.accepts(value):
            raise self.error(f"{label} {self.must(value)}, got {value!r}")


def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The longest wait a command accepts (about 31 years): threads, timers and torch's
#: millisecond timeouts cannot hold much more. Every argument in seconds is capped here, so a
#: wait too long to make is refused by name before anything is sent.
LONGEST_WAIT_S = 1e9
SECONDS = Rule("a number of seconds >= 0", lambda v: _number(v) and v >= 0, LONGEST_WAIT_S)
POSITIVE_SECONDS = Rule("a number of seconds > 0", lambda v: _number(v) and v > 0,
                        LONGEST_WAIT_S)
#: A moment as unix time (seconds since 1970): a time, not a wait, so not capped as waits are.
UNIX_TIME = Rule("a unix time in seconds >= 0", lambda v: _number(v) and v >= 0)
POSITIVE = Rule("a number > 0", lambda v: _number(v) and v > 0)
NON_NEGATIVE = Rule("a number >= 0", lambda v: _number(v) and v >= 0)
FRACTION = Rule("a number in (0, 1]", lambda v: _number(v) and 0 < v <= 1)
COUNT = Rule(">= 1 (an integer)", lambda v: _integer(v) and v >= 1)
INDEX = Rule("a non-negative integer", lambda v: _integer(v) and v >= 0)
#: A rank of a job: its number, or "any" (a live rank chaosgpu picks; chaosgpu.job.actions).
RANK = Rule('a rank number (a non-negative integer) or "any"',
            lambda v: (_integer(v) and v >= 0) or v == "any")
MIB = Rule("a number of MiB >= 0", lambda v: _number(v) and v >= 0)
PID = Rule("a positive host PID (an integer > 0)", lambda v: _integer(v) and v > 0)
TEXT = Rule("a non-empty string", lambda v: isinstance(v, str) and bool(v.strip()))
#: A tag (CHAOSGPU_TAG) as a selection takes it: matched exactly, never stripped, so it may hold
#: no whitespace or control character (a workload's tag, chaosgpu.workloads' TAG_RE, never does).
TAG = Rule("a tag: a non-empty string without whitespace or control characters",
           lambda v: isinstance(v, str) and v.isprintable() and bool(v)
           and not any(c.isspace() for c in v))
#: A name or id matched exactly (a job id, a sandbox name, a pod uid): never stripped.
NAME = Rule("a non-empty string without leading or trailing whitespace",
            lambda v: isinstance(v, str) and bool(v) and v == v.strip())
#: A user or group id: 0 .. 2**32 - 2 (2**32 - 1 is the kernel's "no id", -1 as unsigned).
ID = Rule("a user or group id (an integer from 0 to 4294967294)",
          lambda v: _integer(v) and 0 <= v <= 4294967294)
PORT = Rule("a TCP port (an integer from 1 to 65535)", lambda v: _integer(v) and 0 < v < 65536)
#: A port to listen on or to give a launcher, where 0 asks for any free port.
LISTEN_PORT = Rule("a TCP port (an integer from 0 to 65535; 0 = any free port)",
                   lambda v: _integer(v) and 0 <= v < 65536)
DEVICE = Rule("a GPU index (an integer >= 0) or a non-empty UUID or PCI bus id string",
              lambda v: (_integer(v) and v >= 0) or (isinstance(v, str) and bool(v.strip())))
#: A flag an activity reads as true or false, never by truthiness ("false" is not false).
BOOL = Rule("true or false", lambda v: isinstance(v, bool))
#: What `missing_ok` may be (missing_allowed says what each means): true, false or
#: "before-method".
MISSING_OK = Rule('true, false or "before-method"',
                  lambda v: isinstance(v, bool) or v == "before-method")


def one_of(values: tuple[str | int, ...]) -> Rule:
    """The rule "one of `values`" (strings or integers, matched exactly, type included: true is
    not 1, nor 1.0): an activity's choice argument (a signal, a phase, a mode, a level...),
    checked by the activity and by `chaosgpu validate` and the control's pre-run check before a
    run (a `--var how:str=nodeloss` is refused before the method starts anything)."""
    return Rule("one of " + ", ".join(repr(v) for v in values),
                lambda value: any(type(value) is type(v) and value == v for v in values))


def option(rule: Rule, convert: Callable[[str], Any] = float) -> Callable[[str], Any]:
    """An argparse `type=` for a command-line option checked by `rule`: the text is converted
    (float by default; int for ids and counts) and refused, with argparse's usage error naming
    the option, when it does not convert or the rule does not accept it (nan, inf, a negative
    number of seconds, an id out of range)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule.what}, got {text!r}") from None
        if not rule.accepts(value):
            raise argparse.ArgumentTypeError(f"{rule.must(value)}, got {text!r}")
        return value

    parse.__name__ = rule.what  # argparse names the type in some messages
    return parse


#: What Chaos Toolkit passes to every activity: not worth listing as arguments.
_CONTEXT = ("configuration", "secrets")


def rules_of(activity: Callable[..., Any]) -> dict[str, Rule]:
    """The argument rules `checked` gave an activity ({} for one without)."""
    return dict(getattr(activity, "__chaosgpu_rules__", {}))


def argument_problem(activity: Callable[..., Any], name: str, value: Any) -> str | None:
    """What is wrong with `value` for the argument `name` of a `checked` activity ("NAME must
    be ..., got VALUE"), or None when its rule accepts it, when None is a value the argument
    declares, or when it has no rule: the check `checked` makes before the activity runs, and
    `chaosgpu validate` makes without running it."""
    rule = rules_of(activity).get(name)
    if rule is None or rule.accepts(value):
        return None
    if value is None and name in getattr(activity, "__chaosgpu_optional__", ()):
        return None
    return f"{name} {rule.must(value)}, got {value!r}"


def unknown_argument_problem(activity: Callable[..., Any], names: Any) -> str | None:
    """What is wrong with the argument names `names` given to `activity` ("unknown argument
    'X'; it takes A, B"), or None when it takes them all (or takes any keyword): the check a
    `checked` activity makes before it runs, and `chaosgpu validate` makes of a control's
    arguments (chaoslib checks an activity's names, not a control's)."""
    signature = inspect.signature(inspect.unwrap(activity))
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    unknown = sorted(set(names) - set(signature.parameters))
    if not unknown:
        return None
    return (f"unknown argument {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(n for n in signature.parameters if n not in _CONTEXT)}")


def _allows_none(parameter: inspect.Parameter) -> bool:
    """Whether None is a value the parameter declares: its default, or Optional[...]."""
    if parameter.default is None:
        return True
    annotation = parameter.annotation
    return (typing.get_origin(annotation) in (typing.Union, types.UnionType)
            and type(None) in typing.get_args(annotation))


def checked(**rules: Rule) -> Callable[[F], F]:
    """Decorate an activity so that each argument named in `rules` is checked before it runs (a
    missing one is Python's TypeError, as without the decorator). The rules stay readable as
    `rules_of(activity)`."""

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        unknown = sorted(set(rules) - set(signature.parameters))
        if unknown:
            raise TypeError(f"{func.__qualname__} has no argument {unknown}")
        optional = {name for name in rules if _allows_none(signature.parameters[name])}

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            unknown = unknown_argument_problem(func, kwargs)
            if unknown:  # a typo'd name, said before any missing one
                raise InvalidArgument(f"{func.__name__}: {unknown}")
            bound = signature.bind(*args, **kwargs)  # a missing argument stays a TypeError
            bound.apply_defaults()
            for name, rule in rules.items():
                problem = argument_problem(wrapper, name, bound.arguments[name])
                if problem:
                    raise rule.error(f"{func.__name__}: {problem}")
            return func(*args, **kwargs)

        wrapper.__chaosgpu_rules__ = dict(rules)  # type: ignore[attr-defined]
        wrapper.__chaosgpu_optional__ = frozenset(optional)  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate


def missing_allowed(missing_ok: Any, seen_in_this_run: bool,
                    method_started: bool | None = None) -> bool:
    """The one rule for a probe whose selection (a job, a tag, a sandbox) matches nothing:
    acceptable when `missing_ok` is true; with "before-method" (the catalog's form), before the
    experiment's method has started (the timeline control marks it: the method starts what is
    selected) and afterwards only for what this run has seen or created (it ended or was
    removed); never for a selection this run never met once the method started (a typo).
    Without the timeline control the method's start is `method_started` where the caller can
    tell (the Kubernetes activities: whether one of their actions has run), else unknown: then
    only what was seen counts. A `missing_ok` other than true, false or "before-method" is
    InvalidArgument."""
    MISSING_OK.require("missing_ok", missing_ok)
    if isinstance(missing_ok, bool):
        return missing_ok
    if seen_in_this_run:
        return True
    from chaosgpu.timeline.sampler import current

    sampler = current()
    if sampler is not None:
        return sampler.event_time("method", "start") is None
    return method_started is False


def missing_advice(missing_ok: Any) -> str:
    """How a selection that matches nothing could be allowed, to end the error of an activity
    that missing_allowed refused: "needs missing_ok true (or ...)". With "before-method" and no
    timeline control running, it says that the control is what tells before the method from
    after it (without it only what this run met is accepted), rather than advising the
    "before-method" that was given, before the method."""
    from chaosgpu.timeline.sampler import current

    if missing_ok == "before-method" and current() is None:
        return ('needs missing_ok true: "before-method" (the default) tells before the method '
                'from after it only with the timeline control (chaosgpu.timeline.control) in '
                "the experiment's controls; without it, it accepts only what this run met")
    return 'needs missing_ok true (or "before-method", the default, before the method starts)'
