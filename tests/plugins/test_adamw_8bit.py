"""adamw_8bit and its block-wise 8-bit quantization, against float64 references written here.

The quantizer is checked element by element against an independent float64
nearest-value search; the optimizer against a float64 AdamW (one step, with a
tolerance derived from the quantization error bounds), against
torch.optim.AdamW (100 steps), and end to end: the demo model fine-tuned for
200 steps ends within 2 % of layer_adam's loss. The optimizer checks run on
both implementations (the fused C++ kernel and the torch path); that the two
agree bit for bit is tests/plugins/test_adamw8_kernel.py's job.

Run: ``pytest tests/plugins/test_adamw_8bit.py`` (``-m "not slow"`` skips the 200-step runs).
"""

from __future__ import annotations

import math

import pytest
import torch

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.adamw_8bit import KERNEL_SOURCE, AdamW8bit
from slidekit_optim.layer_adam import kernel_status
from slidekit_optim.quant8 import (
    BLOCK_SIZE,
    dequantize_blockwise,
    dynamic_map,
    dynamic_values,
    encode,
    encode_reference,
    num_blocks,
    quantize_blockwise,
)

F32_EPS = 2.0**-24  # unit roundoff of FP32


def _impls() -> list:
    """Both paths; "cpp" skipped (saying why) only where no compiler or ninja exists to build it."""
    status = kernel_status(KERNEL_SOURCE)
    no_tools = status.startswith(("pure torch (no C++ compiler", "pure torch (ninja"))
    return [pytest.param("cpp", marks=pytest.mark.skipif(no_tools, reason=status)), "torch"]


IMPLS = _impls()


def _state(opt: AdamW8bit, n: int) -> dict[str, torch.Tensor]:
    """State as the engine hands it over: allocated from the layout, zero bytes."""
    return {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}


# --------------------------------------------------------------------------- the maps


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_256_sorted_values_spanning_the_range(signed):
    values = dynamic_values(signed=signed)
    assert values.dtype == torch.float32 and values.shape == (256,)
    assert bool((values[1:] > values[:-1]).all())  # strictly increasing, hence distinct
    assert 0.0 in values.tolist() and values[-1] == 1.0
    assert values[0] == (-1.0 if signed else 0.0)
    # Dynamic tree structure: decade e (magnitudes in [0.1, 1] * 10^-e) holds 2^(F) values,
    # F = 7 - e fraction bits unsigned, 6 - e per sign signed (e = 6 signed: one code, positive only).
    mags = values.double().abs()
    for e in range(7):
        in_decade = int(((mags > 0.1 * 10.0**-e) & (mags < 10.0**-e)).sum())
        expected = 2 ** (7 - e) if not signed else (2 * 2 ** (6 - e) if e < 6 else 1)
        assert in_decade == expected, (e, in_decade)


def test_signed_map_is_symmetric_but_for_one_sub_ppm_code():
    values = dynamic_values(signed=True).double()
    positive = set(values[values > 0].tolist())
    mirrored = set((-values[values < 0]).tolist())
    extra = positive - mirrored
    assert mirrored <= positive and len(extra) == 1 and 0 < extra.pop() < 1e-6


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("keep_nonzero", [False, True])
def test_lookup_encoder_equals_binary_search(signed, keep_nonzero):
    qmap = dynamic_map(signed=signed, keep_nonzero=keep_nonzero)
    gen = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**31), 2**31, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_floats = bits.view(torch.float32)
    b = qmap.boundaries
    y = torch.cat(
        [
            random_floats[torch.isfinite(random_floats)],
            torch.rand(1 << 18, generator=gen) * 2 - 1,
            (torch.rand(1 << 16, generator=gen) * 2 - 1) * 1e-6,
            qmap.values,
            b,
            torch.nextafter(b, torch.full_like(b, 2.0)),
            torch.nextafter(b, torch.full_like(b, -2.0)),
            torch.tensor([0.0, -0.0, 1.5, -1.5, math.inf, -math.inf, 1e-45, -1e-45]),
        ]
    )
    fast, slow = encode(y, qmap), encode_reference(y, qmap)
    bad = (fast != slow).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, first at y={y[bad[0]].item()!r}"


# --------------------------------------------------------------------------- round trip


