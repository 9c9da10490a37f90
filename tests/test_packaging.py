"""The wheel's package list (written by hand in pyproject.toml) names every sub-package of
chaosgpu: a missing one installs fine in editable mode and breaks only a regular install."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(path.parent.relative_to(ROOT).parts)
             for path in (ROOT / "chaosgpu").rglob("__init__.py")}
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
