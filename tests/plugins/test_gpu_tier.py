"""The gpu tier: conformance on a CUDA machine; a clear refusal elsewhere."""

from __future__ import annotations

import pytest
import torch

from slidekit import Plugins
from slidekit.interfaces import TierContext
from slidekit.testing.tiers import check_tier


def test_unavailable_without_cuda_says_why():
    ok, reason = Plugins().availability("tier", "gpu")
    assert ok == torch.cuda.is_available()
    if not ok:
        assert reason == "no CUDA device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_conformance_and_mapping():
    from slidekit_tiers.gpu import GpuTier

    check_tier(lambda: GpuTier(TierContext(device=torch.device("cuda"))))
    tier = GpuTier(TierContext(device=torch.device("cuda")))
    tier.allocate("m", 16)
    region = tier.map("m")
    assert region is not None and region.is_cuda
    tier.close()
