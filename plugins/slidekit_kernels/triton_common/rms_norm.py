"""RMSNorm in Triton, exactly as Hugging Face's Llama/Qwen compute it, with dx and dweight.

Forward, per row x of length H (statistics in FP32, then cast, then the weight)::

    r = 1 / sqrt(mean(x^2) + eps)          FP32, saved per row for backward
    n = cast_to_x_dtype(x * r)
    y = w * n                              in the promoted dtype of x and w

Backward, with dn = dy * w and n in FP32::

    dx = r * (dn - n * mean(dn * n))
    dw = sum over rows of dy * cast_to_x_dtype(n)

Each backward program owns a contiguous range of rows, accumulates its part
of dw in FP32 registers and writes one partial row; the partials (a few per
multiprocessor) are then summed in a deterministic reduction.

Test: ``pytest tests/plugins/test_triton_kernels.py -k rms_norm``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from slidekit_kernels.triton_common._launch import check_device, multiprocessors, on_device
from slidekit_kernels.triton_common.vendors import LaunchConfig, next_pow2

__all__ = ["MAX_HIDDEN", "RMSNormFunction", "rms_norm", "rms_norm_backward", "rms_norm_forward"]

#: Widest row one program holds; wider rows would spill registers (use torch_ref for those).
MAX_HIDDEN = 1 << 16


@triton.jit
def _rms_norm_fwd_kernel(
    X,  # (R, H) rows, stride_x apart
    W,  # (H,)
    Y,  # (R, H) rows, stride_y apart
    RSTD,  # (R,) FP32
    stride_x,
    stride_y,
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
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,  # (R, H) rows, stride_dy apart
    X,  # (R, H) rows, stride_x apart
    W,  # (H,)
    RSTD,  # (R,) FP32 from the forward pass
    DX,  # (R, H) rows, stride_dx apart
    DW_PARTIAL,  # (programs, H) FP32: this program's sum of dy * cast(n)
    stride_dy,
    stride_x,
    stride_dx,
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
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tile += 1
    tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)


def _rows(t: Tensor, h: int) -> Tensor:
    """``t`` as (rows, h) with unit column stride, without a copy where the layout allows."""
    t2 = t.reshape(-1, h)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


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


def rms_norm_forward(
    x: Tensor, weight: Tensor, eps: float, cfg: LaunchConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """y (shape of x), x as (R, H) rows, and rsqrt per row (FP32), for the backward pass."""
    h = _check(x, weight)
    check_device(_rms_norm_fwd_kernel, x, weight)
    x2 = _rows(x, h)
    w = weight.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, h), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block_n = next_pow2(h)
        tile_rows = cfg.rows_per_tile(block_n)
        with on_device(x2):
            _rms_norm_fwd_kernel[(triton.cdiv(rows, tile_rows),)](
                x2, w, y, rstd, x2.stride(0), y.stride(0), rows, h, eps,
                ROWS=tile_rows, BLOCK_N=block_n, num_warps=cfg.num_warps(tile_rows * block_n),
            )  # fmt: skip
    return y.view(x.shape), x2, rstd


def rms_norm_backward(
    dy: Tensor, x2: Tensor, weight: Tensor, rstd: Tensor, cfg: LaunchConfig
) -> tuple[Tensor, Tensor]:
    """dx as (R, H) in x's dtype, and dweight in weight's dtype."""
    rows, h = x2.shape
    dy2 = _rows(dy, h)
    dx = torch.empty((rows, h), dtype=x2.dtype, device=x2.device)
    if not rows:
        return dx, torch.zeros_like(weight)
    block_n = next_pow2(h)
    tile_rows = cfg.rows_per_tile(block_n)
    tiles = triton.cdiv(rows, tile_rows)
    programs = min(tiles, multiprocessors(x2.device) * cfg.rms_bwd_programs_per_sm)
    per_program = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, per_program)  # no program left without rows
    partial = torch.empty((programs, h), dtype=torch.float32, device=x2.device)
    with on_device(x2):
        _rms_norm_bwd_kernel[(programs,)](
            dy2, x2, weight.contiguous(), rstd, dx, partial,
            dy2.stride(0), x2.stride(0), dx.stride(0), rows, h, per_program,
            ROWS=tile_rows, BLOCK_N=block_n, num_warps=cfg.num_warps(tile_rows * block_n),
        )  # fmt: skip
    return dx, partial.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x (as rows), the weight and rsqrt per row."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, cfg: LaunchConfig) -> Tensor:  # type: ignore[override]
        y, x2, rstd = rms_norm_forward(x, weight, eps, cfg)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.cfg, ctx.x_shape = cfg, x.shape
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x2, weight, rstd, ctx.cfg)
        return dx.view(ctx.x_shape), dw if ctx.needs_input_grad[1] else None, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, cfg: LaunchConfig) -> Tensor:
    """RMSNorm over the last dimension of ``x`` (..., H) with ``weight`` (H,); differentiable."""
    return RMSNormFunction.apply(x, weight, eps, cfg)
