"""GPU-aware pod selection: which pods of a namespace an experiment may touch.

This module owns the selection rules: a namespace, a label selector and/or a name pattern (a
regular expression that must match the whole name), and by default only pods that request a GPU
resource (`nvidia.com/gpu` in requests or limits of any container or init container). An empty
selector is refused: chaostoolkit-kubernetes's `terminate_pods` would take every pod in the
namespace. It reads pods; it must not change anything in the cluster. It also remembers what
this run met (the selections that matched a pod, the pods it created, whether a chaosgpu.k8s
action has run), so that a probe can tell a selection whose pods are gone from a typo.
"""

import random
import re
from typing import Any

from kubernetes import client

from chaosgpu.arguments import Rule

__all__ = ["SelectionError", "GPU_RESOURCE", "gpu_count", "summarize", "check_namespace",
           "check_pod_name", "validate", "select_pods", "choose", "equality_terms",
           "remember_created", "note_action", "action_ran", "met"]

GPU_RESOURCE = "nvidia.com/gpu"
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class SelectionError(ValueError):
    """The selection was refused (empty selector, bad pattern) or matched nothing."""


# What this run met: (namespace, label selector, name pattern) of every selection that matched
# a pod, (namespace, name, labels) of every pod created, and whether an action ran.
_MET: set[tuple[str, str, str]] = set()
_CREATED: list[tuple[str, str, dict[str, str]]] = []
_ACTED: list[bool] = [False]


def _key(ns: str, label_selector: str | None, name_pattern: str | None) -> tuple[str, str, str]:
    return ns, (label_selector or "").strip(), (name_pattern or "").strip()


def equality_terms(label_selector: str | None, strict: bool = False) -> dict[str, str] | None:
    """The `key=value` (or `key==value`) terms of a label selector; the other terms (`!=`,
    `in`, `notin`, existence) are left out, or with `strict` make the answer None (the
    selector cannot be checked against labels by equality alone)."""
    terms: dict[str, str] = {}
    for term in (label_selector or "").split(","):
        if not term.strip():
            continue
        match = re.fullmatch(r"\s*([^\s!=]+)\s*==?\s*(\S*)\s*", term)
        if match:
            terms[match.group(1)] = match.group(2)
        elif strict:
            return None
    return terms


def remember_created(pod: dict[str, Any]) -> None:
    """Note a pod this run created (API dict): a selection its labels and name satisfy is one
    this run met, even once the pod is gone."""
    metadata = pod.get("metadata") or {}
    _CREATED.append((str(metadata.get("namespace") or ""), str(metadata.get("name") or ""),
                     dict(metadata.get("labels") or {})))


def note_action() -> None:
    """Note that a chaosgpu.k8s action ran in this run: the experiment's method has begun (the
    Kubernetes experiments carry no timeline control to say so)."""
    _ACTED[0] = True


def action_ran() -> bool:
    """Whether a chaosgpu.k8s action has run in this process (see note_action)."""
    return _ACTED[0]


def met(ns: str, label_selector: str | None, name_pattern: str | None) -> bool:
    """Whether this run met the selection: it matched a pod here, or a pod this run created
    satisfies it (by its labels, where every selector term is an equality, and its name)."""
    if _key(ns, label_selector, name_pattern) in _MET:
        return True
    terms = equality_terms(label_selector, strict=True)
    if terms is None:
        return False
    pattern = re.compile(name_pattern) if name_pattern and name_pattern.strip() else None
    return any(created_ns == ns and all(labels.get(k) == v for k, v in terms.items())
               and (pattern is None or pattern.fullmatch(name))
               for created_ns, name, labels in _CREATED)


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def gpu_count(pod: dict[str, Any], resource: str = GPU_RESOURCE) -> int:
    """Return how many `resource` units a pod (a dict in API form) requests across containers."""
    spec = pod.get("spec") or {}
    total = 0
    for container in (spec.get("containers") or []):
        resources = container.get("resources") or {}
        requests = _quantity((resources.get("requests") or {}).get(resource))
        limits = _quantity((resources.get("limits") or {}).get(resource))
        total += max(requests, limits)
    init_max = 0
    for container in (spec.get("initContainers") or []):
        resources = container.get("resources") or {}
        init_max = max(init_max, _quantity((resources.get("requests") or {}).get(resource)),
                       _quantity((resources.get("limits") or {}).get(resource)))
    return max(total, init_max)


