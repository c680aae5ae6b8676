"""The ram tier passes the tier conformance checks, maps its regions, and page-locks a region only once it is
copied to or from a device."""

from __future__ import annotations

import pytest
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


class _Pages:
    """A stand-in page locker (the CPU has no cudaHostRegister): records the addresses locked."""

    def __init__(self) -> None:
        self.locked: set[int] = set()

    def register(self, ptr: int, nbytes: int) -> None:
        self.locked.add(ptr)

    def unregister(self, ptr: int) -> None:
        self.locked.remove(ptr)


def test_regions_the_cpu_alone_uses_are_never_locked():
    """Optimizer state is mapped and updated in place, and host-to-host copies need no locked pages: a
    pinning tier leaves such regions pageable (locking the Adam moments was 7.1 s of a 3B setup)."""
    pages = _Pages()
    tier = RamTier(TierContext(device=torch.device("cpu")), pin=True, pages=pages)
    try:
        tier.allocate("state", 4096)
        tier.map("state").fill_(1)
        out = torch.empty(4096, dtype=torch.uint8)
        tier.read("state", out).result()
        tier.write("state", out).result()
        assert not tier.locked("state") and pages.locked == set()
    finally:
        tier.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device copy needs a GPU")
def test_a_region_is_locked_on_its_first_device_copy_only():
    from slidekit.hostmem import registered_bytes

    before = registered_bytes()
    tier = RamTier(TierContext(device=torch.device("cuda")))
    try:
        tier.allocate("activation", 1 << 20)
        tier.allocate("state", 1 << 20)
        tier.map("state").fill_(3)
        assert not tier.locked("activation") and not tier.locked("state") and registered_bytes() == before
        src = torch.arange(1 << 18, dtype=torch.float32, device="cuda")
        tier.write("activation", src).result()
        back = torch.empty_like(src)
        tier.read("activation", back).result()
        torch.cuda.synchronize()
        assert torch.equal(back, src)
        assert tier.locked("activation") and not tier.locked("state")
        assert registered_bytes() == before + (1 << 20)
    finally:
        tier.close()
    assert registered_bytes() == before
