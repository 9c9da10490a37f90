"""Helpers shared by the tests that write an experiment and hand it to the real CLIs:
`chaosgpu validate` and `chaos run`, each as a subprocess in the test's own directory."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: the `chaos` command installed beside this Python
CHAOS = str(Path(sys.executable).with_name("chaos"))


def activity(module: str, func: str, arguments: dict[str, Any] | None = None,
             name: str = "act") -> dict[str, Any]:
    """A python activity (a probe when `module` ends in "probes", else an action); without
    `arguments` its provider has none."""
    provider: dict[str, Any] = {"type": "python", "module": module, "func": func}
    if arguments is not None:
        provider["arguments"] = arguments
    return {"type": "probe" if module.endswith("probes") else "action", "name": name,
            "provider": provider}


def experiment(*method: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """An experiment running `method`, with `extra` top-level keys (configuration, controls,
    rollbacks...)."""
    return {"title": "t", "description": "d", "method": list(method), **extra}


def validate(tmp_path: Path, document: dict[str, Any], *options: str,
             env: dict[str, str] | None = None) -> "subprocess.CompletedProcess[str]":
    """`chaosgpu validate [options] <document written to tmp_path>`: the finished process."""
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(document))
    return subprocess.run([sys.executable, "-m", "chaosgpu.cli", "validate", *options,
                           str(path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, stdin=subprocess.DEVNULL,
                          env=dict(os.environ, **(env or {})))


def chaos_run(tmp_path: Path, document: dict[str, Any], env: dict[str, str] | None = None,
              ) -> tuple["subprocess.CompletedProcess[str]", dict[str, Any], str]:
    """`chaos run` of `document` in tmp_path: the finished process, its journal and its log
    (tmp_path/log)."""
    path = tmp_path / "experiment.json"
    path.write_text(json.dumps(document))
    journal = tmp_path / "journal.json"
    run = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                          "run", "--journal-path", str(journal), str(path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))
    return run, json.loads(journal.read_text()), (tmp_path / "log").read_text()
