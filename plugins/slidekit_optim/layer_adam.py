"""The ``layer_adam`` optimizer: AdamW over one unit's flat FP32 master, on the CPU.

Per element, with ``t`` the unit's update count (``count``)::

    p <- p * (1 - lr * wd)                              (decoupled decay, per group)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

which is ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected steps):
after 100 steps the two differ by about 1e-8 relative in the parameters and
1e-7 in the moments. State: two FP32 vectors, 8 bytes per parameter. The
gradient may be FP32 or BF16 (upcast exactly); ``lowp_out`` receives the
updated parameters rounded to BF16 (nearest even).

Two implementations, chosen by ``LayerAdam(hyper, impl=...)``:

* ``"cpp"``: the fused kernel in ``csrc/fused_adam.cpp``. One pass per element
  (read the gradient, decay, both moments, the step, write the master and the
  BF16 copy), vectorized, on torch's intra-op threads, no temporaries, with
  the GIL released so the engine's other threads run meanwhile. It is
  compiled on first use (the first ``LayerAdam`` made in a process, when no
  cached build exists) with ``torch.utils.cpp_extension`` (a C++ compiler and
  ninja are needed) for the CPU capability torch dispatches to, and cached in
  the torch extensions directory (``TORCH_EXTENSIONS_DIR`` moves it), or ahead
  of time by ``slidekit build``. ``kernel_build`` does the building: a build
  killed halfway is taken over by the next one, and a wait for another
  process's build gives up after ``SLIDEKIT_BUILD_TIMEOUT`` seconds (300),
  which counts as a failed build.
* ``"torch"``: the same sequence of operations as torch ops, over chunks of
  2^19 elements, so that its temporaries stay a few MB (cache-resident).
* ``"auto"`` (default): ``cpp``, or ``torch`` with one logged warning saying
  why when the kernel cannot be built.

Tensors on a GPU (units the engine keeps resident on the device) take the
fused Triton kernel of ``adam_triton.py`` on the current stream: the C++
kernel's operation sequence with correctly rounded divide and square root and
no FMA contraction, so bitwise the CPU's results. Where Triton is missing, or
with ``impl="torch"``, they take the torch path in chunks of 2^24 elements
(also bitwise: every one of its operations is correctly rounded on a GPU too).

Both compute every element with the same IEEE-754 FP32 operations in the same
order (listed in the kernel's header comment): ``m + w1 * (g - m)`` and
``v * beta2 + (w2 * g) * g`` as separate multiplies and adds, a correctly
rounded square root times ``1 / sqrt(1 - beta2^t)`` (a multiplication where
AdamW divides: one slow operation fewer per element), no fused multiply-add.
So they agree bitwise on every element, whatever the vector width, ATen CPU
capability or thread count (NaN payloads of the BF16 copy aside). Neither can
agree bitwise with ``torch.optim.AdamW`` itself: its ``lerp_``/``addcmul_``
round once or twice depending on how torch was compiled, and torch's FP32
``sqrt`` on x86 calls MKL's vector math, which is not correctly rounded (the
torch path here takes its square root in FP64, which then rounds to the
correctly rounded FP32 result).

Speculative clipping's buffers (``slidekit_optim.backup``; one of the two per step, refused together):

* ``fused_backup = True`` (``slidekit.interfaces.FusedBackupOptimizer``):
  ``step(..., backup_out={"master": ..., "exp_avg": ..., "exp_avg_sq": ...})`` also writes the values
  master and moments hold before the update there. The kernel does it in the update's pass, tile by
  tile (128 elements, L1-resident) right before updating the tile, with streaming stores where the
  build has AVX-512 or AVX (``csrc/backup_copy.h``): 12 more bytes written per parameter, 40 in all,
  where the engine's former copy added 24 of traffic and its cold reads.
* ``fused_update_out = True``: ``step(..., update_out={...})``, the same names and sizes, receives the
  updated master and moments, and ``master`` and ``state`` keep their values (``lowp_out`` gets the
  new weights as usual); the engine swaps the two sets when its bet wins. The kernel updates each
  tile from the sources into an L1 scratch, with the same per-element update as in place, and copies
  the scratch out to ``update_out`` with streaming stores: it reads the sources and writes the
  outputs, never the sources, so it moves the bytes of the update in place (28 per parameter with a
  BF16 gradient and the BF16 copy, where the fused backup moves 40), and the streaming stores spare
  the outputs' reads for ownership.

The torch path and tensors on a GPU copy the sources into the buffers first, then update in place: the
sources for a backup, the copies for ``update_out``. Either way every bit written is what the update
in place writes, and the backup is the old bytes (``slidekit_optim.backup`` checks the buffers).

Threads: the kernel runs on torch's intra-op pool (``at::parallel_for``, so
``torch.get_num_threads()`` threads), one contiguous slice per thread.
``OptimizerHyper.threads`` caps how many take part (at most torch's count);
nothing global changes. The torch path cannot honour it without changing
torch's global thread count, so it ignores it.

Test: ``pytest tests/plugins/test_layer_adam.py tests/plugins/test_update_out.py``.
Speed: ``python benchmarks/optimizer_rate.py --numel 20000000``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Literal

import torch

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, OptimizerDescriptor, OptimizerHyper, ParamGroupRange
from slidekit_optim.backup import check_step_buffers, copy_sources
from slidekit_optim.kernel_build import (
    KERNEL_SOURCE,
    KernelUnavailable,
    kernel_status,
    load_kernel,
    load_or_fallback,
    prepare_kernel,
)

__all__ = [
    "KERNEL_SOURCE",
    "Impl",
    "KernelUnavailable",
    "LayerAdam",
    "kernel_status",
    "load_kernel",
    "load_or_fallback",
]

log = logging.getLogger(__name__)

Impl = Literal["auto", "cpp", "torch"]
_IMPLS: tuple[str, ...] = ("auto", "cpp", "torch")

#: Elements per chunk of the torch path: its temporaries stay a few MB (cache-resident) on the CPU;
#: on a GPU larger chunks keep the number of kernel launches down.
_TORCH_CHUNK = 1 << 19
_DEVICE_CHUNK = 1 << 24


# --------------------------------------------------------------------------- the update


@dataclass(frozen=True, slots=True)
class _StepScalars:
    """One step's constants, as Python floats (both paths round them to FP32 the same way)."""

    w1: float  # 1 - beta1
    beta2: float
    sq_weight: float  # 1 - beta2
    inv_b2: float  # 1 / (1 - beta2^t) ** 0.5
    eps: float
    neg_step: float  # -lr / (1 - beta1^t)

    def values(self) -> tuple[float, ...]:
        """The scalars in the order both kernels take them."""
        return (self.w1, self.beta2, self.sq_weight, self.inv_b2, self.eps, self.neg_step)


