"""What an export carries beside the weights: the source's generation config, a config that says ``dtype``
(transformers 5's name, no deprecated ``torch_dtype``), and a model card with Hub metadata and the run's
settings and losses; all listed in the manifest, and never replacing a card the user wrote."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig, Trainer
from slidekit.export import MANIFEST, export_model
from slidekit.modelcard import base_model_id, last_logged, model_card
from slidekit.models.loading import demo_dir
from slidekit.testing.models import random_batches, save_tiny_model

#: The tiny models have no tokenizer, and an export writes one: the demo's will do.
TOKENIZER = str(demo_dir() / "tokenizer")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_log():
    """Every message transformers logs meanwhile (its logger does not propagate, and warns once per
    process: the once-cache is cleared so a message logged by an earlier test shows again)."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        yield records.messages
    finally:
        logger.removeHandler(records)


@pytest.fixture
def model_with_generation_config(tmp_path):
    """A tiny llama directory with its own generation_config.json (sampling settings of its maker)."""
    from transformers import GenerationConfig

    directory = save_tiny_model("llama", tmp_path / "src")
    GenerationConfig(
        bos_token_id=1, eos_token_id=[2, 7], do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=77
    ).save_pretrained(directory)
    return directory


def _card(path: Path):
    from huggingface_hub import ModelCard

    return ModelCard.load(path / "README.md")


def test_an_export_carries_the_generation_config_a_dtype_and_a_card(
    model_with_generation_config, tmp_path, transformers_log
):
    from transformers import AutoModelForCausalLM

    src = model_with_generation_config
    cfg = TrainConfig(
        model=ModelConfig(source=str(src), tokenizer=TOKENIZER),
        optim=OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=1, weight_decay=0.1, max_grad_norm=1.0),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
        steps=3,
    )
    with Trainer(cfg) as t:
        result = t.fit(random_batches(128, steps=3))
        out = t.export(str(tmp_path / "my-finetune"), dtype="float32")
    assert (out / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == "float32" and "torch_dtype" not in written
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert {"generation_config.json", "README.md", "config.json", "model.safetensors"} <= set(files)
    assert files == sorted(p.name for p in out.iterdir() if p.name != MANIFEST)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    gen = model.generation_config
    assert (gen.eos_token_id, gen.temperature, gen.top_p, gen.max_new_tokens) == ([2, 7], 0.6, 0.9, 77)
    said = transformers_log + [str(w.message) for w in caught]
    assert not [m for m in said if "torch_dtype" in m], said  # neither the export nor the load warns

    card = _card(out)
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # a local directory
    assert {"slidekit", "llama"} <= set(meta["tags"])
    text = card.text
    assert text.startswith("\n# my-finetune\n")
    assert f"| training loss (the last step's) | 3 | {result.losses[-1]:.4f} |" in text
    assert "evaluation loss" not in text  # nothing was held out
    for row in (
        "| optimizer | layer_adam (betas 0.9, 0.999; eps 1e-08; weight decay 0.1 (not on norm.weight, bias)) |",
        "| learning rate | 0.001 peak, cosine decay to 0 x peak, 1 warm-up step(s) |",
        "| gradient clipping | global norm 1 |",
        "| steps | 3 |",
        "| batch | 8 rows x 128 tokens per micro-batch, 1 micro-batch(es) per step: 8 rows, 1024 tokens per step |",
        "| sequence length | 128 |",
        "| precision | float32 compute, FP32 master weights and optimizer; exported as float32 |",
        "| drivers | kernels=torch_ref, optimizer=layer_adam, state_tier=ram |",
    ):
        assert row in text, row
    import slidekit

    assert f"with slidekit {slidekit.__version__}" in text
    whole = json.loads(text.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert whole == cfg.to_dict()


def test_the_demo_export_has_no_generation_config_and_its_card_has_the_eval_loss(tmp_path):
    cfg = TrainConfig(engine=EngineConfig(device="cpu"), data=DataConfig(eval_fraction=0.2), steps=2)
    with Trainer(cfg) as t:
        result = t.fit()
        eval_loss = t.eval_loss()
        out = t.export(str(tmp_path / "out"))
    assert not (out / "generation_config.json").exists()  # the demo has none: transformers derives it
    text = _card(out).text
    assert "slidekit's embedded demo model" in text
    assert f"| training loss (the last step's) | 2 | {result.losses[-1]:.4f} |" in text
    assert eval_loss is not None
    assert f"| evaluation loss (held-out documents) | 2 | {eval_loss:.4f} |" in text


def test_an_export_after_a_resume_that_trains_nothing_takes_the_losses_from_the_run(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama")), tokenizer=TOKENIZER),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu", compute_dtype="float32"),
        run=RunConfig(dir=str(run)),
        steps=2,
    )
    with Trainer(cfg) as t:
        losses = t.fit(random_batches(128, steps=2)).losses
    with Trainer(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))) as t:
        assert t.fit(random_batches(128, steps=2)).losses == []  # every step was taken already
        out = t.export(str(tmp_path / "out"))
    assert f"| training loss (the last step's) | 2 | {losses[-1]:.4f} |" in _card(out).text


