"""Block-wise 8-bit dynamic quantization (Dettmers et al. 2022), the storage format of ``adamw_8bit``.

A tensor is cut into blocks of ``block_size`` consecutive elements (the last
one may be shorter). Each block keeps one FP32 scale, its absolute maximum
``A = max |x|``, and one byte per element: the index ``q`` of the map value
nearest to ``x / A``. Decoding is ``x' = map[q] * A``. A block whose scale is
0 decodes to zeros whatever its codes, so an all-zero byte buffer means "all
zeros" (the engine zero-fills optimizer state before the first step).

The maps: dynamic tree quantization (Dettmers 2016; "dynamic quantization" in
"8-bit Optimizers via Block-wise Quantization", ICLR 2022). A code reads as
``[sign] [e zeros] [1] [fraction bits]``: the run of zeros is a base-10
exponent, the indicator bit ends it, and the remaining ``F`` bits split
``[0.1, 1]`` into ``2^F`` equal bins whose centres are the code's values::

    value(e, j) = 10^-e * (0.1 + 0.9 * (j + 0.5) / 2^F),   j = 0 .. 2^F - 1

so large magnitudes get many fraction bits and tiny ones few, covering seven
decades with a relative step of 0.7 % to 14 %.

* unsigned (second moment, ``x >= 0``): no sign bit, ``F = 7 - e`` for
  ``e = 0..6`` gives 128 + 64 + ... + 2 = 254 values, plus 0 and 1: 256.
* signed (first moment): ``F = 6 - e``; per sign, ``e = 0..5`` gives 126
  values. With 0, +1 and -1 (so the element that sets a block's scale
  round-trips exactly, whatever its sign) that is 255; the 256th code is the
  single ``e = 6`` value, +0.55e-6, kept on the positive side only. The map
  is therefore symmetric except for that one sub-ppm code.

Encoding is round-to-nearest on the sorted map (ties go to the smaller code):
code ``i`` holds ``y`` with ``b[i-1] < y <= b[i]``, ``b`` the midpoints of
neighbouring values. ``torch.bucketize`` does that with a binary search, but
costs 20-50 ns per element on a CPU core, more than the whole optimizer
update. So ``encode`` looks the answer up instead: the top 17 bits of ``y``'s
FP32 pattern (sign, exponent, 8 mantissa bits) select one of 2^17 buckets,
each a range of floats so narrow (relative width 2^-8) that it holds at most
one boundary; the table stores the code of the bucket's lowest float and that
boundary, and one comparison finishes the job::

    key  = bits(y) >> 15                  (17 bits)
    code = table[key] + (y > threshold[key])

This equals ``bucketize(y, b)`` for every float32 ``y``; ``QuantMap`` checks
the one-boundary property when it builds the tables, and the tests compare
both encoders.

``adamw_8bit``'s fused C++ kernel (``csrc/adamw8.cpp``) reads the same tables
in a compact form, ``QuantMap.packed``: one int32 per bucket holding both
answers, ``code | cut << 8``, where ``cut`` places the boundary inside the
bucket by the low 15 bits of its pattern (bit-inverted for negative keys, so
that a larger number is a larger float; ``0x7FFF`` when the bucket holds no
boundary)::

    low  = bits(y) & 0x7FFF               (inverted where y's sign is set)
    code = (entry & 0xFF) + (low > entry >> 8)

And only the buckets that differ from their neighbours are kept: per sign,
the bucket of 0 (and the subnormals), one entry for every key below a window
of keys, the window's, one entry for every key above it. For the dynamic
maps the window spans the 22 binary exponents that hold codes, 2^-22 to 1:
10.5 K entries (42 KB) for the signed map, 5.4 K for the unsigned one,
instead of 640 KB each, so the kernel's lookups stay in the L1 and L2
caches, and one gather serves both answers. ``_packed_table`` builds it from
``table`` and ``threshold`` and checks that it reproduces them for every key;
its layout is documented there. The kernel gets it with every call.

``keep_nonzero`` (used for the second moment): a nonzero value never takes
the zero code; a value nearer to 0 than to the smallest code of its sign
takes that smallest code. The optimizer needs this. An element whose second
moment is below half the smallest unsigned code (1.6e-7 of its block's
largest) would otherwise be stored as 0, and every later step would divide
its first moment by ``sqrt((1 - beta2) g^2)`` instead of ``sqrt(v)``: an
update about ``1 / sqrt(1 - beta2)``, 32 times, larger than Adam's. Rounding
up to the smallest code instead errs on the side of a smaller update.

Test: ``pytest tests/plugins/test_adamw_8bit.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BLOCK_SIZE",
    "PACKED_HEADER",
    "QuantMap",
    "dequantize_blockwise",
    "dynamic_map",
    "dynamic_values",
    "encode",
    "encode_reference",
    "num_blocks",
    "quantize_blockwise",
]

#: Elements per block. The paper uses 2048; bitsandbytes' 8-bit optimizers use 256: smaller blocks keep
#: an outlier from flattening more of its neighbours to zero, for 8 / 256 = 0.03 bytes of scale per element.
BLOCK_SIZE = 256

_KEY_SHIFT = 15  # keep the top 32 - 15 = 17 bits of the FP32 pattern
_KEY_BITS = 32 - _KEY_SHIFT
_KEY_MASK = (1 << _KEY_BITS) - 1


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks (and FP32 scales) needed for ``numel`` elements."""
    return -(-numel // block_size)


# --------------------------------------------------------------------------- the maps


def _decade(e: int, fraction_bits: int) -> list[float]:
    """The ``2^F`` bin centres of ``[0.1, 1] * 10^-e``."""
    bins = 1 << fraction_bits
    return [10.0**-e * (0.1 + 0.9 * (j + 0.5) / bins) for j in range(bins)]


def dynamic_values(*, signed: bool) -> Tensor:
    """The 256 values of the dynamic map, sorted ascending, FP32 (built in float64, rounded once)."""
    if signed:
        magnitudes = [v for e in range(6) for v in _decade(e, 6 - e)]
        values = [0.0, 1.0, -1.0, *_decade(6, 0), *magnitudes, *(-v for v in magnitudes)]
    else:
        values = [0.0, 1.0, *(v for e in range(7) for v in _decade(e, 7 - e))]
    out = torch.tensor(sorted(values), dtype=torch.float64).to(torch.float32)
    assert out.numel() == 256 and bool((out[1:] > out[:-1]).all()), "dynamic map must be 256 sorted values"
    return out


@dataclass(frozen=True, eq=False, slots=True)
class QuantMap:
    """A sorted 256-value map and what encoding with it needs. Treat every tensor as read-only.

    Fields:
        values: (256,) FP32, ascending: code ``i`` decodes to ``values[i]`` (times the block scale).
        boundaries: (255,) FP32: ``encode`` gives ``y`` the code ``#{i: boundaries[i] < y}``.
        table: (2^17,) uint8: per key (top 17 bits of ``y``), the code of the key's lowest float.
        threshold: (2^17,) FP32: per key, the first boundary at or above its lowest float; ``y``
            above it takes the next code (it lies past the key's floats when none falls inside).
        packed: int32: ``table`` and ``threshold`` in the compact form the fused CPU kernel reads
            (``_packed_table``).
    """

    values: Tensor
    boundaries: Tensor
    table: Tensor
    threshold: Tensor
    packed: Tensor

    @classmethod
    def build(cls, values: Tensor, *, keep_nonzero: bool = False) -> QuantMap:
        """Tables for ``values`` (256 sorted FP32 numbers within [-1, 1]); see the module docstring."""
        if (
            values.shape != (256,)
            or values.dtype != torch.float32
            or not bool((values[1:] > values[:-1]).all())
        ):
            raise ValueError("a QuantMap needs 256 strictly increasing FP32 values")
        v64 = values.double()
        boundaries = ((v64[1:] + v64[:-1]) / 2).to(torch.float32)
        if keep_nonzero:
            boundaries = _keep_nonzero(values, boundaries)
        table, threshold = _lookup_tables(boundaries)
        packed = _packed_table(table, threshold)
        return cls(values=values, boundaries=boundaries, table=table, threshold=threshold, packed=packed)


def _keep_nonzero(values: Tensor, boundaries: Tensor) -> Tensor:
    """Move the boundaries around the zero code to (just below) zero, so only 0 itself encodes to it."""
    zero = torch.nonzero(values == 0)
    if zero.numel() != 1:
        raise ValueError("keep_nonzero needs a map that contains 0 exactly once")
    z = int(zero[0, 0])
    boundaries = boundaries.clone()
    if z < 255:  # (0, smallest positive]: positives above 0 take code z + 1
        boundaries[z] = 0.0
    if z > 0:  # at -2^-149, the negative float nearest 0: every negative float takes z - 1, -0.0 stays at z
        boundaries[z - 1] = -torch.finfo(torch.float32).smallest_normal * 2.0**-23
    return boundaries


def _bucket_ends() -> tuple[Tensor, Tensor]:
    """(lowest, highest) float of each 17-bit key's bucket; NaN where the bucket holds NaN patterns."""
    keys = torch.arange(1 << _KEY_BITS, dtype=torch.int64)
    first = keys << _KEY_SHIFT
    last = first + (1 << _KEY_SHIFT) - 1
    ends = torch.stack([first, last]).sub_((first >= 1 << 31).long() << 32)  # as signed int32 patterns
    floats = ends.to(torch.int32).view(torch.float32)  # (2, keys): the bucket's two extreme patterns
    # Negative floats grow more negative with the pattern. minimum/maximum propagate NaN.
    return torch.minimum(floats[0], floats[1]), torch.maximum(floats[0], floats[1])


def _lookup_tables(boundaries: Tensor) -> tuple[Tensor, Tensor]:
    """Per 17-bit key: the code of its lowest float and the boundary inside it (see ``encode``)."""
    keys = torch.arange(1 << _KEY_BITS, dtype=torch.int64)
    lo, hi = _bucket_ends()
    finite = torch.isfinite(lo) & torch.isfinite(hi)
    lo, hi = torch.where(finite, lo, 0.0), torch.where(finite, hi, 0.0)
    code_lo = torch.bucketize(lo, boundaries)
    code_hi = torch.bucketize(hi, boundaries)
    if bool((code_hi - code_lo > 1).any()):
        raise ValueError("map too fine for the 17-bit lookup: two boundaries share one bucket")
    padded = torch.cat([boundaries, torch.tensor([math.inf])])
    threshold = torch.where(finite, padded[code_lo], math.inf)
    # inf and NaN patterns: the top code for positive sign, the bottom code for negative.
    negative = keys >= 1 << (_KEY_BITS - 1)
    table = torch.where(finite, code_lo, torch.where(negative, 0, 255)).to(torch.uint8)
    return table, threshold.contiguous()


#: int32 words before the entries of ``QuantMap.packed``: per sign (positive, then negative) the
#: window's first key, the slot of the entry above it, and the slot of the sign's first entry; 2 spare.
PACKED_HEADER = 8
_NO_CUT = 0x7FFF  # a bucket without a boundary: no 15-bit ``low`` is greater
_KEYS_PER_SIGN = 1 << (_KEY_BITS - 1)


def _packed_table(table: Tensor, threshold: Tensor) -> Tensor:
    """``table`` and ``threshold`` as the fused CPU kernel reads them: see the module docstring.

    Each sign's 2^16 keys ``K`` (``K = (bits(y) >> 15) & 0xFFFF``) are kept as ``W + 3`` entries
    from slot ``base``: slot 0 for ``K = 0``, slot 1 for every ``K`` in ``[1, lo)``, slots 2 ..
    W + 1 for ``K`` in ``[lo, lo + W)``, slot ``W + 2`` (``top``) for every ``K`` above; so the
    entry of ``K`` is ``packed[base + (0 if K == 0 else clamp(K - lo + 2, 1, top))]``. The header
    is ``[lo+, top+, base+, lo-, top-, base-, 0, 0]``. Checked here against both tables, every key.
    """
    lo_f, hi_f = _bucket_ends()
    bits = threshold.view(torch.int32).long() & 0xFFFFFFFF
    negative = torch.arange(1 << _KEY_BITS) >= _KEYS_PER_SIGN
    # The boundary lies inside the bucket when lo <= t < hi (then y > t iff low(y) > low(t)); t == hi
    # (or beyond, or non-finite buckets, where lo and hi are NaN) leaves no float of it above t.
    inside = (lo_f <= threshold) & (threshold < hi_f)
    low = torch.where(negative, ~bits, bits) & _NO_CUT
    entry = table.long() | torch.where(inside, low, _NO_CUT) << 8
    header, parts, base = [], [], PACKED_HEADER
    for e in entry.view(2, _KEYS_PER_SIGN):
        below, above = e[1], e[-1]
        differ_below = (e[1:] != below).nonzero()
        differ_above = (e[1:] != above).nonzero()
        lo = int(differ_below[0]) + 1 if differ_below.numel() else _KEYS_PER_SIGN
        hi = int(differ_above[-1]) + 1 if differ_above.numel() else 0
        width = max(0, hi - lo + 1)
        header += [lo, width + 2, base]
        parts += [e[:2], e[lo : lo + width], above.view(1)]
        base += width + 3
    packed = torch.cat([torch.tensor([*header, 0, 0]), *parts]).to(torch.int32)
    if not torch.equal(_unpack(packed).long(), entry):
        raise ValueError("packed encoding table does not reproduce the lookup tables")  # a bug here
    return packed


def _unpack(packed: Tensor) -> Tensor:
    """The entry of every 17-bit key, through ``packed``'s index rule (the inverse of ``_packed_table``)."""
    k = torch.arange(_KEYS_PER_SIGN)
    rows = []
    for sign in range(2):
        lo, top, base = (int(x) for x in packed[3 * sign : 3 * sign + 3])
        slot = torch.where(k == 0, 0, (k - lo + 2).clamp(1, top))
        rows.append(packed[base + slot])
    return torch.cat(rows)


@functools.cache
def dynamic_map(*, signed: bool, keep_nonzero: bool = False) -> QuantMap:
    """The dynamic map with its encoding tables (built once per argument pair, then shared)."""
    return QuantMap.build(dynamic_values(signed=signed), keep_nonzero=keep_nonzero)


# --------------------------------------------------------------------------- encode / decode


def encode_reference(y: Tensor, qmap: QuantMap) -> Tensor:
    """Codes of ``y`` by binary search (``torch.bucketize``): the slow reference ``encode`` must equal."""
    return torch.bucketize(y, qmap.boundaries).to(torch.uint8)


def encode(
    y: Tensor, qmap: QuantMap, *, out: Tensor | None = None, work: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """Codes (uint8) of the contiguous FP32 tensor ``y``, normally within [-1, 1]; values outside saturate.

    ``work``: optional (int32, FP32) scratch tensors with ``y``'s number of elements.
    """
    n = y.numel()
    key, thr = work if work is not None else (torch.empty(n, dtype=torch.int32), torch.empty(n))
    key, thr = key[:n].view(y.shape), thr[:n].view(y.shape)
    out = out if out is not None else torch.empty(y.shape, dtype=torch.uint8)
    torch.bitwise_right_shift(y.view(torch.int32), _KEY_SHIFT, out=key)
    key.bitwise_and_(_KEY_MASK)  # the arithmetic shift sign-extends; keep the 17 bits
    flat_key = key.view(-1)
    torch.index_select(qmap.table, 0, flat_key, out=out.view(-1))
    torch.index_select(qmap.threshold, 0, flat_key, out=thr.view(-1))
    above = torch.gt(y, thr, out=key.view(torch.bool).view(-1)[:n].view(y.shape))  # the keys are spent
    out.add_(above.view(torch.uint8))  # +1 where y lies above its bucket's boundary
    return out


def _block_views(x: Tensor, block_size: int) -> list[tuple[Tensor, slice]]:
    """``x`` as (rows, block) views: the full blocks, then the short last block if any; with block slices."""
    n = x.numel()
    full = n // block_size
    views = []
    if full:
        views.append((x[: full * block_size].view(full, block_size), slice(0, full)))
    if n > full * block_size:
        views.append((x[full * block_size :].view(1, -1), slice(full, full + 1)))
    return views


def quantize_blockwise(
    x: Tensor,
    qmap: QuantMap,
    *,
    block_size: int = BLOCK_SIZE,
    codes: Tensor | None = None,
    absmax: Tensor | None = None,
    work: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize the 1-D FP32 tensor ``x``: returns ``(codes, absmax)``, uint8 (n,) and FP32 (blocks,).

    ``codes``/``absmax`` are written in place when given. ``work``: optional (FP32, int32, FP32)
    scratch tensors of at least ``x.numel()`` elements, so a caller looping over chunks allocates once.
    An all-zero block gets scale 0 and the codes of 0.
    """
    if x.dim() != 1 or x.dtype != torch.float32:
        raise ValueError(f"quantize_blockwise takes a 1-D FP32 tensor, got {tuple(x.shape)} {x.dtype}")
    n = x.numel()
    codes = codes if codes is not None else torch.empty(n, dtype=torch.uint8)
    absmax = absmax if absmax is not None else torch.empty(num_blocks(n, block_size))
    if work is None:
        work = (torch.empty(n), torch.empty(n, dtype=torch.int32), torch.empty(n))
    scaled, key, thr = work
    scaled, key, thr = scaled[:n], key[:n], thr[:n]
    for (xb, blocks), (yb, _) in zip(
        _block_views(x, block_size), _block_views(scaled, block_size), strict=True
    ):
        amax = absmax[blocks]
        torch.amax(torch.abs(xb, out=yb), dim=1, out=amax)
        torch.div(xb, torch.where(amax > 0, amax, 1.0).unsqueeze(1), out=yb)
    encode(scaled, qmap, out=codes, work=(key, thr))
    return codes, absmax


def dequantize_blockwise(
    codes: Tensor,
    absmax: Tensor,
    qmap: QuantMap,
    *,
    block_size: int = BLOCK_SIZE,
    out: Tensor | None = None,
    work: Tensor | None = None,
) -> Tensor:
    """Decode ``codes`` (uint8, (n,)) with the block scales ``absmax`` into FP32 (n,): ``map[q] * A``.

    ``work``: optional int32 scratch of at least n elements.
    """
    n = codes.numel()
    if absmax.numel() != num_blocks(n, block_size):
        raise ValueError(
            f"{n} codes in blocks of {block_size} need {num_blocks(n, block_size)} scales, got {absmax.numel()}"
        )
    out = out if out is not None else torch.empty(n)
    index = work[:n] if work is not None else torch.empty(n, dtype=torch.int32)
    index.copy_(codes)  # index_select wants int32/int64 indices
    torch.index_select(qmap.values, 0, index, out=out)
    for ob, blocks in _block_views(out, block_size):
        ob.mul_(absmax[blocks].unsqueeze(1))
    return out