def _scalars(hyper: OptimizerHyper, lr: float, count: int) -> _StepScalars:
    b1, b2 = hyper.betas
    return _StepScalars(
        w1=1 - b1,
        beta2=b2,
        sq_weight=1 - b2,
        inv_b2=1 / (1 - b2**count) ** 0.5,
        eps=hyper.eps,
        neg_step=-(lr / (1 - b1**count)),
    )


def _check_hyper(hyper: OptimizerHyper, impl: str) -> None:
    """What every bundled AdamW (layer_adam, adamw_8bit, adamw_fp8) refuses at construction, naming
    the bad value and the valid range."""
    b1, b2 = hyper.betas
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {hyper.betas}")
    if hyper.eps <= 0:
        raise ValueError(f"eps must be > 0, got {hyper.eps}")
    if hyper.threads is not None and hyper.threads < 1:
        raise ValueError(f"threads must be >= 1 or None (torch's setting), got {hyper.threads}")
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {', '.join(_IMPLS)}; got {impl!r}")


#: A range of the unit and its decay factor (1 - lr * wd), None where it does not decay.
_Segment = tuple[int, int, float | None]


def _segments(groups: Sequence[ParamGroupRange], n: int, lr: float) -> list[_Segment]:
    """The groups as ordered ranges that tile [0, n); elements in no group do not decay."""
    out: list[_Segment] = []
    pos = 0
    for g in sorted(groups, key=lambda g: (g.start, g.stop)):
        if not 0 <= g.start <= g.stop <= n:
            raise ValueError(f"group range [{g.start}, {g.stop}) lies outside the unit's [0, {n})")
        if g.start < pos:
            raise ValueError(f"group ranges overlap at element {g.start}; groups must be disjoint")
        if g.start == g.stop:
            continue
        if g.start > pos:
            out.append((pos, g.start, None))
        out.append((g.start, g.stop, 1 - lr * g.weight_decay if g.weight_decay else None))
        pos = g.stop
    if pos < n:
        out.append((pos, n, None))
    return out


