"""SwiGLU, ``silu(gate) * up``, in Triton: forward and backward as flat element-wise kernels.

Math in FP32; like ``F.silu(gate) * up`` in torch, silu is rounded to the
input dtype before the product::

    s  = sigmoid(g)
    out = cast(g * s) * u
    du = dout * cast(g * s)
    dg = dout * u * s * (1 + g * (1 - s))

Nothing is modified in place; the backward pass recomputes the sigmoid
instead of saving it.

Test: ``pytest tests/plugins/test_triton_kernels.py -k swiglu``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from slidekit_kernels.triton_common._launch import cdiv, check_device, on_device
from slidekit_kernels.triton_common.vendors import LaunchConfig

__all__ = ["SwiGLUFunction", "swiglu", "swiglu_backward", "swiglu_forward"]


@triton.jit
def _swiglu_fwd_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
    """out = cast(g * sigmoid(g)) * u over BLOCK elements."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(G.dtype.element_ty).to(tl.float32)
    tl.store(OUT + offs, (silu * u).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DO, G, U, DG, DU, n, BLOCK: tl.constexpr):
    """du = dout * cast(silu(g)); dg = dout * u * s * (1 + g * (1 - s)) with s = sigmoid(g)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = (g * s).to(G.dtype.element_ty).to(tl.float32)
    tl.store(DU + offs, (do * silu).to(DU.dtype.element_ty), mask=mask)
    tl.store(DG + offs, (do * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


def _launch(kernel: Any, cfg: LaunchConfig, n: int, *args: Any) -> None:
    if n:
        block = cfg.elementwise_block
        with on_device(args[0]):
            kernel[(cdiv(n, block),)](*args, n, BLOCK=block, num_warps=cfg.num_warps(block))


def swiglu_forward(gate: Tensor, up: Tensor, cfg: LaunchConfig) -> tuple[Tensor, Tensor, Tensor]:
    """silu(gate) * up (promoted dtype), and gate and up as the contiguous tensors the kernel read."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    check_device(_swiglu_fwd_kernel, gate, up)
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
    _launch(_swiglu_fwd_kernel, cfg, g.numel(), g, u, out)
    return out, g, u


def swiglu_backward(dout: Tensor, gate: Tensor, up: Tensor, cfg: LaunchConfig) -> tuple[Tensor, Tensor]:
    """(d gate, d up) in the dtypes of gate and up."""
    do = dout.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    _launch(_swiglu_bwd_kernel, cfg, gate.numel(), do, gate, up, dg, du)
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper: saves gate and up (contiguous); the backward pass recomputes the sigmoid."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, cfg: LaunchConfig) -> Tensor:
        out, g, u = swiglu_forward(gate, up, cfg)
        ctx.save_for_backward(g, u)
        ctx.cfg = cfg
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        dg, du = swiglu_backward(dout, gate, up, ctx.cfg)
        return dg, du, None


def swiglu(gate: Tensor, up: Tensor, cfg: LaunchConfig) -> Tensor:
    """silu(gate) * up, differentiable in both."""
    return SwiGLUFunction.apply(gate, up, cfg)
