"""Fused linear + cross-entropy: the LM head's loss and both gradients, never the full logits.

For hidden states h (N, H), the head's weight W (V, H) and labels y (N,)::

    loss    = sum_i [ logsumexp(h_i W^T) - (h_i W^T)[y_i] ]      over labelled i
    dL/dh_i = (softmax(h_i W^T) - onehot(y_i)) W
    dL/dW   = sum_i (softmax(h_i W^T) - onehot(y_i))^T h_i

The tokens are walked in chunks of C. Per chunk: the logits (C, V) come from
one matmul (cuBLAS / hipBLASLt) into a buffer reused by every chunk; then
``_cross_entropy_fwd_kernel`` makes two passes over each row in FP32 (an
online max / sum-exp, then the gradient), writes the row's loss term, and
overwrites the logits in place with their gradient, softmax - one-hot,
zeroed for rows labelled ``ignore_index``; then dh = g @ W and dW += g^T h.
So the forward pass produces the loss and both gradients, and the backward
pass only scales them by the incoming gradient, on the device (no host sync).

Memory beyond the inputs and gradients: one (C, V) logits buffer in the
input dtype and N FP32 loss terms. ``auto_chunk`` sizes C to 128 MiB of
logits, rounded down to a multiple of 128 tokens for the matmuls' tiles.

A label outside [0, V) that is not ``ignore_index`` makes the loss NaN
(checking it on the host would cost a device synchronisation).

Test: ``pytest tests/plugins/test_triton_kernels.py -k linear_cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from slidekit_kernels.triton_common._launch import cdiv, check_device, on_device
from slidekit_kernels.triton_common.vendors import LaunchConfig, next_pow2

__all__ = [
    "LOGITS_BUDGET_BYTES",
    "LinearCrossEntropyFunction",
    "auto_chunk",
    "linear_cross_entropy",
    "linear_cross_entropy_forward",
]

#: Bytes of logits one chunk may hold.
LOGITS_BUDGET_BYTES = 128 << 20
#: Chunks of at least this many tokens are rounded down to a multiple of it (matmul tile size).
_CHUNK_ALIGN = 128
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _cross_entropy_fwd_kernel(
    LOGITS,  # (C, V) rows, stride_row apart: read, then overwritten with the gradient
    LABELS,  # (C,) integer labels
    LOSS,  # (C,) FP32: lse - logit[label], 0 for ignored rows
    stride_row,
    n_rows,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Per row: loss = logsumexp(x) - x[y]; x <- softmax(x) - onehot(y), or 0 if y is ignored.

    ROWS rows at a time (1 for large vocabularies), BLOCK_V columns per loop iteration.
    Ignored rows are never read; their statistics come out finite and are discarded.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    labels = tl.load(LABELS + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    active = row_ok & (labels != ignore_index)
    ptr = LOGITS + rows[:, None] * stride_row  # (ROWS, 1)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([ROWS], float("-inf"), tl.float32)  # running max
    s = tl.zeros([ROWS], tl.float32)  # running sum of exp(x - m)
    start = 0
    while start < n_cols:  # while, not range(): see the note on loops in triton_common/__init__.py
        col_ok = start + cols < n_cols
        x = tl.load(ptr + start + cols[None, :], mask=active[:, None] & col_ok[None, :], other=0.0)
        x = tl.where(col_ok[None, :], x.to(tl.float32), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
        start += BLOCK_V
    lse = m + tl.log(s)
    in_range = (labels >= 0) & (labels < n_cols)
    target = tl.load(LOGITS + rows * stride_row + labels, mask=active & in_range, other=float("nan"))
    tl.store(LOSS + rows, tl.where(active, lse - target.to(tl.float32), 0.0), mask=row_ok)
    if WRITE_GRAD:
        start = 0
        while start < n_cols:
            col_ok = start + cols < n_cols
            x = tl.load(ptr + start + cols[None, :], mask=active[:, None] & col_ok[None, :], other=0.0)
            g = tl.exp(x.to(tl.float32) - lse[:, None])
            g = tl.where((start + cols)[None, :] == labels[:, None], g - 1.0, g)
            g = tl.where(active[:, None], g, 0.0)
            tl.store(
                ptr + start + cols[None, :],
                g.to(LOGITS.dtype.element_ty),
                mask=row_ok[:, None] & col_ok[None, :],
            )
            start += BLOCK_V


def auto_chunk(num_tokens: int, vocab: int, itemsize: int, budget: int = LOGITS_BUDGET_BYTES) -> int:
    """Tokens per chunk so one chunk's logits fit ``budget`` bytes; a multiple of 128 when that large."""
    chunk = max(1, budget // max(1, vocab * itemsize))
    if chunk >= _CHUNK_ALIGN:
        chunk -= chunk % _CHUNK_ALIGN
    return min(num_tokens, chunk) if num_tokens else 1


def _check(hidden: Tensor, weight: Tensor, labels: Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden must be (N, H) and weight (V, H), got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if labels.shape != (hidden.shape[0],):
        raise ValueError(
            f"linear_cross_entropy: labels must be ({hidden.shape[0]},), got {tuple(labels.shape)}"
        )
    if hidden.dtype != weight.dtype or hidden.dtype not in _DTYPES:
        raise TypeError(
            f"linear_cross_entropy: hidden and weight must share one of {[str(d) for d in _DTYPES]}, got "
            f"{hidden.dtype} and {weight.dtype}; use the torch_ref kernel set for other dtypes"
        )


def linear_cross_entropy_forward(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int,
    chunk_size: int,
    cfg: LaunchConfig,
    want_dh: bool,
    want_dw: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The summed loss (FP32, 0-dim) and, as asked, dL/dhidden and dL/dweight (unscaled)."""
    _check(hidden, weight, labels)
    check_device(_cross_entropy_fwd_kernel, hidden, weight, labels)
    n, v = hidden.shape[0], weight.shape[0]
    labels = labels.contiguous()
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)  # (N,)
    dh = torch.empty_like(hidden) if want_dh else None
    dw = torch.zeros_like(weight) if want_dw and n == 0 else (torch.empty_like(weight) if want_dw else None)
    chunk = max(1, min(chunk_size, n))
    buffer = torch.empty((chunk, v), dtype=hidden.dtype, device=hidden.device)  # one chunk's logits
    block_v = min(cfg.ce_block, next_pow2(v))
    rows = cfg.ce_block // block_v  # rows per program: 1 for large vocabularies
    write_grad = want_dh or want_dw
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        h = hidden[a:b]
        logits = buffer[: b - a]  # (c, V)
        torch.mm(h, weight.T, out=logits)
        with on_device(logits):
            _cross_entropy_fwd_kernel[(cdiv(b - a, rows),)](
                logits, labels[a:b], losses[a:b], logits.stride(0), b - a, v, ignore_index,
                WRITE_GRAD=write_grad, ROWS=rows, BLOCK_V=block_v, num_warps=cfg.num_warps(rows * block_v),
            )  # fmt: skip
        if dh is not None:
            torch.mm(logits, weight, out=dh[a:b])
        if dw is not None:
            if a == 0:
                torch.mm(logits.T, h, out=dw)  # the first chunk writes dW: no zero fill, no read
            else:
                dw.addmm_(logits.T, h)
    return losses.sum(), dh, dw


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: the forward pass computes the gradients; backward scales them in place."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        ignore_index: int,
        chunk: int,
        cfg: LaunchConfig,
    ) -> Tensor:
        loss, dh, dw = linear_cross_entropy_forward(
            hidden, weight, labels, ignore_index=ignore_index, chunk_size=chunk, cfg=cfg,
            want_dh=ctx.needs_input_grad[0], want_dw=ctx.needs_input_grad[1],
        )  # fmt: skip
        ctx.dh, ctx.dw = dh, dw
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        dh, dw = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None
        # The scale stays a device tensor: no host sync. In BF16 it is rounded to BF16 first,
        # a uniform factor on all gradients of the step (as in torch_ref).
        if dh is not None:
            dh.mul_(grad_out.to(dh.dtype))
        if dw is not None:
            dw.mul_(grad_out.to(dw.dtype))
        return dh, dw, None, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    cfg: LaunchConfig,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "sum",
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` (sum or mean over labelled tokens).

    hidden: (N, H); weight: (V, H); labels: (N,). ``chunk_size`` None sizes chunks by ``auto_chunk``.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens or None, got {chunk_size}")
    chunk = chunk_size or auto_chunk(hidden.shape[0], weight.shape[0], hidden.element_size())
    loss = LinearCrossEntropyFunction.apply(hidden, weight, labels, ignore_index, chunk, cfg)
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum().clamp(min=1)
    return loss
