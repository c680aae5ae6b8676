"""slidekit.tierkit: byte views, counters, ordered copies, and a worker pool whose close never hangs.

The bundled tiers' close() used to wait for their I/O threads without limit (``shutdown(wait=True)``),
so one read stuck on a hung disk hung the run's shutdown forever. Now ``IoPool.close`` waits at most
``TierContext.close_timeout_s``, warns naming the tier and leaves the stuck thread behind. The stuck
task in these tests waits on an event that only the test sets (after close returned), so what they
check never depends on timing; a watchdog sets it after 30 s, so the old code fails (no warning)
instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError

import numpy as np
import pytest
import torch

from slidekit.interfaces import StorageTier, TierContext, TierStats
from slidekit.testing.tiers import _gpu_busy
from slidekit.tierkit import Counters, IoPool, StreamCopier, byte_view, caller_ready
from slidekit_tiers.gds import GdsTier
from slidekit_tiers.posix import PosixTier
from slidekit_tiers.ram import RamTier

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WATCHDOG_S = 30.0


# --------------------------------------------------------------------------- byte views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int16, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5)])
def test_byte_view_is_the_tensors_bytes_without_a_copy(dtype, shape):
    t = (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * 1.37 - 3).to(dtype)
    view = byte_view(t)
    assert view.dtype == torch.uint8 and view.dim() == 1
    assert view.numel() == t.numel() * t.element_size()
    if t.numel():
        assert view.data_ptr() == t.data_ptr()
    assert bytes(view.numpy()) == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_byte_view_of_a_slice_starts_at_the_slice():
    base = torch.arange(100, dtype=torch.int32)
    view = byte_view(base[10:20])
    assert view.numel() == 40 and view.data_ptr() == base.data_ptr() + 40
    view[:4] = 0xFF  # a view: writing through it changes the tensor
    assert int(base[10]) == -1


def test_byte_view_detaches_from_autograd():
    t = torch.ones(4, requires_grad=True)
    view = byte_view(t)
    assert not view.requires_grad and view.numel() == 16


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ([1, 2, 3], TypeError, "storage tiers move torch tensors, got list"),
        (torch.zeros(4, 4).t(), ValueError, r"contiguous tensors only; call \.contiguous\(\) first"),
        (torch.zeros(8)[::2], ValueError, r"contiguous tensors only; call \.contiguous\(\) first"),
        (torch.zeros(4, device="meta"), ValueError, r"cpu or cuda tensors, got a tensor on meta; move it"),
    ],
    ids=["list", "transposed", "strided", "meta"],
)
def test_byte_view_refuses_what_a_tier_must_not_move_naming_the_fix(value, error, message):
    with pytest.raises(error, match=message):
        byte_view(value)


# --------------------------------------------------------------------------- counters


def test_counters_count_exactly_from_many_threads():
    counters = Counters()
    per_thread, threads = 2000, 8

    def work(k: int) -> None:
        for i in range(per_thread):
            counters.add(written=k + 1) if i % 2 else counters.add(read=k + 1)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    each = sum(k + 1 for k in range(threads)) * per_thread // 2
    assert (counters.written, counters.read) == (each, each)
    assert counters.stats(allocated=123, capacity=None, detail="d") == TierStats(
        bytes_written=each, bytes_read=each, bytes_allocated=123, capacity=None, detail="d"
    )


def test_counters_only_grow():
    with pytest.raises(ValueError, match="byte counts only grow: got written=-1, read=0"):
        Counters().add(written=-1)


# --------------------------------------------------------------------------- ordered copies


def test_host_copies_need_no_event_and_copy_at_once():
    src, dst = torch.arange(1000, dtype=torch.float32), torch.zeros(1000)
    ready = caller_ready(dst, src)
    assert ready is None
    StreamCopier().copy(byte_view(dst), byte_view(src), ready)
    assert torch.equal(dst, src)


@requires_cuda
def test_device_copies_wait_for_the_callers_stream():
    """A source still being produced, and a destination still in use, on a side stream of the caller."""
    copier = StreamCopier()
    n = 1 << 22
    want = torch.randn(n)
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        src = torch.zeros(n, device="cuda")
        _gpu_busy()  # ~50 ms of queued work before the source is filled
        src.copy_(want.cuda())
        ready = caller_ready(src)
    out = torch.empty(n).pin_memory()
    worker = threading.Thread(target=copier.copy, args=(out, src, ready))
    worker.start()
    worker.join(timeout=WATCHDOG_S)
    assert torch.equal(out, want)
    got = []  # one side stream per thread (both alive at once) and device
    barrier = threading.Barrier(2)

    def grab() -> None:
        got.append(copier.stream(src.device))
        barrier.wait(timeout=WATCHDOG_S)

    pair = [threading.Thread(target=grab) for _ in range(2)]
    for t in pair:
        t.start()
    for t in pair:
        t.join(timeout=WATCHDOG_S)
    assert len(got) == 2 and got[0] is not got[1]
    assert copier.stream(src.device) is copier.stream(src.device)


# --------------------------------------------------------------------------- the worker pool


@contextlib.contextmanager
def _gate() -> Iterator[threading.Event]:
    """An event the stuck task waits on: set by the test, or by a watchdog so nothing hangs forever."""
    gate = threading.Event()
    watchdog = threading.Timer(WATCHDOG_S, gate.set)
    watchdog.start()
    try:
        yield gate
    finally:
        gate.set()
        watchdog.cancel()


def _threads(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]


def test_pool_runs_work_on_named_threads_and_close_joins_them():
    before = set(_threads("slidekit-kit_a"))
    pool = IoPool(3, tier="kit_a", timeout_s=5.0)
    names = [
        pool.submit(lambda: threading.current_thread().name).result(timeout=WATCHDOG_S) for _ in range(5)
    ]
    assert all(n.startswith("slidekit-kit_a") for n in names)
    assert pool.submit(pow, 2, 10).result(timeout=WATCHDOG_S) == 1024
    assert pool.close() is True
    assert [t for t in _threads("slidekit-kit_a") if t not in before] == []
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_pool_close_gives_up_on_stuck_work_with_a_warning_naming_the_tier():
    pool = IoPool(1, tier="kit_b", timeout_s=0.05)
    with _gate() as gate:
        stuck = pool.submit(gate.wait)
        queued = pool.submit(pow, 2, 3)  # behind the stuck task on the only worker
        with pytest.warns(
            RuntimeWarning, match=r"closing the kit_b tier: 1 I/O task\(s\) still running after 0.05 s"
        ):
            assert pool.close() is False
        assert not gate.is_set(), "the watchdog released the task: close() waited for it"
        assert queued.cancelled()
        assert not stuck.done()
        gate.set()
        assert stuck.result(timeout=WATCHDOG_S) is True  # the stuck thread finishes on its own later


def test_pool_refuses_a_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match="the kit_c tier's close timeout must be > 0 seconds, got 0"):
        IoPool(1, tier="kit_c", timeout_s=0)


def test_tier_context_refuses_a_close_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match=r"TierContext.close_timeout_s must be > 0 seconds, got -1"):
        TierContext(device=torch.device("cpu"), close_timeout_s=-1)


# --------------------------------------------------------------------------- the bundled tiers


class _NoFile:
    """A kvikio CuFile stand-in that is never read or written here."""

    def __init__(self, path: str, mode: str) -> None:
        self.fd = os.open(path, os.O_RDWR)

    def close(self) -> None:
        os.close(self.fd)


TIERS: dict[str, Callable[[TierContext], StorageTier]] = {
    "ram": RamTier,
    "posix": PosixTier,
    "gds": lambda ctx: GdsTier(ctx, kvikio=types.SimpleNamespace(CuFile=_NoFile, __version__="stand-in")),
}


@pytest.mark.parametrize("name", list(TIERS))
def test_a_tier_with_stuck_io_closes_with_a_warning_instead_of_hanging(name, tmp_path):
    """Regression: close() used to wait forever for a stuck I/O thread."""
    ctx = TierContext(device=torch.device("cpu"), directory=str(tmp_path), io_threads=1, close_timeout_s=0.05)
    tier = TIERS[name](ctx)
    tier.allocate("r", 64)
    with _gate() as gate:
        tier._pool.submit(gate.wait)  # white box: its only worker is stuck, as on a hung disk
        queued = tier.write("r", torch.ones(16))
        with pytest.warns(RuntimeWarning, match=rf"closing the {name} tier: 1 I/O task\(s\) still running"):
            tier.close()
        assert not gate.is_set(), "the watchdog released the task: close() waited for it"
        with pytest.raises(CancelledError):  # the transfer behind it fails instead of waiting forever
            queued.result(timeout=WATCHDOG_S)
        if name != "ram":
            assert os.listdir(tier.root), "files a stuck task may use were removed under it"
    if name != "ram":
        tier._files.close()  # white box: what the finalizer does at exit


@pytest.mark.parametrize("name", list(TIERS))
def test_a_tier_closes_and_joins_its_threads_when_nothing_is_stuck(name, tmp_path):
    ctx = TierContext(device=torch.device("cpu"), directory=str(tmp_path), io_threads=2)
    before = set(_threads(f"slidekit-{name}"))
    tier = TIERS[name](ctx)
    tier.allocate("r", 64)
    if name != "gds":  # the stand-in moves nothing
        tier.write("r", torch.ones(16)).result(timeout=WATCHDOG_S)
    tier.close()
    assert [t for t in _threads(f"slidekit-{name}") if t not in before] == []


# --------------------------------------------------------------------------- the module's example


def test_the_example_tier_in_the_module_docstring_passes_the_tier_checks():
    import textwrap

    import slidekit.tierkit
    from slidekit.testing.tiers import DEVICE_CHECKS, check_tier

    doc = slidekit.tierkit.__doc__
    assert doc is not None
    block = doc.split("exactly this code)::\n", 1)[1].split("\nThe bundled", 1)[0]
    namespace: dict[str, object] = {}
    exec(textwrap.dedent(block), namespace)
    my_tier = namespace["MyTier"]
    make = lambda: my_tier(TierContext(device=torch.device("cpu")))  # type: ignore[operator]  # noqa: E731
    assert check_tier(make, allow_skips=DEVICE_CHECKS).driver == "tier 'my_tier'"
