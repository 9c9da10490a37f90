"""Pod deletion with a measured end: send the DELETE, then follow each pod until it is gone.

This module owns the deletion record: per pod, when the DELETE was sent (with which grace
period), when the API server's `deletionTimestamp` was first seen, when every container was
reported terminated (with exit codes and reasons), and when the pod was gone (404, or the same
name now carrying another uid). Records are kept under the state directory (`k8s_deletions`) so
that a later probe of the same run can finish the wait or read the timings: each names the runner
that wrote it (`runner`: pid and start time), only this runner's records are this run's, and the
records of runners that are gone are removed when a new one is saved. Following is by polling with a
deadline; it must never wait without one, and it selects nothing itself (see selection.py).
"""

import functools
import logging
import os
import time
from typing import Any

import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from chaosgpu import state
from chaosgpu.node import process_starttime
from chaosgpu.progress import Progress

__all__ = ["send_delete", "follow", "record_name", "save", "load", "public", "runner",
           "this_run"]

logger = logging.getLogger("chaostoolkit")
RECORD_KIND = "k8s_deletions"
DEFAULT_GRACE = 30  # the Kubernetes default terminationGracePeriodSeconds


def record_name(ns: str, name: str) -> str:
    """Return the state-record name of the deletion of pod ns/name."""
    return f"{ns}__{name}"


def runner() -> dict[str, Any]:
    """This runner, as a deletion record names the run that wrote it: {pid, starttime}."""
    return {"pid": os.getpid(), "starttime": process_starttime(os.getpid())}


def this_run(record: dict[str, Any]) -> bool:
    """Whether `record` was written by this runner (this run), not by an earlier run."""
    return record.get("runner") == runner()


def _runner_gone(record: dict[str, Any]) -> bool:
    owner = record.get("runner")
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return True  # written before records named their runner: no run can claim it
    return process_starttime(owner["pid"]) != owner.get("starttime")


def save(entry: dict[str, Any]) -> None:
    """Keep a deletion entry on disk for later probes of this run (naming this runner), and
    remove the records of runners that are gone (no later run reads them)."""
    for name, record in state.list_records(RECORD_KIND).items():
        if _runner_gone(record):
            state.remove_record(RECORD_KIND, name)
    state.write_record(RECORD_KIND, record_name(entry["namespace"], entry["name"]),
                       {**entry, "runner": runner()})


def load(ns: str, name: str) -> dict[str, Any] | None:
    """Return the last deletion entry kept for pod ns/name, or None."""
    return state.read_record(RECORD_KIND, record_name(ns, name))


def send_delete(core: client.CoreV1Api, pod: dict[str, Any], grace_period: int,
                ns: str) -> dict[str, Any]:
    """DELETE one pod with `grace_period` (-1: the pod's own) in the body; return its entry."""
    metadata = pod["metadata"]
    spec = pod.get("spec") or {}
    own = spec.get("terminationGracePeriodSeconds")
    if grace_period >= 0:
        grace, source = grace_period, "given"
    else:
        grace, source = (own if isinstance(own, int) else DEFAULT_GRACE), "pod"
    entry: dict[str, Any] = {
        "namespace": metadata.get("namespace") or ns,
        "name": metadata["name"], "uid": metadata.get("uid"), "node": spec.get("nodeName"),
        "labels": dict(metadata.get("labels") or {}),
        "grace_period_seconds": grace, "grace_period_source": source,
        "delete_sent_at": None, "delete_status": None, "deletion_timestamp": None,
        "deletion_timestamp_seen_s": None, "containers_terminated_s": None, "containers": [],
        "containers_seen": None,
        "gone": False, "gone_s": None, "timed_out": False, "error": None,
    }
    ns = entry["namespace"]
    body = client.V1DeleteOptions(grace_period_seconds=grace)
    if entry["uid"]:
        body.preconditions = client.V1Preconditions(uid=entry["uid"])
    entry["delete_sent_at"] = time.time()
    entry["_t0"] = time.monotonic()
    try:
        core.delete_namespaced_pod(metadata["name"], ns, body=body)
        entry["delete_status"] = "sent"
    except ApiException as error:
        if error.status == 404:
            entry["delete_status"] = "already gone"
            entry["gone"], entry["gone_s"] = True, 0.0
        else:
            entry["delete_status"] = "refused"
            entry["error"] = f"DELETE refused by the API server: {error.status} {error.reason}"
    logger.info("chaosgpu: DELETE pod %s/%s grace=%ss (%s): %s", ns, metadata["name"], grace,
                source, entry["delete_status"])
    return entry


def _observe(entry: dict[str, Any], pod: dict[str, Any], now: float) -> None:
    elapsed = round(now - entry["_t0"], 4)
    metadata = pod.get("metadata") or {}
    if metadata.get("deletionTimestamp") and entry["deletion_timestamp_seen_s"] is None:
        entry["deletion_timestamp"] = metadata["deletionTimestamp"]
        entry["deletion_timestamp_seen_s"] = elapsed
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if statuses and entry["containers_terminated_s"] is None:
        terminated: list[tuple[dict[str, Any], dict[str, Any]]] = [
            (s, (s.get("state") or {}).get("terminated") or {}) for s in statuses]
        if all(t for _, t in terminated):
            entry["containers_terminated_s"] = elapsed
            entry["containers"] = [
                {"name": s.get("name"), "exit_code": t.get("exitCode"), "reason": t.get("reason"),
                 "signal": t.get("signal")} for s, t in terminated]


