"""The data a run's configuration names: its tokenizer, ``config.data`` tokenized with it, the step count.

The tokenizer is ``model.tokenizer`` (CLI ``--tokenizer DIR``), else the model directory's own (the
demo model's for "demo"). A run needs one when it trains on ``config.data`` or exports (an export is
a whole Hugging Face directory, tokenizer included); ``fit()`` on batches of token ids without an
export needs none. A directory without tokenizer files is refused with its name and the fix
(``slidekit.data.tokens.load_tokenizer``), never loaded as an empty tokenizer.

Test: ``python -m pytest -q tests/test_data_summary.py tests/test_epochs.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit.data.datasets import DataSpec, PackedDataset, build_datasets
from slidekit.data.epochs import StepCount, count_steps, needs_rows
from slidekit.data.formats import data_file
from slidekit.data.hub import HUB_PREFIX
from slidekit.data.summary import describe_data
from slidekit.data.tokens import load_tokenizer
from slidekit.errors import ConfigError

if TYPE_CHECKING:
    from slidekit.config import TrainConfig

__all__ = [
    "configured_datasets",
    "configured_spec",
    "configured_summary",
    "model_tokenizer",
    "planned_steps",
    "run_step_count",
    "tokenizer_dir",
]


def tokenizer_dir(config: TrainConfig, model_dir: Path) -> Path:
    """Where the run's tokenizer is: ``model.tokenizer``, else the model's directory (the demo's for "demo")."""
    from slidekit.models.loading import DEMO_MODEL, demo_dir

    if config.model.tokenizer is not None:
        return Path(config.model.tokenizer).expanduser()
    return demo_dir() / "tokenizer" if config.model.source == DEMO_MODEL else model_dir


def model_tokenizer(config: TrainConfig, model_dir: Path) -> Any:
    """The run's tokenizer (``tokenizer_dir``); a ConfigError naming the directory and the fix without one."""
    label = "model.tokenizer" if config.model.tokenizer is not None else "the model directory"
    return load_tokenizer(tokenizer_dir(config, model_dir), label)


def configured_spec(config: TrainConfig) -> DataSpec:
    """The DataSpec of ``config.data``."""
    dc = config.data
    path = dc.path if dc.path is not None and dc.path.startswith(HUB_PREFIX) else data_file(dc.path)
    return DataSpec(
        path=path,
        format=dc.format,
        split=dc.split,
        columns=dc.columns,
        seq_len=dc.seq_len,
        completion_only=dc.completion_only,
        packing=dc.packing,
        eval_fraction=dc.eval_fraction,
        seed=dc.seed,
    )


def configured_datasets(
    config: TrainConfig, tokenizer: Any, *, vocab_size: int
) -> tuple[PackedDataset, PackedDataset | None]:
    """The training set and the held-out set (None without ``eval_fraction``) of ``config.data``; the
    training set must fill one step (``steps_per_epoch``)."""
    train, held_out = build_datasets(configured_spec(config), tokenizer)
    too_big = max(ds.max_token_id() for ds in (train, held_out) if ds is not None)
    if too_big >= vocab_size:
        raise ConfigError(
            f"the tokenizer produced id {too_big}, but the model's vocabulary has {vocab_size} "
            "entries; use the tokenizer that belongs to the model (CLI: --tokenizer DIR)"
        )
    run_step_count(config, len(train))  # fewer rows than one step: refused, with the numbers
    return train, held_out


def run_step_count(config: TrainConfig, rows: int | None) -> StepCount:
    """``count_steps`` for ``config``, the training set having ``rows`` rows (None: not built)."""
    if rows is None and needs_rows(config.steps, config.epochs):
        raise ValueError("the step count of an epochs run needs the training rows")
    return count_steps(
        config.steps,
        config.epochs,
        rows=rows,
        batch_size=config.data.batch_size,
        grad_accum=config.grad_accum,
    )


def configured_summary(
    config: TrainConfig, train: PackedDataset, held_out: PackedDataset | None, steps: StepCount | None = None
) -> str:
    """``describe_data`` of ``config.data``'s datasets (``steps``: the run's step count, when known)."""
    return describe_data(
        configured_spec(config),
        train,
        held_out,
        batch_size=config.data.batch_size,
        grad_accum=config.grad_accum,
        steps=steps,
    )


def planned_steps(config: TrainConfig) -> tuple[TrainConfig, StepCount, str | None]:
    """What ``slidekit plan`` counts: ``config`` with ``steps`` fixed, its StepCount and, for an epochs run
    (whose count needs the data, tokenized here as the Trainer would), the data summary."""
    import dataclasses

    from slidekit.inputs import seq_len_refusal
    from slidekit.models.loading import load_hf_config

    if not needs_rows(config.steps, config.epochs):
        steps = run_step_count(config, None)
        return dataclasses.replace(config, steps=steps.total), steps, None
    hf_config, model_dir = load_hf_config(config.model.source, config.model.overrides)
    positions = getattr(hf_config, "max_position_embeddings", None)
    why = seq_len_refusal(config.data.seq_len, positions) if positions else None
    if why:
        raise ConfigError(why)
    train, held_out = configured_datasets(
        config, model_tokenizer(config, model_dir), vocab_size=int(hf_config.vocab_size)
    )
    steps = run_step_count(config, len(train))
    summary = configured_summary(config, train, held_out, steps)
    return dataclasses.replace(config, steps=steps.total), steps, summary
