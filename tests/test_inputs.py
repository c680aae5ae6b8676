"""A step's micro-batches are checked before anything runs: bad input fails with its cause and the fix.

Test: ``python -m pytest -q tests/test_inputs.py``.
"""

from __future__ import annotations

import pytest
import torch

from slidekit import Batch, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.inputs import check_pair, check_step, seq_len_refusal
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import random_batches

VOCAB, POSITIONS = 128, 64  # the tiny models'


def _ids(*shape: int, dtype: torch.dtype = torch.int64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _lab(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Labels of ``_ids``' shape that are not its inputs (the same seed would be the copy-the-input mistake)."""
    return _ids(*shape, dtype=dtype, seed=1)


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    return _ids(2, 24), _lab(2, 24)


def _labels_with(value: int) -> torch.Tensor:
    labels = _lab(2, 24)
    labels[1, 5] = value
    return labels


BAD = {
    "no micro-batch": ([], ValueError, "at least one micro-batch"),
    "a tensor, not a sequence": (_ids(2, 24), TypeError, "sequence of \\(input_ids, labels\\)"),
    "not a pair": ([(_ids(2, 24),)], TypeError, "micro-batch 1 of 1: expected a pair"),
    "a list, not a tensor": ([([[1, 2]], _ids(1, 2))], TypeError, "input_ids must be a torch.Tensor"),
    "1-D": ([(_ids(24), _ids(24))], ValueError, "must both be 2-D .*unsqueeze"),
    "3-D labels": ([(_ids(2, 24), _ids(2, 24, 1))], ValueError, "must both be 2-D"),
    "shapes differ": (
        [(_ids(2, 24), _ids(2, 23))],
        ValueError,
        r"\(2, 24\) and labels \(2, 23\) must have the same",
    ),
    "float ids": (
        [(_ids(2, 24, dtype=torch.float32), _ids(2, 24))],
        TypeError,
        "input_ids has dtype torch.float32",
    ),
    "bool labels": ([(_ids(2, 24), _ids(2, 24).bool())], TypeError, "labels has dtype torch.bool"),
    "empty": ([(_ids(0, 24), _ids(0, 24))], ValueError, r"\(0, 24\) is empty"),
    "too long": (
        [(_ids(1, POSITIONS + 1), _lab(1, POSITIONS + 1))],
        ValueError,
        "65 tokens per row, more than .* 64",
    ),
    "id beyond the vocabulary": (
        [(torch.full((2, 24), VOCAB), _ids(2, 24))],
        ValueError,
        "token id 128, outside the model's vocabulary of 128",
    ),
    "negative id": ([(-torch.ones(2, 24, dtype=torch.int64), _ids(2, 24))], ValueError, "token id -1"),
    "label beyond the vocabulary": ([(_ids(2, 24), _labels_with(VOCAB))], ValueError, "labels hold 128"),
    "negative label other than -100": (
        [(_ids(2, 24), _labels_with(-1))],
        ValueError,
        "labels hold -1, .* nor -100",
    ),
    "nothing labelled": ([(_ids(2, 24), torch.full((2, 24), -100))], ValueError, "no labelled token"),
    "Hugging Face-style labels (the inputs)": (
        [(_ids(2, 24), _ids(2, 24))],
        ValueError,
        r"labels equal input_ids at every labelled position.*copy its input.*Batch\.from_hf",
    ),
    "the second micro-batch is bad": (
        [_good(), (_ids(2, 40), _ids(2, 24))],
        ValueError,
        "micro-batch 2 of 2",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_with_its_cause(case):
    micro, error, message = BAD[case]
    with pytest.raises(error, match=message):
        check_step(micro, vocab_size=VOCAB, max_positions=POSITIONS)


def test_good_input_counts_its_labelled_tokens():
    labels = _lab(3, 40)
    labels[0, :7] = -100
    micro = [_good(), (_ids(3, 40, dtype=torch.int32), labels.to(torch.int32))]
    assert check_step(micro, vocab_size=VOCAB, max_positions=POSITIONS) == 2 * 24 + 3 * 40 - 7


def test_batch_refuses_what_a_step_would():
    with pytest.raises(ValueError, match="same shape"):
        Batch(_ids(2, 24), _ids(2, 25))
    with pytest.raises(TypeError, match=r"input_ids has dtype torch\.float32"):
        Batch(_ids(2, 24, dtype=torch.float32), _ids(2, 24))
    check_pair(*_good())  # and accepts what it takes


def test_the_engine_refuses_before_it_moves_anything(tiny_model):
    """A refused step changes nothing: afterwards the same training gives the same bits as without it."""
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(lr=1e-4, weight_decay=0.1),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
        steps=2,
    )
    batches = random_batches(VOCAB, steps=2, seq_len=24)
    with Trainer(cfg) as t:
        want = t.fit(batches).losses, t.state_dict()
    with Trainer(cfg) as t:
        for case in ("id beyond the vocabulary", "the second micro-batch is bad", "shapes differ"):
            micro, error, message = BAD[case]
            with pytest.raises(error, match=message):
                t.engine.train_step(micro, 1e-4)
        assert t.engine.steps_done == 0
        int32 = [Batch(b.input_ids.to(torch.int32), b.labels.to(torch.int32)) for b in batches]
        got = t.fit(int32).losses, t.state_dict()  # int32 token ids train exactly as int64 ones
    assert got[0] == want[0]
    assert_states_equal(got[1], want[1])


def test_a_seq_len_beyond_the_models_positions_is_refused_in_one_wording():
    assert seq_len_refusal(POSITIONS, POSITIONS) is None
    assert seq_len_refusal(POSITIONS + 1, POSITIONS) == (
        f"data.seq_len {POSITIONS + 1} exceeds the model's max_position_embeddings {POSITIONS}; "
        f"use a seq_len of at most {POSITIONS} (CLI: --seq-len)"
    )
