"""adamw_8bit's update on a GPU: one fused Triton pass per unit, the C++ kernel's arithmetic exactly.

Units the engine keeps resident on the GPU are updated there, on the current
(compute) stream, at the end of the step. This kernel is ``csrc/adamw8.cpp``
(its header comment is the contract) for device tensors: one program per
``ROWS`` quantization blocks of 256 elements, each block decoded, updated and
re-encoded in registers. Per element it reads the gradient (2 bytes in BF16),
the master (4) and both codes (2), and writes the master, the codes and the
BF16 copy (8); per block the two scales. About 16 bytes per parameter,
memory-bound; the maps' tables (1.3 MB for both) stay in L2.

Bit for bit the CPU kernel's results (NaN inputs aside), because every step is
the same IEEE-754 FP32 operation rounded to nearest even, in the same order:

* decode ``values[code] * A``; the decoupled decay ``p * decay`` where the
  range decays. A block may straddle several ranges, so each element picks
  its decay from the unit's table of ranges, a loop unrolled at compile time
  (the count is padded to a power of two, so few variants compile; a decoder
  layer has 4 to 12 ranges: weights decay, norms and biases do not);
* ``m + w1 * (g - m)``, ``v * beta2``, ``v + (w2 * g) * g``,
  ``sqrt(v) * inv_b2 + eps``, ``p + (neg_step * m) / den``, with
  ``tl.sqrt_rn`` and ``tl.div_rn`` (correctly rounded; Triton's ``tl.sqrt``
  and ``/`` are approximations on NVIDIA GPUs), compiled with
  ``enable_fp_fusion=False`` so no multiply and add become an FMA;
* the block's new scale is the maximum of the ``|x|`` bit patterns (exact; a
  NaN pattern sorts above every number, as in the C++ kernel), ``y = x / A``
  (``A`` or 1 for an all-zero block) with ``tl.div_rn``, and the code is
  ``table[key] + (y > threshold[key])`` with ``key = bits(y) >> 15``: quant8's
  lookup, with the maps' own tables, so ``keep_nonzero`` and ties to the
  smaller code are the CPU's by construction;
* the BF16 copy is rounded in integers exactly as the C++ kernel's ``to_bf16``
  (round to nearest even, NaN to 0x7FC0), not by a float cast: so it is
  bitwise under ``TRITON_INTERPRET=1`` too, where float -> BF16 casts truncate.

The step's scalars arrive as Python floats and are rounded to FP32 at launch,
the decays on the host by torch; both round to nearest, as the C++ kernel's
``static_cast<float>`` does.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel
runs on CPU tensors in NumPy, which is how the CPU tests exercise it.

Test: ``pytest tests/plugins/test_adamw8_triton.py`` (interpreted here, compiled on a GPU).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from slidekit_optim.quant8 import BLOCK_SIZE as QBLOCK  # elements per quantization block

__all__ = ["ROWS", "adamw8_step_"]

#: Blocks per program: 1024 elements, 8 per thread at 4 warps.
ROWS = 4


@triton.jit
def _encode(x, mask, table_ptr, threshold_ptr):
    """Codes (int32, x's shape) and scales (FP32, one per row) of the (ROWS, QBLOCK) tile ``x``."""
    bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)  # |x|; padding lanes count 0
    amax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)  # sign bit clear: int order = magnitude order
    scale = tl.where(amax > 0, amax, 1.0)  # an all-zero block keeps scale 0 and encodes x / 1
    y = tl.div_rn(x, scale[:, None])
    key = (y.to(tl.int32, bitcast=True) >> 15) & 0x1FFFF  # top 17 bits (the shift is arithmetic)
    code = tl.load(table_ptr + key, mask=mask, other=0).to(tl.int32)
    above = y > tl.load(threshold_ptr + key, mask=mask, other=0.0)
    return code + above.to(tl.int32), amax


