"""Write the HAND-MADE fixture journals of this folder (handmade-*.json, bad/handmade-*).

They imitate what `chaos run` writes for chaosgpu experiments (the Chaos Toolkit journal shape
plus the `chaosgpu` section of docs/ARCHITECTURE.md), with figures shaped after the field report
(2466 MiB per worker, a 30 s grace period, 148 MiB of NCCL peer residue). They are NOT real runs:
replace them with journals of real catalog runs when those exist (the report tests take any
folder: CHAOSGPU_REPORT_JOURNALS=DIR pytest tests/test_report.py). The pod deletions and the
interrupted run are in the OLDER format (no typed events: the report rebuilds the fault from the
outputs); the NCCL pair carries the control's typed events (format 2).

    python tests/data/journals/make_handmade.py        # rewrites the files next to it
"""

import datetime
import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
T0 = 1796212800.0  # 2026-12-02T12:00:00Z
DEVICE_RATE = 100.0  # Hz
PROCESS_RATE = 20.0  # Hz
IDLE_MIB = 615.0  # an idle H200's driver reservation


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).replace(tzinfo=None).isoformat()


def frange(start: float, end: float, rate: float) -> list[float]:
    n = int(round((end - start) * rate))
    return [round(start + i / rate, 4) for i in range(n + 1)]


def worker_mib(t: float, start: float, held: float, gone: float) -> float | None:
    """A worker's MiB at t: ramps up for 0.3 s from start, holds, gone at `gone`."""
    if t < start or t >= gone:
        return None
    return round(held * min(1.0, (t - start) / 0.3), 1)


def timeline(workers, end, device_extra=None, events=(), rng=None, zombies=()):
    """workers: list of (pid, device, start, held_mib, gone, tag, rank); events: list of
    (t, name, phase, type) as the timeline control marks them; zombies: {pid: t it became Z}."""
    rng = rng or random.Random(7)
    zombies = dict(zombies)
    devices = sorted({w[1] for w in workers} | {0})
    ts = frange(0.0, end, DEVICE_RATE)
    dev = []
    for index in devices:
        used = []
        for t in ts:
            total = IDLE_MIB + sum(
                (worker_mib(t, w[2], w[3], w[4]) or 0.0) for w in workers if w[1] == index
            )
            if device_extra:
                total += device_extra(index, t)
            used.append(round(total + rng.uniform(-0.5, 0.5), 1))
        dev.append({"index": index, "t": ts, "used_mib": used})
    procs = {}
    for pid, _device, start, held, gone, tag, rank in workers:
        pts, mib = [], []
        for t in frange(0.0, end, PROCESS_RATE):
            value = worker_mib(t, start, held, gone)
            if value is not None:
                pts.append(t)
                mib.append(value)
        states = [[start, "S"]]
        if pid in zombies:
            states.append([zombies[pid], "Z"])
        if gone < end:
            states.append([round(gone + 0.05, 3), "gone"])
        procs[str(pid)] = {"t": pts, "mib": mib, "tag": tag, "rank": rank,
                           "comm": "python3", "states": states}
    total = [round(sum(d["used_mib"][i] for d in dev), 1) for i in range(len(ts))]
    return {
        "t0": T0,
        "rate_hz": DEVICE_RATE,
        "overhead_cpu_pct": 1.2,
        "source": "nvml",
        "unit": "MiB",
        "t": ts,
        "total_mib": total,
        "devices": dev,
        "processes": procs,
        "events": [{"t": t, "name": n, "phase": ph, "type": ty} for t, n, ph, ty in events],
        "baseline": {"source": "nvml", "total_mib": IDLE_MIB * len(devices),
                     "devices": [{"index": i, "used_mib": IDLE_MIB} for i in devices],
                     "taken_at": T0 + 0.1, "samples": 10},
    }


