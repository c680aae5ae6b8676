"""What an architecture adapter produces: the model's units, their flat layouts, its templates.

A *unit* is what the engine moves as one: the embedding, each decoder layer,
and the head (final norm + LM head). Each unit's parameters live in one flat
vector; ``UnitLayout`` says where every Hugging Face parameter sits in it.
Entries start on 64-element boundaries, so views into BF16 buffers stay
128-byte aligned; the padding between them is zero and stays zero.

``ArchSpec`` is the adapter's whole answer for one model: dimensions, the
per-family switches of the decoder layer, the units, and the rotary
frequencies. The layer computation itself lives in ``slidekit.models.decoder``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ALIGN",
    "ArchSpec",
    "LayerFlags",
    "ParamEntry",
    "UnitKind",
    "UnitLayout",
    "build_units",
]

#: Every entry of a flat vector starts at a multiple of this many elements.
ALIGN = 64


class UnitKind:
    """The three kinds of unit (plain strings, to keep layouts printable)."""

    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head"


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One parameter inside a unit's flat vector."""

    name: str  # full Hugging Face name, e.g. "model.layers.3.self_attn.q_proj.weight"
    key: str  # short name the templates use, e.g. "q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # first element in the flat vector

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True, slots=True)
class UnitLayout:
    """A unit: its position in the model and where its parameters sit in its flat vector."""

    index: int  # position in forward order: 0 = embedding, 1..L = layers, L+1 = head
    kind: str
    layer: int | None  # decoder layer number (0-based, as in HF names) for layer units
    entries: tuple[ParamEntry, ...]
    numel: int  # length of the flat vector, padding included

    def entry(self, key: str) -> ParamEntry:
        for e in self.entries:
            if e.key == key:
                return e
        raise KeyError(f"unit {self.index} ({self.kind}) has no parameter {key!r}")

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` shaped as this unit's parameters, keyed by short name."""
        return {e.key: flat[e.offset : e.stop].view(e.shape) for e in self.entries}


def _layout(
    index: int, kind: str, layer: int | None, params: list[tuple[str, str, tuple[int, ...]]]
) -> UnitLayout:
    entries = []
    offset = 0
    for name, key, shape in params:
        entries.append(ParamEntry(name, key, shape, offset))
        offset += -(-math.prod(shape) // ALIGN) * ALIGN
    return UnitLayout(index, kind, layer, tuple(entries), offset)


@dataclass(frozen=True, slots=True)
class LayerFlags:
    """The per-family switches of the Llama-style decoder layer."""

    qkv_bias: bool = False  # Qwen2/2.5
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE


@dataclass(frozen=True, kw_only=True, slots=True)
class ArchSpec:
    """Everything the engine needs to know about one model architecture instance."""

    family: str  # adapter name: "llama", "qwen2", "qwen3", "mistral"
    model_type: str  # the Hugging Face model_type
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    sliding_window: int | None  # attention window, None for full causal attention
    flags: LayerFlags
    initializer_range: float
    rope_init: Callable[[], tuple[torch.Tensor, float]]  # -> (inv_freq (D/2,), attention scaling)
    # The HF config's pad_token_id, in 0..vocab_size-1, or None: its embedding row gets no gradient from the
    # lookup (transformers builds nn.Embedding(padding_idx=pad_token_id)); a tied LM head still trains it.
    pad_token_id: int | None = None
    hf_config: Any = field(repr=False)  # the transformers config the spec came from
    units: tuple[UnitLayout, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}"
            )
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"pad_token_id {self.pad_token_id} is not a token id of the vocabulary (0..{self.vocab_size - 1})"
            )
        if not self.units:
            object.__setattr__(self, "units", build_units(self))

    @property
    def num_params(self) -> int:
        """Parameters of the model, padding excluded, tied weights counted once."""
        return sum(e.numel for u in self.units for e in u.entries)

    @property
    def embed(self) -> UnitLayout:
        return self.units[0]

    @property
    def head(self) -> UnitLayout:
        return self.units[-1]

    @property
    def layers(self) -> tuple[UnitLayout, ...]:
        return self.units[1:-1]


def _layer_params(spec: ArchSpec, i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    h, d, f = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    fl = spec.flags
    keys: list[tuple[str, tuple[int, ...]]] = [("input_layernorm.weight", (h,))]
    for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        keys.append((f"self_attn.{proj}.weight", (out, h)))
        if fl.qkv_bias:
            keys.append((f"self_attn.{proj}.bias", (out,)))
    keys.append(("self_attn.o_proj.weight", (h, q)))
    if fl.o_bias:
        keys.append(("self_attn.o_proj.bias", (h,)))
    if fl.qk_norm:
        keys += [("self_attn.q_norm.weight", (d,)), ("self_attn.k_norm.weight", (d,))]
    keys.append(("post_attention_layernorm.weight", (h,)))
    for proj, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
        keys.append((f"mlp.{proj}.weight", shape))
        if fl.mlp_bias:
            keys.append((f"mlp.{proj}.bias", (shape[0],)))
    return [(f"model.layers.{i}.{k}", k, s) for k, s in keys]


def build_units(spec: ArchSpec) -> tuple[UnitLayout, ...]:
    """Embedding, one unit per decoder layer, head. A tied LM head lives in the embedding unit."""
    v, h = spec.vocab_size, spec.hidden_size
    units = [_layout(0, UnitKind.EMBED, None, [("model.embed_tokens.weight", "embed_tokens.weight", (v, h))])]
    for i in range(spec.num_layers):
        units.append(_layout(i + 1, UnitKind.LAYER, i, _layer_params(spec, i)))
    head: list[tuple[str, str, tuple[int, ...]]] = [("model.norm.weight", "norm.weight", (h,))]
    if not spec.tie_embeddings:
        head.append(("lm_head.weight", "lm_head.weight", (v, h)))
    units.append(_layout(spec.num_layers + 1, UnitKind.HEAD, None, head))
    return tuple(units)
