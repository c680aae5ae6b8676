"""Conformance checks any storage tier must pass (bundled or third-party).

All at once::

    from slidekit.testing.tiers import check_tier
    check_tier(lambda: MyTier(TierContext(device=torch.device("cpu"))))

or one test per check, so pytest reports each on its own::

    from slidekit.testing.tiers import CHECKS

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check):
        check(lambda: MyTier(TierContext(device=torch.device("cpu"))))

Each check builds fresh tiers from the factory and closes them, so one
failure does not hide another. A check that needs what this machine lacks (a
CUDA device) raises ``unittest.SkipTest``: pytest reports a skip. A skip is
not a pass: ``check_tier`` runs every other check and then raises
``unittest.SkipTest`` itself, listing what was skipped and why, unless the
skipped check is allowed (``allow_skips=DEVICE_CHECKS`` on a CPU-only
machine); it returns the ``Conformance`` (``slidekit.testing.conformance``)::

    outcome = check_tier(make, allow_skips=DEVICE_CHECKS)
    assert outcome.passed and (torch.cuda.is_available() or "check_device_tensors" in outcome.skipped)

What a tier must do, beyond the ``StorageTier`` docstring:

* move bytes, not values: every dtype, arbitrary bit patterns (NaN payloads,
  signed zeros, subnormals) and odd sizes and offsets come back bit for bit;
* keep the rest of a region intact when part of it is written;
* let many reads and writes be in flight at once, including writes to
  neighbouring byte ranges of one region;
* take device tensors that queued kernels are still producing (or still
  using), ordering itself after the caller's current stream;
* copy a source before its write completes (the caller may reuse it then);
* count every byte asked for in ``stats()``;
* reject misuse, at the call or through the future: an unknown or freed
  region, a second ``allocate`` of a live name, a negative size, a transfer
  past either end of a region, a non-contiguous tensor; and keep working
  after it;
* if ``map`` returns a tensor, it aliases the region both ways.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Collection
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from slidekit.interfaces import StorageTier, TierStats
from slidekit.testing.conformance import Conformance, run_checks

__all__ = [
    "CHECKS",
    "DEVICE_CHECKS",
    "DTYPES",
    "OFFSETS",
    "SIZES",
    "TierFactory",
    "check_bit_patterns",
    "check_close_twice",
    "check_concurrent",
    "check_device_tensors",
    "check_empty_transfers",
    "check_free_and_reuse",
    "check_large_transfers",
    "check_map",
    "check_misuse_bounds",
    "check_misuse_regions",
    "check_misuse_tensors",
    "check_partial_regions",
    "check_round_trips",
    "check_stats",
    "check_tier",
]

DTYPES: tuple[torch.dtype, ...] = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)),
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
SIZES = (1, 3, 127, 4099)  # elements
OFFSETS = (0, 5, 4093)  # bytes: on a block, just past one, just short of the next
TIMEOUT_S = 60.0

TierFactory = Callable[[], StorageTier]


# --------------------------------------------------------------------------- helpers


def _random(numel: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random bytes viewed as ``dtype``: arbitrary bit patterns, NaNs included (bool: 0 or 1)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    high = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, high, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _assert_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    a, b = _bits(got), _bits(want)
    if a.shape != b.shape:
        raise AssertionError(f"{what}: {a.numel()} bytes, expected {b.numel()}")
    differ = (a != b).nonzero().flatten()
    if differ.numel():
        first = int(differ[0])
        raise AssertionError(
            f"{what}: {differ.numel()} of {a.numel()} bytes differ, first at byte {first} "
            f"(got {int(a[first])}, expected {int(b[first])})"
        )


def _done(f: Future[None], what: str = "transfer") -> None:
    if not isinstance(f, Future):
        raise AssertionError(f"{what}: tiers return concurrent.futures.Future, got {type(f).__name__}")
    f.result(timeout=TIMEOUT_S)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _put(tier: StorageTier, key: str, src: torch.Tensor, offset: int = 0) -> None:
    _done(tier.write(key, src, offset), f"{tier.name}: write {key!r} at {offset}")


def _get(tier: StorageTier, key: str, like: torch.Tensor, offset: int = 0) -> torch.Tensor:
    dst = torch.empty_like(like)
    _done(tier.read(key, dst, offset), f"{tier.name}: read {key!r} at {offset}")
    return dst


class _Tier:
    """``with _Tier(make) as tier``: a fresh tier, closed however the check ends."""

    def __init__(self, make: TierFactory) -> None:
        self.tier = make()

    def __enter__(self) -> StorageTier:
        return self.tier

    def __exit__(self, *exc: object) -> None:
        self.tier.close()


_MISUSE = (LookupError, ValueError, IndexError, RuntimeError, TypeError, OSError)


def _expect_error(
    tier: StorageTier, what: str, action: Callable[[], Any], mention: str | None = None
) -> None:
    """``action`` must fail with a usage error, when called or through the future it returns."""
    try:
        result = action()
        if isinstance(result, Future):
            result.result(timeout=TIMEOUT_S)
    except _MISUSE as e:
        if mention is not None and mention not in str(e):
            raise AssertionError(f"{tier.name}: {what}: the error does not name {mention!r}: {e}") from e
        return
    raise AssertionError(f"{tier.name}: {what} did not fail")


# --------------------------------------------------------------------------- bytes in, bytes out


def check_round_trips(make: TierFactory) -> None:
    """Every dtype at odd sizes and offsets comes back bit for bit; a source may change once written."""
    with _Tier(make) as tier:
        for i, dtype in enumerate(DTYPES):
            for j, n in enumerate(SIZES):
                for k, offset in enumerate(OFFSETS):
                    key = f"rt/{dtype}/{n}/{offset}"
                    src = _random(n, dtype, seed=1000 * i + 10 * j + k)
                    tier.allocate(key, offset + _nbytes(src) + 7)
                    _put(tier, key, src, offset)
                    keep = src.clone()
                    src.view(torch.uint8).bitwise_not_()  # the tier must have copied the bytes already
                    _assert_bits(_get(tier, key, src, offset), keep, f"{tier.name}: {key}")
                    tier.free(key)


# Bit patterns as hex words: quiet and signalling NaNs with payloads and both signs, the
# largest-payload NaN, -0.0, +inf, -inf, the smallest subnormal, the largest subnormal, the
# largest finite number, and all ones (a negative NaN).
_SPECIAL: dict[torch.dtype, tuple[torch.dtype, str]] = {
    torch.float64: (
        torch.int64,
        "7FF8000000000000 7FF0000000000001 FFF8000000000123 7FF7FFFFFFFFFFFF 8000000000000000 "
        "7FF0000000000000 FFF0000000000000 0000000000000001 000FFFFFFFFFFFFF 7FEFFFFFFFFFFFFF "
        "FFFFFFFFFFFFFFFF",
    ),
    torch.float32: (
        torch.int32,
        "7FC00000 7F800001 FFC00001 7FBFFFFF 80000000 7F800000 FF800000 00000001 007FFFFF 7F7FFFFF FFFFFFFF",
    ),
    torch.bfloat16: (torch.int16, "7FC0 7F81 FFC1 7FBF 8000 7F80 FF80 0001 007F 7F7F FFFF"),
    torch.float16: (torch.int16, "7E00 7C01 FE01 7DFF 8000 7C00 FC00 0001 03FF 7BFF FFFF"),
}


def _special(dtype: torch.dtype) -> torch.Tensor:
    int_dtype, words = _SPECIAL[dtype]
    bits = 8 * torch.empty((), dtype=int_dtype).element_size()
    values = [int(w, 16) for w in words.split()]
    signed = [v - (1 << bits) if v >= 1 << (bits - 1) else v for v in values]  # two's complement
    return torch.tensor(signed, dtype=int_dtype).view(dtype)


def check_bit_patterns(make: TierFactory) -> None:
    """Special floating-point bit patterns are moved, never canonicalised (no arithmetic on them)."""
    with _Tier(make) as tier:
        for dtype in _SPECIAL:
            src = _special(dtype).repeat(37)  # odd length
            key = f"bits/{dtype}"
            tier.allocate(key, _nbytes(src) + 3)
            _put(tier, key, src, 3)
            _assert_bits(_get(tier, key, src, 3), src, f"{tier.name}: {key}")


def check_partial_regions(make: TierFactory) -> None:
    """Writing part of a region leaves the rest intact; any sub-range reads back what was written."""
    with _Tier(make) as tier:
        size = 3 * 4096 + 123
        tier.allocate("p", size)
        model = _random(size, torch.uint8, 1)
        _put(tier, "p", model)
        patches = [(0, 1), (1, 7), (4090, 12), (4096, 4096), (100, 9000), (size - 5, 5), (8191, 2), (3, 4093)]
        for seed, (at, n) in enumerate(patches):
            patch = _random(n, torch.uint8, 100 + seed)
            _put(tier, "p", patch, at)
            model[at : at + n] = patch
            _assert_bits(_get(tier, "p", model), model, f"{tier.name}: region after patch {n} bytes at {at}")
        for at, n in [(0, size), (1, 1), (4095, 2), (777, 5000), (size - 1, 1), (12288, 123)]:
            _assert_bits(
                _get(tier, "p", model[at : at + n], at), model[at : at + n], f"{tier.name}: {n} bytes at {at}"
            )
        wide = _random(257, torch.float32, 9)  # a typed tensor into a byte range
        _put(tier, "p", wide, 4099)
        model[4099 : 4099 + _nbytes(wide)] = wide.view(torch.uint8)
        _assert_bits(_get(tier, "p", model), model, f"{tier.name}: region after a float32 write at 4099")


def check_large_transfers(make: TierFactory) -> None:
    """Transfers of several MiB at unaligned offsets, whole and in part."""
    with _Tier(make) as tier:
        n = (9 << 20) + 13
        src = _random(n, torch.uint8, 5)
        tier.allocate("big", n + 4093 + 11)
        _put(tier, "big", src, 4093)
        _assert_bits(_get(tier, "big", src, 4093), src, f"{tier.name}: {n} bytes at 4093")
        part = src[(3 << 20) + 1 : (7 << 20) + 2]
        _assert_bits(
            _get(tier, "big", part, 4093 + (3 << 20) + 1), part, f"{tier.name}: 4 MiB from the middle"
        )


# --------------------------------------------------------------------------- concurrency and devices


def check_concurrent(make: TierFactory) -> None:
    """Many transfers in flight at once: across regions, and into neighbouring ranges of one region."""
    with _Tier(make) as tier:
        srcs = [_random(1000 + 517 * k, torch.float32, seed=k) for k in range(24)]
        for k, s in enumerate(srcs):
            tier.allocate(f"c{k}", _nbytes(s))
        for f in [tier.write(f"c{k}", s) for k, s in enumerate(srcs)]:
            _done(f)
        # Reads of the first half in flight together with rewrites of the second half.
        fresh = [_random(s.numel(), torch.float32, seed=100 + k) for k, s in enumerate(srcs)]
        dsts = [torch.empty_like(s) for s in srcs]
        half = len(srcs) // 2
        futures = [tier.read(f"c{k}", dsts[k]) for k in range(half)]
        futures += [tier.write(f"c{k}", fresh[k]) for k in range(half, len(srcs))]
        for f in futures:
            _done(f)
        futures = [tier.read(f"c{k}", dsts[k]) for k in range(half, len(srcs))]
        for f in futures:
            _done(f)
        for k in range(len(srcs)):
            want = srcs[k] if k < half else fresh[k]
            _assert_bits(dsts[k], want, f"{tier.name}: concurrent region c{k}")
        # Neighbouring, unaligned byte ranges of one region written all at once.
        piece, count = 37, 300
        whole = _random(piece * count, torch.uint8, 77)
        tier.allocate("shared", piece * count)
        futures = [tier.write("shared", whole[i * piece : (i + 1) * piece], i * piece) for i in range(count)]
        for f in futures:
            _done(f)
        _assert_bits(
            _get(tier, "shared", whole), whole, f"{tier.name}: {count} concurrent neighbouring writes"
        )


def _gpu_busy() -> None:
    """Queue ~50 ms of work on the current stream, so a tier that ignores it reads or writes too early."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(100_000_000)
        return
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        a = a @ a
        a /= a.norm()


