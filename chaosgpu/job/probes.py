"""Chaos Toolkit probes on distributed-training jobs: the observed verdict (running, hung,
failed, restarting, finished, unknown) with its evidence, a steady-state check, hang
detection, waiting for survivors to end by themselves, and the ranks' states.

Every verdict is observed over time by chaosgpu.job.observe and decided by chaosgpu.job.verdict
(progress seen, or not, over a window; exits; where each rank waits), never inferred from the
fault chaosgpu injected. A probe whose job or tag matches nothing fails (raises) unless the
experiment sets `missing_ok`: true (always), or "before-method" (the catalog's form: before
the method starts the job, and afterwards only for a job this run has seen, which then ended; a
selection that never matched fails after the method). This module owns these probes' public
face; it signals nothing. Each function has its own deadline.
"""

from typing import Any, Dict, List, Optional, Union

from chaosgpu.arguments import BOOL, MISSING_OK, NAME, POSITIVE_SECONDS, SECONDS, TAG, Rule, checked
from chaosgpu.job import observe as _observe
from chaosgpu.job.verdict import DEFAULT_WINDOW_S, VERDICTS, rank_key

__all__ = ["job_state", "job_hung", "job_running", "detect_hang", "wait_survivors_exit",
           "wait_job_verdict", "job_ranks"]

SETTLED = ("hung", "failed", "finished")
#: wait_job_verdict's `verdicts`: verdict names (chaosgpu.job.verdict.VERDICTS), at least one
VERDICT_LIST = Rule(f"a non-empty list of {', '.join(map(repr, VERDICTS))}",
                    lambda value: isinstance(value, list) and bool(value)
                    and all(isinstance(v, str) and v in VERDICTS for v in value))


def _mark(verdict: dict[str, Any]) -> None:
    from chaosgpu.timeline.sampler import current

    sampler = current()
    if sampler is not None and verdict.get("verdict"):
        sampler.mark(f"verdict:{verdict['verdict']}", "point", job=verdict.get("id"),
                     since=verdict.get("since"), confirmed_at=verdict.get("confirmed_at"),
                     blocked_in=verdict.get("blocked_in"),
                     culprit_ranks=[c.get("rank") for c in verdict.get("culprit_ranks") or []])


def _watch(job: str | None, tag: str | None, missing_ok: Any, **kwargs: Any
           ) -> "_observe.Observer":
    """observe() with missing_ok checked first (a bad value changes nothing) and a short wait
    for a job that is allowed to be missing."""
    lenient = _observe.missing_allowed(missing_ok, job, tag)
    return _observe.observe(job, tag, missing_ok=True, appear_s=1.0 if lenient else 5.0,
                            **kwargs)


def _one(observer: "_observe.Observer", job: str | None, tag: str | None,
         missing_ok: Any) -> dict[str, Any]:
    tracks = list(observer.tracks.values())
    if not tracks:
        if _observe.missing_allowed(missing_ok, job, tag):
            why = ("it ended (seen earlier in this run)" if _observe.seen(job, tag)
                   else f"none is running (missing_ok={missing_ok!r})")
            return {"id": job, "tag": tag, "verdict": None, "found": False, "hung": False,
                    "reason": f"no such job: {why}", "visibility": observer.visibility}
        raise _observe.JobError(_observe.not_found_message(job, tag, observer))
    if len(tracks) > 1:
        raise _observe.JobError(f"{'job ' + repr(job) if job else 'tag ' + repr(tag)} matches "
                                f"several jobs {[t.id for t in tracks]}: name one with job=<id>")
    result = tracks[0].to_json()
    result["found"] = True
    result["visibility"] = observer.visibility
    result["hung"] = result["verdict"] == "hung"
    _mark(result)
    return result


def _settled_or_progressing(started: float) -> Any:
    def until(observer: "_observe.Observer") -> bool:
        for track in observer.tracks.values():
            if track.verdict in SETTLED:
                continue
            if track.verdict == "running" and any(
                    (r.last_progress or 0) > started + 0.05 for r in track.current_ranks()):
                continue
            return False
        return bool(observer.tracks)
    return until


