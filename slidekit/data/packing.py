"""Framing, packing and padding tokenized documents into rows, and the held-out split.

Each document becomes ``[BOS] tokens [EOS]`` (BOS only if the tokenizer has one; neither is doubled
when the chat template already wrote it). Packing concatenates the framed documents and cuts rows
of ``seq_len + 1`` tokens (the last row padded). Across a boundary the targets are ``last -> EOS``
(the document ends) and ``EOS -> BOS`` (a new one starts): real next-token targets, never ``last ->
first of the next document``. They carry loss unless ``completion_only``, where EOS carries the loss
of the token before it (a completion learns to stop) and BOS none. ``packing=False`` puts one framed
document per row, truncated to ``seq_len + 1`` or right-padded with the pad token, padding carrying
no loss.

``eval_fraction`` of the documents (not rows) is held out by a seeded permutation, so the split
depends only on the file and the seed.

Test: ``python -m pytest -q tests/test_data.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from slidekit.data.tokens import Documents
from slidekit.errors import ConfigError

__all__ = ["frame_documents", "pack_rows", "pad_rows", "split_documents"]


def split_documents(n_docs: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) document indices, each ascending: ``round(eval_fraction * n_docs)`` held out by seed."""
    n_eval = round(eval_fraction * n_docs)
    if eval_fraction > 0:
        if n_docs < 2:
            raise ConfigError(
                f"eval_fraction {eval_fraction} needs at least 2 documents; the data holds {n_docs}"
            )
        n_eval = min(max(n_eval, 1), n_docs - 1)
    order = torch.randperm(n_docs, generator=torch.Generator().manual_seed(seed)).numpy()
    return np.sort(order[n_eval:]), np.sort(order[:n_eval])


def frame_documents(
    docs: Documents, index: np.ndarray, tokenizer: Any, completion_only: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[BOS] doc [EOS]`` for the documents in ``index``, concatenated: (ids, loss, offsets)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            "the tokenizer has no eos_token, so documents cannot be separated; use one that has"
        )
    starts = docs.offsets[index]
    lengths = docs.offsets[index + 1] - starts
    full = lengths > 0
    ids_x, loss_x = np.append(docs.ids, -1), np.append(docs.loss, False)  # a sentinel for empty documents
    last = starts + lengths - 1  # -1 (the sentinel) or a neighbour's token for empty ones: masked by ``full``
    add_bos = np.full(len(index), bos is not None) & ~(full & (ids_x[starts] == bos))
    add_eos = ~(full & (ids_x[last] == eos))
    eos_loss = (full & loss_x[last]) if completion_only else np.ones(len(index), dtype=bool)
    offsets = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(add_bos + lengths + add_eos, out=offsets[1:])
    total = int(offsets[-1])
    ids, loss = np.empty(total, dtype=np.int32), np.empty(total, dtype=bool)
    first_at, eos_at = offsets[:-1][add_bos], offsets[1:][add_eos] - 1
    body = np.ones(total, dtype=bool)
    body[first_at], body[eos_at] = False, False
    src = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
    ids[body], loss[body] = docs.ids[src], docs.loss[src]
    ids[first_at], loss[first_at] = bos if bos is not None else 0, not completion_only
    ids[eos_at], loss[eos_at] = eos, eos_loss[add_eos]
    return ids, loss, offsets


def pack_rows(ids: np.ndarray, loss: np.ndarray, width: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """The stream cut into rows of ``width`` tokens, the last row right-padded: (rows, loss), (R, width)."""
    n_rows = -(-len(ids) // width)
    rows, rows_loss = np.full(n_rows * width, pad, dtype=np.int32), np.zeros(n_rows * width, dtype=bool)
    rows[: len(ids)], rows_loss[: len(ids)] = ids, loss
    return rows.reshape(n_rows, width), rows_loss.reshape(n_rows, width)


def pad_rows(
    ids: np.ndarray, loss: np.ndarray, offsets: np.ndarray, width: int, pad: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """One framed document per row, truncated or right-padded to ``width``: (rows, loss, truncated)."""
    lengths = np.diff(offsets)
    keep = np.minimum(lengths, width)
    rows, rows_loss = (
        np.full((len(lengths), width), pad, dtype=np.int32),
        np.zeros((len(lengths), width), dtype=bool),
    )
    row = np.repeat(np.arange(len(lengths)), keep)
    col = np.arange(int(keep.sum())) - np.repeat(np.cumsum(keep) - keep, keep)
    src = np.repeat(offsets[:-1], keep) + col
    rows[row, col], rows_loss[row, col] = ids[src], loss[src]
    return rows, rows_loss, int((lengths > width).sum())
