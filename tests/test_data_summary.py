"""The run's tokenizer (refused when missing, never loaded empty; ``--tokenizer``), the dataset summary
printed before the first step, and truncation that removes every labelled token.

Expected counts come from separate tokenizer calls on the pieces of each record (the demo tokenizer:
BOS 1, EOS 2, every token of a document framed as ``[BOS] tokens [EOS]``).

Test: ``python -m pytest -q tests/test_data_summary.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from slidekit import DataConfig, EngineConfig, ModelConfig, RunConfig, TrainConfig, Trainer
from slidekit.cli import main
from slidekit.data import DataSpec, build_datasets, describe_data, load_tokenizer
from slidekit.data.configured import tokenizer_dir
from slidekit.errors import ConfigError
from slidekit.models.loading import demo_dir
from slidekit.testing.models import random_batches

DEMO_TOKENIZER = demo_dir() / "tokenizer"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(DEMO_TOKENIZER)


def write(tmp_path: Path, records: list[dict], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def n_tokens(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_a_model_directory_without_tokenizer_files_is_refused(family, tiny_model):
    """Regression: transformers builds an empty tokenizer (one token, id 0) from a Qwen2/Qwen3 config.json
    alone; every document then tokenized to [0]. Loading must refuse it, naming the directory and the fix."""
    model_dir = tiny_model(family)
    with pytest.raises(ConfigError, match=rf"{model_dir}.*holds no tokenizer.*--tokenizer DIR"):
        load_tokenizer(model_dir)


def test_an_empty_vocabulary_is_refused(tmp_path):
    """A tokenizer.json whose vocabulary is empty encodes text to nothing: refused, not trained on."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    empty = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token="<eos>")
    empty.save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError, match=r"encodes text to no token \(an empty vocabulary\).*--tokenizer DIR"
    ):
        load_tokenizer(tmp_path)


def _cfg(model_dir: Path, **kw: Any) -> TrainConfig:
    run = kw.pop("run", RunConfig())
    model = ModelConfig(source=str(model_dir), **kw)
    return TrainConfig(
        model=model, engine=EngineConfig(device="cpu"), data=DataConfig(seq_len=16), steps=1, run=run
    )


def test_training_on_the_data_without_a_tokenizer_is_refused_before_a_step(tiny_model):
    """Regression: the qwen2 run trained on rows of token id 0; now it is refused, naming the directory."""
    model_dir = tiny_model("qwen2")
    with Trainer(_cfg(model_dir)) as t:
        with pytest.raises(
            ConfigError, match=rf"the model directory '{model_dir}' holds no tokenizer.*--tokenizer"
        ):
            t.fit()
        assert t.engine.steps_done == 0


def test_an_export_without_a_tokenizer_is_refused_when_the_trainer_is_built(tiny_model, tmp_path):
    model_dir = tiny_model("qwen2")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"holds no tokenizer.*--tokenizer DIR"):
        Trainer(_cfg(model_dir, run=RunConfig(export_dir=str(out))))
    assert not out.exists()


