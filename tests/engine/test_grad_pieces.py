"""Gradients of units larger than a layer come down and are updated in layer-sized pieces.

The shared host gradient buffers are sized for the largest layer
(``slidekit.planning.ring_numel``); an embedding or head of a large vocabulary
goes through them piece by piece, the optimizer updating each piece while
the next comes down. Updating a unit in pieces must change nothing: these
tests train with pieces and with buffers sized for the whole unit (the old
layout) and require bitwise equal losses, masters and optimizer state, for
tied and untied embeddings, state in RAM or streamed from files in chunks
smaller than a piece, element-wise (layer_adam) and block-wise quantized
(adamw_8bit) state, and one or two buffers.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.errors import NonFiniteError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import KernelSetDescriptor
from slidekit.planning import GRANULE, ring_numel, unit_pieces
from slidekit.planning import layout as layout_module  # where the layout sizes the ring
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import random_batches, save_tiny_model
from slidekit_kernels.torch_ref import TorchRef

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 4096  # embedding 4096 x 64 = 262 k parameters against ~47 k per layer: six pieces


def test_ring_is_sized_for_the_largest_sliding_layer():
    numels, kinds = [500_000, 40_000, 47_000, 500_000], ["embed", "layer", "layer", "head"]
    every = [True] * 4
    assert ring_numel(numels, kinds, every, pieces=True) == -(-47_000 // GRANULE) * GRANULE
    assert ring_numel(numels, kinds, every, pieces=False) == 500_000  # non-linear state: whole units
    assert ring_numel(numels, kinds, [True, True, False, True], pieces=True) == 40_960
    assert ring_numel(numels, kinds, [True, False, False, True], pieces=True) == 500_000  # no layer slides
    assert ring_numel([1000, 3000], ["embed", "layer"], [True, True], pieces=True) == 3000  # below a granule
    assert unit_pieces(10_000, 4096) == [(0, 4096), (4096, 8192), (8192, 10_000)]
    assert unit_pieces(4096, 4096) == [(0, 4096)] and unit_pieces(0, 4096) == [(0, 0)]


def _train(model_dir, tmp_path, batches, *, whole_units: bool, monkeypatch, **engine):
    if whole_units:  # the old layout: buffers as large as the largest unit, every unit in one piece
        monkeypatch.setattr(
            layout_module, "ring_numel", lambda numels, kinds, sliding, pieces: max(numels)
        )  # fmt: skip
    else:
        monkeypatch.undo()
    optimizer = engine.pop("optimizer", "layer_adam")
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(name=optimizer, lr=1e-3, weight_decay=0.05),
        engine=EngineConfig(device=DEVICE, gpu_resident="none", offload_dir=str(tmp_path), **engine),
    )
    with Trainer(cfg) as t:
        host = t.engine.host
        pieces = [len(host.pieces(u)) for u in range(len(t.spec.units))]
        ring_bytes = cfg.engine.grad_buffers * host.piece * host.ring.buffers[0].element_size()
        if not whole_units:  # the planner counts the buffers the engine makes: the ring, and each sliding
            # unit's own where the plan keeps them (the forward update order a GPU's rates may choose)
            assert t.estimate.host["gradients"] == ring_bytes + host.unit_grad_bytes()
        result = t.fit(batches)
        return result.losses, t.state_dict(), host.piece, pieces


@pytest.mark.parametrize(
    "family, engine",
    [
        ("llama", {}),
        ("qwen2", {"grad_buffers": 1}),  # tied embedding; one buffer: each piece waits for the last update
        ("llama", {"state_tier": "posix", "state_chunk": GRANULE}),  # streamed, chunks inside pieces
        (
            "mistral",
            {"optimizer": "adamw_8bit", "state_offload_tier": "posix", "state_offload_fraction": 0.5},
        ),
        ("llama", {"optimizer": "adamw_fp8", "state_tier": "posix", "state_chunk": GRANULE}),  # host only
    ],
)
def test_pieces_change_nothing(tmp_path, monkeypatch, family, engine):
    tied = {"tie_word_embeddings": True} if family == "qwen2" else {"tie_word_embeddings": False}
    model_dir = save_tiny_model(
        family,
        tmp_path / "model",
        vocab_size=VOCAB,
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=160,
        **tied,
    )
    batches = random_batches(VOCAB, steps=3)
    ref = _train(model_dir, tmp_path, batches, whole_units=True, monkeypatch=monkeypatch, **dict(engine))
    got = _train(model_dir, tmp_path, batches, whole_units=False, monkeypatch=monkeypatch, **dict(engine))
    losses, state, piece, pieces = got
    assert piece < ref[2] and pieces[0] >= 5 and max(ref[3]) == 1  # the embedding really came in pieces
    assert losses == ref[0]
    assert_states_equal(state, ref[1])


class _PoisonHead:
    """Kernels whose final norm output is NaN: the head's gradients (the first to come down) are not finite."""

    @hookimpl
    def slidekit_kernel_sets(self) -> Iterator[KernelSetDescriptor]:
        class Poisoned(TorchRef):
            name = "poisoned_head"

            def rms_norm(self, x, weight, eps):
                return super().rms_norm(x, weight, eps) * float("nan")

        yield KernelSetDescriptor(name="poisoned_head", factory=Poisoned)


def test_nonfinite_unit_in_pieces_stops_the_step(tmp_path):
    model_dir = save_tiny_model(
        "llama", tmp_path / "model", vocab_size=VOCAB, num_hidden_layers=1, hidden_size=64,
        intermediate_size=160, tie_word_embeddings=False,
    )  # fmt: skip
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(
            device=DEVICE, gpu_resident="none", kernels="poisoned_head", compute_dtype="float32", timeout_s=60
        ),
    )
    with Trainer(cfg, plugins=Plugins(extra=[("poison", _PoisonHead())])) as t:
        head = len(t.spec.units) - 1
        assert len(t.engine.host.pieces(head)) > 1
        # Two refusals race, both right: the optimizer's, of the head's pieces, and the step's own, when the
        # main thread reaches the NaN loss first (CI, 2026-12-07, on a loaded 2-core machine).
        refused = rf"unit {head} \(head\) are not finite; no update|loss nan / gradient norm nan is not finite"
        with pytest.raises(NonFiniteError, match=refused):
            t.fit(random_batches(VOCAB, steps=1))  # and does not hang on the pieces still in flight
