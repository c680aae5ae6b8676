"""docs/plugins.md cites only what exists: every ``slidekit.x.y`` it names resolves, every file or directory
it points to is there, and its tables of ``TierContext`` fields and tier threads match the code."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugins.md"
TEXT = DOC.read_text(encoding="utf-8")

_DOTTED = re.compile(r"\bslidekit(?:\.[A-Za-z_]\w*)+")
_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)#\s]+)\)")
_PATHISH = re.compile(r"^[\w.-]+(?:/[\w.-]+)+/?$")


def _resolve(dotted: str) -> object:
    """The module or attribute ``dotted`` names, or AssertionError saying which part is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for i, attr in enumerate(parts[cut:], cut):
            if not hasattr(obj, attr):
                raise AssertionError(f"{dotted}: {'.'.join(parts[:i])} has no {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{dotted}: no such module")


def _dotted_names() -> list[str]:
    names = {m.group(0).rstrip(".") for code in _CODE.findall(TEXT) for m in _DOTTED.finditer(code)}
    names |= {m.group(0) for m in _DOTTED.finditer(TEXT)}
    return sorted(n for n in names if not n.endswith((".py", ".md", ".toml")))


def _paths() -> list[tuple[str, Path]]:
    found = []
    for code in _CODE.findall(TEXT):
        token = code.strip()
        if _PATHISH.match(token) and not token.startswith("slidekit-"):
            found.append((token, ROOT / token))
    found += [(link, DOC.parent / link) for link in _LINK.findall(TEXT) if "://" not in link]
    return found


def test_the_doc_names_things_at_all():
    assert len(_dotted_names()) > 15 and len(_paths()) > 5


@pytest.mark.parametrize("dotted", _dotted_names())
def test_every_slidekit_name_it_cites_resolves(dotted):
    _resolve(dotted)


@pytest.mark.parametrize(("cited", "path"), _paths(), ids=[c for c, _ in _paths()])
def test_every_file_it_cites_exists(cited, path):
    assert path.exists(), f"docs/plugins.md cites {cited!r}, but {path} does not exist"


def _table_after(heading: str) -> list[list[str]]:
    """The rows (their cells) of the first table after ``heading``, past its header and rule."""
    lines = TEXT.split(heading, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return block[2:]


def test_the_tier_context_table_lists_exactly_its_fields():
    from slidekit.interfaces import TierContext

    documented = [row[0].strip("`") for row in _table_after("### What the factory gets: `TierContext`")]
    assert documented == [f.name for f in dataclasses.fields(TierContext)]


def test_the_threads_it_names_are_the_engines():
    from slidekit.engine.runtime import POOLS

    rows = _table_after("### Which threads call a tier")
    named = {m for row in rows for m in re.findall(r"thread `(slidekit-[\w-]+)`", row[0])}
    assert named == {"slidekit-optim", "slidekit-checkpoint"}
    assert "optim" in POOLS  # lane threads are named slidekit-<lane>
    runtime = (ROOT / "slidekit" / "engine" / "runtime.py").read_text()
    assert 'name=f"slidekit-{self.name}"' in runtime
    assert 'name="slidekit-checkpoint"' in (ROOT / "slidekit" / "checkpoint" / "_write.py").read_text()
