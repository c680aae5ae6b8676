"""What an optimizer declares it can do, and the check that holds it to its word.

A ``UnitOptimizer`` declares two capabilities (its docstring in
``slidekit.interfaces`` defines them): ``device_update`` (``step`` also runs
on tensors on the compute device, so units can be resident there) and
``linear_state`` (its state is linear in the parameters, so a unit can be
updated, and its state streamed, piece by piece), and may declare two
optional ones: ``fused_backup`` (``step`` also writes speculative clipping's
backup, ``FusedBackupOptimizer``; ``fuses_backup`` reads it, False where it is
not declared) and ``fused_update_out`` (``step`` also writes the updated
master and state into other buffers and leaves its inputs as they were,
``updates_out_of_place`` reads it). The engine and the planner
read the declarations and never probe. What can be checked without running
the optimizer is checked here, once, when a run builds it
(``slidekit.resolve.build_optimizer``):

* both attributes are there and are bools; the optional ones, where declared, are bools;
* ``linear_state = True`` agrees with the optimizer's own ``state_layout``:
  ``state_layout(a + m)`` is ``state_layout(a)`` followed by
  ``state_layout(m)`` (same names, same dtypes, sizes adding up) for offsets
  ``a`` that are multiples of ``GRANULE`` and lengths ``m`` of every kind
  (block-sized, odd, longer than a granule). A declared False is always
  allowed, even for a linear layout: the engine then updates every unit whole.

The behavioural half (pieces give the bits of a whole update; a device step
gives the bits of a host step) is in the conformance kit,
``slidekit.testing.optimizers``.

Test: ``pytest tests/test_capabilities.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch

from slidekit.errors import PluginError
from slidekit.planning.placement import GRANULE

__all__ = [
    "CAPABILITIES",
    "GRANULE",
    "OPTIONAL_CAPABILITIES",
    "check_optimizer",
    "fuses_backup",
    "layout_nonlinearity",
    "state_is_linear",
    "updates_out_of_place",
]

#: The capability attributes every optimizer declares, each a bool.
CAPABILITIES: Final = ("device_update", "linear_state")
#: Capabilities an optimizer may declare, each a bool where declared (not declared: False).
OPTIONAL_CAPABILITIES: Final = ("fused_backup", "fused_update_out")

_FIXES: Final = {
    "device_update": (
        "declare device_update = True/False on the optimizer (True when step() also runs on tensors on "
        "the compute device, so units can be kept resident there; False keeps every unit on the host)"
    ),
    "linear_state": (
        "declare linear_state = True/False on the optimizer (True when the state of parameters "
        f"[a, a + m) sits at state_layout(a)'s offsets with state_layout(m)'s size for every a that is a "
        f"multiple of {GRANULE}, so a unit can be updated and its state streamed piece by piece; "
        "False, always safe, updates every unit whole)"
    ),
    "fused_backup": (
        "declare fused_backup = True/False on the optimizer, or leave it out (True when step() takes "
        "backup_out and writes the old master and state there in its pass: "
        "slidekit.interfaces.FusedBackupOptimizer; False or absent, the engine copies the backup itself)"
    ),
    "fused_update_out": (
        "declare fused_update_out = True/False on the optimizer, or leave it out (True when step() takes "
        "update_out and writes the updated master and state there, leaving its inputs as they were: "
        "slidekit.interfaces.FusedBackupOptimizer; False or absent, speculative clipping backs up in place)"
    ),
}

#: Lengths the linearity check tries after each offset: empty, tiny, around the common block
#: sizes (64, 256), around a granule and past it, so a per-unit constant or a rounding shows.
_SMALL: Final = (1, 3, 63, 64, 65, 255, 256, 257, 1000)
_LENGTHS: Final = (*_SMALL, GRANULE - 1, GRANULE, GRANULE + 1, 2 * GRANULE + 7, 0)


def _layout(optimizer: Any, numel: int) -> dict[str, tuple[torch.dtype, int]]:
    """``state_layout(numel)`` as a plain dict, checked for shape: names -> (dtype, element count)."""
    try:
        raw = optimizer.state_layout(numel)
    except Exception as exc:
        raise ValueError(f"state_layout({numel}) raised {exc!r}") from exc
    if not isinstance(raw, Mapping):
        raise ValueError(f"state_layout({numel}) returned {type(raw).__name__}, not a mapping")
    out: dict[str, tuple[torch.dtype, int]] = {}
    for name, entry in raw.items():
        ok = isinstance(entry, tuple) and len(entry) == 2
        if not ok or not isinstance(entry[0], torch.dtype) or not isinstance(entry[1], int) or entry[1] < 0:
            raise ValueError(
                f"state_layout({numel})[{name!r}] is {entry!r}; each entry is (torch.dtype, element count >= 0)"
            )
        out[str(name)] = entry
    return out


def layout_nonlinearity(optimizer: Any, granule: int = GRANULE) -> str | None:
    """Why ``optimizer.state_layout`` is not linear in the parameters (a counterexample), or None.

    Linear: for every offset ``a`` that is a multiple of ``granule`` and every
    length ``m``, ``state_layout(a + m)`` names the buffers ``state_layout(a)``
    and ``state_layout(m)`` name, with the same dtypes, and each holds exactly
    the elements of the two together. Tried for ``a`` in 0, 1, 2 and 3
    granules and a spread of lengths (``_LENGTHS``).
    """
    layouts: dict[int, dict[str, tuple[torch.dtype, int]]] = {}

    def layout(n: int) -> dict[str, tuple[torch.dtype, int]]:
        if n not in layouts:
            layouts[n] = _layout(optimizer, n)
        return layouts[n]

    try:
        for a in (granule, 2 * granule, 3 * granule, 0):  # a = 0 last: its counterexamples say less
            for m in _LENGTHS:
                whole, head, tail = layout(a + m), layout(a), layout(m)
                if not set(whole) == set(head) == set(tail):
                    return (
                        f"state_layout({a + m}) names {sorted(whole)}, but state_layout({a}) names "
                        f"{sorted(head)} and state_layout({m}) names {sorted(tail)}"
                    )
                for name, (dtype, n) in whole.items():
                    if head[name][0] != dtype or tail[name][0] != dtype:
                        return (
                            f"state {name!r} is {dtype} in state_layout({a + m}) but {head[name][0]} in "
                            f"state_layout({a}) and {tail[name][0]} in state_layout({m})"
                        )
                    if n != head[name][1] + tail[name][1]:
                        return (
                            f"state {name!r} of {a + m} parameters has {n} elements, but those of parameters "
                            f"[0, {a}) and [{a}, {a + m}) would have {head[name][1]} + {tail[name][1]} = "
                            f"{head[name][1] + tail[name][1]} (state_layout({a}) and state_layout({m}))"
                        )
    except ValueError as exc:
        return str(exc)
    return None


def state_is_linear(optimizer: Any, granule: int = GRANULE) -> bool:
    """Whether ``optimizer.state_layout`` is linear in the parameters (``layout_nonlinearity`` finds nothing)."""
    return layout_nonlinearity(optimizer, granule) is None


def fuses_backup(optimizer: Any) -> bool:
    """Whether ``optimizer`` writes speculative clipping's backup itself (``fused_backup`` is True;
    an optimizer that does not declare it does not)."""
    return getattr(optimizer, "fused_backup", False) is True


def updates_out_of_place(optimizer: Any) -> bool:
    """Whether ``optimizer``'s step can write the updated master and state into other buffers and leave
    its inputs untouched (``fused_update_out`` is True; an optimizer that does not declare it cannot)."""
    return getattr(optimizer, "fused_update_out", False) is True


def check_optimizer(optimizer: Any, *, who: str) -> None:
    """Refuse an optimizer whose capability declarations are missing, not bool, or contradicted.

    ``who`` names it in the error, e.g. "optimizer 'my_adam' (plugin 'my_plugin')".
    Raises ``PluginError`` naming the attribute, its value and the fix.
    """
    for method in ("state_layout", "step"):
        if not callable(getattr(optimizer, method, None)):
            raise PluginError(
                f"{who} built {type(optimizer).__name__}, which has no {method}() method: an optimizer "
                "factory must return a UnitOptimizer (slidekit.interfaces)"
            )
    for attr in (*CAPABILITIES, *OPTIONAL_CAPABILITIES):
        if attr in CAPABILITIES and not hasattr(optimizer, attr):
            raise PluginError(f"{who} does not declare {attr}: {_FIXES[attr]}")
        value = getattr(optimizer, attr, False)
        if not isinstance(value, bool):
            raise PluginError(
                f"{who} declares {attr} = {value!r} ({type(value).__name__}), which is not a bool: {_FIXES[attr]}"
            )
    if optimizer.linear_state:
        problem = layout_nonlinearity(optimizer)
        if problem is not None:
            raise PluginError(
                f"{who} declares linear_state = True, but its state_layout is not linear in the parameters: "
                f"{problem}. Declare linear_state = False (the engine then updates and stages each unit "
                "whole) or make state_layout linear"
            )