def summarize(pod: dict[str, Any], resource: str = GPU_RESOURCE) -> dict[str, Any]:
    """Return the JSON-serialisable facts of a pod that experiments and journals need."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    return {
        "namespace": metadata.get("namespace"),
        "name": metadata.get("name"),
        "uid": metadata.get("uid"),
        "node": spec.get("nodeName"),
        "phase": status.get("phase"),
        "gpus": gpu_count(pod, resource),
        "termination_grace_period_seconds": spec.get("terminationGracePeriodSeconds"),
        "containers": [c.get("name") for c in (spec.get("containers") or [])],
        "deletion_timestamp": metadata.get("deletionTimestamp"),
        "labels": dict(metadata.get("labels") or {}),
    }


def check_namespace(ns: str) -> str:
    """Return `ns` if it is a valid namespace name, else raise SelectionError."""
    if not isinstance(ns, str) or not _NAMESPACE.fullmatch(ns) or len(ns) > 63:
        raise SelectionError(f"invalid namespace {ns!r}: a DNS label such as 'default' is needed")
    return ns


def check_pod_name(name: str) -> str:
    """Return `name` if it is a valid pod name, else raise SelectionError."""
    if (not isinstance(name, str) or len(name) > 253
            or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name)):
        raise SelectionError(f"invalid pod name {name!r}: a DNS subdomain name is needed")
    return name


#: the rules of an activity's `ns` and pod `name` (chaosgpu.arguments): these checks, made by
#: the activity before it calls the API, and by `chaosgpu validate` before a run
NAMESPACE = Rule.by_check("a namespace name (a DNS label such as 'default')", check_namespace)
POD_NAME = Rule.by_check("a pod name (a DNS subdomain name)", check_pod_name)


def validate(ns: str, label_selector: str | None,
             name_pattern: str | None) -> re.Pattern[str] | None:
    """Check the selection arguments; return the compiled name pattern (or None)."""
    check_namespace(ns)
    if label_selector is not None and not isinstance(label_selector, str):
        raise SelectionError(
            f"label_selector must be a string, not {type(label_selector).__name__}")
    if name_pattern is not None and not isinstance(name_pattern, str):
        raise SelectionError(f"name_pattern must be a string, not {type(name_pattern).__name__}")
    if not (label_selector or "").strip() and not (name_pattern or "").strip():
        raise SelectionError(
            f"refusing an empty selector in namespace {ns!r}: give label_selector and/or "
            "name_pattern (an empty one would select every pod of the namespace)")
    if name_pattern:
        try:
            return re.compile(name_pattern)
        except re.error as error:
            raise SelectionError(f"invalid name_pattern {name_pattern!r}: {error}") from None
    return None


def select_pods(core: client.CoreV1Api, ns: str = "default", label_selector: str | None = None,
                name_pattern: str | None = None, gpu_only: bool = True,
                resource: str = GPU_RESOURCE) -> list[dict[str, Any]]:
    """Return the pods (API dicts, sorted by name) matching the selection; refuse empty ones."""
    pattern = validate(ns, label_selector, name_pattern)
    kwargs: dict[str, Any] = {}
    if label_selector and label_selector.strip():
        kwargs["label_selector"] = label_selector.strip()
    listing = core.list_namespaced_pod(ns, **kwargs)
    pods = core.api_client.sanitize_for_serialization(listing).get("items") or []
    selected = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name") or ""
        if pattern is not None and not pattern.fullmatch(name):
            continue
        if gpu_only and gpu_count(pod, resource) <= 0:
            continue
        selected.append(pod)
    selected.sort(key=lambda p: p["metadata"]["name"])
    if selected:
        _MET.add(_key(ns, label_selector, name_pattern))
    return selected


def choose(pods: list[dict[str, Any]], qty: int | None = None,
           rand: bool = False) -> list[dict[str, Any]]:
    """Return `qty` of the pods (all when None): the first by name, or a random sample."""
    if qty is None:
        return list(pods)
    if isinstance(qty, bool) or not isinstance(qty, int) or qty < 1:
        raise SelectionError(f"qty must be a positive integer or null (all), not {qty!r}")
    if rand:
        return random.sample(pods, min(qty, len(pods)))
    return list(pods[:qty])
