"""adamw_8bit's fused C++ kernel encodes exactly as quant8 does: its packed table, on every 17-bit key.

``QuantMap.packed`` is the compact form of quant8's two lookup tables that the kernel
(csrc/adamw8.cpp through quant8_packed.h, or quant8_avx512.h's 16-lane form) reads.
Checked here, for the dynamic maps and for maps unlike them (uniform, exponential,
one code among the subnormals):

* the format itself, read in torch by the rule quant8 documents, against
  ``torch.bucketize`` (the plain reference) and ``quant8.encode`` on every 17-bit
  key with 8 low-bit patterns each, every boundary and the two floats on either
  side of it, every map value, zeros, subnormals, +-1, infinities and NaNs;
* the kernel's encoder (``quantize_blockwise_``, the very code ``adamw8_step_``
  runs) on those floats, placed in blocks whose scale is 1, so that each reaches
  the encoder unscaled; under every ATen CPU capability this machine has (the
  AVX-512 block pass, and the portable loops of the AVX2 and DEFAULT builds);
* random blocks (hypothesis): the kernel's blockwise quantization equals
  ``quant8.quantize_blockwise``, scales and codes, bit for bit;
* blocks of extreme scales (the smallest normal float to 2^127 and past it, subnormal), each with
  elements of every exponent below its scale, zeros of both signs and subnormals: codes and
  scales equal ``quant8.quantize_blockwise``'s.

That the whole fused step equals the torch path is tests/plugins/test_adamw8_kernel.py's job.

Run: ``pytest tests/plugins/test_adamw8_encoder.py``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from test_adamw8_kernel import _capabilities

from slidekit_optim.adamw_8bit import KERNEL_SOURCE
from slidekit_optim.layer_adam import kernel_status, load_kernel
from slidekit_optim.quant8 import (
    BLOCK_SIZE,
    PACKED_HEADER,
    QuantMap,
    dynamic_map,
    dynamic_values,
    encode,
    num_blocks,
    quantize_blockwise,
)


def _exponential_values() -> torch.Tensor:
    """0 and 255 values 2^(-k/10): codes over 25 binary exponents, 7 % apart."""
    return torch.tensor(sorted([0.0, *(2.0 ** (-k / 10) for k in range(255))]), dtype=torch.float32)


def _subnormal_values() -> torch.Tensor:
    """The unsigned dynamic map with its smallest nonzero value moved to 2^-135, a subnormal: a
    boundary inside the bucket of key 0."""
    values = dynamic_values(signed=False).clone()
    values[1] = 2.0**-135
    return values


_BUILDERS = {
    "signed": lambda: dynamic_map(signed=True),
    "unsigned keep_nonzero": lambda: dynamic_map(signed=False, keep_nonzero=True),
    "unsigned": lambda: dynamic_map(signed=False),
    "signed keep_nonzero": lambda: dynamic_map(signed=True, keep_nonzero=True),
    "uniform": lambda: QuantMap.build(torch.linspace(-1, 1, 256)),
    "exponential": lambda: QuantMap.build(_exponential_values()),
    "subnormal code": lambda: QuantMap.build(_subnormal_values()),
}
MAPS = list(_BUILDERS)


@functools.cache
def _map(name: str) -> QuantMap:
    return _BUILDERS[name]()


@pytest.fixture(scope="module")
def kernel():
    """The fused kernel, built (or loaded from cache) once; skipped only where no compiler/ninja exists."""
    status = kernel_status(KERNEL_SOURCE)
    if status.startswith(("pure torch (no C++ compiler", "pure torch (ninja")):
        pytest.skip(status)
    return load_kernel(KERNEL_SOURCE)


def _floats(patterns: torch.Tensor) -> torch.Tensor:
    """FP32 values of unsigned 32-bit patterns held in int64."""
    return (patterns - ((patterns >= 1 << 31).long() << 32)).to(torch.int32).view(torch.float32)


def _every_key() -> torch.Tensor:
    """Every 17-bit key (the top bits quant8 looks up) with 8 low-15-bit patterns each: 2^20 floats."""
    gen = torch.Generator().manual_seed(17)
    low = torch.cat([torch.tensor([0, 0x7FFF, 0x4000]), torch.randint(0, 1 << 15, (5,), generator=gen)])
    keys = torch.arange(1 << 17, dtype=torch.int64)
    return _floats(((keys.unsqueeze(1) << 15) | low).flatten())


def _edges(qmap: QuantMap) -> torch.Tensor:
    """Every boundary (a tie: the smaller code) and the two floats on either side of it, every map
    value, zeros, subnormals, the smallest normals, +-1, infinities and NaNs of both signs."""
    b = qmap.boundaries
    up, down = torch.full_like(b, torch.inf), torch.full_like(b, -torch.inf)
    above = torch.nextafter(b, up)
    below = torch.nextafter(b, down)
    near = [b, above, below, torch.nextafter(above, up), torch.nextafter(below, down)]
    tiny = torch.finfo(torch.float32).smallest_normal
    special = torch.tensor([0.0, 1.0, -1.0, 2.0**-149, tiny, tiny - 2.0**-149, 1.5, torch.inf])
    nans = _floats(torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF]))
    return torch.cat([*near, qmap.values, special, -special, nans])


def _read_packed(y: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """Codes of ``y`` from ``packed`` by the rule quant8's docstring (and quant8_packed.h) state."""
    u = y.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    sign = u >> 31
    key = (u >> 15) & 0xFFFF
    lo, top, base = packed[: PACKED_HEADER - 2].long().view(2, 3)[sign].unbind(-1)
    slot = torch.where(key == 0, 0, torch.minimum(torch.maximum(key - lo + 2, torch.ones_like(key)), top))
    entry = packed.long()[base + slot]
    low = torch.where(sign == 1, ~u, u) & 0x7FFF
    return ((entry & 0xFF) + (low > entry >> 8).long()).to(torch.uint8)


