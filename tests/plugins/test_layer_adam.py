"""layer_adam: the fused C++ kernel and the pure-torch path agree bitwise, and both follow torch.optim.AdamW.

The kernel is built once for the module (about 30 s on 2 cores the first time,
then loaded from the torch extensions cache). Gradients span 1e-8..1e2 with
zeros and a few huge values; sizes are odd (1, 7, 4099, 1_000_003) so vector
remainders and thread splits land everywhere; ranges carry different weight
decays, and one range belongs to no group.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit.testing.asserts import assert_states_close
from slidekit_optim.layer_adam import (
    KERNEL_SOURCE,
    KernelUnavailable,
    LayerAdam,
    kernel_status,
    load_kernel,
    slidekit_optimizers,
)

HYPER = OptimizerHyper(betas=(0.9, 0.95), eps=1e-8)
LR = 1e-3


@pytest.fixture(scope="module")
def kernel():
    """The fused kernel, built (or loaded from cache) once; skipped only where no compiler/ninja exists."""
    status = kernel_status()
    if status.startswith("pure torch (no C++ compiler") or status.startswith("pure torch (ninja"):
        pytest.skip(status)
    return load_kernel()


def _groups(n: int) -> list[ParamGroupRange]:
    """Three ranges with different decays, and for n >= 10 a tail that belongs to no group."""
    if n < 4:
        return [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    a, b, c = int(n * 0.4), int(n * 0.5), n if n < 10 else int(n * 0.9)
    return [
        ParamGroupRange(start=0, stop=a, weight_decay=0.1),
        ParamGroupRange(start=b, stop=c, weight_decay=0.01),  # listed out of order on purpose
        ParamGroupRange(start=a, stop=b, weight_decay=0.0),
    ]


def _grad_scale(n: int, gen: torch.Generator) -> torch.Tensor:
    """Per-element gradient magnitudes: 1e-8..1e2, about 5% exact zeros, and where there is room a few huge."""
    scale = 10 ** torch.empty(n).uniform_(-8, 2, generator=gen)
    scale[torch.rand(n, generator=gen) < 0.05] = 0.0
    if n > 100:
        scale[torch.randperm(n, generator=gen)[:3]] = torch.tensor([1e6, 3e9, 1e15])
    return scale


def _run(impls, n: int, grad_dtype: torch.dtype, steps: int, **options):
    """``steps`` updates of one unit by each of ``impls`` on the same random gradients; see ``_updates``."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=gen)
    scale = _grad_scale(n, gen)
    grads = ((torch.randn(n, generator=gen) * scale).to(grad_dtype) for _ in range(steps))
    return _updates(impls, init, grads, _groups(n), **options)


