"""`chaosgpu jobs`: the training jobs on this node and their observed verdicts, for game-days.

This module owns the command line (arguments, text and JSON output, the watch loop); the
observation is chaosgpu.job.observe and the verdicts chaosgpu.job.verdict. It signals nothing.
"""

import argparse
import json
import sys
import time
from typing import Any

from chaosgpu.arguments import POSITIVE_SECONDS, SECONDS, option
from chaosgpu.job.observe import JobError, Observer, not_found_message
from chaosgpu.job.verdict import DEFAULT_WINDOW_S, culprit_text, rank_name

__all__ = ["main", "render"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaosgpu jobs",
        description="Observe the training jobs on this node for a window and print each one's "
                    "verdict (running, hung, failed, restarting, finished, unknown) with its "
                    "evidence. Needs nothing from the jobs; as non-root, other users' jobs are "
                    "invisible.")
    parser.add_argument("--job", help="only this job id (as listed)")
    parser.add_argument("--tag", help="only the job whose ranks carry this chaosgpu tag")
    parser.add_argument("--window", type=option(POSITIVE_SECONDS), default=DEFAULT_WINDOW_S,
                        help="seconds without progress before a job is called hung "
                             f"(default {DEFAULT_WINDOW_S:g})")
    parser.add_argument("--observe", type=option(SECONDS), default=None,
                        help="seconds to observe before printing (default: the window + 1)")
    parser.add_argument("--watch", action="store_true",
                        help="keep observing; print a line when a job appears and at every "
                             "verdict change (Ctrl-C stops)")
    parser.add_argument("--json", action="store_true", help="print JSON (one document, or one "
                                                            "line per change with --watch)")
    return parser


def _brief(job: dict[str, Any]) -> dict[str, Any]:
    return {"id": job["id"], "verdict": job["verdict"], "reason": job["reason"],
            "since": job["since"], "since_known": job["since_known"],
            "confirmed_at": job["confirmed_at"],
            "culprit_ranks": job["culprit_ranks"],
            "blocked_in": job["blocked_in"], "restart_count": job["restart_count"],
            "evidence": job["evidence"], "ranks": job["ranks"], "detection": job["detection"],
            "tag": job["tag"], "backend": job["backend"], "launcher": job["launcher"],
            "sources": job["sources"]}


def _since_text(job: dict[str, Any]) -> str:
    """" since 12:00:01", or, for a verdict that already held when the watch began, when it
    was first seen so (the job may have been in that state long before)."""
    if not job["since"]:
        return ""
    clock = time.strftime("%H:%M:%S", time.localtime(job["since"]))
    return f" since {clock}" if job.get("since_known") else f" (already when first seen, {clock})"


def render(jobs: list[dict[str, Any]], note: str | None = None) -> str:
    """The jobs and their verdicts as text."""
    lines = [f"Jobs: {len(jobs)}"]
    for job in jobs:
        restart = f"  restart {job['restart_count']}" if job.get("restart_count") else ""
        lines.append(f"  {job['id']}  {job['verdict'].upper()}{_since_text(job)}{restart}  "
                     f"({job['reason']})")
        for rank in job["ranks"]:
            where = rank["waiting_in"]
            wait = f"  waits in {where['kind']} {where['what']}" if where else ""
            ended = f"  {rank['exit']['text']}" if rank.get("exit") else ""
            lines.append(f"    {rank_name(rank['rank'], rank['pid'])}  pid {rank['pid']}  "
                         f"{rank['state']}{wait}{ended}")
        for culprit in job["culprit_ranks"]:
            lines.append(f"    culprit: {culprit_text(culprit)}")
    if note:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run `chaosgpu jobs` and return its exit code (2 for bad arguments)."""
    args = _parser().parse_args(argv)
    try:
        observer = Observer(job=args.job, tag=args.tag, window_s=args.window, all_jobs=True)
    except (JobError, ValueError) as error:
        print(f"chaosgpu jobs: {error}", file=sys.stderr)
        return 2
    try:
        if args.watch:
            return _watch(observer, args.json)
        observer.run(lambda o: False, args.window + 1.0 if args.observe is None else args.observe)
        jobs = [t.to_json() for t in observer.tracks.values()]
        if args.json:
            print(json.dumps({"schema": "chaosgpu.jobs/1", "jobs": [_brief(j) for j in jobs],
                              "visibility": observer.visibility}, default=str))
        else:
            print(render(jobs, observer.visibility))
        if not jobs and (args.job or args.tag):  # a typo'd selection is no empty node
            print(f"chaosgpu jobs: {not_found_message(args.job, args.tag, observer)}",
                  file=sys.stderr)
            return 1
        return 0
    except JobError as error:  # the selection turned out wrong while observing
        print(f"chaosgpu jobs: {error}", file=sys.stderr)
        return 2
    finally:
        observer.close()


def _watch(observer: Observer, as_json: bool) -> int:
    """Print a line when a job is first seen and when its verdict (or its restart count)
    changes; a reason whose figures move ("progress 0.4 s ago") prints nothing new."""
    seen: dict[str, str] = {}
    try:
        while True:
            observer.run(lambda o: True, 0.0)
            for track in observer.tracks.values():
                key = f"{track.verdict}:{track.restart_count()}"
                if seen.get(track.id) == key:
                    continue
                seen[track.id] = key
                job = track.to_json()
                if as_json:
                    print(json.dumps(_brief(job), default=str), flush=True)
                else:
                    stamp = time.strftime("%H:%M:%S")
                    print(f"{stamp}  {job['id']}  {job['verdict'].upper()}  {job['reason']}",
                          flush=True)
            observer.pause(observer.tick_s)
    except KeyboardInterrupt:
        return 0
