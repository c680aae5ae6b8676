"""Micro-batches of different lengths in one step (dynamic padding), FP32 on the CPU.

A step over micro-batches of 24 and 40 tokens per row equals one step on all
their rows right-padded to 40 with label -100 on the padding (causal
attention: no real token sees the padding after it, and the padding's own
gradients are exactly zero), and the transformers + torch.optim.AdamW
reference loop fed the same micro-batches unpadded.

Test: ``python -m pytest -q tests/test_mixed_lengths.py``.
"""

from __future__ import annotations

import pytest
import torch

from slidekit import Batch, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.models.adapters import llama
from slidekit.models.decoder import RopeTables
from slidekit.testing.asserts import assert_losses_close, assert_states_close, assert_states_equal, rel_error
from slidekit.testing.models import tiny_config
from slidekit.testing.reference import reference_run

LR, WD = 1e-4, 0.1
VOCAB = 128
PAD = 0  # the token the padding uses; any id gives the same result (its label is -100)


def _batch(gen: torch.Generator, rows: int, length: int) -> Batch:
    ids = torch.randint(0, VOCAB, (rows, length + 1), generator=gen)
    labels = ids[:, 1:].clone()
    labels[0, :2] = -100  # some unlabelled real tokens too
    return Batch(ids[:, :-1].contiguous(), labels)


def _padded(batches: list[Batch]) -> Batch:
    """All rows of ``batches`` right-padded to the longest: PAD inputs, label -100."""
    length = max(b.input_ids.shape[1] for b in batches)
    rows = sum(b.input_ids.shape[0] for b in batches)
    ids = torch.full((rows, length), PAD, dtype=torch.int64)
    labels = torch.full((rows, length), -100, dtype=torch.int64)
    r = 0
    for b in batches:
        n, t = b.input_ids.shape
        ids[r : r + n, :t], labels[r : r + n, :t] = b.input_ids, b.labels
        r += n
    return Batch(ids, labels)


def _steps(lengths: list[tuple[int, int]], seed: int = 0) -> list[list[Batch]]:
    """One step per (short, long) pair: a micro-batch of 2 rows of ``short`` tokens, then 3 of ``long``."""
    gen = torch.Generator().manual_seed(seed)
    return [[_batch(gen, 2, short), _batch(gen, 3, long)] for short, long in lengths]


def _train(model_dir, batches: list[Batch], grad_accum: int, **engine):
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=LR, weight_decay=WD),
        engine=EngineConfig(device="cpu", compute_dtype="float32", **engine),
        steps=len(batches) // grad_accum,
        grad_accum=grad_accum,
    )
    with Trainer(cfg) as t:
        init = t.state_dict()
        result = t.fit(batches)
        return t.hf_config, init, result, t.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
def test_mixed_lengths_equal_one_padded_batch_and_the_reference(family, tiny_model):
    model_dir = tiny_model(family)
    steps = _steps([(24, 40), (40, 24), (17, 33)])  # the longer one first or second, odd lengths
    micro = [b for step in steps for b in step]
    cfg, init, mixed, mixed_state = _train(model_dir, micro, grad_accum=2)
    _, _, padded, padded_state = _train(model_dir, [_padded(step) for step in steps], grad_accum=1)

    assert len(mixed.losses) == 3
    assert mixed.tokens == sum(b.input_ids.numel() for b in micro)  # the real rows' tokens, no padding
    assert_losses_close(mixed.losses, padded.losses, rtol=1e-6)
    assert_states_close(mixed_state, padded_state, rtol=1e-6)
    ref = reference_run(cfg, init, steps, lr=LR, weight_decay=WD)  # micro-batches, unpadded
    assert_losses_close(mixed.losses, ref.losses, rtol=1e-5)
    assert_states_close(mixed_state, ref.state, rtol=1e-5)
    moved = max(rel_error(mixed_state[n], init[n]) for n in init)
    assert moved > 1e-3, "the steps must move the parameters far beyond the tolerance"