def _nearest_reference(x: torch.Tensor, values: torch.Tensor, *, keep_nonzero: bool = False):
    """Float64 block-wise quantization by exhaustive nearest-value search.

    Returns (decoded, absmax, y, gap, near_zero): ``y = x / A``; ``gap`` is the distance between the
    two map values around ``y``; ``near_zero`` marks ``y`` between 0 and its sign's smallest code.
    """
    x64, v64 = x.double(), values.double()
    n = x.numel()
    pad = num_blocks(n) * BLOCK_SIZE - n
    blocks = torch.cat([x64, x64.new_zeros(pad)]).view(-1, BLOCK_SIZE)
    absmax = blocks.abs().amax(dim=1)
    y = (blocks / torch.where(absmax > 0, absmax, 1.0).unsqueeze(1)).reshape(-1)[:n]
    q = (y.unsqueeze(1) - v64.unsqueeze(0)).abs().argmin(dim=1)  # ties: the first (smaller) value
    if keep_nonzero:  # a nonzero value never takes the zero code: the smallest code of its sign instead
        zero = int((v64 == 0).nonzero())
        q = torch.where((q == zero) & (y > 0), zero + 1, q)
        q = torch.where((q == zero) & (y < 0), zero - 1, q)
    scale = absmax.repeat_interleave(BLOCK_SIZE)[:n]
    k = torch.searchsorted(v64, y).clamp(1, 255)  # y lies in [v[k-1], v[k]]
    gap = v64[k] - v64[k - 1]
    near_zero = (v64[k - 1] == 0) | (v64[k] == 0)
    return v64[q] * scale, absmax, y, gap, near_zero


