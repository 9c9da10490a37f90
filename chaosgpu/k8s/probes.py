"""Chaos Toolkit probes on Kubernetes GPU pods: which GPU pods exist, how their deletion went,
and what the census sees from inside a pod.

This module owns the probe surface (arguments, validation, JSON results). It changes nothing in
the cluster; the in-pod census runs the read-only `probes/node_census.py` through exec. Probes
backed by the node agent live with the agent, not here.
"""

import time
from typing import Any, Dict, List, Optional, Union

from chaosgpu import state
from chaosgpu.arguments import BOOL, MISSING_OK, POSITIVE_SECONDS, checked, missing_allowed
from chaosgpu.k8s import deletion, inpod, selection
from chaosgpu.k8s.client import core_api
from chaosgpu.k8s.selection import NAMESPACE, POD_NAME

__all__ = ["gpu_pods", "gpu_pod_count", "gpu_pods_terminating", "pod_deletion_timings",
           "pod_census"]


@checked(ns=NAMESPACE, gpu_only=BOOL)
def gpu_pods(label_selector: Optional[str] = None, name_pattern: Optional[str] = None,
             ns: str = "default", gpu_only: bool = True,
             configuration: Optional[Dict[str, Any]] = None,
             secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """List the pods of `ns` matched by label_selector and/or name_pattern (a whole-name regular
    expression; an empty selector is refused) that request nvidia.com/gpu (all matched pods when
    gpu_only is false), each as namespace, name, uid, node, phase, GPU count, grace period,
    containers, deletionTimestamp and labels."""
    core = core_api(secrets)
    pods = selection.select_pods(core, ns, label_selector, name_pattern, gpu_only=gpu_only)
    return [selection.summarize(pod) for pod in pods]


def _counted(label_selector: str | None, name_pattern: str | None, ns: str, gpu_only: bool,
             missing_ok: Any, secrets: dict[str, Any] | None) -> list[dict[str, Any]]:
    """gpu_pods for a probe that counts: a selection that matches no pod is accepted only where
    chaosgpu.arguments' missing_allowed allows it (this run met it: its pods are gone; or
    before the method, known by whether a chaosgpu.k8s action has run), otherwise
    SelectionError: a typo'd selector never reads as "no pod terminating"."""
    missing_allowed(missing_ok, True)  # a bad value is refused whatever matches
    pods = gpu_pods(label_selector, name_pattern, ns, gpu_only, secrets=secrets)
    if pods or missing_allowed(missing_ok, selection.met(ns, label_selector, name_pattern),
                               method_started=selection.action_ran()):
        return pods
    raise selection.SelectionError(
        f"no {'GPU ' if gpu_only else ''}pod in namespace {ns!r} matches "
        f"label_selector={label_selector!r} name_pattern={name_pattern!r}, and this run never "
        "met that selection (no pod it created or matched satisfies it): a typo? A selection "
        "that may match nothing needs missing_ok true (or \"before-method\", the default, "
        "before the method's first action)")


@checked(ns=NAMESPACE, missing_ok=MISSING_OK, gpu_only=BOOL)
def gpu_pod_count(label_selector: Optional[str] = None, name_pattern: Optional[str] = None,
                  ns: str = "default", gpu_only: bool = True,
                  missing_ok: Union[bool, str] = "before-method",
                  configuration: Optional[Dict[str, Any]] = None,
                  secrets: Optional[Dict[str, Any]] = None) -> int:
    """Count the pods gpu_pods would list (same selection rules), e.g. for a steady state that
    expects the training pods to be there, or gone. A selection that matches nothing fails
    unless `missing_ok` allows it: true, or "before-method" (the default) before the method's
    first action and afterwards for a selection this run met (its pods were deleted)."""
    return len(_counted(label_selector, name_pattern, ns, gpu_only, missing_ok, secrets))


@checked(ns=NAMESPACE, missing_ok=MISSING_OK, gpu_only=BOOL)
def gpu_pods_terminating(label_selector: Optional[str] = None, name_pattern: Optional[str] = None,
                         ns: str = "default", gpu_only: bool = True,
                         missing_ok: Union[bool, str] = "before-method",
                         configuration: Optional[Dict[str, Any]] = None,
                         secrets: Optional[Dict[str, Any]] = None) -> int:
    """Count the selected GPU pods that are being deleted (deletionTimestamp set) but still
    exist: a steady state of 0 holds before a deletion and after a clean one, and catches a pod
    stuck in Terminating with its GPU. A selection that matches nothing fails unless
    `missing_ok` allows it (see gpu_pod_count): a typo'd selector never passes as 0."""
    pods = _counted(label_selector, name_pattern, ns, gpu_only, missing_ok, secrets)
    return sum(1 for pod in pods if pod["deletion_timestamp"])


@checked(ns=NAMESPACE, timeout=POSITIVE_SECONDS, poll_interval=POSITIVE_SECONDS, wait=BOOL)
def pod_deletion_timings(label_selector: Optional[str] = None, name_pattern: Optional[str] = None,
                         ns: str = "default", wait: bool = True, timeout: float = 120.0,
                         poll_interval: float = 0.2,
                         configuration: Optional[Dict[str, Any]] = None,
                         secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Return the timings of this run's delete_gpu_pods in `ns` for the pods matching name_pattern
    (whole-name regular expression) and/or label_selector's equality terms: per pod the seconds
    from DELETE to deletionTimestamp seen, to containers terminated and to pod gone; with `wait`,
    first follows pods not yet gone for at most `timeout` seconds (for a delete sent with
    wait=false). Raises when this run recorded no deletion for the selection (one recorded by
    an earlier run is never reported as this run's)."""
    pattern = selection.validate(ns, label_selector, name_pattern)
    wanted = selection.equality_terms(label_selector) or {}
    matching = [r for r in state.list_records(deletion.RECORD_KIND).values()
                if r.get("namespace") == ns
                and (pattern is None or pattern.fullmatch(r.get("name") or ""))
                and all((r.get("labels") or {}).get(k) == v for k, v in wanted.items())]
    records = [r for r in matching if deletion.this_run(r)]
    if not records:
        earlier = len(matching) - len(records)
        raise ValueError(
            f"no pod deletion recorded by this run in namespace {ns!r} for "
            f"label_selector={label_selector!r} name_pattern={name_pattern!r}"
            + (f" ({earlier} recorded by an earlier run, not reported: their timings are not "
               "this run's evidence; did this run's delete_gpu_pods fail or match nothing?)"
               if earlier else ""))
    pending = [r for r in records if not r.get("gone") and r.get("delete_status") == "sent"]
    if wait and pending:
        core = core_api(secrets)
        for record in pending:
            record["timed_out"] = False
            record["_t0"] = time.monotonic() - (time.time() - record["delete_sent_at"])
        deletion.follow(core, pending, float(timeout), float(poll_interval))
        for record in pending:
            deletion.save(deletion.public(record))
    pods = sorted((deletion.public(r) for r in records), key=lambda r: r["name"])
    gone = [p["gone_s"] for p in pods if p["gone"]]
    terminated = [p["containers_terminated_s"] for p in pods
                  if p["containers_terminated_s"] is not None]
    return {"namespace": ns, "pods": pods, "all_gone": len(gone) == len(pods),
            "max_gone_s": max(gone) if gone else None,
            "max_containers_terminated_s": max(terminated) if terminated else None}


@checked(name=POD_NAME, ns=NAMESPACE, timeout=POSITIVE_SECONDS, full=BOOL)
def pod_census(name: str, ns: str = "default", container: Optional[str] = None,
               timeout: float = 60.0, full: bool = False, python: str = "python3",
               configuration: Optional[Dict[str, Any]] = None,
               secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run chaosgpu's census inside pod `ns/name` (container optional) through the exec API —
    the field report's observe.sh done right: GPU processes attributed across PID namespaces
    (NVML's host PIDs are not reported as orphans), zombies, orphans (with their reason), jobs
    and their ranks. Returns a summary (zombie_count, orphan_count, jobs, gpu_processes, PID 1),
    or the whole census document with `full`."""
    selection.check_namespace(ns)
    selection.check_pod_name(name)
    core = core_api(secrets)
    document = inpod.census(core, name, ns, container=container, timeout=float(timeout),
                            python=python)
    result = document if full else inpod.summarize_census(document)
    return {"pod": f"{ns}/{name}", "container": container, **result}
