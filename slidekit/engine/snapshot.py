"""What a checkpoint of the engine holds, and how to put it back.

A checkpoint is every unit's FP32 master (``master/<unit>``) and every
optimizer state buffer (``state/<unit>/<name>``), in the order the next step
will modify the units, so the optimizer can move on to a unit as soon as its
tensors are on disk while later ones are still being written. State that a
tier keeps off the host (files) is read back only when the checkpoint writer
reaches it (``checkpoint.Deferred``), so a checkpoint needs no second copy
of the state in memory. Restoring reads every array back, checksums checked,
after ``verify_compatible`` has refused a checkpoint of another model.

Test: ``pytest tests/test_resume.py``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from slidekit import checkpoint as ck

if TYPE_CHECKING:
    from pathlib import Path

    from slidekit.engine.core import Engine

__all__ = ["capture", "names_by_unit", "restore", "update_order"]


def update_order(engine: Engine, deferred: bool) -> list[int]:
    """Units in the order the next step updates them: backward order, or forward order when updates wait."""
    units = list(range(len(engine.spec.units)))
    return units if deferred else units[::-1]


def names_by_unit(engine: Engine) -> dict[int, list[str]]:
    """Checkpoint array names of each unit."""
    state = engine.host.state
    return {
        u: [f"master/{u}", *(f"state/{u}/{name}" for name in state.layout(u))]
        for u in range(len(engine.spec.units))
    }


def capture(engine: Engine, order: list[int]) -> dict[str, torch.Tensor | ck.Deferred]:
    """The engine's tensors for ``CheckpointWriter.save``, in ``order``. Call after ``wait_updates``."""
    state = engine.host.state
    out: dict[str, torch.Tensor | ck.Deferred] = {}
    for u in order:
        out[f"master/{u}"] = _host(engine.host.masters[u])
        mapped = state.mapped(u)
        for name, (dtype, numel) in state.layout(u).items():
            if mapped is not None:
                out[f"state/{u}/{name}"] = _host(mapped[name])
            else:
                out[f"state/{u}/{name}"] = ck.Deferred(
                    dtype, (numel,), functools.partial(state.read_buffer, u, name)
                )
    return out


def _host(t: torch.Tensor) -> torch.Tensor | ck.Deferred:
    """Host tensors as they are; device tensors copied to the host only when the writer gets to them."""
    if t.device.type == "cpu":
        return t
    return ck.Deferred(t.dtype, tuple(t.shape), t.cpu)


def _read_into(path: Path, name: str, dst: torch.Tensor) -> None:
    if dst.device.type == "cpu":
        ck.read_into(path, name, dst)
    else:
        dst.copy_(ck.read(path, name))


def expected_arrays(engine: Engine) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every array a checkpoint of this engine must hold."""
    state = engine.host.state
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for u, master in enumerate(engine.host.masters):
        out[f"master/{u}"] = (master.dtype, tuple(master.shape))
        for name, (dtype, numel) in state.layout(u).items():
            out[f"state/{u}/{name}"] = (dtype, (numel,))
    return out


def restore(engine: Engine, path: Path) -> None:
    """Load masters and optimizer state from checkpoint ``path`` (verified against this engine)."""
    ck.verify_compatible(path, expected_arrays(engine))
    engine.wait_updates()
    state = engine.host.state
    for u, master in enumerate(engine.host.masters):
        _read_into(path, f"master/{u}", master)
        mapped = state.mapped(u)
        for name, (dtype, numel) in state.layout(u).items():
            if mapped is not None:
                _read_into(path, f"state/{u}/{name}", mapped[name])
            else:
                buf = torch.empty(numel, dtype=dtype)
                ck.read_into(path, f"state/{u}/{name}", buf)
                state.write_buffer(u, name, buf)
    engine.invalidate_device_copies()
