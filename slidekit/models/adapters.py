"""The bundled architecture adapters: Llama 3.x, Qwen2/2.5, Qwen3, Mistral.

Each adapter turns a Hugging Face config into an ``ArchSpec``, after
refusing every setting whose math slidekit does not compute
(``slidekit.models.support``, ``slidekit.models.rope``). They are
registered as the core plugin "slidekit.models" through the same hook a
third-party adapter uses (``slidekit_model_adapters``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import ModelAdapterDescriptor
from slidekit.models.base import ArchSpec, LayerFlags
from slidekit.models.rope import rope_init
from slidekit.models.support import attention_window, check_math, padding_index

__all__ = ["llama", "mistral", "qwen2", "qwen3"]


def _spec(config: Any, family: str, flags: LayerFlags) -> ArchSpec:
    check_math(config, family)
    window = attention_window(config, family)
    rope = rope_init(config)
    heads = config.num_attention_heads
    return ArchSpec(
        family=family,
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size,
        rms_eps=config.rms_norm_eps,
        max_positions=config.max_position_embeddings,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=window,
        flags=flags,
        initializer_range=getattr(config, "initializer_range", 0.02),
        rope_init=rope,
        pad_token_id=padding_index(config),
        hf_config=config,
    )


def llama(config: Any) -> ArchSpec:
    """Llama 2/3.x: optional attention and MLP biases, rope scaling (llama3, linear, dynamic, yarn)."""
    bias = bool(getattr(config, "attention_bias", False))
    flags = LayerFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
    return _spec(config, "llama", flags)


def qwen2(config: Any) -> ArchSpec:
    """Qwen2 / Qwen2.5: biases on q, k and v; tied embeddings on the small sizes; one window for all layers."""
    return _spec(config, "qwen2", LayerFlags(qkv_bias=True))


def qwen3(config: Any) -> ArchSpec:
    """Qwen3 (dense): RMSNorm on q and k per head before RoPE; one window for all layers."""
    bias = bool(getattr(config, "attention_bias", False))
    return _spec(config, "qwen3", LayerFlags(qkv_bias=bias, o_bias=bias, qk_norm=True))


def mistral(config: Any) -> ArchSpec:
    """Mistral: Llama layout without biases, optional sliding-window attention on every layer."""
    return _spec(config, "mistral", LayerFlags())


@hookimpl
def slidekit_model_adapters() -> Iterator[ModelAdapterDescriptor]:
    yield ModelAdapterDescriptor(
        name="llama", factory=llama, model_types=("llama",), description="Llama 2 / 3.x decoder"
    )
    yield ModelAdapterDescriptor(
        name="qwen2", factory=qwen2, model_types=("qwen2",), description="Qwen2 / Qwen2.5 decoder"
    )
    yield ModelAdapterDescriptor(
        name="qwen3", factory=qwen3, model_types=("qwen3",), description="Qwen3 dense decoder"
    )
    yield ModelAdapterDescriptor(
        name="mistral", factory=mistral, model_types=("mistral",), description="Mistral decoder"
    )
