"""``reference_run`` takes an optimizer factory, so a plugin optimizer is checked against the plain loop.

The example plugin's momentum-SGD driver (``tests/example_optimizer.py``, registered here as a
plugin) trains the tiny models in slidekit; the reference trains the transformers model with
``torch.optim.SGD(momentum=0.9)`` built by the factory: losses and every final parameter agree.
"""

from __future__ import annotations

import pytest
import torch
from example_optimizer import MomentumSGD

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor
from slidekit.testing.asserts import assert_losses_close, assert_states_close, rel_error
from slidekit.testing.models import random_batches
from slidekit.testing.reference import reference_run

LR, WD, MOMENTUM, STEPS = 2e-2, 0.05, 0.9, 5


class SGDPlugin:
    @hookimpl
    def slidekit_optimizers(self):
        yield OptimizerDescriptor(name="momentum_sgd_test", factory=MomentumSGD)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_plugin_optimizer_matches_the_torch_optimizer_it_implements(family, tiny_model):
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model(family))),
        optim=OptimConfig(name="momentum_sgd_test", lr=LR, weight_decay=WD, betas=(MOMENTUM, 0.999)),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
        steps=STEPS,
    )
    batches = random_batches(128, steps=STEPS)
    with Trainer(cfg, plugins=Plugins(extra=[("sgd", SGDPlugin())])) as t:
        init = t.state_dict()
        result = t.fit(batches)
        final = t.state_dict()
    ref = reference_run(
        t.hf_config,
        init,
        batches,
        lr=LR,
        weight_decay=WD,
        optimizer=lambda groups: torch.optim.SGD(groups, momentum=MOMENTUM, foreach=False),
    )
    assert_losses_close(result.losses, ref.losses, rtol=1e-5)
    assert_states_close(final, ref.state, rtol=1e-5)
    assert max(rel_error(ref.state[n], init[n]) for n in ref.state) > 1e-3  # it trained

    adam = reference_run(t.hf_config, init, batches, lr=LR, weight_decay=WD)  # the default: AdamW
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_states_close(final, adam.state, rtol=1e-5)  # the factory is what the reference used


def test_the_factory_is_checked():
    from slidekit.testing.models import tiny_config

    hf = tiny_config("llama")
    with pytest.raises(ValueError, match=r"betas=\(0\.8, 0\.9\) and eps=1e-08 configure the default AdamW"):
        reference_run(hf, {}, [], lr=1e-3, betas=(0.8, 0.9), optimizer=lambda g: torch.optim.SGD(g))