@triton.jit
def _adamw8_kernel(
    p_ptr,
    g_ptr,
    m_codes_ptr,
    m_absmax_ptr,
    v_codes_ptr,
    v_absmax_ptr,
    out_ptr,  # int16 view of the BF16 copy
    m_values_ptr,
    m_table_ptr,
    m_threshold_ptr,
    v_values_ptr,
    v_table_ptr,
    v_threshold_ptr,
    seg_ptr,  # int64 (2 * SEGMENTS,): the ranges' starts, then their decays' FP32 bit patterns
    n,
    blocks,
    w1,
    beta2,
    sq_weight,
    inv_b2,
    eps,
    neg_step,
    SEGMENTS: tl.constexpr,  # decay ranges, padded to a power of two with ranges starting at n; 0: none
    HAS_OUT: tl.constexpr,
    ROWS: tl.constexpr,
    QBLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,) block indices
    row_ok = rows < blocks
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # (ROWS, QBLOCK) element indices
    mask = offs < n

    m_codes = tl.load(m_codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    v_codes = tl.load(v_codes_ptr + offs, mask=mask, other=0).to(tl.int32)
    m_scale = tl.load(m_absmax_ptr + rows, mask=row_ok, other=0.0)
    v_scale = tl.load(v_absmax_ptr + rows, mask=row_ok, other=0.0)
    m = tl.load(m_values_ptr + m_codes) * m_scale[:, None]  # decode: one multiply
    v = tl.load(v_values_ptr + v_codes) * v_scale[:, None]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a BF16 upcast is exact
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)

    if SEGMENTS > 0:  # each element takes the decay of the last range starting at or before it
        decay = tl.full((ROWS, QBLOCK), 1.0, tl.float32)
        for k in tl.static_range(SEGMENTS):
            start = tl.load(seg_ptr + k)
            factor = tl.load(seg_ptr + SEGMENTS + k).to(tl.int32).to(tl.float32, bitcast=True)
            decay = tl.where(offs >= start, factor, decay)
        p = tl.where(decay != 1.0, p * decay, p)  # as the C++ kernel: no multiply where nothing decays
    m = m + w1 * (g - m)
    v = v * beta2
    v = v + (sq_weight * g) * g
    den = tl.sqrt_rn(v) * inv_b2 + eps
    p = p + tl.div_rn(neg_step * m, den)
    tl.store(p_ptr + offs, p, mask=mask)
    if HAS_OUT:  # round to nearest even in integers, NaN to 0x7FC0: the C++ kernel's to_bf16
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        tl.store(out_ptr + offs, rounded.to(tl.int16), mask=mask)

    m_new, m_amax = _encode(m, mask, m_table_ptr, m_threshold_ptr)
    v_new, v_amax = _encode(v, mask, v_table_ptr, v_threshold_ptr)
    tl.store(m_codes_ptr + offs, m_new.to(tl.uint8), mask=mask)
    tl.store(v_codes_ptr + offs, v_new.to(tl.uint8), mask=mask)
    tl.store(m_absmax_ptr + rows, m_amax, mask=row_ok)
    tl.store(v_absmax_ptr + rows, v_amax, mask=row_ok)


def _segment_table(seg_stop: Sequence[int], seg_decay: Sequence[float], device: torch.device) -> torch.Tensor:
    """The decay ranges as the kernel reads them, on ``device``: ``2 * SEGMENTS`` int64, the ranges' starts
    (padded with ``n``, where no element lies), then their decays rounded to FP32, as bit patterns.

    On a GPU it goes up from pinned memory without waiting: torch's pinned-memory cache keeps the host
    buffer until the copy, queued on the current stream before the kernel, is done.
    """
    n, count = seg_stop[-1], len(seg_stop)
    padded = triton.next_power_of_2(count)  # few distinct counts, so few compiled variants
    starts = torch.full((padded,), n, dtype=torch.int64)
    starts[1:count] = torch.tensor(list(seg_stop[:-1]), dtype=torch.int64)
    starts[0] = 0
    decays = torch.ones(padded, dtype=torch.float32)
    decays[:count] = torch.tensor(list(seg_decay), dtype=torch.float64).to(torch.float32)  # to nearest
    table = torch.cat([starts, decays.view(torch.int32).to(torch.int64)])
    if device.type == "cpu":
        return table
    return table.pin_memory().to(device, non_blocking=True)


def adamw8_step_(
    master: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_absmax: torch.Tensor,
    v_codes: torch.Tensor,
    v_absmax: torch.Tensor,
    lowp_out: torch.Tensor | None,
    m_values: torch.Tensor,
    m_table: torch.Tensor,
    m_threshold: torch.Tensor,
    v_values: torch.Tensor,
    v_table: torch.Tensor,
    v_threshold: torch.Tensor,
    seg_stop: Sequence[int],
    seg_decay: Sequence[float],
    w1: float,
    beta2: float,
    sq_weight: float,
    inv_b2: float,
    eps: float,
    neg_step: float,
) -> None:
    """One 8-bit AdamW step over a whole unit, in place, on the current stream of the tensors' device.

    The arguments are those of the C++ kernel's ``adamw8_step_`` (without its thread cap) except the
    maps: here each map's ``values``, ``table`` and ``threshold`` (the C++ kernel takes ``values`` and
    the packed table). The caller (``AdamW8bit.step``) has checked them the same way: flat contiguous tensors on one device,
    ``lowp_out`` contiguous BF16 or None, the maps' tensors on that device too, and ``seg_stop`` /
    ``seg_decay`` tiling ``[0, n)`` in order (a decay of 1 means none).
    """
    n = master.numel()
    if n == 0:
        return
    if len(seg_stop) != len(seg_decay) or not seg_stop or seg_stop[-1] != n:
        raise ValueError(f"the decay segments must tile [0, {n}) in order, got stops {list(seg_stop)}")
    blocks = -(-n // QBLOCK)
    table = _segment_table(seg_stop, seg_decay, master.device) if any(d != 1.0 for d in seg_decay) else None
    grid = (-(-blocks // ROWS),)
    with torch.cuda.device(master.device) if master.is_cuda else contextlib.nullcontext():
        _adamw8_kernel[grid](
            master,
            grad,
            m_codes,
            m_absmax,
            v_codes,
            v_absmax,
            master if lowp_out is None else lowp_out.view(torch.int16),  # unused when HAS_OUT is False
            m_values,
            m_table,
            m_threshold,
            v_values,
            v_table,
            v_threshold,
            master if table is None else table,  # unused when SEGMENTS is 0
            n,
            blocks,
            w1,
            beta2,
            sq_weight,
            inv_b2,
            eps,
            neg_step,
            SEGMENTS=0 if table is None else table.numel() // 2,
            HAS_OUT=lowp_out is not None,
            ROWS=ROWS,
            QBLOCK=QBLOCK,
            num_warps=4,
            enable_fp_fusion=False,
        )
