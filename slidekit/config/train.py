"""The run around the training: ``RunConfig`` (its outputs), ``PluginConfig`` (its plugins) and
``TrainConfig``, the whole configuration, with ``to_dict``, the plain data saved with every run.

Test: ``pytest tests/test_config.py``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slidekit.config.sections import DataConfig, EngineConfig, ModelConfig, OptimConfig, _positive, _seed
from slidekit.errors import ConfigError
from slidekit.typecheck import check_types

#: The dtypes an export can write its weights in (``RunConfig.export_dtype``).
EXPORT_DTYPES = ("bfloat16", "float16", "float32")

#: Optimizer steps of a run that sets neither ``steps`` nor ``epochs``.
DEFAULT_STEPS = 150


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Where a run keeps its outputs: checkpoints, metrics, the effective configuration."""

    dir: str | None = None  # run directory (checkpoints/, metrics.jsonl, config.json); None: keep nothing
    checkpoint_every: int = 0  # steps between checkpoints; 0: only at the end (and when interrupted)
    keep: int = 2  # complete checkpoints to keep
    resume: bool | int | str = False  # continue bitwise from a checkpoint: True or "latest" for the newest
    # intact one in dir/checkpoints (damaged ones are moved aside), a step (an int, or a string of digits)
    # for that step's checkpoint there, any other string for a checkpoint directory's path
    export_dir: str | None = None  # write the final model here as a Hugging Face directory
    export_dtype: str = "bfloat16"  # dtype of the exported weights: bfloat16, float16 or float32
    trace: str | None = None  # write a Chrome trace of the pipeline here (relative: to the current directory;
    # a data-parallel rank r > 0 writes <stem>.rank<r><suffix> beside it)
    # Loggers that get the run's metrics (Hugging Face's report_to): "none", "tensorboard", "wandb", "all"
    # (every logger installed), or several, as a list or a comma-separated string; stored as a tuple of names
    # (() for none). Each is the logging plugin of that name; it writes under dir. See docs/logging.md.
    report_to: str | tuple[str, ...] = ()
    # Start afresh in a dir that holds a previous run (its checkpoints and metrics are removed), and replace
    # a previous slidekit export in export_dir (only the files its manifest lists). See docs/runs.md.
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_types("run", self)
        _positive("run", "checkpoint_every", self.checkpoint_every, allow_zero=True)
        _positive("run", "keep", self.keep)
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(
                f"run.export_dtype (CLI: --export-dtype) must be one of {list(EXPORT_DTYPES)}, "
                f"got {self.export_dtype!r}"
            )
        for name in ("dir", "export_dir"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"run.{name} must be a directory path, or None; got {value!r}")
        if self.trace is not None and not self.trace.strip():
            raise ConfigError("run.trace must be a file path such as trace.json, or None for no trace")
        object.__setattr__(self, "report_to", _report_to(self.report_to))
        if self.report_to and not self.dir:
            raise ConfigError(
                f"run.report_to = {','.join(self.report_to)!r} writes the logs in the run directory: set "
                "run.dir (CLI: --run-dir), or report_to 'none'"
            )
        if self.resume_target() is not None and not self.dir:
            raise ConfigError(
                "run.resume needs run.dir (CLI: --run-dir) to find the checkpoints in; on the command line "
                "--resume RUN_DIR names the run directory itself"
            )

    def resume_target(self) -> int | str | None:
        """What ``resume`` asks for: None (start fresh), "latest", a step number or a checkpoint path."""
        value = self.resume
        if isinstance(value, bool):
            return "latest" if value else None
        if isinstance(value, int) and value >= 0:
            return value
        if isinstance(value, str) and value.strip():
            text = value.strip()
            return int(text) if text.isascii() and text.isdigit() else text
        raise ConfigError(
            f"run.resume must be true/false, 'latest', a step number >= 0 or a checkpoint directory's path, "
            f"got {value!r}"
        )


_LOGGER_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def _report_to(value: str | tuple[str, ...]) -> tuple[str, ...]:
    """``run.report_to`` as a tuple of logger names: () for "none", ("all",) for every installed logger."""
    items = value.split(",") if isinstance(value, str) else value
    names = tuple(dict.fromkeys(item.strip().lower() for item in items if item.strip()))
    bad = [n for n in names if not _LOGGER_NAME.fullmatch(n)]
    if bad:
        raise ConfigError(
            f"run.report_to (CLI: --report-to) holds {bad[0]!r}, not a logger name; give 'none', 'tensorboard', "
            "'wandb', 'all', or several names separated by commas"
        )
    if len(names) > 1 and ("none" in names or "all" in names):
        special = "none" if "none" in names else "all"
        raise ConfigError(
            f"run.report_to (CLI: --report-to) = {','.join(names)!r}: {special!r} stands alone; give it, or "
            "the names of the loggers"
        )
    return () if names == ("none",) else names


@dataclass(frozen=True, kw_only=True, slots=True)
class PluginConfig:
    """Which plugins load, and the settings their drivers get."""

    entry_points: bool = True  # load plugins from entry-point group "slidekit"
    block: tuple[str, ...] = ()  # plugin names never to load (added to $SLIDEKIT_BLOCK_PLUGINS)
    # Driver name -> its settings, e.g. {"my_tier": {"queue_depth": 8}}: TOML [plugins.options.my_tier],
    # CLI --plugin-option my_tier.queue_depth=8. A driver takes the keys its descriptor declares
    # (``options``); tiers get them in TierContext.options, optimizers in OptimizerHyper.options.
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types("plugins", self)
        object.__setattr__(self, "options", _plugin_options(self.options))


_OPTION_VALUES = (bool, int, float, str)


def _plugin_options(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``plugins.options`` as plain data (a copy), or ConfigError naming the driver, the key and the value."""
    out: dict[str, dict[str, Any]] = {}
    for driver, table in options.items():
        if not isinstance(table, Mapping) or not all(isinstance(k, str) and k for k in table):
            raise ConfigError(
                f"plugins.options.{driver} must be a table of settings (TOML [plugins.options.{driver}]), "
                f"got {table!r}"
            )
        for key, value in table.items():
            items = value if isinstance(value, list | tuple) else [value]
            if not all(isinstance(v, _OPTION_VALUES) for v in items) or any(
                isinstance(v, float) and not math.isfinite(v) for v in items
            ):
                raise ConfigError(
                    f"plugins.options.{driver}.{key} must be a string, a boolean, a finite number or a list "
                    f"of them, got {value!r} ({type(value).__name__})"
                )
        out[driver] = {k: list(v) if isinstance(v, list | tuple) else v for k, v in table.items()}
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """A whole fine-tuning run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    plugins: PluginConfig = field(default_factory=PluginConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # Optimizer steps; None: ``epochs`` decides, and without epochs DEFAULT_STEPS (150). Set together with
    # epochs, steps wins (as max_steps over num_train_epochs in transformers' Trainer).
    steps: int | None = None
    grad_accum: int = 1  # micro-batches (of data.batch_size rows each) per optimizer step
    seed: int = 0  # seeds the data order (model.init_seed seeds random weights)
    epochs: float | None = None  # passes over the training data (data.batch_size * grad_accum rows per step)

    def __post_init__(self) -> None:
        check_types("train", self)
        if self.steps is not None:
            _positive("train", "steps", self.steps)
        if self.epochs is not None:
            _positive("train", "epochs", self.epochs)
        _positive("train", "grad_accum", self.grad_accum)
        _seed("train", "seed", self.seed)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (JSON/TOML-serialisable)."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
