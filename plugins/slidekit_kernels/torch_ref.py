"""The ``torch_ref`` kernel set: plain PyTorch, the reference every other kernel set is tested against.

It runs on any device torch runs on. The math follows Hugging Face
transformers' Llama/Qwen code exactly (RMSNorm in FP32 then cast back, RoPE
by ``rotate_half``), so slidekit's forward can be compared with theirs.

The fused linear + cross-entropy never holds the (tokens x vocab) logits:
it walks the tokens in chunks, and for each chunk computes logits in FP32,
the loss, and at once the gradients of the hidden states and of the weight
(softmax minus one-hot), so the backward pass only scales what the forward
pass already produced::

    loss   = sum_i [ logsumexp(h_i W^T) - (h_i W^T)[y_i] ]      over labelled i
    dL/dh_i = (softmax(h_i W^T) - onehot(y_i)) W
    dL/dW   = sum_i (softmax(h_i W^T) - onehot(y_i))^T h_i

Test: ``pytest tests/plugins/test_torch_ref.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import KernelSetDescriptor

__all__ = ["TorchRef", "auto_chunk", "linear_cross_entropy"]

#: Default logits budget per chunk: 2^26 FP32 elements (256 MiB).
_LOGITS_BUDGET = 1 << 26


def auto_chunk(num_tokens: int, vocab: int, budget: int = _LOGITS_BUDGET) -> int:
    """Tokens per chunk so that one chunk's FP32 logits stay within ``budget`` elements."""
    return max(1, min(num_tokens, budget // max(vocab, 1)))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int
    ) -> Tensor:
        n = hidden.shape[0]
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if want_dh else None
        dw = torch.zeros_like(weight) if want_dw else None
        acc = torch.promote_types(hidden.dtype, torch.float32)  # FP32 at least (FP64 stays FP64)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        for a in range(0, n, chunk_size):
            b = min(a + chunk_size, n)
            h, y = hidden[a:b], labels[a:b]
            logits = (h @ weight.T).to(acc)  # (c, V)
            lse = torch.logsumexp(logits, dim=-1)  # (c,)
            valid = y != ignore_index
            safe_y = torch.where(valid, y, 0)
            target = logits.gather(1, safe_y[:, None])[:, 0]
            loss += torch.where(valid, lse - target, 0.0).sum()
            if dh is None and dw is None:
                continue
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[torch.arange(b - a, device=grad.device), safe_y] -= 1.0
            grad.mul_(valid[:, None])
            g = grad.to(hidden.dtype)
            if dh is not None:
                torch.matmul(g, weight, out=dh[a:b])
            if dw is not None:
                dw.addmm_(g.T, h)
        ctx.dh, ctx.dw = dh, dw
        return loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        dh, dw = ctx.dh, ctx.dw
        ctx.dh = ctx.dw = None
        # Scale in place, without a host sync (the scale stays on the device). In BF16 the
        # scale itself is rounded to BF16: a uniform factor on all gradients of the step.
        if dh is not None:
            dh.mul_(grad_out.to(dh.dtype))
        if dw is not None:
            dw.mul_(grad_out.to(dw.dtype))
        return dh, dw, None, None, None


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    reduction: str = "sum",
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising the logits.

    hidden: (N, H); weight: (V, H); labels: (N,). ``reduction`` is "sum" or
    "mean" (over labelled tokens). ``chunk_size`` None sizes chunks to 256 MiB of logits.
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    chunk = chunk_size or auto_chunk(hidden.shape[0], weight.shape[0])
    loss = _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk)
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum().clamp(min=1)
    return loss


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchRef:
    """Reference kernels in plain PyTorch."""

    name = "torch_ref"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None = None
    ) -> Tensor:
        t = q.shape[-2]
        gqa = q.shape[1] != k.shape[1]
        if window is None or t <= window:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        i = torch.arange(t, device=q.device)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)  # (T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)

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
            hidden, weight, labels, ignore_index=ignore_index, chunk_size=chunk_size, reduction=reduction
        )


@hookimpl
def slidekit_kernel_sets() -> Iterator[KernelSetDescriptor]:
    yield KernelSetDescriptor(
        name="torch_ref",
        factory=TorchRef,
        loss_workspace_bytes=3 * 4 * _LOGITS_BUDGET,  # FP32 logits, their softmax, the cast gradient
        priority=0,
        description="plain PyTorch reference kernels (SDPA attention, chunked linear + cross-entropy)",
    )
