"""A ``TrainConfig`` from plain data or a file: ``from_dict``, ``load_config`` (TOML or JSON) and
``load_toml``; an unknown key is refused naming the file, with a "did you mean".

Test: ``pytest tests/test_config.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from typing import Any

from slidekit.config.sections import DataConfig, EngineConfig, ModelConfig, OptimConfig
from slidekit.config.train import PluginConfig, RunConfig, TrainConfig
from slidekit.errors import ConfigError

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "engine": EngineConfig,
    "plugins": PluginConfig,
    "run": RunConfig,
}


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _suggest(key: str, section: str | None) -> str:
    """A "did you mean" for an unknown ``key`` of ``section`` (None: the top level): the closest setting
    there, or the table where a setting of that name lives."""
    here = _field_names(_SECTIONS[section] if section else TrainConfig)
    close = difflib.get_close_matches(key, here, n=1)
    if close:
        return f"{key!r}: did you mean {close[0]!r}?"
    tables = [name for name, cls in _SECTIONS.items() if name != section and key in _field_names(cls)]
    if section and key in _field_names(TrainConfig):
        return f"{key!r}: did you mean {key!r} at the top level, outside [{section}]?"
    if tables:
        return f"{key!r}: did you mean {key!r} in [{tables[0]}]?"
    return ""


def _unknown(keys: list[str], section: str | None, where: str) -> ConfigError:
    valid = _field_names(_SECTIONS[section]) if section else sorted(_field_names(TrainConfig))
    hints = "; ".join(h for h in (_suggest(k, section) for k in keys) if h)
    return ConfigError(
        f"{where}: unknown setting(s) {keys}{f' in [{section}]' if section else ''}; "
        f"{hints + '; ' if hints else ''}valid: {', '.join(valid)}"
    )


def _section(name: str, cls: type, values: Mapping[str, Any], where: str) -> Any:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}[{name}] must be a table of settings, got {values!r}")
    unknown = sorted(set(values) - set(_field_names(cls)))
    if unknown:
        raise _unknown(unknown, name, where)
    return cls(**values)


def from_dict(values: Mapping[str, Any], *, where: str = "configuration") -> TrainConfig:
    """A TrainConfig from plain data shaped like ``TrainConfig.to_dict()`` (missing keys keep defaults)."""
    unknown = sorted(set(values) - set(_field_names(TrainConfig)))
    if unknown:
        raise _unknown(unknown, None, where)
    try:
        kwargs = {k: _section(k, _SECTIONS[k], v, where) if k in _SECTIONS else v for k, v in values.items()}
        return TrainConfig(**kwargs)
    except ConfigError as exc:
        if str(exc).startswith(f"{where}:"):
            raise
        raise ConfigError(f"{where}: {exc}") from None


def load_config(path: str) -> dict[str, Any]:
    """The plain data of a configuration file: JSON (a ``.json`` file, such as a run's saved
    ``config.json``, or any file whose first character is ``{``) or TOML, both shaped like
    ``TrainConfig.to_dict()``."""
    if not path.endswith(".json"):
        try:
            with open(path, "rb") as f:
                head = f.read(4096).lstrip()
        except FileNotFoundError:
            raise ConfigError(f"configuration file {path!r} does not exist") from None
        if path.endswith(".toml") or not head.startswith(b"{"):
            return load_toml(path)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a configuration is a JSON object of settings, got {type(doc).__name__}")
    return doc


def load_toml(path: str) -> dict[str, Any]:
    """The plain data of a TOML configuration file (``[model]``, ``[data]``, ... tables; ``steps`` etc. at top)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
