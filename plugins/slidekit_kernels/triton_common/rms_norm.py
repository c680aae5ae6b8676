"""RMSNorm in Triton, exactly as Hugging Face's Llama/Qwen compute it, with dx and dweight.

Forward, per row x of length H (statistics in FP32, then cast, then the weight)::

    r = 1 / sqrt(mean(x^2) + eps)          FP32, saved per row for backward
    n = cast_to_x_dtype(x * r)
    y = w * n                              in the promoted dtype of x and w

Backward, with dn = dy * w and n in FP32::

    dx = r * (dn - n * mean(dn * n))
    dw = sum over rows of dy * cast_to_x_dtype(n)

The forward pass writes a fresh y and saves r (FP32, one per row). The
backward pass is persistent: ``rms_bwd_programs_per_sm`` programs per
multiprocessor (so one wave when that many fit), each owning a contiguous
range of rows that it walks ``rms_bwd_tile`` elements at a time, accumulating
its part of dw in FP32 registers and writing one partial row; the partials
(a few per multiprocessor, not one per token) are then summed on the device
in a deterministic reduction. dx goes to a fresh tensor: the incoming dy may
be referenced elsewhere, so it is never overwritten.

Host overhead matters as much as the kernels at Llama sizes (a forward +
backward moves ~0.34 GB, ~80 us on an H200, while a Python autograd step
costs several hundred microseconds of host time): the launchers make no
copies, reshapes or views of contiguous tensors, allocate outputs in their
final shape, and finish dw with one sum (plus a cast for BF16 weights).

Test: ``pytest tests/plugins/test_triton_kernels.py -k rms_norm``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from slidekit_kernels.triton_common._launch import cdiv, check_device, multiprocessors, on_device
from slidekit_kernels.triton_common.vendors import LaunchConfig, next_pow2

__all__ = [
    "MAX_HIDDEN",
    "BackwardPlan",
    "ForwardPlan",
    "RMSNormFunction",
    "backward_plan",
    "forward_plan",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
]

#: Widest row one program holds; wider rows would spill registers (use torch_ref for those).
MAX_HIDDEN = 1 << 16


@triton.jit
def _rms_norm_fwd_kernel(
    X,  # (R, H) rows, stride_x apart
    W,  # (H,)
    Y,  # (R, H) contiguous
    RSTD,  # (R,) FP32
    stride_x,
    n_rows,
    n_cols,
    eps,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y = w * cast(x * rsqrt(mean(x^2) + eps)) for ROWS rows of one tile; stores rsqrt per row."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    n = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = n * w[None, :]
    tl.store(Y + rows[:, None] * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,  # (R, H) rows, stride_dy apart
    X,  # (R, H) rows, stride_x apart
    W,  # (H,)
    RSTD,  # (R,) FP32 from the forward pass
    DX,  # (R, H) contiguous
    DW_PARTIAL,  # (programs, H) FP32: this program's sum of dy * cast(n)
    stride_dy,
    stride_x,
    n_rows,
    n_cols,
    tiles_per_program,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dx = r * (dn - n * mean(dn * n)) with dn = dy * w; a partial dw over this program's rows."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    tile = pid.to(tl.int64) * tiles_per_program
    last = tile + tiles_per_program
    while tile < last:  # while, not range(): see the note on loops in triton_common/__init__.py
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        n = x * rstd[:, None]
        dw += tl.sum(dy * n.to(X.dtype.element_ty).to(tl.float32), axis=0)
        dn = dy * w[None, :]
        mean_dn_n = tl.sum(dn * n, axis=1) / n_cols
        dx = rstd[:, None] * (dn - n * mean_dn_n[:, None])
        tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tile += 1
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)


def _rows(t: Tensor, h: int) -> tuple[Tensor, int]:
    """``t`` as rows of ``h`` with unit column stride, and the row stride; no copy where the layout allows.

    A contiguous ``t`` is returned as it is (its rows are ``h`` apart), whatever its shape.
    """
    if t.is_contiguous():
        return t, h
    t2 = t.reshape(-1, h)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2, t2.stride(0)


def _check(x: Tensor, weight: Tensor) -> int:
    h = x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(
            f"rms_norm: weight must have shape ({h},) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}"
        )
    if h > MAX_HIDDEN:
        raise ValueError(
            f"rms_norm: hidden size {h} exceeds {MAX_HIDDEN} per row; use the torch_ref kernel set"
        )
    return h


class ForwardPlan(NamedTuple):
    """How the forward kernel is launched for R rows of H."""

    block_n: int  # H padded to a power of two
    rows: int  # rows per program
    warps: int
    programs: int


class BackwardPlan(NamedTuple):
    """How the backward kernel is launched for R rows of H (persistent programs, one dW partial each)."""

    block_n: int  # H padded to a power of two
    rows: int  # rows per loop step
    warps: int
    programs: int  # = dW partials
    steps: int  # loop steps per program


def forward_plan(n_rows: int, h: int, cfg: LaunchConfig) -> ForwardPlan:
    """Launch sizes of the forward kernel (``cfg.rms_fwd_*``)."""
    block_n = next_pow2(h)
    rows = cfg.rows_per_tile(cfg.rms_fwd_tile, block_n)
    warps = cfg.num_warps(rows * block_n, cfg.rms_fwd_elems_per_thread)
    return ForwardPlan(block_n, rows, warps, cdiv(n_rows, rows))


def backward_plan(n_rows: int, h: int, cfg: LaunchConfig, sms: int) -> BackwardPlan:
    """Launch sizes of the backward kernel (``cfg.rms_bwd_*``) on a device with ``sms`` multiprocessors."""
    block_n = next_pow2(h)
    rows = cfg.rows_per_tile(cfg.rms_bwd_tile, block_n)
    warps = cfg.num_warps(rows * block_n, cfg.rms_bwd_elems_per_thread)
    tiles = cdiv(n_rows, rows)
    steps = cdiv(tiles, max(1, min(tiles, sms * cfg.rms_bwd_programs_per_sm)))
    return BackwardPlan(block_n, rows, warps, cdiv(tiles, steps), steps)  # no program left without rows


def rms_norm_forward(
    x: Tensor, weight: Tensor, eps: float, cfg: LaunchConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """y (shape of x), x as the rows the kernel read, and rsqrt per row (FP32), for the backward pass.

    The rows are ``x`` itself when it is contiguous, else a (R, H) view or copy.
    """
    h = _check(x, weight)
    check_device(_rms_norm_fwd_kernel, x, weight)
    x2, stride_x = _rows(x, h)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    # Contiguous y in x's shape: empty_like keeps x's (contiguous) layout and is the cheapest allocation.
    y = torch.empty_like(x) if x2 is x and out_dtype == x.dtype else x.new_empty(x.shape, dtype=out_dtype)
    n_rows = x.numel() // h if h else 0
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    if n_rows:
        plan = forward_plan(n_rows, h, cfg)
        with on_device(x):
            _rms_norm_fwd_kernel[(plan.programs,)](
                x2, weight.contiguous(), y, rstd, stride_x, n_rows, h, eps,
                ROWS=plan.rows, BLOCK_N=plan.block_n, num_warps=plan.warps,
            )  # fmt: skip
    return y, x2, rstd


def rms_norm_backward(
    dy: Tensor, x2: Tensor, weight: Tensor, rstd: Tensor, cfg: LaunchConfig, *, want_dw: bool = True
) -> tuple[Tensor, Tensor | None]:
    """dx (shape of ``x2``) in x's dtype, and dweight in weight's dtype (None unless ``want_dw``)."""
    h = x2.shape[-1]
    n_rows = rstd.shape[0]
    dy2, stride_dy = _rows(dy, h)
    x_dense = x2.is_contiguous()
    dx = torch.empty_like(x2) if x_dense else x2.new_empty(x2.shape)
    if not n_rows:
        return dx, torch.zeros_like(weight) if want_dw else None
    plan = backward_plan(n_rows, h, cfg, multiprocessors(x2.device))
    partial = x2.new_empty((plan.programs, h), dtype=torch.float32)
    with on_device(x2):
        _rms_norm_bwd_kernel[(plan.programs,)](
            dy2, x2, weight.contiguous(), rstd, dx, partial, stride_dy, h if x_dense else x2.stride(0),
            n_rows, h, plan.steps, ROWS=plan.rows, BLOCK_N=plan.block_n, num_warps=plan.warps,
        )  # fmt: skip
    if not want_dw:
        return dx, None
    dw = partial.sum(0)
    return dx, dw if dw.dtype == weight.dtype else dw.to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x (as the rows the kernel read), the weight and rsqrt per row."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, cfg: LaunchConfig) -> Tensor:
        y, x2, rstd = rms_norm_forward(x, weight, eps, cfg)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.cfg, ctx.x_shape = cfg, None if x2 is x else x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x2, weight, rstd, ctx.cfg, want_dw=ctx.needs_input_grad[1])
        return dx if ctx.x_shape is None else dx.view(ctx.x_shape), dw, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, cfg: LaunchConfig) -> Tensor:
    """RMSNorm over the last dimension of ``x`` (..., H) with ``weight`` (H,); differentiable."""
    return RMSNormFunction.apply(x, weight, eps, cfg)
