"""The host updates of a step that does not clip in the next forward's order (``engine.update_order``).

"forward" keeps every sliding unit's gradients in a host buffer of its own and the optimizer takes,
of the units whose gradients are down, the one the next forward needs first
(``slidekit.engine.speculation``'s takers, without backups); "arrival" updates them through the shared
ring as they come down. Parameters, optimizer state, losses and norms are equal bit for bit: tied and
untied embeddings, half the units resident, accumulation, both bundled optimizers, state streamed from
the posix tier, and the transformers + torch.optim.AdamW reference loop. The order itself is held
fixed with a hook, and a unit whose gradients are not finite stops the step as on the ring path.

Test: ``pytest tests/engine/test_forward_updates.py``.
"""

from __future__ import annotations

import time
from concurrent.futures import wait

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.engine.speculation import Speculation
from slidekit.errors import ConfigError, NonFiniteError
from slidekit.testing.asserts import (
    assert_losses_close,
    assert_states_close,
    assert_states_equal,
    trained_state,
)
from slidekit.testing.models import random_batches
from slidekit.testing.reference import reference_run

# The GPU gate runs these on the GPU (the lanes, the d2h copies and the takers as users run them); CI on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(model_dir, steps, *, order, optimizer="layer_adam", grad_accum=1, device=DEVICE, **engine):
    return TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3, weight_decay=0.1, name=optimizer),
        engine=EngineConfig(
            device=device, update_order=order, **{"compute_dtype": "float32", "gpu_resident": "none", **engine}
        ),
        steps=steps,
        grad_accum=grad_accum,
    )


def _train(model_dir, batches, *, grad_accum=1, **kw):
    with Trainer(_config(model_dir, len(batches) // grad_accum, grad_accum=grad_accum, **kw)) as t:
        assert t.engine.layout.forward_updates == (kw["order"] == "forward")
        host = t.engine.host  # the plan's host gradients are what the engine allocates: ring + own buffers
        assert t.estimate.host["gradients"] == sum(b.nbytes for b in host.ring.buffers) + host.unit_grad_bytes()
        result = t.fit(batches)
        return result, trained_state(t), t.engine.host.unit_grad_bytes()


@pytest.mark.parametrize(
    ("family", "resident", "optimizer", "grad_accum"),
    [
        ("llama", "none", "layer_adam", 1),
        ("qwen2", "none", "layer_adam", 2),  # tied embeddings, accumulation
        ("llama", "0.5", "adamw_8bit", 1),
        ("qwen2", "0.5", "adamw_8bit", 2),
    ],
)
def test_the_forward_order_gives_the_bits_of_the_arrival_order(
    tiny_model, family, resident, optimizer, grad_accum
):
    model_dir = tiny_model(family)
    batches = random_batches(128, steps=4 * grad_accum, seed=3)
    kw = {"optimizer": optimizer, "gpu_resident": resident, "grad_accum": grad_accum}
    want, want_state, want_bytes = _train(model_dir, batches, order="arrival", **kw)
    got, got_state, got_bytes = _train(model_dir, batches, order="forward", **kw)
    assert got.losses == want.losses and got.grad_norms == want.grad_norms
    assert_states_equal(got_state, want_state)
    assert want_bytes == 0 < got_bytes  # the units' own gradient buffers, only in the forward order
    assert got.speculated == 0 and got.rollbacks == 0  # plain updates, no backups


def test_the_forward_order_with_state_streamed_from_disk(tiny_model, tmp_path):
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=3, seed=4)
    kw = {
        "gpu_resident": "none",
        "state_offload_tier": "posix",
        "state_offload_fraction": 0.5,
        "offload_dir": str(tmp_path),
        "state_chunk": 4096,
    }
    want, want_state, _ = _train(model_dir, batches, order="arrival", **kw)
    got, got_state, _ = _train(model_dir, batches, order="forward", **kw)
    assert got.losses == want.losses
    assert_states_equal(got_state, want_state)


def test_the_forward_order_matches_transformers_and_torch_adamw(tiny_model):
    """transformers + torch.optim.AdamW, at a tolerance."""
    model_dir = tiny_model("qwen2")
    batches = random_batches(128, steps=4, seed=5)
    with Trainer(_config(model_dir, len(batches), order="forward", gpu_resident="none")) as t:
        init = t.state_dict()
        res = t.fit(batches)
        state, hf = t.state_dict(), t.hf_config
    ref = reference_run(hf, init, batches, lr=1e-3, weight_decay=0.1)
    assert_losses_close(res.losses, ref.losses, rtol=1e-5)
    assert_states_close(state, ref.state, rtol=3e-5)


def test_the_takers_take_the_units_in_the_next_forwards_order(tiny_model, monkeypatch):
    """The first taker of each step is held until the backward is over and every gradient is down: the
    units are then taken in ascending order, the one the next forward needs first."""
    order: list[list[int]] = []
    firsts: list[object] = []  # the steps' StepStates, held: a freed one's id may be the next one's
    take = Speculation._take

    def held_take(eng, c):
        if not any(f is c for f in firsts):
            firsts.append(c)
            order.append([])
            deadline = time.monotonic() + 60
            while not c.known:  # the main thread has the step's norm: the backward is over
                assert time.monotonic() < deadline, "held too long waiting for the backward's end"
                time.sleep(1e-3)
            with c.lock:
                pending = [f for handoff in c.waiting.values() for f in handoff]
            wait(pending, timeout=60)
        unit, handoff = take(eng, c)
        order[-1].append(unit)
        return unit, handoff

    monkeypatch.setattr(Speculation, "_take", held_take)
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=3, seed=6)
    got, got_state, _ = _train(model_dir, batches, order="forward", gpu_resident="none")
    monkeypatch.setattr(Speculation, "_take", take)
    want, want_state, _ = _train(model_dir, batches, order="arrival", gpu_resident="none")
    assert got.losses == want.losses
    assert_states_equal(got_state, want_state)
    assert len(order) == 3 and all(o == sorted(o) and len(o) > 2 for o in order), order
    assert all(len(o) == len(set(o)) == len(order[0]) for o in order)  # every unit, once a step


