"""Conformance checks any storage tier must pass (bundled or third-party).

    from slidekit.testing.tiers import check_tier
    check_tier(lambda: MyTier(TierContext(device=torch.device("cpu"))))

Each check builds a fresh tier, so one failure does not hide another. They
cover: bitwise round trips of every dtype at odd sizes and offsets; many
reads and writes in flight at once; reads into and writes from device
tensors when a GPU is present; the byte counters; and errors on misuse.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from slidekit.interfaces import StorageTier

__all__ = ["DTYPES", "check_tier"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.int8)
SIZES = (1, 3, 127, 4099)

TierFactory = Callable[[], StorageTier]


def _random(numel: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (numel * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen
    )
    return raw.view(dtype).to(device)  # arbitrary bit patterns, NaNs included: tiers move bytes


def _done(f: Future[None]) -> None:
    f.result(timeout=60)


def check_round_trips(make: TierFactory) -> None:
    tier = make()
    try:
        for i, dtype in enumerate(DTYPES):
            for j, n in enumerate(SIZES):
                key = f"rt/{dtype}/{n}"
                src = _random(n, dtype, seed=100 * i + j)
                nbytes = src.numel() * src.element_size()
                tier.allocate(key, nbytes + 16)
                _done(tier.write(key, src, offset=16))
                dst = torch.empty_like(src)
                _done(tier.read(key, dst, offset=16))
                assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8)), (
                    f"{tier.name}: {key} not bitwise equal"
                )
                tier.free(key)
    finally:
        tier.close()


def check_partial_regions(make: TierFactory) -> None:
    tier = make()
    try:
        tier.allocate("p", 64)
        a, b = _random(8, torch.float32, 1), _random(8, torch.float32, 2)
        _done(tier.write("p", a, offset=0))
        _done(tier.write("p", b, offset=32))
        whole = torch.empty(16, dtype=torch.float32)
        _done(tier.read("p", whole))
        assert torch.equal(whole[:8].view(torch.uint8), a.view(torch.uint8)), f"{tier.name}: first half lost"
        assert torch.equal(whole[8:].view(torch.uint8), b.view(torch.uint8)), f"{tier.name}: second half lost"
    finally:
        tier.close()


def check_concurrent(make: TierFactory) -> None:
    tier = make()
    try:
        srcs = [_random(1000 + k, torch.float32, seed=k) for k in range(16)]
        for k, s in enumerate(srcs):
            tier.allocate(f"c{k}", s.numel() * 4)
        for f in [tier.write(f"c{k}", s) for k, s in enumerate(srcs)]:
            _done(f)
        dsts = [torch.empty_like(s) for s in srcs]
        for f in [tier.read(f"c{k}", d) for k, d in enumerate(dsts)]:
            _done(f)
        for k, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
            assert torch.equal(s.view(torch.uint8), d.view(torch.uint8)), (
                f"{tier.name}: concurrent region c{k} differs"
            )
    finally:
        tier.close()


def check_device_tensors(make: TierFactory) -> None:
    if not torch.cuda.is_available():
        return
    tier = make()
    try:
        src = _random(12345, torch.bfloat16, 7, device="cuda")
        tier.allocate("d", src.numel() * 2)
        _done(tier.write("d", src))
        dst = torch.full_like(src, 0)
        _done(tier.read("d", dst))
        assert torch.equal(dst.view(torch.int16), src.view(torch.int16)), (
            f"{tier.name}: device round trip differs"
        )
    finally:
        tier.close()


def check_stats(make: TierFactory) -> None:
    tier = make()
    try:
        before = tier.stats()
        tier.allocate("s", 400)
        _done(tier.write("s", torch.ones(100)))
        _done(tier.read("s", torch.empty(100)))
        after = tier.stats()
        assert after.bytes_written - before.bytes_written == 400, f"{tier.name}: bytes_written not counted"
        assert after.bytes_read - before.bytes_read == 400, f"{tier.name}: bytes_read not counted"
        assert after.bytes_allocated >= 400
    finally:
        tier.close()


def check_misuse(make: TierFactory) -> None:
    tier = make()
    try:
        for action in (
            lambda: _done(tier.read("never-allocated", torch.empty(4))),
            lambda: _done(tier.write("never-allocated", torch.empty(4))),
        ):
            try:
                action()
            except (KeyError, ValueError, RuntimeError):
                pass
            else:
                raise AssertionError(f"{tier.name}: using a region that was never allocated did not fail")
        tier.allocate("small", 8)
        try:
            _done(tier.write("small", torch.zeros(4)))  # 16 bytes into 8
        except (ValueError, RuntimeError):
            pass
        else:
            raise AssertionError(f"{tier.name}: writing past the end of a region did not fail")
    finally:
        tier.close()


CHECKS = (
    check_round_trips,
    check_partial_regions,
    check_concurrent,
    check_device_tensors,
    check_stats,
    check_misuse,
)


def check_tier(make: TierFactory) -> None:
    """Run every check against fresh tiers from ``make``; raise AssertionError on the first failure."""
    for check in CHECKS:
        check(make)
