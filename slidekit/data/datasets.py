"""Datasets and batches: the packed rows of a data source, split, and served as micro-batches.

The label convention. A ``Batch`` holds labels *already shifted*: ``labels[b, t]`` is the token
that follows ``input_ids[b, t]``, so the engine takes the loss of position t against labels[b, t]
as they are. Hugging Face models take ``labels == input_ids`` and shift inside the model; a batch
built that way must go through ``Batch.from_hf``, which shifts. A Batch whose labels equal its
inputs at every labelled position, where shifted labels could not (the next token differs), is
refused: trained as given, the model would learn to copy its input.

A row gives ``input_ids = row[:-1]`` and ``labels = row[1:]``, label -100 where the target carries
no loss. Rows without a single labelled token are dropped (a step must have something to learn
from); packed training data must fill at least one row. Training batches are endless: each epoch is
a fresh permutation of the rows from a generator seeded by the ``batches`` seed. Evaluation batches
are one pass in file order.

Test: ``python -m pytest -q tests/test_data.py tests/test_hf_labels.py tests/test_data_summary.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidekit.data.formats import FORMATS
from slidekit.data.packing import frame_documents, pack_rows, pad_rows, split_documents
from slidekit.data.sources import open_records
from slidekit.data.tokens import Documents, tokenize_records
from slidekit.errors import ConfigError
from slidekit.inputs import IGNORE_INDEX, check_pair, check_shifted, shift_hf_labels

__all__ = ["Batch", "DataSpec", "DataStats", "PackedDataset", "build_datasets"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One micro-batch: ``input_ids`` and ``labels``, integer tensors (B, T); label -100 where no loss is taken.

    ``labels[b, t]`` is the token that follows ``input_ids[b, t]``: labels are already shifted, unlike
    Hugging Face's ``labels == input_ids`` (the model shifts). For HF-style tensors use
    ``Batch.from_hf(input_ids, labels=None, attention_mask=None)``; a Batch built directly from
    HF-style labels (equal to the inputs wherever they carry loss) is refused with that advice. Batches of
    one step (``grad_accum``) may differ in B and T; padding them to the
    longest row, with label -100 on the padding, changes nothing (causal
    attention: a real token never sees the padding after it). The model's
    ``pad_token_id`` (from its config.json) gets no gradient through the
    embedding lookup, as in transformers (``nn.Embedding(padding_idx=...)``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        check_pair(self.input_ids, self.labels)
        check_shifted(self.input_ids, self.labels)

    @classmethod
    def from_hf(
        cls,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Batch:
        """A Batch from Hugging Face-style tensors, (B, T) each: ``labels`` (default: ``input_ids``) are
        those a transformers causal LM takes, unshifted, -100 for no loss; ``attention_mask`` 0 marks
        padding, whose labels become -100. Shifted as transformers shifts: ``labels[b, t]`` becomes
        ``labels[b, t + 1]`` and the last position carries no loss, so the loss equals the HF model's.
        Padding must be on the right (slidekit's attention is causal, with no mask)."""
        return cls(input_ids, shift_hf_labels(input_ids, labels, attention_mask))


@dataclass(frozen=True, kw_only=True, slots=True)
class DataSpec:
    """What ``build_datasets`` builds."""

    path: str | Path  # the JSONL file or a datasets source (``slidekit.data.sources``; ``~`` is expanded)
    format: str = "auto"  # one of FORMATS; "auto" reads it off the first record (or the columns)
    split: str = "train"  # the split of a dataset with splits
    columns: Mapping[str, str] = field(default_factory=dict)  # record field -> the column that holds it
    seq_len: int = 128  # tokens per row (each row holds seq_len + 1: inputs and shifted labels)
    completion_only: bool = False  # loss on completions / assistant turns only (not for "text")
    packing: bool = True  # concatenate documents into full rows; False: one padded document per row
    eval_fraction: float = 0.0  # fraction of documents held out for evaluation (0: none)
    seed: int = 0  # seeds the held-out split (the batch order has its own seed)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ConfigError(f"data format {self.format!r} is unknown; choose one of: {', '.join(FORMATS)}")
        if self.seq_len <= 0:
            raise ConfigError(f"data seq_len must be > 0, got {self.seq_len}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data eval_fraction must be in [0, 1), got {self.eval_fraction}")


@dataclass(frozen=True, slots=True)
class DataStats:
    """What went into a dataset, for the run's log."""

    documents: int  # documents in this split
    tokens: int  # framed tokens (with BOS/EOS), before padding or truncation
    labelled: int  # labels that carry loss, over all kept rows
    rows: int  # rows kept
    truncated: int = 0  # documents cut to seq_len + 1 (packing=False)
    dropped_rows: int = 0  # rows without a single labelled token, left out
    cut_labels: int = 0  # labelled tokens the truncation cut off (packing=False)
    emptied: int = 0  # documents whose every labelled token the truncation cut off (among dropped_rows)
    format: str = ""  # the records' format (FORMATS), when known


class PackedDataset:
    """Rows of ``seq_len + 1`` token ids and their loss flags; batches for training or evaluation."""

    def __init__(self, rows: torch.Tensor, loss: torch.Tensor, stats: DataStats | None = None) -> None:
        if rows.dim() != 2 or rows.shape != loss.shape or rows.shape[1] < 2:
            raise ValueError(
                f"rows {tuple(rows.shape)} and loss {tuple(loss.shape)} must be (N, seq_len + 1)"
            )
        self.rows = rows  # (N, T + 1) int32 token ids
        self.loss = loss  # (N, T + 1) bool: predicting this token carries loss (column 0 is never a target)
        self.stats = stats or DataStats(len(rows), rows.numel(), int(loss[:, 1:].sum()), len(rows))

    @property
    def seq_len(self) -> int:
        return self.rows.shape[1] - 1

    def __len__(self) -> int:
        return self.rows.shape[0]

    def max_token_id(self) -> int:
        return int(self.rows.max()) if len(self) else -1

    def batch(self, index: torch.Tensor) -> Batch:
        """The rows at ``index`` as a Batch: inputs ``row[:-1]``, labels ``row[1:]`` (-100 without loss)."""
        rows = self.rows[index].long()
        labels = rows[:, 1:].masked_fill(~self.loss[index][:, 1:], IGNORE_INDEX)
        return Batch(rows[:, :-1].contiguous(), labels)

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """Endless training batches; each epoch is a fresh seeded permutation of the rows."""
        if batch_size <= 0 or len(self) == 0:
            raise ConfigError(
                f"cannot batch {len(self)} rows by {batch_size}; need rows and a batch_size > 0"
            )
        gen = torch.Generator().manual_seed(seed)
        order = torch.empty(0, dtype=torch.int64)
        while True:
            while order.numel() < batch_size:
                order = torch.cat([order, torch.randperm(len(self), generator=gen)])
            take, order = order[:batch_size], order[batch_size:]
            yield self.batch(take)

    def one_pass(self, batch_size: int) -> Iterator[Batch]:
        """Every row once, in order (the last batch may be smaller): for evaluation."""
        if batch_size <= 0:
            raise ConfigError(f"batch_size must be > 0, got {batch_size}")
        for lo in range(0, len(self), batch_size):
            yield self.batch(torch.arange(lo, min(lo + batch_size, len(self))))

    @classmethod
    def from_documents(
        cls,
        docs: Documents,
        index: np.ndarray,
        tokenizer: Any,
        *,
        seq_len: int,
        packing: bool = True,
        completion_only: bool = False,
    ) -> PackedDataset:
        """Frame, pack (or pad) and keep the rows that carry loss, for the documents in ``index``."""
        ids, loss, offsets = frame_documents(docs, index, tokenizer, completion_only)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        truncated, cut, emptied = 0, 0, 0
        if packing:
            rows, rows_loss = pack_rows(ids, loss, seq_len + 1, pad)
        else:
            rows, rows_loss, truncated = pad_rows(ids, loss, offsets, seq_len + 1, pad)
            cut, emptied = _truncation_losses(loss, offsets, seq_len + 1)
        keep = rows_loss[:, 1:].any(axis=1)
        stats = DataStats(
            documents=len(index),
            tokens=len(ids),
            labelled=int(rows_loss[keep, 1:].sum()),
            rows=int(keep.sum()),
            truncated=truncated,
            dropped_rows=int((~keep).sum()),
            cut_labels=cut,
            emptied=emptied,
        )
        return cls(torch.from_numpy(rows[keep]), torch.from_numpy(rows_loss[keep]), stats)

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Any, seq_len: int) -> PackedDataset:
        """Packed rows of plain texts, every token labelled (the trainer's path until it uses build_datasets)."""
        docs = tokenize_records(((f"text {i}", t) for i, t in enumerate(texts)), "text", tokenizer)
        return cls.from_documents(docs, np.arange(len(docs)), tokenizer, seq_len=seq_len)


