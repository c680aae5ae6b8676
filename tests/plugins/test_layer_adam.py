"""layer_adam against torch.optim.AdamW: same updates on the same gradients, step after step."""

from __future__ import annotations

import pytest
import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.layer_adam import LayerAdam


def _run_both(steps: int, grad_dtype: torch.dtype, wd: float, lr: float = 1e-3):
    gen = torch.Generator().manual_seed(0)
    n = 1000
    init = torch.randn(n, generator=gen)
    # Two groups, like weights (decay) and norms (no decay).
    groups = [
        ParamGroupRange(start=0, stop=600, weight_decay=wd),
        ParamGroupRange(start=600, stop=n, weight_decay=0.0),
    ]
    opt = LayerAdam(OptimizerHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=wd))
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


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_adamw_over_100_steps(grad_dtype, wd):
    master, ref, lowp = _run_both(100, grad_dtype, wd)
    rel = ((master - ref).norm() / ref.norm()).item()
    assert rel <= 1e-6, rel
    assert torch.equal(master, ref)  # same formula, same order: bitwise in fact
    assert torch.equal(lowp, master.to(torch.bfloat16))


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
