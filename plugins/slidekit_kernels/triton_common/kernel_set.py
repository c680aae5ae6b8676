"""``TritonKernelSet``: the shared Triton kernels behind the ``KernelSet`` protocol, for one vendor.

``triton_cuda`` and ``triton_rocm`` are this class with their own name and
``LaunchConfig``. Attention is torch's scaled_dot_product_attention (flash
backend on the GPU), exactly as in ``torch_ref``: a Triton attention kernel
would have to beat FlashAttention / cuDNN to earn its place.

    from slidekit_kernels.triton_common.kernel_set import TritonKernelSet
    from slidekit_kernels.triton_common.vendors import NVIDIA
    ks = TritonKernelSet("triton_cuda", NVIDIA)
    y = ks.rms_norm(x, w, 1e-6)

Test: ``pytest tests/plugins/test_triton_kernels.py``.
"""

from __future__ import annotations

from torch import Tensor

from slidekit_kernels.torch_ref import TorchRef
from slidekit_kernels.triton_common.cross_entropy import linear_cross_entropy
from slidekit_kernels.triton_common.rms_norm import rms_norm
from slidekit_kernels.triton_common.rope import rope
from slidekit_kernels.triton_common.swiglu import swiglu
from slidekit_kernels.triton_common.vendors import LaunchConfig

__all__ = ["TritonKernelSet"]


class TritonKernelSet:
    """RMSNorm, RoPE, SwiGLU and fused linear + cross-entropy in Triton; SDPA attention."""

    def __init__(self, name: str, config: LaunchConfig) -> None:
        self.name = name
        self.config = config
        self._sdpa = TorchRef()

    def __repr__(self) -> str:
        return f"TritonKernelSet({self.name!r}, vendor={self.config.vendor!r})"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return rms_norm(x, weight, eps, self.config)

    def rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return rope(q, k, cos, sin, self.config)

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return swiglu(gate, up, self.config)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None = None
    ) -> Tensor:
        return self._sdpa.attention(q, k, v, scale=scale, window=window)

    def linear_cross_entropy(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        *,
        ignore_index: int = -100,
        chunk_size: int | None = None,
        reduction: str = "sum",
    ) -> Tensor:
        return linear_cross_entropy(
            hidden,
            weight,
            labels,
            self.config,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            reduction=reduction,
        )
