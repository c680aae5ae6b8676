"""The state of one training step as the engine's visits pass it along (``Engine.train_step``)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

__all__ = ["StepState"]


@dataclass(eq=False, slots=True)
class StepState:
    """What the visits of one step read and write: its inputs, the flowing activations and gradients,
    the loss, the gradient norm and the updates still to queue."""

    ids: list[torch.Tensor]  # input ids per micro-batch, on the device
    labels: list[torch.Tensor]  # labels per micro-batch, on the device
    rope: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) per micro-batch
    lr: float
    labelled: int  # labelled tokens of the whole step: the loss is their mean
    clip: float | None  # max_grad_norm
    defer: bool  # updates wait for the step's end (clipping, skipping non-finite steps)
    sq_norm: torch.Tensor  # the squared global gradient norm, summed on the device as units finish
    x: list[torch.Tensor] = field(default_factory=list)  # hidden states per micro-batch (forward)
    dx: list[torch.Tensor] = field(default_factory=list)  # their gradients (backward)
    loss_sum: torch.Tensor | None = None  # summed cross-entropy, set by the head
    deferred: dict[int, Future[float]] = field(default_factory=dict)  # unit -> its gradient download
    resident_due: list[int] = field(default_factory=list)  # resident units to update on the device
    shard_sq: dict[int, Future[float]] = field(default_factory=dict)  # data-parallel: unit -> its shard's
    # squared gradient norm, once the d2h lane has reduced the unit's gradient over the ranks
    # Speculative clipping (slidekit.engine.speculation): units updated during the backward as if unclipped.
    speculate: bool = False  # this step speculates (the main thread decided at its start)
    speculative: set[int] = field(default_factory=set)  # units handed to the optimizer thread to speculate
    speculated: set[int] = field(default_factory=set)  # of those, the ones it updated (optimizer thread)
    seen_sq: float = 0.0  # the squared norms of the speculative units so far (optimizer thread)
    rolled_back: bool = False  # the step clipped or was not finite after speculating: updates redone
    # unit -> its gradient pieces' handoffs, for the units handed on that the optimizer thread has not taken
    # yet (it takes the one the next forward needs first, of those whose gradients have come down)
    waiting: dict[int, list[Future[tuple[int, float]]]] = field(default_factory=dict)
    # unit -> done once the optimizer thread has taken and updated it (or left it to the step's end)
    bet_done: dict[int, Future[None]] = field(default_factory=dict)
    # taken but not updated: the bet had stopped (the optimizer thread found clipping certain, or a
    # non-finite norm); once it holds one, the rest of the step defers
    halted_units: set[int] = field(default_factory=set)
    # updated out of place before the norm was known: their bet_done waits for the main thread, which swaps
    # their new master and state in (the bet won) or not (it lost), then completes it
    held: set[int] = field(default_factory=set)
    known: bool = False  # the step's norm is known (the main thread, at the step's end)
    known_scale: float | None = None  # then: its clip factor; None: not finite
    # orders the optimizer thread's choice for a unit against the main thread's ``known``
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_x(self) -> list[torch.Tensor]:
        """The hidden states, let go of here (the head is their last reader)."""
        x, self.x = self.x, []
        return x

    def take_dx(self) -> list[torch.Tensor]:
        """The input gradients, let go of here (the embedding's backward is their last reader)."""
        dx, self.dx = self.dx, []
        return dx

    def take_deferred(self) -> dict[int, Future[float]]:
        deferred, self.deferred = self.deferred, {}
        return deferred
