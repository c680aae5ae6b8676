"""The kernel conformance suite itself (slidekit.testing.kernels): torch_ref passes, broken sets fail clearly.

Run: ``pytest tests/plugins/test_kernel_conformance.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slidekit.testing.kernels import (
    LINEAR_CE_CASES,
    TOLERANCES,
    Tolerance,
    assert_close,
    check_kernel_set,
    check_linear_cross_entropy,
    check_rms_norm,
    check_rope,
    check_swiglu,
    conformance_cases,
    reference_kernels,
)
from slidekit_kernels.torch_ref import TorchRef


def test_torch_ref_conforms_in_float32_and_bfloat16():
    n = check_kernel_set(TorchRef(), "cpu", (torch.float32, torch.bfloat16))
    assert n == len(conformance_cases((torch.float32, torch.bfloat16))) > 60


def test_every_op_and_dtype_has_tolerances():
    ops = {c.op for c in conformance_cases()}
    assert ops == {"rms_norm", "rope", "swiglu", "attention", "linear_cross_entropy"}
    for table in TOLERANCES.values():
        assert set(table) == ops | {f"{op}.grad" for op in ops}
    ids = [str(c) for c in conformance_cases((torch.float32, torch.bfloat16))]
    assert len(ids) == len(set(ids)), "case ids must be unique (they are pytest ids)"


def test_reference_comes_from_the_registry():
    assert reference_kernels().name == "torch_ref"


class _NoEps(TorchRef):
    """RMSNorm with eps inside the square root forgotten and the mean replaced by a sum: wrong outputs."""

    name = "no_eps"

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True))).to(x.dtype)


class _SiluBackwardWrong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        return g * up * s, g * F.silu(gate)  # misses the (1 + gate * (1 - s)) factor


class _BadGrad(TorchRef):
    name = "bad_grad"

    def swiglu(self, gate, up):
        return _SiluBackwardWrong.apply(gate, up)


class _InPlace(TorchRef):
    name = "in_place"

    def rope(self, q, k, cos, sin):
        out = super().rope(q, k, cos, sin)
        with torch.no_grad():
            q.mul_(2.0)  # scribbles on its input
        return out


class _WrongChunking(TorchRef):
    """Drops the last partial chunk of tokens: only cases whose token count is no multiple of the chunk see it."""

    name = "wrong_chunks"

    def linear_cross_entropy(self, hidden, weight, labels, **kw):
        chunk = kw.get("chunk_size") or hidden.shape[0]
        keep = hidden.shape[0] - hidden.shape[0] % chunk or hidden.shape[0]
        return super().linear_cross_entropy(hidden[:keep], weight, labels[:keep], **kw)


def test_wrong_outputs_are_reported_with_where_and_how_much():
    with pytest.raises(AssertionError) as info:
        check_rms_norm(_NoEps(), (5, 123, 123), dtype=torch.float32, device="cpu")
    msg = str(info.value)
    for part in ("no_eps rms_norm (5, 123, 123) float32, output y", "elements off", "worst at (", "actual"):
        assert part in msg, msg
    assert "expected" in msg and "abs err" in msg and "rel err" in msg and "relative L2 error" in msg


def test_a_wrong_gradient_alone_is_caught():
    check_swiglu(TorchRef(), (4, 3001), dtype=torch.float32, device="cpu")
    with pytest.raises(AssertionError, match="gradient of gate"):
        check_swiglu(_BadGrad(), (4, 3001), dtype=torch.float32, device="cpu")


def test_modifying_an_input_in_place_is_caught():
    with pytest.raises(AssertionError, match="input 0 was modified in place"):
        check_rope(_InPlace(), (2, 4, 2, 9, 16), dtype=torch.float32, device="cpu")


def test_a_dropped_partial_chunk_is_caught():
    (case,) = [c for c in LINEAR_CE_CASES if c.chunk == 4]  # 9 tokens: the 9th is labelled
    with pytest.raises(AssertionError, match="output loss"):
        check_linear_cross_entropy(_WrongChunking(), case, dtype=torch.float32, device="cpu")


def test_check_kernel_set_reports_every_failure_at_once():
    with pytest.raises(AssertionError) as info:
        check_kernel_set(_NoEps(), "cpu")
    msg = str(info.value)
    assert f"failed {len(_rms_cases())} of {len(conformance_cases())} conformance checks" in msg
    assert msg.count("[rms_norm-") == len(_rms_cases())


def _rms_cases():
    return [c for c in conformance_cases() if c.op == "rms_norm"]


def test_assert_close_tolerance_arithmetic():
    e = torch.tensor([10.0, -1.0, 0.0])
    tol = Tolerance(atol=1e-3, rtol=1e-2)  # bound: 0.01 (1e-3 x max 10) + 1% of |e|
    assert_close(e + torch.tensor([0.109, -0.019, 0.0099]), e, tol, "x")
    with pytest.raises(AssertionError, match=r"worst at \(2,\): actual 0.011, expected 0"):
        assert_close(e + torch.tensor([0.0, 0.0, 0.011]), e, tol, "x")
    with pytest.raises(AssertionError, match="1 of 3 elements"):
        assert_close(torch.tensor([10.0, float("nan"), 0.0]), e, tol, "x")
    assert_close(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]), tol, "x")
    with pytest.raises(AssertionError, match="got shape"):
        assert_close(e[:2], e, tol, "x")
    with pytest.raises(AssertionError, match="float64"):
        assert_close(e.double(), e, tol, "x")