def marks(activities, end):
    """The control's marks: experiment/method/rollbacks and each activity's start and end.
    activities: (start, end, name, type, phase group 'method'|'rollbacks')."""
    out = [(0.0, "experiment", "start", None)]
    method = [a for a in activities if a[4] == "method"]
    rollbacks = [a for a in activities if a[4] == "rollbacks"]
    if method:
        out.append((method[0][0] - 0.01, "method", "start", None))
    for a in method:
        out += [(a[0], a[2], "start", a[3]), (a[1], a[2], "end", a[3])]
    if method:
        out.append((method[-1][1] + 0.01, "method", "end", None))
    if rollbacks:
        out.append((rollbacks[0][0] - 0.01, "rollbacks", "start", None))
    for a in rollbacks:
        out += [(a[0], a[2], "start", a[3]), (a[1], a[2], "end", a[3])]
    if rollbacks:
        out.append((rollbacks[-1][1] + 0.01, "rollbacks", "end", None))
    out.append((end, "experiment", "end", None))
    return sorted(out)


def activity(kind, name, func, module, arguments, output, start, end, status="succeeded"):
    entry = {
        "activity": {
            "type": kind,
            "name": name,
            "provider": {"type": "python", "module": module, "func": func,
                         "arguments": arguments},
        },
        "output": output,
        "start": iso(T0 + start),
        "end": iso(T0 + end),
        "duration": round(end - start, 3),
        "status": status,
    }
    if status == "failed":
        entry["exception"] = ["Traceback ...", "RuntimeError: interrupted"]
    return entry


def steady(met=True):
    return {
        "steady_state_met": met,
        "probes": [activity("probe", "no-residual-gpu-memory", "residual_gpu_memory",
                            "chaosgpu.gpu.probes", {}, {"residual_mib": 0.0}, 0.0, 0.01,
                            "succeeded")],
    }


def journal(title, tags, configuration, method, runs, section, status="completed",
            deviated=False, duration=40.0, rollbacks=()):
    return {
        "chaoslib-version": "1.44.0",
        "platform": "Linux-6.x-x86_64 (hand-made fixture)",
        "node": "handmade-fixture",
        "experiment": {
            "version": "1.0.0",
            "title": title,
            "description": "HAND-MADE FIXTURE imitating a chaosgpu run; not a real measurement.",
            "tags": tags,
            "configuration": configuration,
            "steady-state-hypothesis": {"title": "node is clean", "probes": []},
            "method": method,
            "rollbacks": [],
            "controls": [{"name": "chaosgpu-timeline",
                          "provider": {"type": "python", "module": "chaosgpu.timeline.control"}}],
        },
        "start": iso(T0),
        "end": iso(T0 + duration),
        "duration": duration,
        "status": status,
        "deviated": deviated,
        "steady_states": {"before": steady(True), "after": steady(not deviated), "during": []},
        "run": runs,
        "rollbacks": list(rollbacks),
        "chaosgpu": section,
    }


def method_action(name, func, module, arguments):
    return {"type": "action", "name": name,
            "provider": {"type": "python", "module": module, "func": func,
                         "arguments": arguments}}


def probe_figures(tl, fault_t, until_t):
    """What the timeline probes would record: release time (64 MiB above the baseline) and
    GiB x s above the baseline from the fault to `until_t` (chaosgpu.timeline.integral)."""
    from chaosgpu.timeline.integral import gib_seconds

    base = tl["baseline"]["total_mib"]
    t, total = tl["t"], tl["total_mib"]
    release = next((ti - fault_t for ti, v in zip(t, total, strict=True)
                    if ti >= fault_t and v <= base + 64), None)
    waste = gib_seconds(t, total, fault_t, until_t, above=base)
    return (None if release is None else round(release, 4)), round(waste, 4)


def section_of(tl, measurements):
    return {"timeline": tl, "timeline_file": None, "events": tl["events"],
            "measurements": measurements,
            "summary": {"source": "nvml", "samples": len(tl["t"]), "rate_hz": DEVICE_RATE,
                        "overhead_cpu_pct": tl["overhead_cpu_pct"]},
            "backend": {"gpu": {"available": True, "reason": None, "driver": "580.159",
                                "devices": ["NVIDIA H200"]}, "python": "3.12.3"},
            "gating": {"before_met": True}}


