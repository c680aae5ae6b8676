"""The ``adamw_fp8`` optimizer: AdamW whose moments are stored as block-scaled 8-bit floats, on the host.

AdamW as in ``layer_adam`` and ``adamw_8bit`` (and ``torch.optim.AdamW``), with ``t`` = ``count``::

    p <- p * (1 - lr * wd)                              (decoupled decay, per group)
    m <- beta1 * m + (1 - beta1) * g
    v <- beta2 * v + (1 - beta2) * g^2
    p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

but between steps the moments live in the codec of ``slidekit_optim.fp8``:
blocks of 256 elements, each with an FP32 absmax scale per moment; the first
moment ``m`` as FP8 E4M3 codes of ``m * (448 / A_m)``, the square root of the
second, ``r = sqrt(v)``, as unsigned E4M4 codes of ``r * (496 / A_r)`` (a
nonzero ``r`` never takes code 0). Each step, per block: decode both (exact,
then one multiplication), ``v = r * r``, the update in FP32, then the new
``m`` and ``r`` re-encoded under the block's new absmax (one division per
block, rounding to nearest even on the FP32 bit pattern: no table, no
per-element division).

Why ``r``: the update takes ``sqrt(v)`` for its denominator anyway, so the new
``r`` costs nothing, and ``r`` spans half of ``v``'s range in log terms: E4M4
covers realistic blocks where ``v`` itself in 8 bits would flush a third of
them to 0 (docs/benchmarks/NOTES.md section 21). Precision: a code is within
half a unit in the last place of the scaled value, 6.25 % relative at most
for E4M3 (``m``), 3.1 % for UE4M4 (``r``; ``v = r^2`` then within ~6.3 %);
median over realistic moments ~2.2 % and ~1.1 %. Below the formats' smallest
normal (2^-6 of the block's max scale) the error is absolute.

State per parameter: 2 bytes of codes + 2 * 4 / 256 bytes of scales = 2.03
bytes, as ``adamw_8bit`` (8 for ``layer_adam``); host RAM per parameter with
the FP32 master: 4 + 2.03. An all-zero state (what the engine hands the first
step) has every scale 0 and decodes to zero moments: step 1 is AdamW's up to
FP32 rounding.

Host only: ``device_update = False``. The engine keeps no unit on the GPU
with this optimizer (``gpu_resident`` must be ``none``; "auto" keeps none);
``step`` refuses tensors on a GPU. A Triton device update (the kernel's
operation sequence, as ``adamw8_triton`` is ``adamw8.cpp``'s) is future work.

Two implementations, chosen by ``AdamWFp8(hyper, impl=...)`` exactly as in
``layer_adam`` and ``adamw_8bit`` (same build machinery, cache and switch):

* ``"cpp"``: the fused kernel in ``csrc/adamwfp8.cpp`` (built by
  ``kernel_build`` on first use, or ahead of time by ``slidekit build``): one
  pass, block by block, on torch's intra-op threads (at most
  ``OptimizerHyper.threads`` of them; nothing global changes), the GIL
  released; 16 elements at a time in zmm registers where torch dispatches to
  AVX-512, portable loops elsewhere.
* ``"torch"``: ``fp8.reference_step``, the kernel's operations as torch ops,
  run over chunks of whole blocks (``chunk`` elements, 1 Mi by default) so
  its temporaries stay ~50 MB whatever the unit. It ignores ``threads``.
* ``"auto"`` (default): ``cpp``, or ``torch`` with one logged warning saying
  why when the kernel cannot be built.

Both run the same IEEE-754 FP32 operations in the same order (the kernel's
header comment lists them), so master, BF16 copy, codes and scales agree bit
for bit whatever the vector width, thread count or chunk, and since blocks
are independent, whatever block-aligned pieces the engine updates a unit in
(``linear_state``). NaN: a NaN (or an infinity, whose update is NaN) in a
block makes that block's scales NaN in both paths, as ``adamw_8bit``; only
the non-NaN results are bitwise alike. ``lowp_out`` of another dtype than
BF16, or not contiguous, is cast from the master after the update.

Speculative clipping out of place (``fused_update_out = True``,
``slidekit_optim.backup``): ``step(..., update_out=...)``, "master" and the
four state buffers, each of its source's dtype and size, receives the values
an update in place would leave in master and state, bit for bit; ``master``
and ``state`` keep theirs (``lowp_out`` gets the new weights as usual), and
the engine swaps the two sets when its bet wins. The C++ kernel decodes and
updates each block from master and state as in place, but writes its new
master and codes into an L1 scratch, which it streams out to ``update_out``
with the new scales: the 16 bytes per parameter of the update in place
(BF16 gradient and copy), the outputs written instead of the sources. The
torch path copies master and state into ``update_out`` first, then updates
the copies in place. There is no ``backup_out`` (``fused_backup``): with
``fused_update_out`` the engine never asks for one.

Measured on the H200 host (16 threads, a 233M unit, ``benchmarks/fp8_codec.py
rate``, NOTES section 21): the kernel 5.687 G params/s, 1.56x adamw_8bit's
3.663 at the same 2.03 B/param of state, 1.43x layer_adam's 4.015.

Test: ``pytest tests/plugins/test_adamw_fp8.py tests/plugins/test_fp8_codec.py
tests/plugins/test_update_out.py``.
Speed: ``python benchmarks/optimizer_rate.py --numel 20000000``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import Availability, OptimizerDescriptor, OptimizerHyper, ParamGroupRange
from slidekit_optim.adamw_8bit import DEFAULT_CHUNK, _check_chunk, _check_unit
from slidekit_optim.backup import check_buffers, copy_sources
from slidekit_optim.fp8 import STATE_KEYS, reference_step
from slidekit_optim.kernel_build import CSRC, kernel_status, load_or_fallback, prepare_kernel
from slidekit_optim.layer_adam import Impl, _check_hyper, _scalars, _Segment, _segments, _StepScalars
from slidekit_optim.quant8 import BLOCK_SIZE, num_blocks

__all__ = ["DEFAULT_CHUNK", "KERNEL_SOURCE", "AdamWFp8"]

#: The fused kernel's source; ``AdamWFp8(kernel_source=...)`` builds another one instead.
KERNEL_SOURCE = CSRC / "adamwfp8.cpp"

NAME = "adamw_fp8"
_HOST_ONLY = (
    "keep its units on the host: engine.gpu_resident='none' (CLI: --gpu-resident none); a device "
    "update for adamw_fp8 is not built yet (layer_adam and adamw_8bit have one)"
)


def _chunk_segments(segments: Sequence[_Segment], start: int, stop: int) -> list[_Segment]:
    """The decay ranges of ``segments`` that meet [start, stop), cut to it and shifted to start at 0."""
    out: list[_Segment] = []
    for lo, hi, decay in segments:
        lo, hi = max(lo, start), min(hi, stop)
        if lo < hi:
            out.append((lo - start, hi - start, decay))
    return out


class AdamWFp8:
    """AdamW with block-scaled FP8 moments (m as E4M3, sqrt(v) as UE4M4) over a flat vector, on the host.

    ``impl``: "auto" (fused C++ kernel, else pure torch with a warning), "cpp"
    (the kernel or ``KernelUnavailable`` saying why not), "torch"
    (``fp8.reference_step`` in chunks). The kernel is built or loaded here,
    when the optimizer is made, so a first build never runs inside a training
    step. ``kernel_source`` builds it from another file; ``chunk`` (a multiple
    of 256) sets the torch path's chunk. ``self.impl`` says which path runs.
    """

    name = NAME
    #: Host only: the engine keeps no unit on the GPU with this optimizer (a Triton pass is future work).
    device_update = False
    #: Blocks of 256 divide slidekit's granule (4096): the state of parameters [a, a + m), a a multiple
    #: of it, is codes [a, a + m) and scales [a / 256, a / 256 + ceil(m / 256)); blocks never straddle
    #: a piece, and each block's update reads and writes only its own codes and scales.
    linear_state = True
    #: ``step`` takes ``update_out`` (speculative clipping): the C++ kernel writes the update there block by
    #: block instead of in place, in one pass that writes no more bytes than the update in place.
    fused_update_out = True

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
        self.requested_impl: Impl = impl
        self._source = Path(kernel_source) if kernel_source is not None else KERNEL_SOURCE
        self._kernel: ModuleType | None = load_or_fallback(self._source, impl, NAME)
        self.impl: str = "cpp" if self._kernel is not None else "torch"  # the path in use

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]:
        m_codes, m_absmax, r_codes, r_absmax = STATE_KEYS
        blocks = num_blocks(numel)
        return {
            m_codes: (torch.uint8, numel),  # E4M3 codes of m
            m_absmax: (torch.float32, blocks),
            r_codes: (torch.uint8, numel),  # UE4M4 codes of sqrt(v)
            r_absmax: (torch.float32, blocks),
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
        update_out: Mapping[str, Tensor] | None = None,
    ) -> None:
        """One update of the unit, in place, ``lowp_out`` receiving the new weights.

        ``update_out`` (speculative clipping, ``fused_update_out``): "master" and each state name, each a
        contiguous vector of its source's dtype and size, overlapping no input, receives the updated
        values instead of ``master`` and ``state``, which keep theirs; the same bits as in place. It is
        checked before anything is written (``backup.check_buffers``: errors name ``update_out[...]``)."""
        if count < 1:
            raise ValueError(f"count is the 1-based update number, got {count}")
        n = master.numel()
        _check_unit(
            NAME,
            self.state_layout(n),
            master,
            grad,
            state,
            lowp_out,
            devices=("cpu",),
            where="on the host (CPU) only (device_update = False)",
            device_fix=_HOST_ONLY,
        )
        layout = {k: state[k] for k in STATE_KEYS}
        out = None
        if update_out is not None:
            out = check_buffers(
                NAME, "update_out", update_out, master, layout, {"grad": grad, "lowp_out": lowp_out}
            )
        if n == 0:
            return
        grad = grad.reshape(-1)  # a view when contiguous
        segments = _segments(groups, n, lr)
        scalars = _scalars(self.hyper, lr, count)
        # The kernel writes a contiguous BF16 copy in its pass; anything else is cast after the update.
        direct = None
        if lowp_out is not None and lowp_out.dtype == torch.bfloat16 and lowp_out.is_contiguous():
            direct = lowp_out.view(-1)
        if self._kernel is not None:
            self._step_kernel(master, grad, layout, segments, scalars, direct, out)
        else:
            if out is not None:  # copy, then update the copies in place
                copy_sources(out, master, layout)
                master, layout = out["master"], {k: out[k] for k in STATE_KEYS}
            self._step_torch(master, grad, layout, segments, scalars)
            direct = None  # the torch path casts the whole unit once, below
        if lowp_out is not None and direct is None:  # from the updated master, wherever it went
            updated = master if out is None else out["master"]
            lowp_out.copy_(updated.view(lowp_out.shape))

    def _step_kernel(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        segments: Sequence[_Segment],
        s: _StepScalars,
        lowp_out: Tensor | None,
        update_out: Mapping[str, Tensor] | None,
    ) -> None:
        """The whole unit in one call of the fused kernel (it releases the GIL); with ``update_out``
        (checked), out of place: the kernel writes the update there, in the same pass."""
        assert self._kernel is not None
        out_of_place = () if update_out is None else (*(update_out[k] for k in ("master", *STATE_KEYS)), True)
        self._kernel.adamwfp8_step_(
            master,
            grad if grad.is_contiguous() else grad.contiguous(),
            *(state[k] for k in STATE_KEYS),
            lowp_out,
            [stop for _, stop, _ in segments],
            [1.0 if decay is None else decay for _, _, decay in segments],  # times 1 changes no bits
            *s.values(),
            self.hyper.threads or 0,
            *out_of_place,
        )

    def _step_torch(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        segments: Sequence[_Segment],
        s: _StepScalars,
    ) -> None:
        """``fp8.reference_step`` over chunks of whole blocks: each block's arithmetic is its own, so
        the chunks give the bits of one call over the unit, with temporaries of ``chunk`` elements."""
        n = master.numel()
        m_codes, m_absmax, r_codes, r_absmax = (state[k] for k in STATE_KEYS)
        for start in range(0, n, self.chunk):
            stop = min(start + self.chunk, n)
            blocks = slice(start // BLOCK_SIZE, num_blocks(stop))
            piece = {
                STATE_KEYS[0]: m_codes[start:stop],
                STATE_KEYS[1]: m_absmax[blocks],
                STATE_KEYS[2]: r_codes[start:stop],
                STATE_KEYS[3]: r_absmax[blocks],
            }
            reference_step(
                master[start:stop], grad[start:stop], piece, _chunk_segments(segments, start, stop), s
            )


def _availability() -> Availability:
    return True, kernel_status(KERNEL_SOURCE)


@hookimpl
def slidekit_optimizers() -> Iterator[OptimizerDescriptor]:
    yield OptimizerDescriptor(
        name=NAME,
        factory=AdamWFp8,
        available=_availability,
        priority=40,  # below layer_adam and adamw_8bit: chosen explicitly
        devices=("cpu", "cuda", "rocm"),  # runs beside any compute device; its updates stay on the host
        description="AdamW with block-scaled FP8 moments (m E4M3, sqrt(v) UE4M4; ~2 bytes/param), "
        "updated per unit on the host only (fused C++ kernel or pure torch); no GPU-resident units",
        prepare=functools.partial(prepare_kernel, KERNEL_SOURCE),  # slidekit build
    )