def _updates(impls, init, grads, groups, *, threads=None, lowp=True, adamw=False):
    """Updates of the unit ``init`` by each of ``impls`` (and torch.optim.AdamW), one per gradient.

    Returns {impl: {"master", "exp_avg", "exp_avg_sq", "lowp"}}, with "adamw" when asked.
    """
    n = init.numel()
    hyper = OptimizerHyper(betas=HYPER.betas, eps=HYPER.eps, threads=threads)
    runs = {}
    for impl in impls:
        opt = LayerAdam(hyper, impl=impl)
        state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
        out = torch.empty(n, dtype=torch.bfloat16) if lowp else None
        runs[impl] = (opt, {"master": init.clone(), **state, "lowp": out})
    if adamw:  # one parameter per range, the ranges in no group without decay
        ranges = sorted((g.start, g.stop, g.weight_decay) for g in groups)
        if ranges[-1][1] < n:
            ranges.append((ranges[-1][1], n, 0.0))
        params = [torch.nn.Parameter(init[a:b].clone()) for a, b, _ in ranges]
        ref = torch.optim.AdamW(
            [{"params": [p], "weight_decay": wd} for p, (_, _, wd) in zip(params, ranges, strict=True)],
            lr=LR,
            betas=HYPER.betas,
            eps=HYPER.eps,
            foreach=False,
        )
    for t, g in enumerate(grads, 1):
        for opt, r in runs.values():
            opt.step(r["master"], g, r, lr=LR, count=t, groups=groups, lowp_out=r["lowp"])
        if adamw:
            for p, (a, b, _) in zip(params, ranges, strict=True):
                p.grad = g[a:b].float()
            ref.step()
    result = {impl: r for impl, (_, r) in runs.items()}
    assert all(opt.impl == impl for impl, (opt, _) in runs.items())
    if adamw:
        result["adamw"] = {
            "master": torch.cat([p.detach() for p in params]),
            **{k: torch.cat([ref.state[p][k] for p in params]) for k in ("exp_avg", "exp_avg_sq")},
        }
    return result


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same bits (so -0.0 differs from 0.0); otherwise say how many elements differ, where, and by how much."""
    int_view = torch.int32 if actual.element_size() == 4 else torch.int16
    differ = (actual.view(int_view) != expected.view(int_view)).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        raise AssertionError(
            f"{what}: {differ.numel()} of {actual.numel()} elements differ, first at {i}: "
            f"{actual[i].item()!r} vs {expected[i].item()!r}"
        )


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 7, 4099, 1_000_003])
def test_cpp_equals_torch_path_bitwise_and_both_follow_adamw(kernel, one_torch_thread, n, grad_dtype):
    runs = _run(("cpp", "torch"), n, grad_dtype, 100, adamw=True)
    cpp, ref, adamw = runs["cpp"], runs["torch"], runs["adamw"]
    for key in ("master", "exp_avg", "exp_avg_sq", "lowp"):
        _assert_bitwise(cpp[key], ref[key], key)
    _assert_bitwise(cpp["lowp"], cpp["master"].to(torch.bfloat16), "lowp vs master.to(bfloat16)")
    # Both paths hold the same bits (above), so comparing one with AdamW compares both.
    assert_states_close({k: cpp[k] for k in adamw}, adamw, rtol=1e-6)
    # The run must move the parameters far beyond the tolerance, or the comparison means nothing.
    start = torch.randn(n, generator=torch.Generator().manual_seed(0))
    assert (cpp["master"] - start).norm() > 1e-3 * start.norm()


def _capabilities() -> list[str]:
    """The ATen CPU capabilities this machine can run: DEFAULT, and AVX2 / AVX512 where present."""
    have = str(torch.backends.cpu.get_cpu_capability())
    ladder = ["default", "avx2", "avx512"]
    return ladder[: ladder.index(have.lower()) + 1] if have.lower() in ladder else ["default", have.lower()]


@pytest.mark.parametrize("capability", _capabilities())
def test_torch_path_bits_do_not_depend_on_the_aten_cpu_capability(kernel, tmp_path, capability):
    """ATen picks its vectorized kernels by CPU capability; the torch path (so the kernel too) is unmoved.

    The inputs are made here and handed over: torch.randn itself differs between capabilities.
    """
    n, steps = 100_003, 20
    gen = torch.Generator().manual_seed(0)
    init, scale = torch.randn(n, generator=gen), _grad_scale(n, gen)
    grads = [(torch.randn(n, generator=gen) * scale).to(torch.bfloat16) for _ in range(steps)]
    torch.save({"init": init, "grads": grads}, tmp_path / "inputs.pt")
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_layer_adam as t; "
        "print(torch.backends.cpu.get_cpu_capability()); torch.set_num_threads(1); "
        f"x = torch.load({str(tmp_path / 'inputs.pt')!r}); "
        f"r = t._updates(('torch',), x['init'], x['grads'], t._groups({n}))['torch']; "
        f"torch.save(r, {str(tmp_path / 'result.pt')!r})"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split()[0].lower() == capability, done.stdout
    theirs = torch.load(tmp_path / "result.pt")
    ours = _updates(("cpp",), init, grads, _groups(n))["cpp"]
    for key in ours:
        _assert_bitwise(ours[key], theirs[key], f"ATEN_CPU_CAPABILITY={capability}: {key}")


def test_thread_count_and_missing_output_change_nothing(kernel):
    n = 1_000_003
    base = _run(("cpp",), n, torch.bfloat16, 3)["cpp"]
    for threads in (1, 3):  # 3 is more than torch uses here: capped, still the same bits
        other = _run(("cpp",), n, torch.bfloat16, 3, threads=threads)["cpp"]
        for key in base:
            _assert_bitwise(other[key], base[key], f"threads={threads}: {key}")
    no_lowp = _run(("cpp",), n, torch.bfloat16, 3, lowp=False)["cpp"]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        _assert_bitwise(no_lowp[key], base[key], f"without lowp_out: {key}")


def test_kernel_runs_on_torchs_threads_and_honours_the_cap(kernel):
    """Every torch intra-op thread takes part (so ATen's parallel_for really runs in parallel), no more."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("torch uses one intra-op thread here: nothing to spread")
    n = 1 << 20
    p, m, v, g = torch.randn(n), torch.zeros(n), torch.zeros(n), torch.randn(n).bfloat16()

    def used(max_tasks: int) -> int:
        return kernel.fused_adamw_(
            p, g, m, v, None, False, 1.0, 0.1, 0.999, 1e-3, 1.0, 1e-8, -1e-3, max_tasks
        )

    assert used(0) == min(threads, n >> 15)
    assert used(1) == 1
    assert used(threads + 5) == min(threads, n >> 15)
    torch.set_num_threads(1)
    try:
        assert used(0) == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_converges_on_a_quadratic(kernel, impl):
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(4099, generator=gen)
    master = torch.zeros(4099)
    opt = LayerAdam(HYPER, impl=impl)
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(4099).items()}
    groups = [ParamGroupRange(start=0, stop=4099, weight_decay=0.0)]
    for t in range(1, 301):
        opt.step(master, 2 * (master - target), state, lr=1e-2, count=t, groups=groups)
    assert (master - target).norm() < 0.05 * target.norm()


