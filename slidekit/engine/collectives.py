"""The engine's collectives in a data-parallel run: each unit's gradient reduced, its weights gathered.

``reduce_grads`` (the ``d2h`` lane, after a unit's backward) leaves in the
rank's own piece of the unit's flat gradient buffer the sum of every rank's
gradient there; ``gather_weights`` (the ``h2d`` lane, after the rank's
updated shard was written into its piece of the flat weight buffer) fills
the whole buffer with every rank's piece. Both work on the unit's padded
buffer (``slidekit.distributed.shards``): ``world`` equal pieces.

How, by backend and device:

* NCCL (CUDA): ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` in
  place, queued behind the lane's stream (which already waits for the
  backward, or for the upload); the lane's stream then waits for NCCL's, so
  nothing blocks the host. NCCL's own watchdog bounds a collective a dead
  peer never joins (the groups' timeout is ``engine.timeout_s``).
* gloo (CPU): an in-place ``all_reduce`` for the gradient (gloo's
  reduce-scatter gives no handle that can be polled), an in-place
  ``all_gather_into_tensor`` for the weights. The lane polls the handle,
  checking meanwhile for a peer's failure report (``DataParallel.check_peers``)
  and for no progress within ``engine.timeout_s`` (``Pipeline.poll``).
* gloo with CUDA tensors (ranks sharing one GPU): the same through host
  copies of the buffer.

Test: ``pytest tests/distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from slidekit.distributed.group import DataParallel
from slidekit.distributed.shards import Shard
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.errors import PipelineStalled

__all__ = ["Collectives"]

# torch 2.13 renames these (the old names warn); torch 2.11 has only the old ones.
_reduce_scatter: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_HINT = "(a collective of every rank: a rank that never joins it is stuck, died or left the training loop)"


class Collectives:
    """Bounded collectives over ``parallel``'s groups for the units cut as ``shards``."""

    def __init__(
        self, parallel: DataParallel, pipeline: Pipeline, streams: Streams, shards: Sequence[Shard]
    ) -> None:
        self.parallel = parallel
        self.pipeline = pipeline
        self.streams = streams
        self.shards = shards
        self.nccl = parallel.backend == "nccl"
        self.staged = not self.nccl and streams.cuda  # gloo over CUDA tensors: through host copies

    @property
    def rank(self) -> int:
        return self.parallel.rank

    @property
    def world(self) -> int:
        return self.parallel.world

    def _wait(self, work: Any, what: str) -> None:
        """The lane waits for a gloo collective: bounded, and failing fast when a peer reported a failure."""
        try:
            self.pipeline.poll(work.is_completed, f"{what} {_HINT}", check=self.parallel.check_peers)
        except PipelineStalled as exc:  # no report came: name the peers on this host that are gone
            gone = self.parallel.gone_peers()
            if gone:
                self.parallel.failed_collective(what, exc)
            raise
        try:
            work.wait()  # re-raises what the collective raised (a peer's connection closed, gloo's timeout)
        except Exception as exc:
            self.parallel.failed_collective(what, exc)

    def _own(self, buf: torch.Tensor, shard: Shard) -> torch.Tensor:
        return buf[shard.offset : shard.offset + shard.chunk]

    def reduce_grads(self, unit: int, grads: torch.Tensor) -> None:
        """Sum ``grads`` (the unit's flat gradient buffer, at least ``padded`` long) over the ranks in this
        rank's piece. On CUDA call it with the lane's stream current, after it waited for the backward."""
        shard = self.shards[unit]
        flat = grads[: shard.padded]
        what = f"the gradient reduction of unit {unit}"
        if self.nccl:
            work = _reduce_scatter(self._own(flat, shard), flat, group=self.parallel.grads, async_op=True)
            work.wait()  # the current stream waits for NCCL's: the host does not
            return
        if self.staged:
            host = flat.cpu()  # waits for the current stream (the backward)
            self._wait(dist.all_reduce(host, group=self.parallel.grads, async_op=True), what)
            self._own(flat, shard).copy_(self._own(host, shard))
            return
        self._wait(dist.all_reduce(flat, group=self.parallel.grads, async_op=True), what)

    def gather_weights(self, unit: int, params: torch.Tensor) -> None:
        """Fill ``params`` (the unit's flat weight buffer) from every rank's piece, this rank's written
        there already. On CUDA call it with the lane's stream current, after that write."""
        shard = self.shards[unit]
        flat = params[: shard.padded]
        what = f"the weight gather of unit {unit}"
        if self.nccl:
            work = _all_gather(flat, self._own(flat, shard), group=self.parallel.weights, async_op=True)
            work.wait()
            return
        if self.staged:
            own = self._own(flat, shard).cpu()
            host = torch.empty(shard.padded, dtype=flat.dtype)
            self._wait(_all_gather(host, own, group=self.parallel.weights, async_op=True), what)
            flat.copy_(host)
            return
        self._wait(
            _all_gather(flat, self._own(flat, shard), group=self.parallel.weights, async_op=True),
            what,
        )

    def gather_master(self, unit: int, master: torch.Tensor) -> torch.Tensor:
        """The whole FP32 master of ``unit`` from every rank's shard (a new host tensor; main thread,
        ``control`` group)."""
        shard = self.shards[unit]
        piece = torch.zeros(shard.chunk, dtype=torch.float32)
        piece[: shard.size].copy_(master)
        out = torch.empty(shard.padded, dtype=torch.float32)
        work = _all_gather(out, piece, group=self.parallel.control, async_op=True)
        self.parallel.wait(work, f"the master gather of unit {unit}")
        return out[: shard.numel]
