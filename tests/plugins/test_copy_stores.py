"""The BF16 copy written with streaming stores (NOTES 41): the same bits wherever the copy lies.

The fused kernels (layer_adam's fused_adam.cpp, adamw_8bit's adamw8.cpp, adamw_fp8's adamwfp8.cpp)
write a full, aligned vector of the copy with a streaming store and a partial or misaligned one with a
plain store. Here each optimizer's C++ step writes its copy into a buffer at a 32-byte boundary and
into views of one buffer at odd element offsets (every vector misaligned, the head and the tail
partial), on one and two threads, over sizes off the vector, tile and block widths: the copy, the
master and the state are the same bits each time, and the copy is the master rounded to BF16.

Run: ``pytest tests/plugins/test_copy_stores.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.adamw_8bit import AdamW8bit
from slidekit_optim.adamw_fp8 import AdamWFp8
from slidekit_optim.kernel_build import KernelUnavailable
from slidekit_optim.layer_adam import LayerAdam

OPTIMIZERS = {"layer_adam": LayerAdam, "adamw_8bit": AdamW8bit, "adamw_fp8": AdamWFp8}


def _steps(factory, n: int, threads: int, offset: int | None, steps: int = 3):
    """Master, state and copy after ``steps`` steps, the copy at ``offset`` elements into a larger buffer
    (None: a buffer of its own)."""
    try:
        opt = factory(dataclasses.replace(OptimizerHyper(weight_decay=0.1), threads=threads), impl="cpp")
    except KernelUnavailable as e:  # no compiler here: the kernels' own tests say so too
        pytest.skip(str(e))
    gen = torch.Generator().manual_seed(n)
    master = torch.randn(n, generator=gen)
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
    groups = [ParamGroupRange(start=0, stop=n // 2, weight_decay=0.1), ParamGroupRange(start=n // 2, stop=n, weight_decay=0.0)]
    if offset is None:
        copy = torch.empty(n, dtype=torch.bfloat16)
    else:
        copy = torch.empty(n + 64, dtype=torch.bfloat16)[offset : offset + n]
    for count in range(1, steps + 1):
        grad = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
        opt.step(master, grad, state, lr=1e-3, count=count, groups=groups, lowp_out=copy)
    return master, state, copy.clone()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [15, 256 * 3 + 17, 70_001])
def test_the_copy_is_the_same_bits_wherever_it_lies(name, n):
    factory = OPTIMIZERS[name]
    threads = 2 if n > 60_000 else 1
    master, state, copy = _steps(factory, n, threads, None)
    assert torch.equal(copy, master.to(torch.bfloat16)), "the copy is the master rounded to BF16"
    for offset in (1, 3, 8, 13):  # 2-26 bytes in: no 32-byte boundary where the aligned copy has one
        other_master, other_state, other_copy = _steps(factory, n, threads, offset)
        assert torch.equal(other_copy.view(torch.int16), copy.view(torch.int16)), (name, n, offset)
        assert torch.equal(other_master, master), (name, n, offset)
        for key, value in state.items():
            assert torch.equal(other_state[key], value), (name, n, offset, key)
