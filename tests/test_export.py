"""Export: a Hugging Face directory that transformers loads and that computes slidekit's logits."""

from __future__ import annotations

import json

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
from slidekit.errors import ConfigError
from slidekit.testing.asserts import rel_error
from slidekit.testing.models import FAMILIES, random_batches


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_model_gives_slidekits_logits(family, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model(family))),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
    )
    ids = random_batches(128, steps=1, batch=2, seq_len=12, seed=9)[0].input_ids
    with Trainer(cfg) as t:
        t.fit(random_batches(128, steps=3))  # fine-tuned weights, not the loaded ones
        ours = t.engine.forward(ids)
        path = t.export(str(tmp_path / "out"), dtype="float32")
        batch = random_batches(128, steps=1, seed=4)
        loss = t.evaluate(batch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    assert rel_error(ours, theirs) < 1e-5
    with torch.no_grad():
        logits = model(input_ids=batch[0].input_ids).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[0].labels.reshape(-1))
    assert loss == pytest.approx(ref.item(), rel=1e-5)


def test_bf16_sharded_export_with_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = TrainConfig(engine=EngineConfig(device="cpu"), steps=1)  # the demo model, with its tokenizer
    with Trainer(cfg) as t:
        from slidekit.export import export_model

        path = export_model(
            tmp_path / "out",
            hf_config=t.hf_config,
            state=t.engine.master_state(),
            tokenizer=t.tokenizer(),
            dtype="bfloat16",
            shard_bytes=1 << 20,
        )
        want = t.state_dict()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name].to(torch.bfloat16)), name
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_export_refuses_to_overwrite_and_bad_dtypes(tmp_path):
    (tmp_path / "taken").mkdir()
    with Trainer(TrainConfig(engine=EngineConfig(device="cpu"))) as t:
        with pytest.raises(ConfigError, match="already exists"):
            t.export(str(tmp_path / "taken"))
        with pytest.raises(ConfigError, match="export dtype must be one of"):
            t.export(str(tmp_path / "x"), dtype="int8")
    assert not (tmp_path / "x").exists()
