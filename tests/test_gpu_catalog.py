"""What each GPU-fault experiment of the catalog must have measured (called by
tests/test_catalog.py after the real `chaos run`), with bounds for a noisy machine."""

from typing import Any


def _output(out: dict[str, Any], name: str) -> Any:
    assert name in out, f"activity {name!r} did not run"
    return out[name]["output"]


def check_gpu_measurements(name: str, out: dict[str, Any], config: dict[str, Any]) -> None:
    """Assert the figures a GPU-fault experiment exists to measure."""
    if name.startswith("gpu-rank-hang"):
        before = _output(out, "progress-before-hang")
        after = _output(out, "progress-after-hang")
        assert before["progressing"] is True, before
        assert int(config["hang_rank"]) in after["stalled_ranks"], after
        assert _output(out, "hang-rank-on-gpu")["delivered"] is True
        hang = _output(out, "detect-hang")
        # every rank is alive, and the observed verdict is still "hung": no progress while the
        # peers wait in all_reduce
        assert hang["verdict"] == "hung", hang["reason"]
        assert all(r["state"] == "alive" for r in hang["ranks"]), hang["ranks"]
        involved = set(hang["blocked_in"]["ranks"]) | {c["rank"] for c in hang["culprit_ranks"]}
        assert involved == {0, 1}, hang
    elif name.startswith("gpu-memory-pressure"):
        assert _output(out, "take-gpu-memory")["held_mib"] > 0
        assert _output(out, "give-gpu-memory-back")["gpu_released"] is True
        oom = _output(out, "cuda-oom-seen")
        assert oom["seen"] is True, oom
    elif name == "gpu-compute-contention":
        slowdown = _output(out, "slowdown-under-contention")
        assert slowdown["slowdown_factor"] is not None and slowdown["slowdown_factor"] > 1.2
        assert _output(out, "progress-after-contention")["progressing"] is True
    elif name == "gpu-xid":
        xid = _output(out, "trigger-xid")
        assert xid["seen_expected_error"] is True and xid["device_usable"] is True, xid
    elif name == "gpu-cuda-alloc-fault":
        oom = _output(out, "cuda-oom-seen")
        assert oom["seen"] is True and oom["cuda_injector"], oom
