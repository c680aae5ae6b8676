"""The ``adamw_8bit`` optimizer: AdamW whose moments are stored in 8 bits, block-wise quantized.

AdamW as in ``layer_adam`` (and ``torch.optim.AdamW``), with ``t`` = ``count``::

    p <- p * (1 - lr * wd)                              (decoupled decay, per group)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

but ``m`` and ``v`` live between steps as block-wise quantized 8-bit codes
(Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022):
blocks of 256 elements, each with an FP32 absmax scale and one byte per
element indexing a dynamic map (signed for ``m``, unsigned for ``v``; see
``slidekit_optim.quant8`` for the maps and the encoding). Each step, per
block: decode ``m`` and ``v`` to FP32, apply the update above with them in
FP32 (so the new parameters see the exact new moments), then re-encode the
new moments to the nearest codes under the block's new absmax. For ``v``, a
nonzero value never rounds to 0 (``keep_nonzero``, why: see ``quant8``).

State per parameter: 2 bytes of codes + 2 * 4 / 256 bytes of scales =
2.03 bytes, against 8 for ``layer_adam``. An all-zero state (what the engine
hands the first step) has every scale 0 and so decodes to zero moments.

Two implementations, chosen by ``AdamW8bit(hyper, impl=...)`` exactly as in
``layer_adam`` (same build machinery, same cache, same switch):

* ``"cpp"``: the fused kernel in ``csrc/adamw8.cpp`` (built by
  ``kernel_build``, or ahead of time by ``slidekit build``). One pass, block by
  block, on torch's intra-op threads (``at::parallel_for``; at most
  ``OptimizerHyper.threads`` of them take part, nothing global changes), the
  GIL released: decode both moments into a 1 KiB stack buffer each, update,
  write the master and the BF16 copy, find the new scales and write the new
  codes, looked up in the maps' packed tables (``QuantMap.packed``, one int32
  per element from ~42 KB). Built on first use (the first ``AdamW8bit`` made
  in a process when no cached build exists) for the CPU capability torch
  dispatches to; for AVX-512, 16 elements at a time in zmm registers.
* ``"torch"``: the reference. Vectorised torch ops over chunks of whole
  blocks (``chunk`` elements, 1 Mi by default) through scratch buffers
  allocated once per step, so memory beyond the state never grows with the
  unit. It cannot honour ``threads`` without changing torch's global setting,
  so it ignores it; torch runs its table lookups on one thread.
* ``"auto"`` (default): ``cpp``, or ``torch`` with one logged warning saying
  why when the kernel cannot be built.

Both compute every element with the same IEEE-754 FP32 operations in the same
order, those of ``layer_adam`` (listed in the kernel's header comment):
``m + w1 * (g - m)`` and ``v * beta2 + (w2 * g) * g`` as separate multiplies
and adds, a correctly rounded square root (the torch path takes it in FP64:
torch's FP32 ``sqrt`` is not correctly rounded on x86) times
``1 / sqrt(1 - beta2^t)``, then ``p + (-step * m) / den``; decoding is one
multiply, re-encoding one division by the block's scale and quant8's table
lookup (equal to nearest-value search with ties to the smaller code; the
kernel reads the same tables packed). So the two give the same master, BF16
copy, codes and scales bit for bit, whatever the vector width, ATen CPU
capability, thread count or chunk size (NaN inputs aside: both produce NaN,
not necessarily the same NaN). Earlier versions of
the torch path used ``lerp_``, ``addcmul_``, ``addcdiv_`` and FP32 ``sqrt``,
whose rounding depends on how torch was built (fused multiply-adds, MKL's
vector math); the sequence above rounds the same everywhere, and differs from
those by a few FP32 roundings, far inside the quantization error the tests
allow against float64 AdamW.

Tensors on a GPU (units the engine keeps resident on the device,
``device_update``) take the fused Triton kernel of ``adamw8_triton.py`` on
the current stream: the C++ kernel's operation sequence, decoding and
encoding (same maps and tables, so ``keep_nonzero`` and ties alike), block
maxima and BF16 rounding, with correctly rounded divide and square root and
no FMA contraction, so bitwise the CPU's results. Where Triton is missing,
or with ``impl="torch"``, they take the torch path on the device (also
bitwise: each of its operations is correctly rounded on a GPU too). The maps
go to each device once (1.4 MB for both) and are shared by every unit there.

Speculative clipping's buffers (``slidekit_optim.backup``), "master" and the four state buffers, one
set per step (both at once are refused):

* ``backup_out`` (``fused_backup = True``) receives the values before the update. The C++ kernel copies
  each block's master and codes (streaming stores where the build has AVX-512 or AVX,
  ``csrc/backup_copy.h``) and its two scales right before decoding it: 6 more bytes written per
  parameter.
* ``update_out`` (``fused_update_out = True``) receives the updated values, and ``master`` and
  ``state`` keep theirs (``lowp_out`` gets the new weights as usual); the engine swaps the two sets
  when its bet wins. The C++ kernel decodes and updates each block from master and state as in place,
  but writes its new master and codes into an L1 scratch, which it streams out to ``update_out`` with
  the new scales: the bytes of the update in place, the outputs written instead of the sources.

The torch path and the Triton kernel copy the sources into the buffers first, then update in place: the
sources for a backup, the copies for ``update_out``. Every bit written is what the update in place
writes, and the backup is the old bytes.

A resident unit costs 10.03 bytes per parameter of device memory in BF16
training: the FP32 master (4), the state (2.03), the BF16 weights (2) and
gradients (2), against 16 with ``layer_adam`` (14.03 and 20 in FP32
training, whose weights and gradients take 4 bytes each). The Triton kernel
needs nothing more; the torch path allocates ``chunk`` * 32 bytes of scratch
per call (32 MiB by default). The first step from a zero state is AdamW's up to
FP32 rounding: no quantization error enters until the moments are stored.

Test: ``pytest tests/plugins/test_adamw_8bit.py tests/plugins/test_adamw8_kernel.py
tests/plugins/test_adamw8_triton.py tests/plugins/test_fused_backup.py tests/plugins/test_update_out.py``.
Speed: ``python benchmarks/optimizer_rate.py --numel 20000000``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, OptimizerDescriptor, OptimizerHyper, ParamGroupRange
from slidekit_optim.backup import check_step_buffers, copy_sources
from slidekit_optim.kernel_build import CSRC, kernel_status, load_or_fallback, prepare_kernel
from slidekit_optim.layer_adam import Impl, _check_hyper, _scalars, _Segment, _segments, _StepScalars
from slidekit_optim.quant8 import (
    BLOCK_SIZE,
    QuantMap,
    dequantize_blockwise,
    dynamic_map,
    num_blocks,
    quantize_blockwise,
)

__all__ = ["DEFAULT_CHUNK", "KERNEL_SOURCE", "AdamW8bit"]

log = logging.getLogger(__name__)


#: The fused kernel's source; ``AdamW8bit(kernel_source=...)`` builds another one instead.
KERNEL_SOURCE = CSRC / "adamw8.cpp"

#: Elements per chunk of the torch path: 4 MiB per FP32 scratch buffer. A multiple of the block size.
DEFAULT_CHUNK = 1 << 20


@dataclass(slots=True)
class _Scratch:
    """Per-step scratch of the torch path, ``chunk`` elements each: reused by every chunk of the unit."""

    grad: Tensor  # FP32 copy of a BF16 gradient chunk
    m: Tensor
    v: Tensor
    tmp: Tensor  # FP32: update temporaries, then the scaled moments while re-encoding
    thr: Tensor  # FP32: the step's numerator, then the lookup thresholds
    wide: Tensor  # FP64: the square root
    index: Tensor  # int32: code indices / lookup keys

    @classmethod
    def allocate(cls, n: int, device: torch.device) -> _Scratch:
        f32 = [torch.empty(n, device=device) for _ in range(5)]
        return cls(
            grad=f32[0],
            m=f32[1],
            v=f32[2],
            tmp=f32[3],
            thr=f32[4],
            wide=torch.empty(n, dtype=torch.float64, device=device),
            index=torch.empty(n, dtype=torch.int32, device=device),
        )


class AdamW8bit:
    """AdamW with block-wise 8-bit quantized moments over a flat vector.

    ``impl``: "auto" (fused C++ kernel, else pure torch with a warning), "cpp"
    (the kernel or ``KernelUnavailable`` saying why not), "torch" (pure torch).
    The kernel is built or loaded here, when the optimizer is made, so a first
    build never runs inside a training step. ``kernel_source`` builds it from
    another file. ``chunk`` sets the torch path's chunk. ``self.impl`` says
    which path runs on the CPU. Tensors on a GPU take the Triton kernel, or
    the torch path with ``impl="torch"`` or without Triton. ``m_map``/``v_map``
    are read at every step.
    """

    name = "adamw_8bit"
    #: ``step`` also takes tensors on a GPU (units the engine keeps resident there): a fused Triton pass there.
    device_update = True
    #: Blocks of 256 divide slidekit's granule (4096): the state of parameters [a, a + m), a a multiple
    #: of it, is codes [a, a + m) and scales [a / 256, a / 256 + ceil(m / 256)).
    linear_state = True
    #: ``step`` takes ``backup_out`` (speculative clipping): the C++ kernel writes it block by block.
    fused_backup = True
    #: ``step`` takes ``update_out`` (speculative clipping): the C++ kernel writes the update there block by
    #: block instead of in place, in one pass that writes no more bytes than the update in place.
    fused_update_out = True
    #: Tests only: send CPU tensors down the GPU path too (the Triton kernel then needs TRITON_INTERPRET=1).
    _device_path_on_cpu = False

    def __init__(
        self,
        hyper: OptimizerHyper,
        *,
        chunk: int = DEFAULT_CHUNK,
        impl: Impl = "auto",
        kernel_source: Path | str | None = None,
    ) -> None:
        _check_hyper(hyper, impl)
        _check_chunk(chunk)
        self.hyper = hyper
        self.chunk = chunk
        self.m_map: QuantMap = dynamic_map(signed=True)
        self.v_map: QuantMap = dynamic_map(signed=False, keep_nonzero=True)
        self.requested_impl: Impl = impl
        self._source = Path(kernel_source) if kernel_source is not None else KERNEL_SOURCE
        self._kernel: ModuleType | None = load_or_fallback(self._source, impl, "adamw_8bit")
        self.impl: str = "cpp" if self._kernel is not None else "torch"  # the path in use
        self._device_maps: dict[torch.device, tuple[QuantMap, QuantMap, QuantMap, QuantMap]] = {}
        self._device_maps_lock = threading.Lock()

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]:
        blocks = num_blocks(numel)
        return {
            "exp_avg_codes": (torch.uint8, numel),
            "exp_avg_absmax": (torch.float32, blocks),
            "exp_avg_sq_codes": (torch.uint8, numel),
            "exp_avg_sq_absmax": (torch.float32, blocks),
        }

    def step(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        *,
        lr: float,
        count: int,
        groups: Sequence[ParamGroupRange],
        lowp_out: Tensor | None = None,
        backup_out: Mapping[str, Tensor] | None = None,
        update_out: Mapping[str, Tensor] | None = None,
    ) -> None:
        """One update of the unit, in place, ``lowp_out`` receiving the new weights.

        Speculative clipping's buffers ("master" and each state name, each a contiguous vector of its
        source's dtype and size, overlapping no input; one or neither): ``backup_out`` receives the
        values before the update (``fused_backup``); ``update_out`` receives the updated values instead
        of ``master`` and ``state``, which keep theirs (``fused_update_out``). Same bits either way."""
        if count < 1:
            raise ValueError(f"count is the 1-based update number, got {count}")
        _check_unit(
            "adamw_8bit",
            self.state_layout(master.numel()),
            master,
            grad,
            state,
            lowp_out,
            devices=("cpu", "cuda"),  # ROCm GPUs are "cuda" devices to torch
            where="on the CPU or a CUDA/ROCm GPU",
            device_fix="keep the unit on the host or on the GPU",
        )
        layout = {k: state[k] for k in self.state_layout(0)}
        extra, out_of_place = check_step_buffers(
            "adamw_8bit",
            master,
            layout,
            {"grad": grad, "lowp_out": lowp_out},
            backup_out=backup_out,
            update_out=update_out,
        )
        n = master.numel()
        grad = grad.reshape(-1)  # a view when contiguous
        segments = _segments(groups, n, lr)
        scalars = _scalars(self.hyper, lr, count)
        m_map, v_map = self._maps_on(master.device)
        fused: tuple[Callable[..., object], tuple[Tensor, ...], tuple[object, ...]] | None = None
        # Where the new weights end up, for a lowp_out the kernel cannot write: out of place, update_out's.
        updated = extra["master"] if extra is not None and out_of_place else master
        if master.device.type != "cpu" or self._device_path_on_cpu:
            triton = None if self.requested_impl == "torch" else _device_kernel()
            if triton is not None:  # the Triton kernel reads quant8's two lookup tables
                maps = tuple(t for q in (m_map, v_map) for t in (q.values, q.table, q.threshold))
                fused = (triton, maps, ())
        elif self._kernel is not None:  # the C++ kernel reads their packed form, and takes a thread cap
            maps = tuple(t for q in (m_map, v_map) for t in (q.values, q.packed))
            fused = (self._kernel.adamw8_step_, maps, (self.hyper.threads or 0,))
            if extra is not None:  # the kernel writes the backup, or the update out of place, in its pass
                buffers = tuple(extra[k] for k in ("master", *layout))
                fused = (fused[0], maps, (*fused[2], *buffers, out_of_place))
                extra = None
        if extra is not None:  # the Triton kernel and the torch path: copy, then update in place
            copy_sources(extra, master, layout)
            if out_of_place:  # the copies
                master, state = extra["master"], {k: extra[k] for k in layout}
        if fused is not None:
            self._step_fused(*fused, master, grad, state, segments, scalars, lowp_out, updated)
            return
        scratch = _Scratch.allocate(min(self.chunk, n), master.device)
        for start in range(0, n, self.chunk):
            stop = min(start + self.chunk, n)
            self._step_chunk(master, grad, state, start, stop, scratch, segments, scalars, m_map, v_map)
        if lowp_out is not None:
            lowp_out.copy_(master.view(lowp_out.shape))

    def _maps_on(self, device: torch.device) -> tuple[QuantMap, QuantMap]:
        """``m_map`` and ``v_map`` with their tensors on ``device``: copied once per device and map."""
        if device.type == "cpu":
            return self.m_map, self.v_map
        with self._device_maps_lock:
            known = self._device_maps.get(device)
            if known is None or known[0] is not self.m_map or known[1] is not self.v_map:
                m, v = (
                    QuantMap(
                        values=q.values.to(device),
                        boundaries=q.boundaries.to(device),
                        table=q.table.to(device),
                        threshold=q.threshold.to(device),
                        packed=q.packed.to(device),
                    )
                    for q in (self.m_map, self.v_map)
                )
                known = self._device_maps[device] = (self.m_map, self.v_map, m, v)
        return known[2], known[3]

    def _step_fused(
        self,
        kernel: Callable[..., object],
        tables: tuple[Tensor, ...],
        extra: tuple[object, ...],
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        segments: Sequence[_Segment],
        s: _StepScalars,
        lowp_out: Tensor | None,
        updated: Tensor,
    ) -> None:
        """The whole unit in one call of a fused kernel: the C++ one or the Triton one. Both take the
        same arguments but for the maps' ``tables`` (the C++ kernel reads the packed form) and the C++
        kernel's thread cap, and its speculative buffers and ``out_of_place`` if any, in ``extra``.
        ``updated``: the master the update leaves its new weights in (``master``, or out of place
        ``update_out``'s), cast into a ``lowp_out`` the kernel cannot write itself."""
        if master.numel() == 0:
            return
        direct = lowp_out is not None and lowp_out.dtype == torch.bfloat16 and lowp_out.is_contiguous()
        kernel(
            master,
            grad if grad.is_contiguous() else grad.contiguous(),
            state["exp_avg_codes"],
            state["exp_avg_absmax"],
            state["exp_avg_sq_codes"],
            state["exp_avg_sq_absmax"],
            lowp_out.view(-1) if direct and lowp_out is not None else None,
            *tables,
            [stop for _, stop, _ in segments],
            [1.0 if decay is None else decay for _, _, decay in segments],  # times 1 changes no bits
            *s.values(),
            *extra,
        )
        if lowp_out is not None and not direct:  # another dtype or layout: cast after the update
            lowp_out.copy_(updated.view(lowp_out.shape))

    def _step_chunk(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        start: int,
        stop: int,
        s: _Scratch,
        segments: Sequence[_Segment],
        c: _StepScalars,
        m_map: QuantMap,
        v_map: QuantMap,
    ) -> None:
        """The torch path for elements [start, stop), a whole number of blocks unless it ends the unit.

        Each op is one IEEE operation per element, in the kernel's order (see the module docstring).
        """
        n = stop - start
        blocks = slice(start // BLOCK_SIZE, num_blocks(stop))
        p = master[start:stop]
        g = grad[start:stop] if grad.dtype == torch.float32 else s.grad[:n].copy_(grad[start:stop])
        m_codes, m_absmax = state["exp_avg_codes"][start:stop], state["exp_avg_absmax"][blocks]
        v_codes, v_absmax = state["exp_avg_sq_codes"][start:stop], state["exp_avg_sq_absmax"][blocks]
        m = dequantize_blockwise(m_codes, m_absmax, m_map, out=s.m[:n], work=s.index)
        v = dequantize_blockwise(v_codes, v_absmax, v_map, out=s.v[:n], work=s.index)

        for lo, hi, decay in segments:  # decoupled weight decay first, as torch.optim.AdamW
            lo, hi = max(lo, start), min(hi, stop)
            if decay is not None and lo < hi:
                master[lo:hi].mul_(decay)
        tmp, num, wide = s.tmp[:n], s.thr[:n], s.wide[:n]
        m.add_(torch.sub(g, m, out=tmp).mul_(c.w1))  # m + w1 * (g - m)
        v.mul_(c.beta2).add_(torch.mul(g, c.sq_weight, out=tmp).mul_(g))  # v * beta2 + (w2 * g) * g
        # sqrt in FP64 (error < 1 ulp there) then rounded to FP32 is the correctly rounded FP32 sqrt.
        denom = tmp.copy_(wide.copy_(v).sqrt_()).mul_(c.inv_b2).add_(c.eps)  # sqrt(v) * inv_b2 + eps
        p.add_(torch.mul(m, c.neg_step, out=num).div_(denom))  # p + (neg_step * m) / den

        work = (s.tmp, s.index, s.thr)  # the denominator and numerator are spent
        quantize_blockwise(m, m_map, codes=m_codes, absmax=m_absmax, work=work)
        quantize_blockwise(v, v_map, codes=v_codes, absmax=v_absmax, work=work)


def _check_chunk(chunk: int) -> None:
    if chunk <= 0 or chunk % BLOCK_SIZE:
        raise ValueError(f"chunk must be a positive multiple of the block size {BLOCK_SIZE}, got {chunk}")


def _check_unit(
    owner: str,
    layout: Mapping[str, tuple[torch.dtype, int]],
    master: Tensor,
    grad: Tensor,
    state: Mapping[str, Tensor],
    lowp_out: Tensor | None,
    *,
    devices: tuple[str, ...],
    where: str,
    device_fix: str,
) -> None:
    """Shapes, dtypes and devices of one ``step``'s tensors, so a wrong buffer fails here instead of
    corrupting state: ``owner`` names the optimizer, ``layout`` is its ``state_layout(n)``, ``devices``
    the device types it updates on, ``where`` says so in words and ``device_fix`` what to do instead."""
    n = master.numel()
    if master.dtype != torch.float32 or master.dim() != 1 or not master.is_contiguous():
        raise ValueError(
            f"{owner}: master must be a contiguous 1-D FP32 tensor, got {master.dtype} {tuple(master.shape)}"
        )
    if grad.numel() != n or grad.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            f"{owner}: grad must hold {n} FP32 or BF16 elements, got {grad.numel()} {grad.dtype}"
        )
    if lowp_out is not None and lowp_out.numel() != n:
        raise ValueError(f"{owner}: lowp_out must hold {n} elements, got {lowp_out.numel()}")
    missing = [k for k in layout if k not in state]
    if missing:
        raise ValueError(f"{owner} state lacks {missing}; allocate it from state_layout(): {sorted(layout)}")
    for name, (dtype, numel) in layout.items():
        t = state[name]
        if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
            raise ValueError(
                f"{owner}: state {name!r} must be a contiguous {dtype} tensor of {numel} elements, "
                f"got {t.dtype} with {t.numel()}; allocate it from state_layout({n})"
            )
    device = master.device
    if device.type not in devices:
        raise ValueError(f"{owner} updates {where}, got master on {device}; {device_fix}")
    tensors = {"master": master, "grad": grad, "lowp_out": lowp_out, **state}
    elsewhere = [f"{k} on {t.device}" for k, t in tensors.items() if t is not None and t.device != device]
    if elsewhere:
        raise ValueError(
            f"{owner}: every tensor must be on the master's device {device}, got {', '.join(elsewhere)}"
        )


@functools.cache
def _device_kernel() -> Callable[..., None] | None:
    """The fused Triton update for GPU tensors, or None (logged once) where Triton cannot be imported."""
    try:
        from slidekit_optim.adamw8_triton import adamw8_step_
    except ImportError as exc:
        log.warning("adamw_8bit: Triton is unavailable (%s); GPU-resident units take the torch path", exc)
        return None
    return adamw8_step_


def _availability() -> Availability:
    return True, kernel_status(KERNEL_SOURCE)


@hookimpl
def slidekit_optimizers() -> Iterator[OptimizerDescriptor]:
    yield OptimizerDescriptor(
        name="adamw_8bit",
        factory=AdamW8bit,
        available=_availability,
        priority=50,  # below layer_adam: chosen explicitly, to save host memory
        devices=("cpu", "cuda", "rocm"),
        description="AdamW with block-wise 8-bit moments (~2 bytes/param), updated per unit on the CPU "
        "(fused C++ kernel or pure torch) or, for units kept on the GPU, there (fused Triton kernel)",
        prepare=functools.partial(prepare_kernel, KERNEL_SOURCE),  # slidekit build
    )