def _assert_codes(actual: torch.Tensor, expected: torch.Tensor, y: torch.Tensor, what: str) -> None:
    bad = (actual != expected).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        pattern = int(y[i : i + 1].view(torch.int32)) & 0xFFFFFFFF
        raise AssertionError(
            f"{what}: {bad.numel()} of {y.numel()} codes differ, first y={y[i].item()!r} "
            f"(0x{pattern:08X}): {int(actual[i])} vs {int(expected[i])}"
        )


@pytest.mark.parametrize("name", MAPS)
def test_packed_table_reads_as_binary_search_for_every_key(name):
    qmap = _map(name)
    y = torch.cat([_every_key(), _edges(qmap)])
    codes = _read_packed(y, qmap.packed)
    real = ~torch.isnan(y)
    _assert_codes(codes[real], torch.bucketize(y[real], qmap.boundaries).to(torch.uint8), y[real], name)
    _assert_codes(codes, encode(y, qmap), y, f"{name} vs quant8.encode")


def test_packed_tables_of_the_dynamic_maps_are_small():
    """A few exponents hold codes: ~10 K entries (42 KB) for the signed map instead of 2^17 per table."""
    sizes = {name: _map(name).packed.numel() for name in ("signed", "unsigned keep_nonzero")}
    assert sizes["signed"] < 11_000 and sizes["unsigned keep_nonzero"] < 6_000, sizes


def _unscaled_blocks(y: torch.Tensor) -> torch.Tensor:
    """``y`` in blocks whose scale is 1, so that the encoder sees each element as it is: |y| <= 1 in
    blocks led by +-1, the rest (larger, infinite, NaN) in blocks led by a NaN (a NaN scale
    encodes x / 1), each padded with zeros to a whole block."""
    per = BLOCK_SIZE - 1
    small = (y.abs() <= 1) & ~torch.isnan(y)
    parts = []
    for group, leaders in ((y[small], [1.0, -1.0]), (y[~small], [torch.nan, -torch.nan])):
        rows = torch.cat([group, group.new_zeros(-group.numel() % per)]).view(-1, per)
        lead = torch.tensor(leaders).repeat(rows.shape[0] // 2 + 1)[: rows.shape[0]]
        parts.append(torch.cat([lead.unsqueeze(1), rows], dim=1).flatten())
    return torch.cat(parts)


def _kernel_codes(kernel, x: torch.Tensor, qmap: QuantMap) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.empty(x.numel(), dtype=torch.uint8)
    absmax = torch.empty(num_blocks(x.numel()))
    kernel.quantize_blockwise_(x, qmap.packed, codes, absmax)
    return codes, absmax


@pytest.mark.parametrize("name", MAPS)
def test_kernel_encoder_equals_quant8_for_every_key(kernel, name):
    qmap = _map(name)
    x = _unscaled_blocks(torch.cat([_every_key(), _edges(qmap)]))
    codes, absmax = _kernel_codes(kernel, x, qmap)
    leaders = x.view(-1, BLOCK_SIZE)[:, 0]
    assert torch.equal(torch.isnan(absmax), torch.isnan(leaders)), "a block's scale is NaN iff it holds a NaN"
    assert bool((absmax[~torch.isnan(absmax)] == 1).all())
    _assert_codes(codes, encode(x, qmap), x, f"{name}: kernel vs quant8.encode")
    real = ~torch.isnan(x)
    expected = torch.bucketize(x[real], qmap.boundaries).to(torch.uint8)
    _assert_codes(codes[real], expected, x[real], f"{name}: kernel vs bucketize")


@pytest.mark.parametrize("capability", _capabilities())
def test_kernel_encoder_under_every_cpu_capability(kernel, tmp_path, capability):
    """The kernel built for each capability (AVX512: the 16-lane block pass; AVX2 and DEFAULT: the
    portable loops) encodes every key of the signed and the unsigned map as quant8 does."""
    names = ["signed", "unsigned keep_nonzero"]
    inputs = {name: _unscaled_blocks(torch.cat([_every_key(), _edges(_map(name))])) for name in names}
    torch.save(inputs, tmp_path / "inputs.pt")
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_adamw8_encoder as t; "
        "k = t.load_kernel(t.KERNEL_SOURCE); "
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r}); "
        "r = {n: t._kernel_codes(k, x[n], t._map(n)) for n in x}; "
        "r['cap'] = str(torch.backends.cpu.get_cpu_capability()).lower(); r['width'] = k.vector_width(); "
        f"torch.save(r, {str(tmp_path / 'result.pt')!r})"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    # The timeout only turns a hang into a failure: the child may build the kernel from cold (see
    # test_adamw8_kernel.py's capability test for the times seen on a loaded 2-core machine).
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(tmp_path / "result.pt")
    assert result["cap"] == capability
    assert result["width"] == (16 if capability == "avx512" else 1), result["width"]
    for name in names:
        codes, _ = result[name]
        _assert_codes(codes, encode(inputs[name], _map(name)), inputs[name], f"{capability} {name}")


_FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
_TYPICAL = st.floats(min_value=-1e3, max_value=1e3, width=32)


@settings(max_examples=200)
@given(
    values=st.lists(st.one_of(_FLOATS, _TYPICAL), min_size=1, max_size=3 * BLOCK_SIZE + 7),
    name=st.sampled_from(MAPS),
)
def test_kernel_quantizes_random_blocks_like_quant8(kernel, values, name):
    qmap = _map(name)
    x = torch.tensor(values, dtype=torch.float32)
    codes, absmax = _kernel_codes(kernel, x, qmap)
    ref_codes, ref_absmax = quantize_blockwise(x, qmap)
    _assert_codes(codes, ref_codes, x, name)
    nan = torch.isnan(ref_absmax)
    assert torch.equal(torch.isnan(absmax), nan)
    assert torch.equal(absmax[~nan].view(torch.int32), ref_absmax[~nan].view(torch.int32))


#: Block scales: the smallest normal float (and its significand all ones), ordinary ones, just below
#: 2^127, 2^127, a subnormal and the largest float.
_SCALES = [2.0**-126, 2.0**-126 * (2 - 2.0**-23), 3.0e-20, 1.0, 1.5, 7.0e15, 2.0**126 * (2 - 2.0**-23)]
_SCALES += [2.0**127, 2.0**-140, 3.4028234663852886e38]


def _block_of_scale(scale: float, generator: torch.Generator) -> torch.Tensor:
    """One block led by ``scale``: random elements of every exponent from the scale's down to
    subnormals, signed, and +0, -0, the smallest subnormal and -scale."""
    x = torch.empty(BLOCK_SIZE, dtype=torch.float64)
    x[0] = scale
    exponents = torch.randint(-160, 1, (BLOCK_SIZE,), generator=generator).double()
    fractions = torch.rand(BLOCK_SIZE, generator=generator, dtype=torch.float64)
    signs = torch.randint(0, 2, (BLOCK_SIZE,), generator=generator).double() * 2 - 1
    x[1:] = (signs * fractions * 2.0**exponents * scale)[1:]
    x[1:5] = torch.tensor([0.0, -0.0, 2.0**-149, -scale], dtype=torch.float64)
    out = x.float()
    return torch.where(out.abs() > scale, torch.zeros_like(out), out)  # a rounding up past the scale


@pytest.mark.parametrize("name", ["signed", "unsigned keep_nonzero", "exponential", "subnormal code"])
def test_kernel_quantizes_blocks_of_extreme_scales_like_quant8(kernel, name):
    qmap = _map(name)
    generator = torch.Generator().manual_seed(5)
    x = torch.cat([_block_of_scale(scale, generator) for scale in _SCALES for _ in range(8)])
    if name.startswith("unsigned"):
        x = x.abs()
    codes, absmax = _kernel_codes(kernel, x, qmap)
    ref_codes, ref_absmax = quantize_blockwise(x, qmap)
    _assert_codes(codes, ref_codes, x, f"{name}, extreme scales")
    assert torch.equal(absmax.view(torch.int32), ref_absmax.view(torch.int32))
