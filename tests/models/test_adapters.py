"""Model adapters: unit layouts cover the Hugging Face parameters exactly; special configs match transformers."""

from __future__ import annotations

import pytest

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.models.base import ALIGN
from slidekit.testing.asserts import assert_losses_close, assert_states_close
from slidekit.testing.models import FAMILIES, random_batches, save_tiny_model, tiny_config
from slidekit.testing.reference import reference_run


@pytest.mark.parametrize("family", FAMILIES)
def test_units_cover_every_parameter_once(family):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    spec = Plugins().adapter_for(config.model_type).descriptor.factory(config)
    hf = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(config).named_parameters()}
    ours = {e.name: e.shape for u in spec.units for e in u.entries}
    assert ours == hf  # named_parameters drops the tied lm_head, and so do the units
    for unit in spec.units:
        stops = [0] + [e.stop for e in unit.entries]
        for e, prev in zip(unit.entries, stops, strict=False):
            assert e.offset % ALIGN == 0 and e.offset >= prev
        assert unit.numel >= unit.entries[-1].stop
    assert spec.num_params == sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def _two_steps_match(tmp_path, family, seq_len=16, **overrides):
    model_dir = save_tiny_model(family, tmp_path, **overrides)
    batches = random_batches(128, steps=2, seq_len=seq_len)
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-4),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
    )
    with Trainer(cfg) as t:
        init = t.state_dict()
        res = t.fit(batches)
        final = t.state_dict()
    ref = reference_run(t.hf_config, init, batches, lr=1e-4)
    assert_losses_close(res.losses, ref.losses, rtol=1e-5)
    assert_states_close(final, ref.state, rtol=1e-5)


def test_llama3_rope_scaling(tmp_path):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
        "rope_theta": 500000.0,
    }
    _two_steps_match(tmp_path, "llama", rope_parameters=rope)


def test_mistral_sliding_window_shorter_than_the_sequence(tmp_path):
    _two_steps_match(tmp_path, "mistral", seq_len=24, sliding_window=8)


def test_qwen2_untied_and_qwen3_with_biases(tmp_path):
    _two_steps_match(tmp_path / "a", "qwen2", tie_word_embeddings=False)
    _two_steps_match(tmp_path / "b", "qwen3", attention_bias=True)


def test_layerwise_sliding_window_is_refused_with_the_fix():
    from slidekit.errors import ModelLoadError

    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=8)
    with pytest.raises(ModelLoadError, match="set use_sliding_window to false"):
        Plugins().adapter_for("qwen2").descriptor.factory(config)


def test_unsupported_rope_type_is_refused():
    from slidekit.errors import ModelLoadError

    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "nonsense", "rope_theta": 10000.0}
    spec = Plugins().adapter_for("llama").descriptor.factory(config)
    with pytest.raises(ModelLoadError, match="rope_type 'nonsense' is not supported"):
        spec.rope_init()
