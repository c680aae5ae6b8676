"""A driver that raises mid-step makes ``fit`` raise that error, quickly, and leaves no thread behind.

"Quickly" is checked without a clock: every wait in the engine is bounded by ``engine.timeout_s``
and raises ``PipelineStalled`` when it runs out, so ``fit`` raising the driver's own error proves
that the error reached the waiting thread before any wait gave up, however loaded the machine is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor, TierContext, TierDescriptor
from slidekit.testing.models import random_batches
from slidekit_optim.layer_adam import LayerAdam
from slidekit_tiers.ram import RamTier


class Boom(RuntimeError):
    pass


class FailingAdam(LayerAdam):
    """layer_adam that raises on its ``fail_at``-th update."""

    name = "failing_adam"
    fail_at = 5

    def __init__(self, hyper) -> None:
        super().__init__(hyper)
        self.calls = 0

    def step(self, *args, **kwargs) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Boom(f"optimizer failed on update {self.calls}")
        super().step(*args, **kwargs)


class FailingTier(RamTier):
    """A ram tier whose reads (or writes) raise after a few have succeeded."""

    name = "failing_tier"
    fail_op = "read"
    fail_at = 3

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self.calls = {"read": 0, "write": 0}

    def _failed(self, op: str) -> Future | None:
        """A future holding the error, delivered the way an I/O error would be."""
        self.calls[op] += 1
        if op != self.fail_op or self.calls[op] != self.fail_at:
            return None
        fut: Future = Future()
        fut.set_exception(Boom(f"tier {op} {self.calls[op]} failed"))
        return fut

    def read(self, key, dst, offset=0):
        return self._failed("read") or super().read(key, dst, offset)

    def write(self, key, src, offset=0):
        return self._failed("write") or super().write(key, src, offset)


class FaultPlugin:
    @hookimpl
    def slidekit_optimizers(self) -> Iterator[OptimizerDescriptor]:
        yield OptimizerDescriptor(name="failing_adam", factory=FailingAdam)

    @hookimpl
    def slidekit_storage_tiers(self) -> Iterator[TierDescriptor]:
        yield TierDescriptor(name="failing_tier", factory=FailingTier)


def _slidekit_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("slidekit-")]


def _trainer(tiny_model, **engine) -> Trainer:
    optim = engine.pop("optimizer", "layer_adam")
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(name=optim, lr=1e-3),
        engine=EngineConfig(device="cpu", timeout_s=30, **engine),
    )
    return Trainer(cfg, plugins=Plugins(extra=[("faults", FaultPlugin())]))


def _run(tiny_model, **engine) -> None:
    _trainer(tiny_model, **engine).fit(random_batches(128, steps=4))


@pytest.mark.parametrize(
    "engine",
    [
        {"optimizer": "failing_adam"},
        {"activation_tier": "failing_tier"},  # a read of a boundary activation in the backward pass
        {"state_tier": "ram", "activation_tier": "failing_tier", "_op": "write"},
    ],
    ids=["optimizer", "tier-read", "tier-write"],
)
def test_fit_raises_the_drivers_error_quickly(tiny_model, engine, monkeypatch):
    engine = dict(engine)
    monkeypatch.setattr(FailingTier, "fail_op", engine.pop("_op", "read"))
    before = set(_slidekit_threads())
    with pytest.raises(Boom):  # the driver's error itself, not PipelineStalled: no wait ran out
        _run(tiny_model, **engine)
    leftover = [t for t in _slidekit_threads() if t not in before and t.is_alive()]
    assert not leftover, f"threads still running after the failure: {leftover}"


def test_a_failing_state_tier_stops_the_optimizer_thread(tiny_model, monkeypatch):
    """State on a tier that cannot map is staged through reads on the optimizer thread."""

    class Unmappable(FailingTier):
        def map(self, key):
            return None

    monkeypatch.setattr(
        FaultPlugin,
        "slidekit_storage_tiers",
        hookimpl(lambda self: iter([TierDescriptor(name="failing_tier", factory=Unmappable)])),
    )
    monkeypatch.setattr(FailingTier, "fail_at", 20)  # past the zeroing writes, into training
    with pytest.raises(Boom):
        _run(tiny_model, state_tier="failing_tier")


def test_after_a_failure_the_trainer_is_closed(tiny_model):
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(name="failing_adam", lr=1e-3),
        engine=EngineConfig(device="cpu"),
    )
    trainer = Trainer(cfg, plugins=Plugins(extra=[("faults", FaultPlugin())]))
    with pytest.raises(Boom):
        trainer.fit(random_batches(128, steps=4))
    with pytest.raises(RuntimeError, match="closed"):
        trainer.fit(random_batches(128, steps=1))
    assert torch.get_num_threads() >= 1
