"""`chaosgpu snapshot`: print the node's truth as a readable table or as the census JSON.

This module owns only the presentation of the census (`chaosgpu.node.take_census`); it must not
read /proc or NVML itself.
"""

from __future__ import annotations

import os
import sys

from chaosgpu.node import take_census

TYPE_CHECKING = False  # mypy reads it as true; typing costs ~5-9 ms of every command's start
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

__all__ = ["main", "render"]


def _fmt_mib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  " + "  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    return lines


def _container(container: dict[str, Any] | None) -> str:
    if not container:
        return "-"
    ident = container.get("id") or container.get("pod_uid") or "?"
    if len(ident) > 12 and container.get("runtime") != "sandbox":
        ident = ident[:12]
    return f"{container.get('runtime')}:{ident}"


def _cmd(proc: dict[str, Any]) -> str:
    cmdline = proc.get("cmdline")
    text = " ".join(cmdline) if cmdline else f"[{proc.get('comm')}]"
    return text if len(text) <= 60 else text[:57] + "..."


def render(census: dict[str, Any]) -> str:
    """Return the census as readable text: GPUs, GPU processes, zombies, orphans, jobs."""
    out: list[str] = []
    observer = census["observer"]
    out.append(f"chaosgpu snapshot  host {observer.get('hostname')}  observer pid "
               f"{observer.get('pid')} uid {observer.get('uid')}  pid_ns {observer.get('pid_ns')}"
               f"{'' if observer.get('host_view') else ' (nested: host PIDs not visible)'}  "
               f"{len(census['processes'])} processes in {census['duration_ms']:.1f} ms")
    gpu = census["gpu"]
    out.append("")
    if not gpu.get("available"):
        out.append(f"GPUs: not available ({gpu.get('reason')})")
    else:
        out.append(f"GPUs (driver {gpu.get('driver')}):")
        rows = [[str(d.get("index")), str(d.get("name")), _fmt_mib(d.get("memory_used_mib")),
                 _fmt_mib(d.get("memory_total_mib")), str(len(d.get("processes") or [])),
                 str(d.get("uuid"))] for d in gpu.get("devices") or []]
        out.extend(_table(["GPU", "NAME", "USED MiB", "TOTAL MiB", "PROCS", "UUID"], rows))
    out.append("")
    gprocs = census.get("gpu_processes") or []
    out.append(f"GPU processes: {len(gprocs)}")
    if gprocs:
        rows = [[str(g["gpu_index"]), "?" if g.get("host_pid") is None else str(g["host_pid"]),
                 str(g.get("nvml_pid")),
                 "-" if g["pid"] is None else str(g["pid"]),
                 "-" if g["ns_pid"] is None else str(g["ns_pid"]), str(g.get("state") or "-"),
                 _container(g.get("container")), str(g.get("job") or "-"),
                 "-" if g.get("rank") is None else str(g["rank"]), _fmt_mib(g.get("used_mib")),
                 g.get("note") or (g.get("comm") or "")] for g in gprocs]
        out.extend(_table(["GPU", "HOST PID", "NVML PID", "PID", "NS PID", "STATE",
                           "CONTAINER", "JOB", "RANK", "MiB", "NOTE"], rows))
    by_pid = {p["pid"]: p for p in census["processes"]}
    for title, pids in (("Zombies", census["zombies"]), ("Orphans", census["orphans"])):
        out.append("")
        out.append(f"{title}: {len(pids)}")
        if pids:
            rows = []
            for pid in pids:
                p = by_pid[pid]
                nspid = p.get("nspid") or []
                rows.append([str(pid), str(p["ppid"]), str(nspid[-1]) if nspid else "?",
                             p["state"], "?" if p["uid"] is None else str(p["uid"]),
                             _container(p.get("container")), str(p.get("tag") or "-"),
                             _cmd(p)])
            out.extend(_table(["PID", "PPID", "NS PID", "STATE", "UID", "CONTAINER", "TAG",
                               "COMMAND"], rows))
    out.append("")
    jobs = census.get("jobs") or []
    out.append(f"Jobs: {len(jobs)}")
    for job in jobs:
        flag = f"  restart {job['restart_count']}" if job.get("restart_count") else ""
        launcher_pid = job.get("launcher_pid")
        launcher = job.get("launcher") + ("" if launcher_pid is None else f" pid {launcher_pid}")
        out.append(f"  job {job['id']}  master {job.get('master')}  world {job.get('world_size')}"
                   f"  launcher {launcher}{flag}")
        rows = [["?" if r["rank"] is None else str(r["rank"]),
                 "-" if r.get("local_rank") is None else str(r["local_rank"]),
                 "-" if r["pid"] is None else str(r["pid"]),
                 "-" if r.get("ns_pid") is None else str(r["ns_pid"]), r["state"],
                 _fmt_mib(r.get("gpu_mib"))] for r in job["ranks"]]
        out.extend("  " + line for line in _table(
            ["RANK", "LOCAL", "PID", "NS PID", "STATE", "GPU MiB"], rows))
    from chaosgpu.job.observe import visibility_note

    note = visibility_note(census)
    if note:
        out.append(f"  note: {note}")
    if jobs:
        out.append("  (a verdict, running or hung, needs observation over time: `chaosgpu jobs`)")
    unreadable = sum(1 for p in census["processes"] if p.get("unreadable"))
    if unreadable:
        out.append("")
        out.append(f"Not readable from here (permissions or vanished): fields of {unreadable} "
                   "processes; see --json (`unreadable`, `errors`)")
    if census.get("errors"):
        out.append("")
        out.append("Errors:")
        out.extend(f"  {e}" for e in census["errors"])
    return "\n".join(out)