def pod_delete(n_workers, handler, name):
    """The report's step 3-B in a local pod (PID 1 sleep, workers exec'd and backgrounded)."""
    per = 2470.0 if n_workers > 1 else 2466.0
    fault_t = 3.0
    if handler:
        gone, kill_t = fault_t + 0.15, None
    else:
        kill_t = fault_t + 30.0
        gone = kill_t + 0.14
    end = gone + 2.0
    workers = [(41000 + i, 0, 0.5 + 0.02 * i, per, gone + 0.01 * i, f"{name}-w{i}", None)
               for i in range(n_workers)]
    terminate_end = round(gone + 0.01 * (n_workers - 1) + 0.06, 3)
    activities = [(0.3, 1.2, "start-workers", "action", "method"),
                  (1.5, 1.6, "orphans", "probe", "method"),
                  (fault_t, terminate_end, "terminate-pod", "action", "method"),
                  (terminate_end + 0.05, terminate_end + 0.4, "memory-release-time", "probe",
                   "method")]
    tl = timeline(workers, end, events=marks(activities, end), rng=random.Random(n_workers))
    terminate_out = {
        "name": name, "grace_period_s": 30, "sigterm_sent": T0 + fault_t,
        "namespace_empty_or_grace_end": T0 + (kill_t or gone),
        "sigkill_sent": T0 + kill_t if kill_t else None, "gone": T0 + terminate_end,
        "exited_on_sigterm": bool(handler),
        "namespace_empty_or_grace_end_s": round((kill_t or gone) - fault_t, 6),
        "sigkill_sent_s": 30.0 if kill_t else None,
        "gone_after_sigkill_s": round(terminate_end - kill_t, 6) if kill_t else None}
    release, waste = probe_figures(tl, fault_t, terminate_end)
    orphans_out = [{"pid": w[0] - 40000, "host_pid": w[0], "comm": "python3"} for w in workers]
    runs = [
        activity("action", "start-workers", "exec_in_sandbox", "chaosgpu.sandbox.actions",
                 {"name": name, "detach": True, "count": n_workers, "mib": per,
                  "sigterm": "cleanup" if handler else "ignore"},
                 {"pids": [w[0] for w in workers]}, 0.3, 1.2),
        activity("probe", "orphans", "orphans_in_scope", "chaosgpu.process.probes",
                 {"scope": {"sandbox": name}}, orphans_out, 1.5, 1.6),
        activity("action", "terminate-pod", "terminate_sandbox", "chaosgpu.sandbox.actions",
                 {"name": name, "grace_period": 30}, terminate_out, fault_t, terminate_end),
        activity("probe", "memory-release-time", "memory_release_time", "chaosgpu.timeline.probes",
                 {"after_event": "terminate-pod"}, release, terminate_end + 0.05,
                 terminate_end + 0.4),
    ]
    if n_workers > 1 and not handler:
        # The flat form (figure -> value) is accepted too: this fixture uses it.
        measurements = {"memory_held_mib": round(per * n_workers, 1), "orphans": n_workers,
                        "zombies_after_kill": 0, "deletion_s": round(terminate_end - fault_t, 3),
                        "release_s": release, "gib_seconds": round(waste, 1),
                        "residual_mib": 0.0}
    elif not handler:
        measurements = {
            "baseline_memory": [tl["baseline"]],
            "memory_release_time": [{"after_event": "terminate-pod", "phase": "start",
                                     "seconds": release, "threshold_mib": 64.0,
                                     "source": "nvml"}],
            "gb_seconds_held": [{"from_event": "terminate-pod", "to_event": "terminate-pod",
                                 "gib_s": waste, "seconds": round(terminate_end - fault_t, 4),
                                 "unit": "GiB x s (GiB = 1024 MiB)", "source": "nvml"}],
            "residual_gpu_memory": [{"residual_mib": 0.3, "baseline_mib": IDLE_MIB,
                                     "source": "nvml", "tolerance_mib": 64.0}]}
    else:
        measurements = {"memory_release_time": [{"after_event": "terminate-pod",
                                                 "phase": "start", "seconds": release}]}
    tags = ["chaosgpu", "gpu", f"scenario:pod-delete-{n_workers}",
            "fault:pod deletion, grace 30 s (workers ignore SIGTERM)" if not handler
            else "fault:pod deletion, grace 30 s"]
    if handler:
        tags += ["remediation:SIGTERM handler frees GPU memory and exits",
                 f"remediation-of:pod-delete-{n_workers}"]
    title = (f"Pod deletion with {n_workers} worker{'s' if n_workers > 1 else ''} ignoring SIGTERM"
             if not handler else f"Pod deletion, {n_workers} worker(s) with a SIGTERM handler")
    method = [method_action("terminate-pod", "terminate_sandbox", "chaosgpu.sandbox.actions",
                            {"name": name, "grace_period": 30})]
    return journal(title, tags, {"grace_period": 30, "workers": n_workers}, method, runs,
                   section_of(tl, measurements), deviated=not handler, duration=end)


