"""layer_adam's update on a GPU: one fused Triton pass per unit, the C++ kernel's arithmetic exactly.

Units the engine keeps resident on the GPU are updated there, on the compute
stream, between backward passes: their update time adds to the step. The
torch path (``layer_adam._torch_update``) makes about ten passes over memory
per element (an FP64 square root among them) and launches a dozen kernels per
16 M elements; this kernel reads each element's gradient, master and moments
once and writes the master, the moments and the BF16 copy once: 28 bytes per
parameter, memory-bound.

Per element it runs the operation sequence of ``csrc/fused_adam.cpp`` (the
contract is written there), each an IEEE-754 FP32 operation rounded to
nearest even: ``tl.div_rn`` and ``tl.sqrt_rn`` are the correctly rounded
divide and square root (Triton's ``/`` and ``tl.sqrt`` are approximations on
NVIDIA GPUs), and the kernel is compiled with ``enable_fp_fusion=False`` so no
multiply and add are contracted into an FMA. The scalars arrive as Python
floats and are rounded to FP32 at launch, as the C++ kernel rounds them. So a
unit updated on the GPU gets bitwise the values the CPU would have computed
(NaN payloads of the BF16 copy aside), which is what lets the planner move
units between the GPU and the host without changing results.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel
runs on CPU tensors in NumPy, which is how the CPU tests exercise it; the
interpreter truncates FP32 -> BF16 casts, so there only the FP32 outputs are
bitwise.

Test: ``pytest tests/plugins/test_adam_triton.py`` (interpreted here, compiled on a GPU).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["BLOCK", "fused_adamw_"]

#: Elements per program: 8 per thread at 4 warps, 128-bit loads of FP32.
BLOCK = 1024


@triton.jit
def _adamw_kernel(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    n,
    decay,
    w1,
    beta2,
    sq_weight,
    inv_b2,
    eps,
    neg_step,
    HAS_DECAY: tl.constexpr,
    HAS_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_DECAY:
        p = p * decay
    m = m + w1 * (g - m)
    v = v * beta2
    v = v + (sq_weight * g) * g
    den = tl.sqrt_rn(v) * inv_b2 + eps
    p = p + tl.div_rn(neg_step * m, den)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, p.to(tl.bfloat16), mask=mask)


def fused_adamw_(
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lowp_out: torch.Tensor | None,
    decay: float | None,
    w1: float,
    beta2: float,
    sq_weight: float,
    inv_b2: float,
    eps: float,
    neg_step: float,
) -> None:
    """One AdamW step over flat contiguous vectors, in place, on the current stream of their device.

    The caller (``LayerAdam.step``) has checked dtypes, sizes, devices and
    overlap; ``decay`` is ``1 - lr * weight_decay`` or None where the range
    does not decay.
    """
    n = master.numel()
    if n == 0:
        return
    grid = (-(-n // BLOCK),)
    with torch.cuda.device(master.device) if master.is_cuda else contextlib.nullcontext():
        _adamw_kernel[grid](
            master,
            grad,
            m,
            v,
            master if lowp_out is None else lowp_out,  # unused when HAS_OUT is False
            n,
            1.0 if decay is None else decay,
            w1,
            beta2,
            sq_weight,
            inv_b2,
            eps,
            neg_step,
            HAS_DECAY=decay is not None,
            HAS_OUT=lowp_out is not None,
            BLOCK=BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
        )