def _select_device(census: dict[str, Any], device: int) -> str | None:
    """Keep only GPU `device` in the census; return an error message if it does not exist."""
    gpu = census["gpu"]
    indexes = [d.get("index") for d in gpu.get("devices") or []]
    if device not in indexes:
        if not gpu.get("available"):
            return f"GPU {device} does not exist here: GPUs not available ({gpu.get('reason')})"
        return f"GPU {device} does not exist here; GPUs are {indexes}"
    gpu["devices"] = [d for d in gpu["devices"] if d.get("index") == device]
    census["gpu_processes"] = [g for g in census["gpu_processes"] if g["gpu_index"] == device]
    return None


#: the options of `chaosgpu snapshot`, read once each way: (flag, value type (None for a switch),
#: metavar, default, help). `_parse_plain` reads a plain command line with them; argparse, built
#: from them, reads the rest (help, abbreviations, errors). argparse and json import re, enum
#: and gettext: ~9 ms of a snapshot's start on 2 cores, a fifth of what `ps` takes at 1,000
#: processes, for a command line that is mostly `--json`.
_OPTIONS: tuple[tuple[str, type | None, str | None, Any, str], ...] = (
    ("--json", None, None, False,
     "print the census JSON (schema chaosgpu.census/1, docs/census.md)"),
    ("--no-gpu", None, None, False, "do not query NVML"),
    ("--no-env", None, None, False, "do not read environments (no jobs, no tags)"),
    ("--no-fds", None, None, False, "do not scan fds for /dev/nvidia*"),
    ("--scan-fds", None, None, False,
     "scan fds even where no NVIDIA device is registered (measures what a GPU node pays)"),
    ("--device", int, "N", None, "show only GPU N (error if it does not exist)"),
    ("--workers", int, "N", 0,
     "read /proc with N readers (N - 1 forked); 0 (default): as many as pay for this node's "
     "process count and CPUs"),
    ("--indent", int, "N", None,
     "indent the JSON by N (default: 1 on a terminal, compact otherwise)"),
    ("--gpu-snapshot", str, "FILE", None,
     "use a recorded NVML snapshot (JSON: the census's gpu section, or a recording with it "
     'under "held"; - reads standard input) instead of NVML'),
)


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def _parse_plain(argv: list[str]) -> dict[str, Any] | None:
    """The options of a plain command line: whole option names, each value after its option
    (`--workers 4`, `--workers=4`) and of its type; None for anything else (help, an
    abbreviation, an unknown word, a missing or bad value), which argparse then reads and
    answers as it does."""
    spec = {flag: kind for flag, kind, _, _, _ in _OPTIONS}
    options = {_dest(flag): default for flag, _, _, default, _ in _OPTIONS}
    words = iter(argv)
    for word in words:
        flag, has_value, value = word.partition("=")
        if flag not in spec:
            return None
        kind = spec[flag]
        if kind is None:
            if has_value:
                return None
            options[_dest(flag)] = True
            continue
        if not has_value:
            following = next(words, None)
            if following is None or (following.startswith("-") and following != "-"
                                     and not following[1:].isdigit()):
                return None  # no value, or another option where it belongs: argparse says so
            value = following
        try:
            options[_dest(flag)] = kind(value)
        except ValueError:
            return None
    return options


