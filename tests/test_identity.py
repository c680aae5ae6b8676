"""A resume refuses what changes the run's meaning, naming the field; fingerprints see other weights and data."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from slidekit import (
    DataConfig,
    EngineConfig,
    ModelConfig,
    OptimConfig,
    Plugins,
    RunConfig,
    TrainConfig,
    Trainer,
)
from slidekit import checkpoint as ck
from slidekit.fingerprint import SAMPLE_BYTES, file_sha256, files_fingerprint, weights_fingerprint
from slidekit.identity import (
    ADDED,
    FIXED,
    architecture,
    changed_settings,
    differences,
    identity,
    run_identity,
)
from slidekit.models.loading import demo_dir, weight_files
from slidekit.resume import saved_identity
from slidekit.testing.models import random_batches, save_tiny_model, tiny_config

BASE = TrainConfig(
    model=ModelConfig(source="/models/base"),
    optim=OptimConfig(schedule="cosine", lr=1e-3, warmup_steps=2),
    run=RunConfig(dir="runs/a"),
    steps=10,
)


def _with(path: str, value: object) -> TrainConfig:
    section, _, name = path.rpartition(".")
    if not section:
        return dataclasses.replace(BASE, **{name: value})
    return dataclasses.replace(
        BASE, **{section: dataclasses.replace(getattr(BASE, section), **{name: value})}
    )


def _identity(cfg: TrainConfig) -> dict[str, object]:
    return identity(cfg.to_dict(), model={}, fingerprints={})


@pytest.mark.parametrize(
    ("path", "value", "shown"),
    [
        ("data.split", "validation", "data.split: 'train' -> 'validation'"),
        ("data.columns", {"text": "body"}, "data.columns: {} -> {'text': 'body'}"),
        ("data.format", "text", "data.format: 'auto' -> 'text'"),
        ("data.seq_len", 64, "data.seq_len: 128 -> 64"),
        ("data.batch_size", 4, "data.batch_size: 8 -> 4"),
        ("data.completion_only", True, "data.completion_only: False -> True"),
        ("data.packing", False, "data.packing: True -> False"),
        ("data.eval_fraction", 0.1, "data.eval_fraction: 0.0 -> 0.1"),
        ("data.seed", 1, "data.seed: 0 -> 1"),
        ("grad_accum", 2, "grad_accum: 1 -> 2"),
        ("seed", 7, "seed: 0 -> 7"),
        ("optim.name", "adamw_8bit", "optim.name: 'layer_adam' -> 'adamw_8bit'"),
        ("optim.lr", 2e-3, "optim.lr: 0.001 -> 0.002"),
        ("optim.schedule", "linear", "optim.schedule: 'cosine' -> 'linear'"),
        ("optim.warmup_steps", 3, "optim.warmup_steps: 2 -> 3"),
        ("optim.min_lr_ratio", 0.1, "optim.min_lr_ratio: 0.0 -> 0.1"),
        ("steps", 20, "optim.schedule_steps: 10 -> 20"),  # the cosine schedule's length
    ],
)
def test_each_fixed_setting_is_refused_by_name(path, value, shown):
    changes, unchecked = differences(_identity(BASE), _identity(_with(path, value)))
    assert changes == [shown]
    assert unchecked == [k for k in FIXED if k.startswith("model.") or k == "data.file"]  # none given here


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("engine.state_tier", "posix"),
        ("engine.state_offload_fraction", 0.0),
        ("engine.activation_tier", "ram"),
        ("engine.gpu_resident", "none"),
        ("engine.window", 5),
        ("engine.offload_dir", "/nvme"),
        ("engine.device", "cuda"),
        ("run.checkpoint_every", 100),
        ("run.keep", 5),
        ("run.trace", "t.json"),
        ("run.export_dir", "out"),
        ("data.eval_every", 50),
        ("optim.weight_decay", 0.1),
        ("optim.max_grad_norm", 1.0),
        ("optim.on_nonfinite", "skip"),
        ("data.path", "/data/moved.jsonl"),  # the file's bytes are what counts (data.file)
    ],
)
def test_what_leaves_the_meaning_alone_may_change(path, value):
    assert differences(_identity(BASE), _identity(_with(path, value)))[0] == []


def test_a_constant_rate_run_may_be_extended_and_the_change_is_noted():
    constant = dataclasses.replace(BASE, optim=dataclasses.replace(BASE.optim, schedule="constant"))
    longer = dataclasses.replace(constant, steps=50)
    assert differences(_identity(constant), _identity(longer))[0] == []
    assert changed_settings(constant.to_dict(), longer.to_dict()) == ["steps 10 -> 50"]
    tweaked = dataclasses.replace(longer, optim=dataclasses.replace(longer.optim, weight_decay=0.1))
    assert changed_settings(constant.to_dict(), tweaked.to_dict()) == [
        "steps 10 -> 50",
        "optim.weight_decay 0.0 -> 0.1",
    ]


def test_an_identity_recorded_before_split_and_columns_reads_them_from_its_config_or_the_default():
    """A checkpoint whose identity predates data.split and data.columns (``ADDED``): its recorded
    configuration says what it ran with, and a configuration without them ran with the defaults."""
    old = {k: v for k, v in _identity(BASE).items() if k not in ADDED}
    with_config = saved_identity({"identity": old, "config": BASE.to_dict()})
    config = BASE.to_dict()
    del config["data"]["split"], config["data"]["columns"]
    without = saved_identity({"identity": old, "config": config})
    for saved in (with_config, without, identity(config, model={}, fingerprints={})):
        assert differences(saved, _identity(BASE)) == differences(_identity(BASE), _identity(BASE))
        assert differences(saved, _identity(_with("data.split", "test")))[0] == [
            "data.split: 'train' -> 'test'"
        ]
    other = _with("data.columns", {"text": "body"})
    recorded = saved_identity({"identity": old, "config": other.to_dict()})  # it ran with a mapping
    assert differences(recorded, _identity(other))[0] == []
    assert differences(recorded, _identity(BASE))[0] == ["data.columns: {'text': 'body'} -> {}"]


def test_the_default_learning_rate_is_compared_as_used():
    unset = dataclasses.replace(BASE, optim=dataclasses.replace(BASE.optim, lr=None))
    assert differences(_identity(unset), _identity(_with("optim.lr", 2e-5)))[0] == []  # the default
    demo = dataclasses.replace(unset, model=ModelConfig())
    assert differences(_identity(unset), _identity(demo))[0] == ["optim.lr: 2e-05 -> 0.002"]


def _spec(**overrides: object):
    hf = tiny_config("llama", **overrides)
    return Plugins().adapter_for(hf.model_type).descriptor.factory(hf)


def test_architecture_changes_are_named():
    base = architecture(_spec())
    assert differences(base, architecture(_spec(num_hidden_layers=4)))[0][:2] == [
        "model.layers: 3 -> 4",
        f"model.params: {base['model.params']} -> {architecture(_spec(num_hidden_layers=4))['model.params']}",
    ]
    (change,) = differences(base, architecture(_spec(rope_theta=1e6)))[0]
    assert change.startswith("model.rope: sha256:")


# --------------------------------------------------------------------------- fingerprints


def test_weights_fingerprint_sees_other_values_of_the_same_shape_not_a_move(tmp_path):
    a = save_tiny_model("llama", tmp_path / "a", seed=0)
    b = save_tiny_model("llama", tmp_path / "b", seed=1)
    fa, fb = weights_fingerprint(weight_files(a)), weights_fingerprint(weight_files(b))
    assert fa.startswith("sha256:") and fa != fb
    moved = tmp_path / "elsewhere" / "a"
    shutil.copytree(a, moved, copy_function=shutil.copyfile)  # new path, new mtimes
    assert weights_fingerprint(weight_files(moved)) == fa
    assert weights_fingerprint({}, init_seed=3) == "random-init:seed=3"


def test_weights_fingerprint_samples_every_tensor(tmp_path):
    a = save_tiny_model("llama", tmp_path / "a")
    files = weight_files(a)
    path = next(iter(files.values()))
    before = weights_fingerprint(files)
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    base = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    name, entry = max(
        ((k, v) for k, v in header.items() if k != "__metadata__"),
        key=lambda kv: kv[1]["data_offsets"][1] - kv[1]["data_offsets"][0],
    )
    start, stop = entry["data_offsets"]
    assert stop - start > 3 * SAMPLE_BYTES, name  # large enough to be sampled, not read whole
    data = bytearray(path.read_bytes())
    data[base + start] ^= 1  # the first byte of the largest tensor: inside its first sample
    path.write_bytes(bytes(data))
    assert weights_fingerprint(files) != before


def test_data_and_tokenizer_fingerprints_hash_every_byte(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    first = file_sha256(data)
    data.write_text('{"text": "b"}\n')  # same size, other bytes
    assert file_sha256(data) != first
    tok = files_fingerprint(demo_dir() / "tokenizer")
    assert tok is not None and tok.startswith("sha256:")
    assert files_fingerprint(tmp_path) is None  # no tokenizer files


def test_run_identity_takes_the_weight_files_it_is_given_and_expands_the_data_path(tmp_path, monkeypatch):
    """The caller that loads the weights passes their files (looked up once per start); ``~`` in
    data.path names the same file as its expansion."""
    model = save_tiny_model("llama", tmp_path / "model")
    files = weight_files(model)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    cfg = dataclasses.replace(BASE, model=ModelConfig(source=str(model)), data=DataConfig(path="~/d.jsonl"))
    spec = _spec()
    looked_up = run_identity(cfg, spec, model)
    elsewhere = tmp_path / "no-weights"  # where a lookup would find none: the files given are used
    elsewhere.mkdir()
    given = run_identity(cfg, spec, elsewhere, files)
    assert given["model.weights"] == looked_up["model.weights"] == weights_fingerprint(files)
    assert looked_up["data.file"] == file_sha256(tmp_path / "d.jsonl")


# --------------------------------------------------------------------------- through the trainer


def _run(run_dir: Path, **changes: object) -> TrainConfig:
    cfg = TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(run_dir), checkpoint_every=2),
        steps=4,
    )
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


def test_resume_refuses_other_weights_of_the_same_shape(tmp_path):
    a = save_tiny_model("llama", tmp_path / "a", seed=0)
    b = save_tiny_model("llama", tmp_path / "b", seed=1)
    run = tmp_path / "run"
    with Trainer(_run(run, model=ModelConfig(source=str(a)))) as t:
        t.fit(random_batches(128, steps=2, seq_len=32), steps=2)
    resume = dataclasses.replace(_run(run).run, resume=True)
    with pytest.raises(ck.CheckpointMismatch, match=r"model\.weights: sha256:[0-9a-f]{12} -> sha256:"):
        Trainer(_run(run, model=ModelConfig(source=str(b)), run=resume))
    moved = tmp_path / "moved"
    shutil.copytree(a, moved, copy_function=shutil.copyfile)
    with Trainer(_run(run, model=ModelConfig(source=str(moved)), run=resume)) as t:
        assert t.engine.steps_done == 2
        assert any(f"model.source '{a}' -> '{moved}'" in n for n in t.notes)


def test_resume_refuses_other_data_and_allows_the_same_data_moved(tmp_path):
    data = tmp_path / "corpus.jsonl"
    shutil.copyfile(demo_dir() / "corpus.jsonl", data)
    run = tmp_path / "run"
    with Trainer(_run(run, data=DataConfig(seq_len=32, batch_size=2, path=str(data)))) as t:
        t.fit(steps=2)
    resume = dataclasses.replace(_run(run).run, resume=True)
    moved = tmp_path / "moved.jsonl"
    shutil.copyfile(data, moved)
    with Trainer(_run(run, data=DataConfig(seq_len=32, batch_size=2, path=str(moved)), run=resume)) as t:
        assert t.engine.steps_done == 2 and any("data.path" in n for n in t.notes)
    with data.open("a") as f:
        f.write('{"text": "one more document"}\n')
    with pytest.raises(ck.CheckpointMismatch, match=r"data\.file: sha256:[0-9a-f]{12} -> sha256:"):
        Trainer(_run(run, data=DataConfig(seq_len=32, batch_size=2, path=str(data)), run=resume))


def test_resume_refuses_another_column_mapping_of_the_same_data(tmp_path):
    """Same bytes, other records: the column a field is read from is part of what a resume keeps."""
    data = tmp_path / "corpus.jsonl"
    lines = [json.loads(line) for line in (demo_dir() / "corpus.jsonl").read_text().splitlines()]
    data.write_text("".join(json.dumps({"text": r["text"], "body": r["text"][::-1]}) + "\n" for r in lines))
    mapped = DataConfig(seq_len=32, batch_size=2, path=str(data), columns={"text": "body"})
    run = tmp_path / "run"
    with Trainer(_run(run, data=mapped)) as t:
        t.fit(steps=2)
    resume = dataclasses.replace(_run(run).run, resume=True)
    with pytest.raises(ck.CheckpointMismatch, match=r"data\.columns: \{'text': 'body'\} -> \{\}"):
        Trainer(_run(run, data=dataclasses.replace(mapped, columns={}), run=resume))
    with Trainer(_run(run, data=mapped, run=resume)) as t:
        assert t.engine.steps_done == 2