def test_a_card_or_generation_config_the_user_wrote_is_kept(model_with_generation_config, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    src = model_with_generation_config
    hf_config = AutoConfig.from_pretrained(src)
    state = {n: t.float() for n, t in load_file(src / "model.safetensors").items()}

    def export(**kw):
        return export_model(
            tmp_path / "out", hf_config=copy.deepcopy(hf_config), state=state, tokenizer=None, **kw
        )

    out = export()  # as slidekit did before it wrote cards
    assert not (out / "README.md").exists() and not (out / "generation_config.json").exists()
    (out / "README.md").write_text("my own card")
    with pytest.warns(RuntimeWarning, match=r"holds a README\.md that slidekit did not write: it is kept"):
        export(overwrite=True, source_dir=src, model_card="slidekit's card")
    assert (out / "README.md").read_text() == "my own card"
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert "README.md" not in files and "generation_config.json" in files

    (out / "README.md").unlink()  # without the user's card, slidekit's goes in, and is slidekit's to replace
    export(overwrite=True, source_dir=src, model_card="card 1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(overwrite=True, source_dir=src, model_card="card 2")
    assert (out / "README.md").read_text() == "card 2"


# --------------------------------------------------------------------------- the card's parts


def test_a_model_in_the_hub_cache_is_named_by_its_hub_id_and_its_license_carries_over(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "0123abc"
    shutil.copytree(save_tiny_model("qwen2", tmp_path / "tiny"), snapshot)
    (snapshot / "README.md").write_text("---\nlicense: apache-2.0\nlanguage:\n- en\n---\n# Qwen2.5\n")
    assert base_model_id(snapshot) == "Qwen/Qwen2.5-0.5B"
    assert base_model_id(tmp_path / "tiny") is None and base_model_id(None) is None
    cfg = TrainConfig(model=ModelConfig(source=str(snapshot)))
    text = model_card(
        cfg,
        title="out",
        family="qwen2",
        source_dir=snapshot,
        step=150,
        lr=2e-5,
        drivers={"optimizer": "layer_adam"},
        dtype="bfloat16",
        compute_dtype="bfloat16",
        logged={},
        version="9.9",
    )
    from huggingface_hub import ModelCard

    card = ModelCard(text)
    meta = card.data.to_dict()
    assert meta["base_model"] == "Qwen/Qwen2.5-0.5B" and meta["base_model_relation"] == "finetune"
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert "[Qwen/Qwen2.5-0.5B](https://huggingface.co/Qwen/Qwen2.5-0.5B)" in card.text
    assert "| no loss was logged | | |" in card.text


def test_last_logged_reads_the_last_losses_up_to_a_step_and_skips_torn_lines(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text(
        '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5, "eval_loss": 2.9}\n'
        '{"step": 3, "loss": 2.0}\n{"step": 4, "loss": 1.'
    )
    assert last_logged(log) == {"loss": (3, 2.0), "eval_loss": (2, 2.9)}
    assert last_logged(log, upto=1) == {"loss": (1, 3.0)}
    assert last_logged(tmp_path / "none.jsonl") == {}