def _truncation_losses(loss: np.ndarray, offsets: np.ndarray, width: int) -> tuple[int, int]:
    """(labelled targets cut off, documents left with none) when each framed document is cut to ``width``."""
    sums = np.concatenate([[0], np.cumsum(loss, dtype=np.int64)])
    starts, lengths = offsets[:-1], np.diff(offsets)
    before = sums[offsets[1:]] - sums[starts + 1]  # targets: every token but the row's first
    after = sums[starts + np.minimum(lengths, width)] - sums[starts + 1]
    return int((before - after).sum()), int(((before > 0) & (after == 0)).sum())


def _split_dataset(
    docs: Documents, index: np.ndarray, spec: DataSpec, tokenizer: Any, name: str, fmt: str
) -> PackedDataset:
    ds = PackedDataset.from_documents(
        docs,
        index,
        tokenizer,
        seq_len=spec.seq_len,
        packing=spec.packing,
        completion_only=spec.completion_only,
    )
    ds.stats = dataclasses.replace(ds.stats, format=fmt)
    width = spec.seq_len + 1
    if not len(ds) and ds.stats.emptied:
        raise ConfigError(
            f"the {len(index)} {name} documents of {spec.path} carry labelled tokens, but only beyond "
            f"seq_len + 1 = {width} tokens: packing is off, so each document is cut there ({ds.stats.truncated} "
            f"{'was' if ds.stats.truncated == 1 else 'were'}), which removed every labelled token (all "
            f"{ds.stats.cut_labels}); raise data.seq_len "
            "(CLI: --seq-len) or turn packing on (drop --no-packing)"
        )
    if not len(ds):
        why = " (completion_only: none has a completion or an assistant turn)" if spec.completion_only else ""
        raise ConfigError(
            f"the {len(index)} {name} documents of {spec.path} carry no labelled token{why}; "
            "add data, turn completion_only off or change eval_fraction"
        )
    if spec.packing and name == "training" and ds.stats.tokens < width:
        raise ConfigError(
            f"the {len(index)} {name} documents of {spec.path} hold {ds.stats.tokens} tokens (with BOS/EOS), "
            f"less than one row of seq_len + 1 = {width}: every batch would be mostly padding; add data "
            f"or lower data.seq_len (to at most {ds.stats.tokens - 1})"
        )
    return ds


def build_datasets(spec: DataSpec, tokenizer: Any) -> tuple[PackedDataset, PackedDataset | None]:
    """(train, eval) from ``spec``: eval is None when ``eval_fraction`` is 0."""
    fmt, records = open_records(spec.path, spec.format, split=spec.split, columns=spec.columns)  # one pass
    docs = tokenize_records(records, fmt, tokenizer, completion_only=spec.completion_only)
    train_idx, eval_idx = split_documents(len(docs), spec.eval_fraction, spec.seed)
    train = _split_dataset(docs, train_idx, spec, tokenizer, "training", fmt)
    held_out = _split_dataset(docs, eval_idx, spec, tokenizer, "held-out", fmt) if eval_idx.size else None
    return train, held_out
