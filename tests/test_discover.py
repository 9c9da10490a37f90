"""`chaos discover` lists every activity with its real argument types and a docstring, and the
package's own discover() agrees with the activity modules' __all__.

chaoslib names plain types and typing.List/Dict itself; chaosgpu.discover names Optional[X] (as
X) and Union[X, Y] ("x|y"), which chaoslib calls "object". So no argument may show as "object",
and each type must be the one the signature declares.
"""

import importlib
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import chaosgpu

CHAOS = shutil.which("chaos") or str(Path(sys.executable).with_name("chaos"))


def exported_functions() -> set[tuple[str, str]]:
    """Every (module, function) that the activity modules publish through __all__."""
    found = set()
    for name in chaosgpu.ACTIVITY_MODULES:
        module = importlib.import_module(name)
        for func in getattr(module, "__all__", []):
            found.add((name, func))
    return found


def activity_modules_on_disk() -> set[str]:
    """Every chaosgpu/<part>/actions.py and probes.py, as module names."""
    root = Path(chaosgpu.__file__).parent
    return {f"chaosgpu.{path.parent.name}.{path.stem}"
            for pattern in ("*/actions.py", "*/probes.py") for path in root.glob(pattern)}


def test_every_activity_module_is_discovered() -> None:
    assert set(chaosgpu.ACTIVITY_MODULES) == activity_modules_on_disk()


def test_every_activity_module_exists_and_publishes_documented_functions() -> None:
    for module_name, func_name in exported_functions():
        module = importlib.import_module(module_name)
        func = getattr(module, func_name)
        assert callable(func), (module_name, func_name)
        assert (func.__doc__ or "").strip(), f"{module_name}.{func_name} has no docstring"
        # postponed annotations would make chaoslib see strings, every type an "object"
        assert "from __future__ import annotations" not in inspect.getsource(module), module_name


def test_package_discover_lists_every_exported_function() -> None:
    discovery = chaosgpu.discover(discover_system=False)
    listed = {(a["mod"], a["name"]) for a in discovery["activities"]}
    assert listed == exported_functions()


def test_no_required_argument_hides_behind_a_fake_default() -> None:
    """An argument the activity cannot do without has no default (so `chaos validate` reports
    it missing); an empty string or a 0 PID is never a default."""
    for module_name, func_name in exported_functions():
        func = getattr(importlib.import_module(module_name), func_name)
        for param in inspect.signature(func).parameters.values():
            assert param.default != "", (func_name, param.name)
            if param.name in ("pid", "name", "tag", "spec_path", "after_event", "from_event",
                              "scope", "pod_uid", "url"):
                assert param.default in (inspect.Parameter.empty, None), (func_name, param.name)


def _expected(annotation: Any) -> str:
    return chaosgpu.portable_type(annotation)


def test_chaos_discover_cli_shows_every_argument_with_its_type(tmp_path: Path) -> None:
    out = tmp_path / "discovery.json"
    done = subprocess.run([CHAOS, "--no-version-check", "--log-file", str(tmp_path / "log"),
                           "discover", "--no-install", "--no-system-info", "--discovery-path",
                           str(out), "chaostoolkit-gpu"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and out.exists(), done.stdout + done.stderr
    discovery = json.loads(out.read_text())
    assert discovery["extension"] == {"name": "chaostoolkit-gpu",
                                      "version": chaosgpu.__version__}
    activities = discovery["activities"]
    assert {(a["mod"], a["name"]) for a in activities} == exported_functions()
    plain = {"string", "integer", "number", "boolean", "list", "mapping"}
    for activity in activities:
        assert activity["doc"], activity["name"]
        signature = inspect.signature(getattr(importlib.import_module(activity["mod"]),
                                              activity["name"]))
        assert activity.get("return_type") not in (None, "object"), activity["name"]
        for arg in activity["arguments"]:
            assert arg.get("type") not in (None, "object"), (activity["name"], arg)
            assert set(arg["type"].split("|")) <= plain, (activity["name"], arg)
            annotation = signature.parameters[arg["name"]].annotation
            assert arg["type"] == _expected(annotation), (activity["name"], arg)
            default = signature.parameters[arg["name"]].default
            assert ("default" in arg) == (default is not inspect.Parameter.empty), arg


def test_the_version_is_defined_once_in_pyproject() -> None:
    import tomllib

    root = Path(__file__).resolve().parent.parent
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert chaosgpu.__version__ == declared
    done = subprocess.run([sys.executable, "-m", "chaosgpu.cli", "--version"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == f"chaosgpu {declared}", done.stdout + done.stderr
    # no second copy of the version string in the package's code
    copies = [path for path in (root / "chaosgpu").rglob("*.py")
              if f'"{declared}"' in path.read_text()]
    assert copies == []
