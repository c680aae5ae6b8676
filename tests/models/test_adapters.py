"""Model adapters: unit layouts cover the Hugging Face parameters exactly; special configs match transformers.

Every config variant slidekit implements (RoPE scaling types, the config.json
forms transformers reads them from, windows, head shapes, biases, padding
rows) trains two steps exactly as transformers' model with torch.optim.AdamW
does. The variants slidekit refuses are in test_math_support.py.
"""

from __future__ import annotations

import json

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


def _two_steps_match(tmp_path, family, seq_len=16, batches=None, **overrides):
    model_dir = save_tiny_model(family, tmp_path, **overrides)
    return _two_steps_match_dir(model_dir, seq_len, batches)


def _two_steps_match_dir(model_dir, seq_len=16, batches=None):
    batches = batches or random_batches(128, steps=2, seq_len=seq_len)
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
    # A k-projection bias adds one vector to every key of a head: softmax ignores it but for RoPE's
    # rotation, so its gradient nearly cancels (with a large rope_theta most of all), and Adam, which divides
    # each gradient by its own RMS, turns last-bit differences of the two implementations' sums (another
    # CPU's BLAS order) into relative differences of the update (tests/test_equivalence.py's docstring).
    # Seen on the H200 machine's CPU: 1.28e-5 with yarn at theta 1e6. Those get 1e-4; every other 1e-5.
    near_cancelling = {n for n in ref.state if n.endswith("k_proj.bias")}
    assert_states_close(_without(final, near_cancelling), _without(ref.state, near_cancelling), rtol=1e-5)
    assert_states_close(final, {n: ref.state[n] for n in near_cancelling}, rtol=1e-4)
    return t.spec


def _without(state, names):
    return {n: v for n, v in state.items() if n not in names}


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 1e6}
ROPES = [
    ("llama", LLAMA3),
    ("llama", {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
    ("mistral", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
    ("qwen2", YARN),
    ("qwen3", {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 0.9}),
]


@pytest.mark.parametrize(("family", "rope"), ROPES, ids=[f"{f}-{r['rope_type']}" for f, r in ROPES])
def test_rope_scaling_matches_transformers(tmp_path, family, rope):
    spec = _two_steps_match(tmp_path, family, rope_parameters=rope)
    default = tiny_config(family, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]})
    plain = Plugins().adapter_for(family).descriptor.factory(default).rope_init()
    inv_freq, scaling = spec.rope_init()
    same = inv_freq.equal(plain[0]) and scaling == plain[1]
    assert same == (rope["rope_type"] == "dynamic")  # dynamic equals default up to max_position_embeddings


LEGACY = [  # config.json as transformers 4 wrote it: rope_theta beside rope_scaling, "type" for rope_type
    (
        "qwen2",
        {
            "rope_theta": 1e6,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        },
        "yarn",
    ),
    (
        "llama",
        {"rope_theta": 5e5, "rope_scaling": {k: v for k, v in LLAMA3.items() if k != "rope_theta"}},
        "llama3",
    ),
    ("mistral", {"rope_theta": 1e6, "rope_scaling": None}, "default"),
]


@pytest.mark.parametrize(("family", "fields", "rope_type"), LEGACY, ids=[f for f, _, _ in LEGACY])
def test_transformers_4_rope_fields_in_config_json_match(tmp_path, family, fields, rope_type):
    model_dir = save_tiny_model(family, tmp_path)
    path = model_dir / "config.json"
    values = json.loads(path.read_text())
    del values["rope_parameters"]
    path.write_text(json.dumps({**values, **fields}))
    spec = _two_steps_match_dir(model_dir)
    params = spec.hf_config.rope_parameters  # as transformers 5 normalised it on load
    assert (params["rope_type"], params["rope_theta"]) == (rope_type, fields["rope_theta"])


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sliding_window_on_every_layer_matches(tmp_path, family):
    spec = _two_steps_match(
        tmp_path, family, seq_len=24, use_sliding_window=True, sliding_window=8, max_window_layers=0
    )
    assert spec.sliding_window == 8


def test_mistral_sliding_window_shorter_than_the_sequence(tmp_path):
    _two_steps_match(tmp_path, "mistral", seq_len=24, sliding_window=8)


SHAPES = {  # head_dim other than hidden/heads, MHA and MQA, an rms_norm_eps large enough to matter
    "llama": {"head_dim": 24, "num_key_value_heads": 4, "rms_norm_eps": 0.1},
    "qwen2": {"head_dim": 24, "num_key_value_heads": 1, "rms_norm_eps": 0.1},
    "qwen3": {"head_dim": 8, "num_key_value_heads": 4, "rms_norm_eps": 0.1},
    "mistral": {"head_dim": 24, "num_key_value_heads": 1, "rms_norm_eps": 0.1, "hidden_act": "swish"},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_head_shapes_and_norm_eps_match(tmp_path, family):
    spec = _two_steps_match(tmp_path, family, **SHAPES[family])
    assert (spec.head_dim, spec.num_kv_heads, spec.rms_eps) == tuple(
        SHAPES[family][k] for k in ("head_dim", "num_key_value_heads", "rms_norm_eps")
    )


def test_qwen2_untied_and_qwen3_with_biases(tmp_path):
    _two_steps_match(tmp_path / "a", "qwen2", tie_word_embeddings=False)
    _two_steps_match(tmp_path / "b", "qwen3", attention_bias=True)


def test_llama_with_mlp_biases_and_tied_embeddings(tmp_path):
    spec = _two_steps_match(tmp_path, "llama", mlp_bias=True, tie_word_embeddings=True)
    assert spec.flags.mlp_bias and spec.tie_embeddings


@pytest.mark.parametrize(
    "family", ["llama", "qwen2"]
)  # untied and tied: the head still trains a tied pad row
def test_pad_token_row_gets_no_gradient_from_the_lookup(tmp_path, family):
    pad = 5
    batches = random_batches(128, steps=2)
    for b in batches:
        b.input_ids[:, ::3] = pad  # the pad token in every row, as packed documents' eos = pad do
    spec = _two_steps_match(tmp_path, family, batches=batches, pad_token_id=pad)
    assert spec.pad_token_id == pad
