"""Host buffers for transfers: page-locked at their exact size.

``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host
allocator, which rounds every request up to a power of two: a 308 MB layer
master takes 512 MB, and a model's host memory grows by up to 2x. A
``HostBuffers`` pool instead allocates ordinary memory and page-locks it in
place with ``cudaHostRegister``, so a buffer costs its size (plus at most two
pages) and copies to and from it are still truly asynchronous.

The pool keeps every registered buffer alive until it is released, and
unregisters before letting go, so no freed memory ever stays registered.
Registration only happens with ``pin=True``; otherwise buffers are plain
pageable memory. Owners (the host store, the ram tier) release theirs when
they close.

Test: ``pytest tests/test_hostmem.py`` (the pinning path runs on a GPU machine).
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

__all__ = ["HostBuffers", "registered_bytes"]

_PAGE = mmap.PAGESIZE
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


def _unregister_all(ptrs: dict[int, torch.Tensor]) -> None:
    for ptr, raw in list(ptrs.items()):
        torch.cuda.cudart().cudaHostUnregister(ptr)
        _REGISTERED[0] -= raw.numel() - _PAGE
    ptrs.clear()


class HostBuffers:
    """Allocates host tensors, page-locked at their exact size when ``pin`` is set."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._lock = threading.Lock()
        self._live: dict[int, torch.Tensor] = {}  # registered address -> the raw allocation behind it
        self._owner: dict[int, int] = {}  # data_ptr of a handed-out tensor -> registered address
        self.nbytes = 0
        # Safety net: if the owner is garbage-collected without close(), still unregister.
        self._finalizer = weakref.finalize(self, _unregister_all, self._live)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D tensor of ``numel`` elements."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not self.pin or nbytes == 0:
            return torch.empty(numel, dtype=dtype)
        span = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(span + _PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % _PAGE  # whole pages of our own: never shared with another allocation
        ptr = raw.data_ptr() + start
        _cuda_call(torch.cuda.cudart().cudaHostRegister(ptr, span, 0), f"page-locking {nbytes} bytes")
        out = raw[start : start + nbytes].view(dtype)
        with self._lock:
            self._live[ptr] = raw
            self._owner[out.data_ptr()] = ptr
            self.nbytes += span
            _REGISTERED[0] += span
        return out

    def release(self, t: torch.Tensor) -> None:
        """Unregister and drop a tensor from ``empty`` (no-op for unpinned ones)."""
        with self._lock:
            ptr = self._owner.pop(t.data_ptr(), None)
            if ptr is None:
                return
            raw = self._live.pop(ptr)
            self.nbytes -= raw.numel() - _PAGE
            _REGISTERED[0] -= raw.numel() - _PAGE
        torch.cuda.cudart().cudaHostUnregister(ptr)

    def close(self) -> None:
        """Unregister everything. Tensors handed out must no longer be used for async copies."""
        with self._lock:
            _unregister_all(self._live)
            self._owner.clear()
            self.nbytes = 0
