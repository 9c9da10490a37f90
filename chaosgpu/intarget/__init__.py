"""Locate, load and run the in-target programs (the repository's `probes/` and `actions/`).

The in-target programs are self-contained files (standard library only; NVML via ctypes) that run
where chaosgpu is not installed: inside a container, through the Kubernetes exec API. The package
uses the very same files locally, so a reading of /proc or NVML is written once. This module owns
finding them (installed wheel or source checkout) and loading them as modules; it must not
contain any reading of /proc or NVML itself.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # mypy reads it as true; typing costs ~5-9 ms of every command's start
if TYPE_CHECKING:
    from pathlib import Path
    from types import ModuleType

__all__ = ["KINDS", "program_path", "source", "load"]

KINDS = ("probes", "actions")


def _program_file(kind: str, name: str) -> str:
    """The file of in-target program `name` of `kind`, as a string (os.path: loading a program
    must not import pathlib, ~8 ms of `chaosgpu snapshot`'s start)."""
    import os.path

    if kind not in KINDS:
        raise ValueError(f"unknown in-target program kind {kind!r}; expected one of {KINDS}")
    if not name.isidentifier():
        raise ValueError(f"invalid in-target program name {name!r}")
    here = os.path.dirname(os.path.realpath(__file__))
    candidates = (
        os.path.join(here, kind, f"{name}.py"),  # installed: package-dir maps probes/ here
        os.path.join(os.path.dirname(os.path.dirname(here)), kind, f"{name}.py"),  # checkout
    )
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"in-target program {kind}/{name}.py not found (looked in "
                            + ", ".join(os.path.dirname(c) for c in candidates) + ")")


def program_path(kind: str, name: str) -> Path:
    """Return the file of in-target program `name` of `kind` ('probes' or 'actions')."""
    from pathlib import Path

    return Path(_program_file(kind, name))


def source(kind: str, name: str) -> str:
    """Return the source text of an in-target program, to stream it into a target."""
    return program_path(kind, name).read_text(encoding="utf-8")


def load(kind: str, name: str) -> ModuleType:
    """Import an in-target program as a module (once per process) and return it."""
    module_name = f"chaosgpu.intarget.{kind}.{name}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    import importlib.util

    path = _program_file(kind, name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load in-target program {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
