"""Rank functions for the per-rank planning tests (``test_dp_planning.py``), run by ``dp_ranks.run_ranks``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 1 << 30


@dataclass
class Build:
    """A data-parallel Trainer of the tiny model, trained one step, its footprint against its layout."""

    model_dir: str
    optimizer: str = "layer_adam"
    resident: Any = "none"  # one value for every rank, or a list: rank r takes resident[r]
    clip: bool = False
    engine: dict[str, Any] = field(default_factory=dict)
    accum: int = 1


def _dp(rank: int, world: int, store: str) -> Any:
    import torch.distributed as dist

    from slidekit.distributed import DataParallel

    return DataParallel.init(dist.FileStore(store, world), rank=rank, world=world, device=torch.device("cpu"))


def footprint_against_layout(rank: int, world: int, store: str, job: Build) -> dict[str, Any]:
    """Build rank ``rank``'s engine, train a step, and return what it holds next to what its layout says."""
    from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
    from slidekit.engine.build import footprint
    from slidekit.testing.models import random_batches

    resident = job.resident[rank] if isinstance(job.resident, list) else job.resident
    config = TrainConfig(
        model=ModelConfig(source=job.model_dir),
        optim=OptimConfig(lr=1e-4, name=job.optimizer, max_grad_norm=1.0 if job.clip else None),
        engine=EngineConfig(device="cpu", compute_dtype="float32", gpu_resident=resident, timeout_s=30.0, **job.engine),
        data=DataConfig(batch_size=2, seq_len=16),
        steps=1,
        grad_accum=job.accum,
    )
    parallel = _dp(rank, world, store)
    try:
        with Trainer(config, parallel=parallel) as t:
            layout = t.engine.layout
            batches = random_batches(t.spec.vocab_size, steps=job.accum * world, batch=2, seq_len=16)
            t.fit(batches[rank::world])
            return {
                "expected": layout.allocations(),
                "measured": footprint(t.engine, t._tiers),
                "host_state": sum(u.state_bytes for u in layout.units if u.slides and u.state_medium == "host"),
                "own": [u.own for u in layout.units],
                "numel": [u.numel for u in layout.units],
                "world": layout.world,
                "rank": layout.rank,
                "machine": t.machine(),
                "describe": layout.describe(),
            }
    finally:
        parallel.close()


def agreed_machine(rank: int, world: int, store: str) -> Any:
    """The machine rank ``rank`` plans on when each rank measured a different one."""
    from slidekit.distributed.planning import rank_machine
    from slidekit.planning import Machine

    seen = Machine(
        device_type="cpu",
        host_available=(10 + rank) * GIB,
        host_total=64 * GIB,
        disk_free=(100 - rank) * GIB,
        run_dir_free=None,
    )
    parallel = _dp(rank, world, store)
    try:
        return rank_machine(seen, parallel)
    finally:
        parallel.close()


def agreed_probed_machine(rank: int, world: int, store: str) -> Any:
    """The rates rank ``rank`` plans with when each rank probed its GPU and measured differently."""
    import dataclasses

    from slidekit.distributed.planning import rank_machine
    from slidekit.planning import Machine
    from slidekit.planning.probe import H200_PROBE, rates_from

    probed = dataclasses.replace(H200_PROBE, matmul_tflops=700.0 + 50 * rank, host_gbps=90.0 - 10 * rank)
    seen = Machine(
        device_type="cuda",
        device_free=70 * GIB,
        device_total=80 * GIB,
        host_available=60 * GIB,
        host_total=64 * GIB,
        rates=rates_from(probed, "Some GPU"),
        probed=probed,
        gpu="Some GPU",
    )
    parallel = _dp(rank, world, store)
    try:
        return rank_machine(seen, parallel)
    finally:
        parallel.close()
