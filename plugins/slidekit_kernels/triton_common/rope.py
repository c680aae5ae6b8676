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
(batch, position) pairs (``rope_tile`` elements: one pair for Llama-sized
heads, more for small ones); each row of cos/sin it loads serves all heads of
q and k. Head counts and the head dimension are compile-time constants (a
model has one of each), so a power-of-two head layout needs no masks. Inputs
may have any strides with a unit last stride (the decoder hands in transposed
views of its projections); outputs keep the inputs' memory layout (inputs
with gaps are made contiguous first). Math in FP32, one rounding at the end.
Nothing is modified in place: the inputs and the incoming gradients may be
referenced elsewhere, and writing a fresh tensor costs the same single pass.
The backward pass skips the argument checks (autograd hands in gradients of
the checked outputs) and reuses the contiguous tables saved by the forward.

Test: ``pytest tests/plugins/test_triton_kernels.py -k rope``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from slidekit_kernels.triton_common._launch import cdiv, check_device, on_device
from slidekit_kernels.triton_common.vendors import LaunchConfig, next_pow2, prev_pow2

__all__ = ["RopeFunction", "RopePlan", "launch_plan", "rope", "rope_apply"]


@triton.jit
def _rotate_heads(X, OUT, pos, s_h, pos_ok, n_heads, half, d, c1, c2, s1, s2, BLOCK_H: tl.constexpr):
    """Rotate every head at a block of positions; X and OUT share strides, ``pos`` (BLOCK_P,) are offsets."""
    h = tl.arange(0, BLOCK_H)
    mask = pos_ok[:, None, None] & (h < n_heads)[None, :, None] & (d < half)[None, None, :]
    off = pos[:, None, None] + (h * s_h)[None, :, None] + d[None, None, :]
    x1 = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + off + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + off, (x1 * c1 - x2 * s1).to(OUT.dtype.element_ty), mask=mask)
    tl.store(OUT + off + half, (x2 * c2 + x1 * s2).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN,  # QO / KO have the strides of Q / K; COS / SIN are contiguous (T, 2 * HALF)
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,
    n_pos, seq_len,
    N_QH: tl.constexpr, N_KH: tl.constexpr, HALF: tl.constexpr,
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
    tab = p_ok[:, None] & (d < HALF)[None, :]
    tab_off = t[:, None] * (2 * HALF) + d[None, :]
    c1 = tl.load(COS + tab_off, mask=tab, other=0.0).to(tl.float32)[:, None, :]  # (BLOCK_P, 1, BLOCK_D)
    c2 = tl.load(COS + tab_off + HALF, mask=tab, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(SIN + tab_off, mask=tab, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(SIN + tab_off + HALF, mask=tab, other=0.0).to(tl.float32)[:, None, :]
    if BACKWARD:
        r1 = -s2
        r2 = -s1
    else:
        r1 = s1
        r2 = s2
    q_pos = b * sq_b + t * sq_t
    k_pos = b * sk_b + t * sk_t
    _rotate_heads(Q, QO, q_pos, sq_h, p_ok, N_QH, HALF, d, c1, c2, r1, r2, BLOCK_QH)
    _rotate_heads(K, KO, k_pos, sk_h, p_ok, N_KH, HALF, d, c1, c2, r1, r2, BLOCK_KH)


def _with_output(x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``x`` and an empty output of ``dtype`` with the same strides (x is copied if it has gaps)."""
    out = torch.empty_like(x) if x.dtype == dtype else torch.empty_like(x, dtype=dtype)
    if x.stride(-1) == 1:
        xs, os = x.stride(), out.stride()  # empty_like keeps x's strides when x is dense
        if xs == os or all(a == b for a, b, n in zip(os, xs, x.shape, strict=True) if n > 1):
            return x, out
    x = x.contiguous()
    return x, torch.empty_like(x, dtype=dtype)


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


class RopePlan(NamedTuple):
    """How the RoPE kernel is launched for B * T positions of Hq + Hk heads of D."""

    block_p: int  # positions per program
    block_qh: int  # q heads padded to a power of two
    block_kh: int
    block_d: int  # D / 2 padded to a power of two
    warps: int
    programs: int


def launch_plan(n_pos: int, hq: int, hk: int, d: int, cfg: LaunchConfig) -> RopePlan:
    """Launch sizes for ``n_pos`` (batch, position) pairs (``cfg.rope_*``)."""
    block_qh, block_kh, block_d = next_pow2(hq), next_pow2(hk), next_pow2(d // 2)
    per_position = 2 * (block_qh + block_kh) * block_d  # elements of q and k at one position
    block_p = min(prev_pow2(max(1, cfg.rope_tile // per_position)), next_pow2(n_pos))
    warps = cfg.num_warps(block_p * per_position, cfg.rope_elems_per_thread)
    return RopePlan(block_p, block_qh, block_kh, block_d, warps, cdiv(n_pos, block_p))


def _rope_launch(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig, backward: bool,
    dtypes: tuple[torch.dtype, torch.dtype],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The launch itself, for checked arguments and contiguous ``cos`` / ``sin``."""
    (q, qo), (k, ko) = _with_output(q, dtypes[0]), _with_output(k, dtypes[1])
    b, hq, t, d = q.shape
    hk = k.shape[1]
    n_pos = b * t
    if not n_pos or not d:
        return qo, ko
    plan = launch_plan(n_pos, hq, hk, d, cfg)
    sq, sk = q.stride(), k.stride()
    with on_device(q):
        _rope_kernel[(plan.programs,)](
            q, k, qo, ko, cos, sin, sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], n_pos, t,
            N_QH=hq, N_KH=hk, HALF=d // 2, BACKWARD=backward, BLOCK_P=plan.block_p,
            BLOCK_QH=plan.block_qh, BLOCK_KH=plan.block_kh, BLOCK_D=plan.block_d, num_warps=plan.warps,
        )  # fmt: skip
    return qo, ko


def rope_apply(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig, *, backward: bool = False,
    out_dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Rotate q (B, Hq, T, D) and k (B, Hk, T, D) by cos/sin (T, D): forward, or its transpose.

    Outputs have the inputs' memory layout and, unless ``out_dtypes`` says otherwise,
    the dtype torch would give ``q * cos`` (the promoted type).
    """
    _check(q, k, cos, sin)
    check_device(_rope_kernel, q, k, cos, sin)
    dtypes = out_dtypes or (torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype))
    return _rope_launch(q, k, cos.contiguous(), sin.contiguous(), cfg, backward, dtypes)


class RopeFunction(torch.autograd.Function):
    """Autograd wrapper: saves only cos and sin (contiguous); the gradient is the transposed rotation."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig
    ) -> tuple[Tensor, Tensor]:
        _check(q, k, cos, sin)
        check_device(_rope_kernel, q, k, cos, sin)
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.cfg, ctx.dtypes = cfg, (q.dtype, k.dtype)
        dtypes = (torch.promote_types(q.dtype, cos.dtype), torch.promote_types(k.dtype, cos.dtype))
        return _rope_launch(q, k, cos, sin, cfg, False, dtypes)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        gq, gk = _rope_launch(dq, dk, cos, sin, ctx.cfg, True, ctx.dtypes)
        return gq, gk, None, None, None


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, cfg: LaunchConfig) -> tuple[Tensor, Tensor]:
    """Apply RoPE to q (B, Hq, T, D) and k (B, Hk, T, D) with cos/sin (T, D); differentiable in q and k."""
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope: cos and sin are fixed tables; detach them (no gradient flows into them)")
    return RopeFunction.apply(q, k, cos, sin, cfg)
