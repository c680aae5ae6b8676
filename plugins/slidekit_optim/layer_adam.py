"""The ``layer_adam`` optimizer: AdamW over one unit's flat FP32 master, on the CPU.

Per element, with ``t`` the unit's update count (``count``)::

    p <- p * (1 - lr * wd)                              (decoupled decay, per group)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

which is ``torch.optim.AdamW`` (single-tensor path) step for step, so results
match it to the last bit on the same gradients. State: two FP32 vectors,
8 bytes per parameter. The gradient may be FP32 or BF16 (upcast on the fly).

Test: ``pytest tests/plugins/test_layer_adam.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor, OptimizerHyper, ParamGroupRange

__all__ = ["LayerAdam"]


class LayerAdam:
    """AdamW with FP32 moments over a flat vector."""

    name = "layer_adam"

    def __init__(self, hyper: OptimizerHyper) -> None:
        b1, b2 = hyper.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {hyper.betas}")
        if hyper.eps <= 0:
            raise ValueError(f"eps must be > 0, got {hyper.eps}")
        self.hyper = hyper

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]:
        return {"exp_avg": (torch.float32, numel), "exp_avg_sq": (torch.float32, numel)}

    def step(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        count: int,
        groups: Sequence[ParamGroupRange],
        lowp_out: torch.Tensor | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"count is the 1-based update number, got {count}")
        b1, b2 = self.hyper.betas
        g = grad if grad.dtype == torch.float32 else grad.float()
        for grp in groups:
            if grp.weight_decay:
                master[grp.start : grp.stop].mul_(1.0 - lr * grp.weight_decay)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        step_size = lr / (1.0 - b1**count)
        denom = (v.sqrt() / (1.0 - b2**count) ** 0.5).add_(self.hyper.eps)
        master.addcdiv_(m, denom, value=-step_size)
        if lowp_out is not None:
            lowp_out.copy_(master)


@hookimpl
def slidekit_optimizers() -> Iterator[OptimizerDescriptor]:
    yield OptimizerDescriptor(
        name="layer_adam",
        factory=LayerAdam,
        priority=100,
        devices=("cpu", "cuda", "rocm"),
        description="AdamW with FP32 moments, updated per unit on the CPU",
    )
