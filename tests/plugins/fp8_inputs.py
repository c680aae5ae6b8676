"""Inputs shared by the FP8 codec's and adamw_fp8's tests: parameter groups and gradients that reach
every corner of the block-scaled codes (imported as ``fp8_inputs``, beside them in tests/plugins)."""

from __future__ import annotations

import torch

from slidekit.interfaces import ParamGroupRange
from slidekit_optim.quant8 import BLOCK_SIZE


def _groups(n: int) -> list[ParamGroupRange]:
    """Decays 0.1 and 0.01, listed out of order, and (n >= 10) a tail in no group; ends off the grid."""
    if n < 4:
        return [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    a, b, c = int(n * 0.3), int(n * 0.55), n if n < 10 else int(n * 0.9)
    return [
        ParamGroupRange(start=b, stop=c, weight_decay=0.01),
        ParamGroupRange(start=0, stop=a, weight_decay=0.1),
        ParamGroupRange(start=a, stop=b, weight_decay=0.0),
    ]


def _inputs(n: int, steps: int, dtype: torch.dtype, seed: int = 0):
    """Magnitudes log-uniform over 1e-8..1e2, 5 % exact zeros, and (n > 2 blocks) block 1 always zero."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(n, generator=gen)
    scale = 10 ** torch.empty(n).uniform_(-8, 2, generator=gen)
    scale[torch.rand(n, generator=gen) < 0.05] = 0.0
    if n > 2 * BLOCK_SIZE:
        scale[BLOCK_SIZE : 2 * BLOCK_SIZE] = 0.0
    return init, [(torch.randn(n, generator=gen) * scale).to(dtype) for _ in range(steps)]
