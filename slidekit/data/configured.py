"""The datasets a run's configuration names: ``config.data`` tokenized with the model's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit.data.datasets import DataSpec, PackedDataset, build_datasets
from slidekit.data.formats import data_file
from slidekit.data.tokens import load_tokenizer
from slidekit.errors import ConfigError

if TYPE_CHECKING:
    from slidekit.config import TrainConfig

__all__ = ["configured_datasets", "model_tokenizer"]


def model_tokenizer(directory: Path) -> Any | None:
    """The tokenizer in a model directory, or None when the directory has none."""
    try:
        return load_tokenizer(directory)
    except ConfigError:
        return None


def configured_datasets(
    config: TrainConfig, tokenizer: Any | None, *, vocab_size: int, model_dir: Path
) -> tuple[PackedDataset, PackedDataset | None]:
    """The training set and the held-out set (None without ``eval_fraction``) of ``config.data``."""
    dc = config.data
    if tokenizer is None:
        raise ConfigError(f"{model_dir} has no tokenizer; add one, or pass batches to fit()")
    spec = DataSpec(
        path=data_file(dc.path),
        format=dc.format,
        seq_len=dc.seq_len,
        completion_only=dc.completion_only,
        packing=dc.packing,
        eval_fraction=dc.eval_fraction,
        seed=dc.seed,
    )
    train, held_out = build_datasets(spec, tokenizer)
    too_big = max(ds.max_token_id() for ds in (train, held_out) if ds is not None)
    if too_big >= vocab_size:
        raise ConfigError(
            f"the tokenizer produced id {too_big}, but the model's vocabulary has {vocab_size} "
            "entries; use the tokenizer that belongs to the model"
        )
    return train, held_out