# The original check, now for both paths: 100 steps of torch.optim.AdamW, two groups.
def _run_both(steps: int, grad_dtype: torch.dtype, wd: float, impl: str, lr: float = 1e-3):
    gen = torch.Generator().manual_seed(0)
    n = 1000
    init = torch.randn(n, generator=gen)
    # Two groups, like weights (decay) and norms (no decay).
    groups = [
        ParamGroupRange(start=0, stop=600, weight_decay=wd),
        ParamGroupRange(start=600, stop=n, weight_decay=0.0),
    ]
    opt = LayerAdam(OptimizerHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=wd), impl=impl)
    master = init.clone()
    state = {name: torch.zeros(numel, dtype=dt) for name, (dt, numel) in opt.state_layout(n).items()}

    ref_a = torch.nn.Parameter(init[:600].clone())
    ref_b = torch.nn.Parameter(init[600:].clone())
    ref = torch.optim.AdamW(
        [{"params": [ref_a], "weight_decay": wd}, {"params": [ref_b], "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    lowp = torch.empty(n, dtype=torch.bfloat16)
    for t in range(1, steps + 1):
        g = (torch.randn(n, generator=gen) * 10 ** torch.randint(-6, 1, (n,), generator=gen)).to(grad_dtype)
        opt.step(master, g, state, lr=lr, count=t, groups=groups, lowp_out=lowp)
        ref_a.grad, ref_b.grad = g[:600].float(), g[600:].float()
        ref.step()
    return master, torch.cat([ref_a.detach(), ref_b.detach()]), lowp


@pytest.mark.parametrize("impl", ["cpp", "torch"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adamw_over_100_steps(kernel, one_torch_thread, grad_dtype, wd, impl):
    master, ref, lowp = _run_both(100, grad_dtype, wd, impl)
    rel = ((master - ref).norm() / ref.norm()).item()
    assert rel <= 1e-6, rel
    # Not bitwise: torch's FP32 sqrt (MKL) is not correctly rounded; see the module docstring.
    assert torch.equal(lowp, master.to(torch.bfloat16))


# --------------------------------------------------------------------------- choosing the path


def test_impl_switch(kernel):
    assert LayerAdam(HYPER, impl="torch").impl == "torch"
    assert LayerAdam(HYPER, impl="cpp").impl == "cpp"
    assert LayerAdam(HYPER).impl == "cpp"  # auto, where the kernel builds
    with pytest.raises(ValueError, match="auto, cpp, torch"):
        LayerAdam(HYPER, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads"):
        LayerAdam(OptimizerHyper(threads=0))


def test_availability_says_which_path_without_building(kernel):
    (descriptor,) = slidekit_optimizers()
    ok, reason = descriptor.available()
    assert ok and reason == "fused C++ kernel (loaded)"


def test_cached_kernel_loads_without_the_build_message(kernel):
    code = "from slidekit_optim.layer_adam import load_kernel; load_kernel()"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert "building the fused CPU Adam kernel" not in done.stderr


def test_build_failure_announces_the_build_and_falls_back(tmp_path, monkeypatch, capsys, caplog):
    # Keep the failed build out of the shared extensions cache.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    broken = tmp_path / "broken_adam.cpp"
    broken.write_text('#error "deliberately broken kernel source"\n')
    assert kernel_status(broken) == "fused C++ kernel (built on first use)"  # the probe compiles nothing

    with caplog.at_level(logging.WARNING, logger="slidekit_optim.layer_adam"):
        opt = LayerAdam(HYPER, kernel_source=broken)
        assert opt.impl == "torch"
    assert "slidekit: building the fused CPU Adam kernel (first use" in capsys.readouterr().err
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "deliberately broken kernel source" in warnings[0], warnings
    assert kernel_status(broken).startswith("pure torch (building broken_adam.cpp failed")

    with pytest.raises(KernelUnavailable, match=r"impl='auto'.*impl='torch'"):
        LayerAdam(HYPER, impl="cpp", kernel_source=broken)

    # The fallback computes what the torch path computes.
    master, grad = torch.randn(999), torch.randn(999)
    state = {k: torch.zeros(c) for k, (_, c) in opt.state_layout(999).items()}
    expected, expected_state = master.clone(), {k: v.clone() for k, v in state.items()}
    groups = [ParamGroupRange(start=0, stop=999, weight_decay=0.1)]
    opt.step(master, grad, state, lr=LR, count=1, groups=groups)
    LayerAdam(HYPER, impl="torch").step(expected, grad, expected_state, lr=LR, count=1, groups=groups)
    _assert_bitwise(master, expected, "fallback master")


def test_no_compiler_means_pure_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    source = tmp_path / "fused_adam.cpp"  # a fresh path: not built in this process yet
    source.write_bytes(KERNEL_SOURCE.read_bytes())
    assert kernel_status(source).startswith("pure torch (no C++ compiler")
    with caplog.at_level(logging.WARNING, logger="slidekit_optim.layer_adam"):
        assert LayerAdam(HYPER, kernel_source=source).impl == "torch"
    assert any("no C++ compiler" in r.getMessage() for r in caplog.records)
    with pytest.raises(KernelUnavailable, match=re.escape("no C++ compiler")):
        LayerAdam(HYPER, impl="cpp", kernel_source=source)


def test_both_kernels_share_adam_common_h_and_a_change_to_it_rebuilds_both(tmp_path):
    """The per-element update, BF16 rounding and checks live once, in csrc/adam_common.h; the build's
    cache key covers the headers beside a source, so editing the shared one builds both kernels anew."""
    from slidekit_optim import kernel_build

    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for f in KERNEL_SOURCE.parent.iterdir():
        if f.suffix in (".cpp", ".h"):
            (csrc / f.name).write_bytes(f.read_bytes())
    sources = [csrc / "fused_adam.cpp", csrc / "adamw8.cpp"]
    for source in sources:
        assert '#include "adam_common.h"' in source.read_text()
    before = {s.name: kernel_build._build_spec(s).name for s in sources}  # white box: the cache key
    header = csrc / "adam_common.h"
    header.write_text(header.read_text() + "// an edit\n")
    after = {s.name: kernel_build._build_spec(s).name for s in sources}
    assert all(before[name] != after[name] for name in before), (before, after)


# --------------------------------------------------------------------------- argument checks


def test_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="betas"):
        LayerAdam(OptimizerHyper(betas=(1.0, 0.9)))
    with pytest.raises(ValueError, match="eps"):
        LayerAdam(OptimizerHyper(eps=0.0))
    opt = LayerAdam(OptimizerHyper())
    with pytest.raises(ValueError, match="1-based"):
        opt.step(
            torch.zeros(2),
            torch.zeros(2),
            {"exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)},
            lr=1e-3,
            count=0,
            groups=[],
        )


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        (
            [
                ParamGroupRange(start=0, stop=6, weight_decay=0.1),
                ParamGroupRange(start=5, stop=8, weight_decay=0),
            ],
            "overlap",
        ),
        ([ParamGroupRange(start=0, stop=9, weight_decay=0.1)], "outside"),
    ],
)
def test_rejects_bad_groups(groups, match):
    opt = LayerAdam(HYPER, impl="torch")
    state = {k: torch.zeros(c) for k, (_, c) in opt.state_layout(8).items()}
    with pytest.raises(ValueError, match=match):
        opt.step(torch.zeros(8), torch.zeros(8), state, lr=LR, count=1, groups=groups)


def test_rejects_mismatched_tensors():
    opt = LayerAdam(HYPER, impl="torch")
    state = {k: torch.zeros(c) for k, (_, c) in opt.state_layout(8).items()}
    with pytest.raises(TypeError, match=re.escape("grad must be torch.float32 or torch.bfloat16")):
        opt.step(torch.zeros(8), torch.zeros(8, dtype=torch.float16), state, lr=LR, count=1, groups=[])
    shared = torch.zeros(16)
    with pytest.raises(ValueError, match="master and exp_avg overlap"):
        state_on_master = {"exp_avg": shared[4:12], "exp_avg_sq": state["exp_avg_sq"]}
        opt.step(shared[:8], torch.zeros(8), state_on_master, lr=LR, count=1, groups=[])
    with pytest.raises(ValueError, match="lowp_out must be a flat vector of 8"):
        opt.step(
            torch.zeros(8),
            torch.zeros(8),
            state,
            lr=LR,
            count=1,
            groups=[],
            lowp_out=torch.zeros(7).bfloat16(),
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_take_the_torch_path_with_the_same_bits():
    from slidekit.interfaces import OptimizerHyper, ParamGroupRange
    from slidekit_optim.layer_adam import LayerAdam

    n = 3_000_001
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    groups = [ParamGroupRange(start=0, stop=n // 2, weight_decay=0.1)]
    opt = LayerAdam(OptimizerHyper(weight_decay=0.1), impl="torch")
    cpu = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
    dev = {k: v.cuda() for k, v in cpu.items()}
    m_cpu, m_dev = master.clone(), master.cuda()
    low_cpu, low_dev = (
        torch.empty(n, dtype=torch.bfloat16),
        torch.empty(n, dtype=torch.bfloat16, device="cuda"),
    )
    for t in range(1, 6):
        opt.step(m_cpu, grad, cpu, lr=1e-3, count=t, groups=groups, lowp_out=low_cpu)
        opt.step(m_dev, grad.cuda(), dev, lr=1e-3, count=t, groups=groups, lowp_out=low_dev)
    assert torch.equal(m_dev.cpu(), m_cpu)
    assert torch.equal(low_dev.cpu(), low_cpu)
    assert torch.equal(dev["exp_avg_sq"].cpu(), cpu["exp_avg_sq"])
