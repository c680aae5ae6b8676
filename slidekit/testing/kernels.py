"""Conformance checks any kernel set must pass (bundled or third-party), against ``torch_ref``.

    from slidekit.testing.kernels import check_kernel_set
    check_kernel_set(MyKernels(), "cuda", dtypes=(torch.float32, torch.bfloat16))

or one case at a time, e.g. as pytest parameters::

    @pytest.mark.parametrize("case", conformance_cases((torch.float32,)), ids=str)
    def test_my_kernels(case):
        case.check(MyKernels(), "cuda")

Every op of the ``KernelSet`` protocol is run by the kernel set under test
and by the reference (``torch_ref``, loaded through the plugin registry
unless another reference is passed) on the same seeded inputs. Outputs AND
the gradient of every differentiable input (for seeded random output
gradients) must agree within the per-dtype table ``TOLERANCES``. Shapes are
stacked tables with odd sizes: hidden sizes like 123, non-power-of-two head
dimensions, single-token sequences, vocabularies that are no multiple of any
block, chunked cross-entropy with ignored tokens. A kernel set must also
leave its inputs and the incoming gradients unmodified (autograd may hand
either to someone else).

A failure says where and by how much: the worst element's index, both
values, its absolute and relative error, how many elements are off, and the
relative L2 error of the whole tensor. ``check_kernel_set`` runs every case
and reports every failure, so one does not hide another.

Triton kernels interpreted on the CPU (``TRITON_INTERPRET=1``) are only
meaningful in float32: the interpreter truncates float32 -> bfloat16 casts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slidekit.interfaces import KernelSet
from slidekit.testing.asserts import rel_error

__all__ = [
    "ATTENTION_SHAPES",
    "LINEAR_CE_CASES",
    "RMS_NORM_SHAPES",
    "ROPE_SHAPES",
    "SWIGLU_SHAPES",
    "TOLERANCES",
    "Case",
    "LinearCECase",
    "Tolerance",
    "assert_close",
    "check_attention",
    "check_kernel_set",
    "check_linear_cross_entropy",
    "check_rms_norm",
    "check_rope",
    "check_swiglu",
    "conformance_cases",
    "reference_kernels",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerance:
    """``|actual - expected| <= atol * max|expected| + rtol * |expected|``, element by element.

    ``atol`` is relative to the tensor's largest magnitude, so one table serves
    tensors of any scale; it absorbs rounding where terms cancel.
    """

    atol: float
    rtol: float


_FP32 = Tolerance(atol=1e-5, rtol=1e-5)
_BF16 = Tolerance(atol=1e-2, rtol=1.6e-2)  # a few BF16 ulps (2^-8 relative each)

#: dtype -> op (outputs) or "op.grad" (input gradients) -> tolerance.
TOLERANCES: dict[torch.dtype, dict[str, Tolerance]] = {
    torch.float32: {
        "rms_norm": _FP32,
        "rms_norm.grad": _FP32,
        "rope": _FP32,
        "rope.grad": _FP32,
        "swiglu": _FP32,
        "swiglu.grad": _FP32,
        "attention": _FP32,
        "attention.grad": _FP32,
        "linear_cross_entropy": _FP32,
        "linear_cross_entropy.grad": _FP32,
    },
    torch.bfloat16: {
        "rms_norm": _BF16,
        "rms_norm.grad": _BF16,
        "rope": _BF16,
        "rope.grad": _BF16,
        "swiglu": _BF16,
        "swiglu.grad": _BF16,
        "attention": _BF16,
        "attention.grad": _BF16,
        # The loss is FP32 math over the same BF16 logits: it must agree much more closely.
        "linear_cross_entropy": Tolerance(atol=0.0, rtol=1e-3),
        "linear_cross_entropy.grad": _BF16,
    },
}

#: x shapes (..., H) for rms_norm.
RMS_NORM_SHAPES: tuple[tuple[int, ...], ...] = (
    (5, 123, 123),
    (2, 7, 64),
    (3, 1, 4, 80),
    (1, 4096),
    (1, 1, 1, 8),
)
#: (B, q heads, kv heads, T, D) for rope; each runs with q/k contiguous and as transposed views.
ROPE_SHAPES: tuple[tuple[int, int, int, int, int], ...] = (
    (2, 4, 2, 9, 16),
    (1, 5, 1, 1, 24),
    (2, 3, 3, 17, 80),
    (1, 8, 2, 33, 128),
)
ROPE_LAYOUTS = ("bhtd", "bthd")  # contiguous (B, heads, T, D), or a transposed (B, T, heads, D) tensor
#: gate / up shapes for swiglu.
SWIGLU_SHAPES: tuple[tuple[int, ...], ...] = ((5, 123, 123), (1, 1, 7), (4, 3001), (2, 17, 96))
#: (B, q heads, kv heads, T, D, sliding window or None) for attention.
ATTENTION_SHAPES: tuple[tuple[int, int, int, int, int, int | None], ...] = (
    (2, 4, 2, 11, 8, None),
    (1, 6, 1, 1, 80, None),
    (2, 4, 4, 13, 24, 5),
    (1, 2, 1, 40, 64, 16),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearCECase:
    """One fused linear + cross-entropy setting."""

    tokens: int
    hidden: int
    vocab: int
    chunk: int | None  # chunk_size passed to both kernel sets
    grads: str = "both"  # "both", "hidden" (frozen weight) or "none" (loss only, under no_grad)
    ignored: str = "every3"  # which labels are ignore_index: "none", "every3", "first_chunk", "all"

    def __str__(self) -> str:
        return (
            f"N{self.tokens}-H{self.hidden}-V{self.vocab}-chunk{self.chunk}-{self.grads}-ign_{self.ignored}"
        )


LINEAR_CE_CASES: tuple[LinearCECase, ...] = (
    LinearCECase(tokens=1, hidden=16, vocab=11, chunk=None, ignored="none"),
    LinearCECase(tokens=37, hidden=24, vocab=123, chunk=None),
    LinearCECase(tokens=64, hidden=32, vocab=1000, chunk=7, ignored="first_chunk"),
    LinearCECase(tokens=9, hidden=16, vocab=20011, chunk=4),
    LinearCECase(tokens=20, hidden=16, vocab=300, chunk=6, grads="hidden"),
    LinearCECase(tokens=20, hidden=16, vocab=300, chunk=None, grads="none"),
    LinearCECase(tokens=5, hidden=8, vocab=50, chunk=2, ignored="all"),
)

IGNORE_INDEX = -100


@functools.cache
def reference_kernels() -> KernelSet:
    """``torch_ref``, built through the plugin registry (the core never imports a plugin module)."""
    from slidekit.plugins import Plugins

    kernels: KernelSet = Plugins(entry_points=["torch_ref"]).get("kernels", "torch_ref").descriptor.factory()
    return kernels


# --------------------------------------------------------------------------- comparison


def assert_close(actual: Tensor, expected: Tensor, tol: Tolerance, what: str) -> None:
    """Raise AssertionError saying where and by how much ``actual`` is off, if it is."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: got shape {tuple(actual.shape)} {actual.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
        )
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return
    scale = float(e.abs().nan_to_num(posinf=0.0, neginf=0.0).max())
    bound = tol.atol * scale + tol.rtol * e.abs()
    err = (a - e).abs()
    same_special = (a.isnan() & e.isnan()) | (a == e)  # NaN where expected, or equal infinities
    bad = ~(err <= bound) & ~same_special
    if not bool(bad.any()):
        return
    excess = torch.where(bad, (err / bound.clamp(min=1e-300)).nan_to_num(nan=float("inf")), 0.0)
    flat = int(excess.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), e.shape))
    av, ev, ae = float(a.flatten()[flat]), float(e.flatten()[flat]), float(err.flatten()[flat])
    rel = ae / abs(ev) if ev else float("inf")
    raise AssertionError(
        f"{what}: {int(bad.sum())} of {e.numel()} elements off by more than "
        f"{tol.atol:g} * max|expected| ({tol.atol * scale:.3g}) + {tol.rtol:g} * |expected|\n"
        f"  worst at {where}: actual {av:.6g}, expected {ev:.6g}, abs err {ae:.3g}, rel err {rel:.3g}\n"
        f"  relative L2 error of the whole tensor: {rel_error(a, e):.3g}"
    )