#: how long the replay of a gone pod's last events may take (seconds)
REPLAY_S = 3


def _replay_end(core: client.CoreV1Api, entry: dict[str, Any], gone_at: float) -> None:
    """The pod went from running to gone between two polls: its end (containers terminated,
    exit codes) is asked of the API server's event history, a watch from the pod's last
    polled resourceVersion up to its DELETED event (whose object is its final state). Times
    found this way are bounded by the poll that found it gone (`gone_at`), and the entry's
    `containers_seen` says so; with no history (too old, watch refused) it says what was not
    seen instead of claiming anything."""
    stream = watch.Watch()
    try:
        for event in stream.stream(
                core.list_namespaced_pod, entry["namespace"],
                field_selector=f"metadata.name={entry['name']}",
                resource_version=entry["_rv"], timeout_seconds=REPLAY_S,
                _request_timeout=REPLAY_S + 2):
            raw = event.get("raw_object") or {}
            if event.get("type") == "ERROR":
                break
            if (raw.get("metadata") or {}).get("uid") not in (None, entry["uid"]):
                continue
            _observe(entry, raw, gone_at)
            if event.get("type") == "DELETED":
                break
    except (ApiException, OSError, ValueError, urllib3.exceptions.HTTPError) as error:
        logger.debug("chaosgpu: replaying the end of pod %s/%s failed: %s", entry["namespace"],
                     entry["name"], error)
    finally:
        stream.stop()
    entry["containers_seen"] = (
        "after the pod was gone, in the API server's event history (times are the poll that "
        "found it gone)" if entry["containers_terminated_s"] is not None else
        "never: the pod was gone at the next poll and the API server's event history no "
        "longer held its end")


def _found_gone(core: client.CoreV1Api, entry: dict[str, Any]) -> None:
    """The poll found the pod gone (404): mark it, and where its containers were not seen to
    end, replay its end from the API server (or say it was never seen)."""
    gone_at = time.monotonic()
    entry["gone"], entry["gone_s"] = True, round(gone_at - entry["_t0"], 4)
    if entry["containers_terminated_s"] is not None:
        return
    if entry.get("_rv"):
        _replay_end(core, entry, gone_at)
    else:
        entry["containers_seen"] = ("never: the pod was gone before its containers were seen "
                                    "running or ending")


def _still_there(pending: list[dict[str, Any]]) -> str:
    return "still there: " + ", ".join(
        f"{e['namespace']}/{e['name']} (grace {e['grace_period_seconds']} s"
        f"{', containers ended' if e['containers_terminated_s'] is not None else ''})"
        for e in pending)


def follow(core: client.CoreV1Api, entries: list[dict[str, Any]], timeout: float,
           poll_interval: float = 0.2) -> list[dict[str, Any]]:
    """Poll each pending pod until it is gone or `timeout` seconds pass; fill in the entries."""
    deadline = time.monotonic() + timeout
    for entry in entries:
        entry.setdefault("_t0", time.monotonic())
    waiting = Progress(f"{len(entries)} deleted pod(s) to be gone", timeout)
    while True:
        pending = [e for e in entries if not e["gone"] and e["delete_status"] != "refused"]
        if not pending:
            break
        waiting.update(functools.partial(_still_there, pending))
        for entry in pending:
            try:
                raw = core.read_namespaced_pod(entry["name"], entry["namespace"],
                                               _request_timeout=max(1.0, poll_interval * 5))
                pod = core.api_client.sanitize_for_serialization(raw)
            except ApiException as error:
                if error.status == 404:
                    _found_gone(core, entry)
                    continue
                entry["error"] = f"reading the pod failed: {error.status} {error.reason}"
                continue
            now = time.monotonic()
            pod = pod if isinstance(pod, dict) else {}
            if entry["uid"] and (pod.get("metadata") or {}).get("uid") not in (None, entry["uid"]):
                entry["gone"], entry["gone_s"] = True, round(now - entry["_t0"], 4)
                entry["replaced_by_uid"] = pod["metadata"]["uid"]
                continue
            _observe(entry, pod, now)
            if entry["containers_terminated_s"] is not None:
                entry["containers_seen"] = entry["containers_seen"] or "polled"
            elif (pod.get("status") or {}).get("containerStatuses"):  # containers to see end
                entry["_rv"] = (pod.get("metadata") or {}).get("resourceVersion")
        if all(e["gone"] or e["delete_status"] == "refused" for e in entries):
            break
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for entry in entries:
                if not entry["gone"] and entry["delete_status"] != "refused":
                    entry["timed_out"] = True
            break
        time.sleep(min(poll_interval, remaining))
    return entries


def public(entry: dict[str, Any]) -> dict[str, Any]:
    """Return the entry without its process-local fields (monotonic clock origin)."""
    return {k: v for k, v in entry.items() if not k.startswith("_")}
