"""Rotary position embedding of q and k in Triton (Hugging Face's ``rotate_half`` form), both directions.

With the head dimension D split into halves x = [x1, x2] and the tables
cos = [c1, c2], sin = [s1, s2] of shape (T, D)::

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = [-x2, x1]
    out1 = x1 * c1 - x2 * s1
    out2 = x2 * c2 + x1 * s2

The backward pass is the transposed rotation, the same kernel with
(s1, s2) replaced by (-s2, -s1)::

    dx1 = do1 * c1 + do2 * s2
    dx2 = do2 * c2 - do1 * s1

One program rotates every head of q and of k at a block of the B * T
(batch, position) pairs (one pair for Llama-sized heads, more for small
ones); each row of cos/sin it loads serves all heads of q and k. Inputs may
have any strides with a unit last stride (the decoder hands in transposed
views of its projections); outputs keep the inputs' memory layout (inputs
with gaps are made contiguous first). Math in FP32, one rounding at the end.
Nothing is modified in place: the inputs and the incoming gradients may be
referenced elsewhere, and writing a fresh tensor costs the same single pass.

Test: ``pytest tests/plugins/test_triton_kernels.py -k rope``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from slidekit_kernels.triton_common._launch import check_device, on_device
from slidekit_kernels.triton_common.vendors import LaunchConfig, next_pow2, prev_pow2

__all__ = ["RopeFunction", "rope", "rope_apply"]


@triton.jit
def _rotate_heads(X, OUT, pos, s_h, pos_ok, n_heads, half, d, d_ok, c1, c2, s1, s2, BLOCK_H: tl.constexpr):
    """Rotate every head at a block of positions; X and OUT share strides, ``pos`` (BLOCK_P,) are offsets."""
    h = tl.arange(0, BLOCK_H)
    mask = pos_ok[:, None, None] & (h < n_heads)[None, :, None] & d_ok[None, None, :]
    off = pos[:, None, None] + (h * s_h)[None, :, None] + d[None, None, :]
    x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + off, (x1 * c1 - x2 * s1).to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + off + half, (x2 * c2 + x1 * s2).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_fwd_kernel(
    Q, K, QO, KO, COS, SIN,  # QO / KO have the strides of Q / K; COS / SIN are contiguous (T, D)
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    n_pos, seq_len, n_q_heads, n_k_heads, half,
    BACKWARD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out = x * cos + rotate_half(x) * sin for q and k at BLOCK_P of the B * T (batch, position) pairs.

    BACKWARD applies the transposed rotation (sin halves swapped and negated).
    """
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < n_pos
    b = p // seq_len
    t = p - b * seq_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < half
    tab = p_ok[:, None] & d_ok[None, :]
    tab_off = t[:, None] * (2 * half) + d[None, :]
    c1 = tl.load(COS + tab_off, mask=tab, other=0.0).to(tl.float32)[:, None, :]  # (BLOCK_P, 1, BLOCK_D)
    c2 = tl.load(COS + tab_off + half, mask=tab, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(SIN + tab_off, mask=tab, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(SIN + tab_off + half, mask=tab, other=0.0).to(tl.float32)[:, None, :]
    if BACKWARD:
        r1 = -s2
        r2 = -s1
    else:
        r1 = s1
        r2 = s2
    q_pos = b * sq_b + t * sq_t
    k_pos = b * sk_b + t * sk_t
    _rotate_heads(Q, QO, q_pos, sq_h, p_ok, n_q_heads, half, d, d_ok, c1, c2, r1, r2, BLOCK_QH)
    _rotate_heads(K, KO, k_pos, sk_h, p_ok, n_k_heads, half, d, d_ok, c1, c2, r1, r2, BLOCK_KH)


def _with_output(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x`` and an empty output of ``dtype`` with the same strides (x is copied if it has gaps)."""
    out = torch.empty_like(x, dtype=dtype)  # keeps x's strides when x is dense
    same = all(a == b for a, b, n in zip(out.stride(), x.stride(), x.shape, strict=True) if n > 1)
    if not same or x.stride(-1) != 1:
        x = x.contiguous()
        out = torch.empty_like(x, dtype=dtype)
    return x, out


def _check(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q and k must be (B, heads, T, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ValueError(
            f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, length or head dim"
        )
    if d % 2:
        raise ValueError(f"rope: the head dimension must be even, got {d}")
    if cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(
            f"rope: cos and sin must be ({t}, {d}), got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def rope_apply(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig, *, backward: bool = False,
    out_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) by cos/sin (T, D): forward, or its transpose.

    Outputs have the inputs' memory layout and, unless ``out_dtypes`` says otherwise,
    the dtype torch would give ``q * cos`` (the promoted type).
    """
    _check(q, k, cos, sin)
    check_device(_rope_fwd_kernel, q, k, cos, sin)
    qd, kd = out_dtypes or (torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype))
    (q, qo), (k, ko) = _with_output(q, qd), _with_output(k, kd)
    cos, sin = cos.contiguous(), sin.contiguous()
    b, hq, t, d = q.shape
    hk = k.shape[1]
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    block_qh, block_kh, block_d = next_pow2(hq), next_pow2(hk), next_pow2(d // 2)
    per_position = 2 * (block_qh + block_kh) * block_d  # elements of q and k at one position
    block_p = min(prev_pow2(max(1, cfg.row_tile // per_position)), next_pow2(b * t))
    with on_device(q):
        _rope_fwd_kernel[(triton.cdiv(b * t, block_p),)](
            q, k, qo, ko, cos, sin,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            b * t, t, hq, hk, d // 2,
            BACKWARD=backward, BLOCK_P=block_p, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_D=block_d,
            num_warps=cfg.num_warps(block_p * per_position),
        )  # fmt: skip
    return qo, ko


class RopeFunction(torch.autograd.Function):
    """Autograd wrapper: saves only cos and sin; the gradient is the transposed rotation."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig
    ) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        ctx.cfg, ctx.dtypes = cfg, (q.dtype, k.dtype)
        return rope_apply(q, k, cos, sin, cfg)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        gq, gk = rope_apply(dq, dk, cos, sin, ctx.cfg, backward=True, out_dtypes=ctx.dtypes)
        return gq, gk, None, None, None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig) -> tuple[Tensor, Tensor]:
    """Apply RoPE to q (B, Hq, T, D) and k (B, Hk, T, D) with cos/sin (T, D); differentiable in q and k."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope: cos and sin are fixed tables; detach them (no gradient flows into them)")
    return RopeFunction.apply(q, k, cos, sin, cfg)