def _as_tuple(out: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (out,) if isinstance(out, Tensor) else tuple(out)


def _grad_outputs(outs: Sequence[Tensor], seed: int) -> list[Tensor]:
    """Seeded random output gradients; 0.37 for scalars (a scale other than 1 tests the scaling)."""
    grads = []
    for i, o in enumerate(outs):
        gen = torch.Generator().manual_seed(seed + i)
        g = torch.full((), 0.37) if o.dim() == 0 else torch.randn(o.shape, generator=gen)
        grads.append(g.to(device=o.device, dtype=o.dtype))
    return grads


def _run(
    ks: KernelSet,
    call: Callable[[KernelSet, list[Tensor]], Any],
    inputs: Sequence[Tensor],
    grad_of: Sequence[bool],
) -> tuple[tuple[Tensor, ...], list[Tensor | None]]:
    """Run ``call`` on fresh leaves; return outputs and input gradients. Checks nothing is modified in place."""
    leaves = [t.detach().clone().requires_grad_(g) for t, g in zip(inputs, grad_of, strict=True)]
    before = [t.detach().clone() for t in leaves]
    grads: list[Tensor | None] = []
    if any(grad_of):
        outs = _as_tuple(call(ks, leaves))
        gouts = _grad_outputs(outs, seed=1234)
        gouts_before = [g.clone() for g in gouts]
        wrt = [t for t, g in zip(leaves, grad_of, strict=True) if g]
        grads = list(torch.autograd.grad(outs, wrt, gouts, allow_unused=True))
        if any(not torch.equal(g, b) for g, b in zip(gouts, gouts_before, strict=True)):
            raise AssertionError(f"{ks.name}: the incoming output gradient was modified in place")
    else:
        with torch.no_grad():
            outs = _as_tuple(call(ks, leaves))
    for i, (t, b) in enumerate(zip(leaves, before, strict=True)):
        if not torch.equal(t.detach(), b):
            raise AssertionError(f"{ks.name}: input {i} was modified in place")
    return tuple(o.detach() for o in outs), grads


def _compare(
    op: str,
    label: str,
    kernels: KernelSet,
    reference: KernelSet | None,
    call: Callable[[KernelSet, list[Tensor]], Any],
    inputs: Sequence[tuple[str, Tensor, bool]],
    out_names: Sequence[str],
) -> None:
    """Outputs and every input gradient of ``kernels`` against the reference, per the tolerance table."""
    ref = reference if reference is not None else reference_kernels()
    dtype = inputs[0][1].dtype
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerances for {dtype}; TOLERANCES covers {', '.join(map(str, TOLERANCES))}")
    tensors = [t for _, t, _ in inputs]
    grad_of = [g for _, _, g in inputs]
    out_a, grads_a = _run(kernels, call, tensors, grad_of)
    out_e, grads_e = _run(ref, call, tensors, grad_of)
    prefix = f"{kernels.name} {op} {label} {str(dtype).removeprefix('torch.')}"
    if len(out_a) != len(out_e):
        raise AssertionError(f"{prefix}: {len(out_a)} outputs, expected {len(out_e)}")
    for name, a, e in zip(out_names, out_a, out_e, strict=True):
        assert_close(a, e, TOLERANCES[dtype][op], f"{prefix}, output {name}")
    wrt = [n for n, _, g in inputs if g]
    for name, ga, ge in zip(wrt, grads_a, grads_e, strict=True):
        if ga is None or ge is None:
            if ga is not ge:
                raise AssertionError(f"{prefix}: gradient of {name} is {ga!r}, expected {ge!r}")
            continue
        assert_close(ga, ge, TOLERANCES[dtype][op + ".grad"], f"{prefix}, gradient of {name}")


def _randn(shape: Sequence[int], seed: int, *, scale: float = 1.0, shift: float = 0.0) -> Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed)) * scale + shift


