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

The unit is processed in chunks of whole blocks (``chunk`` elements, 1 Mi by
default), through scratch buffers allocated once per step, so memory beyond
the state never grows with the unit. Every operation is a vectorised torch op
on torch's intra-op threads (``OptimizerHyper.threads`` is not honoured: that
would change torch's global setting), except that torch runs the table
lookups (``index_select`` on a 1-D table) on one thread; they are about half
the time on one core and bound the rate on many. Blocks are independent, so
results do not depend on the chunk size, bit for bit. The first step from a
zero state is AdamW's up to FP32 rounding: no quantization error enters until
the moments are stored.

Test: ``pytest tests/plugins/test_adamw_8bit.py``.
Speed: ``python benchmarks/optimizer_rate.py --numel 20000000``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from slidekit.hookspecs import hookimpl
from slidekit.interfaces import OptimizerDescriptor, OptimizerHyper, ParamGroupRange
from slidekit_optim.quant8 import (
    BLOCK_SIZE,
    QuantMap,
    dequantize_blockwise,
    dynamic_map,
    num_blocks,
    quantize_blockwise,
)

__all__ = ["DEFAULT_CHUNK", "AdamW8bit"]

#: Elements per chunk: 4 MiB per FP32 scratch buffer. A multiple of the block size.
DEFAULT_CHUNK = 1 << 20


@dataclass(slots=True)
class _Scratch:
    """Per-step scratch, ``chunk`` elements each: reused by every chunk of the unit."""

    grad: Tensor  # FP32 copy of a BF16 gradient chunk
    m: Tensor
    v: Tensor
    denom: Tensor  # the denominator, then the scaled moment while re-encoding
    index: Tensor  # int32: code indices / lookup keys
    thr: Tensor  # FP32 lookup thresholds

    @classmethod
    def allocate(cls, n: int) -> _Scratch:
        f32 = [torch.empty(n) for _ in range(5)]
        return cls(
            grad=f32[0], m=f32[1], v=f32[2], denom=f32[3], thr=f32[4], index=torch.empty(n, dtype=torch.int32)
        )


class AdamW8bit:
    """AdamW with block-wise 8-bit quantized moments over a flat vector."""

    name = "adamw_8bit"

    def __init__(self, hyper: OptimizerHyper, *, chunk: int = DEFAULT_CHUNK) -> None:
        b1, b2 = hyper.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"betas must lie in [0, 1), got {hyper.betas}")
        if hyper.eps <= 0:
            raise ValueError(f"eps must be > 0, got {hyper.eps}")
        if chunk <= 0 or chunk % BLOCK_SIZE:
            raise ValueError(f"chunk must be a positive multiple of the block size {BLOCK_SIZE}, got {chunk}")
        self.hyper = hyper
        self.chunk = chunk
        self.m_map: QuantMap = dynamic_map(signed=True)
        self.v_map: QuantMap = dynamic_map(signed=False, keep_nonzero=True)

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
    ) -> None:
        if count < 1:
            raise ValueError(f"count is the 1-based update number, got {count}")
        self._check(master, grad, state, lowp_out)
        n = master.numel()
        scratch = _Scratch.allocate(min(self.chunk, n))
        for start in range(0, n, self.chunk):
            stop = min(start + self.chunk, n)
            self._step_chunk(master, grad, state, start, stop, scratch, lr=lr, count=count, groups=groups)
            if lowp_out is not None:
                lowp_out[start:stop].copy_(master[start:stop])

    def _step_chunk(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        start: int,
        stop: int,
        s: _Scratch,
        *,
        lr: float,
        count: int,
        groups: Sequence[ParamGroupRange],
    ) -> None:
        """The update of elements [start, stop), a whole number of blocks unless it ends the unit."""
        b1, b2 = self.hyper.betas
        n = stop - start
        blocks = slice(start // BLOCK_SIZE, num_blocks(stop))
        p = master[start:stop]
        g = grad[start:stop] if grad.dtype == torch.float32 else s.grad[:n].copy_(grad[start:stop])
        m_codes, m_absmax = state["exp_avg_codes"][start:stop], state["exp_avg_absmax"][blocks]
        v_codes, v_absmax = state["exp_avg_sq_codes"][start:stop], state["exp_avg_sq_absmax"][blocks]
        m = dequantize_blockwise(m_codes, m_absmax, self.m_map, out=s.m[:n], work=s.index)
        v = dequantize_blockwise(v_codes, v_absmax, self.v_map, out=s.v[:n], work=s.index)

        for grp in groups:  # decoupled weight decay first, as torch.optim.AdamW
            lo, hi = max(grp.start, start), min(grp.stop, stop)
            if grp.weight_decay and lo < hi:
                master[lo:hi].mul_(1.0 - lr * grp.weight_decay)
        m.lerp_(g, 1.0 - b1)
        v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
        step_size = lr / (1.0 - b1**count)
        denom = torch.sqrt(v, out=s.denom[:n]).div_((1.0 - b2**count) ** 0.5).add_(self.hyper.eps)
        p.addcdiv_(m, denom, value=-step_size)

        work = (s.denom, s.index, s.thr)  # the denominator is spent: its buffer holds scaled moments now
        quantize_blockwise(m, self.m_map, codes=m_codes, absmax=m_absmax, work=work)
        quantize_blockwise(v, self.v_map, codes=v_codes, absmax=v_absmax, work=work)

    def _check(
        self, master: Tensor, grad: Tensor, state: Mapping[str, Tensor], lowp_out: Tensor | None
    ) -> None:
        """Shapes and dtypes, so a wrong buffer fails here instead of corrupting state."""
        n = master.numel()
        if master.dtype != torch.float32 or master.dim() != 1 or not master.is_contiguous():
            raise ValueError(
                f"master must be a contiguous 1-D FP32 tensor, got {master.dtype} {tuple(master.shape)}"
            )
        if grad.numel() != n or grad.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"grad must hold {n} FP32 or BF16 elements, got {grad.numel()} {grad.dtype}")
        if lowp_out is not None and lowp_out.numel() != n:
            raise ValueError(f"lowp_out must hold {n} elements, got {lowp_out.numel()}")
        layout = self.state_layout(n)
        missing = [k for k in layout if k not in state]
        if missing:
            raise ValueError(
                f"adamw_8bit state lacks {missing}; allocate it from state_layout(): {sorted(layout)}"
            )
        for name, (dtype, numel) in layout.items():
            t = state[name]
            if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
                raise ValueError(
                    f"state {name!r} must be a contiguous {dtype} tensor of {numel} elements, "
                    f"got {t.dtype} with {t.numel()}"
                )


@hookimpl
def slidekit_optimizers() -> Iterator[OptimizerDescriptor]:
    yield OptimizerDescriptor(
        name="adamw_8bit",
        factory=AdamW8bit,
        priority=50,  # below layer_adam: chosen explicitly, to save host memory
        devices=("cpu", "cuda", "rocm"),
        description="AdamW with block-wise 8-bit moments (~2 bytes/param), updated per unit on the CPU",
    )
