"""``model.overrides``: the config.json fields a run replaces, each value checked once.

Two moments, each checking what it can:

* when the configuration is built (``ModelConfig``), ``check_values``: the fields that size the
  model (``SIZE_KEYS``) are positive integers (None lets the config derive ``DERIVABLE`` ones), and
  ``rms_norm_eps`` and ``rope_theta`` positive finite numbers; nothing else needs the model;
* when the model's config is loaded (``models.loading.load_hf_config``), ``apply``: every key must be
  a field of that config, and a value the first check did not cover must have the type of the value
  it replaces (an int may replace a float; None is not checked). transformers then validates the
  whole config, and an error there is reported as the overrides'.

What the overrides make of the model afterwards (a shape the adapter refuses, math slidekit does not
compute) is refused by the adapter and ``models.support`` like any other config.

Test: ``pytest tests/test_config.py tests/models/test_loading.py -k overrides``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from slidekit.errors import ConfigError, ModelLoadError

__all__ = ["DERIVABLE", "POSITIVE_FLOAT_KEYS", "SIZE_KEYS", "apply", "check_values"]

#: Keys that size the model: positive integers (None lets the config derive the ``DERIVABLE`` ones).
SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
DERIVABLE = ("head_dim", "num_key_value_heads")
#: Keys that must be positive finite numbers.
POSITIVE_FLOAT_KEYS = ("rms_norm_eps", "rope_theta")


def check_values(overrides: Mapping[str, Any]) -> None:
    """Refuse overrides that cannot make a model whatever it is: sizes that are not positive integers,
    and so on (ConfigError naming the key and the value)."""
    for key, value in overrides.items():
        if key in SIZE_KEYS:
            if value is None and key in DERIVABLE:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"model.overrides.{key} must be a positive integer (it sets the model's size), got {value!r}"
                )
        elif key in POSITIVE_FLOAT_KEYS and (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ConfigError(f"model.overrides.{key} must be a positive finite number, got {value!r}")


def apply(config: Any, overrides: Mapping[str, Any]) -> Any:
    """A new transformers config: ``config`` with ``overrides`` (already through ``check_values``)."""
    overrides = dict(overrides)
    values = config.to_dict()
    unknown = [k for k in overrides if k not in values]
    if unknown:
        raise ModelLoadError(f"cannot override {unknown}: {config.model_type} configs have no such fields")
    for key, value in overrides.items():
        if key not in SIZE_KEYS and key not in POSITIVE_FLOAT_KEYS:  # those are checked already
            _check_type(key, values[key], value)
    values.update(overrides)
    if "num_hidden_layers" in overrides:
        values.pop("layer_types", None)  # derived from the layer count; let the config rebuild it
    try:
        return type(config)(**values)
    except Exception as exc:  # transformers validates the whole config: report it as ours
        raise ConfigError(
            f"model.overrides {overrides} make no valid {config.model_type} config: {exc}"
        ) from exc


def _check_type(key: str, current: Any, value: Any) -> None:
    """An override has the type of the value it replaces (an int may replace a float; None is not checked)."""
    if current is None or value is None:
        return
    if isinstance(current, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(current, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(current, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        kind = "a finite number"
    elif isinstance(current, str):
        ok, kind = isinstance(value, str), "a string"
    else:
        return
    if not ok:
        raise ConfigError(
            f"model.overrides.{key} must be {kind}, like the model's own value {current!r}; "
            f"got {value!r} ({type(value).__name__})"
        )