def verdict_output(job, verdict, reason, after_fault_s, culprits, blocked_ranks, **extra):
    """A chaosgpu.job.verdict/1 output as job_state / detect_hang / wait_survivors_exit give."""
    out = {"schema": "chaosgpu.job.verdict/1", "id": job, "verdict": verdict, "reason": reason,
           "culprit_ranks": culprits, "culprits_note": None,
           "blocked_in": {"kind": "collective", "what": "all_reduce", "frame": None,
                          "ranks": blocked_ranks} if blocked_ranks else None,
           "detection": {"after_fault_s": after_fault_s} if after_fault_s is not None else {}}
    out.update(extra)
    return out


def nccl_rank_kill(remediation=False):
    """The report's variant 5 as the control of format 2 records it: rank 0 lost (node loss:
    partitioned, then SIGKILLed); the survivors hang holding memory until the cleanup (baseline),
    or, with the NCCL timeout remediation, give up by themselves 15 s after the fault."""
    fault_t, detect_t, cleanup_t = 3.0, 3.8, 12.0
    if remediation:
        cleanup_t = 20.0
    kill_survivors_t, gone = cleanup_t + 2.0, cleanup_t + 2.2
    survivors_gone = fault_t + 15.2 if remediation else gone
    end = (cleanup_t + 1.0 if remediation else gone) + 1.5
    workers = [
        (52000, 0, 0.6, 1897.0, fault_t + 0.12, "ring-r0", 0),
        (52001, 1, 0.6, 1897.0, survivors_gone, "ring-r1", 1),
        (52002, 2, 0.6, 1897.0, survivors_gone + 0.03, "ring-r2", 2),
    ]

    def residue(index, t):  # the survivors' peer contexts on the dead rank's GPU
        return 148.0 if index == 0 and 0.9 <= t < survivors_gone else 0.0

    wait = ("wait-survivors-exit", "wait_survivors_exit") if remediation else (
        "detect-hang", "detect_hang")
    wait_end = survivors_gone + 0.1 if remediation else detect_t
    activities = [(0.2, 1.0, "start-ring", "action", "method"),
                  (fault_t, fault_t + 0.01, "fail-rank-0", "action", "method"),
                  (fault_t + 0.01, wait_end, wait[0], "probe", "method"),
                  (wait_end, wait_end + 0.05, "zombies", "probe", "method"),
                  (cleanup_t, cleanup_t + (0.3 if remediation else 2.3), "cleanup-hang",
                   "action", "rollbacks")]
    tl = timeline(workers, end, device_extra=residue, events=marks(activities, end),
                  rng=random.Random(3), zombies={52000: fault_t + 0.01})
    culprits = [{"rank": 0, "pid": 52000, "why": "ended: killed by SIGKILL (chaosgpu's fault)",
                 "stack": None}]
    if remediation:
        verdict = verdict_output("ring-1", "failed", "the survivors ended with errors", 15.2,
                                 culprits, [], all_exited=True, survivors=[1, 2],
                                 still_alive=[], exits={
                                     "1": {"exit": {"code": 1}, "at": T0 + survivors_gone,
                                           "error": "DistBackendError: timeout"},
                                     "2": {"exit": {"code": 1}, "at": T0 + survivors_gone,
                                           "error": "DistBackendError: timeout"}})
    else:
        verdict = verdict_output("ring-1", "hung", "ranks [1, 2] wait in collective all_reduce",
                                 0.8, culprits, [1, 2])
    runs = [
        activity("action", "start-ring", "start_ring", "chaosgpu.workloads.actions",
                 {"world_size": 3, "backend": "auto"}, {"job": "ring-1", "backend": "gloo"},
                 0.2, 1.0),
        activity("action", "fail-rank-0", "fail_rank", "chaosgpu.job.actions",
                 {"job": "ring-1", "rank": 0, "how": "node-loss"},
                 {"job": "ring-1", "rank": 0, "pid": 52000, "done": "node-loss",
                  "how": "node-loss", "backend": "gloo"}, fault_t, fault_t + 0.01),
        activity("probe", wait[0], wait[1], "chaosgpu.job.probes", {"job": "ring-1"}, verdict,
                 fault_t + 0.01, wait_end),
        activity("probe", "zombies", "zombies_in_scope", "chaosgpu.process.probes",
                 {"scope": {"job": "ring-1"}}, [{"pid": 52000, "host_pid": 52000}],
                 wait_end, wait_end + 0.05),
    ]
    cleanup_out = {"job": "ring-1", "found": 0 if remediation else 2,
                   "steps": [] if remediation else [
                       {"step": "sigterm", "sent": 2, "gone_in_grace": False, "t": 0.0},
                       {"step": "sigkill", "sent": 2, "t": 2.0},
                       {"step": "gpu_release", "released": True, "t": 2.2}],
                   "removed": [] if remediation else [52001, 52002], "not_removed": [],
                   "gpu_memory_released": True, "took_s": 0.3 if remediation else 2.3}
    rollbacks = [activity("action", "cleanup-hang", "cleanup_hung_job", "chaosgpu.job.actions",
                          {"job": "ring-1"}, cleanup_out, cleanup_t,
                          cleanup_t + (0.3 if remediation else 2.3))]
    measurements = {"residual_gpu_memory": [
        {"value": 3942.0, "unit": "MiB", "residual_mib": 3942.0, "baseline_mib": 3 * IDLE_MIB,
         "source": "nvml", "tolerance_mib": 64.0}]}
    section = section_of(tl, measurements)
    # What the control of format 2 writes (chaosgpu.timeline.events), by hand.
    signals = [{"signal": "SIGKILL", "at": T0 + fault_t + 0.005, "t": fault_t + 0.005,
                "activity": "fail-rank-0", "part": "method"}]
    if not remediation:
        signals += [{"signal": "SIGTERM", "at": T0 + cleanup_t, "t": cleanup_t,
                     "activity": "cleanup-hang", "part": "rollbacks"},
                    {"signal": "SIGKILL", "at": T0 + kill_survivors_t, "t": kill_survivors_t,
                     "activity": "cleanup-hang", "part": "rollbacks"}]
    section.update(format=2, signals=signals, release=None, fault={
        "activity": "fail-rank-0", "module": "chaosgpu.job.actions", "func": "fail_rank",
        "kind": "node-loss", "start_at": T0 + fault_t, "start_t": fault_t,
        "at": T0 + fault_t, "t": fault_t, "source": "chaosgpu.faultlog (recorded by the fault "
                                                    "action)"},
        verdicts=[{"activity": wait[0], "part": "method", "job": "ring-1",
                   "verdict": verdict["verdict"], "reason": verdict["reason"],
                   "culprits": [{"rank": 0, "why": culprits[0]["why"]}],
                   "culprits_note": None,
                   "blocked_in": None if remediation else {
                       "kind": "collective", "what": "all_reduce", "ranks": [1, 2]},
                   "after_fault_s": verdict["detection"]["after_fault_s"],
                   "after_hang_began_s": None,
                   **({"all_exited": True, "survivors": [1, 2], "still_alive": [],
                       "exits": {"1": {"code": 1}, "2": {"code": 1}}} if remediation else {})}])
    tags = ["chaosgpu", "gpu", "nccl", "scenario:nccl-rank-kill", "fault:node-loss"]
    title = "NCCL rank lost: survivors hang holding GPU memory"
    if remediation:
        tags += ["remediation", "remediation-of:nccl-rank-kill"]
        title = "Remediation: NCCL process-group timeout"
    method = [method_action("fail-rank-0", "fail_rank", "chaosgpu.job.actions",
                            {"job": "ring-1", "rank": 0, "how": "node-loss"})]
    j = journal(title, tags, {}, method, runs, section, deviated=not remediation, duration=end,
                rollbacks=rollbacks)
    j["experiment"]["runtime"] = {"rollbacks": {"strategy": "always"}}
    return j