def _torch_update(
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lowp_out: torch.Tensor | None,
    segments: Sequence[_Segment],
    s: _StepScalars,
) -> None:
    """The kernel's operation sequence as torch ops, chunk by chunk; each op is one IEEE op per element."""
    n = master.numel()
    chunk = _TORCH_CHUNK if master.device.type == "cpu" else _DEVICE_CHUNK
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        p, mc, vc = master[a:b], m[a:b], v[a:b]
        for start, stop, decay in segments:
            if decay is not None and start < b and stop > a:
                master[max(start, a) : min(stop, b)].mul_(decay)
        g = grad[a:b] if grad.dtype == torch.float32 else grad[a:b].float()
        mc.add_((g - mc).mul_(s.w1))  # m + w1 * (g - m)
        vc.mul_(s.beta2).add_(torch.mul(g, s.sq_weight).mul_(g))  # v * beta2 + (w2 * g) * g
        # sqrt in FP64 (error < 1 ulp there) then rounded to FP32 is the correctly rounded FP32 sqrt.
        denom = torch.sqrt(vc.double()).float().mul_(s.inv_b2).add_(s.eps)  # sqrt(v) * inv_b2 + eps
        p.add_(torch.mul(mc, s.neg_step).div_(denom))  # p + (neg_step * m) / den
        if lowp_out is not None:
            lowp_out[a:b].copy_(p)


