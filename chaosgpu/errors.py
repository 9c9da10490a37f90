"""The errors chaosgpu raises where users see them, as Chaos Toolkit's own exception types.

An activity's bad argument is an `InvalidArgument` (chaoslib's InvalidActivity, and a ValueError
for Python callers): it is raised before anything is touched. A `${name}` in an experiment that
no configuration key or secret defines is an `UnknownVariable` (chaoslib's InvalidExperiment).
A fault or probe that ran and could not do what it was asked raises `ActivityError` (chaoslib's
ActivityFailed, and a RuntimeError for Python callers).

The node agent runs without Chaos Toolkit (its image carries no chaoslib): there the same three
classes derive from stand-ins of chaoslib's, so that everything else imports unchanged.
"""

try:
    from chaoslib.exceptions import ActivityFailed, InvalidActivity, InvalidExperiment
except ImportError:  # the node agent, or any use of chaosgpu outside Chaos Toolkit

    class ActivityFailed(Exception):  # type: ignore[no-redef]
        """Stand-in for chaoslib.exceptions.ActivityFailed."""

    class InvalidActivity(Exception):  # type: ignore[no-redef]
        """Stand-in for chaoslib.exceptions.InvalidActivity."""

    class InvalidExperiment(Exception):  # type: ignore[no-redef]
        """Stand-in for chaoslib.exceptions.InvalidExperiment."""

__all__ = ["ActivityError", "InvalidArgument", "UnknownVariable"]


class InvalidArgument(InvalidActivity, ValueError):
    """An activity was given an argument it cannot use; nothing was touched."""


class UnknownVariable(InvalidExperiment):
    """An experiment refers to `${name}` and no configuration key or secret is called `name`."""


class ActivityError(ActivityFailed, RuntimeError):
    """An activity ran and could not do what it was asked (the message says why)."""
