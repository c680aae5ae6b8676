"""Which of a config's math slidekit implements: every field that changes it is checked here.

The decoder layer (``slidekit.models.decoder``) computes one thing: pre-norm
RMSNorm, attention with RoPE (optionally a sliding window, the same for every
layer), a SiLU-gated MLP, no dropout. A config that asks for anything else is
refused with the field, its value and what is supported, never trained with
different math. Values that are no-ops (``attention_dropout=0.0``,
``mlp_bias=False``, ``final_logit_softcapping=None``...) are accepted.

The checks follow transformers' own modeling files for each family: a field
counts when ``modeling_<family>.py`` reads it, or when it is another
architecture's math (soft-capping, multipliers, dropout) whose presence
means the checkpoint is not the family its ``model_type`` says. The full
list, per family, is in docs/models.md.

Test: ``pytest tests/models/test_math_support.py``.
"""

from __future__ import annotations

from typing import Any

from slidekit.errors import ModelLoadError

__all__ = ["FOREIGN_FIELDS", "SILU_ACTIVATIONS", "attention_window", "check_math", "padding_index", "refuse"]

#: ``hidden_act`` values that are SiLU in transformers' ACT2FN (the only activation the kernels gate with).
SILU_ACTIVATIONS = ("silu", "swish")

#: Math of other architectures, with the values that leave a Llama-style layer unchanged.
FOREIGN_FIELDS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),  # Gemma 2
    "final_logit_softcapping": (None,),  # Gemma 2
    "query_pre_attn_scalar": (None,),  # Gemma: attention scale other than head_dim**-0.5
    "embedding_multiplier": (None, 1.0),  # Granite
    "residual_multiplier": (None, 1.0),  # Granite
    "attention_multiplier": (None,),  # Granite: replaces head_dim**-0.5
    "logits_scaling": (None, 1.0),  # Granite
    "logit_scale": (None, 1.0),  # Cohere
    "scale_emb": (None, 1.0),  # MiniCPM
    "use_qk_norm": (None, False),  # Llama 4
    "use_bidirectional_attention": (None, False),
    "hidden_dropout": (None, 0.0),
    "resid_pdrop": (None, 0.0),
    "embd_pdrop": (None, 0.0),
}

#: Switches transformers hard-codes for a family: a config that says otherwise does not describe it.
_FIXED: dict[str, dict[str, tuple[Any, ...]]] = {
    "llama": {},
    "qwen2": {"mlp_bias": (None, False)},  # q/k/v always carry biases, o_proj and the MLP never
    "qwen3": {"mlp_bias": (None, False)},
    "mistral": {"mlp_bias": (None, False), "attention_bias": (None, False)},
}


def refuse(config: Any, field: str, value: Any, why: str, fix: str) -> ModelLoadError:
    """The error refusing ``config``'s ``field=value``: ``<model_type>: field=value is not supported: why; fix``."""
    return ModelLoadError(f"{config.model_type}: {field}={value!r} is not supported: {why}; {fix}")


