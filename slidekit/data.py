"""Training data: JSONL text records, tokenized, packed into fixed-length rows, batched.

Each line of the file is a JSON object with a ``text`` field. Documents are
tokenized, each followed by the end-of-sequence token (and preceded by the
beginning-of-sequence token where the tokenizer has one), concatenated and
cut into rows of ``seq_len + 1`` tokens: a row gives ``input_ids = row[:-1]``
and ``labels = row[1:]``. Rows are shuffled with a seeded generator, epoch
after epoch, so a run's data order depends only on its seed.

Without a path, the sample corpus embedded in the package is used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slidekit.errors import ConfigError

__all__ = ["Batch", "PackedRows", "load_tokenizer", "read_texts"]


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's data: ``input_ids`` and ``labels`` (B, T), label -100 where no loss is taken."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.labels.shape or self.input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} and labels {tuple(self.labels.shape)} "
                "must both be (batch, seq_len)"
            )


def load_tokenizer(directory: Path) -> Any:
    """The fast tokenizer saved in a model directory (offline)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"cannot load a tokenizer from {str(directory)!r}: {exc}") from exc


def read_texts(path: Path) -> list[str]:
    """The ``text`` field of every line of a JSONL file; errors name the file and line."""
    if not path.is_file():
        raise ConfigError(f"data file {str(path)!r} does not exist")
    texts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{path}:{n}: not valid JSON ({exc.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f'{path}:{n}: expected an object with a string field "text"')
            texts.append(record["text"])
    if not texts:
        raise ConfigError(f"data file {str(path)!r} holds no records")
    return texts


class PackedRows:
    """Token rows of ``seq_len + 1`` cut from the concatenated documents."""

    def __init__(self, docs: Sequence[Sequence[int]], seq_len: int) -> None:
        stream = [t for doc in docs for t in doc]
        n_rows = len(stream) // (seq_len + 1)
        if n_rows == 0:
            raise ConfigError(
                f"the data holds {len(stream)} tokens, fewer than one row of seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter seq_len"
            )
        self.seq_len = seq_len
        self.rows = torch.tensor(stream[: n_rows * (seq_len + 1)], dtype=torch.int64).view(
            n_rows, seq_len + 1
        )

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Any, seq_len: int) -> PackedRows:
        ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ConfigError("the tokenizer has no eos_token; documents cannot be separated when packing")
        return cls([bos + doc + [eos] for doc in ids], seq_len)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def batches(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """Endless batches; each epoch is a fresh seeded permutation of the rows."""
        gen = torch.Generator().manual_seed(seed)
        order = torch.empty(0, dtype=torch.int64)
        while True:
            while order.numel() < batch_size:
                order = torch.cat([order, torch.randperm(len(self), generator=gen)])
            take, order = order[:batch_size], order[batch_size:]
            rows = self.rows[take]
            yield Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
