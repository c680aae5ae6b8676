"""Whole steps: ``FitResult.step_seconds`` is the start-to-start period of consecutive steps, and the
last one ends only when every update has been applied (``Engine.drain``).

The optimizer lane is slowed (``fault_hook``) so that the host updates outlast the steps that queue
them: a per-step time that stopped when ``train_step`` returned (the updates still running on their
thread) would leave that time out, as the engine's own ``StepResult.seconds`` does.
"""

from __future__ import annotations

import time

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.testing.models import random_batches

DELAY = 0.05  # seconds added to every optimizer task


def test_step_seconds_are_start_to_start_and_the_last_step_drains(tiny_model):
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu", compute_dtype="float32", gpu_resident="none"),
        steps=3,
    )

    def slow_updates(lane: str) -> None:
        if lane == "optim":
            time.sleep(DELAY)

    with Trainer(cfg, fault_hook=slow_updates) as trainer:
        units = len(trainer.spec.units)
        batches = random_batches(trainer.spec.vocab_size, steps=3)
        t0 = time.perf_counter()
        result = trainer.fit(batches)
        wall = time.perf_counter() - t0
    assert len(result.step_seconds) == 3
    # Consecutive periods tile the loop: their sum is the time from the first start to the drain.
    assert sum(result.step_seconds) <= wall
    assert sum(result.step_seconds) >= 3 * units * DELAY  # every update of every step is inside
    # The last period holds at least the last step's own updates (all of them run after its backward).
    assert result.step_seconds[-1] >= units * DELAY
