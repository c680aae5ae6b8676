"""The layer templates: how each kind of unit computes, from bound weights and a kernel set.

One Llama-style decoder layer serves every supported family; ``LayerFlags``
switches on Qwen2's q/k/v biases, Qwen3's q/k norms and the like. Weights are
passed in as a mapping of short names to tensors, usually views into a flat
cache unit on the GPU, so "loading a layer" is one copy and nothing here
allocates parameters.

Shapes: ``ids`` (B, T); ``x`` (B, T, H); ``cos``/``sin`` (T, D).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from slidekit.interfaces import KernelSet
from slidekit.models.base import ArchSpec
from slidekit.models.rope import rope_type

__all__ = ["RopeTables", "embed_backward", "embed_forward", "head_loss", "layer_forward"]

Weights = Mapping[str, Tensor]


class RopeTables:
    """cos/sin tables for positions 0..T-1, shared by all layers and by every length T.

    One table per (device, dtype) covers the longest length asked for so far
    (grown geometrically, at most to the model's positions); a length T gets
    views of its first T rows. Micro-batches of different lengths in one step
    thus use the very same values at the same position, and a row does not
    depend on the table's length (each element is computed from its position
    alone), so a step's result does not depend on the lengths seen before.
    """

    def __init__(self, spec: ArchSpec) -> None:
        inv_freq, scaling = spec.rope_init()
        self._inv_freq = inv_freq.to(torch.float32).cpu()
        self._scaling = float(scaling)
        self._max_positions = spec.max_positions
        self._cache: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}
        # Dynamic NTK RoPE rescales its frequencies past max_position_embeddings (and transformers keeps
        # the rescaled ones afterwards): the fixed frequencies here hold only up to that length.
        self._limit = spec.max_positions if rope_type(spec.hf_config) == "dynamic" else None

    def get(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin), each (seq_len, D): contiguous views of the shared table."""
        if self._limit is not None and seq_len > self._limit:
            raise ValueError(
                f"rows of {seq_len} tokens are longer than max_position_embeddings={self._limit}, past which "
                "rope_type 'dynamic' changes its frequencies; slidekit computes it up to that length only"
            )
        key = (device, dtype)
        table = self._cache.get(key)
        if table is None or table[0].shape[0] < seq_len:
            have = 0 if table is None else table[0].shape[0]
            self._cache[key] = table = self._compute(
                max(seq_len, min(2 * have, self._max_positions)), device, dtype
            )
        cos, sin = table
        return cos[:seq_len], sin[:seq_len]

    def _compute(self, n: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        pos = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(pos, self._inv_freq)  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos = (emb.cos() * self._scaling).to(device=device, dtype=dtype)
        sin = (emb.sin() * self._scaling).to(device=device, dtype=dtype)
        return cos, sin


def embed_forward(w: Weights, ids: Tensor) -> Tensor:
    """Token embedding lookup: (B, T) -> (B, T, H)."""
    return F.embedding(ids, w["embed_tokens.weight"])


def embed_backward(grad_weight: Tensor, ids: Tensor, dh: Tensor, padding_idx: int | None = None) -> None:
    """Add the embedding's weight gradient into ``grad_weight`` (V, H), in place.

    Rows are summed in FP32 over the distinct tokens of the batch, then
    added once per distinct row. The sum must not depend on thread timing:
    on CUDA ``index_put_(accumulate=True)`` sorts and is deterministic (its
    ``index_add_`` uses atomics); on the CPU it is the other way round
    (``index_put_`` adds FP32 with atomics on several threads, ``index_add_``
    walks the indices in order), so each device gets its deterministic one.

    The row ``padding_idx`` (the model's ``pad_token_id``) gets nothing, as in
    ``nn.Embedding(padding_idx=...)``; a tied LM head's gradient, already in
    ``grad_weight``, stays.
    """
    flat_ids = ids.reshape(-1)
    uniq, inverse = torch.unique(flat_ids, return_inverse=True)
    rows = torch.zeros(uniq.numel(), dh.shape[-1], dtype=torch.float32, device=dh.device)
    src = dh.reshape(-1, dh.shape[-1]).float()
    if dh.device.type == "cpu":
        rows.index_add_(0, inverse, src)
    else:
        rows.index_put_((inverse,), src, accumulate=True)
    if padding_idx is not None:  # a mask, not a selection: no device synchronisation
        rows.masked_fill_((uniq == padding_idx).unsqueeze(1), 0.0)
    grad_weight[uniq] += rows.to(grad_weight.dtype)


def _linear(x: Tensor, w: Weights, name: str) -> Tensor:
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def layer_forward(
    spec: ArchSpec, w: Weights, x: Tensor, cos: Tensor, sin: Tensor, kernels: KernelSet
) -> Tensor:
    """One decoder layer: pre-norm attention and SwiGLU MLP, each with a residual."""
    b, t, _ = x.shape
    d = spec.head_dim
    h = kernels.rms_norm(x, w["input_layernorm.weight"], spec.rms_eps)
    q = _linear(h, w, "self_attn.q_proj").view(b, t, spec.num_heads, d)
    k = _linear(h, w, "self_attn.k_proj").view(b, t, spec.num_kv_heads, d)
    v = _linear(h, w, "self_attn.v_proj").view(b, t, spec.num_kv_heads, d)
    if spec.flags.qk_norm:
        q = kernels.rms_norm(q, w["self_attn.q_norm.weight"], spec.rms_eps)
        k = kernels.rms_norm(k, w["self_attn.k_norm.weight"], spec.rms_eps)
    q, k = kernels.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, heads, T, D)
    o = kernels.attention(q, k, v.transpose(1, 2), scale=d**-0.5, window=spec.sliding_window)
    x = x + _linear(o.transpose(1, 2).reshape(b, t, spec.num_heads * d), w, "self_attn.o_proj")
    h = kernels.rms_norm(x, w["post_attention_layernorm.weight"], spec.rms_eps)
    mid = kernels.swiglu(_linear(h, w, "mlp.gate_proj"), _linear(h, w, "mlp.up_proj"))
    return x + _linear(mid, w, "mlp.down_proj")


def head_loss(
    spec: ArchSpec,
    w_head: Weights,
    lm_weight: Tensor,
    x: Tensor,
    labels: Tensor,
    kernels: KernelSet,
    chunk_size: int | None,
) -> Tensor:
    """Final norm, LM head and summed cross-entropy over the tokens whose label is not -100.

    ``lm_weight`` is the head's own ``lm_head.weight`` or, for tied models, the
    embedding. The caller divides by the number of labelled tokens.
    """
    h = kernels.rms_norm(x, w_head["norm.weight"], spec.rms_eps)
    return kernels.linear_cross_entropy(
        h.reshape(-1, spec.hidden_size), lm_weight, labels.reshape(-1), chunk_size=chunk_size, reduction="sum"
    )
