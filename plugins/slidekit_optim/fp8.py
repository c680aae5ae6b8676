"""Block-wise scaled 8-bit floating-point codes for optimizer moments: the pure-torch codec.

Two formats, both with 4 exponent bits of bias 7 and subnormals, coded by
integer arithmetic on the FP32 bit pattern (no table):

* ``E4M3`` (signed; the first moment): sign, exponent, 3 mantissa bits; the
  OCP FP8 E4M3 ("e4m3fn") codes 0x00-0x7E and 0x80-0xFE, largest 448,
  smallest subnormal 2^-9; 0x7F/0xFF (NaN) are never produced. The same bits
  as ``torch.float8_e4m3fn`` for every value in [-448, 448].
* ``UE4M4`` (unsigned; the square root of the second moment): no sign, so the
  eighth bit is a fourth mantissa bit: largest (1 + 15/16) * 2^8 = 496,
  smallest subnormal 2^-10; all 256 codes are finite. With ``keep_nonzero``
  a nonzero value never takes code 0 (it takes code 1 at worst), so a second
  moment is never stored as 0 (why that matters: ``quant8``'s docstring).

A code's relative error is at most half a unit in the last place: 2^-4 =
6.25 % for E4M3 normals, 2^-5 = 3.1 % for UE4M4 (median over realistic
moments ~2.2 % and ~1.1 %, ``benchmarks/fp8_codec.py range``); below the
smallest normal, 2^-6 (a block's absmax times 2^-6 / 448 = 3.5e-5, or
2^-6 / 496), the error is absolute: at most 2^-10 (UE4M4: 2^-11) on the
scale where the absmax is 448 (496).

Per block of ``BLOCK_SIZE`` (256) elements with absmax ``A`` (FP32), as the
fused kernel (``csrc/adamwfp8.cpp``) does, each step one IEEE FP32 operation:

    encode:  y = x * (MAX / A)      (MAX / A once per block; A = 0: factor 1)
             code = rne8(y)        (|y| clamped to MAX first)
    decode:  x = value(code) * (A / MAX)

``rne8`` rounds to nearest, ties to even: for ``|y| >= 2^-6`` it adds
``2^(S-1) - 1`` plus the lowest kept bit to the pattern and shifts by
``S = 23 - M`` (M mantissa bits), rebasing the exponent by 127 - 7; below
2^-6 it adds ``2^(17 - M)`` in FP32 (whose ulp there is the subnormal step,
so the hardware's nearest-even addition rounds) and takes the pattern's
difference. ``value`` is exact: ``(code << S) + (120 << 23)`` as a pattern
for normals; for subnormals the pattern with exponent 121, less 2^-6.

State per parameter, as ``adamw_8bit``'s: 2 bytes of codes + 2 * 4 / 256 of
scales = 2.03 bytes. Why the square root of v: the update takes ``sqrt(v)``
for its denominator anyway, so the new r costs nothing, and r spans half v's
range in log terms, so E4M3's 2^17.8 (UE4M4's 2^19) covers realistic blocks
where v's own range would flush a third of them to 0 (NOTES section 21).

``reference_step`` is the pure-torch statement of the fused AdamW step of
``csrc/adamwfp8.cpp`` (m in E4M3, r = sqrt(v) in UE4M4 with keep_nonzero, the
update in ``layer_adam``'s FP32 operation order): the two agree bit for bit.
It is the ``"torch"`` path of the ``adamw_fp8`` optimizer (``adamw_fp8.py``,
run there in chunks of whole blocks), whose ``"cpp"`` path is that kernel
(measured in docs/benchmarks/NOTES.md section 21, ``benchmarks/fp8_codec.py``).

Test: ``pytest tests/plugins/test_fp8_codec.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slidekit_optim.layer_adam import _Segment, _StepScalars
from slidekit_optim.quant8 import BLOCK_SIZE, num_blocks

__all__ = ["E4M3", "STATE_KEYS", "UE4M4", "Fp8Format", "decode", "encode", "reference_step"]


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """An 8-bit float format with 4 exponent bits (bias 7) and subnormals."""

    name: str
    mantissa: int  # mantissa bits: 3 (signed) or 4 (unsigned)
    signed: bool
    max: float  # the largest finite value; a block's absmax maps onto it

    @property
    def shift(self) -> int:
        """FP32 pattern bits below the kept mantissa."""
        return 23 - self.mantissa

    @property
    def magic(self) -> float:
        """The FP32 number whose ulp is the format's subnormal step (2^(-6 - M))."""
        return float(1 << (17 - self.mantissa))


E4M3 = Fp8Format(name="e4m3", mantissa=3, signed=True, max=448.0)
UE4M4 = Fp8Format(name="ue4m4", mantissa=4, signed=False, max=496.0)

_MIN_NORMAL_BITS = 121 << 23  # the FP32 pattern of 2^-6, the smallest normal of both formats
_REBIAS = 120 << 23  # exponent bias 127 -> 7


