"""The errors chaosgpu raises where users see them, as Chaos Toolkit's own exception types.

An activity's bad argument is an `InvalidArgument` (chaoslib's InvalidActivity, and a ValueError
for Python callers): it is raised before anything is touched. A `${name}` in an experiment that
no configuration key or secret defines is an `UnknownVariable` (chaoslib's InvalidExperiment).
A fault or probe that ran and could not do what it was asked raises `ActivityError` (chaoslib's
ActivityFailed, and a RuntimeError for Python callers).
"""

from chaoslib.exceptions import ActivityFailed, InvalidActivity, InvalidExperiment

__all__ = ["ActivityError", "InvalidArgument", "UnknownVariable"]


class InvalidArgument(InvalidActivity, ValueError):
    """An activity was given an argument it cannot use; nothing was touched."""


class UnknownVariable(InvalidExperiment):
    """An experiment refers to `${name}` and no configuration key or secret is called `name`."""


class ActivityError(ActivityFailed, RuntimeError):
    """An activity ran and could not do what it was asked (the message says why)."""
