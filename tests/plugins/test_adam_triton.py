"""layer_adam's fused Triton update for GPU-resident units: bitwise the C++ kernel's results.

One file, two modes, as tests/plugins/test_triton_kernels.py:

* On a GPU the kernel is compiled: random units (odd sizes, decayed and
  undecayed ranges, BF16 and FP32 gradients, gradients from 1e-8 to 1e15 and
  exact zeros) are updated five steps on the GPU through ``LayerAdam.step``
  and on the CPU by the fused C++ kernel; master, both moments and the BF16
  copy must be bitwise equal.
* Without a GPU, ``test_interpreted_run`` runs this file again in a subprocess
  with ``TRITON_INTERPRET=1``, where the kernel runs on CPU tensors and its
  FP32 outputs must equal the pure-torch path bitwise (the interpreter
  truncates FP32 -> BF16 casts, so the BF16 copy may differ by one unit in the
  last place there).

Run: ``pytest tests/plugins/test_adam_triton.py`` (about 20 s interpreted on 2 cores).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import HAVE_TRITON, INTERPRETED, ON_GPU, rerun_interpreted

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.layer_adam import LayerAdam, kernel_status

HYPER = OptimizerHyper(betas=(0.9, 0.95), eps=1e-8)

needs_kernel = pytest.mark.skipif(
    not HAVE_TRITON or not (INTERPRETED or ON_GPU),
    reason="no GPU: test_interpreted_run runs these under the Triton interpreter",
)

SIZES = (1, 1023, 1025, 70_001) if INTERPRETED else (1, 1023, 4099, 3_000_001)


def _groups(n: int) -> list[ParamGroupRange]:
    """Two decays and, for n >= 10, a tail in no group (so a range without decay)."""
    if n < 10:
        return [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    return [
        ParamGroupRange(start=0, stop=n // 3, weight_decay=0.1),
        ParamGroupRange(start=n // 3, stop=(9 * n) // 10, weight_decay=0.0),
    ]


def _unit(n: int, grad_dtype: torch.dtype, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    grads = []
    for _ in range(steps):
        scale = 10 ** torch.empty(n).uniform_(-8, 2, generator=gen)
        scale[torch.rand(n, generator=gen) < 0.05] = 0.0
        if n > 100:
            scale[:3] = torch.tensor([1e6, 3e9, 1e15])
        grads.append((torch.randn(n, generator=gen) * scale).to(grad_dtype))
    return master, grads


def _run(opt: LayerAdam, master: torch.Tensor, grads, groups, device: str):
    n = master.numel()
    state = {k: torch.zeros(c, dtype=dt, device=device) for k, (dt, c) in opt.state_layout(n).items()}
    p = master.clone().to(device)
    low = torch.empty(n, dtype=torch.bfloat16, device=device)
    for t, g in enumerate(grads, 1):
        opt.step(p, g.to(device), state, lr=1e-3, count=t, groups=groups, lowp_out=low)
    return {"master": p.cpu(), **{k: v.cpu() for k, v in state.items()}, "lowp": low.cpu()}


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str, ulps: int = 0) -> None:
    int_view = torch.int32 if actual.element_size() == 4 else torch.int16
    diff = (actual.view(int_view).long() - expected.view(int_view).long()).abs()
    bad = (diff > ulps).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.numel()} of {actual.numel()} elements differ by more than {ulps} ulp, first at "
            f"{i}: {actual[i].item()!r} vs {expected[i].item()!r}"
        )


@needs_kernel
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fused_update_is_bitwise_the_cpu_kernel(n, grad_dtype):
    master, grads = _unit(n, grad_dtype, steps=5 if ON_GPU else 3)
    groups = _groups(n)
    if ON_GPU:
        if kernel_status().startswith("pure torch"):
            pytest.skip(kernel_status())
        expected = _run(LayerAdam(HYPER, impl="cpp"), master, grads, groups, "cpu")
        actual = _run(LayerAdam(HYPER), master, grads, groups, "cuda")
        low_ulps = 0
    else:  # interpreted: the kernel itself on CPU tensors against the torch path
        from slidekit_optim import adam_triton
        from slidekit_optim.layer_adam import _scalars, _segments

        expected = _run(LayerAdam(HYPER, impl="torch"), master, grads, groups, "cpu")
        n = master.numel()
        p, m, v = master.clone(), torch.zeros(n), torch.zeros(n)
        low = torch.empty(n, dtype=torch.bfloat16)
        for t, g in enumerate(grads, 1):
            s = _scalars(HYPER, 1e-3, t)
            for a, b, decay in _segments(groups, n, 1e-3):
                adam_triton.fused_adamw_(
                    p[a:b], g[a:b], m[a:b], v[a:b], low[a:b], decay,
                    s.w1, s.beta2, s.sq_weight, s.inv_b2, s.eps, s.neg_step,
                )  # fmt: skip
        actual = {"master": p, "exp_avg": m, "exp_avg_sq": v, "lowp": low}
        low_ulps = 1
    for key in ("master", "exp_avg", "exp_avg_sq"):
        _assert_bitwise(actual[key], expected[key], key)
    _assert_bitwise(actual["lowp"], expected["lowp"], "lowp", ulps=low_ulps)


@needs_kernel
def test_without_a_copy_or_decay_only_the_master_and_moments_change():
    n = 5000
    master, grads = _unit(n, torch.bfloat16, steps=1, seed=3)
    device = "cuda" if ON_GPU else "cpu"
    from slidekit_optim import adam_triton

    p = master.clone().to(device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    adam_triton.fused_adamw_(
        p, grads[0].to(device), m, v, None, None, 0.1, 0.95, 0.05, 1 / 0.05**0.5, 1e-8, -1e-2
    )
    g = grads[0].float()
    m_ref = 0.1 * g
    v_ref = 0.05 * g * g
    p_ref = master - 1e-2 * m_ref / (v_ref.sqrt() / 0.05**0.5 + 1e-8)
    torch.testing.assert_close(m.cpu(), m_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(v.cpu(), v_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(p.cpu(), p_ref, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_torch_impl_keeps_the_torch_path_on_the_gpu_with_the_same_bits():
    n = 100_003
    master, grads = _unit(n, torch.bfloat16, steps=3, seed=1)
    groups = _groups(n)
    fused = _run(LayerAdam(HYPER), master, grads, groups, "cuda")
    plain = _run(LayerAdam(HYPER, impl="torch"), master, grads, groups, "cuda")
    for key in fused:
        _assert_bitwise(fused[key], plain[key], key)


@pytest.mark.skipif(INTERPRETED or ON_GPU or not HAVE_TRITON, reason="the outer CPU run starts it")
def test_interpreted_run():
    proc = rerun_interpreted(__file__)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout and "failed" not in proc.stdout