def _test_data(n: int, *, signed: bool, seed: int) -> torch.Tensor:
    """Magnitudes log-uniform over 10 decades; an outlier in block 0; block 1 (if any) all zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = 10.0 ** (torch.rand(n, generator=gen) * 10 - 8)
    if signed:
        x = x * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1)
    x[min(n - 1, 17)] = 1e6  # one huge outlier: the rest of block 0 lands in the lowest decades
    if n > 2 * BLOCK_SIZE:
        x[BLOCK_SIZE : 2 * BLOCK_SIZE] = 0.0
    return x.float()


@pytest.mark.parametrize("n", [1, 255, 256, 257, 4099])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("keep_nonzero", [False, True])
def test_round_trip_decodes_to_the_nearest_value(n, signed, keep_nonzero):
    qmap = dynamic_map(signed=signed, keep_nonzero=keep_nonzero)
    x = _test_data(n, signed=signed, seed=n)
    codes, absmax = quantize_blockwise(x, qmap)
    assert codes.dtype == torch.uint8 and codes.shape == (n,)
    assert absmax.dtype == torch.float32 and absmax.shape == (num_blocks(n),)
    decoded = dequantize_blockwise(codes, absmax, qmap)

    ref, ref_absmax, _, gap, near_zero = _nearest_reference(x, qmap.values, keep_nonzero=keep_nonzero)
    assert torch.equal(absmax.double(), ref_absmax)  # the scale is the exact block maximum
    scale = ref_absmax.repeat_interleave(BLOCK_SIZE)[:n]
    err = (decoded.double() - x.double()).abs()
    slack = 4 * F32_EPS * scale  # FP32 rounding of x / A and of map[q] * A
    assert bool((err <= (ref - x.double()).abs() + slack).all()), "not the nearest code"
    # Nearest means within half the gap between the two map values around x / A (keep_nonzero: the
    # whole gap between 0 and the smallest code); the element setting the scale is exact.
    bound = torch.where(near_zero, gap, gap / 2) if keep_nonzero else gap / 2
    assert bool((err <= bound * scale + slack).all())
    assert bool((decoded.abs().double() <= scale).all())
    assert decoded[x.abs() == scale.float()].double().equal(x[x.abs() == scale.float()].double())
    if n > 2 * BLOCK_SIZE:  # the all-zero block: scale 0, exact zeros
        assert absmax[1] == 0 and bool((decoded[BLOCK_SIZE : 2 * BLOCK_SIZE] == 0).all())
    if keep_nonzero:
        assert bool(((decoded != 0) == (x != 0)).all())


def test_zero_bytes_decode_to_zero_whatever_the_codes():
    qmap = dynamic_map(signed=True)
    n = 1000
    zeros = dequantize_blockwise(torch.zeros(n, dtype=torch.uint8), torch.zeros(num_blocks(n)), qmap)
    assert bool((zeros == 0).all())
    codes = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert bool((dequantize_blockwise(codes, torch.zeros(num_blocks(n)), qmap) == 0).all())


def test_state_layout_costs_about_two_bytes_per_parameter():
    opt = AdamW8bit(OptimizerHyper())
    n = 1_000_003
    layout = opt.state_layout(n)
    assert layout == {
        "exp_avg_codes": (torch.uint8, n),
        "exp_avg_absmax": (torch.float32, num_blocks(n)),
        "exp_avg_sq_codes": (torch.uint8, n),
        "exp_avg_sq_absmax": (torch.float32, num_blocks(n)),
    }
    nbytes = sum(c * torch.empty((), dtype=dt).element_size() for dt, c in layout.values())
    assert nbytes / n == pytest.approx(2 + 8 / BLOCK_SIZE, abs=1e-4)
    for name, t in _state(opt, n).items():  # the engine's zero bytes decode to zero moments
        if name.endswith("absmax"):
            assert bool((t == 0).all())


# --------------------------------------------------------------------------- the update


def _groups(n: int, wd: float) -> list[ParamGroupRange]:
    cut = (n * 3) // 5
    return [
        ParamGroupRange(start=0, stop=cut, weight_decay=wd),
        ParamGroupRange(start=cut, stop=n, weight_decay=0.0),
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_first_step_from_zero_bytes_is_plain_adamw(grad_dtype, impl):
    """Zero bytes are zero moments, and no quantization error enters before the moments are
    stored: step 1 is AdamW from zero moments, up to FP32 rounding."""
    n, lr, betas, eps, wd = 3001, 1e-3, (0.9, 0.95), 1e-8, 0.1
    gen = torch.Generator().manual_seed(0)
    init, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).to(grad_dtype)
    opt = AdamW8bit(OptimizerHyper(betas=betas, eps=eps, weight_decay=wd), impl=impl)
    p, lowp = init.clone(), torch.empty(n, dtype=torch.bfloat16)
    opt.step(p, grad, _state(opt, n), lr=lr, count=1, groups=_groups(n, wd), lowp_out=lowp)
    decay = torch.zeros(n, dtype=torch.float64)  # per element, from the groups
    for grp in _groups(n, wd):
        decay[grp.start : grp.stop] = grp.weight_decay
    zeros = torch.zeros(n, dtype=torch.float64)
    kw = {"lr": lr, "count": 1, "betas": betas, "eps": eps, "wd": decay}
    ref = _adamw64(init.double(), grad.double(), zeros, zeros, **kw)[0]
    assert bool(((p.double() - ref).abs() <= 4 * F32_EPS * (init.double().abs() + lr)).all())
    assert torch.equal(lowp, p.to(torch.bfloat16))


def _adamw64(p, g, m, v, *, lr, count, betas, eps, wd):
    """One AdamW step in float64 (the formula of torch.optim.AdamW): returns (p, m, v, update)."""
    b1, b2 = betas
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = v.sqrt() / math.sqrt(1 - b2**count) + eps
    update = m / denom
    return p - lr / (1 - b1**count) * update, m, v, update


@pytest.mark.parametrize("impl", IMPLS)
def test_one_step_against_float64_adamw_within_the_quantization_error(impl):
    n, lr, count, betas, eps, wd = 5000, 1e-3, 7, (0.9, 0.95), 1e-8, 0.1
    gen = torch.Generator().manual_seed(3)
    p0, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.3
    v0 = (torch.randn(n, generator=gen) * 0.5) ** 2 + 1e-4
    opt = AdamW8bit(OptimizerHyper(betas=betas, eps=eps, weight_decay=wd), impl=impl)
    state = _state(opt, n)
    quantize_blockwise(m0, opt.m_map, codes=state["exp_avg_codes"], absmax=state["exp_avg_absmax"])
    quantize_blockwise(v0, opt.v_map, codes=state["exp_avg_sq_codes"], absmax=state["exp_avg_sq_absmax"])
    m0q = dequantize_blockwise(state["exp_avg_codes"], state["exp_avg_absmax"], opt.m_map).double()
    v0q = dequantize_blockwise(state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"], opt.v_map).double()
    p = p0.clone()
    opt.step(p, g, state, lr=lr, count=count, groups=[ParamGroupRange(start=0, stop=n, weight_decay=wd)])
    kw = {"lr": lr, "count": count, "betas": betas, "eps": eps, "wd": wd}

    # 1. From the moments as stored, the step is AdamW up to FP32 rounding.
    pq, m1q, v1q, uq = _adamw64(p0.double(), g.double(), m0q, v0q, **kw)
    step = lr / (1 - betas[0] ** count)
    fp32 = 4 * F32_EPS * (p0.double().abs() + step * uq.abs())
    assert bool(((p.double() - pq).abs() <= fp32).all())

    # 2. Against the exact moments: the stored ones are off by at most half a map gap times the
    # block scale (m), or one gap (v, which never rounds down to 0); propagate that through the update.
    gap_m, gap_v = _nearest_reference(m0, opt.m_map.values)[3], _nearest_reference(v0, opt.v_map.values)[3]
    dm = betas[0] * gap_m / 2 * _block_scales(m0)  # bounds on |m1 - m1q| and |v1 - v1q|
    dv = betas[1] * gap_v * _block_scales(v0)
    pe, m1, v1, ue = _adamw64(p0.double(), g.double(), m0.double(), v0.double(), **kw)
    c2 = math.sqrt(1 - betas[1] ** count)
    d_exact, d_stored = v1.sqrt() / c2 + eps, v1q.sqrt() / c2 + eps
    du = dm / d_stored + m1.abs() * (dv.sqrt() / c2) / (d_exact * d_stored)  # |ue - uq| bound
    assert bool(((ue - uq).abs() <= du * (1 + 1e-9)).all())
    assert bool(((p.double() - pe).abs() <= step * du + fp32).all())
    assert float(((p.double() - pe) / (pe - p0.double() * (1 - lr * wd))).abs().median()) < 0.05

    # 3. The new moments are stored as the nearest codes of the new moments (which the optimizer
    # computes in FP32: a few roundings of the operands away from these float64 ones).
    for codes, absmax, qmap, exact, operands in (
        ("exp_avg_codes", "exp_avg_absmax", opt.m_map, m1q, m0q.abs() + g.double().abs()),
        ("exp_avg_sq_codes", "exp_avg_sq_absmax", opt.v_map, v1q, v0q + g.double() ** 2),
    ):
        stored = dequantize_blockwise(state[codes], state[absmax], qmap).double()
        nearest = _nearest_reference(exact.float(), qmap.values, keep_nonzero=qmap is opt.v_map)[0]
        slack = 8 * F32_EPS * (_block_scales(exact) + operands)
        assert bool(((stored - exact).abs() <= (nearest - exact).abs() + slack).all())


def _block_scales(x: torch.Tensor) -> torch.Tensor:
    """Each element's block scale (float64): the largest magnitude in its block."""
    n = x.numel()
    pad = num_blocks(n) * BLOCK_SIZE - n
    blocks = torch.cat([x.double(), x.double().new_zeros(pad)]).view(-1, BLOCK_SIZE)
    return blocks.abs().amax(1).repeat_interleave(BLOCK_SIZE)[:n]


