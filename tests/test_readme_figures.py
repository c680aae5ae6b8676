"""README.md's suite table is the committed suite's: every figure traced to its raw records.

Issue 15 asks that the README quote only tables of ``slidekit bench`` suites, each from committed raw
records. This test regenerates the suite's page from its committed JSONL (``suite_markdown``, the
code that wrote it) and compares it with the committed page, then reads README's table of that suite
and checks every cell against the page: tokens/s (the median over the repeats), model TFLOPS, the
offload efficiency in parentheses, "does not fit" where the run was unavailable, and the last row's
ratio against the best HF recipe. A README edit that drifts from the records, or records edited
after the page was written, fails here.

Test: ``pytest tests/test_readme_figures.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from slidekit.tools.bench.summary import suite_markdown

ROOT = Path(__file__).resolve().parents[1]
SUITE_DIR = ROOT / "docs/benchmarks/raw/2026-12-04-s16/suite-1.5b-call3"
RECORDS = SUITE_DIR / "suite-qwen2.5-1.5b.jsonl"
PAGE = SUITE_DIR / "suite-qwen2.5-1.5b.md"
#: README's row labels -> the suite page's run names.
ROWS = {
    "slidekit, every unit resident": "slidekit (resident all)",
    "slidekit, half the units on the host": "slidekit (resident 0.5)",
    "slidekit, every master and state on the host": "slidekit (resident none)",
    "slidekit, the planner's choice (`auto`)": "slidekit (resident auto)",
    "HF + Liger, no checkpointing": "HF + Liger (no GC)",
    "HF + Liger, checkpointing": "HF + Liger (GC)",
    "plain HF, checkpointing": "HF (GC)",
}


def _table(text: str, first_header: str) -> list[list[str]]:
    """The markdown table whose header row starts with ``| first_header |``: its rows' cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _page_cells() -> dict[tuple[str, int], list[str]]:
    """(run, batch) -> its cells, in the page's first table (the recipe without clipping)."""
    rows = _table(PAGE.read_text(), "run")
    header = rows[0]
    return {(r[0], int(r[1])): dict(zip(header, r, strict=True)) for r in rows[2:]}


def test_the_suite_page_is_what_its_committed_records_give():
    lines = [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]
    header, rows = lines[0], lines[1:]
    assert header["record"] == "suite"
    assert suite_markdown(header, rows, records_name=RECORDS.name).strip() == PAGE.read_text().strip()


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def test_readmes_table_is_the_suites_cells():
    readme = (ROOT / "README.md").read_text()
    assert f"]({PAGE.relative_to(ROOT).as_posix()})" in readme and f"]({RECORDS.relative_to(ROOT).as_posix()})" in readme
    table = _table(readme, "Qwen2.5-1.5B")
    batches = [int(re.search(r"batch (\d+)", h).group(1)) for h in table[0][1:]]
    cells = _page_cells()
    seen = 0
    for row in table[2:]:
        label, values = row[0], row[1:]
        if label.startswith("all-resident against"):
            for batch, value in zip(batches, values, strict=True):
                ratio = cells[("slidekit (resident all)", batch)]["vs best no-offload"]
                assert ratio.startswith(value), (batch, value, ratio)
                seen += 1
            continue
        run = ROWS[label]
        for batch, value in zip(batches, values, strict=True):
            cell = cells[(run, batch)]
            tokens = cell["tokens/s median [min-max] (n)"]
            if value.startswith("does not fit"):
                assert tokens.startswith("unavailable: does not fit"), (run, batch, tokens)
                seen += 1
                continue
            m = re.fullmatch(r"([\d,]+)(?: \((?:(\d+) TFLOPS|([\d.]+)(?: of all-resident)?)\))?", value)
            assert m, (label, value)
            assert tokens.split(" ")[0] == m.group(1), (run, batch, value, tokens)
            if m.group(2):
                assert cell["TFLOPS"] == m.group(2), (run, batch)
            if m.group(3):
                assert cell["offload efficiency"] == m.group(3), (run, batch)
            seen += 1
    assert seen == (len(ROWS) + 1) * len(batches)


@pytest.mark.parametrize("path", [RECORDS, PAGE])
def test_the_records_are_committed(path):
    assert path.is_file() and path.stat().st_size > 0
