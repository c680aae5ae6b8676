"""The layout shows the architecture, and the imports keep to it (read from the source, not run).

- the library never imports the tools (``slidekit.tools``: bench, baselines, presets, child runs,
  report); only the CLI reaches them, to run them;
- planning is pure: it imports neither the engine, nor the Trainer, nor the tools;
- the engine imports neither the Trainer nor the tools;
- nothing in ``slidekit`` imports a bundled plugin package (the plugin wall: entry points only).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "slidekit"
PLUGINS = ("slidekit_tiers", "slidekit_optim", "slidekit_kernels")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _modules(under: str = "") -> list[Path]:
    return sorted((ROOT / under).rglob("*.py"))


def _name(path: Path) -> str:
    return ".".join(("slidekit", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def _violations(paths: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in paths:
        for imported in _imports(path):
            if any(imported == f or imported.startswith(f + ".") for f in forbidden):
                out.append(f"{_name(path)} imports {imported}")
    return out


def test_the_library_never_imports_the_tools():
    library = [p for p in _modules() if "tools" not in p.relative_to(ROOT).parts and p.name != "cli.py"]
    assert not _violations(library, ("slidekit.tools",))


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("planning", ("slidekit.engine", "slidekit.trainer", "slidekit.building", "slidekit.exporting", "slidekit.tools")),
        ("engine", ("slidekit.trainer", "slidekit.building", "slidekit.exporting", "slidekit.tools")),
    ],
)
def test_packages_keep_to_their_layer(package, forbidden):
    assert not _violations(_modules(package), forbidden)


def test_no_module_imports_a_bundled_plugin():
    assert not _violations(_modules(), PLUGINS)


def test_the_checks_see_imports():
    """The scan is not vacuous: it finds the imports a module does make."""
    assert "slidekit.planning.layout" in _imports(ROOT / "engine" / "core.py") or any(
        i.startswith("slidekit.planning") for i in _imports(ROOT / "engine" / "core.py")
    )
    assert _violations([ROOT / "cli.py"], ("slidekit.tools",))  # the CLI does run the tools


def test_the_wheel_carries_the_tools_and_their_baselines():
    """``slidekit bench`` runs from an installed wheel: the packaging (pyproject's package discovery) takes
    the tools and the baseline scripts, which the bench runs as modules (``python -m``), not as files."""
    import tomllib

    from setuptools import find_packages

    root = ROOT.parent
    found = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    where, include = found["packages"]["find"]["where"], found["packages"]["find"]["include"]
    packages = {p for w in where for p in find_packages(where=str(root / w), include=include)}
    assert {"slidekit.tools", "slidekit.tools.bench", "slidekit.tools.baselines", "slidekit.planning"} <= packages
    import importlib.util

    from slidekit.tools.bench.suites import BASELINE_PACKAGE, BASELINES

    for name, base in BASELINES.items():  # each a module of the installed package, found without the checkout
        module = f"{BASELINE_PACKAGE}.{base.script.removesuffix('.py')}"
        assert importlib.util.find_spec(module) is not None, f"baseline {name!r}: no module {module}"
