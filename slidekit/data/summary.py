"""The dataset summary a run prints before its first step: what the data became, split by split.

``describe_data`` renders the ``DataStats`` of the training split (and the held-out one) and the
steps per epoch, e.g.::

    data: train.jsonl (chat, completion_only, packed into rows of 512 + 1 tokens)
      train: 1,980 documents, 912,345 tokens, 301,223 labelled, 1,790 rows; 223 steps per epoch (1,790 rows
        // (8 rows x 1 micro-batch); the 6 rows left over start the next epoch)
      held out: 20 documents, 9,876 tokens, 3,210 labelled, 20 rows
      run: 446 steps = 2 epochs of 223 steps

It names documents truncated (packing off) and what that cut: labelled tokens, and documents left
with none, whose rows are dropped like every row without a labelled token.

Test: ``python -m pytest -q tests/test_data_summary.py``.
"""

from __future__ import annotations

from slidekit.data.datasets import DataSpec, DataStats, PackedDataset
from slidekit.data.epochs import StepCount

__all__ = ["describe_data", "describe_split"]


def _n(value: int) -> str:
    return f"{value:,}"


def _count(value: int, word: str) -> str:
    return f"{value:,} {word}{'' if value == 1 else 's'}"


def describe_split(name: str, stats: DataStats, *, packing: bool, seq_len: int) -> str:
    """One split's line: documents, tokens, labelled tokens, rows; what truncation and dropping did."""
    line = (
        f"{name}: {_count(stats.documents, 'document')}, {_count(stats.tokens, 'token')}, "
        f"{_n(stats.labelled)} labelled, {_count(stats.rows, 'row')}"
    )
    notes = []
    if stats.truncated:
        cut = f"{_count(stats.truncated, 'document')} truncated to seq_len + 1 = {seq_len + 1} tokens"
        if stats.cut_labels:
            cut += f", cutting {_count(stats.cut_labels, 'labelled token')}"
        if stats.emptied:
            cut += f"; {stats.emptied:,} of them lost every labelled token (raise --seq-len, or pack)"
        notes.append(cut)
    if stats.dropped_rows:
        notes.append(
            f"{_count(stats.dropped_rows, 'document' if not packing else 'row')} dropped: no labelled token"
        )
    return line + (f" ({'; '.join(notes)})" if notes else "")


def describe_data(
    spec: DataSpec,
    train: PackedDataset,
    held_out: PackedDataset | None,
    *,
    batch_size: int,
    grad_accum: int,
    steps: StepCount | None = None,
) -> str:
    """The summary ``slidekit finetune`` prints before the first step (see the module docstring)."""
    mode = (
        f"packed into rows of {spec.seq_len} + 1 tokens"
        if spec.packing
        else (f"one document per row of {spec.seq_len} + 1 tokens (packing off)")
    )
    fmt = train.stats.format
    what = ", ".join(p for p in (fmt, "completion_only" if spec.completion_only else None, mode) if p)
    where = str(spec.path) + (f" [{spec.split}]" if spec.split != "train" else "")
    lines = [f"data: {where} ({what})"]
    per_step = batch_size * grad_accum
    per_epoch = len(train) // per_step
    accum = f"{grad_accum} micro-batch{'es' if grad_accum != 1 else ''}"
    left = len(train) - per_epoch * per_step
    lines.append(
        "  "
        + describe_split("train", train.stats, packing=spec.packing, seq_len=spec.seq_len)
        + f"; {_count(per_epoch, 'step')} per epoch ({_count(len(train), 'row')} // ({batch_size} rows x {accum})"
        + (f"; the {_count(left, 'row')} left over start the next epoch)" if left else ")")
    )
    if held_out is not None:
        lines.append(
            "  " + describe_split("held out", held_out.stats, packing=spec.packing, seq_len=spec.seq_len)
        )
    if steps is not None:
        lines.append(f"  run: {steps.describe()}")
    return "\n".join(lines)
