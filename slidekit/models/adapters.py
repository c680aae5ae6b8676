"""The bundled architecture adapters: Llama 3.x, Qwen2/2.5, Qwen3, Mistral.

Each adapter turns a Hugging Face config into an ``ArchSpec``. They are
registered as the core plugin "slidekit.models" through the same hook a
third-party adapter uses (``slidekit_model_adapters``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from slidekit.errors import ModelLoadError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import ModelAdapterDescriptor
from slidekit.models.base import ArchSpec, LayerFlags

__all__ = ["llama", "mistral", "qwen2", "qwen3"]


def _rope_init(config: Any) -> Callable[[], tuple[torch.Tensor, float]]:
    """(inv_freq, attention scaling) exactly as transformers computes them for this config."""

    def init() -> tuple[torch.Tensor, float]:
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            return inv_freq, 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ModelLoadError(
                f"rope_type {rope_type!r} is not supported; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}"
            )
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq, float(scaling)

    return init


def _no_layerwise_window(config: Any) -> None:
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError(
            f"{config.model_type}: use_sliding_window=True (sliding attention on some layers only) is not "
            "supported; set use_sliding_window to false in config.json"
        )


def _pad_token_id(config: Any) -> int | None:
    """The row ``nn.Embedding(vocab_size, hidden, padding_idx=config.pad_token_id)`` keeps out of training.

    None when the config has none. Negative ids count from the end, as torch counts ``padding_idx``.
    """
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        return None
    vocab = config.vocab_size
    if isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        raise ModelLoadError(
            f"{config.model_type}: pad_token_id {pad!r} is not a token id of the vocabulary of {vocab} "
            f"(0..{vocab - 1}); correct it in config.json or override it (model.overrides "
            "{'pad_token_id': ID}, or None for no padding token)"
        )
    return pad % vocab


def _spec(config: Any, family: str, flags: LayerFlags, sliding_window: int | None) -> ArchSpec:
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
        pad_token_id=_pad_token_id(config),
        sliding_window=sliding_window,
        flags=flags,
        initializer_range=getattr(config, "initializer_range", 0.02),
        rope_init=_rope_init(config),
        hf_config=config,
    )


def llama(config: Any) -> ArchSpec:
    """Llama 2/3.x: optional attention and MLP biases, rope scaling of type llama3."""
    bias = bool(getattr(config, "attention_bias", False))
    flags = LayerFlags(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))
    return _spec(config, "llama", flags, None)


def qwen2(config: Any) -> ArchSpec:
    """Qwen2 / Qwen2.5: biases on q, k and v; tied embeddings on the small sizes."""
    _no_layerwise_window(config)
    return _spec(config, "qwen2", LayerFlags(qkv_bias=True), None)


def qwen3(config: Any) -> ArchSpec:
    """Qwen3 (dense): RMSNorm on q and k per head before RoPE."""
    _no_layerwise_window(config)
    bias = bool(getattr(config, "attention_bias", False))
    return _spec(config, "qwen3", LayerFlags(qkv_bias=bias, o_bias=bias, qk_norm=True), None)


def mistral(config: Any) -> ArchSpec:
    """Mistral: Llama layout with optional sliding-window attention."""
    return _spec(config, "mistral", LayerFlags(), getattr(config, "sliding_window", None))


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
