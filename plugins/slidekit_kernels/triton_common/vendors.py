"""Everything that differs between NVIDIA and AMD for the shared Triton kernels: launch sizes and probes.

The kernels in this package are the same source for both vendors; Triton
compiles them for CUDA (PTX) or ROCm (AMDGCN). What differs is how they are
launched (a warp is 32 threads on NVIDIA, a wavefront 64 on AMD, and a
program may hold at most 1024 threads on either) and how availability is
probed. Both live here and nowhere else: ``LAUNCH_CONFIGS`` is the table,
``TUNE_SPACE`` the candidates ``benchmarks/kernels.py --tune`` measures for
it, ``availability`` the probe. Importing this module does not import triton.

Test: ``pytest tests/plugins/test_triton_kernels.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from slidekit.interfaces import Availability

__all__ = [
    "AMD",
    "LAUNCH_CONFIGS",
    "NVIDIA",
    "TUNE_SPACE",
    "LaunchConfig",
    "availability",
    "next_pow2",
    "prev_pow2",
    "tune_configs",
]


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """How the shared kernels are launched on one GPU vendor (block sizes and warps, not math).

    Warp counts are given as elements per thread: a program whose tile holds E
    elements gets ``E / (elems_per_thread * warp_size)`` warps (a power of two in
    [1, max_warps]), so one table serves every hidden size. Under
    ``TRITON_INTERPRET=1`` the warp counts are ignored and the block sizes are
    just other tilings, which is how the tests run both tables on a CPU.
    ``benchmarks/kernels.py --tune`` sweeps the RMSNorm and RoPE fields on a GPU.
    """

    vendor: str  # "nvidia" or "amd"
    warp_size: int  # threads per warp (NVIDIA) or wavefront (AMD)
    max_warps: int  # warps one program may use: 1024 threads / warp_size
    elems_per_thread: int  # SwiGLU and cross-entropy: elements of a tile each thread holds
    elementwise_block: int  # elements per SwiGLU program
    ce_block: int  # elements per cross-entropy loop iteration: vocabulary columns x rows (small vocabularies)
    rms_fwd_tile: int  # elements per RMSNorm forward program: rows x hidden padded to a power of two
    rms_fwd_elems_per_thread: int  # sets the RMSNorm forward's warps
    rms_bwd_tile: int  # elements per RMSNorm backward loop step: rows x padded hidden
    rms_bwd_elems_per_thread: int  # sets the RMSNorm backward's warps (and so its registers per thread)
    rms_bwd_programs_per_sm: int  # RMSNorm backward programs per SM / CU, each summing one FP32 dW partial
    rope_tile: int  # elements of q and k (all heads, both halves) per RoPE program (sets its positions)
    rope_elems_per_thread: int  # sets the RoPE kernel's warps

    def __post_init__(self) -> None:
        pow2 = ("warp_size", "max_warps", "elementwise_block", "ce_block", "rms_fwd_tile", "rms_bwd_tile")
        for name in (*pow2, "rope_tile"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two, got {value}")
        for name in ("elems_per_thread", "rms_fwd_elems_per_thread", "rms_bwd_elems_per_thread",
                     "rope_elems_per_thread", "rms_bwd_programs_per_sm"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"LaunchConfig.{name} must be a positive integer, got {getattr(self, name)}")

    def num_warps(self, elements: int, elems_per_thread: int | None = None) -> int:
        """Warps for a program whose tile holds ``elements`` values: a power of two in [1, max_warps].

        ``elems_per_thread`` defaults to the table's general ``elems_per_thread``.
        """
        per_thread = elems_per_thread or self.elems_per_thread
        warps = elements // (per_thread * self.warp_size)
        return max(1, min(self.max_warps, prev_pow2(warps)))

    @staticmethod
    def rows_per_tile(tile: int, block_cols: int) -> int:
        """Rows of ``block_cols`` (padded) columns that fit a ``tile`` of elements; at least one."""
        return max(1, tile // block_cols)


#: NVIDIA (Hopper, Ampere): 32-thread warps; an SM holds 64 warps and 65536 registers. Occupancies
#: below are from ptxas (triton 3.6, sm_90, BF16, H = 4096).
#: SwiGLU / cross-entropy: 16 elements per thread (two 16-byte BF16 vectors).
#: RMSNorm forward: one row per program, 8 warps (33 registers; 6 programs per SM), as Liger launches it.
#: RMSNorm backward: one row per loop step at 8 elements per thread = 16 warps (59 registers), so 2
#: programs fit an SM; 2 programs per SM make the persistent grid exactly one wave, each program
#: walking ~31 rows of an 8192-token batch, and the FP32 dW partials stay at 2 x SMs x H (4 MiB).
#: (The previous 8 warps x 4 programs per SM needed 127 registers: 2 resident, two waves.)
#: RoPE: one position per program for Llama-sized heads (32 + 8 heads x 128), 8 warps (47 registers).
NVIDIA: Final = LaunchConfig(
    vendor="nvidia",
    warp_size=32,
    max_warps=32,
    elems_per_thread=16,
    elementwise_block=2048,
    ce_block=16384,
    rms_fwd_tile=4096,
    rms_fwd_elems_per_thread=16,
    rms_bwd_tile=4096,
    rms_bwd_elems_per_thread=8,
    rms_bwd_programs_per_sm=2,
    rope_tile=4096,
    rope_elems_per_thread=16,
)

#: AMD (CDNA, RDNA): 64-thread wavefronts, at most 16 per program. Row tiles twice NVIDIA's
#: (8192 elements) give 8 wavefronts of 16 elements per lane. Not yet measured on an AMD GPU.
AMD: Final = LaunchConfig(
    vendor="amd",
    warp_size=64,
    max_warps=16,
    elems_per_thread=16,
    elementwise_block=4096,
    ce_block=16384,
    rms_fwd_tile=8192,
    rms_fwd_elems_per_thread=16,
    rms_bwd_tile=8192,
    rms_bwd_elems_per_thread=16,
    rms_bwd_programs_per_sm=4,
    rope_tile=8192,
    rope_elems_per_thread=16,
)

#: Candidate values of the RMSNorm and RoPE launch fields that ``benchmarks/kernels.py --tune`` sweeps,
#: one group at a time from the vendor's table (a group's fields together, as a cross product):
#: rows per step x warps x programs for the RMSNorm backward, rows x warps for its forward, positions x
#: warps for RoPE. At Llama's H = 4096 the tiles are 1 / 2 / 4 rows and the elements per thread
#: 4 / 8 / 16 / 32 give 32 / 16 / 8 / 4 warps per row.
TUNE_SPACE: Final[dict[str, dict[str, tuple[int, ...]]]] = {
    "rms_norm backward": {
        "rms_bwd_tile": (4096, 8192),
        "rms_bwd_elems_per_thread": (4, 8, 16),
        "rms_bwd_programs_per_sm": (1, 2, 3, 4, 8, 16),
    },
    "rms_norm forward": {
        "rms_fwd_tile": (4096, 8192, 16384),
        "rms_fwd_elems_per_thread": (4, 8, 16, 32),
    },
    "rope": {
        "rope_tile": (4096, 16384, 32768, 65536),
        "rope_elems_per_thread": (4, 8, 16, 32),
    },
}


def tune_configs(base: LaunchConfig) -> Iterator[tuple[str, LaunchConfig]]:
    """(group, config) for every point of ``TUNE_SPACE``: ``base`` with one group's fields replaced."""
    for group, fields in TUNE_SPACE.items():
        names = list(fields)
        for values in itertools.product(*(fields[n] for n in names)):
            changes: dict[str, Any] = dict(zip(names, values, strict=True))
            yield group, dataclasses.replace(base, **changes)


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
