"""Configuration: frozen, validated dataclasses, and the one place defaults live.

``TrainConfig`` holds everything a run needs, grouped by concern. Each class
validates itself on construction and names the bad value and what would be
valid: first every field against its type annotation, in one place
(``slidekit.typecheck``: a bool is not an int, an int is a fine float, numbers
must be finite, lists become tuples), then the values. Absurd but valid values
(a learning rate above 1) warn. Runtime objects (models, devices, streams)
never go in here: they are built from a config, not stored in it.
``TrainConfig.to_dict`` gives the effective configuration as plain data,
saved with every run (``RUN_DIR/config.json``); ``from_dict`` and
``load_config`` build one back from plain data or a file (TOML, or JSON such
as a run's saved ``config.json``), so CLI flags, files and Python all land on
the same dataclasses (and their errors name the file; an unknown key gets a
"did you mean").

The package, by concern: ``sections`` (``ModelConfig``, ``DataConfig``, ``OptimConfig``,
``EngineConfig``, and the checks they share), ``train`` (``RunConfig``, ``PluginConfig`` and
``TrainConfig``, the whole), ``loading`` (``from_dict``, ``load_config``, ``load_toml``). Every name
is imported from ``slidekit.config`` itself.

Test: ``pytest tests/test_config.py``.
"""

from __future__ import annotations

from slidekit.config.loading import from_dict, load_config, load_toml
from slidekit.config.sections import (
    CLIP_OVERLAP,
    DATA_FIELDS,
    DEFAULT_LR,
    DEMO_LR,
    DataConfig,
    EngineConfig,
    ModelConfig,
    OptimConfig,
    parse_columns,
    resident_fraction,
    upload_copy_dtype_error,
)
from slidekit.config.sections import RESIDENT_WEIGHTS as RESIDENT_WEIGHTS
from slidekit.config.sections import UPDATE_ORDER as UPDATE_ORDER
from slidekit.config.sections import UPLOAD_COPY as UPLOAD_COPY
from slidekit.config.train import DEFAULT_STEPS, EXPORT_DTYPES, PluginConfig, RunConfig, TrainConfig

__all__ = [
    "CLIP_OVERLAP",
    "DATA_FIELDS",
    "DEFAULT_LR",
    "DEFAULT_STEPS",
    "DEMO_LR",
    "EXPORT_DTYPES",
    "DataConfig",
    "EngineConfig",
    "ModelConfig",
    "OptimConfig",
    "PluginConfig",
    "RunConfig",
    "TrainConfig",
    "from_dict",
    "load_config",
    "load_toml",
    "parse_columns",
    "resident_fraction",
    "upload_copy_dtype_error",
]
