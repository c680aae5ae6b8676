"""The ``momentum_sgd`` optimizer: SGD with momentum over one unit's flat FP32 master.

``torch.optim.SGD(momentum=beta, weight_decay=wd)`` per unit, with ``beta``
the first of ``OptimizerHyper.betas`` (0.9 by default) and each group's own
weight decay (L2, added to the gradient, as torch does)::

    g   = grad + wd * p
    buf = beta * buf + g
    p   = p - lr * buf

State: one FP32 buffer per parameter (4 bytes). Each line is separate torch
ops, each rounded once on any device (no ``alpha=`` arguments, which ATen
may fuse into a multiply-add on one device and not on another), so a unit
updated on the GPU gets the CPU's bits. Against ``torch.optim.SGD`` it
differs by those roundings: about 1e-7 relative.

The two capabilities every optimizer declares:

* ``device_update = True``: ``step`` is plain torch ops, so it runs on
  tensors on the compute device too, and the engine may keep units there;
* ``linear_state = True``: the buffer of parameter i is element i of
  ``buf``, so the state of parameters [a, a + m) is ``buf[a : a + m]``
  (what ``state_layout(a)`` and ``state_layout(m)`` say), and a unit
  updated piece by piece gets the bits of the unit updated whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange

__all__ = ["MomentumSGD"]


class MomentumSGD:
    """SGD with momentum and L2 weight decay per group."""

    name = "momentum_sgd"
    device_update = True  # plain torch ops: runs on the GPU too, with the CPU's results
    linear_state = True  # one buffer element per parameter

    def __init__(self, hyper: OptimizerHyper) -> None:
        self.momentum = hyper.betas[0]
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum_sgd: momentum (betas[0]) must lie in [0, 1), got {self.momentum}")

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]:
        return {"momentum_buffer": (torch.float32, numel)}

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
        buf = state["momentum_buffer"]
        g = grad.float()  # (n,): a copy for BF16 gradients; clone an FP32 one, which step must not change
        g = g.clone() if g is grad else g
        for group in groups:
            if group.weight_decay:
                span = slice(group.start, group.stop)
                g[span].add_(torch.mul(master[span], group.weight_decay))
        buf.mul_(self.momentum).add_(g)
        master.sub_(torch.mul(buf, lr))
        if lowp_out is not None:
            lowp_out.copy_(master)
