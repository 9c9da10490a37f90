"""`chaos discover --no-install chaostoolkit-gpu` lists every activity with its argument types and
docstring (Chaos Toolkit refuses editable installs there: the test skips on one, CI installs the
wheel), and the package's own discover() agrees with the activity modules' __all__."""

import importlib
import inspect
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import chaosgpu

CHAOS = str(Path(sys.executable).with_name("chaos"))


def editable_install() -> bool:
    """Whether chaostoolkit-gpu is installed in editable (development) mode."""
    direct_url = metadata.distribution("chaostoolkit-gpu").read_text("direct_url.json")
    return bool(direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"))


def exported_functions() -> set[tuple[str, str]]:
    """Every (module, function) that the activity modules publish through __all__."""
    found = set()
    for name in chaosgpu.ACTIVITY_MODULES:
        module = importlib.import_module(name)
        for func in getattr(module, "__all__", []):
            found.add((name, func))
    return found


def test_every_activity_module_exists_and_publishes_documented_functions() -> None:
    for module_name, func_name in exported_functions():
        func = getattr(importlib.import_module(module_name), func_name)
        assert callable(func), (module_name, func_name)
        assert (func.__doc__ or "").strip(), f"{module_name}.{func_name} has no docstring"


def test_package_discover_lists_every_exported_function() -> None:
    discovery = chaosgpu.discover(discover_system=False)
    listed = {(a["mod"], a["name"]) for a in discovery["activities"]}
    assert listed == exported_functions()


@pytest.mark.skipif(editable_install(), reason="chaos discover refuses editable installs")
def test_chaos_discover_cli(tmp_path: Path) -> None:
    out = tmp_path / "discovery.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "discover", "--no-install", "--no-system-info", "--discovery-path",
                           str(out), "chaostoolkit-gpu"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and out.exists(), done.stdout + done.stderr
    discovery = json.loads(out.read_text())
    activities = discovery["activities"]
    assert {(a["mod"], a["name"]) for a in activities} == exported_functions()
    plain = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list",
             dict: "mapping"}
    for activity in activities:
        assert activity["doc"], activity["name"]
        signature = inspect.signature(getattr(importlib.import_module(activity["mod"]),
                                              activity["name"]))
        for arg in activity.get("arguments", []):
            annotation = signature.parameters[arg["name"]].annotation
            if annotation in plain:
                # postponed annotations would turn every type into "object"
                assert arg.get("type") == plain[annotation], (activity["name"], arg)
