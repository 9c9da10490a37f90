"""The wheel ships every part of chaosgpu: each folder of the package (and of the in-target
programs) is listed in pyproject's [tool.setuptools] packages, and a real, non-editable wheel
builds without setuptools warning about a folder it was not told of."""

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folders_with_files() -> set[str]:
    found = set()
    for path in (ROOT / "chaosgpu").rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".c"):
            found.add(".".join(path.parent.relative_to(ROOT).parts))
    return found


def test_every_folder_is_listed() -> None:
    listed = set(SETUPTOOLS["packages"])
    assert _folders_with_files() - listed == set()
    # the in-target programs ship from the repository's top-level folders
    assert SETUPTOOLS["package-dir"] == {"chaosgpu.intarget.probes": "probes",
                                         "chaosgpu.intarget.actions": "actions"}
    assert {"chaosgpu.intarget.probes", "chaosgpu.intarget.actions"} <= listed


@pytest.mark.slow
def test_the_wheel_builds_without_warnings_and_ships_everything(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "absent from the `packages` configuration" not in output, output[-3000:]
    (wheel,) = tmp_path.glob("chaostoolkit_gpu-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("chaosgpu/gpu/site/sitecustomize.py", "chaosgpu/gpu/site/chaosgpu_injector.py",
                    "chaosgpu/gpu/cuda_inject/chaosgpu_cuda_inject.c",
                    "chaosgpu/intarget/probes/node_census.py",
                    "chaosgpu/intarget/actions/signal_processes.py",
                    "chaosgpu/errors.py", "chaosgpu/arguments.py", "chaosgpu/validation.py"):
        assert shipped in names, shipped
    # the command ships as a script whose first line the installer sets to its interpreter
    (script,) = [n for n in names if n.endswith(".data/scripts/chaosgpu")]
    assert zipfile.ZipFile(wheel).read(script).startswith(b"#!python\n")
    # every module of the source tree is in the wheel
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "chaosgpu").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources <= names, sorted(sources - names)
