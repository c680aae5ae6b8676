"""A prefetch never holds up the main thread.

When every cache unit is still in use (its gradients waiting to come down
behind the CPU's updates), the engine used to block in the prefetch of a
later visit, so the GPU sat idle even when the visit at hand was a resident
unit that needs no cache unit at all. A prefetch now gives up at once; the
visit itself claims a cache unit when its turn comes.
"""

from __future__ import annotations

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.errors import PipelineStalled
from slidekit.planning import spread_host_units
from slidekit.testing.models import random_batches

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _trainer(model_dir, resident: str, timeout_s: float = 60.0) -> Trainer:
    return Trainer(
        TrainConfig(
            model=ModelConfig(source=str(model_dir)),
            optim=OptimConfig(lr=1e-3),
            engine=EngineConfig(device=DEVICE, gpu_resident=resident, timeout_s=timeout_s),
        )
    )


def test_try_claim_takes_a_free_cache_unit_or_none(tiny_model):
    with _trainer(tiny_model("llama"), "none") as t:
        window = t.engine.window
        held = [window.try_claim(-10 - i, 0) for i in range(len(window.slots))]
        assert all(s is not None for s in held) and len({s.index for s in held if s}) == len(window.slots)
        assert window.try_claim(-99, 0) is None  # every cache unit in use: no wait, no slot
        window.release(held[1], None)
        again = window.try_claim(-98, 0)
        assert again is held[1] and again.unit == -98
        with pytest.raises(PipelineStalled):  # the visit's own claim still waits (bounded)
            t.engine.pipeline.timeout_s = 0.2
            window.claim(-97, 0)


def test_a_resident_visit_runs_while_every_cache_unit_is_in_use(tiny_model):
    model_dir = tiny_model("llama")
    with _trainer(model_dir, "0.5", timeout_s=30.0) as t:
        engine = t.engine
        units = len(t.spec.units)
        on_host = spread_host_units(units, units - round(0.5 * units))
        assert set(engine.window.resident) == {u for u in range(units) if not on_host[u]}
        # a backward visit of a resident unit followed by one of a unit that needs a cache unit
        k = next(
            i
            for i, v in enumerate(engine.visits[:-1])
            if v.unit in engine.window.resident
            and engine.visits[i + 1].needs_params
            and engine.visits[i + 1].unit not in engine.window.resident
        )
        held = [engine.window.claim(-10 - i, 0) for i in range(len(engine.window.slots))]
        # With every cache unit held here and no time allowed for any wait, a wait for a cache unit
        # raises PipelineStalled at once: the visit returning shows that it never waited for one.
        engine.pipeline.timeout_s = 0.0
        slot = engine._acquire(k)
        engine.pipeline.timeout_s = 30.0
        assert slot is engine.window.resident[engine.visits[k].unit]
        assert k + 1 not in engine._loads  # the prefetch gave up; the visit will claim its own
        for s in held:
            engine.window.release(s, None)
        engine._loads.clear()
        engine.pipeline.drain()
        # and training is unaffected: the same losses as with every unit on the host
        batches = random_batches(128, steps=2)
        got = t.fit(batches).losses
    with _trainer(model_dir, "none") as t:
        assert t.fit(batches).losses == got
