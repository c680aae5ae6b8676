"""Export: a Hugging Face directory that transformers loads and that computes slidekit's logits, written
so that it never replaces what slidekit did not write, and never leaves a half-written model in place."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig, Trainer
from slidekit.errors import ConfigError
from slidekit.export import (
    MANIFEST,
    ExportError,
    check_target,
    export_guards,
    export_model,
    remove_leftovers,
)
from slidekit.models.loading import demo_dir
from slidekit.testing.asserts import rel_error
from slidekit.testing.models import FAMILIES, random_batches

#: The tiny models have no tokenizer, and an export writes one: the demo's will do.
TOKENIZER = str(demo_dir() / "tokenizer")


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_model_gives_slidekits_logits(family, tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model(family)), tokenizer=TOKENIZER),  # an export writes one
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


def test_export_refuses_a_foreign_directory_and_bad_dtypes(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with Trainer(TrainConfig(engine=EngineConfig(device="cpu"))) as t:
        for overwrite in (False, True):  # overwrite never extends to files slidekit did not write
            with pytest.raises(ConfigError, match=r"not empty \(notes\.txt\) and holds no slidekit export"):
                t.export(str(taken), overwrite=overwrite)
        with pytest.raises(ConfigError, match="export dtype must be one of"):
            t.export(str(tmp_path / "x"), dtype="int8")
        empty = tmp_path / "empty"
        empty.mkdir()
        assert t.export(str(empty)) == empty  # an empty directory is a fine target
    assert (taken / "notes.txt").read_text() == "mine" and sorted(os.listdir(taken)) == ["notes.txt"]
    assert not (tmp_path / "x").exists()
    assert json.loads((empty / MANIFEST).read_text())["files"] == sorted(
        f for f in os.listdir(empty) if f != MANIFEST
    )


# --------------------------------------------------------------------------- what a target may be


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """(hf_config, FP32 state) of a tiny llama: enough to export without building a Trainer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from slidekit.testing.models import save_tiny_model

    directory = save_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    state = {n: t.float() for n, t in load_file(directory / "model.safetensors").items()}
    return AutoConfig.from_pretrained(directory), state


def _export(parts, out, **kw):
    hf_config, state = parts
    return export_model(
        out, hf_config=copy.deepcopy(hf_config), state=state, tokenizer=kw.pop("tokenizer", None), **kw
    )


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _staging_left(parent: Path) -> list[str]:
    return [e for e in os.listdir(parent) if ".slidekit-export-" in e]


def _guarded_setup(tmp_path: Path, case: str) -> tuple[Path, list]:
    """A directory layout and the target that would destroy something in it."""
    from slidekit.config import DataConfig, RunConfig

    model, data_dir, run_parent = tmp_path / "model", tmp_path / "data", tmp_path / "runs"
    for d in (model, data_dir, run_parent / "a" / "checkpoints"):
        d.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (data_dir / "train.jsonl").write_text('{"text": "x"}\n')
    cfg = TrainConfig(
        data=DataConfig(path=str(data_dir / "train.jsonl")), run=RunConfig(dir=str(run_parent / "a"))
    )
    targets = {
        "cwd": Path.cwd(),
        "run dir": run_parent / "a",
        "parent of run dir": run_parent,
        "model dir": model,
        "contains the data": data_dir,
        "inside checkpoints": run_parent / "a" / "checkpoints" / "model",
    }
    return targets[case], export_guards(cfg, model)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("cwd", "is the current directory"),
        ("run dir", "is the run directory"),
        ("parent of run dir", "contains the run directory"),
        ("model dir", "is the source model"),
        ("contains the data", "contains the data file"),
        ("inside checkpoints", "lies inside the run directory's checkpoints"),
    ],
)
def test_a_target_holding_what_the_run_needs_is_refused(parts, tmp_path, monkeypatch, case, message):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    target, guards = _guarded_setup(tmp_path, case)
    before = _tree(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=message):
            check_target(target, overwrite=overwrite, guards=guards)
        with pytest.raises(ConfigError, match=message):
            _export(parts, target, overwrite=overwrite, guards=guards)
    assert _tree(tmp_path) == before and not _staging_left(target.parent)


