"""The one definition of "GiB x s": memory held over time, integrated from samples.

Everything in chaosgpu that reports GiB x s (the sampler and its `gb_seconds_held` probe, the
node agent's `pod_gb_seconds`, the report) calls `gib_seconds` here, so the three agree to the
last digit on the same samples.

Units: times in seconds, values in MiB (2**20 bytes), the result in GiB x s with
GiB = 1024 MiB.

The rule: the trapezoidal rule over the samples that fall in [start, end], each sample first
reduced by `above` (a baseline) and clipped at zero. Where start or end falls between two samples
the value there is interpolated linearly; before the first sample nothing is counted (nothing
was seen); from the last sample to `end` the last value is held (it was still held when last
seen, and nothing showed it go).

Why trapezoids: memory is a step function (an allocation, a release) sampled at instants; the
step happens at an unknown instant between two samples. The trapezoid counts half of each
sampling interval that holds a step, so its error is at most half an interval times the step,
and it is unbiased when the step is equally likely anywhere in the interval. Holding the left
sample (a left step) always counts the whole interval: biased by half an interval per step.
"""

import bisect
from collections.abc import Sequence

__all__ = ["GIB_PER_MIB", "RULE", "gib_seconds"]

GIB_PER_MIB = 1.0 / 1024.0

# One line the report and the docs quote.
RULE = ("trapezoids over the samples (MiB above the baseline, clipped at 0), the last value "
        "held to the end; GiB = 1024 MiB")


def _value_at(times: Sequence[float], values: Sequence[float], t: float) -> float:
    """The series at t, linear between samples, the last value after the last sample."""
    index = bisect.bisect_right(times, t)
    if index >= len(times):
        return values[-1]
    if index == 0:
        return values[0]
    t0, t1 = times[index - 1], times[index]
    if t1 <= t0:
        return values[index]
    v0, v1 = values[index - 1], values[index]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def gib_seconds(times: Sequence[float], mib: Sequence[float], start: float, end: float,
                above: float = 0.0) -> float:
    """GiB x s held between `start` and `end` (seconds, on the samples' clock) by the series
    (`times` in seconds, ascending; `mib` in MiB), counting only what lies above `above` MiB;
    see the module docstring for the rule. Raises ValueError when the lengths differ or the
    times go backwards; returns 0.0 for an empty series or an empty window."""
    if len(times) != len(mib):
        raise ValueError(f"times ({len(times)}) and mib ({len(mib)}) differ in length")
    if any(b < a for a, b in zip(times, times[1:], strict=False)):
        raise ValueError("times are not in ascending order")
    if not times or end <= start:
        return 0.0
    values = [max(0.0, float(v) - above) for v in mib]
    lo = max(start, float(times[0]))
    if end <= lo:
        return 0.0
    points = [lo] + [float(t) for t in times if lo < t < end] + [end]
    area = 0.0
    previous = _value_at(times, values, points[0])
    for a, b in zip(points, points[1:], strict=False):
        current = _value_at(times, values, b) if b <= times[-1] else values[-1]
        area += (previous + current) / 2.0 * (b - a)
        previous = current
    return area * GIB_PER_MIB
