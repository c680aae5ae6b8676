"""Host buffers for transfers: page-locked at their exact size, now or on first use.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every request up to a power of two: a 308 MB layer
master takes 512 MB, and a model's host memory grows by up to 2x. A
``HostBuffers`` pool instead allocates ordinary memory and page-locks it in
place with ``cudaHostRegister``, so a buffer costs its size (plus at most two
pages) and copies to and from it are still truly asynchronous.

Page-locking is not free: ``cudaHostRegister`` touches every page, so
locking the Adam moments of a 3B model (24.7 GB) took 7.1 s of its 14.2 s
setup (docs/benchmarks/NOTES.md 34), for memory that only the CPU ever
reads. ``empty(..., lock_now=False)`` hands out a buffer that is
page-aligned but locked only when ``lock`` is called, by whoever is about to
copy it to or from a device (the ram tier, on a region's first device
transfer); a buffer never copied is never locked. Until then it is ordinary
pageable memory, which copies correctly, only synchronously.

The pool keeps every buffer alive until it is released, and unregisters
before letting go, so no freed memory ever stays registered. Registration
only happens with ``pin=True``; otherwise buffers are plain pageable memory.
Owners (the host store, the ram tier) release theirs when they close. The
CUDA calls go through a ``PageLocker`` (``pages=``), so the bookkeeping runs
on the CPU too, with a stand-in.

Test: ``pytest tests/test_hostmem.py`` (the CUDA registration on a GPU machine, the bookkeeping everywhere).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from typing import Protocol

import torch

__all__ = ["CudaPages", "HostBuffers", "PageLocker", "registered_bytes"]

_PAGE = mmap.PAGESIZE
#: How long a thread waits for another's page-locking of the same buffer (a 10 GiB region locks in ~3 s).
LOCK_WAIT_S = 300.0
_REGISTERED = [0]  # bytes page-locked by every pool of this process, for leak checks


def registered_bytes() -> int:
    """Bytes currently page-locked through ``HostBuffers`` in this process (0 once every owner closed)."""
    return _REGISTERED[0]


def _cuda_call(code: object, what: str) -> None:
    value = getattr(code, "value", code)
    if value != 0:
        raise RuntimeError(
            f"{what} failed with CUDA error {value}; the host may be out of lockable memory "
            "(check `ulimit -l` and free RAM)"
        )


class PageLocker(Protocol):
    """Page-locks (and unlocks) host memory for a device's copies: ``cudaHostRegister`` and its undo."""

    def register(self, ptr: int, nbytes: int) -> None: ...

    def unregister(self, ptr: int) -> None: ...


class CudaPages:
    """``PageLocker`` through the CUDA runtime."""

    def register(self, ptr: int, nbytes: int) -> None:
        _cuda_call(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0), f"page-locking {nbytes} bytes")

    def unregister(self, ptr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _unregister_all(ptrs: dict[int, torch.Tensor], pages: PageLocker) -> None:
    for ptr, raw in list(ptrs.items()):
        pages.unregister(ptr)
        _REGISTERED[0] -= raw.numel() - _PAGE
    ptrs.clear()


class HostBuffers:
    """Allocates host tensors, page-locked at their exact size when ``pin`` is set (at once, or on ``lock``)."""

    def __init__(self, *, pin: bool, pages: PageLocker | None = None) -> None:
        self.pin = pin
        self._pages = pages if pages is not None else CudaPages()
        self._lock = threading.Lock()
        self._live: dict[int, torch.Tensor] = {}  # registered address -> the raw allocation behind it
        self._unlocked: dict[int, torch.Tensor] = {}  # address of a buffer not locked yet -> its allocation
        self._locking: dict[int, threading.Event] = {}  # address being locked -> set when that is over
        self._owner: dict[int, int] = {}  # data_ptr of a handed-out tensor -> its page-aligned address
        self.nbytes = 0  # bytes page-locked now
        # Safety net: if the owner is garbage-collected without close(), still unregister.
        self._finalizer = weakref.finalize(self, _unregister_all, self._live, self._pages)

    def empty(self, numel: int, dtype: torch.dtype, *, lock_now: bool = True) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements; with ``lock_now=False`` page-locked only by
        ``lock`` (a pinning pool's buffer is page-aligned either way)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not self.pin or nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        span = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(span + _PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE  # whole pages of our own: never shared with another allocation
        ptr = raw.data_ptr() + start
        out = raw[start : start + nbytes].view(dtype)
        with self._lock:
            self._unlocked[ptr] = raw
            self._owner[out.data_ptr()] = ptr
        if lock_now:
            try:
                self.lock(out)
            except BaseException:
                self.release(out)
                raise
        return out

    def lock(self, t: torch.Tensor) -> None:
        """Page-lock a buffer from ``empty`` if it is not yet (a no-op for a pool that does not pin, a
        zero-size buffer or one already locked). Safe from several threads: one locks, the others wait
        for it; if locking fails, the one raises and the others go on with pageable memory."""
        if not self.pin:
            return
        with self._lock:
            ptr = self._owner.get(t.data_ptr())
            if ptr is None:
                if t.numel() == 0:
                    return
                raise ValueError("HostBuffers.lock: the tensor is not a buffer of this pool (give the one empty returned)")
            raw = self._unlocked.get(ptr)
            if raw is None:
                return
            busy = self._locking.get(ptr)
            if busy is None:
                done = self._locking[ptr] = threading.Event()
        if busy is not None:  # another thread is locking it: wait for its cudaHostRegister, not forever
            if not busy.wait(timeout=LOCK_WAIT_S):
                raise TimeoutError(
                    f"page-locking a {t.numel() * t.element_size()} byte host buffer took over {LOCK_WAIT_S:.0f} s in "
                    "another thread; the CUDA driver may be stuck (check nvidia-smi)"
                )
            return
        span = raw.numel() - _PAGE
        try:
            self._pages.register(ptr, span)
            with self._lock:
                self._unlocked.pop(ptr, None)
                self._live[ptr] = raw
                self.nbytes += span
                _REGISTERED[0] += span
        finally:
            with self._lock:
                self._locking.pop(ptr, None)
            done.set()

    def locked(self, t: torch.Tensor) -> bool:
        """Whether a buffer from ``empty`` is page-locked now."""
        with self._lock:
            return self._owner.get(t.data_ptr()) in self._live

    def release(self, t: torch.Tensor) -> None:
        """Unregister (where locked) and drop a tensor from ``empty`` (a no-op for unpinned ones)."""
        with self._lock:
            ptr = self._owner.pop(t.data_ptr(), None)
            if ptr is None:
                return
            if self._unlocked.pop(ptr, None) is not None:
                return
            raw = self._live.pop(ptr)
            self.nbytes -= raw.numel() - _PAGE
            _REGISTERED[0] -= raw.numel() - _PAGE
        self._pages.unregister(ptr)

    def close(self) -> None:
        """Unregister everything. Tensors handed out must no longer be used for async copies."""
        with self._lock:
            _unregister_all(self._live, self._pages)
            self._unlocked.clear()
            self._owner.clear()
            self.nbytes = 0
