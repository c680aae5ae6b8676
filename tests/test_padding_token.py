"""The embedding row of the model's pad_token_id gets no gradient from the lookup, as in transformers.

transformers builds ``nn.Embedding(vocab, hidden, padding_idx=config.pad_token_id)``,
whose backward leaves that row's gradient at zero; a tied LM head still
trains the row through the head, and AdamW's decoupled weight decay still
shrinks it. slidekit does the same, from ``ArchSpec.pad_token_id``. Where
the padding token is EOS (packing separates documents with EOS) the
difference shows after one step, so both families are compared with the
transformers + torch.optim.AdamW reference on batches full of it.

Test: ``python -m pytest -q tests/test_padding_token.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slidekit import Batch, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.errors import ModelLoadError
from slidekit.models.adapters import llama, qwen2
from slidekit.models.decoder import embed_backward
from slidekit.models.loading import init_unit
from slidekit.testing.asserts import assert_losses_close, assert_states_close, rel_error
from slidekit.testing.models import tiny_config
from slidekit.testing.reference import reference_run

STEPS, LR, WD = 4, 1e-4, 0.1
VOCAB = 128
#: llama's tiny config has EOS 2: pad = EOS, as many fine-tuning configs set it; qwen2's has no EOS.
PAD = {"llama": 2, "qwen2": 5}
EMBED = "model.embed_tokens.weight"


def _batches(pad: int, seed: int = 0) -> list[Batch]:
    """Rows that end in padding (label -100) and hold the pad id as a real, labelled token too."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (3, 33), generator=gen)
        ids[0, 10] = ids[1, 4] = pad  # the pad id inside a row (EOS between packed documents)
        labels = ids[:, 1:].clone()
        ids[2, 20:] = pad  # the last row right-padded
        labels[2, 19:] = -100
        out.append(Batch(ids[:, :-1].contiguous(), labels))
    return out


def _train(model_dir, batches):
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=LR, weight_decay=WD),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
        steps=len(batches),
    )
    with Trainer(cfg) as t:
        assert t.spec.pad_token_id == t.hf_config.pad_token_id
        init = t.state_dict()
        result = t.fit(batches)
        return t.hf_config, init, result, t.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # untied and tied embeddings
def test_pad_row_trains_as_in_transformers(family, tiny_model):
    pad = PAD[family]
    model_dir = tiny_model(family, pad_token_id=pad)
    batches = _batches(pad)
    cfg, init, result, state = _train(model_dir, batches)
    ref = reference_run(cfg, init, batches, lr=LR, weight_decay=WD)
    assert ref.state is not None and cfg.pad_token_id == pad

    assert_losses_close(result.losses, ref.losses, rtol=1e-5)
    assert_states_close(state, ref.state, rtol=1e-5)
    row, row0 = state[EMBED][pad], init[EMBED][pad]
    assert row0.abs().max() > 0.01  # a trained-looking row, so that decay (and any update) shows
    decayed = row0.clone()
    for _ in range(STEPS):
        decayed.mul_(1 - LR * WD)  # torch AdamW: decoupled decay on a parameter whose gradient is zero
    if family == "llama":  # untied: no gradient reaches the row at all, only weight decay changes it
        torch.testing.assert_close(row, decayed, rtol=1e-6, atol=0)
        assert not row.equal(row0)
    else:  # tied: the LM head trains the row, exactly as it does in transformers
        assert rel_error(row, decayed) > 1e-4


def test_without_pad_token_id_the_pad_row_trains(tiny_model):
    """No pad_token_id in the config: the same id is an ordinary token whose row learns (the old behaviour)."""
    batches = _batches(PAD["llama"])
    cfg, init, _, state = _train(tiny_model("llama"), batches)
    assert cfg.pad_token_id is None
    ref = reference_run(cfg, init, batches, lr=LR, weight_decay=WD)
    assert_states_close(state, ref.state, rtol=1e-5)
    row, row0 = state[EMBED][PAD["llama"]], init[EMBED][PAD["llama"]]
    assert rel_error(row, row0) > 1e-3


@pytest.mark.parametrize("pad", [None, 0, 7, VOCAB - 1])
@pytest.mark.parametrize("tied", [False, True])
def test_embed_backward_matches_nn_embedding_padding_idx(pad, tied):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 50), generator=gen)
    ids[:, -5:] = 0 if pad is None else pad
    ids[1, 3] = VOCAB - 1
    dh = torch.randn(4, 50, 32, generator=gen)
    head = torch.randn(VOCAB, 32, generator=gen) if tied else torch.zeros(VOCAB, 32)  # a tied head's gradient

    weight = torch.randn(VOCAB, 32, generator=gen, requires_grad=True)
    F.embedding(ids, weight, padding_idx=pad).backward(dh)
    want = head + weight.grad

    got = head.clone()
    embed_backward(got, ids, dh, padding_idx=pad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if pad is not None:
        assert got[pad].equal(head[pad])  # nothing added to the padding row


@pytest.mark.parametrize("family, adapter", [("llama", llama), ("qwen2", qwen2)])
def test_spec_takes_pad_token_id_from_the_config(family, adapter):
    assert adapter(tiny_config(family)).pad_token_id is None
    assert adapter(tiny_config(family, pad_token_id=3)).pad_token_id == 3
    # Negative ids count from the end, as nn.Embedding counts padding_idx.
    assert adapter(tiny_config(family, pad_token_id=-1)).pad_token_id == VOCAB - 1
    for bad in (VOCAB, -VOCAB - 1):
        with pytest.raises(ModelLoadError, match=rf"pad_token_id={bad} is not supported.*overrides"):
            adapter(tiny_config(family, pad_token_id=bad))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_random_init_zeroes_the_pad_row_like_transformers(family):
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, pad_token_id=PAD[family])
    spec = llama(config) if family == "llama" else qwen2(config)
    embed = spec.embed
    master = torch.empty(embed.numel)
    init_unit(spec, embed, master, seed=0)
    rows = embed.views(master)["embed_tokens.weight"]
    assert rows[PAD[family]].eq(0).all() and rows.abs().sum(1).gt(0).sum() == VOCAB - 1
    hf = AutoModelForCausalLM.from_config(config)
    assert hf.get_input_embeddings().weight[PAD[family]].eq(0).all()
    plain = torch.empty(embed.numel)
    init_unit(
        llama(tiny_config("llama")) if family == "llama" else qwen2(tiny_config("qwen2")), embed, plain, 0
    )
    other = torch.arange(VOCAB) != PAD[family]
    assert rows[other].equal(embed.views(plain)["embed_tokens.weight"][other])  # the other rows as before
