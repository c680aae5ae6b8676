"""Host buffers: exact-size page-locked memory (on a GPU machine), plain memory elsewhere; locked at once
or on first use (``lock_now=False``), the bookkeeping checked on any machine through a stand-in locker."""

from __future__ import annotations

import mmap
import threading
import time

import pytest
import torch

from slidekit.hostmem import HostBuffers


def test_unpinned_buffers_are_plain_tensors():
    pool = HostBuffers(pin=False)
    t = pool.empty(1000, torch.bfloat16)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and pool.nbytes == 0
    pool.release(t)  # no-op
    pool.close()


def _registered(t: torch.Tensor) -> bool:
    """Whether CUDA knows ``t``'s memory as page-locked host memory (cudaPointerGetAttributes, via CuPy).

    (A second cudaHostRegister as a probe would leave a sticky "already registered" error behind
    for the next CUDA call, and torch's is_pinned() does not see memory registered outside its allocator.)
    """
    cupy = pytest.importorskip("cupy")
    return cupy.cuda.runtime.pointerGetAttributes(t.data_ptr()).type == 1  # cudaMemoryTypeHost


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs the CUDA driver")
def test_pinned_buffers_are_exact_size_and_async_capable():
    pool = HostBuffers(pin=True)
    sizes = [
        1,
        4097,
        77_000_003,
    ]  # odd sizes; the largest would round up to 512 MB in torch's pinned allocator
    bufs = [pool.empty(n, torch.float32) for n in sizes]
    for n, b in zip(sizes, bufs, strict=True):
        assert b.numel() == n and _registered(b)
    assert pool.nbytes <= sum(4 * n + 4096 for n in sizes)
    src = torch.randn(sizes[-1])
    bufs[-1].copy_(src)
    dev = torch.empty(sizes[-1], device="cuda")
    dev.copy_(bufs[-1], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dev.cpu(), src)
    pool.release(bufs[0])
    assert not _registered(bufs[0])
    pool.close()
    assert pool.nbytes == 0 and not _registered(bufs[-1])


class _Pages:
    """A stand-in ``PageLocker``: records what is locked; ``slow`` makes each registration take that long,
    ``fail`` makes the next one raise."""

    def __init__(self, slow: float = 0.0) -> None:
        self.locked: dict[int, int] = {}
        self.calls = 0
        self.slow, self.fail = slow, False
        self._lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self.calls += 1
        time.sleep(self.slow)
        if self.fail:
            self.fail = False
            raise RuntimeError("page-locking failed (stand-in)")
        assert ptr % mmap.PAGESIZE == 0 and nbytes % mmap.PAGESIZE == 0, "whole pages only"
        assert ptr not in self.locked, "locked twice"
        self.locked[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        assert ptr in self.locked, "unlocking memory that was never locked"
        del self.locked[ptr]


def test_a_buffer_allocated_unlocked_is_locked_once_on_first_use_and_released_right():
    pages = _Pages()
    pool = HostBuffers(pin=True, pages=pages)
    now = pool.empty(1000, torch.float32)  # locked at once, as before
    later = pool.empty(4097, torch.uint8, lock_now=False)
    never = pool.empty(77, torch.bfloat16, lock_now=False)
    assert pool.locked(now) and not pool.locked(later) and not pool.locked(never)
    assert pool.nbytes == 4096 and len(pages.locked) == 1
    later.fill_(7)  # ordinary memory until then
    pool.lock(later)
    pool.lock(later)  # a second lock is a no-op
    assert pool.locked(later) and pages.calls == 2 and pool.nbytes == 4096 + 8192
    assert later.numel() == 4097 and int(later.sum()) == 7 * 4097
    pool.release(never)  # never locked: nothing to unregister
    pool.release(later)
    assert not pool.locked(later) and pool.nbytes == 4096 and len(pages.locked) == 1
    pool.close()
    assert pool.nbytes == 0 and pages.locked == {}
    with pytest.raises(ValueError, match="not a buffer of this pool"):
        HostBuffers(pin=True, pages=_Pages()).lock(torch.empty(3))


def test_threads_locking_one_buffer_lock_it_once_and_all_return_after_it():
    pages = _Pages(slow=0.05)
    pool = HostBuffers(pin=True, pages=pages)
    buf = pool.empty(10_000, torch.float32, lock_now=False)
    seen = []

    def use() -> None:
        pool.lock(buf)
        seen.append(pool.locked(buf))  # nobody goes on before the lock is there

    threads = [threading.Thread(target=use) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == [True] * 6 and pages.calls == 1
    pool.close()


def test_a_failed_lock_raises_leaves_the_buffer_usable_and_can_be_tried_again():
    pages = _Pages()
    pool = HostBuffers(pin=True, pages=pages)
    buf = pool.empty(100, torch.float32, lock_now=False)
    pages.fail = True
    with pytest.raises(RuntimeError, match="page-locking failed"):
        pool.lock(buf)
    assert not pool.locked(buf) and pool.nbytes == 0
    pool.lock(buf)
    assert pool.locked(buf)
    pages.fail = True
    with pytest.raises(RuntimeError, match="page-locking failed"):
        pool.empty(100, torch.float32)  # locked at once: the failure drops the buffer again
    pool.close()
    assert pages.locked == {}


def test_a_thread_waiting_for_a_stuck_lock_gives_up_naming_it(monkeypatch):
    import slidekit.hostmem as hostmem

    release = threading.Event()

    inside = threading.Event()

    class Stuck(_Pages):
        def register(self, ptr: int, nbytes: int) -> None:
            inside.set()
            release.wait(10)
            super().register(ptr, nbytes)

    monkeypatch.setattr(hostmem, "LOCK_WAIT_S", 0.2)
    pool = HostBuffers(pin=True, pages=Stuck())
    buf = pool.empty(1000, torch.float32, lock_now=False)
    first = threading.Thread(target=pool.lock, args=(buf,))
    first.start()
    assert inside.wait(10)  # the first thread is inside register
    with pytest.raises(TimeoutError, match="page-locking a 4000 byte host buffer took over 0 s"):
        pool.lock(buf)
    release.set()
    first.join(timeout=10)
    assert pool.locked(buf)
    pool.close()
