"""README.md's suite tables are the committed suites': every figure traced to its raw records.

Issue 15 asks that the README quote only tables of ``slidekit bench`` suites, each from committed raw
records. For each suite README quotes (``QUOTED``), this test regenerates the suite's page from its committed
JSONL (``suite_markdown``, the code that wrote it) and compares it with the committed page, then reads
README's table of that suite and checks every cell against the page: tokens/s (the median over the
repeats), model TFLOPS, the offload efficiency in parentheses, "one run" exactly where the cell has a
single repeat, "does not fit" or "host RAM exhausted" where the run was measured not to fit, "not in the
suite" where the suite has no such run, "not run" where it has none or its time budget left it out, and
the ratio rows (``RATIOS``).
A README edit that drifts from the records, or records edited after the page was written, fails here.

Test: ``pytest tests/test_readme_figures.py``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from slidekit.tools.bench.records import no_room
from slidekit.tools.bench.summary import suite_markdown

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Quoted:
    """A suite table README quotes: its first header cell and the suite's committed page and records."""

    header: str
    records: Path

    @property
    def page(self) -> Path:
        return self.records.with_suffix(".md")


RAW = ROOT / "docs/benchmarks/raw"
QUOTED = [
    Quoted("Qwen2.5-1.5B", RAW / "2026-12-04-s16/suite-1.5b-call3/suite-qwen2.5-1.5b.jsonl"),
    Quoted("Qwen2.5-3B, H100 80 GB", RAW / "2026-12-07-s28/suite-3b-h100/suite-qwen2.5-3b.jsonl"),
    Quoted(
        "Qwen2.5-1.5B offloading, H100 80 GB",
        RAW / "2026-12-06-s25/suite-1.5b-offload-h100/suite-qwen2.5-1.5b-offload.jsonl",
    ),
    Quoted(
        "Qwen2.5-3B offloading, H100 80 GB",
        RAW / "2026-12-06-s26/suite-3b-offload-h100/suite-qwen2.5-3b-offload.jsonl",
    ),
    Quoted(
        "Qwen2.5-7B offloading, H100 80 GB",
        RAW / "2026-12-07-s30/suite-7b-offload-h100/suite-qwen2.5-7b-offload.jsonl",
    ),
]
#: README's row labels -> the suite page's run names.
ROWS = {
    "slidekit, every unit resident": "slidekit (resident all)",
    "slidekit, half the units on the host": "slidekit (resident 0.5)",
    "slidekit, 65% of the units resident": "slidekit (resident 0.65)",
    "slidekit, every master and state on the host": "slidekit (resident none)",
    "slidekit, the planner's choice (`auto`)": "slidekit (resident auto)",
    "HF + Liger, no checkpointing": "HF + Liger (no GC)",
    "HF + Liger, checkpointing": "HF + Liger (GC)",
    "plain HF, checkpointing": "HF (GC)",
    "torchao CPUOffloadOptimizer": "torchao CPUOffloadOptimizer",
    "DeepSpeed ZeRO-2 Offload": "DeepSpeed ZeRO-2 Offload",
    "DeepSpeed ZeRO-3 partial offload (ratio 0.5)": "DeepSpeed ZeRO-3 partial offload (ratio 0.5)",
    "DeepSpeed ZeRO-3 partial offload (ratio 0.35)": "DeepSpeed ZeRO-3 partial offload (ratio 0.35)",
}
#: README's cell for a run measured not to fit -> where the run had no room (``records.no_room`` of the
#: page's reason): out of GPU memory or the planner's refusal (before any allocation), or host RAM.
UNAVAILABLE = {"does not fit": ("gpu", "planner"), "host RAM exhausted": ("host",)}
#: README's ratio rows -> (the slidekit run, the page's column or columns). One column: README's cell
#: starts with the page's ("-" where the page has none, or the suite has no such run there). Several:
#: README's cell is the smallest of them, the fastest alternative's, named in parentheses by its column's
#: name ("vs NAME"), or "-" where none ran.
RATIOS = {
    "all-resident against the best HF recipe": ("slidekit (resident all)", ("vs best no-offload",)),
    "the planner's choice against the best HF recipe": ("slidekit (resident auto)", ("vs best no-offload",)),
    "every state on the host against the best alternative": (
        "slidekit (resident none)",
        ("vs torchao", "vs DeepSpeed", "vs DS partial"),
    ),
    "half on the host against DeepSpeed's partial offload": ("slidekit (resident 0.5)", ("vs DS partial",)),
}
#: A README cell: tokens/s, optionally (TFLOPS) or (offload efficiency), optionally marked a single run.
CELL = re.compile(r"([\d,]+)(?: \((?:(\d+) TFLOPS|([\d.]+)(?: of all-resident)?)\))?(, one run)?")


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


