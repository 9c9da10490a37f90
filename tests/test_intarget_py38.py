"""The in-target programs (probes/*.py, actions/*.py) run with the target's own python3, as
old as Python 3.8: their grammar is 3.8's, no annotation that 3.8 evaluates uses PEP 585/604
forms, and they run under a real Python 3.8 (found as CHAOSGPU_PYTHON38 or python3.8 on PATH;
.ci/run installs one). ruff checks the same files with target py38 (pyproject)."""

import ast
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import find_tool

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = sorted(p for folder in ("probes", "actions") for p in (ROOT / folder).glob("*.py")
                  if p.name != "__init__.py")
GENERICS = {"list", "dict", "tuple", "set", "frozenset", "type"}


def _new_style(annotation: ast.expr) -> list[str]:
    found = []
    for node in ast.walk(annotation):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            found.append(f"X | Y at line {node.lineno}")
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and node.value.id in GENERICS):
            found.append(f"{node.value.id}[...] at line {node.lineno}")
    return found


def _evaluated_annotations(tree: ast.Module) -> list[ast.expr]:
    """The annotations Python 3.8 evaluates at run time: of functions, and of variables at
    module and class level (a local variable's annotation is never evaluated)."""
    found: list[ast.expr] = []
    scopes: list[ast.AST] = [tree]
    while scopes:
        scope = scopes.pop()
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                found += [a.annotation for a in (args.posonlyargs + args.args + args.kwonlyargs
                                                 + [args.vararg, args.kwarg]) if a and a.annotation]
                if node.returns is not None:
                    found.append(node.returns)
                scopes.append(node)  # nested definitions are evaluated when defined
            elif isinstance(node, ast.ClassDef):
                scopes.append(node)
            elif isinstance(node, ast.AnnAssign) and not isinstance(scope, ast.FunctionDef):
                found.append(node.annotation)
    return found


@pytest.mark.parametrize("path", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_the_program_is_python_38(path: Path) -> None:
    source = path.read_text()
    tree = ast.parse(source, filename=str(path), feature_version=(3, 8))
    future = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                 and any(a.name == "annotations" for a in n.names) for n in tree.body)
    if not future:
        problems = [p for a in _evaluated_annotations(tree) for p in _new_style(a)]
        assert problems == [], f"{path.name}: annotations Python 3.8 cannot evaluate: {problems}"


def test_the_checker_sees_what_38_cannot_run() -> None:
    tree = ast.parse("def f(x: list[int]) -> 'int | None':\n    y: dict[str, int] = {}\n"
                     "class C:\n    z: int | None = None\n")
    found = [p for a in _evaluated_annotations(tree) for p in _new_style(a)]
    assert found == ["list[...] at line 1", "X | Y at line 4"]
    with pytest.raises(SyntaxError):
        ast.parse("match x:\n    case 1:\n        pass\n", feature_version=(3, 8))


def _python38() -> str:
    path = os.environ.get("CHAOSGPU_PYTHON38") or find_tool("python3.8")
    if not path:
        pytest.skip("missing tool: python3.8 (set CHAOSGPU_PYTHON38 to a Python 3.8 "
                    "interpreter, e.g. pyenv's)")
    version = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert version == "(3, 8)", (path, version)
    return path


def test_the_census_runs_under_python_38() -> None:
    done = subprocess.run([_python38(), str(ROOT / "probes" / "node_census.py"), "--no-gpu",
                           "--no-fds", "--pid", str(os.getpid())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    census = json.loads(done.stdout)
    assert census["schema"].startswith("chaosgpu.census/")
    assert [p["pid"] for p in census["processes"]] == [os.getpid()]


def test_the_signal_program_runs_under_python_38_and_refuses_without_pidfds() -> None:
    target = subprocess.Popen(["sleep", "60"])
    try:
        with open(f"/proc/{target.pid}/stat") as handle:
            stat = handle.read()
        starttime = int(stat[stat.rindex(")") + 2:].split()[19])
        done = subprocess.run([_python38(), str(ROOT / "actions" / "signal_processes.py"),
                               "SIGKILL", json.dumps([{"pid": target.pid,
                                                       "starttime": starttime}])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        (result,) = json.loads(done.stdout)["results"]
        # Python 3.8 has no signal.pidfd_send_signal: refused, never sent through a bare PID
        assert result["result"] == "refused" and result["reason_code"] == "no_pidfd", result
        assert target.poll() is None
    finally:
        os.kill(target.pid, signal.SIGKILL)
        target.wait(timeout=10)
