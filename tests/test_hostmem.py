"""Host buffers: exact-size page-locked memory (on a GPU machine), plain memory elsewhere."""

from __future__ import annotations

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