def test_a_file_or_a_path_below_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"export target .* is a file, not a directory"):
        check_target(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"cannot be created: '.*f' is a file, not a directory"):
        check_target(tmp_path / "f" / "sub" / "out")
    assert (tmp_path / "f").read_text() == "x"


def test_a_previous_export_is_replaced_only_when_asked_and_only_its_files(parts, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    _export(parts, out, shard_bytes=40_000)  # several shards and an index
    first = json.loads((out / MANIFEST).read_text())["files"]
    assert "model.safetensors.index.json" in first and len(first) > 3
    (out / "README.md").write_text("my notes")  # the user documents the export
    with pytest.raises(ConfigError, match="holds a previous slidekit export; set overwrite=True"):
        _export(parts, out)
    hf_config, state = parts
    changed = {n: t + 1.0 for n, t in state.items()}
    export_model(
        out,
        hf_config=copy.deepcopy(hf_config),
        state=changed,
        tokenizer=None,
        overwrite=True,
        dtype="float32",
    )
    files = json.loads((out / MANIFEST).read_text())["files"]
    assert files == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(out)) == sorted(["README.md", MANIFEST, "config.json", "model.safetensors"])
    assert (out / "README.md").read_text() == "my notes"
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), changed[name]), name
    assert not _staging_left(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_a_previous_export_holding_only_its_files_is_swapped_in_one_step(parts, tmp_path):
    out = tmp_path / "out"
    _export(parts, out, shard_bytes=40_000)
    inode = os.stat(out).st_ino
    _export(parts, out, overwrite=True)
    assert os.stat(out).st_ino != inode  # a new directory took the old one's place in one rename
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "config.json", "model.safetensors"])
    assert os.listdir(tmp_path) == ["out"]  # the old export went with the staging directory


class CrashAt:
    """``progress`` for export_model: raise an injected disk-full error at ``stage`` (the n-th time)."""

    def __init__(self, stage: str, nth: int = 1) -> None:
        self.stage, self.left = stage, nth

    def __call__(self, stage: str, detail: str) -> None:
        if stage == self.stage:
            self.left -= 1
            if self.left == 0:
                raise OSError(28, "No space left on device (injected)")


@pytest.mark.parametrize("stage", ["written", "install"])
@pytest.mark.parametrize("user_file", [False, True])
def test_a_failed_export_leaves_the_previous_one_intact(parts, tmp_path, stage, user_file):
    out = tmp_path / "out"
    _export(parts, out)
    if user_file:
        (out / "README.md").write_text("mine")
    before = _tree(out)
    hf_config, state = parts
    with pytest.raises(OSError, match="injected"):
        export_model(
            out,
            hf_config=copy.deepcopy(hf_config),
            state={n: t * 2 for n, t in state.items()},
            tokenizer=None,
            overwrite=True,
            progress=CrashAt(stage),
        )
    assert _tree(out) == before and os.listdir(tmp_path) == ["out"]


def test_a_crash_while_moving_files_leaves_a_recognisable_export(parts, tmp_path):
    """File-by-file replacement (the target holds a user's file): killed after the first file moved, the
    target is still an export whose manifest covers every file slidekit put there; the next export cleans up."""
    out = tmp_path / "out"
    _export(parts, out, shard_bytes=40_000)
    (out / "README.md").write_text("mine")
    with pytest.raises(OSError, match="injected"):
        _export(parts, out, overwrite=True, progress=CrashAt("moved"))
    listed = json.loads((out / MANIFEST).read_text())
    assert listed["status"] == "replacing"
    assert set(os.listdir(out)) - {MANIFEST, "README.md"} <= set(listed["files"])
    _export(parts, out, overwrite=True)
    assert sorted(os.listdir(out)) == sorted(["README.md", MANIFEST, "config.json", "model.safetensors"])
    assert "status" not in json.loads((out / MANIFEST).read_text())
    assert (out / "README.md").read_text() == "mine" and not _staging_left(tmp_path)


