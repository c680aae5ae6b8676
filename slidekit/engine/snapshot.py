"""What a checkpoint of the engine holds, and how to put it back.

A checkpoint is every unit's FP32 master (``master/<unit>``) and every
optimizer state buffer (``state/<unit>/<name>``), in the order the next step
will modify the units, so the optimizer can move on to a unit as soon as its
tensors are on disk while later ones are still being written. State that a
tier keeps off the host (files) is read back only when the checkpoint writer
reaches it (``checkpoint.Deferred``), so a checkpoint needs no second copy
of the state in memory. Restoring reads every array back, checksums checked,
after ``verify_compatible`` has refused a checkpoint of another model.

Data-parallel (``engine.collectives``): each rank's checkpoint holds its
shards, and ``parallel/world`` (the world size and the rank). Rank 0's part
commits the whole checkpoint: its ``parallel/world`` is produced last, once
every other rank has reported its part committed (``DataParallel.wait_parts``),
so rank 0's checkpoint exists only when every part does. ``restore`` of a
checkpoint written by another world size (a one-process checkpoint in a
data-parallel run, and the reverse, included) re-shards it
(``slidekit.distributed.reshard``): every rank reads its new shards' ranges
from the old parts, bitwise the masters and state the writing run had.

Test: ``pytest tests/test_resume.py tests/distributed/test_dp_checkpoints.py
tests/distributed/test_dp_reshard.py``.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from slidekit import checkpoint as ck
from slidekit.distributed.shards import unit_shard
from slidekit.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from slidekit.distributed.group import DataParallel
    from slidekit.engine.core import Engine

__all__ = [
    "PARALLEL",
    "capture",
    "check_world",
    "engine_world",
    "expected_arrays",
    "names_by_unit",
    "restore",
    "saved_world",
    "update_order",
]

#: The array of a data-parallel rank's checkpoint that says whose part it is: (world size, rank), int64.
PARALLEL = "parallel/world"


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
    dp = engine.collectives
    if dp is not None:
        mark = torch.tensor([dp.world, dp.rank], dtype=torch.int64)
        if dp.rank == 0:  # the last array of rank 0's part: written once every other part is committed
            wait = functools.partial(_after_parts, dp.parallel, engine.steps_done, mark)
            out[PARALLEL] = ck.Deferred(torch.int64, (2,), wait)
        else:
            out[PARALLEL] = mark
    return out


def _after_parts(parallel: DataParallel, step: int, mark: torch.Tensor) -> torch.Tensor:
    parallel.wait_parts(step)
    return mark


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


def expected_arrays(
    engine: Engine, world: int | None = None, rank: int = 0
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every array a checkpoint of this engine must hold: this rank's part, or
    with ``world`` the part rank ``rank`` of ``world`` ranks writes (its shards of every unit)."""
    if world is None:
        state = engine.host.state
        out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for u, master in enumerate(engine.host.masters):
            out[f"master/{u}"] = (master.dtype, tuple(master.shape))
            for name, (dtype, numel) in state.layout(u).items():
                out[f"state/{u}/{name}"] = (dtype, (numel,))
        if engine.collectives is not None:
            out[PARALLEL] = (torch.int64, (2,))
        return out
    out = {}
    for u, (unit, master) in enumerate(zip(engine.spec.units, engine.host.masters, strict=True)):
        size = unit_shard(unit.numel, world, rank).size
        out[f"master/{u}"] = (master.dtype, (size,))
        for name, (dtype, numel) in engine.optimizer.state_layout(size).items():
            out[f"state/{u}/{name}"] = (dtype, (numel,))
    if world > 1:
        out[PARALLEL] = (torch.int64, (2,))
    return out


def engine_world(engine: Engine) -> int:
    """The data-parallel world size of ``engine`` (1: one process)."""
    return 1 if engine.collectives is None else engine.collectives.world


def saved_world(path: Path) -> int:
    """The world size that wrote checkpoint part ``path`` (1: one process), from its ``parallel/world``."""
    if PARALLEL not in ck.read_manifest(path).arrays:
        return 1
    return int(ck.read(path, PARALLEL)[0])


def check_world(engine: Engine, path: Path) -> None:
    """Refuse checkpoint part ``path`` when it is another rank's part of a checkpoint of this world size
    (a checkpoint of another world size is re-sharded, ``slidekit.distributed.reshard``)."""
    dp = engine.collectives
    if dp is None or PARALLEL not in ck.read_manifest(path).arrays:
        return
    world, rank = (int(v) for v in ck.read(path, PARALLEL).tolist())
    if world == dp.world and rank != dp.rank:
        raise ConfigError(f"checkpoint {path} is rank {rank}'s part, not rank {dp.rank}'s")


def restore(engine: Engine, path: Path) -> None:
    """Load masters and optimizer state from checkpoint ``path`` (verified against this engine): this
    rank's part of a checkpoint of this world size, or the checkpoint (rank 0's part) of another world
    size, which is re-sharded (``slidekit.distributed.reshard``: every rank reads its ranges)."""
    world = saved_world(path)
    if world != engine_world(engine):
        from slidekit.distributed import reshard  # it builds on this module

        reshard.restore(engine, path, world)
        return
    check_world(engine, path)
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