def encode(y: Tensor, fmt: Fp8Format, *, keep_nonzero: bool = False, out: Tensor | None = None) -> Tensor:
    """Codes (uint8) of the FP32 tensor ``y`` (already scaled), rounded to nearest even.

    ``|y|`` is clamped to ``fmt.max`` first. Unsigned formats take ``|y|``
    (callers pass non-negative values). ``keep_nonzero``: nonzero ``y`` never
    takes code 0. Exact integer arithmetic and one FP32 addition per element.
    """
    bits = y.view(torch.int32)
    mag = torch.clamp(torch.abs(y), max=fmt.max)
    mbits = mag.view(torch.int32)
    s = fmt.shift
    # normal: add 2^(s-1) - 1 and the lowest kept bit, shift, rebase the exponent
    normal = (mbits + ((1 << (s - 1)) - 1) + ((mbits >> s) & 1)) >> s
    normal -= _REBIAS >> s
    magic = torch.tensor(fmt.magic, dtype=torch.float32, device=y.device)
    sub = (mag + magic).view(torch.int32) - magic.view(torch.int32)  # the hardware rounds the addition
    code = torch.where(mbits < _MIN_NORMAL_BITS, sub, normal).to(torch.int32)
    if keep_nonzero:
        code = torch.maximum(code, (mbits != 0).to(torch.int32))
    if fmt.signed:
        code |= (bits >> 24) & 0x80
    out = out if out is not None else torch.empty(y.shape, dtype=torch.uint8, device=y.device)
    return out.copy_(code)


def decode(codes: Tensor, fmt: Fp8Format, *, out: Tensor | None = None) -> Tensor:
    """FP32 values of ``codes`` (uint8), exactly."""
    c = codes.to(torch.int32)
    mag = c & 0x7F if fmt.signed else c
    s = fmt.shift
    subnormal = (mag >> fmt.mantissa) == 0
    bits = (mag << s) + torch.where(subnormal, _MIN_NORMAL_BITS, _REBIAS).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(subnormal, x - 2.0**-6, x)  # exact: m * 2^-(6 + M) (Sterbenz)
    if fmt.signed:
        x = torch.where((c & 0x80) != 0, -x, x)  # negation flips the sign bit only
    out = out if out is not None else torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    return out.copy_(x)


# --------------------------------------------------------------------------- the AdamW step

#: The state of ``reference_step`` and the kernel: codes (uint8, n) and block absmax (FP32, blocks).
STATE_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_sqrt_codes", "exp_avg_sq_sqrt_absmax")


def _per_block(x: Tensor, factor: Tensor) -> Tensor:
    """``x`` (n,) times its block's entry of ``factor`` (blocks,): one FP32 multiplication each."""
    n = x.numel()
    full = n // BLOCK_SIZE
    out = torch.empty_like(x)
    if full:
        head = slice(0, full * BLOCK_SIZE)
        torch.mul(x[head].view(full, BLOCK_SIZE), factor[:full, None], out=out[head].view(full, BLOCK_SIZE))
    if n > full * BLOCK_SIZE:
        torch.mul(x[full * BLOCK_SIZE :], factor[full], out=out[full * BLOCK_SIZE :])
    return out


def _block_absmax(x: Tensor) -> Tensor:
    pad = num_blocks(x.numel()) * BLOCK_SIZE - x.numel()
    return torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, BLOCK_SIZE).amax(1)


def _ratio(num: float, den: Tensor) -> Tensor:
    """``num / den`` per element, one FP32 division (tensor by tensor: a scalar divisor may be turned
    into a multiplication by its reciprocal on some devices)."""
    return torch.div(torch.full_like(den, num), den)


def reference_step(
    master: Tensor,
    grad: Tensor,
    state: Mapping[str, Tensor],
    segments: Sequence[_Segment],
    s: _StepScalars,
    lowp_out: Tensor | None = None,
) -> None:
    """One AdamW step over a whole unit in place, in ``csrc/adamwfp8.cpp``'s operation order.

    ``state``: ``STATE_KEYS``; ``segments``/``s`` as ``layer_adam._segments``/``_scalars`` make
    them. Allocates a few FP32 temporaries the size of the unit (a reference, not a fast path).
    """
    mc, ma, rc, ra = (state[k] for k in STATE_KEYS)
    g = grad.reshape(-1).float()
    m0 = _per_block(decode(mc, E4M3), torch.div(ma, torch.full_like(ma, E4M3.max)))
    r0 = _per_block(decode(rc, UE4M4), torch.div(ra, torch.full_like(ra, UE4M4.max)))
    for lo, hi, decay in segments:  # decoupled weight decay first
        if decay is not None:
            master[lo:hi].mul_(decay)
    m = m0.add_(torch.sub(g, m0).mul_(s.w1))  # m + w1 * (g - m)
    v = r0.mul_(r0).mul_(s.beta2).add_(torch.mul(g, s.sq_weight).mul_(g))  # (r * r) * beta2 + (w2 * g) * g
    r = torch.sqrt(v.double()).float()  # correctly rounded (torch's FP32 sqrt is not, on x86)
    den = torch.mul(r, s.inv_b2).add_(s.eps)
    master.add_(torch.mul(m, s.neg_step).div_(den))  # p + (neg_step * m) / den
    if lowp_out is not None:
        lowp_out.copy_(master.view(lowp_out.shape))
    am, ar = _block_absmax(m), _block_absmax(r)
    one = torch.ones_like(am)
    fm = torch.where(am > 0, _ratio(E4M3.max, torch.where(am > 0, am, one)), one)
    fr = torch.where(ar > 0, _ratio(UE4M4.max, torch.where(ar > 0, ar, one)), one)
    encode(_per_block(m, fm), E4M3, out=mc)
    encode(_per_block(r, fr), UE4M4, keep_nonzero=True, out=rc)
    ma.copy_(am)
    ra.copy_(ar)
