"""Chaos Toolkit actions on Kubernetes GPU pods: delete them with a measured end, and kill,
freeze or thaw a training rank inside a pod through the exec API.

This module owns the activity surface (arguments, validation, JSON results). Selection lives in
selection.py, the deletion record in deletion.py, the exec transport in exec.py and the in-pod
programs' combination in inpod.py; credentials come from client.py and never appear in a result.
"""

import functools
import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import yaml
from kubernetes.client.exceptions import ApiException

from chaosgpu.arguments import (
    BOOL,
    COUNT,
    INDEX,
    LONGEST_WAIT_S,
    POSITIVE_SECONDS,
    TEXT,
    Rule,
    checked,
)
from chaosgpu.job.actions import SIGNAL_NAME
from chaosgpu.k8s import deletion, inpod, selection
from chaosgpu.k8s import exec as k8s_exec
from chaosgpu.k8s.client import core_api, describe
from chaosgpu.k8s.selection import NAMESPACE, POD_NAME
from chaosgpu.progress import Progress

__all__ = ["create_gpu_pod", "delete_gpu_pods", "exec_in_pod", "kill_rank_in_pod",
           "freeze_rank_in_pod", "thaw_rank_in_pod"]

logger = logging.getLogger("chaostoolkit")

#: A pod's grace period as Kubernetes takes it (whole seconds, terminationGracePeriodSeconds),
#: capped like every argument in seconds (LONGEST_WAIT_S), or -1: the pod's own (its manifest's).
GRACE_PERIOD = Rule("an integer >= 0 (seconds), or -1 for the pod's own",
                    lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= -1,
                    LONGEST_WAIT_S)
#: exec_in_pod's `command`: what the exec API runs, no shell unless one is named
COMMAND = Rule("a non-empty list of strings", lambda value: isinstance(value, list)
               and bool(value) and all(isinstance(part, str) for part in value))


def _spec_overrides_rule(value: Any) -> None:
    """create_gpu_pod's check of `spec_overrides` (_spec_overrides, defined below)."""
    _spec_overrides(value)


#: create_gpu_pod's `spec_overrides`: a JSON merge patch of the pod's spec, or its JSON text
SPEC_OVERRIDES = Rule.by_check("an object (a JSON merge patch of the pod's spec) or its JSON "
                               "text", _spec_overrides_rule)


@checked(spec_path=TEXT, ns=NAMESPACE, timeout=POSITIVE_SECONDS, poll_interval=POSITIVE_SECONDS,
         grace_period=GRACE_PERIOD, image=TEXT, spec_overrides=SPEC_OVERRIDES, wait_running=BOOL)