@checked(window_s=POSITIVE_SECONDS, job=NAME, tag=TAG, missing_ok=MISSING_OK)
def job_state(job: Optional[str] = None, tag: Optional[str] = None,
              window_s: float = DEFAULT_WINDOW_S, missing_ok: Union[bool, str] = False,
              configuration: Optional[Dict[str, Any]] = None,
              secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Observe a training job (by id or its ranks' tag) and return its verdict: "running"
    (progress seen), "hung" (live ranks waiting in a collective, barrier or rendezvous with no
    progress for `window_s`), "failed", "restarting", "finished" or "unknown", with the
    evidence: every rank's state, where it waits, exits and errors, the culprit ranks, the
    blocked collective, and since when. Returns as soon as progress is seen or a hang, a
    failure or the end is confirmed, at most about window_s + 2 s. Fails when nothing matches,
    unless missing_ok."""
    window = float(window_s)
    import time

    started = time.time()
    observer = _watch(job, tag, missing_ok, until=_settled_or_progressing(started),
                                timeout_s=window + 2.0, window_s=window)
    return _one(observer, job, tag, missing_ok)


@checked(window_s=POSITIVE_SECONDS, job=NAME, tag=TAG, missing_ok=MISSING_OK)
def job_hung(job: Optional[str] = None, tag: Optional[str] = None,
             window_s: float = DEFAULT_WINDOW_S, missing_ok: Union[bool, str] = False,
             configuration: Optional[Dict[str, Any]] = None,
             secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when the job (by id or tag) is observed hung: live ranks waiting in a collective,
    barrier or rendezvous with no progress for `window_s` (see job_state). The steady state
    "no hung training job" uses tolerance false. Fails (so the steady state is not met) when
    nothing matches, unless missing_ok (then false)."""
    state = job_state(job=job, tag=tag, window_s=window_s, missing_ok=missing_ok)
    return bool(state.get("verdict") == "hung")


@checked(timeout_s=SECONDS, window_s=POSITIVE_SECONDS, job=NAME, tag=TAG)
def job_running(job: Optional[str] = None, tag: Optional[str] = None, timeout_s: float = 30.0,
                window_s: float = DEFAULT_WINDOW_S,
                configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> bool:
    """True when the job (by id or tag) is observed running, some rank making progress, within
    `timeout_s` (a job coming back from a fault may take a while); false when it is hung,
    failed, finished, restarting or unknown at the deadline. The steady state "the job is
    running" of a game-day on a job you run uses tolerance true. Fails (the steady state is
    not met) when nothing matches: a typo'd id or tag never passes. A job seen failed or
    finished is watched until the deadline too: a supervisor that starts the same job again
    (the same run id under a new launcher) brings it back under its id."""
    state = wait_job_verdict(verdicts=["running"], job=job, tag=tag, timeout_s=timeout_s,
                             window_s=window_s)
    return bool(state.get("reached"))


@checked(timeout_s=SECONDS, window_s=POSITIVE_SECONDS, job=NAME, tag=TAG, missing_ok=MISSING_OK,
          expect_hang=BOOL)
def detect_hang(job: Optional[str] = None, tag: Optional[str] = None, timeout_s: float = 30.0,
                window_s: float = DEFAULT_WINDOW_S, missing_ok: Union[bool, str] = False,
                expect_hang: bool = False,
                configuration: Optional[Dict[str, Any]] = None,
                secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Watch a training job (by id or tag) for up to `timeout_s` until a hang is confirmed (no
    progress for `window_s` while live ranks wait in a collective, barrier or rendezvous) or
    the job fails or finishes. Returns the verdict with its evidence: the blocked ranks and
    the collective they wait in (every thread's Python stack: with DDP the main thread sits in
    backward()), since when, the culprit ranks (ended, stopped, frozen, partitioned, missing,
    or alive elsewhere with their stack), how long after the fault and after the last progress
    the hang was confirmed. "hung" is false when the job failed (gloo survivors of a killed
    peer error out: that is "failed"), finished, or stayed healthy. With `expect_hang` true (a
    game-day that needs the hang to go on: freeze, observe, resume), a verdict other than
    "hung" fails the activity, naming the verdict and its reason, instead of returning."""
    timeout = float(timeout_s)
    window = float(window_s)

    def until(observer: "_observe.Observer") -> bool:
        return bool(observer.tracks) and all(t.verdict in SETTLED
                                             for t in observer.tracks.values())

    observer = _watch(job, tag, missing_ok, until=until, timeout_s=timeout, window_s=window)
    result = _one(observer, job, tag, missing_ok)
    if result.get("found") and result["verdict"] not in SETTLED:
        result["note"] = (f"no hang confirmed within {timeout:g} s: the job is "
                          f"{result['verdict']} ({result['reason']})")
    if expect_hang and result.get("verdict") != "hung":
        raise _observe.JobError(
            "expect_hang: no hang was confirmed: "
            + (result.get("note") or f"the job is {result.get('verdict')} "
               f"({result.get('reason')})"))
    return result


@checked(timeout_s=SECONDS, job=NAME, tag=TAG, missing_ok=MISSING_OK)
def wait_survivors_exit(job: Optional[str] = None, tag: Optional[str] = None,
                        timeout_s: float = 60.0, missing_ok: Union[bool, str] = False,
                        configuration: Optional[Dict[str, Any]] = None,
                        secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Wait up to `timeout_s` for the surviving ranks of a job (by id or tag: those running
    when the wait begins, not the stopped or frozen ones) to end by themselves, as they should
    when a process-group timeout and async error handling are set (the NCCL
    remediation). Returns "all_exited", each rank's exit (code or signal, when, the error text
    where readable), the ranks still alive, the observed verdict ("failed" is the remedy
    working: the survivors aborted instead of hanging) and, with NVML, the survivors still
    holding GPU memory. Fails when nothing matches, unless missing_ok."""
    timeout = float(timeout_s)
    survivors: set[tuple[int, int]] = set()

    def until(observer: "_observe.Observer") -> bool:
        if not survivors:  # the ranks running (not stopped or frozen) when the wait began
            survivors.update((r.pid, r.starttime) for t in observer.tracks.values()
                             for r in t.current_ranks() if r.state == "alive")
        return bool(observer.tracks) and not any(
            r.live for t in observer.tracks.values() for r in t.ranks.values()
            if (r.pid, r.starttime) in survivors)

    observer = _watch(job, tag, missing_ok, until=until, timeout_s=timeout,
                      waiting_for="the survivors of {jobs} to end by themselves")
    result = _one(observer, job, tag, missing_ok)
    if not result.get("found"):
        result.update(all_exited=True, still_alive=[], exits={}, survivors=[])
        return result
    ranks = result["ranks"]
    # by number, the unnumbered last (a spawn job's ranks show no number: None)
    result["survivors"] = [r["rank"] for r in sorted(
        (r for r in ranks if (r["pid"], r["starttime"]) in survivors),
        key=lambda r: (r["rank"] is None, r["rank"] or 0, r["pid"]))]
    result["still_alive"] = [{"rank": r["rank"], "pid": r["pid"]} for r in ranks
                             if (r["pid"], r["starttime"]) in survivors
                             and r["state"] in ("alive", "stopped", "frozen")]
    result["all_exited"] = not result["still_alive"]
    result["exits"] = {rank_key(r["rank"], r["pid"]): {"exit": r["exit"], "at": r["exited_at"],
                                        "error": r["error"]} for r in ranks if r["exit"]}
    result["survivors_left"] = [r["rank"] for r in result["still_alive"]]
    gpu = _gpu_pids()
    if gpu is not None:
        result["still_on_gpu"] = sorted({r["pid"] for r in ranks} & gpu)
    return result


@checked(timeout_s=SECONDS, window_s=POSITIVE_SECONDS, job=NAME, tag=TAG, missing_ok=MISSING_OK,
         verdicts=VERDICT_LIST)
def wait_job_verdict(verdicts: List[str], job: Optional[str] = None,
                     tag: Optional[str] = None, timeout_s: float = 60.0,
                     window_s: float = DEFAULT_WINDOW_S, missing_ok: Union[bool, str] = False,
                     configuration: Optional[Dict[str, Any]] = None,
                     secrets: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Observe a job (by id or tag) until its verdict is one of `verdicts` (e.g. ["running"]
    after a restart, ["failed", "finished"]) or `timeout_s` passes; returns the verdict with
    its evidence and "reached": whether one of them was seen."""
    timeout = float(timeout_s)
    window = float(window_s)
    wanted = set(verdicts)

    def until(observer: "_observe.Observer") -> bool:
        return bool(observer.tracks) and all(t.verdict in wanted
                                             for t in observer.tracks.values())

    observer = _watch(job, tag, missing_ok, until=until, timeout_s=timeout, window_s=window)
    result = _one(observer, job, tag, missing_ok)
    result["reached"] = result.get("verdict") in wanted
    return result


@checked(job=NAME, tag=TAG, missing_ok=MISSING_OK)
def job_ranks(job: Optional[str] = None, tag: Optional[str] = None,
              missing_ok: Union[bool, str] = False,
              configuration: Optional[Dict[str, Any]] = None,
              secrets: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The ranks of a job (by id or tag) as one census reading sees them now: rank, PID, state
    (alive, stopped, frozen, zombie, missing), restart count and GPU MiB (no verdict: see
    job_state). Fails when nothing matches, unless missing_ok (then empty; "before-method":
    before the method, or a job this run saw, here or in another job probe, that ended)."""
    _observe.missing_allowed(missing_ok, job, tag)  # a bad value is refused first
    from chaosgpu.job import hang

    _observe.check_selector(job, tag)
    census = hang._census(gpu=True)
    matches = _observe.select_jobs(census, job, tag)
    if not matches:
        if _observe.missing_allowed(missing_ok, job, tag):
            return []
        note = _observe.visibility_note(census)
        what = f"job {job!r}" if job else f"a job tagged {tag!r}"
        raise _observe.JobError(f"{what} is not running on this node"
                                + (f"; {note}" if note else ""))
    for match in matches:
        _observe.remember(match.get("id"), match.get("tag"))
    return [dict(r) for m in matches for r in m.get("ranks") or []]


def _gpu_pids() -> set[int] | None:
    from chaosgpu.node import nvml_device_memory, nvml_gpu_processes

    if not nvml_device_memory():
        return None
    return {entry["pid"] for entry in nvml_gpu_processes()}