def test_fit_on_batches_of_token_ids_needs_no_tokenizer_but_export_does(tiny_model, tmp_path):
    with Trainer(_cfg(tiny_model("qwen2"))) as t:
        assert len(t.fit(random_batches(128, steps=1)).losses) == 1
        with pytest.raises(ConfigError, match=r"holds no tokenizer"):
            t.export(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_option_names_another_directory(tiny_model, tmp_path):
    model_dir = tiny_model("qwen2", vocab_size=2048)  # the demo tokenizer's vocabulary
    cfg = _cfg(model_dir, tokenizer=str(DEMO_TOKENIZER), run=RunConfig(export_dir=str(tmp_path / "out")))
    assert tokenizer_dir(cfg, model_dir) == DEMO_TOKENIZER
    with Trainer(cfg) as t:
        train, _ = t.datasets()
        assert int(train.rows.max()) > 2  # real token ids, not the empty tokenizer's 0
        t.fit()
        path = t.export(str(tmp_path / "out"))
    from transformers import AutoTokenizer

    exported = AutoTokenizer.from_pretrained(path)
    assert exported("Hello world")["input_ids"] == load_tokenizer(DEMO_TOKENIZER)("Hello world")["input_ids"]
    nowhere = Trainer(_cfg(model_dir, tokenizer=str(tmp_path / "nowhere")))
    with nowhere, pytest.raises(ConfigError, match=r"model\.tokenizer '.*nowhere' holds no tokenizer"):
        nowhere.tokenizer()


def test_the_tokenizer_flag_maps_onto_the_config(tmp_path):
    from slidekit.cli import build_parser, config_from_args

    args = build_parser().parse_args(["finetune", "--tokenizer", str(tmp_path)])
    assert config_from_args(args).model.tokenizer == str(tmp_path)


# ------------------------------------------------------------------------------------------- summary

SHORT = {"prompt": "Hi", "completion": " there"}
LONG_PROMPT = {"prompt": "one two three four five six seven eight nine ten eleven", "completion": " ok"}
LONG_COMPLETION = {"prompt": "Tell", "completion": " one two three four five six seven eight nine ten"}


def test_the_summary_counts_what_hand_counting_gives(tmp_path, tok):
    records = [SHORT, LONG_PROMPT, LONG_COMPLETION]
    seq_len, width = 8, 9
    lengths = [1 + n_tokens(tok, r["prompt"]) + n_tokens(tok, r["completion"]) + 1 for r in records]
    assert lengths[0] <= width < lengths[1] and width < lengths[2]  # what the records are for
    p_long, p_tell = n_tokens(tok, LONG_PROMPT["prompt"]), n_tokens(tok, LONG_COMPLETION["prompt"])
    assert 1 + p_long >= width and 1 + p_tell < width  # LONG_PROMPT's labels all lie past the cut
    labelled_short = n_tokens(tok, SHORT["completion"]) + 1  # the completion, and EOS
    kept_long = width - 1 - p_tell  # targets 1..8 of the row, less BOS's and the prompt's
    before = [n_tokens(tok, r["completion"]) + 1 for r in records]
    cut = before[1] + before[2] - kept_long

    spec = DataSpec(path=write(tmp_path, records), seq_len=seq_len, packing=False, completion_only=True)
    train, held_out = build_datasets(spec, tok)
    s = train.stats
    assert (s.documents, s.tokens, s.labelled, s.rows) == (3, sum(lengths), labelled_short + kept_long, 2)
    assert (s.truncated, s.dropped_rows, s.cut_labels, s.emptied) == (2, 1, cut, 1)
    text = describe_data(spec, train, held_out, batch_size=1, grad_accum=2)
    assert text.splitlines() == [
        f"data: {spec.path} (prompt_completion, completion_only, one document per row of 8 + 1 tokens "
        "(packing off))",
        f"  train: 3 documents, {sum(lengths)} tokens, {labelled_short + kept_long} labelled, 2 rows "
        f"(2 documents truncated to seq_len + 1 = 9 tokens, cutting {cut} labelled tokens; 1 of them lost "
        "every labelled token (raise --seq-len, or pack); 1 document dropped: no labelled token); 1 step per "
        "epoch (2 rows // (1 rows x 2 micro-batches))",
    ]


def test_the_summary_of_a_held_out_split_and_rows_left_over(tmp_path, tok):
    texts = [f"Document {i} says something." for i in range(10)]
    spec = DataSpec(
        path=write(tmp_path, [{"text": t} for t in texts]), seq_len=16, packing=False, eval_fraction=0.2
    )
    train, held_out = build_datasets(spec, tok)
    assert held_out is not None
    text = describe_data(spec, train, held_out, batch_size=3, grad_accum=1)
    lines = text.splitlines()
    assert lines[1].endswith(
        "2 steps per epoch (8 rows // (3 rows x 1 micro-batch); the 2 rows left over start the next epoch)"
    )
    assert lines[1].startswith("  train: 8 documents, ")
    assert lines[2].startswith("  held out: 2 documents, ") and lines[2].endswith(", 2 rows")


def test_truncation_that_removes_every_label_says_so(tmp_path, tok):
    spec = DataSpec(path=write(tmp_path, [LONG_PROMPT] * 2), seq_len=8, packing=False, completion_only=True)
    with pytest.raises(ConfigError) as info:
        build_datasets(spec, tok)
    message = str(info.value)
    assert "only beyond seq_len + 1 = 9 tokens" in message and "(2 were)" in message
    assert "raise data.seq_len (CLI: --seq-len) or turn packing on" in message
    assert "no labelled token" not in message  # the data is not to blame
    packed = DataSpec(path=spec.path, seq_len=8, packing=True, completion_only=True)
    assert len(build_datasets(packed, tok)[0])  # packing keeps every label


def test_finetune_prints_the_summary_before_the_first_step(tmp_path, capsys):
    data = write(tmp_path, [{"text": f"Line {i} of the sample."} for i in range(40)])
    argv = ["finetune", "--data", str(data), "--seq-len", "16", "--batch-size", "4", "--device", "cpu"]
    assert main([*argv, "--epochs", "1", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model: demo")
    assert out[1] == f"data: {data} (text, packed into rows of 16 + 1 tokens)"
    assert out[2].startswith("  train: 40 documents, ") and " steps per epoch (" in out[2]
    found = re.search(r"; (\d+) steps per epoch \(", out[2])
    assert found, out[2]
    per_epoch = int(found.group(1))
    assert out[3] == f"  run: {per_epoch} steps = 1 epoch of {per_epoch} steps"
    assert out[4].startswith(f"done: {per_epoch} steps in ")
