"""Every third-party package forerun's code imports is declared in pyproject.toml: in the core
dependencies or in an extra (the one that uses it), so a plain `pip install forerun` (or with
the extra a command names) never fails on an import. The `test` extra repeats the `serve`
extra's packages (CI installs `.[test]` only). Fast: the sources are parsed, nothing is imported."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _name(requirement: str) -> str:
    """"prometheus-client>=0.20" -> "prometheus-client"; "ray[serve]>=2.9" -> "ray"."""
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> dict[str, set[str]]:
    groups = {"core": PYPROJECT["dependencies"], **PYPROJECT.get("optional-dependencies", {})}
    return {group: {_name(r) for r in requirements} for group, requirements in groups.items()}


def _imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} over forerun/, absolute imports of non-stdlib modules
    (top-level and lazy ones inside functions alike)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "forerun").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top != "forerun" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    declared = set().union(*_declared().values())
    missing = {module: sorted(files) for module, files in _imports().items()
               if module.lower().replace("_", "-") not in declared}
    assert not missing, f"imported but declared in no dependency list of pyproject.toml: {missing}"


def test_the_serve_code_needs_only_core_and_the_serve_extra():
    declared = _declared()
    allowed = declared["core"] | declared["serve"] | declared["ray"]  # ray_app.py: the ray extra
    serve_imports = {module for module, files in _imports().items() if any(f.startswith("forerun/serve/") for f in files)}
    undeclared = sorted(m for m in serve_imports if m.lower().replace("_", "-") not in allowed)
    assert not undeclared, f"forerun/serve imports {undeclared}, in neither the core dependencies nor the serve extra"


def test_the_test_extra_repeats_the_serve_extra():
    declared = _declared()
    assert declared["serve"] <= declared["test"], f"the test extra lacks {sorted(declared['serve'] - declared['test'])}"
