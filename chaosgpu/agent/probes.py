"""Chaos Toolkit probes that ask a node agent (`chaosgpu agent`) over HTTP with `requests`.

They give the node-side view of a Kubernetes experiment: the census, a pod's GPU memory now,
when a pod's GPU memory was released after a deletion, and the GiB x s it held, all from the
agent's high-rate timeline at the node (not from a 30-second exporter). This module owns the
client side only; it must not read the node itself.

Where things come from: `url` (else configuration `chaosgpu_agent_url`); the token from the
secrets (`agent_token`, e.g. `{"chaosgpu": {"agent_token": {"type": "env", "key":
"CHAOSGPU_AGENT_TOKEN"}}}` and `"secrets": ["chaosgpu"]` on the probe), never from arguments
(journals copy arguments). A pod is named by `pod_uid`, or by `pod="ns/name"`, whose uid and
DELETE time come from the deletion record `chaosgpu.k8s` keeps. Every call has a deadline.
Units: MiB, seconds, GiB x s (GiB = 1024 MiB).
"""

import bisect
import logging
import math
import time
from typing import Any, Dict, Optional

import requests

from chaosgpu.arguments import BOOL, INDEX, MIB, POSITIVE_SECONDS, TEXT, UNIX_TIME, checked
from chaosgpu.progress import Progress
from chaosgpu.timeline.integral import gib_seconds

__all__ = ["agent_snapshot", "pod_gpu_memory", "pod_release_time", "pod_gb_seconds"]

logger = logging.getLogger("chaostoolkit")


def _url(url: str | None, configuration: dict[str, Any] | None) -> str:
    url = url or str((configuration or {}).get("chaosgpu_agent_url") or "")
    if not url.startswith(("http://", "https://")):
        raise ValueError("the agent's url is required (argument `url` or configuration "
                         f"`chaosgpu_agent_url`, http://HOST:PORT), got {url!r}")
    return url.rstrip("/")


def _token(secrets: dict[str, Any] | None) -> str:
    secrets = secrets or {}
    token = secrets.get("agent_token") or secrets.get("chaosgpu_agent_token")
    if not token and isinstance(secrets.get("chaosgpu"), dict):
        token = secrets["chaosgpu"].get("agent_token")
    if not token:
        raise ValueError("no agent token in the secrets: declare `agent_token` in a secrets "
                         "scope (e.g. from the env var CHAOSGPU_AGENT_TOKEN) and list the scope "
                         "in the probe's `secrets`")
    return str(token)


def _get(url: str, path: str, params: dict[str, Any], timeout_s: float,
         secrets: dict[str, Any] | None) -> Any:
    if not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    headers = {"Authorization": f"Bearer {_token(secrets)}"}
    response = requests.get(f"{url}{path}", params={k: v for k, v in params.items()
                                                      if v is not None},
                            headers=headers, timeout=(min(timeout_s, 5.0), timeout_s))
    if response.status_code != 200:
        try:
            message = response.json().get("error")
        except ValueError:
            message = response.text[:200]
        raise RuntimeError(f"agent {url}{path} answered {response.status_code}: {message}")
    return response.json()


def _pod(pod_uid: str | None, pod: str | None, since: float | None) -> tuple[str, float | None]:
    """(pod uid, DELETE time) from the arguments or chaosgpu.k8s's deletion record."""
    if pod_uid:
        return pod_uid, since
    if not pod or "/" not in pod:
        raise ValueError("name the pod by `pod_uid` or `pod` as 'namespace/name'")
    from chaosgpu.k8s.deletion import load

    ns, name = pod.split("/", 1)
    record = load(ns, name)
    if not record or not record.get("uid"):
        raise ValueError(f"no deletion record for pod {pod}: pass pod_uid and since")
    return str(record["uid"]), since if since is not None else record.get("delete_sent_at")


