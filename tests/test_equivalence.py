"""slidekit against a plain PyTorch loop (transformers model + torch.optim.AdamW), FP32 on the CPU.

Ten steps on the same model, data and hyper-parameters: losses and every final
parameter agree to a relative 1e-5, for each supported family. The tiny
models come from safetensors written by transformers, so loading is covered.

The learning rate is a fine-tuning one (1e-4): Adam divides each gradient by
its own running RMS, so parameters whose gradients are nearly cancelled (the
k-projection biases, whose gradient would vanish exactly without RoPE) turn
last-bit differences of the gradient into relative differences of the update;
the size of those differences in the parameters scales with the learning rate.
"""

from __future__ import annotations

import pytest

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.testing.asserts import assert_losses_close, assert_states_close, rel_error
from slidekit.testing.models import FAMILIES, random_batches
from slidekit.testing.reference import reference_run

STEPS = 10
LR = 1e-4
WD = 0.1


def _config(model_dir, **engine) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=LR, weight_decay=WD),
        engine=EngineConfig(device="cpu", compute_dtype="float32", **engine),
        steps=STEPS,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_reference_loop(family, tiny_model):
    model_dir = tiny_model(family)
    batches = random_batches(128, steps=STEPS)
    with Trainer(_config(model_dir)) as trainer:
        init = trainer.state_dict()
        result = trainer.fit(batches)
        final = trainer.state_dict()
    ref = reference_run(trainer.hf_config, init, batches, lr=LR, weight_decay=WD)

    assert_losses_close(result.losses, ref.losses, rtol=1e-5)
    assert_states_close(final, ref.state, rtol=1e-5)
    # The run must have moved the parameters far beyond the tolerance, or the check means nothing.
    moved = max(rel_error(ref.state[n], init[n]) for n in ref.state)
    assert moved > 1e-3


def test_window_of_two_and_activations_on_a_tier_match_too(tiny_model):
    """The smallest window and boundary activations on the ram tier change nothing but speed."""
    model_dir = tiny_model("qwen2")  # tied embeddings: the pinned cache unit plus two taking turns
    batches = random_batches(128, steps=4)
    with Trainer(_config(model_dir)) as t:
        base = t.fit(batches)
        base_state = t.state_dict()
    with Trainer(_config(model_dir, window=2, activation_tier="ram")) as t:
        other = t.fit(batches)
        other_state = t.state_dict()
    assert other.losses == base.losses
    for name, value in base_state.items():
        assert other_state[name].equal(value), name


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and untied embeddings
def test_forward_only_passes_between_steps_change_nothing(family, tiny_model):
    model_dir = tiny_model(family)
    batches = random_batches(128, steps=4)
    with Trainer(_config(model_dir)) as t:
        straight = t.fit(batches)
        want = t.state_dict()
    with Trainer(_config(model_dir)) as t:
        first = t.fit(batches[:2])
        t.engine.forward(batches[0].input_ids)  # logits
        t.evaluate(batches[1:2])  # fused loss
        second = t.fit(batches[2:])
        got = t.state_dict()
    assert first.losses + second.losses == straight.losses
    for name, value in want.items():
        assert got[name].equal(value), name


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
@pytest.mark.parametrize("resident", ["0.5", "all"])
def test_resident_units_give_the_same_bits(family, resident, tiny_model):
    """Units kept on the compute device (updated there, at the end of the step) change nothing on the CPU."""
    model_dir = tiny_model(family)
    batches = random_batches(128, steps=4)
    with Trainer(_config(model_dir)) as t:
        base = t.fit(batches)
        want = t.state_dict()
    with Trainer(_config(model_dir, gpu_resident=resident)) as t:
        assert len(t.engine.window.resident) == (
            len(t.spec.units) if resident == "all" else round(0.5 * len(t.spec.units))
        )
        got = t.fit(batches)
        state = t.state_dict()
    assert got.losses == base.losses
    for name, value in want.items():
        assert state[name].equal(value), name


@pytest.mark.parametrize("controls", [{"max_grad_norm": 0.5}, {"on_nonfinite": "skip"}])
def test_resident_units_with_deferred_updates(controls, tiny_model):
    """Clipping and skip-on-NaN hold every update until the end of the step: resident ones too."""
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=3)

    def run(resident: str):
        cfg = _config(model_dir, gpu_resident=resident)
        cfg = TrainConfig(
            model=cfg.model,
            optim=OptimConfig(lr=LR, weight_decay=WD, **controls),
            engine=cfg.engine,
            steps=cfg.steps,
        )
        with Trainer(cfg) as t:
            return t.fit(batches).losses, t.state_dict()

    base, half = run("none"), run("0.5")
    assert half[0] == base[0]
    for name, value in base[1].items():
        assert half[1][name].equal(value), name
