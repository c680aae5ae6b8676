"""What a training step takes: micro-batches of ``(input_ids, labels)``, checked before anything runs.

Each micro-batch is a pair of integer tensors of one shape (B, T): token ids
and, per position, the id of the next token, or -100 where no loss is taken.
Micro-batches of one step may differ in B and in T (per-batch dynamic
padding gives exactly that); the step equals one step on all their rows
padded to the longest, with label -100 on the padding.

Labels are already shifted (``labels[b, t]`` is the token after
``input_ids[b, t]``), unlike Hugging Face, where ``labels == input_ids`` and the
model shifts. ``shift_hf_labels`` turns HF-style labels into slidekit's (what
``Batch.from_hf`` does); ``check_shifted`` refuses labels that equal the inputs
wherever they carry loss although the next token differs: HF-style labels passed
as they are, which would train the model to copy its input. ``check_pair`` is the
shape and dtype check that ``slidekit.Batch`` runs when it is built;
``seq_len_refusal`` says why a configured ``data.seq_len`` is beyond the
model's positions, before anything is built (the planner, the trainer);
``check_step`` is the engine's check of a whole step against the model
(vocabulary, positions), run before any transfer or kernel so that bad input
fails with its cause rather than inside a kernel (on CUDA an out-of-range id
is a device-side assert that poisons the process).

Test: ``python -m pytest -q tests/test_inputs.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "IGNORE_INDEX",
    "TOKEN_DTYPES",
    "check_pair",
    "check_shifted",
    "check_step",
    "seq_len_refusal",
    "shift_hf_labels",
]

#: The label of a position that carries no loss (as in ``torch.nn.functional.cross_entropy``).
IGNORE_INDEX = -100

#: The dtypes token ids and labels may have.
TOKEN_DTYPES = (torch.int64, torch.int32)


def seq_len_refusal(seq_len: int, max_positions: int) -> str | None:
    """Why ``data.seq_len`` cannot train this model (it exceeds ``max_positions``), or None when it can:
    a model limit, which no memory placement changes."""
    if seq_len <= max_positions:
        return None
    return (
        f"data.seq_len {seq_len} exceeds the model's max_position_embeddings {max_positions}; "
        f"use a seq_len of at most {max_positions} (CLI: --seq-len)"
    )


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_pair(input_ids: Any, labels: Any, where: str = "") -> None:
    """Refuse an ``(input_ids, labels)`` pair that is not two integer tensors of one (batch, seq_len) shape.

    ``where`` prefixes the message (e.g. "micro-batch 2: "). Raises TypeError
    for a wrong type or dtype, ValueError for a wrong shape.
    """
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{where}{name} must be a torch.Tensor (batch, seq_len), got {type(t).__name__}")
    if input_ids.dim() != 2 or labels.dim() != 2:
        raise ValueError(
            f"{where}input_ids {_shape(input_ids)} and labels {_shape(labels)} must both be 2-D "
            "(batch, seq_len); a single sequence needs a batch dimension (.unsqueeze(0))"
        )
    if input_ids.shape != labels.shape:
        raise ValueError(
            f"{where}input_ids {_shape(input_ids)} and labels {_shape(labels)} must have the same shape: "
            "labels[b, t] is the token that follows input_ids[b, t] (or -100 for no loss)"
        )
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if t.dtype not in TOKEN_DTYPES:
            raise TypeError(
                f"{where}{name} has dtype {t.dtype}; token ids must be torch.int64 or torch.int32 "
                "(convert with .long())"
            )


def check_shifted(input_ids: torch.Tensor, labels: torch.Tensor, where: str = "") -> None:
    """Refuse Hugging Face-style (unshifted) labels: equal to ``input_ids`` at every labelled position,
    where at some labelled position the next input token differs, so shifted labels would not equal it.

    Shifted labels of contiguous text never pass that test (``labels[t] = input_ids[t + 1]``, which
    differs from ``input_ids[t]`` there), so no real batch is refused. Raises ValueError.
    """
    target = labels != IGNORE_INDEX
    if not bool(target.any()) or not torch.equal(labels[target], input_ids[target].to(labels.dtype)):
        return
    changes = input_ids[:, 1:] != input_ids[:, :-1]  # (B, T - 1): the next token differs
    if bool((changes & target[:, :-1]).any()):
        raise ValueError(
            f"{where}labels equal input_ids at every labelled position: Hugging Face-style labels (the model "
            "shifts them), but slidekit takes labels already shifted (labels[b, t] is the token after "
            "input_ids[b, t]); trained as given, the model would learn to copy its input. Build the batch "
            "with slidekit.Batch.from_hf(input_ids, labels, attention_mask), which shifts"
        )


def shift_hf_labels(
    input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """slidekit's labels (B, T) from Hugging Face-style ones: ``labels`` (default ``input_ids``), -100
    where ``attention_mask`` is 0, shifted one position left with -100 last, as transformers' causal-LM
    loss shifts them. Padding must be on the right: slidekit's attention is causal and takes no mask,
    so a real token after padding would attend to it (ValueError)."""
    labels = input_ids if labels is None else labels
    check_pair(input_ids, labels, "Batch.from_hf: ")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = (
                tuple(attention_mask.shape)
                if isinstance(attention_mask, torch.Tensor)
                else type(attention_mask)
            )
            raise ValueError(
                f"Batch.from_hf: attention_mask {got} must be a tensor of input_ids' shape {_shape(input_ids)}"
            )
        real = attention_mask != 0
        left = (real[:, 1:] & ~real[:, :-1]).any(dim=1)  # a real token right after padding
        if bool(left.any()):
            row = int(left.nonzero()[0])
            raise ValueError(
                f"Batch.from_hf: row {row} of attention_mask has padding before a real token (left padding); "
                "slidekit's attention is causal and takes no mask, so padding must be on the right "
                "(tokenizer.padding_side = 'right')"
            )
        labels = labels.masked_fill(~real, IGNORE_INDEX)
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def check_step(micro: Sequence[Any], *, vocab_size: int, max_positions: int) -> int:
    """Check every ``(input_ids, labels)`` micro-batch of a step; return the number of labelled tokens.

    Beyond ``check_pair`` and ``check_shifted``: each micro-batch holds at least one token and at
    most ``max_positions`` per row, its ids lie in ``[0, vocab_size)``, its
    labels there too or at -100, and the step has a labelled token.
    """
    if isinstance(micro, torch.Tensor) or not isinstance(micro, Sequence):
        raise TypeError(
            f"a step takes a sequence of (input_ids, labels) micro-batches, got {type(micro).__name__}"
        )
    if not micro:
        raise ValueError("a step needs at least one micro-batch")
    labelled = 0
    for i, pair in enumerate(micro, 1):
        where = f"micro-batch {i} of {len(micro)}: "
        if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(
                f"{where}expected a pair (input_ids, labels), got {type(pair).__name__} "
                "(for a Batch b: (b.input_ids, b.labels))"
            )
        ids, labels = pair
        check_pair(ids, labels, where)
        rows, length = ids.shape
        if rows == 0 or length == 0:
            raise ValueError(
                f"{where}input_ids {_shape(ids)} is empty; a micro-batch needs a row and a token"
            )
        if length > max_positions:
            raise ValueError(
                f"{where}{length} tokens per row, more than the model's {max_positions} positions "
                "(max_position_embeddings); cut the rows to at most that"
            )
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{where}input_ids hold token id {bad}, outside the model's vocabulary of {vocab_size} "
                f"(ids 0..{vocab_size - 1}); use the tokenizer that belongs to the model"
            )
        target = labels != IGNORE_INDEX
        count = int(target.sum())
        if count:
            lo, hi = (int(v) for v in torch.aminmax(labels[target]))
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"{where}labels hold {bad}, neither a token id of the vocabulary of {vocab_size} "
                    f"(0..{vocab_size - 1}) nor {IGNORE_INDEX} (no loss)"
                )
        check_shifted(ids, labels, where)
        labelled += count
    if labelled == 0:
        raise ValueError("the batch has no labelled token (every label is -100); nothing to learn from")
    return labelled
