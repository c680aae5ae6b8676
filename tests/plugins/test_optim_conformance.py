"""The bundled optimizers pass the optimizer conformance kit (``slidekit.testing.optimizers``).

Every path: the fused C++ kernel (``impl="auto"``: the kernel where it builds, torch otherwise) and
the pure-torch one. ``check_device_update`` runs on a CUDA machine only (skipped here otherwise);
there it holds the Triton kernels (or the torch path) on the GPU to the CPU's bits.
"""

from __future__ import annotations

import pytest

from slidekit.interfaces import OptimizerHyper
from slidekit.testing.optimizers import CHECKS
from slidekit_optim.adamw_8bit import AdamW8bit
from slidekit_optim.adamw_fp8 import AdamWFp8
from slidekit_optim.layer_adam import LayerAdam

HYPER = OptimizerHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

OPTIMIZERS = {
    "layer_adam-auto": lambda: LayerAdam(HYPER),
    "layer_adam-torch": lambda: LayerAdam(HYPER, impl="torch"),
    "adamw_8bit-auto": lambda: AdamW8bit(HYPER),
    "adamw_8bit-torch": lambda: AdamW8bit(HYPER, impl="torch", chunk=1024),  # chunks inside the pieces
    "adamw_fp8-auto": lambda: AdamWFp8(HYPER),  # host only: check_device_update does not apply
    "adamw_fp8-torch": lambda: AdamWFp8(HYPER, impl="torch", chunk=1024),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_conformance(optimizer, check):
    check(OPTIMIZERS[optimizer])
