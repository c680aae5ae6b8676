"""The levers' table of a suite: what kept activations and speculative clipping change, as ratios.

A suite whose modes set levers (``suites.Mode.recompute``, ``Mode.clip_overlap``; their rows carry
``levers``) gets this section after its main tables (``levers_markdown``, empty otherwise). Every
figure is a ratio of medians over the repeats (``summary.cells``) between cells of the same batch and
GPUs:

- kept activations (every slidekit cell whose mode sets ``recompute``): its tokens/s over the same
  mode's with ``recompute`` "all" (every layer recomputed: kept / recomputed), and over HF + Liger
  with gradient checkpointing and without it at the same recipe (the issue's 1.2x / 1.0x);
- clipping (every clipped slidekit cell): its tokens/s over the same mode's unclipped cell (the mode
  without ``clip_overlap``: clipped / unclipped per overlap mode), and per repeat how many of its timed
  steps rolled back and how many speculated (the records' per-step ``clip_rollback`` and
  ``clip_speculated``, the Trainer's step metrics).

"Same mode" means the same residency, optimizer, state placement and GPUs, the other levers equal.
Test: ``pytest tests/test_bench_levers.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from slidekit.tools.bench.summary import Cell, _recipe, cells

__all__ = ["clip_rows", "kept_rows", "levers_markdown"]

_LIGER = (("liger_gc", "vs HF + Liger (GC)"), ("liger", "vs HF + Liger (no GC)"))


def _levers(cell: Cell) -> dict[str, str]:
    return dict(cell.ok[0].get("levers") or {}) if cell.ok else {}


def _mode(cell: Cell, drop: str) -> tuple[Any, ...]:
    """What makes two slidekit cells the same mode but for lever ``drop`` (and the recipe)."""
    r = cell.ok[0]
    others = sorted((k, v) for k, v in _levers(cell).items() if k != drop)
    placement = json.dumps(r.get("state_offload"))
    return (r.get("resident"), r.get("optimizer"), placement, cell.ranks, cell.batch, tuple(others))


def _ratio(a: Cell, b: Cell | None) -> float | None:
    if b is None or not a.median_tokens or not b.median_tokens:
        return None
    return round(a.median_tokens / b.median_tokens, 3)


def kept_rows(found: Sequence[Cell]) -> list[dict[str, Any]]:
    """Per slidekit cell that sets ``recompute``: its ratios (module docstring), in ``found``'s order."""
    ok = [c for c in found if c.ok]
    out = []
    for c in ok:
        recompute = _levers(c).get("recompute")
        if c.system != "slidekit" or recompute is None:
            continue
        ref = next(
            (
                o
                for o in ok
                if o.system == "slidekit"
                and _levers(o).get("recompute") == "all"
                and o.clip == c.clip
                and _mode(o, "recompute") == _mode(c, "recompute")
            ),
            None,
        )
        row: dict[str, Any] = {"cell": c, "recompute": recompute, "kept": c.med("kept_layers")}
        row["vs_recompute_all"] = None if recompute == "all" else _ratio(c, ref)
        for system, _ in _LIGER:
            same = (c.clip, c.batch, c.ranks)
            alt = next((o for o in ok if o.system == system and (o.clip, o.batch, o.ranks) == same), None)
            row[f"vs_{system}"] = _ratio(c, alt)
        out.append(row)
    return out


def clip_rows(found: Sequence[Cell]) -> list[dict[str, Any]]:
    """Per clipped slidekit cell: its tokens/s over its mode's unclipped cell, and its steps' rollbacks."""
    ok = [c for c in found if c.ok]
    out = []
    for c in ok:
        if c.system != "slidekit" or c.clip is None:
            continue
        plain = next(
            (
                o
                for o in ok
                if o.system == "slidekit"
                and o.clip is None
                and "clip_overlap" not in _levers(o)
                and _mode(o, "clip_overlap") == _mode(c, "clip_overlap")
            ),
            None,
        )
        steps = []
        for r in c.ok:
            rolled, speculated = list(r.get("clip_rollback") or []), list(r.get("clip_speculated") or [])
            steps.append((sum(rolled), sum(speculated), len(rolled)))
        out.append(
            {
                "cell": c,
                "clip_overlap": _levers(c).get("clip_overlap", "auto"),
                "vs_unclipped": _ratio(c, plain),
                "steps": steps,  # per repeat: (rolled back, speculated, timed steps)
            }
        )
    return out


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _tokens(c: Cell) -> str:
    assert c.median_tokens is not None
    return f"{c.median_tokens:,.0f} ({len(c.ok)})"


def levers_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The levers' section (module docstring); "" when no row's mode sets a lever."""
    runs = [r for r in rows if r.get("record", "run") == "run"]
    if not any(r.get("levers") for r in runs):
        return ""
    found = cells(runs)
    lines = ["### Levers (ratios of medians over the repeats, same batch and GPUs)", ""]
    kept = kept_rows(found)
    if kept:
        head = ["run", "recipe", "batch", "tokens/s (n)", "layers keeping", "kept / recomputed"]
        head += [name for _, name in _LIGER]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for k in kept:
            c = k["cell"]
            out = [c.label, _recipe(c.clip), str(c.batch), _tokens(c), _f(k["kept"], "{:.0f}")]
            out += [_f(k["vs_recompute_all"], "{:.2f}x")]
            out += [_f(k[f"vs_{s}"], "{:.2f}x") for s, _ in _LIGER]
            lines.append("| " + " | ".join(out) + " |")
        lines.append("")
    clipped = clip_rows(found)
    if clipped:
        head = ["run", "recipe", "batch", "tokens/s (n)", "clipped / unclipped"]
        head += ["timed steps rolled back / speculated, per repeat"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for k in clipped:
            c = k["cell"]
            per = "; ".join(
                f"{r}/{n} rolled back, {s}/{n} speculated" if n else "not recorded" for r, s, n in k["steps"]
            )
            out = [c.label, _recipe(c.clip), str(c.batch), _tokens(c), _f(k["vs_unclipped"], "{:.2f}x"), per]
            lines.append("| " + " | ".join(out) + " |")
        lines.append("")
    return "\n".join(lines)
