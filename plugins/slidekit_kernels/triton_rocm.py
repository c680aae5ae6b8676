"""The ``triton_rocm`` kernel set: the shared Triton kernels, launched for AMD GPUs.

The same kernels as ``triton_cuda`` (``slidekit_kernels.triton_common``)
with AMD's launch sizes (``vendors.AMD``: 64-thread wavefronts, at most 16
per program). Available only on a ROCm (HIP) build of torch with a visible
device and triton installed; elsewhere it says why. Priority 100, so "auto"
prefers it to ``torch_ref`` on AMD GPUs.

Test: ``pytest tests/plugins/test_triton_kernels.py`` (its launch sizes run in the interpreter there).
"""

from __future__ import annotations

from collections.abc import Iterator

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, KernelSet, KernelSetDescriptor
from slidekit_kernels.triton_common.vendors import AMD, availability

__all__ = ["NAME", "available", "build"]

NAME = "triton_rocm"


def available() -> Availability:
    """Triton installed, a ROCm (HIP) build of torch, and a visible device."""
    return availability("rocm")


def build() -> KernelSet:
    """The kernel set (imports triton)."""
    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet

    return TritonKernelSet(NAME, AMD)


@hookimpl
def slidekit_kernel_sets() -> Iterator[KernelSetDescriptor]:
    yield KernelSetDescriptor(
        name=NAME,
        factory=build,
        loss_workspace_bytes=128 << 20,  # one chunk of logits in the compute dtype (cross_entropy.py)
        available=available,
        priority=100,
        devices=("rocm",),
        description="Triton kernels for AMD GPUs (RMSNorm, RoPE, SwiGLU, fused linear + CE; SDPA attention)",
    )