# --------------------------------------------------------------------------- checks, one per op


def check_rms_norm(
    kernels: KernelSet,
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    reference: KernelSet | None = None,
    eps: float = 1e-6,
) -> None:
    """``rms_norm(x, weight, eps)`` for x of ``shape`` (..., H): output, dx and dweight."""
    x = _randn(shape, 1, scale=3.0, shift=0.5).to(device=device, dtype=dtype)
    w = _randn(shape[-1:], 2, scale=0.2, shift=1.0).to(device=device, dtype=dtype)
    _compare(
        "rms_norm", str(tuple(shape)), kernels, reference,
        lambda ks, t: ks.rms_norm(t[0], t[1], eps), [("x", x, True), ("weight", w, True)], ["y"],
    )  # fmt: skip


def _rope_tables(t: int, d: int) -> tuple[Tensor, Tensor]:
    """Hugging Face style tables: cos/sin of (position * inv_freq) repeated over both halves."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = torch.arange(t, dtype=torch.float32) * 7 + 3  # positions other than 0..T-1
    emb = torch.outer(pos, inv_freq).repeat(1, 2)  # (T, D)
    return emb.cos(), emb.sin()


def check_rope(
    kernels: KernelSet,
    shape: tuple[int, int, int, int, int],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    layout: str = "bhtd",
    reference: KernelSet | None = None,
) -> None:
    """``rope(q, k, cos, sin)`` for (B, Hq, Hk, T, D): both outputs, dq and dk.

    ``layout`` "bthd" hands in q and k as transposed views of (B, T, heads, D)
    tensors, as a decoder does after its projections.
    """
    b, hq, hk, t, d = shape
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"layout must be one of {ROPE_LAYOUTS}, got {layout!r}")

    def make(heads: int, seed: int) -> Tensor:
        if layout == "bhtd":
            return _randn((b, heads, t, d), seed).to(device=device, dtype=dtype)
        return _randn((b, t, heads, d), seed).to(device=device, dtype=dtype).transpose(1, 2)

    cos, sin = (x.to(device=device, dtype=dtype) for x in _rope_tables(t, d))
    _compare(
        "rope", f"{shape} {layout}", kernels, reference,
        lambda ks, x: ks.rope(x[0], x[1], cos, sin), [("q", make(hq, 3), True), ("k", make(hk, 4), True)],
        ["q", "k"],
    )  # fmt: skip


def check_swiglu(
    kernels: KernelSet,
    shape: Sequence[int],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    reference: KernelSet | None = None,
) -> None:
    """``swiglu(gate, up)``: output, dgate and dup."""
    gate = _randn(shape, 5, scale=2.0).to(device=device, dtype=dtype)
    up = _randn(shape, 6).to(device=device, dtype=dtype)
    _compare(
        "swiglu", str(tuple(shape)), kernels, reference,
        lambda ks, x: ks.swiglu(x[0], x[1]), [("gate", gate, True), ("up", up, True)], ["out"],
    )  # fmt: skip


def check_attention(
    kernels: KernelSet,
    shape: tuple[int, int, int, int, int, int | None],
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    reference: KernelSet | None = None,
) -> None:
    """Causal (optionally sliding-window) GQA ``attention(q, k, v)``: output, dq, dk and dv."""
    b, hq, hk, t, d, window = shape
    q = _randn((b, hq, t, d), 7).to(device=device, dtype=dtype)
    k = _randn((b, hk, t, d), 8).to(device=device, dtype=dtype)
    v = _randn((b, hk, t, d), 9).to(device=device, dtype=dtype)
    _compare(
        "attention", str(shape), kernels, reference,
        lambda ks, x: ks.attention(x[0], x[1], x[2], scale=d**-0.5, window=window),
        [("q", q, True), ("k", k, True), ("v", v, True)], ["out"],
    )  # fmt: skip


def _labels(case: LinearCECase) -> Tensor:
    y = torch.randint(0, case.vocab, (case.tokens,), generator=torch.Generator().manual_seed(10))
    if case.ignored == "every3":
        y[::3] = IGNORE_INDEX
    elif case.ignored == "first_chunk":
        y[: case.chunk or case.tokens] = IGNORE_INDEX
        y[::3] = IGNORE_INDEX
    elif case.ignored == "all":
        y[:] = IGNORE_INDEX
    elif case.ignored != "none":
        raise ValueError(f"ignored must be none, every3, first_chunk or all, got {case.ignored!r}")
    return y


def check_linear_cross_entropy(
    kernels: KernelSet,
    case: LinearCECase,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    reduction: str = "sum",
    reference: KernelSet | None = None,
) -> None:
    """``linear_cross_entropy(hidden, weight, labels)``: the loss and the gradients ``case.grads`` asks for."""
    h = _randn((case.tokens, case.hidden), 11).to(device=device, dtype=dtype)
    w = _randn((case.vocab, case.hidden), 12, scale=0.5).to(device=device, dtype=dtype)
    y = _labels(case).to(device)
    grads = {"both": (True, True), "hidden": (True, False), "none": (False, False)}[case.grads]
    _compare(
        "linear_cross_entropy", f"{case} {reduction}", kernels, reference,
        lambda ks, x: ks.linear_cross_entropy(
            x[0], x[1], y, ignore_index=IGNORE_INDEX, chunk_size=case.chunk, reduction=reduction
        ),
        [("hidden", h, grads[0]), ("weight", w, grads[1])], ["loss"],
    )  # fmt: skip


# --------------------------------------------------------------------------- the whole suite


@dataclass(frozen=True, slots=True)
class Case:
    """One conformance check: an op, its parameters and a dtype. ``str(case)`` is a test id."""

    op: str
    params: Any
    dtype: torch.dtype
    variant: str = ""  # rope layout, or cross-entropy reduction

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        params = str(self.params).replace(" ", "")
        return "-".join(p for p in (self.op, params, self.variant, dt) if p)

    def check(
        self, kernels: KernelSet, device: str | torch.device, reference: KernelSet | None = None
    ) -> None:
        """Run this check; raises AssertionError with the details on a mismatch."""
        common: dict[str, Any] = {"dtype": self.dtype, "device": device, "reference": reference}
        if self.op == "rms_norm":
            check_rms_norm(kernels, self.params, **common)
        elif self.op == "rope":
            check_rope(kernels, self.params, layout=self.variant, **common)
        elif self.op == "swiglu":
            check_swiglu(kernels, self.params, **common)
        elif self.op == "attention":
            check_attention(kernels, self.params, **common)
        elif self.op == "linear_cross_entropy":
            check_linear_cross_entropy(kernels, self.params, reduction=self.variant, **common)
        else:
            raise ValueError(
                f"unknown op {self.op!r}; ops: rms_norm, rope, swiglu, attention, linear_cross_entropy"
            )


def conformance_cases(dtypes: Sequence[torch.dtype] = (torch.float32,)) -> list[Case]:
    """Every check of the suite for each dtype, in a stable order."""
    cases: list[Case] = []
    for dt in dtypes:
        cases += [Case("rms_norm", s, dt) for s in RMS_NORM_SHAPES]
        cases += [Case("rope", s, dt, layout) for s in ROPE_SHAPES for layout in ROPE_LAYOUTS]
        cases += [Case("swiglu", s, dt) for s in SWIGLU_SHAPES]
        cases += [Case("attention", s, dt) for s in ATTENTION_SHAPES]
        cases += [Case("linear_cross_entropy", c, dt, r) for c in LINEAR_CE_CASES for r in ("sum", "mean")]
    return cases


def check_kernel_set(
    kernels: KernelSet,
    device: str | torch.device,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    *,
    reference: KernelSet | None = None,
) -> int:
    """Run every conformance case; return how many ran, or raise one AssertionError listing every failure."""
    if not isinstance(kernels, KernelSet):
        raise TypeError(f"{kernels!r} does not implement slidekit.interfaces.KernelSet")
    failures: list[str] = []
    cases = conformance_cases(dtypes)
    for case in cases:
        try:
            case.check(kernels, device, reference)
        except Exception as exc:  # a crash in one op must not hide the results of the others
            kind = "" if isinstance(exc, AssertionError) else f"{type(exc).__name__}: "
            failures.append(f"[{case}] {kind}{exc}")
    if failures:
        raise AssertionError(
            f"kernel set {kernels.name!r} failed {len(failures)} of {len(cases)} conformance checks:\n"
            + "\n".join(failures)
        )
    return len(cases)