def _run(opt: AdamW8bit, steps: int, n: int, grad_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    master, state = torch.randn(n, generator=gen), _state(opt, n)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 10 ** torch.randint(-6, 1, (n,), generator=gen)).to(grad_dtype)
        opt.step(master, g, state, lr=1e-3, count=t, groups=_groups(n, 0.1), lowp_out=lowp)
    return master, lowp, state


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bitwise_deterministic_and_independent_of_the_chunk_size(grad_dtype):
    """The torch path's chunk size (and a repeat run) change no bit; the C++ kernel has no chunks."""
    n, hyper = 10_000, OptimizerHyper(betas=(0.9, 0.95), weight_decay=0.1)
    runs = [
        _run(AdamW8bit(hyper, chunk=chunk, impl="torch"), 5, n, grad_dtype)
        for chunk in (BLOCK_SIZE, BLOCK_SIZE, 3 * BLOCK_SIZE, 1 << 20)
    ]
    first = runs[0]
    for other in runs[1:]:
        assert torch.equal(other[0], first[0]) and torch.equal(other[1], first[1])
        for name in first[2]:
            assert torch.equal(other[2][name], first[2][name]), name
    assert torch.equal(first[1], first[0].to(torch.bfloat16))


@pytest.mark.parametrize("impl", IMPLS)
def test_tracks_torch_adamw_over_100_steps(impl):
    """Quantization errors are unbiased and mostly average out: the parameters' total change stays
    within a few percent of AdamW's (about 2 % measured; 5 % leaves room across torch versions,
    while a wrong map, sign or bias correction is off by far more)."""
    n, steps, lr, betas, wd = 4099, 100, 1e-3, (0.9, 0.95), 0.1
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    opt = AdamW8bit(OptimizerHyper(betas=betas, weight_decay=wd), impl=impl)
    master, state = init.clone(), _state(opt, n)
    ref_p = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([ref_p], lr=lr, betas=betas, weight_decay=wd, foreach=False)
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=gen) * 10 ** torch.randint(-6, 1, (n,), generator=gen)
        opt.step(master, g, state, lr=lr, count=t, groups=[ParamGroupRange(start=0, stop=n, weight_decay=wd)])
        ref_p.grad = g
        ref.step()
    change, ref_change = master - init, ref_p.detach() - init
    assert ((change - ref_change).norm() / ref_change.norm()).item() < 0.05