def _is(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(value is None if a is None else value is not None and value == a for a in allowed)


def check_math(config: Any, family: str) -> None:
    """Refuse the fields of ``config`` whose math the ``family`` decoder layer does not compute."""
    act = getattr(config, "hidden_act", "silu")
    if act not in SILU_ACTIVATIONS:
        raise refuse(
            config,
            "hidden_act",
            act,
            "the MLP is gated with SiLU (the SwiGLU kernels)",
            f"supported: {', '.join(map(repr, SILU_ACTIVATIONS))}",
        )
    dropout = getattr(config, "attention_dropout", 0.0)
    if dropout is not None and float(dropout) != 0.0:
        raise refuse(
            config,
            "attention_dropout",
            dropout,
            "slidekit trains without dropout (a dropped attention weight would have to be redrawn identically "
            "when the backward pass recomputes the layer)",
            "set attention_dropout to 0.0 in config.json",
        )
    for field, allowed in {**FOREIGN_FIELDS, **_FIXED.get(family, {})}.items():
        value = getattr(config, field, None)
        if not _is(value, allowed):
            fine = " or ".join("null" if a is None else repr(a) for a in allowed)
            raise refuse(
                config,
                field,
                value,
                f"the {family} decoder layer (slidekit's and transformers') has no such math, so this "
                f"checkpoint is probably not a {family} model",
                f"supported: {fine}; use the model's own model_type if slidekit supports it",
            )


def _positive_window(config: Any, window: Any) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise refuse(
            config,
            "sliding_window",
            window,
            "a window is a positive number of tokens",
            "set it to a positive integer, or null for full attention",
        )
    return window


def _kinds(config: Any) -> dict[str, list[int]]:
    kinds: dict[str, list[int]] = {}
    for i, kind in enumerate(getattr(config, "layer_types", None) or ()):
        kinds.setdefault(str(kind), []).append(i)
    return kinds


def attention_window(config: Any, family: str) -> int | None:
    """The sliding window every layer uses (None: full causal attention), refusing per-layer patterns.

    Qwen2/Qwen3 mark each layer in ``layer_types`` (transformers derives it from
    ``use_sliding_window``, ``sliding_window`` and ``max_window_layers``);
    Mistral applies ``sliding_window`` to every layer; Llama has no window.
    """
    kinds = _kinds(config)
    if set(kinds) - {"full_attention", "sliding_attention"}:
        raise refuse(
            config,
            "layer_types",
            sorted(kinds),
            "slidekit's layers compute full or sliding-window causal attention only",
            "supported layer types: full_attention, sliding_attention",
        )
    window = getattr(config, "sliding_window", None)
    if family in ("qwen2", "qwen3"):
        if len(kinds) > 1:
            raise refuse(
                config,
                "layer_types",
                list(config.layer_types),
                f"it puts sliding attention on layers {kinds['sliding_attention']} and full attention on "
                f"{kinds['full_attention']} (from use_sliding_window={getattr(config, 'use_sliding_window', None)}, "
                f"sliding_window={window}, max_window_layers={getattr(config, 'max_window_layers', None)}), and "
                "slidekit gives every layer the same attention",
                "make every layer the same in config.json: full_attention (use_sliding_window=false, no "
                "sliding_attention in layer_types) or sliding_attention (use_sliding_window=true, "
                "max_window_layers=0)",
            )
        if "sliding_attention" not in kinds:
            return None
        if window is None:
            raise refuse(
                config,
                "sliding_window",
                None,
                "layer_types asks for sliding attention but gives no window (transformers fails here too)",
                "set sliding_window and use_sliding_window, or make every layer full_attention",
            )
        return _positive_window(config, window)
    if family == "llama" and window is not None:
        raise refuse(
            config,
            "sliding_window",
            window,
            "Llama attends over the whole sequence (transformers' Llama ignores this field)",
            "supported: null; a windowed checkpoint needs its own model_type (e.g. mistral)",
        )
    expected = "full_attention" if window is None else "sliding_attention"
    if kinds and set(kinds) != {expected}:
        raise refuse(
            config,
            "layer_types",
            sorted(kinds),
            f"{config.model_type} gives every layer the same attention ({expected}, from "
            f"sliding_window={window!r}), so per-layer types would be ignored",
            f"remove layer_types or make every entry {expected!r}",
        )
    return None if window is None else _positive_window(config, window)


def padding_index(config: Any) -> int | None:
    """``pad_token_id`` as the embedding's ``padding_idx`` (that row gets no gradient from the lookup), or None."""
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        return None
    vocab = config.vocab_size
    if isinstance(pad, bool) or not isinstance(pad, int) or not -vocab <= pad < vocab:
        raise refuse(
            config,
            "pad_token_id",
            pad,
            f"transformers makes it the embedding's padding_idx, which must be a token id below "
            f"vocab_size={vocab}",
            "set pad_token_id to null or to a token id of the vocabulary in config.json, or override it "
            "(model.overrides={'pad_token_id': ID}, or None for no padding token)",
        )
    return pad % vocab