def _slices(
    a: int,
    b: int,
    master: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lowp_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Elements [a, b) of the vectors a kernel call updates."""
    return master[a:b], grad[a:b], m[a:b], v[a:b], None if lowp_out is None else lowp_out[a:b]


def _check_inputs(
    master: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lowp_out: torch.Tensor | None
) -> None:
    n = master.numel()
    wanted = {"master": (master, (torch.float32,)), "grad": (grad, (torch.float32, torch.bfloat16))}
    wanted |= {"exp_avg": (m, (torch.float32,)), "exp_avg_sq": (v, (torch.float32,))}
    if lowp_out is not None:
        wanted["lowp_out"] = (lowp_out, (torch.bfloat16,))
    for name, (t, dtypes) in wanted.items():
        if t.dtype not in dtypes:
            raise TypeError(f"layer_adam: {name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if t.dim() != 1 or t.numel() != n:
            raise ValueError(
                f"layer_adam: {name} must be a flat vector of {n} elements, got {tuple(t.shape)}"
            )
        if t.device != master.device or not t.is_contiguous():
            raise ValueError(
                f"layer_adam: {name} must be a contiguous tensor on the master's device {master.device} "
                f"(it is on {t.device})"
            )
    if n == 0:
        return
    spans = sorted((t.data_ptr(), t.data_ptr() + n * t.element_size(), k) for k, (t, _) in wanted.items())
    reach, owner = spans[0][1], spans[0][2]
    for start, end, name in spans[1:]:
        if start < reach:
            raise ValueError(f"layer_adam: {owner} and {name} overlap in memory; pass separate buffers")
        reach, owner = max((reach, owner), (end, name))


class LayerAdam:
    """AdamW with FP32 moments over a flat vector.

    ``impl``: "auto" (fused C++ kernel, else pure torch with a warning), "cpp"
    (the kernel or ``KernelUnavailable`` saying why not), "torch" (pure torch).
    The kernel is built or loaded here, when the optimizer is made, so a first
    build never runs inside a training step. ``kernel_source`` builds it from
    another file (tests use it to exercise a failing build). ``self.impl`` says
    which path runs.
    """

    name = "layer_adam"
    #: ``step`` also takes tensors on a GPU (units the engine keeps resident there): a fused Triton pass there.
    device_update = True
    #: Per-element moments: the state of parameters [a, a + m) is elements [a, a + m) of each moment.
    linear_state = True
    #: ``step`` takes ``backup_out`` (speculative clipping): the kernel writes it in the update's pass.
    fused_backup = True
    #: ``step`` takes ``update_out`` (speculative clipping): the kernel writes the update there instead of
    #: in place, in one pass that writes no more bytes than the update in place.
    fused_update_out = True

    def __init__(
        self, hyper: OptimizerHyper, *, impl: Impl = "auto", kernel_source: Path | str | None = None
    ) -> None:
        _check_hyper(hyper, impl)
        self.hyper = hyper
        self.requested_impl: Impl = impl
        self._source = Path(kernel_source) if kernel_source is not None else KERNEL_SOURCE
        self._kernel: ModuleType | None = load_or_fallback(self._source, impl, "layer_adam")
        self.impl: str = "cpp" if self._kernel is not None else "torch"  # the path in use

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]:
        return {"exp_avg": (torch.float32, numel), "exp_avg_sq": (torch.float32, numel)}

    def step(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        state: Mapping[str, torch.Tensor],
        *,
        lr: float,
        count: int,
        groups: Sequence[ParamGroupRange],
        lowp_out: torch.Tensor | None = None,
        backup_out: Mapping[str, torch.Tensor] | None = None,
        update_out: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """One update of the unit, in place, ``lowp_out`` (BF16) receiving the new weights.

        Speculative clipping's buffers ("master", "exp_avg", "exp_avg_sq", each a contiguous vector of
        its source's dtype and size, overlapping no input; one or neither): ``backup_out`` receives the
        values before the update (``fused_backup``); ``update_out`` receives the updated values instead
        of ``master`` and ``state``, which keep theirs (``fused_update_out``). Same bits either way."""
        if count < 1:
            raise ValueError(f"count is the 1-based update number, got {count}")
        m, v = state["exp_avg"], state["exp_avg_sq"]
        _check_inputs(master, grad, m, v, lowp_out)
        moments = {"exp_avg": m, "exp_avg_sq": v}
        extra, out_of_place = check_step_buffers(
            "layer_adam",
            master,
            moments,
            {"grad": grad, "lowp_out": lowp_out},
            backup_out=backup_out,
            update_out=update_out,
        )
        segments = _segments(groups, master.numel(), lr)
        s = _scalars(self.hyper, lr, count)
        if extra is not None and (master.device.type != "cpu" or self.impl == "torch"):
            # The paths without the kernel: copy, then update in place; out of place, the copies.
            copy_sources(extra, master, moments)
            if out_of_place:
                master, m, v = extra["master"], extra["exp_avg"], extra["exp_avg_sq"]
            extra = None
        if master.device.type != "cpu":
            fused = None if self.requested_impl == "torch" else _device_kernel()
            if fused is None:
                _torch_update(master, grad, m, v, lowp_out, segments, s)
                return
            for a, b, decay in segments:
                fused(*_slices(a, b, master, grad, m, v, lowp_out), decay, *s.values())
            return
        if self.impl == "torch":
            _torch_update(master, grad, m, v, lowp_out, segments, s)
            return
        self._kernel_update(master, grad, m, v, lowp_out, segments, s, extra, out_of_place)

    def _kernel_update(
        self,
        master: torch.Tensor,
        grad: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        lowp_out: torch.Tensor | None,
        segments: Sequence[_Segment],
        s: _StepScalars,
        extra: Mapping[str, torch.Tensor] | None,
        out_of_place: bool,
    ) -> None:
        """The C++ kernel over each decay segment; ``extra`` (checked) is the backup, or with
        ``out_of_place`` where the update goes, both written in the kernel's pass."""
        assert self._kernel is not None
        max_tasks = self.hyper.threads or 0
        buffers = () if extra is None else tuple(extra[k] for k in ("master", "exp_avg", "exp_avg_sq"))
        for a, b, decay in segments:
            self._kernel.fused_adamw_(
                *_slices(a, b, master, grad, m, v, lowp_out),
                decay is not None,
                1.0 if decay is None else decay,
                *s.values(),
                max_tasks,
                *(t[a:b] for t in buffers),
                out_of_place=out_of_place,
            )


@functools.cache
def _device_kernel() -> Callable[..., None] | None:
    """The fused Triton update for GPU tensors, or None (logged once) where Triton cannot be imported."""
    try:
        from slidekit_optim.adam_triton import fused_adamw_
    except ImportError as exc:
        log.warning("layer_adam: Triton is unavailable (%s); GPU-resident units take the torch path", exc)
        return None
    return fused_adamw_


def _availability() -> Availability:
    return True, kernel_status()


@hookimpl
def slidekit_optimizers() -> Iterator[OptimizerDescriptor]:
    yield OptimizerDescriptor(
        name="layer_adam",
        factory=LayerAdam,
        available=_availability,
        priority=100,
        devices=("cpu", "cuda", "rocm"),
        description="AdamW with FP32 moments, updated per unit on the CPU (fused C++ kernel or pure torch)",
        prepare=prepare_kernel,  # slidekit build: compile the fused kernel ahead of time
    )
