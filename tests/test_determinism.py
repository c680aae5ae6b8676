"""Two runs with the same seed give bitwise identical parameters and losses."""

from __future__ import annotations

from slidekit import DataConfig, EngineConfig, OptimConfig, TrainConfig, Trainer
from slidekit.testing.asserts import assert_states_equal


def _run(seed: int):
    cfg = TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01),
        engine=EngineConfig(device="cpu"),
        steps=4,
        seed=seed,
    )
    with Trainer(cfg) as trainer:
        result = trainer.fit()  # the embedded demo model and corpus, random init from the seed
        return result.losses, trainer.state_dict()


def test_same_seed_same_bits():
    losses_a, state_a = _run(0)
    losses_b, state_b = _run(0)
    assert losses_a == losses_b
    assert_states_equal(state_a, state_b)


def test_another_seed_changes_the_data_order():
    losses_a, _ = _run(0)
    losses_c, _ = _run(1)
    assert losses_a != losses_c