def interrupted():
    """A run interrupted 6 s into the grace period: timeline stops, no measurements."""
    fault_t, end = 3.0, 9.0
    workers = [(43000, 0, 0.5, 2466.0, 1e9, "pod-int-w0", None)]
    activities = [(fault_t, end, "terminate-pod", "action", "method")]
    tl = timeline(workers, end, events=marks(activities, end)[:-2])
    runs = [activity("action", "terminate-pod", "terminate_sandbox", "chaosgpu.sandbox.actions",
                     {"name": "pod-int", "grace_period": 30}, None, fault_t, end, "failed")]
    method = [method_action("terminate-pod", "terminate_sandbox", "chaosgpu.sandbox.actions",
                            {"name": "pod-int", "grace_period": 30})]
    j = journal("Pod deletion interrupted by the operator (SIGINT)", ["chaosgpu",
                "scenario:pod-delete-interrupted"], {}, method, runs, section_of(tl, {}),
                status="interrupted", deviated=False, duration=end)
    j["steady_states"]["after"] = None
    return j


def write(name, data):
    with open(os.path.join(HERE, name), "w", encoding="utf-8") as handle:
        json.dump(data, handle, separators=(",", ":"))
        handle.write("\n")


def main() -> None:
    write("handmade-pod-delete-1-worker.json", pod_delete(1, False, "pod-1"))
    write("handmade-pod-delete-10-workers.json", pod_delete(10, False, "pod-10"))
    write("handmade-pod-delete-1-worker-sigterm-handler.json", pod_delete(1, True, "pod-1h"))
    write("handmade-pod-delete-10-workers-sigterm-handler.json", pod_delete(10, True, "pod-10h"))
    write("handmade-nccl-rank-kill.json", nccl_rank_kill())
    write("handmade-nccl-timeout-remediation.json", nccl_rank_kill(remediation=True))
    write("handmade-interrupted.json", interrupted())
    # Bad or foreign journals (the report must say why and go on):
    text = json.dumps(pod_delete(1, False, "pod-t"))
    with open(os.path.join(HERE, "bad", "handmade-truncated.json"), "w") as handle:
        handle.write(text[: len(text) // 2])
    foreign = journal("A Chaos Toolkit run of another extension", ["k8s"], {}, [
        method_action("kill-pod", "terminate_pods", "chaosk8s.pod.actions", {"ns": "default"})],
        [], None)
    del foreign["chaosgpu"]
    foreign["experiment"]["controls"] = []
    write(os.path.join("bad", "handmade-foreign.json"), foreign)
    no_tl = pod_delete(1, False, "pod-nt")
    no_tl["chaosgpu"] = {"timeline": None, "timeline_file": "missing-timeline.json",
                         "events": [], "measurements": {"orphans": 1}, "backend": "sandbox"}
    no_tl["experiment"]["title"] = "Pod deletion whose timeline file was lost"
    write(os.path.join("bad", "handmade-missing-timeline.json"), no_tl)
    no_control = pod_delete(1, False, "pod-nc")
    del no_control["chaosgpu"]
    no_control["experiment"]["controls"] = []
    no_control["experiment"]["title"] = "Pod deletion without the timeline control"
    write(os.path.join("bad", "handmade-no-timeline-control.json"), no_control)
    with open(os.path.join(HERE, "bad", "handmade-not-a-journal.json"), "w") as handle:
        handle.write('{"hello": "world"}\n')


if __name__ == "__main__":
    main()