@pytest.mark.parametrize("impl", IMPLS)
def test_small_gradients_beside_large_ones_never_get_larger_updates_than_adamw(impl):
    """Why the second moment never rounds down to zero: gradients 10^4 times smaller than their
    block's largest have v below the unsigned map's smallest code. Rounded to 0, every step would
    divide m by sqrt((1 - beta2) g^2): a far larger step than AdamW's. Rounded up, a smaller one."""
    n, tiny = 512, (1, 300)
    g = torch.ones(n)
    g[list(tiny)] = 1e-4
    hyper = OptimizerHyper(betas=(0.9, 0.999))

    def final(opt: AdamW8bit) -> torch.Tensor:
        p, state = torch.zeros(n), _state(opt, n)
        for t in range(1, 51):
            opt.step(p, g, state, lr=1e-3, count=t, groups=[])
        return p

    ref_p = torch.nn.Parameter(torch.zeros(n))
    ref = torch.optim.AdamW([ref_p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(50):
        ref_p.grad = g.clone()
        ref.step()
    guarded = final(AdamW8bit(hyper, impl=impl))
    naive = AdamW8bit(hyper, impl=impl)
    naive.v_map = dynamic_map(signed=False)  # plain nearest rounding for v
    unguarded = final(naive)
    big = [i for i in range(n) if i not in tiny]
    assert torch.allclose(guarded[big], ref_p.detach()[big], rtol=1e-5)
    for i in tiny:
        assert 0 < -guarded[i] <= -ref_p[i]
        assert -unguarded[i] > 2 * -ref_p[i]  # what the guard prevents


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="betas"):
        AdamW8bit(OptimizerHyper(betas=(1.0, 0.9)))
    with pytest.raises(ValueError, match="eps"):
        AdamW8bit(OptimizerHyper(eps=0.0))
    with pytest.raises(ValueError, match="multiple of the block size"):
        AdamW8bit(OptimizerHyper(), chunk=1000)
    opt = AdamW8bit(OptimizerHyper())
    with pytest.raises(ValueError, match="1-based"):
        opt.step(torch.zeros(2), torch.zeros(2), _state(opt, 2), lr=1e-3, count=0, groups=[])
    with pytest.raises(ValueError, match="state_layout"):
        opt.step(torch.zeros(2), torch.zeros(2), {"exp_avg": torch.zeros(2)}, lr=1e-3, count=1, groups=[])
    bad = _state(opt, 2) | {"exp_avg_absmax": torch.zeros(1, dtype=torch.float16)}
    with pytest.raises(ValueError, match="exp_avg_absmax"):
        opt.step(torch.zeros(2), torch.zeros(2), bad, lr=1e-3, count=1, groups=[])


def test_registered_below_layer_adam():
    plugins = Plugins(entry_points=["adamw_8bit", "layer_adam"])
    reg = plugins.get("optimizer", "adamw_8bit")
    assert reg.descriptor.priority < plugins.get("optimizer", "layer_adam").descriptor.priority
    assert isinstance(reg.descriptor.factory(OptimizerHyper()), AdamW8bit)
    assert plugins.select("optimizer", None, "cpu").name == "layer_adam"  # only chosen explicitly


# --------------------------------------------------------------------------- end to end

_TINY = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def _fine_tune(optimizer: str, steps: int = 200) -> list[float]:
    cfg = TrainConfig(
        model=ModelConfig(overrides=_TINY),
        data=DataConfig(seq_len=64, batch_size=4),
        # At the demo's default 2e-3 the two runs decorrelate, and their end losses differ by up to
        # 2 % either way from that alone (measured over seeds); at 1e-3 by under 0.1 %.
        optim=OptimConfig(name=optimizer, lr=1e-3),
        engine=EngineConfig(device="cpu"),
        steps=steps,
    )
    with Trainer(cfg) as trainer:
        return trainer.fit().losses


@pytest.mark.slow
def test_fine_tunes_the_demo_model_as_well_as_layer_adam():
    """The issue's acceptance check: 200 steps, mean of the last 10 losses within 2 % of layer_adam's."""
    ref, q8 = _fine_tune("layer_adam"), _fine_tune("adamw_8bit")
    assert len(ref) == len(q8) == 200
    assert ref[0] == q8[0]  # same model, same data
    ref_end, q8_end = sum(ref[-10:]) / 10, sum(q8[-10:]) / 10
    assert ref_end < 0.85 * ref[0]  # it did learn, so the comparison means something
    assert abs(q8_end - ref_end) <= 0.02 * ref_end, (q8_end, ref_end)