def create_gpu_pod(spec_path: str, ns: str = "default", wait_running: bool = True,
                   timeout: float = 300.0, poll_interval: float = 1.0,
                   grace_period: int = -1, image: Optional[str] = None,
                   spec_overrides: Optional[Union[Dict[str, Any], str]] = None,
                   configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Create the pod described by the YAML or JSON manifest at spec_path (one Pod; a relative
    path is read from the directory chaos runs in) in namespace `ns` and, with wait_running,
    wait at most `timeout` seconds until it is Running with every container started and ready
    (a container with a readinessProbe is ready once it passes: give the workload one when a
    fault must not reach it before it has set itself up, e.g. installed its SIGTERM handler);
    returns the pod's summary (name, uid, node, GPUs, grace period) and how long it took.
    Before creating it: grace_period >= 0 replaces spec.terminationGracePeriodSeconds (-1 keeps
    the manifest's), `image` replaces every container's image, and spec_overrides (an object, or
    its JSON text) is merged into spec as a JSON merge patch (RFC 7386; null removes a key),
    e.g. {"nodeName": "gpu-7", "hostNetwork": true}."""
    selection.check_namespace(ns)
    overrides = _spec_overrides(spec_overrides)
    path = Path(spec_path)
    if not spec_path or not path.is_file():
        raise ValueError(f"spec_path {spec_path!r} is not a manifest file")
    text = path.read_text(encoding="utf-8")
    try:
        manifest = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise ValueError(f"{spec_path}: not valid YAML/JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != "Pod":
        raise ValueError(f"{spec_path}: expected one manifest of kind Pod")
    spec = manifest.setdefault("spec", {})
    if not isinstance(spec, dict):
        raise ValueError(f"{spec_path}: spec must be an object")
    manifest["spec"] = _merge_patch(spec, overrides)
    if grace_period >= 0:
        manifest["spec"]["terminationGracePeriodSeconds"] = grace_period
    if image is not None:
        for container in (manifest["spec"].get("containers") or []) + (
                manifest["spec"].get("initContainers") or []):
            container["image"] = image
    _quantities_as_strings(manifest)
    core = core_api(secrets)
    started = time.monotonic()
    selection.note_action()
    created = core.api_client.sanitize_for_serialization(
        core.create_namespaced_pod(ns, manifest))  # type: ignore[arg-type]
    selection.remember_created(created)
    name = created["metadata"]["name"]
    pod = created
    waiting = Progress(f"pod {ns}/{name} to run with every container ready", timeout)
    while wait_running:
        phase = (pod.get("status") or {}).get("phase")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        waiting_for = [s.get("name") for s in statuses if not (
            (s.get("state") or {}).get("running") and s.get("ready"))]
        if phase == "Running" and statuses and not waiting_for:
            break
        if phase in ("Failed", "Succeeded"):
            raise RuntimeError(f"pod {ns}/{name} ended ({phase}) before running: "
                               f"{_container_ends(statuses)}")
        hopeless = [f"{s.get('name')}: {_waiting(s)[0]} ({_waiting(s)[1]})" for s in statuses
                    if _waiting(s)[0] in NEVER_STARTS]
        if hopeless:
            raise RuntimeError(f"pod {ns}/{name} cannot start, the kubelet will not retry: "
                               f"{'; '.join(hopeless)} (left for the rollback to delete)")
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"pod {ns}/{name} not running and ready after {timeout:g} s "
                               f"({_pod_wait(pod.get('status') or {}, waiting_for)})")
        waiting.update(functools.partial(_pod_wait, pod.get("status") or {}, waiting_for))
        time.sleep(poll_interval)
        pod = core.api_client.sanitize_for_serialization(core.read_namespaced_pod(name, ns))
    return {**selection.summarize(pod), "spec_path": spec_path, "spec_overrides": overrides,
            "running_after_s": round(time.monotonic() - started, 3) if wait_running else None}


#: a container waiting for one of these reasons never starts by itself: no use waiting
NEVER_STARTS = ("InvalidImageName", "ErrImageNeverPull")


def _waiting(status: dict[str, Any]) -> tuple[str | None, str]:
    """A container status's waiting reason and message (None, "" when not waiting)."""
    waiting = (status.get("state") or {}).get("waiting") or {}
    return waiting.get("reason"), waiting.get("message") or ""


def _container_ends(statuses: list[dict[str, Any]]) -> str:
    """How each container of an ended pod ended (exit code and reason), for an error."""
    ends = []
    for status in statuses:
        ended = (status.get("state") or {}).get("terminated") or {}
        ends.append(f"{status.get('name')} exited {ended.get('exitCode', '?')} "
                    f"({ended.get('reason') or 'no reason given'})")
    return ", ".join(ends) or "no container status"


def _pod_wait(pod_status: dict[str, Any], waiting_for: list[Any]) -> str:
    """What a pod being waited for shows: its phase, why it is not scheduled yet (e.g. no node
    with a free GPU), and each container not yet running and ready with the reason the kubelet
    gives (ContainerCreating, ErrImagePull, ...)."""
    phase = pod_status.get("phase")
    statuses = pod_status.get("containerStatuses") or []
    unscheduled = next((c for c in pod_status.get("conditions") or []
                        if c.get("type") == "PodScheduled" and c.get("status") == "False"), None)
    parts = []
    for status in statuses:
        if status.get("name") not in waiting_for:
            continue
        state = status.get("state") or {}
        reason = (_waiting(status)[0]
                  or ("running, not ready" if state.get("running") else next(iter(state), "?")))
        parts.append(f"{status.get('name')}: {reason}")
    return (f"phase {phase}"
            + (f"; not scheduled: {unscheduled.get('reason') or '?'}: "
               f"{unscheduled.get('message') or 'no message'}" if unscheduled else "")
            + (f"; containers not running and ready: {', '.join(parts)}" if parts else ""))


def _spec_overrides(value: Any) -> dict[str, Any]:
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise ValueError(f"spec_overrides is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"spec_overrides must be an object (a JSON merge patch of the pod's "
                         f"spec), not {value!r}")
    return value


def _merge_patch(target: Any, patch: Any) -> Any:
    # RFC 7386: objects merge key by key, null removes, anything else replaces.
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge_patch(merged.get(key), value)
    return merged


def _quantities_as_strings(manifest: dict[str, Any]) -> None:
    # kubectl takes `nvidia.com/gpu: 1`; the typed client (kubernetes >= 35) wants "1".
    spec = manifest.get("spec") or {}
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            values = resources.get(kind)
            if isinstance(values, dict):
                resources[kind] = {k: str(v) for k, v in values.items()}


@checked(ns=NAMESPACE, qty=COUNT, timeout=POSITIVE_SECONDS, poll_interval=POSITIVE_SECONDS,
         grace_period=GRACE_PERIOD, missing_ok=BOOL, rand=BOOL, gpu_only=BOOL, wait=BOOL)
def delete_gpu_pods(label_selector: Optional[str] = None, name_pattern: Optional[str] = None,
                    ns: str = "default", grace_period: int = -1, qty: Optional[int] = None,
                    rand: bool = False, gpu_only: bool = True, wait: bool = True,
                    timeout: float = 120.0, poll_interval: float = 0.2,
                    missing_ok: bool = False,
                    configuration: Optional[Dict[str, Any]] = None,
                    secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Delete the GPU pods matched by label_selector and/or name_pattern (a whole-name regular
    expression) in `ns` — only pods requesting nvidia.com/gpu unless gpu_only is false; an empty
    selector is refused — with the pod's own grace period (grace_period=-1) or the given one,
    sent in the DELETE body; `qty` limits how many (first by name, or random with `rand`). With
    `wait`, follows each pod until it is gone or `timeout` seconds pass, and reports per pod when
    the DELETE was sent, when deletionTimestamp was seen, when the containers were terminated
    (exit codes) and when the pod was gone; the record is kept for `pod_deletion_timings`.
    Matching nothing is an error unless missing_ok (for rollbacks: safe to run twice)."""
    selection.validate(ns, label_selector, name_pattern)
    selection.note_action()
    core = core_api(secrets)
    pods = selection.select_pods(core, ns, label_selector, name_pattern, gpu_only=gpu_only)
    if not pods and missing_ok:
        return {"namespace": ns, "label_selector": label_selector, "name_pattern": name_pattern,
                "gpu_only": gpu_only, "grace_period": grace_period, "waited": wait, "pods": [],
                "all_gone": True, "max_gone_s": None, "api": describe(core.api_client)}
    if not pods:
        raise selection.SelectionError(
            f"no {'GPU ' if gpu_only else ''}pod in namespace {ns!r} matches "
            f"label_selector={label_selector!r} name_pattern={name_pattern!r}: nothing deleted")
    chosen = selection.choose(pods, qty, rand)
    owns = [(p.get("spec") or {}).get("terminationGracePeriodSeconds") for p in chosen]
    longest = max(grace_period if grace_period >= 0 else (30 if own is None else own)
                  for own in owns)
    if wait and timeout < longest:
        logger.warning("chaosgpu: timeout %gs is shorter than the grace period %ss: the pods may "
                       "outlive the wait (pod_deletion_timings can finish it)", timeout, longest)
    entries = [deletion.send_delete(core, pod, grace_period, ns) for pod in chosen]
    for entry, pod in zip(entries, chosen, strict=True):
        entry["gpus"] = selection.gpu_count(pod)
    if wait:
        deletion.follow(core, entries, timeout, poll_interval)
    results = [deletion.public(e) for e in entries]
    for result in results:
        deletion.save(result)
    gone = [r["gone_s"] for r in results if r["gone"]]
    refused = [r for r in results if r["delete_status"] == "refused"]
    if refused and len(refused) == len(results):
        raise RuntimeError("every DELETE was refused: " + "; ".join(r["error"] for r in refused))
    return {
        "namespace": ns, "label_selector": label_selector, "name_pattern": name_pattern,
        "gpu_only": gpu_only, "grace_period": grace_period, "waited": wait,
        "pods": results, "all_gone": len(gone) == len(results),
        "max_gone_s": max(gone) if gone else None, "api": describe(core.api_client),
    }


@checked(name=POD_NAME, ns=NAMESPACE, timeout=POSITIVE_SECONDS, command=COMMAND)
def exec_in_pod(name: str, command: List[str], ns: str = "default",
                container: Optional[str] = None, timeout: float = 60.0,
                expect_exit_code: Optional[int] = 0,
                configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Run `command` (a list of strings, no shell unless you name one) in pod `ns/name`
    (container optional) through the exec API with chaosgpu's client, waiting at most `timeout`
    seconds; returns exit_code, stdout, stderr and duration_s. Fails when the exit code is not
    expect_exit_code (None accepts any). E.g. start a worker in the background:
    ["sh", "-c", "nohup python3 /w.py >/dev/null 2>&1 & exit 0"]."""
    selection.check_namespace(ns)
    selection.check_pod_name(name)
    selection.note_action()
    core = core_api(secrets)
    result = k8s_exec.run_in_pod(core, name, ns, command, container=container, timeout=timeout)
    result = {"pod": f"{ns}/{name}", "container": container, **result}
    if expect_exit_code is not None and result["exit_code"] != expect_exit_code:
        raise RuntimeError(f"{command[0]!r} in pod {ns}/{name} exited {result['exit_code']}, "
                           f"expected {expect_exit_code}; stderr: {result['stderr'][-1000:]}")
    return result


def _rank_action(signal: str, name: str, ns: str, rank: int, job: str | None,
                 container: str | None, timeout: float, allow_other_users: bool,
                 python: str, secrets: dict[str, Any] | None) -> dict[str, Any]:
    selection.check_namespace(ns)
    selection.check_pod_name(name)
    selection.note_action()
    core = core_api(secrets)
    result = inpod.signal_rank(core, name, ns, rank, signal, job=job, container=container,
                               timeout=timeout, allow_other_users=allow_other_users,
                               python=python)
    logger.info("chaosgpu: %s to rank %s (pid %s in pod %s/%s): %s", signal, rank,
                result["pid"], ns, name, result["result"])
    return result


@checked(name=POD_NAME, ns=NAMESPACE, rank=INDEX, timeout=POSITIVE_SECONDS, signal=SIGNAL_NAME,
         allow_other_users=BOOL)
def kill_rank_in_pod(name: str, ns: str = "default", rank: int = 0, job: Optional[str] = None,
                     container: Optional[str] = None, signal: str = "SIGKILL",
                     timeout: float = 60.0, allow_other_users: bool = False,
                     python: str = "python3", configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Kill one rank of the distributed-training job running in pod `ns/name` (container
    optional): the in-pod census finds the rank from the processes' environment, then
    signal_processes sends `signal` (SIGKILL by default: a crash; SIGTERM: a polite stop) through
    a pidfd after checking the process's start time — both streamed in through the exec API, so
    nothing is installed in the pod. Returns the rank's pid inside the pod and the outcome."""
    return _rank_action(signal, name, ns, rank, job, container, timeout, allow_other_users,
                        python, secrets)


@checked(name=POD_NAME, ns=NAMESPACE, rank=INDEX, timeout=POSITIVE_SECONDS, allow_other_users=BOOL)
def freeze_rank_in_pod(name: str, ns: str = "default", rank: int = 0,
                       job: Optional[str] = None, container: Optional[str] = None,
                       timeout: float = 60.0, allow_other_users: bool = False,
                       python: str = "python3", configuration: Optional[Dict[str, Any]] = None,
                       secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Freeze one rank of the job in pod `ns/name` with SIGSTOP (a frozen peer: the survivors
    hang in their collective until their process-group timeout), found and signalled from inside
    the pod like kill_rank_in_pod, and watched there until it is stopped (at most 5 s: a rank
    a tracer holds, or stuck in an uninterruptible call, fails the activity with the reason).
    Pair it with thaw_rank_in_pod in the rollbacks."""
    return _rank_action("SIGSTOP", name, ns, rank, job, container, timeout, allow_other_users,
                        python, secrets)


@checked(name=POD_NAME, ns=NAMESPACE, rank=INDEX, timeout=POSITIVE_SECONDS, allow_other_users=BOOL)
def thaw_rank_in_pod(name: str, ns: str = "default", rank: int = 0,
                     job: Optional[str] = None, container: Optional[str] = None,
                     timeout: float = 60.0, allow_other_users: bool = False,
                     python: str = "python3", configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Rollback of freeze_rank_in_pod: SIGCONT to the rank in pod `ns/name`. Safe to run twice
    or when there is nothing to thaw: a pod that is gone, or a rank no longer present, is
    reported as skipped rather than failing the rollback."""
    selection.check_namespace(ns)
    selection.check_pod_name(name)
    core = core_api(secrets)
    try:
        core.read_namespaced_pod(name, ns)
    except ApiException as error:
        if error.status == 404:
            return {"pod": f"{ns}/{name}", "rank": rank, "skipped": "pod gone"}
        raise
    try:
        return _rank_action("SIGCONT", name, ns, rank, job, container, timeout,
                            allow_other_users, python, secrets)
    except Exception as error:
        if "has no process" in str(error) or "no distributed-training job" in str(error):
            return {"pod": f"{ns}/{name}", "rank": rank, "skipped": str(error)}
        raise