def test_mixed_lengths_with_activations_on_a_tier_and_clipping(tiny_model):
    """Boundary activations of changing sizes on the ram tier, and the deferred (clipped) updates: same bits."""
    model_dir = tiny_model("mistral")
    micro = [b for step in _steps([(24, 40), (40, 8), (30, 30), (12, 20)], seed=1) for b in step]
    _, _, base, base_state = _train(model_dir, micro, grad_accum=2)
    _, _, tier, tier_state = _train(model_dir, micro, grad_accum=2, activation_tier="ram")
    assert tier.losses == base.losses
    assert_states_equal(tier_state, base_state)

    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=LR, weight_decay=WD, max_grad_norm=0.5),
        engine=EngineConfig(device="cpu", compute_dtype="float32", window=2, activation_tier="ram"),
        steps=4,
        grad_accum=2,
    )
    with Trainer(cfg) as t:
        init = t.state_dict()
        clipped = t.fit(micro)
        clipped_state = t.state_dict()
    steps = [micro[i : i + 2] for i in range(0, len(micro), 2)]
    ref = reference_run(t.hf_config, init, steps, lr=LR, weight_decay=WD, max_grad_norm=0.5)
    assert all(n > 0.5 for n in ref.grad_norms), "the test must actually clip"
    assert_losses_close(clipped.losses, ref.losses, rtol=1e-5)
    assert_states_close(clipped_state, ref.state, rtol=1e-5)


def test_a_step_does_not_depend_on_the_lengths_seen_before(tiny_model):
    """The shared RoPE table grows with the longest length; a shorter one keeps exactly its values."""
    model_dir = tiny_model("qwen3")
    gen = torch.Generator().manual_seed(2)
    short, long = _batch(gen, 2, 20), _batch(gen, 2, 60)
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=LR, weight_decay=WD),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
        steps=1,
    )
    with Trainer(cfg) as fresh:
        want = fresh.fit([short]).losses, fresh.state_dict()
    with Trainer(cfg) as grown:
        grown.engine.forward(long.input_ids)  # the table now covers 60 positions
        got = grown.fit([short]).losses, grown.state_dict()
    assert got[0] == want[0]
    assert_states_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_do_not_depend_on_the_table_length(dtype):
    spec = llama(tiny_config("llama", max_position_embeddings=8192))
    grown = RopeTables(spec)
    cos_long, sin_long = grown.get(5000, torch.device("cpu"), dtype)
    for length in (1, 24, 40, 1023, 4099):
        cos, sin = RopeTables(spec).get(length, torch.device("cpu"), dtype)  # a table of exactly this length
        assert cos.equal(cos_long[:length]) and sin.equal(sin_long[:length]), length
        view_cos, _ = grown.get(length, torch.device("cpu"), dtype)
        assert view_cos.is_contiguous() and view_cos.shape == cos.shape
        assert view_cos.data_ptr() == cos_long.data_ptr()  # a view of the shared table, nothing recomputed


def test_rope_table_grows_geometrically_up_to_the_model_positions():
    """A longer length recomputes the table at twice its length (at most the model's positions); others share it."""
    tables = RopeTables(llama(tiny_config("llama", max_position_embeddings=1000)))
    kept = []  # the views keep every table alive, so their addresses are distinct

    def table(length: int) -> int:
        cos, sin = tables.get(length, torch.device("cpu"), torch.float32)
        assert cos.shape == sin.shape == (length, 16)
        kept.append(cos)
        return cos.data_ptr()

    # length asked -> table length: 100 -> 100, 101 -> 200, 201 -> 400, 700 -> 800, 801 -> 1000 (the cap)
    tables_seen = []
    for new, shared in ((100, 60), (101, 200), (201, 399), (700, 800), (801, 1000)):
        ptr = table(new)
        assert table(shared) == ptr, (new, shared)
        tables_seen.append(ptr)
    assert len(set(tables_seen)) == 5