def _parse_args(argv: list[str] | None) -> dict[str, Any] | int:
    """The options of `argv` (default: the process's arguments), or the exit code when
    argparse has answered (help printed: 0; a usage error printed: 2)."""
    words = list(sys.argv[1:] if argv is None else argv)
    plain = _parse_plain(words)
    return plain if plain is not None else _parse_with_argparse(words)


def _parse_with_argparse(words: list[str]) -> dict[str, Any] | int:
    """argparse's reading of `words`, with the parser built from `_OPTIONS`: the options, or
    the exit code once it has printed help (0) or a usage error (2)."""
    import argparse

    class HelpFormatter(argparse.HelpFormatter):
        """argparse's help layout, with the terminal's width read through os: argparse asks
        shutil, whose import (zlib, bz2, lzma) costs 2 ms."""

        def __init__(self, prog: str) -> None:
            try:
                columns = int(os.environ["COLUMNS"])
            except (KeyError, ValueError):
                try:
                    columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
                except (AttributeError, ValueError, OSError):
                    columns = 80
            super().__init__(prog, width=max(columns, 20) - 2)

    parser = argparse.ArgumentParser(
        prog="chaosgpu snapshot", formatter_class=HelpFormatter,
        description="The node's truth: GPUs, GPU processes (host and namespace PIDs, container, "
                    "job, rank), zombies, orphans, distributed-training jobs.")
    for flag, kind, metavar, default, text in _OPTIONS:
        if kind is None:
            parser.add_argument(flag, action="store_true", help=text)
        else:
            parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)
    try:
        return vars(parser.parse_args(words))
    except SystemExit as exit_:
        return int(exit_.code or 0)


#: records per piece of a long top-level list (the census's processes) in the compact JSON:
#: a piece is encoded and written before the next is made, so the output never exists whole
#: in memory (at 10,000 processes the whole text, its UTF-8 bytes and their copy took 15 MB
#: of fresh pages, 15-20 ms of a snapshot on 2 cores: docs/census.md, round 18)
PIECE_RECORDS = 250


def _encoded_pieces(document: dict[str, Any], indent: int | None = None) -> Iterator[str]:
    """`document` as JSON, in pieces whose concatenation is exactly what `json.dumps(document,
    indent=indent, separators=..., check_circular=False, ensure_ascii=False)` writes (compact
    separators without indent). Compact, by the C encoder json itself uses but without
    importing json (its import brings re and enum: ~5 ms of a snapshot's start on 2 cores),
    a top-level list in pieces of PIECE_RECORDS items; indented, or where that encoder is
    missing (not CPython), in one piece by json."""
    try:
        import _json
    except ImportError:  # not CPython: json's own pure-Python encoder
        _json = None  # type: ignore[assignment]
    if indent is not None or _json is None:
        import json

        yield json.dumps(document, indent=indent,
                         separators=(",", ":") if indent is None else None,
                         check_circular=False, ensure_ascii=False)
        return

    def refuse(value: Any) -> Any:
        raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")

    encoder = _json.make_encoder(None, refuse, _json.encode_basestring, None, ":", ",", False,
                                 False, True)
    if not all(isinstance(key, str) for key in document):  # json's rules for other keys
        yield "".join(encoder(document, 0))
        return
    separator = "{"
    for key, value in document.items():
        head = separator + _json.encode_basestring(key) + ":"
        separator = ","
        if not isinstance(value, list) or len(value) <= PIECE_RECORDS:
            yield head + "".join(encoder(value, 0))
            continue
        for start in range(0, len(value), PIECE_RECORDS):
            piece = "".join(encoder(value[start:start + PIECE_RECORDS], 0))
            yield (head + piece[:-1] if start == 0 else "," + piece[1:-1])
        yield "]"
    yield "}" if separator == "," else "{}"


