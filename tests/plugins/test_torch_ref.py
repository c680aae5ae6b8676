"""torch_ref kernels against straightforward PyTorch and transformers code: outputs and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slidekit.testing.asserts import rel_error
from slidekit_kernels.torch_ref import TorchRef, auto_chunk

K = TorchRef()


def _grads(out: torch.Tensor, *inputs: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad(out, inputs, g))


@pytest.mark.parametrize("n", [1, 5, 37])
@pytest.mark.parametrize("vocab", [11, 123])
@pytest.mark.parametrize("chunk", [1, 4, None, 1000])
def test_linear_cross_entropy_matches_full_logits(n, vocab, chunk):
    gen = torch.Generator().manual_seed(n * vocab)
    h = torch.randn(n, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, vocab, (n,), generator=gen)
    y[::3] = -100
    for reduction in ("sum", "mean"):
        ours = K.linear_cross_entropy(h, w, y, chunk_size=chunk, reduction=reduction)
        ref = F.cross_entropy(h @ w.T, y, ignore_index=-100, reduction=reduction)
        if (y == -100).all():
            assert ours.item() == 0.0
            continue
        assert rel_error(ours, ref) < 1e-12
        g_ours = torch.autograd.grad(ours * 0.37, (h, w))
        g_ref = torch.autograd.grad(ref * 0.37, (h, w))
        for a, b in zip(g_ours, g_ref, strict=True):
            assert rel_error(a, b) < 1e-12


def test_linear_cross_entropy_fp32_and_no_weight_grad():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=gen, requires_grad=True)
    w = torch.randn(1000, 32, generator=gen)  # frozen weight: no dW computed
    y = torch.randint(0, 1000, (64,), generator=gen)
    ours = K.linear_cross_entropy(h, w, y, chunk_size=10)
    ref = F.cross_entropy(h @ w.T, y, reduction="sum")
    assert rel_error(ours, ref) < 1e-6
    (gh,) = torch.autograd.grad(ours, h)
    (gh_ref,) = torch.autograd.grad(ref, h)
    assert rel_error(gh, gh_ref) < 1e-5


def test_auto_chunk_bounds_the_logits():
    assert auto_chunk(8192, 128256) * 128256 <= 1 << 26
    assert auto_chunk(3, 10) == 3
    assert auto_chunk(10, 1 << 30) == 1


@pytest.mark.parametrize("shape", [(2, 7, 64), (5, 123), (1, 1, 3, 16)])
def test_rms_norm_matches_transformers(shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    norm = LlamaRMSNorm(shape[-1], eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    w = norm.weight.detach().clone().requires_grad_(True)
    ours, ref = K.rms_norm(x, w, 1e-6), norm(x)
    assert rel_error(ours, ref) < 1e-12
    for a, b in zip(_grads(ours, x, w), _grads(ref, x, norm.weight), strict=True):
        assert rel_error(a, b) < 1e-12


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    ang = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    oq, ok = K.rope(q, k, cos, sin)
    rq, rk = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert rel_error(oq, rq) < 1e-12 and rel_error(ok, rk) < 1e-12
    g1 = torch.autograd.grad(oq.sum() + (ok * 2).sum(), (q, k))
    g2 = torch.autograd.grad(rq.sum() + (rk * 2).sum(), (q, k))
    for a, b in zip(g1, g2, strict=True):
        assert rel_error(a, b) < 1e-12


def test_swiglu():
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 5, 17, generator=gen, dtype=torch.float64, requires_grad=True)
    u = torch.randn(3, 5, 17, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = K.swiglu(g, u)
    ref = g * torch.sigmoid(g) * u
    assert rel_error(ours, ref) < 1e-12
    for a, b in zip(_grads(ours, g, u), _grads(ref, g, u), strict=True):
        assert rel_error(a, b) < 1e-12


def _eager_attention(q, k, v, scale, window):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    t = q.shape[-2]
    i = torch.arange(t)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= (i[:, None] - i[None, :]) < window
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 3, 100])
def test_attention_causal_gqa_and_sliding_window(heads, window):
    hq, hkv = heads
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(2, hq, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, 11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = K.attention(q, k, v, scale=8**-0.5, window=window)
    ref = _eager_attention(q, k, v, 8**-0.5, window)
    assert rel_error(ours, ref) < 1e-10
    for a, b in zip(_grads(ours, q, k, v), _grads(ref, q, k, v), strict=True):
        assert rel_error(a, b) < 1e-10