def _page_cells(page: Path, batches: list[int]) -> dict[tuple[float | None, str, int], dict[str, str]]:
    """(max_grad_norm or None, run, batch) -> its cells, from the page's table of each recipe. A row whose
    batch is "all" (the run was unavailable at every batch) stands for each of ``batches``."""
    cells: dict[tuple[float | None, str, int], dict[str, str]] = {}
    for part in page.read_text().split("### Recipe: ")[1:]:
        title = part.splitlines()[0]
        clip = None if title == "no clipping" else float(title.removeprefix("max_grad_norm "))
        rows = _table(part, "run")
        header = rows[0]
        for r in rows[2:]:
            row = dict(zip(header, r, strict=True))
            stands_for = [int(r[1])] if r[1].isdigit() else (batches if r[1] == "all" else [])
            for batch in stands_for:
                cells[(clip, r[0], batch)] = row
    return cells


def _column(header: str) -> tuple[float | None, int]:
    """A README column, "batch 8" or "batch 8, max_grad_norm 1.0": (max_grad_norm or None, batch)."""
    m = re.fullmatch(r"batch (\d+)(?:, max_grad_norm ([\d.]+))?", header)
    assert m, header
    return (float(m.group(2)) if m.group(2) else None, int(m.group(1)))


def _check_ratio(label: str, cell: dict[str, str] | None, value: str) -> None:
    """README's ratio cell ``value`` against the slidekit run's page cell (``RATIOS``; None where the
    suite has no such run at that batch and recipe: then README says "-")."""
    columns = RATIOS[label][1]
    if cell is None:
        assert value == "-", (label, value)
        return
    if len(columns) == 1:
        page = cell[columns[0]]
        assert page.startswith(value) if value != "-" else page == "-", (label, value, page)
        return
    ratios = {c.removeprefix("vs "): float(cell[c].rstrip("x")) for c in columns if cell[c] != "-"}
    if value == "-":  # no alternative ran at this batch and recipe
        assert not ratios, (label, ratios)
        return
    best = min(ratios, key=ratios.__getitem__)
    m = re.fullmatch(r"([\d.]+)x \(([\w ]+)\)", value)
    assert m, (label, value)
    assert float(m.group(1)) == ratios[best] and m.group(2) == best, (label, value, ratios)


@pytest.mark.parametrize("quoted", QUOTED, ids=lambda q: q.header)
def test_the_suite_page_is_what_its_committed_records_give(quoted):
    lines = [json.loads(line) for line in quoted.records.read_text().splitlines() if line.strip()]
    header, rows = lines[0], lines[1:]
    assert header["record"] == "suite"
    page = suite_markdown(header, rows, records_name=quoted.records.name)
    assert page.strip() == quoted.page.read_text().strip()


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _repeats(tokens: str) -> int:
    """How many repeats a page's tokens/s cell has: its "(n)" after the [min-max]."""
    found = re.match(r"[\d,]+ \[[\d,]+-[\d,]+\] \((\d+)\)", tokens)
    assert found, f"not a tokens/s cell with its repeats: {tokens!r}"
    return int(found.group(1))


@pytest.mark.parametrize("quoted", QUOTED, ids=lambda q: q.header)
def test_readmes_table_is_the_suites_cells(quoted):
    readme = (ROOT / "README.md").read_text()
    for path in (quoted.page, quoted.records):
        assert f"]({path.relative_to(ROOT).as_posix()})" in readme, path
    table = _table(readme, quoted.header)
    columns = [_column(h) for h in table[0][1:]]
    cells = _page_cells(quoted.page, [batch for _, batch in columns])
    seen = 0
    for row in table[2:]:
        label, values = row[0], row[1:]
        if label in RATIOS:
            for (clip, batch), value in zip(columns, values, strict=True):
                _check_ratio(label, cells.get((clip, RATIOS[label][0], batch)), value)
                seen += 1
            continue
        run = ROWS[label]
        for (clip, batch), value in zip(columns, values, strict=True):
            cell = cells.get((clip, run, batch))
            seen += 1
            if value == "not in the suite":  # the suite has no such run at this batch and recipe
                assert cell is None, (run, batch, value)
                continue
            if value == "not run":  # not in the suite at this batch, or left out by the time budget
                assert cell is None or cell["tokens/s median [min-max] (n)"].startswith("not run"), (run, batch)
                continue
            assert cell is not None, (run, batch, value)
            tokens = cell["tokens/s median [min-max] (n)"]
            unavailable = next((u for u in UNAVAILABLE if value.startswith(u)), None)
            if unavailable is not None:
                measured = {"status": "unavailable", "reason": tokens.removeprefix("unavailable: ")}
                assert no_room(measured) in UNAVAILABLE[unavailable], (run, batch, value, tokens)
                continue
            m = CELL.fullmatch(value)
            assert m, (label, value)
            assert tokens.split(" ")[0] == m.group(1), (run, batch, value, tokens)
            assert (_repeats(tokens) == 1) == bool(m.group(4)), (run, batch, value, tokens)  # "one run" marked
            if m.group(2):
                assert cell["TFLOPS"] == m.group(2), (run, batch)
            if m.group(3):
                assert cell["offload efficiency"] == m.group(3), (run, batch)
    assert seen == (len(table) - 2) * len(columns)


@pytest.mark.parametrize("path", [p for q in QUOTED for p in (q.records, q.page)], ids=str)
def test_the_records_are_committed(path):
    assert path.is_file() and path.stat().st_size > 0
