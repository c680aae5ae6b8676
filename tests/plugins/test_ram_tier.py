"""The ram tier passes the tier conformance checks and maps its regions."""

from __future__ import annotations

import torch

from slidekit.interfaces import TierContext
from slidekit.testing.tiers import DEVICE_CHECKS, check_tier
from slidekit_tiers.ram import RamTier


def _make() -> RamTier:
    return RamTier(TierContext(device=torch.device("cuda" if torch.cuda.is_available() else "cpu")))


def test_conformance():
    outcome = check_tier(_make, allow_skips=DEVICE_CHECKS)  # on a CUDA machine the device checks run
    assert set(outcome.skipped) == (set() if torch.cuda.is_available() else set(DEVICE_CHECKS))


def test_regions_map_in_place():
    tier = _make()
    try:
        tier.allocate("m", 16)
        view = tier.map("m")
        assert view is not None and view.numel() == 16
        view.view(torch.float32).copy_(torch.arange(4.0))
        out = torch.empty(4)
        tier.read("m", out).result()
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        tier.close()


def test_says_whether_it_pins():
    tier = _make()
    try:
        assert tier.pin == torch.cuda.is_available()
        assert ("pinned" in tier.stats().detail) == tier.pin
    finally:
        tier.close()