def _encode(document: dict[str, Any], indent: int | None = None) -> str:
    """`document` as one JSON text (``_encoded_pieces`` joined)."""
    return "".join(_encoded_pieces(document, indent))


def _write_json(document: dict[str, Any], indent: int | None) -> None:
    """Write `document` to stdout as one line of JSON (``_encoded_pieces``), in UTF-8 whatever
    the locale says (the JSON may carry any command line)."""
    raw = getattr(sys.stdout, "buffer", None)
    if raw is None:  # a text-only stream (a caller's StringIO)
        for piece in _encoded_pieces(document, indent):
            sys.stdout.write(piece)
        sys.stdout.write("\n")
        return
    sys.stdout.flush()
    for piece in _encoded_pieces(document, indent):
        raw.write(piece.encode("utf-8"))
    raw.write(b"\n")
    raw.flush()


def main(argv: list[str] | None = None, exit_when_written: bool = False) -> int:
    """Run `chaosgpu snapshot [--json] [--no-gpu] [--no-env] [--no-fds] [--device N]`.
    `exit_when_written` (the command run as a program, not a caller's function) ends the
    process once the output is flushed, without freeing the census first: that teardown costs
    ~27 ms with 10,000 processes on 2 cores (a snapshot's whole budget is what `ps` takes);
    where the reader closes its end early (`| head`), it ends with 141, as a program that
    SIGPIPE ended, and no traceback."""
    args = _parse_args(argv)
    if isinstance(args, int):
        return args
    snapshot = None
    if args["gpu_snapshot"]:
        from chaosgpu.node import census_module

        try:
            snapshot = census_module().load_gpu_snapshot(args["gpu_snapshot"])
        except ValueError as error:  # names the file and the shape expected
            print(f"chaosgpu snapshot: {error}", file=sys.stderr)
            return 2
    if args["workers"] < 0:
        print(f"chaosgpu snapshot: --workers must be >= 0, got {args['workers']}", file=sys.stderr)
        return 2
    if args["indent"] is not None and args["indent"] < 0:
        print(f"chaosgpu snapshot: --indent must be >= 0, got {args['indent']}", file=sys.stderr)
        return 2
    if args["device"] is not None and args["device"] < 0:
        print(f"chaosgpu snapshot: --device must be >= 0, got {args['device']}", file=sys.stderr)
        return 2
    census = take_census(env=not args["no_env"],
                         fds="always" if args["scan_fds"] else not args["no_fds"],
                         gpu=not args["no_gpu"] or snapshot is not None, gpu_snapshot=snapshot,
                         workers=args["workers"])
    if args["device"] is not None:
        problem = _select_device(census, args["device"])
        if problem is not None:
            print(f"chaosgpu snapshot: {problem}", file=sys.stderr)
            return 2
    try:
        if args["json"]:
            # the C encoder, piece by piece: the pure-Python indenting encoder costs as much
            # as reading 3,000 processes, so indentation is for terminals (or --indent)
            indent = args["indent"]
            if indent is None:
                indent = 1 if sys.stdout.isatty() else None
            # compact separators, no cycle check (the census is a tree): 12 % of the
            # encoding; UTF-8 written as is (no backslash-u escapes): another 12 %, the same
            _write_json(census, indent)
        else:
            print(render(census), flush=True)
    except BrokenPipeError:  # the reader stopped reading (`| head`): nothing left to say
        if not exit_when_written:
            raise
        os._exit(141)  # as a program that SIGPIPE ended, without a traceback
    if exit_when_written:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
