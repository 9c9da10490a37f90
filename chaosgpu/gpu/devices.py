"""Which GPU a fault targets, and whether the fault's numbers make sense for it.

This module owns the validation every GPU fault shares: a device named by NVML index or UUID
must exist, MiB asked for must fit the device, a duration must be positive. It reads the devices
from NVML through `chaosgpu.node` (the census's `gpu` section), or, when CHAOSGPU_NVML_REPLAY
names a recorded snapshot file, from that recording (the one place NVML is replayed: CPU tests
and dry runs on machines without a GPU). It must not start processes or touch a device.
"""

import json
import math
import os
from typing import Any

__all__ = ["REPLAY_ENV", "gpu_section", "resolve_device", "check_mib", "check_duration",
           "check_number"]

REPLAY_ENV = "CHAOSGPU_NVML_REPLAY"


def gpu_section() -> dict[str, Any]:
    """The NVML view of this node's GPUs (census `gpu` section); raises when none is visible.

    With CHAOSGPU_NVML_REPLAY=FILE the section comes from a recorded JSON file instead: either
    a `gpu` section itself, or a recording with an "idle" (else "held") section (tests/data)."""
    replay = os.environ.get(REPLAY_ENV)
    if replay:
        with open(replay, encoding="utf-8") as handle:
            data = json.load(handle)
        for key in ("gpu", "idle", "held"):
            if isinstance(data.get(key), dict) and "devices" in data[key]:
                data = data[key]
                break
        section: dict[str, Any] = data
    else:
        from chaosgpu.node import nvml_snapshot

        section = nvml_snapshot(with_processes=False)
    if not section.get("available") or not section.get("devices"):
        raise RuntimeError(f"no GPU visible through NVML here: {section.get('reason')}")
    return section


def resolve_device(device: Any, section: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return the NVML device entry named by `device`: an index (int) or a UUID ("GPU-...").

    Raises ValueError naming the devices that exist when there is no such device."""
    section = section if section is not None else gpu_section()
    devices = section.get("devices") or []
    listing = ", ".join(f"{d.get('index')} ({d.get('uuid')})" for d in devices)
    if isinstance(device, bool) or device is None:
        raise ValueError(f"device must be a GPU index or UUID, got {device!r}; GPUs: {listing}")
    if isinstance(device, int):
        for entry in devices:
            if entry.get("index") == device:
                return dict(entry)
        raise ValueError(f"GPU {device} is out of range: this node has {len(devices)} GPU(s): "
                         f"{listing}")
    if isinstance(device, str):
        text = device.strip()
        if text.isdigit():
            return resolve_device(int(text), section)
        for entry in devices:
            if str(entry.get("uuid") or "").lower() == text.lower():
                return dict(entry)
        raise ValueError(f"no GPU with UUID {device!r} here; GPUs: {listing}")
    raise ValueError(f"device must be a GPU index or UUID, got {device!r}; GPUs: {listing}")


def host_backend_device(device: Any) -> dict[str, Any]:
    """The device entry of a `backend="host"` fault, which uses no GPU: the GPU `device` names
    where NVML sees GPUs (resolve_device: its journal names it), else, on a machine without a
    GPU, `host_stand_in(device)` (so the same start, readiness and rollback paths run there)."""
    try:
        section = gpu_section()
    except RuntimeError:  # no GPU visible: nothing to name
        return host_stand_in(device)
    return resolve_device(device, section)


def host_stand_in(device: Any) -> dict[str, Any]:
    """The device entry of a `backend="host"` fault where no GPU is visible: `device` is checked
    for its form only (an index >= 0 or a "GPU-..." UUID); no UUID, no memory figures."""
    if isinstance(device, bool) or not isinstance(device, (int, str)) or (
            isinstance(device, int) and device < 0) or (
            isinstance(device, str) and not (device.strip().isdigit()
                                            or device.strip().upper().startswith("GPU-"))):
        raise ValueError(f"device must be a GPU index or UUID, got {device!r}")
    index = int(device) if isinstance(device, int) or device.strip().isdigit() else None
    return {"index": index, "uuid": None, "memory_total_mib": None, "memory_used_mib": None}


def check_number(name: str, value: Any, minimum: float | None = None,
                 maximum: float | None = None, integer: bool = False,
                 allow_none: bool = False, strict_minimum: bool = False) -> Any:
    """Return `value` when it is a number within bounds, else raise ValueError naming `name`."""
    if value is None and allow_none:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (
            isinstance(value, float) and not math.isfinite(value)):
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if minimum is not None and (value <= minimum if strict_minimum else value < minimum):
        sign = ">" if strict_minimum else ">="
        raise ValueError(f"{name} must be {sign} {minimum:g}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:g}, got {value!r}")
    return value


def check_duration(duration_s: Any, allow_none: bool = True, name: str = "duration_s") -> Any:
    """A duration in seconds must be > 0 (None: until rolled back, where allowed)."""
    if duration_s is None and not allow_none:
        raise ValueError(f"{name} is required (seconds, > 0)")
    return check_number(name, duration_s, minimum=0, strict_minimum=True, allow_none=allow_none)


def check_mib(entry: dict[str, Any], mib: Any = None, leave_mib: Any = None) -> dict[str, Any]:
    """Check a memory-pressure request against device `entry`: exactly one of `mib` (take that
    much) and `leave_mib` (take all but that much), each an integer from 1 (0 for leave_mib)
    up to the device's total memory. Returns {"mib", "leave_mib", "total_mib", "free_mib"}."""
    total = float(entry.get("memory_total_mib") or 0.0)
    used = float(entry.get("memory_used_mib") or 0.0)
    if (mib is None) == (leave_mib is None):
        raise ValueError("give exactly one of mib (MiB to take) and leave_mib (MiB to leave free)")
    name = f"GPU {entry.get('index')} ({entry.get('uuid')})"
    if mib is not None:
        check_number("mib", mib, minimum=1, integer=True)
        if mib > total:
            raise ValueError(f"mib={mib} is more than {name} has: {total:.0f} MiB in total")
    else:
        check_number("leave_mib", leave_mib, minimum=0, integer=True)
        if leave_mib >= total:
            raise ValueError(f"leave_mib={leave_mib} is not less than {name}'s total memory "
                             f"({total:.0f} MiB): nothing would be taken")
    return {"mib": mib, "leave_mib": leave_mib, "total_mib": total,
            "free_mib": round(total - used, 3)}