@checked(gpu=INDEX, timeout_s=POSITIVE_SECONDS, processes=BOOL)
def agent_snapshot(url: Optional[str] = None, gpu: Optional[int] = None, processes: bool = True,
                   timeout_s: float = 5.0, configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Return the node agent's census (`chaosgpu.census/1`): GPUs with their memory, GPU
    processes attributed to pods and containers, zombies, orphans and jobs; `gpu` limits it to
    one device, `processes=False` leaves the process list out."""
    params = {"gpu": gpu, "processes": None if processes else 0}
    result: dict[str, Any] = _get(_url(url, configuration), "/v1/snapshot", params, timeout_s,
                                  secrets)
    return result


@checked(pod_uid=TEXT, timeout_s=POSITIVE_SECONDS)
def pod_gpu_memory(pod_uid: str, url: Optional[str] = None, timeout_s: float = 5.0,
                   configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> float:
    """Return the GPU memory in MiB that the processes of pod `pod_uid` hold now on the agent's
    node (0.0 when it has none there)."""
    if not pod_uid:
        raise ValueError("pod_uid is required")
    census = agent_snapshot(url, processes=False, timeout_s=timeout_s,
                            configuration=configuration, secrets=secrets)
    total = 0.0
    for entry in census.get("gpu_processes") or []:
        if (entry.get("container") or {}).get("pod_uid") == pod_uid:
            total += float(entry.get("used_mib") or 0.0)
    return round(total, 3)


def _pod_series(window: dict[str, Any]) -> tuple[list[float], list[float], float]:
    """The pod's summed MiB over the union of its processes' samples (unix times), each
    process counting 0 from one process-listing interval after its last sample; and that
    interval."""
    t0 = float(window["t0"])
    interval = float(window.get("process_every") or 1) / float(
        window.get("rate_hz") or window.get("rate_hz_requested") or 100.0)
    series = list(window["processes"].values())
    times = sorted({t for s in series for t in s["t"]} |
                   {s["t"][-1] + interval for s in series if s["t"]})
    totals = []
    for t in times:
        value = 0.0
        for s in series:
            if s["t"] and s["t"][0] <= t <= s["t"][-1]:
                value += s["mib"][bisect.bisect_right(s["t"], t) - 1]
        totals.append(value)
    return [t + t0 for t in times], totals, interval


def _release(window: dict[str, Any], since: float, threshold_mib: float) -> float | None:
    times, totals, interval = _pod_series(window)
    if not times:
        return None
    held = max(totals)
    after = [(t, v) for t, v in zip(times, totals, strict=True) if t >= since]
    last_held = max((t for t, v in after if v > threshold_mib), default=None)
    if last_held is None:
        return since if held > 0 else None  # released already at `since`
    # The pod's processes must have been seen gone (a listing after their last sample).
    end = float(window["t0"]) + (window["t"][-1] if window["t"] else 0.0)
    if end < last_held + interval:
        return None
    # Refine with the fast total series: first sample after the last listing that held memory
    # where the total fell by the pod's share (within the threshold).
    t0 = float(window["t0"])
    before = [v for t, v in zip(window["t"], window["total_mib"], strict=True)
              if t0 + t <= last_held]
    if before and held > threshold_mib:
        level = before[-1] - held + threshold_mib
        for t, v in zip(window["t"], window["total_mib"], strict=True):
            if t0 + t > last_held and v <= level:
                return t0 + t
    return last_held + interval


@checked(since=UNIX_TIME, threshold_mib=MIB, timeout_s=POSITIVE_SECONDS, poll_s=POSITIVE_SECONDS)
def pod_release_time(url: Optional[str] = None, pod_uid: Optional[str] = None,
                     pod: Optional[str] = None,
                     since: Optional[float] = None, threshold_mib: float = 64.0,
                     timeout_s: float = 60.0, poll_s: float = 0.25,
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Optional[float]:
    """Seconds from `since` (unix time; by default the DELETE sent for `pod`) until the pod's
    GPU memory was released on the agent's node: its GPU processes gone and the node's total
    down by what they held (within `threshold_mib`), from the agent's timeline. Polls the agent
    until then or `timeout_s`; returns None (and logs why) when it did not happen in time."""
    pod_uid, since = _pod(pod_uid, pod, since)
    if since is None or not isinstance(since, int | float) or math.isnan(since):
        raise ValueError("since (unix time) is required when the pod has no deletion record")
    if poll_s <= 0 or threshold_mib < 0:
        raise ValueError("poll_s must be > 0 and threshold_mib >= 0")
    base = _url(url, configuration)
    deadline = time.monotonic() + timeout_s
    waiting = Progress(f"the GPU memory of pod {pod_uid} to be released (agent {base})",
                       timeout_s)
    while True:
        remaining = max(0.5, deadline - time.monotonic())
        window = _get(base, "/v1/timeline", {"since": since - 2.0, "until": time.time(),
                                             "pod_uid": pod_uid}, min(remaining, 10.0), secrets)
        if window.get("truncated") and window.get("retained_since") and \
                window["retained_since"] > since:
            raise RuntimeError("the agent no longer holds the timeline from `since` "
                               f"(retained since {window['retained_since']}): raise its "
                               "--retention-s or measure sooner")
        released = _release(window, float(since), threshold_mib)
        if released is not None:
            return round(released - float(since), 4)
        if not window["processes"] and time.monotonic() >= deadline:
            logger.warning("chaosgpu agent: no GPU process of pod %s seen by the agent", pod_uid)
            return None
        if time.monotonic() >= deadline:
            logger.warning("chaosgpu agent: pod %s memory not released %.1fs after %s",
                           pod_uid, timeout_s, since)
            return None
        waiting.update(f"{len(window['processes'])} GPU process(es) of the pod on the agent's "
                       "timeline, not released yet")
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


@checked(since=UNIX_TIME, until=UNIX_TIME, timeout_s=POSITIVE_SECONDS)
def pod_gb_seconds(url: Optional[str] = None, pod_uid: Optional[str] = None,
                   pod: Optional[str] = None,
                   since: Optional[float] = None, until: Optional[float] = None,
                   timeout_s: float = 10.0, configuration: Optional[Dict[str, Any]] = None,
                   secrets: Optional[Dict[str, Any]] = None) -> float:
    """GiB x seconds of GPU memory held by the processes of a pod between `since` (unix time;
    by default the DELETE sent for `pod`) and `until` (default now), from the agent's timeline:
    the field report's "GB x s wasted" during a grace period (chaosgpu.timeline.integral)."""
    pod_uid, since = _pod(pod_uid, pod, since)
    if since is None:
        raise ValueError("since (unix time) is required when the pod has no deletion record")
    until = time.time() if until is None else until
    if until < since:
        raise ValueError(f"until ({until}) is before since ({since})")
    window = _get(_url(url, configuration), "/v1/timeline",
                  {"since": since - 2.0, "until": until, "pod_uid": pod_uid}, timeout_s, secrets)
    times, totals, _ = _pod_series(window)
    return round(gib_seconds(times, totals, since, until), 4)
