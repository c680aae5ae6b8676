"""Everything that differs between NVIDIA and AMD for the shared Triton kernels: launch sizes and probes.

The kernels in this package are the same source for both vendors; Triton
compiles them for CUDA (PTX) or ROCm (AMDGCN). What differs is how they are
launched (a warp is 32 threads on NVIDIA, a wavefront 64 on AMD, and a
program may hold at most 1024 threads on either) and how availability is
probed. Both live here and nowhere else: ``LAUNCH_CONFIGS`` is the table,
``availability`` the probe. Importing this module does not import triton.

Test: ``pytest tests/plugins/test_triton_kernels.py``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Final

from slidekit.interfaces import Availability

__all__ = ["AMD", "LAUNCH_CONFIGS", "NVIDIA", "LaunchConfig", "availability", "next_pow2", "prev_pow2"]


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """How the shared kernels are launched on one GPU vendor (block sizes and warps, not math).

    Under ``TRITON_INTERPRET=1`` the warp counts are ignored and the block
    sizes are just other tilings, which is how the tests run both tables on a CPU.
    """

    vendor: str  # "nvidia" or "amd"
    warp_size: int  # threads per warp (NVIDIA) or wavefront (AMD)
    max_warps: int  # warps one program may use: 1024 threads / warp_size
    elems_per_thread: int  # elements of a tile each thread holds; sets num_warps of row kernels
    row_tile: int  # elements per program tile of RMSNorm (rows x hidden) and RoPE (positions x heads x D)
    rms_bwd_programs_per_sm: int  # RMSNorm backward programs per SM / CU, each summing one dW partial
    elementwise_block: int  # elements per SwiGLU program
    ce_block: int  # elements per cross-entropy loop iteration: vocabulary columns x rows (small vocabularies)

    def __post_init__(self) -> None:
        for name in ("row_tile", "elementwise_block", "ce_block", "warp_size", "max_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {value}")

    def num_warps(self, elements: int) -> int:
        """Warps for a program whose tile holds ``elements`` values: a power of two in [1, max_warps]."""
        warps = elements // (self.elems_per_thread * self.warp_size)
        return max(1, min(self.max_warps, prev_pow2(warps)))

    def rows_per_tile(self, block_cols: int) -> int:
        """Rows an RMSNorm program handles at once when a row is padded to ``block_cols``."""
        return max(1, self.row_tile // block_cols)


#: NVIDIA (Hopper, Ampere): 32-thread warps; 16 elements per thread (two 16-byte BF16 vectors) give
#: 8 warps for a 4096-wide row. RMSNorm backward: 4 programs per SM (each ~16 rows of an 8192-token
#: batch), so the FP32 dW partials stay small (4 x SMs x H) while loads keep the SMs busy.
NVIDIA: Final = LaunchConfig(
    vendor="nvidia",
    warp_size=32,
    max_warps=32,
    elems_per_thread=16,
    row_tile=4096,
    rms_bwd_programs_per_sm=4,
    elementwise_block=2048,
    ce_block=16384,
)

#: AMD (CDNA, RDNA): 64-thread wavefronts, at most 16 per program. Row tiles twice NVIDIA's
#: (8192 elements) give 8 wavefronts of 16 elements per lane.
AMD: Final = LaunchConfig(
    vendor="amd",
    warp_size=64,
    max_warps=16,
    elems_per_thread=16,
    row_tile=8192,
    rms_bwd_programs_per_sm=4,
    elementwise_block=4096,
    ce_block=16384,
)

#: slidekit device family ("cuda" for NVIDIA, "rocm" for AMD) -> its launch configuration.
LAUNCH_CONFIGS: Final[dict[str, LaunchConfig]] = {"cuda": NVIDIA, "rocm": AMD}


def availability(family: str) -> Availability:
    """Whether the Triton kernel set for ``family`` ("cuda" or "rocm") can run here, and why (not).

    Cheap and side-effect free: it neither imports triton nor creates a device context.
    """
    if family not in LAUNCH_CONFIGS:
        raise ValueError(f"unknown device family {family!r}; choose one of: {', '.join(LAUNCH_CONFIGS)}")
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install triton)"
    import torch

    hip = getattr(torch.version, "hip", None)
    version = importlib.metadata.version("triton")
    if family == "cuda":
        if hip:
            return False, f"torch is a ROCm (HIP {hip}) build; use triton_rocm on AMD GPUs"
        if not torch.cuda.is_available():
            return False, "torch sees no CUDA device; use torch_ref on the CPU"
        return True, f"Triton {version} kernels for NVIDIA GPUs"
    if not hip:
        return (
            False,
            "torch is not a ROCm (HIP) build; triton_rocm serves AMD GPUs, use triton_cuda on NVIDIA",
        )
    if not torch.cuda.is_available():
        return False, "torch sees no ROCm device; use torch_ref on the CPU"
    return True, f"Triton {version} kernels for AMD GPUs (HIP {hip})"
