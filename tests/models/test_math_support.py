"""Config fields whose math slidekit does not compute are refused by name and value; no-op values pass.

The fields come from transformers' configuration and modeling files of each
supported family (see docs/models.md). Refusals happen when the adapter
builds the ArchSpec, before any weight is read. The implemented variants are
compared against transformers' forward in tests/models/test_adapters.py.
"""

from __future__ import annotations

import pytest

from slidekit.errors import ModelLoadError
from slidekit.models.support import FOREIGN_FIELDS
from slidekit.plugins import Plugins
from slidekit.testing.models import FAMILIES, tiny_config

LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "factor": 2.0,
    "short_factor": [1.0] * 8,
    "long_factor": [2.0] * 8,
    "original_max_position_embeddings": 32,
}
PER_LAYER_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}
MIXED_WINDOWS = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}

#: (family, config arguments, attributes set after construction, refused field, its value as the message shows it)
REFUSED = [
    ("llama", {"hidden_act": "gelu_pytorch_tanh"}, {}, "hidden_act", "'gelu_pytorch_tanh'"),
    ("qwen2", {"hidden_act": "gelu"}, {}, "hidden_act", "'gelu'"),
    ("qwen3", {"hidden_act": "relu"}, {}, "hidden_act", "'relu'"),
    ("mistral", {"hidden_act": "gelu_new"}, {}, "hidden_act", "'gelu_new'"),
    ("llama", {"attention_dropout": 0.1}, {}, "attention_dropout", "0.1"),
    ("qwen2", {"attention_dropout": 0.05}, {}, "attention_dropout", "0.05"),
    ("qwen3", {"attention_dropout": 1}, {}, "attention_dropout", "1"),
    ("mistral", {"attention_dropout": 0.1}, {}, "attention_dropout", "0.1"),
    ("llama", {"rope_parameters": LONGROPE}, {}, "rope_parameters.rope_type", "'longrope'"),
    (
        "qwen2",
        {},
        {"rope_parameters": {"rope_type": "nonsense", "rope_theta": 1e4}},
        "rope_parameters.rope_type",
        "'nonsense'",
    ),
    (
        "mistral",
        {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
        {},
        "rope_parameters.rope_type",
        "'proportional'",
    ),
    ("llama", {"partial_rotary_factor": 0.5}, {}, "partial_rotary_factor", "0.5"),
    ("qwen3", {}, {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta", "-1.0"),
    (
        "qwen2",
        {"layer_types": ["full_attention"] * 3},
        {"rope_parameters": PER_LAYER_ROPE},
        "rope_parameters",
        "{'full_attention'",
    ),
    (
        "qwen2",
        MIXED_WINDOWS,
        {},
        "layer_types",
        "['full_attention', 'sliding_attention', 'sliding_attention']",
    ),
    (
        "qwen3",
        MIXED_WINDOWS,
        {},
        "layer_types",
        "['full_attention', 'sliding_attention', 'sliding_attention']",
    ),
    (  # transformers nulls the window when use_sliding_window is false, then fails on the sliding layer
        "qwen2",
        {"sliding_window": 8, "layer_types": ["sliding_attention"] * 3},
        {},
        "sliding_window",
        "None",
    ),
    (
        "qwen3",
        {"layer_types": ["full_attention", "chunked_attention", "full_attention"]},
        {},
        "layer_types",
        "['chunked_attention', 'full_attention']",
    ),
    (
        "mistral",
        {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
        {},
        "layer_types",
        "['full_attention', 'sliding_attention']",
    ),
    ("mistral", {"sliding_window": 0}, {}, "sliding_window", "0"),
    ("llama", {"sliding_window": 8}, {}, "sliding_window", "8"),
    ("llama", {"pad_token_id": 128}, {}, "pad_token_id", "128"),
    ("qwen2", {"mlp_bias": True}, {}, "mlp_bias", "True"),
    ("qwen3", {"mlp_bias": True}, {}, "mlp_bias", "True"),
    ("mistral", {"mlp_bias": True}, {}, "mlp_bias", "True"),
    ("mistral", {"attention_bias": True}, {}, "attention_bias", "True"),
]

#: A value of each foreign field that changes the math.
FOREIGN_VALUES = {
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "query_pre_attn_scalar": 256,
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125,
    "logits_scaling": 8.0,
    "logit_scale": 0.0625,
    "scale_emb": 12,
    "use_qk_norm": True,
    "use_bidirectional_attention": True,
    "hidden_dropout": 0.1,
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
}


def _factory(family: str):
    return Plugins().adapter_for(family).descriptor.factory


def _config(family: str, arguments: dict, attributes: dict):
    config = tiny_config(family, **arguments)
    for name, value in attributes.items():
        setattr(config, name, value)
    return config


@pytest.mark.parametrize(
    ("family", "arguments", "attributes", "field", "value"),
    REFUSED,
    ids=[f"{c[0]}-{c[3]}-{c[4][:24]}" for c in REFUSED],
)
def test_unsupported_math_is_refused_by_field_and_value(family, arguments, attributes, field, value):
    config = _config(family, arguments, attributes)
    with pytest.raises(ModelLoadError) as err:
        _factory(family)(config)
    message = str(err.value)
    assert f"{field}={value}" in message, message
    assert "supported" in message or "set " in message, message  # says what would work


def test_every_foreign_field_is_tested():
    assert set(FOREIGN_VALUES) == set(FOREIGN_FIELDS)


@pytest.mark.parametrize("field", sorted(FOREIGN_VALUES))
def test_other_architectures_math_is_refused(field):
    family = FAMILIES[sorted(FOREIGN_VALUES).index(field) % len(FAMILIES)]  # spread over the families
    value = FOREIGN_VALUES[field]
    with pytest.raises(ModelLoadError, match=f"{field}={value!r} is not supported"):
        _factory(family)(tiny_config(family, **{field: value}))


NO_OPS = {
    "hidden_act": "swish",
    "attention_dropout": 0,
    "partial_rotary_factor": 1.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "pad_token_id": None,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "embedding_multiplier": 1.0,
    "hidden_dropout": 0.0,
    "use_bidirectional_attention": False,
    "mlp_bias": False,
}
FAMILY_NO_OPS = {
    "llama": {"pretraining_tp": 2, "attention_bias": False, "sliding_window": None},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 3,
    },  # no layer is windowed
    "mistral": {"sliding_window": None, "layer_types": ["full_attention"] * 3, "attention_bias": False},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_values_that_change_nothing_are_accepted(family):
    config = tiny_config(family, **NO_OPS, **FAMILY_NO_OPS[family])
    spec = _factory(family)(config)
    assert spec.sliding_window is None
    assert spec.pad_token_id is None
    inv_freq, scaling = spec.rope_init()
    assert scaling == 1.0 and inv_freq.shape == (spec.head_dim // 2,)


def test_a_window_on_every_layer_is_one_window():
    spec = _factory("qwen2")(
        tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    )
    assert spec.sliding_window == 8
    spec = _factory("mistral")(
        tiny_config("mistral", sliding_window=8, layer_types=["sliding_attention"] * 3)
    )
    assert spec.sliding_window == 8


def test_negative_pad_token_id_counts_from_the_end_as_in_nn_embedding():
    assert _factory("llama")(tiny_config("llama", pad_token_id=-1)).pad_token_id == 127


def test_a_rope_variant_missing_a_parameter_is_refused_at_once():
    config = tiny_config("llama", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    config.rope_parameters = {"rope_type": "linear", "rope_theta": 1e4}  # as a hand-edited config might be
    with pytest.raises(ModelLoadError, match=r"cannot be used for rope_type 'linear'.*'factor'"):
        _factory("llama")(config)


def test_dynamic_rope_is_refused_past_the_length_where_it_changes():
    import torch

    from slidekit.models.decoder import RopeTables

    config = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    tables = RopeTables(_factory("llama")(config))
    cos, _ = tables.get(64, torch.device("cpu"), torch.float32)  # max_position_embeddings: still the default
    assert cos.shape == (64, 16)
    with pytest.raises(ValueError, match="65 tokens are longer than max_position_embeddings=64"):
        tables.get(65, torch.device("cpu"), torch.float32)
