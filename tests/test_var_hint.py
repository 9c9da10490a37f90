"""A refused argument value that is text only because of how it was given says how to give it
typed. Chaos Toolkit reads an untyped `--var rank=1` as the text "1" (chaoslib's convert_vars);
the typed form is `--var rank:int=1` (`:float`, `:bool`). `chaosgpu validate` and the pre-run
check of `chaos run` (the chaosgpu.validation control, and the timeline control's first step)
add "(text): --var rank=1 gives text; write --var rank:int=1" to the refusal of a value an
untyped `--var` gave when the type would make it good; a text written in the experiment file is
told to be written as the value instead, with no `--var` hint; a text no type makes good gets no
hint. Real `chaosgpu validate` and `chaos run` subprocesses."""

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from experiment_helpers import CHAOS, validate

RANK_RULE = 'freeze_rank: rank must be a rank number (a non-negative integer) or "any"'
WAIT_RULE = "signal_processes: wait_gone_s must be a number of seconds >= 0"
FLAG_RULE = "signal_processes: require_match must be true or false"
# (variable, untyped text, the type that makes it good, the refusal of the text)
UNTYPED = [("rank", "1", "int", RANK_RULE), ("wait", "0.5", "float", WAIT_RULE),
           ("strict", "true", "bool", FLAG_RULE)]
TYPED = ["--var", "rank:int=1", "--var", "wait:float=0.5", "--var", "strict:bool=true"]


def _experiment(pid: int, control: str = "chaosgpu.validation",
                rank: Any = "${rank}") -> dict[str, Any]:
    """SIGKILL `pid`, then freeze a rank of a job: `wait_gone_s` (seconds), `require_match` (a
    flag) and `rank` (an integer) from `--var`; the pre-run check of `control` must stop the run
    before the SIGKILL."""
    arguments = {"scope": {"pids": [pid]}, "signal": "SIGKILL", "wait_gone_s": "${wait}",
                 "require_match": "${strict}"}
    return {"title": "typed vars", "description": "the kill must never be sent",
            # declared: `chaos run --var` sets only the configuration's own keys
            "configuration": {"rank": 0, "wait": 0, "strict": False},
            "controls": [{"name": "pre-run", "provider": {"type": "python", "module": control}}],
            "method": [
                {"type": "action", "name": "kill", "provider": {
                    "type": "python", "module": "chaosgpu.process.actions",
                    "func": "signal_processes", "arguments": arguments}},
                {"type": "action", "name": "freeze", "provider": {
                    "type": "python", "module": "chaosgpu.job.actions", "func": "freeze_rank",
                    "arguments": {"tag": "var-hint-job", "rank": rank}}}]}


def _hint(name: str, text: str, type_name: str) -> str:
    return (f"got {text!r} (text): --var {name}={text} gives text; "
            f"write --var {name}:{type_name}={text}")


def _but(name: str, text: str) -> list[str]:
    """TYPED with `name` given untyped as `text`."""
    words = []
    for index in range(0, len(TYPED), 2):
        given = TYPED[index + 1]
        words += ["--var", f"{name}={text}" if given.startswith(f"{name}:") else given]
    return words


@pytest.mark.parametrize(("name", "text", "type_name", "rule"), UNTYPED)
def test_validate_names_the_typed_var_to_write(tmp_path: Path, name: str, text: str,
                                               type_name: str, rule: str) -> None:
    done = validate(tmp_path, _experiment(os.getpid()), *_but(name, text))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{rule}, got {text!r} (text): --var {name}={text} gives text; write " \
           f"--var {name}:{type_name}={text}" in done.stderr, done.stderr
    assert done.stderr.count("(text)") == 1, done.stderr  # the typed ones pass


def test_all_typed_passes(tmp_path: Path) -> None:
    done = validate(tmp_path, _experiment(os.getpid()), *TYPED)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["valid"] is True


@pytest.mark.parametrize("words", [
    ["--var", "rank=x"],  # no type makes "x" a rank
    ["--var", "rank=1.5"],  # nor "1.5": a float is no rank
    ["--var", "rank:str=1"],  # typed: the text was asked for
])
def test_no_hint_where_typing_would_not_help(tmp_path: Path, words: list[str]) -> None:
    done = validate(tmp_path, _experiment(os.getpid()),
                    *words, "--var", "wait:float=0", "--var", "strict:bool=false")
    assert done.returncode == 1, done.stdout + done.stderr
    assert RANK_RULE in done.stderr and "(text)" not in done.stderr, done.stderr
    assert "write --var" not in done.stderr, done.stderr


def test_a_text_in_the_experiment_file_is_told_to_be_written_as_a_number(
        tmp_path: Path) -> None:
    """A "1" written in the experiment (the argument, or the configuration key its `${name}`
    takes) is not a --var: the fix is to write 1 in the file."""
    document = _experiment(os.getpid(), rank="1")
    done = validate(tmp_path, document, "--var", "wait:float=0", "--var", "strict:bool=false")
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{RANK_RULE}, got '1' (text): write 1, not \"1\", in the experiment" \
        in done.stderr, done.stderr
    assert "--var rank" not in done.stderr, done.stderr
    document = _experiment(os.getpid())
    document["configuration"]["rank"] = "1"
    done = validate(tmp_path, document)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{RANK_RULE}, got '1' (text): write 1, not \"1\", for configuration key 'rank' " \
           "in the experiment" in done.stderr, done.stderr
    assert "--var" not in done.stderr, done.stderr


@pytest.mark.parametrize("control", ["chaosgpu.validation", "chaosgpu.timeline.control"])
def test_chaos_run_is_refused_before_anything_starts_with_the_hints(
        tmp_path: Path, control: str) -> None:
    target = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "experiment.json"
        path.write_text(json.dumps(_experiment(target.pid, control)))
        journal = tmp_path / "journal.json"
        words = [w for name, text, _, _ in UNTYPED for w in ("--var", f"{name}={text}")]
        run = subprocess.run(
            [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run", *words,
             "--journal-path", str(journal), str(path)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            stdin=subprocess.DEVNULL)
        assert run.returncode != 0, run.stdout + run.stderr
        log = (tmp_path / "log").read_text()
        for name, text, type_name, rule in UNTYPED:
            assert f"{rule}, {_hint(name, text, type_name)}" in log, log[-3000:]
        data = json.loads(journal.read_text())
        assert data["status"] == "interrupted" and data["run"] == [], data
        assert target.poll() is None  # the SIGKILL was never sent
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)


@pytest.mark.parametrize("control", ["chaosgpu.validation", "chaosgpu.timeline.control"])
def test_chaos_run_with_a_typed_str_var_gets_no_hint(tmp_path: Path, control: str) -> None:
    """`--var rank:str=1` asks for the text: refused before anything starts, with no hint."""
    target = subprocess.Popen(["sleep", "60"])
    try:
        path = tmp_path / "experiment.json"
        path.write_text(json.dumps(_experiment(target.pid, control)))
        journal = tmp_path / "journal.json"
        run = subprocess.run(
            [CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"), "run",
             "--var", "rank:str=1", "--var", "wait:float=0", "--var", "strict:bool=true",
             "--journal-path", str(journal), str(path)],
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
            stdin=subprocess.DEVNULL)
        assert run.returncode != 0, run.stdout + run.stderr
        log = (tmp_path / "log").read_text()
        assert f"{RANK_RULE}, got '1'" in log and "(text)" not in log, log[-3000:]
        data = json.loads(journal.read_text())
        assert data["status"] == "interrupted" and data["run"] == [], data
        assert target.poll() is None
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)
