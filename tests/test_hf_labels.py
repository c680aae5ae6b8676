"""The label convention: a Batch's labels are already shifted; ``Batch.from_hf`` takes Hugging Face-style
tensors (``labels == input_ids``, the model shifts) and gives the same loss as the transformers model;
HF-style labels passed to ``Batch`` directly (the copy-the-input mistake) are refused.

Test: ``python -m pytest -q tests/test_hf_labels.py``.
"""

from __future__ import annotations

import pytest
import torch

from slidekit import Batch, EngineConfig, ModelConfig, TrainConfig, Trainer
from slidekit.inputs import check_step

VOCAB = 128  # the tiny models'


def _ids(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_from_hf_equals_manual_shifting():
    ids = _ids(3, 10)
    b = Batch.from_hf(ids)
    assert torch.equal(b.input_ids, ids)
    assert torch.equal(b.labels[:, :-1], ids[:, 1:]) and (b.labels[:, -1] == -100).all()

    labels = ids.clone()
    labels[0, :4] = -100  # a prompt without loss
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # row 1 right-padded from position 7
    b = Batch.from_hf(ids, labels, mask)
    want = torch.full_like(ids, -100)
    want[:, :-1] = labels[:, 1:]
    want[1, 6:] = -100  # the targets at 7.. are padding
    assert torch.equal(b.labels, want)
    assert torch.equal(b.input_ids, ids)


def test_from_hf_refuses_left_padding_and_a_wrong_mask():
    ids = _ids(2, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match=r"row 1 of attention_mask has padding before a real token.*'right'"):
        Batch.from_hf(ids, attention_mask=mask)
    with pytest.raises(
        ValueError, match=r"attention_mask \(2, 5\) must be a tensor of input_ids' shape \(2, 6\)"
    ):
        Batch.from_hf(ids, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="must have the same shape"):
        Batch.from_hf(ids, _ids(2, 5))


def test_hf_style_labels_given_to_batch_are_refused():
    ids = _ids(2, 12)
    with pytest.raises(
        ValueError, match=r"labels equal input_ids at every labelled position.*Batch\.from_hf"
    ):
        Batch(ids, ids.clone())
    masked = ids.clone()
    masked[:, :5] = -100  # HF-style labels with a masked prompt: still the inputs wherever they count
    with pytest.raises(ValueError, match="copy its input"):
        Batch(ids, masked)
    with pytest.raises(ValueError, match="micro-batch 1 of 1: labels equal input_ids"):
        check_step([(ids, ids)], vocab_size=VOCAB, max_positions=64)  # what train_step checks


def test_shifted_labels_are_never_taken_for_hf_style():
    row = torch.full((1, 8), 5)  # one token repeated: its shifted labels do equal its inputs
    assert Batch(row, row.clone()).labels.equal(row)
    ids = _ids(2, 9)
    b = Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())  # ordinary shifted labels
    assert b.labels.shape == (2, 8)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_loss_of_from_hf_is_the_transformers_models(family, tiny_model):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(family)
    ids = _ids(2, 14, seed=3)
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # right padding
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(mask == 0, -100)).loss
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)), engine=EngineConfig(device="cpu", compute_dtype="float32")
    )
    with Trainer(cfg) as t:
        got = t.evaluate([Batch.from_hf(ids, labels, mask)])
    assert got == pytest.approx(want.item(), rel=1e-5)