def check_device_tensors(make: TierFactory) -> None:
    """Writes from and reads into CUDA tensors, ordered after the caller's stream at call time."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA device")
    with _Tier(make) as tier:
        dev = torch.device("cuda", torch.cuda.current_device())
        n = (1 << 20) + 3
        ref = _random(n, torch.bfloat16, 7)
        ref_dev = ref.to(dev)
        tier.allocate("d", 2 * n + 4097 + 9)
        # A source still being produced when write() is called.
        src = torch.zeros(n, dtype=torch.bfloat16, device=dev)
        _gpu_busy()
        src.copy_(ref_dev)
        _put(tier, "d", src, 4097)
        _assert_bits(_get(tier, "d", ref, 4097), ref, f"{tier.name}: device source read to the host")
        # A destination still in use when read() is called: the queued fill must not land last.
        dst = torch.empty(n, dtype=torch.bfloat16, device=dev)
        _gpu_busy()
        dst.fill_(0)
        _done(tier.read("d", dst, 4097))
        _assert_bits(dst, ref, f"{tier.name}: read into a device tensor with pending work")
        # An unaligned slice of a larger device tensor: its neighbours stay untouched.
        big = torch.full((n + 10,), 1.5, dtype=torch.bfloat16, device=dev)
        _done(tier.read("d", big[3 : 3 + n], 4097))
        _assert_bits(big[3 : 3 + n], ref, f"{tier.name}: read into a device slice")
        _assert_bits(
            big[:3], torch.full((3,), 1.5, dtype=torch.bfloat16), f"{tier.name}: bytes before the slice"
        )
        _assert_bits(
            big[3 + n :], torch.full((7,), 1.5, dtype=torch.bfloat16), f"{tier.name}: bytes after it"
        )
        # Host in, device out and device in, host out, many in flight.
        srcs = [_random(4099 + k, torch.float32, 50 + k) for k in range(8)]
        for k, s in enumerate(srcs):
            tier.allocate(f"x{k}", _nbytes(s) + 1)
        futures = [tier.write(f"x{k}", s.to(dev) if k % 2 else s, 1) for k, s in enumerate(srcs)]
        for f in futures:
            _done(f)
        outs = [
            torch.empty(s.numel(), dtype=s.dtype, device=dev if k % 2 == 0 else "cpu")
            for k, s in enumerate(srcs)
        ]
        for f in [tier.read(f"x{k}", o, 1) for k, o in enumerate(outs)]:
            _done(f)
        for k, (s, o) in enumerate(zip(srcs, outs, strict=True)):
            _assert_bits(o, s, f"{tier.name}: mixed host/device region x{k}")


# --------------------------------------------------------------------------- bookkeeping


def _delta(after: TierStats, before: TierStats) -> tuple[int, int]:
    return after.bytes_written - before.bytes_written, after.bytes_read - before.bytes_read


def check_stats(make: TierFactory) -> None:
    """Counters grow by exactly the bytes asked for; allocation is reported; capacity and detail are sane."""
    with _Tier(make) as tier:
        before = tier.stats()
        tier.allocate("s", 4099)
        grown = tier.stats()
        if grown.bytes_allocated - before.bytes_allocated < 4099:
            raise AssertionError(f"{tier.name}: bytes_allocated grew by less than the 4099 bytes allocated")
        _put(tier, "s", torch.ones(100))
        _put(tier, "s", torch.ones(3, dtype=torch.float16), 4093)
        _get(tier, "s", torch.empty(1000, dtype=torch.uint8), 7)
        _get(tier, "s", torch.empty(1, dtype=torch.float64), 4091)
        written, read = _delta(tier.stats(), before)
        if (written, read) != (406, 1008):
            raise AssertionError(f"{tier.name}: counted {written} written / {read} read, expected 406 / 1008")
        after = tier.stats()
        if after.capacity is not None and after.capacity < 0:
            raise AssertionError(f"{tier.name}: negative capacity {after.capacity}")
        if not isinstance(after.detail, str):
            raise AssertionError(f"{tier.name}: stats().detail must be a str")
        tier.free("s")
        if tier.stats().bytes_allocated != before.bytes_allocated:
            raise AssertionError(f"{tier.name}: bytes_allocated did not fall back after free")


def check_free_and_reuse(make: TierFactory) -> None:
    """A freed name can be allocated again, at another size, and works like new."""
    with _Tier(make) as tier:
        for size in (4096, 10, 9000):
            tier.allocate("r", size)
            src = _random(size, torch.uint8, size)
            _put(tier, "r", src)
            _assert_bits(_get(tier, "r", src), src, f"{tier.name}: region 'r' of {size} bytes after reuse")
            tier.free("r")


def check_empty_transfers(make: TierFactory) -> None:
    """A region of 0 bytes exists; moving 0 bytes works at either end of a region."""
    with _Tier(make) as tier:
        tier.allocate("zero", 0)
        _put(tier, "zero", torch.empty(0))
        _get(tier, "zero", torch.empty(0))
        tier.allocate("ends", 8)
        _put(tier, "ends", torch.empty(0, dtype=torch.int16), 8)
        _get(tier, "ends", torch.empty(0, dtype=torch.int16), 0)
        tier.free("zero")


def check_map(make: TierFactory) -> None:
    """A tensor from ``map`` (if any) is the region: writes show through it, and its changes read back.

    Memory tiers map to host bytes; a device-memory tier maps to bytes on its device.
    """
    with _Tier(make) as tier:
        tier.allocate("m", 64)
        view = tier.map("m")
        if view is None:
            return
        if view.dtype != torch.uint8 or view.numel() != 64:
            raise AssertionError(f"{tier.name}: map() must give 64 bytes, got {view.dtype} x {view.numel()}")
        src = _random(16, torch.float32, 3)
        _put(tier, "m", src)
        _assert_bits(view.cpu(), src, f"{tier.name}: written bytes seen through map()")
        view[3:11] = 0xAB
        want = src.view(torch.uint8).clone()
        want[3:11] = 0xAB
        _assert_bits(_get(tier, "m", src), want, f"{tier.name}: bytes changed through map() read back")


def check_close_twice(make: TierFactory) -> None:
    """``close`` may be called again."""
    tier = make()
    tier.allocate("c", 8)
    tier.close()
    tier.close()


# --------------------------------------------------------------------------- misuse


def check_misuse_regions(make: TierFactory) -> None:
    """Unknown and freed regions and a second allocate of a live name fail, naming the region."""
    with _Tier(make) as tier:
        buf = torch.empty(4)
        _expect_error(tier, "reading a region never allocated", lambda: tier.read("nope", buf), "nope")
        _expect_error(tier, "writing a region never allocated", lambda: tier.write("nope", buf), "nope")
        tier.allocate("twice", 16)
        _expect_error(tier, "allocating a live region again", lambda: tier.allocate("twice", 16), "twice")
        tier.allocate("gone", 16)
        tier.free("gone")
        _expect_error(tier, "reading a freed region", lambda: tier.read("gone", buf), "gone")
        _expect_error(tier, "writing a freed region", lambda: tier.write("gone", buf), "gone")
        src = _random(4, torch.float32, 1)  # and the tier still works
        _put(tier, "twice", src)
        _assert_bits(_get(tier, "twice", src), src, f"{tier.name}: region after misuse errors")


def check_misuse_bounds(make: TierFactory) -> None:
    """Transfers that leave the region, at either end, fail; so does a negative size."""
    with _Tier(make) as tier:
        tier.allocate("small", 16)
        four = torch.zeros(4)  # 16 bytes
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("writing past the end", lambda: tier.write("small", four, 1)),
            ("reading past the end", lambda: tier.read("small", four, 1)),
            ("writing 32 bytes into 16", lambda: tier.write("small", torch.zeros(8))),
            ("reading at an offset beyond the end", lambda: tier.read("small", torch.zeros(1), 100)),
            ("writing at a negative offset", lambda: tier.write("small", torch.zeros(1), -8)),
            ("reading at a negative offset", lambda: tier.read("small", torch.zeros(1), -4)),
            ("allocating a negative size", lambda: tier.allocate("negative", -1)),
        ]
        for what, action in cases:
            _expect_error(tier, what, action)
        src = _random(4, torch.float32, 2)
        _put(tier, "small", src)
        _assert_bits(_get(tier, "small", src), src, f"{tier.name}: region after out-of-bounds errors")


def check_misuse_tensors(make: TierFactory) -> None:
    """Non-contiguous sources and destinations are rejected rather than moved wrongly."""
    with _Tier(make) as tier:
        tier.allocate("nc", 4096)
        grid = torch.zeros(8, 16)
        for name, t in (("a transposed matrix", grid.t()), ("a strided slice", torch.zeros(64)[::2])):
            _expect_error(tier, f"writing from {name}", partial(tier.write, "nc", t))
            _expect_error(tier, f"reading into {name}", partial(tier.read, "nc", t))


CHECKS: tuple[Callable[[TierFactory], None], ...] = (
    check_round_trips,
    check_bit_patterns,
    check_partial_regions,
    check_large_transfers,
    check_concurrent,
    check_device_tensors,
    check_stats,
    check_free_and_reuse,
    check_empty_transfers,
    check_map,
    check_close_twice,
    check_misuse_regions,
    check_misuse_bounds,
    check_misuse_tensors,
)


#: The checks that need a CUDA device (skipped without one).
DEVICE_CHECKS: tuple[str, ...] = ("check_device_tensors",)


def check_tier(make: TierFactory, *, allow_skips: Collection[Callable[..., Any] | str] = ()) -> Conformance:
    """Run every check against fresh tiers from ``make``; raise AssertionError on the first failure.

    A check this machine cannot run (``unittest.SkipTest``) is not a pass: once the others have run,
    ``unittest.SkipTest`` is raised naming it and why, unless it is in ``allow_skips`` (check functions
    or names, e.g. ``DEVICE_CHECKS``). Returns what passed and what was skipped.
    """
    names: list[str] = []

    def tracked() -> StorageTier:
        tier = make()
        names.append(str(getattr(tier, "name", type(tier).__name__)))
        return tier

    return run_checks(
        CHECKS, tracked, driver=lambda: f"tier {names[0]!r}" if names else "tier", allow_skips=allow_skips
    )