def test_a_users_file_where_the_export_writes_is_never_replaced(parts, tmp_path):
    from slidekit.data import load_tokenizer
    from slidekit.models.loading import demo_dir

    out = tmp_path / "out"
    _export(parts, out)  # no tokenizer
    (out / "tokenizer.json").write_text("the user's own")
    before = _tree(out)
    with pytest.raises(ConfigError, match=r"holds tokenizer\.json, which slidekit did not write"):
        _export(parts, out, overwrite=True, tokenizer=load_tokenizer(demo_dir() / "tokenizer"))
    assert _tree(out) == before and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize(
    ("manifest", "problem"),
    [
        ('{"format": "slidekit-export", "version": 1, "files": ["../victim"]}', "lists paths outside"),
        ('{"format": "slidekit-export", "version": 1, "files": ["/etc/passwd"]}', "lists paths outside"),
        ('{"format": "other", "files": []}', "is not a slidekit-export manifest"),
        ("{not json", "cannot be read"),
    ],
)
def test_a_bad_manifest_is_not_an_export(parts, tmp_path, manifest, problem):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text(manifest)
    (tmp_path / "victim").write_text("keep")
    with pytest.raises(ConfigError, match=problem):
        _export(parts, out, overwrite=True)
    assert (tmp_path / "victim").read_text() == "keep" and (out / MANIFEST).read_text() == manifest


def test_leftovers_of_a_dead_export_are_removed_and_a_live_ones_kept(parts, tmp_path):
    out = tmp_path / "out"
    dead = tmp_path / ".out.slidekit-export-dead"
    live = tmp_path / ".out.slidekit-export-live"
    other = tmp_path / ".other.slidekit-export-x"  # another target's: not this export's business
    for d in (dead, live, other):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live export holds its staging directory
        _export(parts, out)
        assert sorted(os.listdir(tmp_path)) == sorted(
            [".other.slidekit-export-x", ".out.slidekit-export-live", "out"]
        )
    finally:
        os.close(fd)
    assert remove_leftovers(out) == [live]


def test_a_checked_target_is_exported_without_checking_it_again(parts, tmp_path):
    """``check_target`` checks the dtype with the target; ``export_model`` given its Target repeats
    neither the check nor the removal of leftovers (the caller's: ``leftovers.reclaim_export``)."""
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"export dtype must be one of .*got 'int8'"):
        check_target(out, dtype="int8")
    target = check_target(out, dtype="float32")
    assert (target.path, target.previous, target.dtype) == (out, None, "float32")
    dead = tmp_path / ".out.slidekit-export-dead"  # an export from before owner records, dead: lock free
    dead.mkdir()
    with pytest.raises(ValueError, match="dtype='bfloat16' for a target checked for 'float32'"):
        _export(parts, target, dtype="bfloat16")
    assert _export(parts, target) == out
    assert json.loads((out / MANIFEST).read_text())["dtype"] == "float32" and dead.is_dir()
    _export(parts, out, overwrite=True)  # a path: checked, and its leftovers removed, here
    assert json.loads((out / MANIFEST).read_text())["dtype"] == "bfloat16" and not dead.exists()


@pytest.mark.parametrize("with_run_dir", [True, False])
def test_a_failed_export_says_where_the_weights_are(tiny_model, tmp_path, with_run_dir):
    def disk_full(lane: str) -> None:
        if lane == "export:written":
            raise OSError(28, "No space left on device (injected)")

    run = tmp_path / "run"
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama")), tokenizer=TOKENIZER),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(run) if with_run_dir else None),
        steps=2,
    )
    with Trainer(cfg, fault_hook=disk_full) as t:
        t.fit(random_batches(128, steps=2))
        where = (
            rf"safe in the checkpoint {run}/checkpoints/step-00000002 \(step 2\)"
            if with_run_dir
            else (r"still in this Trainer: fix the problem and call export\(\) again")
        )
        with pytest.raises(
            ExportError, match=rf"No space left on device \(injected\); the trained weights are {where}"
        ):
            t.export(str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == (["run"] if with_run_dir else [])
