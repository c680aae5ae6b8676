"""The ``triton_cuda`` kernel set: the shared Triton kernels, launched for NVIDIA GPUs.

RMSNorm, RoPE, SwiGLU and the fused linear + cross-entropy are Triton
kernels (``slidekit_kernels.triton_common``) with NVIDIA's launch sizes
(``vendors.NVIDIA``); attention is torch's SDPA (flash backend). Priority 100,
so "auto" prefers it to ``torch_ref`` wherever it is available: a CUDA device,
a torch that is not a ROCm build, and triton installed. Triton is imported
only when the set is built, so ``slidekit plugins`` works without it.

Test: ``pytest tests/plugins/test_triton_kernels.py``; benchmark: ``python benchmarks/kernels.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, KernelSet, KernelSetDescriptor
from slidekit_kernels.triton_common.vendors import NVIDIA, availability

__all__ = ["NAME", "available", "build"]

NAME = "triton_cuda"


def available() -> Availability:
    """Triton installed, a CUDA (not HIP) build of torch, and a visible CUDA device."""
    return availability("cuda")


def build() -> KernelSet:
    """The kernel set (imports triton)."""
    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet

    return TritonKernelSet(NAME, NVIDIA)


@hookimpl
def slidekit_kernel_sets() -> Iterator[KernelSetDescriptor]:
    yield KernelSetDescriptor(
        name=NAME,
        factory=build,
        loss_workspace_bytes=128 << 20,  # one chunk of logits in the compute dtype (cross_entropy.py)
        available=available,
        priority=100,
        devices=("cuda",),
        description="Triton kernels for NVIDIA GPUs (RMSNorm, RoPE, SwiGLU, fused linear + CE; SDPA attention)",
    )
