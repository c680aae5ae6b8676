"""Re-sharding: resuming a checkpoint written by W data-parallel ranks on W' ranks (W, W' >= 1).

A checkpoint of W ranks is W parts (``slidekit.distributed.checkpoints``): rank 0's is the
checkpoint (``checkpoints/step-N``), rank r's lies at ``checkpoints/rank-r/step-N``; a one-process
checkpoint is one part holding every unit whole. Part r holds rank r's shard ``[a_r, b_r)`` of every
unit (``slidekit.distributed.shards``): its FP32 master and its optimizer state.

On W' ranks each rank reads, for every unit, only its new shard ``[A, B)``: from every old part
whose shard overlaps it, the overlap ``[lo, hi)``, with ``checkpoint.read_range`` (tensorstore reads
just those chunks, and checks the checksums of the segments it touches). Masters are plain slices.
Optimizer state is a slice too when the optimizer declares ``linear_state``: the state of
parameters ``[a, a + m)`` sits at ``state_layout(a)`` and has the size of ``state_layout(m)`` for
``a`` a multiple of ``GRANULE``, and shards start at multiples of ``GRANULE`` in every world size
(adamw_8bit's 256-element blocks stay whole: a block a cut would split is the unit's last one, whole
in every part). So the new shards hold, bit for bit, what the writing run's ranks held. State that
is not linear cannot be re-cut, and is refused naming the optimizer. Every part is checked (present,
intact, of the checkpoint's step and world, of the sizes the old cut gives) before any tensor is read.

What a checkpoint holds per rank besides the shards is the same on every rank (the step, the
updates applied, the schedule), except the data position: ``batches_consumed`` counts a rank's own
batches, and rank r of W reads batches r, r + W, ... of the one stream, so after k steps of
grad_accum micro-batches the ranks together took ``k * grad_accum * W`` batches. ``resharded_meta``
turns it into the W'-rank count. The step's batch (ranks x grad_accum x batch_size) is part of the
run's identity (``slidekit.identity``): a resume on W' ranks keeps it by running
``grad_accum * W / W'`` micro-batches a rank; anything else is refused, naming that grad_accum.

Test: ``pytest tests/distributed/test_dp_reshard.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from slidekit import checkpoint as ck
from slidekit.distributed.shards import Shard, unit_shard
from slidekit.engine import snapshot
from slidekit.errors import ConfigError
from slidekit.planning.placement import GRANULE

if TYPE_CHECKING:
    from slidekit.engine import Engine

__all__ = ["check_parts", "overlaps", "part_paths", "resharded_meta", "restore", "world_note"]


def part_paths(checkpoint: Path, world: int) -> list[Path]:
    """Where every part of ``checkpoint`` (rank 0's part, ``checkpoints/step-N``) of ``world`` ranks lies."""
    return [checkpoint] + [checkpoint.parent / f"rank-{r}" / checkpoint.name for r in range(1, world)]


def overlaps(new: Shard, world: int) -> list[tuple[Shard, int, int]]:
    """The old shards (of ``world`` ranks) that ``new`` overlaps, each with the overlap ``[lo, hi)`` in the
    unit's coordinates, in order: together they cover ``new`` exactly."""
    out = []
    for r in range(world):
        old = unit_shard(new.numel, world, r)
        lo, hi = max(old.start, new.start), min(old.stop, new.stop)
        if lo < hi:
            out.append((old, lo, hi))
    return out


def _own_shard(engine: Engine, unit: int) -> Shard:
    dp = engine.collectives
    numel = engine.spec.units[unit].numel
    return unit_shard(numel, 1, 0) if dp is None else dp.shards[unit]


def _ranks(world: int) -> str:
    return "one process" if world == 1 else f"{world} data-parallel ranks"


def check_parts(engine: Engine, checkpoint: Path, world: int) -> list[Path]:
    """Refuse, before any tensor is read, what cannot be re-sharded into ``engine``'s world: state that is
    not linear, a part missing or damaged, of another step or world, or not of the old cut's sizes."""
    now = snapshot.engine_world(engine)
    opt = engine.optimizer
    if not engine.host.state.linear:
        raise ConfigError(
            f"checkpoint {checkpoint} holds the shards of {_ranks(world)} and this run has {_ranks(now)}, but "
            f"optimizer {opt.name!r} does not declare linear_state: its state of a shard is not a slice of "
            "the unit's, so it cannot be re-cut for another world size. Resume it "
            + ("on one process" if world == 1 else f"with torchrun --nproc-per-node {world}")
            + " (the world size that wrote it)"
        )
    step = ck.read_manifest(checkpoint).step
    parts = part_paths(checkpoint, world)
    for rank, part in enumerate(parts):
        if not part.is_dir():
            raise ConfigError(
                f"checkpoint {checkpoint} was written by {_ranks(world)}, but rank {rank}'s part ({part}) is "
                "missing: a re-sharded resume reads every part; restore it, or resume from an older step"
            )
        damage = ck.problems(part)
        if damage:
            raise ck.CheckpointCorrupt(
                f"rank {rank}'s part of checkpoint step {step} is damaged: {'; '.join(damage[:5])}; resume "
                "from an older step (--resume STEP)"
            )
        if ck.read_manifest(part).step != step or snapshot.saved_world(part) != world:
            raise ConfigError(
                f"{part} is not rank {rank}'s part of checkpoint {checkpoint} (step {step}, {_ranks(world)}): "
                "resume from an older step (--resume STEP)"
            )
        if world > 1:
            mark = [int(v) for v in ck.read(part, snapshot.PARALLEL).tolist()]
            if mark != [world, rank]:
                raise ConfigError(
                    f"{part} says it is rank {mark[1]}'s part of {mark[0]} ranks, not rank {rank}'s"
                )
        ck.verify_compatible(part, snapshot.expected_arrays(engine, world, rank))
    return parts


def _state_offset(opt: Any, name: str, params: int) -> int:
    """Where the state ``name`` of the parameters from ``params`` on begins (linear state)."""
    return int(dict(opt.state_layout(params))[name][1]) if params else 0


def _fill(parts: list[Path], name: str, pieces: list[tuple[int, int, int, int]], dst: torch.Tensor) -> None:
    """``dst`` (a flat tensor) from pieces ``(old rank, src start, src stop, dst start)`` of array ``name``."""
    host = dst if dst.device.type == "cpu" and dst.is_contiguous() else torch.empty_like(dst, device="cpu")
    filled = 0
    for rank, a, b, at in pieces:
        if at != filled:  # the pieces tile the destination in order; anything else is a bug
            raise AssertionError(f"re-sharding {name!r}: piece at {at}, expected {filled}")
        ck.read_range(parts[rank], name, a, b, host[at : at + b - a])
        filled += b - a
    if filled != dst.numel():
        raise AssertionError(
            f"re-sharding {name!r}: the old parts give {filled} elements, the shard has {dst.numel()}"
        )
    if host is not dst:
        dst.copy_(host)


def restore(engine: Engine, checkpoint: Path, world: int) -> None:
    """Put into ``engine`` (this rank of its world) its shards of ``checkpoint``, written by ``world`` ranks."""
    parts = check_parts(engine, checkpoint, world)
    engine.wait_updates()
    state, opt = engine.host.state, engine.optimizer
    for u, master in enumerate(engine.host.masters):
        new = _own_shard(engine, u)
        spans = overlaps(new, world)
        for _old, lo, _hi in spans:
            assert (lo - new.start) % GRANULE == 0 or new.world == 1, (u, lo, new)
        _fill(
            parts,
            f"master/{u}",
            [(o.rank, lo - o.start, hi - o.start, lo - new.start) for o, lo, hi in spans],
            master,
        )
        mapped = state.mapped(u)
        for name, (dtype, numel) in state.layout(u).items():
            pieces = []
            for old, lo, hi in spans:
                a = _state_offset(opt, name, lo - old.start)
                count = int(dict(opt.state_layout(hi - lo))[name][1])
                pieces.append((old.rank, a, a + count, _state_offset(opt, name, lo - new.start)))
            key = f"state/{u}/{name}"
            if mapped is not None:
                _fill(parts, key, pieces, mapped[name])
            else:  # streamed: the shard's buffer through its tier
                buf = torch.empty(numel, dtype=dtype)
                _fill(parts, key, pieces, buf)
                state.write_buffer(u, name, buf)
    engine.invalidate_device_copies()


def resharded_meta(meta: Mapping[str, Any], saved: int, world: int) -> dict[str, Any]:
    """``meta`` of a checkpoint of ``saved`` ranks as ``world`` ranks go on from it: the data position
    (``batches_consumed``, each rank's own batches) counted for ``world`` ranks."""
    out = dict(meta)
    taken = int(meta.get("batches_consumed", 0)) * saved  # every rank's: the position in the one stream
    if taken % world:
        raise ConfigError(
            f"checkpoint step {meta.get('step')}: its {saved} ranks took {taken} batches, which {world} ranks "
            f"cannot share equally (rank r reads batches r, r + {world}, ...): resume on a world size that "
            f"divides {taken}"
        )
    out["batches_consumed"] = taken // world
    return out


def world_note(meta: Mapping[str, Any], saved: int, world: int, identity: Mapping[str, Any]) -> str:
    """The note a re-sharded resume prints (rank 0): the worlds, the step's batch and the data position."""
    before = dict(meta.get("identity", {})).get("grad_accum")
    accum, rows = identity.get("grad_accum"), identity.get("data.batch_size")
    taken = int(meta.get("batches_consumed", 0)) * saved
    batch = f"a step trains on {_times(world, accum, rows)}"
    if before is not None:
        batch += f", as it did on {_times(saved, before, rows)}"
    stride = "" if world == 1 else f" (rank r reads batches {taken} + r, {taken} + r + {world}, ...)"
    return (
        f"re-sharded checkpoint step {meta.get('step')} from {_ranks(saved)} to {_ranks(world)}: each rank "
        "read its new shards from the old parts (masters and optimizer state bit for bit the writing run's); "
        f"{batch}; the configured data goes on from batch {taken} of its stream{stride}"
    )


def _times(world: int, accum: Any, rows: Any) -> str:
    total = world * accum * rows if isinstance(accum, int) and isinstance(rows, int) else "?"
    who = "one process" if world == 1 else f"{world} ranks"
    return f"{who} x grad_accum {accum} x batch {rows} = {total} rows"
