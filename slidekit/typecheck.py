"""Type-checking of configuration dataclasses against their annotations, in one place.

``check_types(owner, config)`` (called first in every ``__post_init__`` of
``slidekit.config``) checks each field of a dataclass against its type
annotation, whatever the value came from: TOML, the command line or Python.
A bool is not an int; an int is a fine float (stored as a float); numbers
must be finite; a list is a fine tuple (stored as a tuple), a string is not.
A mismatch is a ``ConfigError`` naming the key, the value and the expected
type, e.g. ``data.seq_len must be an integer, got 64.5 (float)``.

Supported annotations: bool, int, float, str, Any, ``X | None``, ``tuple[X, ...]``,
``tuple[X, Y]``, ``Mapping[str, Any]`` and nested dataclasses.

Test: ``pytest tests/test_config.py``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
import typing
from collections.abc import Mapping
from typing import Any

from slidekit.errors import ConfigError

__all__ = ["check_types"]


class _Mismatch(Exception):
    """A value does not have its field's type."""


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def check_types(owner: str, config: Any) -> None:
    """Check every field of ``config`` against its annotation; store the conformed value.

    Ints (not bools) are accepted for float fields and stored as floats; lists for tuple
    fields, stored as tuples. Anything else of the wrong type, and any non-finite number,
    is a ConfigError naming the key, the value and the expected type.
    """
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        try:
            conformed = _conform(hints[f.name], value)
        except _Mismatch:
            raise ConfigError(
                f"{owner}.{f.name} must be {_describe(hints[f.name])}, got {value!r} ({type(value).__name__})"
            ) from None
        if conformed is not value:
            object.__setattr__(config, f.name, conformed)


def _conform(tp: Any, value: Any) -> Any:
    """``value`` as a value of type ``tp``, or raise ``_Mismatch``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _conform(arg, value)
                except _Mismatch:
                    pass
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return value if type(value) is int else int(value)
    elif tp is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                raise _Mismatch from None
            if math.isfinite(number):
                return value if type(value) is float else number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        if isinstance(value, tuple | list):
            items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
            if len(items) == len(value):
                out = tuple(_conform(a, v) for a, v in zip(items, value, strict=True))
                unchanged = isinstance(value, tuple) and all(a is b for a, b in zip(out, value, strict=True))
                return value if unchanged else out
    elif origin is Mapping:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return value
    elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
    else:
        raise TypeError(f"configuration fields of type {tp} are not supported by check_types")
    raise _Mismatch


_PLURALS = {bool: "booleans", int: "integers", float: "finite numbers", str: "strings"}


def _describe(tp: Any) -> str:
    """What a value of type ``tp`` is, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        some = [_describe(a) for a in args if a is not type(None)]
        return " or ".join(some) + (" or None (left out)" if type(None) in args else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_PLURALS.get(args[0], _describe(args[0]))}"
        if len(set(args)) == 1:
            return f"a list of {len(args)} {_PLURALS.get(args[0], _describe(args[0]))}"
        return f"a list ({', '.join(_describe(a) for a in args)})"
    if origin is Mapping:
        return "a table (mapping) with string keys"
    named = {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        Any: "anything",
    }
    if tp in named:
        return named[tp]
    return f"a {getattr(tp, '__name__', tp)}"