def test_a_unit_whose_gradients_are_not_finite_stops_the_step(tiny_model, monkeypatch):
    """As on the ring path: the step raises NonFiniteError naming the unit, and nothing is applied to it."""
    import slidekit.engine.updates as updates

    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=1, seed=7)
    real = updates.Updates._check_finite
    bad: list[int] = []

    def poisoned(eng, unit, sq):
        if unit == 2 and not bad:
            bad.append(unit)
            sq = float("inf")
        real(eng, unit, sq)

    applied: list[int] = []
    apply = updates.Updates._apply

    def seen_apply(eng, unit, *args, **kw):
        applied.append(unit)
        return apply(eng, unit, *args, **kw)

    monkeypatch.setattr(updates.Updates, "_check_finite", poisoned)
    monkeypatch.setattr(updates.Updates, "_apply", seen_apply)
    with (
        Trainer(_config(model_dir, 1, order="forward", gpu_resident="none")) as t,
        pytest.raises(NonFiniteError, match="unit 2"),
    ):
        t.fit(batches)
    assert bad == [2] and 2 not in applied


def test_update_order_is_validated():
    with pytest.raises(ConfigError, match=r"engine\.update_order .*'arrival', 'forward'.*'backward'"):
        EngineConfig(update_order="backward")


def test_the_forward_order_writes_the_upload_copies_as_the_arrival_order_does(tiny_model):
    """BF16 compute with upload copies (``engine.upload_copy``): the takers write each unit's copy in its
    update's pass, as the ring path does; the copies equal their masters cast, and the bits match."""
    model_dir = tiny_model("qwen2")
    batches = random_batches(128, steps=3, seed=8)
    runs = {}
    for order in ("arrival", "forward"):
        cfg = _config(
            model_dir,
            len(batches),
            order=order,
            gpu_resident="none",
            upload_copy="on",
            compute_dtype="bfloat16",
            kernels="torch_ref",
        )
        with Trainer(cfg) as t:
            result = t.fit(batches)
            t.engine.wait_updates()
            copies = [
                (c, m)
                for c, m in zip(t.engine.host.copies, t.engine.host.masters, strict=True)
                if c is not None
            ]
            assert copies and all(torch.equal(c, m.to(torch.bfloat16)) for c, m in copies)
            runs[order] = result, trained_state(t)
    (want, want_state), (got, got_state) = runs["arrival"], runs["forward"]
    assert got.losses == want.losses
    assert_states_equal(got_state, want_state)
