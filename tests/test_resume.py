"""Checkpoints and resume: a killed run continues bitwise; a crash mid-checkpoint loses nothing.

The run uses the embedded data (so the data position is restored too), and
optimizer state split between RAM and a tier that cannot map (so state is
checkpointed through deferred reads and restored through writes). Damage is
injected into the files of real checkpoints (a flipped bit, edited metadata);
a resume falls back past it, moves the damaged checkpoint aside, and the run
goes on; a resume that would change what the run means is refused
(``tests/test_identity.py`` covers each field).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slidekit import DataConfig, EngineConfig, OptimConfig, Plugins, RunConfig, TrainConfig, Trainer
from slidekit import checkpoint as ck
from slidekit.errors import ConfigError
from slidekit.hookspecs import hookimpl
from slidekit.interfaces import TierDescriptor
from slidekit.testing.asserts import assert_states_equal
from slidekit_tiers.ram import RamTier


class Unmapped(RamTier):
    name = "unmapped_ram"

    def map(self, key):
        return None


class UnmappedPlugin:
    @hookimpl
    def slidekit_storage_tiers(self) -> Iterator[TierDescriptor]:
        yield TierDescriptor(name="unmapped_ram", factory=Unmapped)


def _config(run_dir, *, resume=False, every=2, steps=6, keep=2, **optim) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, schedule="cosine", warmup_steps=2, **optim),
        engine=EngineConfig(device="cpu", state_offload_tier="unmapped_ram", state_offload_fraction=0.5),
        run=RunConfig(dir=str(run_dir), checkpoint_every=every, resume=resume, keep=keep),
        steps=steps,
    )


def _trainer(cfg, **kw) -> Trainer:
    return Trainer(cfg, plugins=Plugins(extra=[("unmapped", UnmappedPlugin())]), **kw)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_resume_continues_bitwise(tmp_path, clip):
    with _trainer(_config(tmp_path / "a", max_grad_norm=clip)) as t:
        whole = t.fit()
        want = t.state_dict()
    with _trainer(_config(tmp_path / "b", max_grad_norm=clip)) as t:
        first = t.fit(steps=4)  # "killed" after step 4 (checkpoint at 4 and at the end of fit)
    with (tmp_path / "b" / "metrics.jsonl").open(
        "a"
    ) as f:  # steps the killed run logged after it, one cut short
        f.write('{"step": 5, "loss": 99.0}\n{"step": 6, "lo')
    with _trainer(_config(tmp_path / "b", resume=True, max_grad_norm=clip)) as t:
        assert t.engine.steps_done == 4
        rest = t.fit(steps=2)
        got = t.state_dict()
    assert first.losses + rest.losses == whole.losses
    assert_states_equal(got, want)
    metrics = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]  # the resumed run's steps 5 and 6, once
    assert [m["loss"] for m in metrics[4:]] == rest.losses
    assert json.loads((tmp_path / "b" / "config.json").read_text())["run"]["resume"] is True


class CrashAt:
    """A fault hook that raises when the checkpoint of ``step`` reaches ``stage``."""

    def __init__(self, stage: str, trainer_box: list) -> None:
        self.stage, self.box, self.armed = stage, trainer_box, False

    def __call__(self, lane: str) -> None:
        if self.armed and lane == f"checkpoint:{self.stage}":
            raise OSError(28, "No space left on device (injected)")


@pytest.mark.parametrize("stage", ["array", "manifest", "commit"])
def test_a_crash_mid_checkpoint_keeps_the_previous_one(tmp_path, stage):
    crash = CrashAt(stage, [])
    t = _trainer(_config(tmp_path, every=2), fault_hook=crash)
    t.fit(steps=2)  # checkpoint of step 2 commits before fit returns
    crash.armed = True
    with pytest.raises(ck.CheckpointError, match="No space left"):
        t.fit(steps=2)  # the checkpoint of step 4 fails: the run stops with the error
    good = ck.latest(tmp_path / "checkpoints")
    assert good is not None and good.name == "step-00000002"
    assert not list((tmp_path / "checkpoints").glob("step-00000004"))
    with _trainer(_config(tmp_path, resume=True)) as t:
        assert t.engine.steps_done == 2
        t.fit(steps=1)


def test_resume_refuses_another_model(tmp_path):
    with _trainer(_config(tmp_path)) as t:
        t.fit(steps=2)
    cfg = _config(tmp_path, resume=True)
    other = TrainConfig(
        model=type(cfg.model)(overrides={"num_hidden_layers": 3}),
        data=cfg.data,
        optim=cfg.optim,
        engine=cfg.engine,
        run=cfg.run,
    )
    with pytest.raises(ck.CheckpointMismatch, match="model"):
        _trainer(other)


def test_resume_without_a_checkpoint_says_so(tmp_path):
    with pytest.raises(ConfigError, match="nothing to resume"):
        _trainer(_config(tmp_path, resume=True))
    with pytest.raises(ConfigError, match=r"run\.resume needs run\.dir"):
        RunConfig(resume=True)


def _flip_a_bit(checkpoint: Path) -> None:
    """One flipped bit in the middle of a master's chunk file: only the checksum can tell."""
    chunk = checkpoint / "arrays" / "master%2F1" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The uninterrupted 6-step run every resumed run below must match bitwise."""
    with _trainer(_config(tmp_path_factory.mktemp("whole"), every=0)) as t:
        result = t.fit()
        return result.losses, t.state_dict()


def test_a_damaged_checkpoint_is_moved_aside_and_its_step_written_again(tmp_path, whole_run):
    with _trainer(_config(tmp_path, every=1)) as t:
        t.fit(steps=3)
    newest = ck.latest(tmp_path / "checkpoints")
    assert newest is not None and newest.name == "step-00000003"
    (newest / "meta.json").write_text("{}")  # damage it
    with pytest.warns(RuntimeWarning, match=r"skipping damaged checkpoint .*step-00000003.*moved it aside"):
        t = _trainer(_config(tmp_path, resume=True, every=1))
    with t:
        assert t.engine.steps_done == 2
        rest = t.fit()  # writes step 3 again: the damaged one no longer stands in the way
        assert rest.losses == whole_run[0][2:]
    (aside,) = (tmp_path / "checkpoints").glob("damaged-step-00000003-*")
    assert (aside / "DAMAGED.txt").is_file()
    with _trainer(_config(tmp_path, resume=True, every=1)) as t:  # and every later resume works
        assert t.engine.steps_done == 6
        assert_states_equal(t.state_dict(), whole_run[1])


def test_a_flipped_bit_in_the_newest_checkpoint_falls_back_to_the_older_one(tmp_path, whole_run):
    with _trainer(_config(tmp_path, every=1)) as t:
        t.fit(steps=4)  # keep=2: steps 3 and 4 are on disk
    _flip_a_bit(tmp_path / "checkpoints" / "step-00000004")
    assert ck.latest(tmp_path / "checkpoints").name == "step-00000004"  # the cheap check cannot see it
    with pytest.warns(RuntimeWarning, match=r"step-00000004.*fails its sha256 checksum.*moved it aside"):
        t = _trainer(_config(tmp_path, resume=True, every=1))
    with t:
        assert t.engine.steps_done == 3
        rest = t.fit()
        assert rest.losses == whole_run[0][3:]
        assert_states_equal(t.state_dict(), whole_run[1])
    assert [s for s, _ in ck.step_dirs(tmp_path / "checkpoints")] == [5, 6]
    assert len(list((tmp_path / "checkpoints").glob("damaged-step-00000004-*"))) == 1


def test_every_checkpoint_damaged_is_said_so(tmp_path):
    with _trainer(_config(tmp_path, every=1)) as t:
        t.fit(steps=2)
    for step in (1, 2):
        _flip_a_bit(tmp_path / "checkpoints" / f"step-{step:08d}")
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(ck.CheckpointCorrupt, match=r"every checkpoint in .* is damaged"),
    ):
        _trainer(_config(tmp_path, resume=True))


@pytest.mark.parametrize("how", ["step", "path"])
def test_resume_from_a_chosen_checkpoint_sets_the_newer_ones_aside(tmp_path, whole_run, how):
    with _trainer(_config(tmp_path, every=2, keep=3)) as t:
        t.fit()  # steps 2, 4 and 6 on disk
    chosen = tmp_path / "checkpoints" / "step-00000002"
    target = 2 if how == "step" else str(chosen)
    with pytest.warns(RuntimeWarning, match=r"resumed from step 2.*moved them aside"):
        t = _trainer(_config(tmp_path, resume=target, every=2, keep=3))
    with t:
        assert t.engine.steps_done == 2 and any(str(chosen) in n for n in t.notes)
        rest = t.fit()
        assert rest.losses == whole_run[0][2:]
        assert_states_equal(t.state_dict(), whole_run[1])
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert [n for n in names if n.startswith("step-")] == ["step-00000002", "step-00000004", "step-00000006"]
    assert [n[:27] for n in names if n.startswith("superseded-")] == [
        "superseded-step-00000004-20",
        "superseded-step-00000006-20",
    ]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]


def test_a_damaged_or_missing_chosen_checkpoint_is_refused_with_the_choices(tmp_path):
    with _trainer(_config(tmp_path, every=2)) as t:
        t.fit(steps=4)
    _flip_a_bit(tmp_path / "checkpoints" / "step-00000002")
    with pytest.raises(
        ck.CheckpointCorrupt, match=r"fails its sha256 checksum.*holds steps \[2, 4\]: resume from"
    ):
        _trainer(_config(tmp_path, resume=2))
    assert (tmp_path / "checkpoints" / "step-00000002").is_dir()  # chosen by name: not moved
    with pytest.raises(
        ConfigError, match=r"run.resume=7: there is no checkpoint directory .*holds steps \[2, 4\]"
    ):
        _trainer(_config(tmp_path, resume=7))
    with _trainer(_config(tmp_path, resume="4")) as t:  # the CLI passes the step as text
        assert t.engine.steps_done == 4


def test_resume_refuses_a_change_of_meaning_and_names_it(tmp_path):
    with _trainer(_config(tmp_path)) as t:
        t.fit(steps=2)
    cfg = _config(tmp_path, resume=True)
    changed = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, seq_len=16), optim=dataclasses.replace(cfg.optim, lr=2e-3)
    )
    with pytest.raises(
        ck.CheckpointMismatch, match=r"data\.seq_len: 32 -> 16; optim\.lr: 0\.001 -> 0\.002\. Resume with"
    ):
        _trainer(changed)


def test_resume_allows_what_leaves_the_meaning_alone(tmp_path, whole_run):
    with _trainer(_config(tmp_path, every=2)) as t:
        t.fit(steps=2)
    cfg = _config(tmp_path, resume=True, every=3, keep=1)
    moved = dataclasses.replace(
        cfg,
        engine=dataclasses.replace(cfg.engine, state_offload_fraction=0.0, window=2),  # placement
        optim=dataclasses.replace(cfg.optim, on_nonfinite="skip"),  # noted, same arithmetic here
        run=dataclasses.replace(
            cfg.run, trace=str(tmp_path / "trace.json"), export_dir=str(tmp_path / "out")
        ),
    )
    with _trainer(moved) as t:
        assert any("resumed with changed settings: optim.on_nonfinite 'stop' -> 'skip'" in n for n in t.notes)
        rest = t.fit()
        assert rest.losses == whole_run[0][2:]
        assert_states_equal(t.state_dict(), whole_run[1])


def test_a_checkpoint_from_before_identities_resumes_with_a_warning(tmp_path):
    with _trainer(_config(tmp_path)) as t:
        t.fit(steps=2)
    path = tmp_path / "checkpoints" / "step-00000002"
    meta = ck.load_meta(path)
    del meta["identity"]  # what an older slidekit wrote
    arrays = {name: ck.read(path, name) for name in ck.read_manifest(path).arrays}
    with ck.CheckpointWriter(tmp_path / "checkpoints", keep=None) as w:
        w.save(2, arrays, meta, overwrite=True).result(timeout=60)
    with pytest.warns(
        RuntimeWarning, match=r"did not record model\.weights, model\.tokenizer, model\.hidden_size"
    ):
        t = _trainer(_config(tmp_path, resume=True))
    with t:
        assert t.engine.steps_done == 2
    changed = _config(tmp_path, resume=True, steps=8)  # what it did record is still checked
    with pytest.raises(ck.CheckpointMismatch, match=r"optim\.schedule_steps: 6 -> 8"):
        _trainer(changed)


# --------------------------------------------------------------------------- another optimizer, --resume RUN_DIR


def test_a_changed_optimizer_is_said_plainly(tmp_path):
    """A layer_adam checkpoint resumed with adamw_8bit: the optimizer is named, not "missing arrays"."""
    with _trainer(_config(tmp_path)) as t:
        t.fit(steps=2)
    path = tmp_path / "checkpoints" / "step-00000002"
    with pytest.raises(ck.CheckpointMismatch) as err:
        _trainer(_config(tmp_path, resume=True, name="adamw_8bit"))
    assert str(err.value) == (
        f"cannot resume from {path}: it holds the state of optimizer 'layer_adam', and this run is configured "
        "with 'adamw_8bit' (optim.name); an optimizer continues only from its own state: resume with the "
        "optimizer that wrote it (optim.name='layer_adam', CLI: --optimizer layer_adam); to go on with another "
        "optimizer, start a new run (a new run directory) from an export of this one's weights"
    )
    # a checkpoint that does not record its optimizer: its state arrays tell, and the message says so
    meta = ck.load_meta(path)
    del meta["identity"]["optim.name"], meta["config"]["optim"]["name"]
    arrays = {name: ck.read(path, name) for name in ck.read_manifest(path).arrays}
    with ck.CheckpointWriter(tmp_path / "checkpoints", keep=None) as w:
        w.save(2, arrays, meta, overwrite=True).result(timeout=60)
    unrecorded = pytest.warns(RuntimeWarning, match=r"did not record optim\.name")
    with unrecorded, pytest.raises(ck.CheckpointMismatch) as err:
        _trainer(_config(tmp_path, resume=True, name="adamw_8bit"))
    text = str(err.value)
    assert "missing arrays" not in text
    assert text.startswith(
        f"cannot resume from {path}: its optimizer state (per unit: exp_avg, exp_avg_sq) is not the state "
        "'adamw_8bit' keeps (per unit: "
    )
    assert "the checkpoint was written by another version or setting of 'adamw_8bit'" in text
    with pytest.warns(RuntimeWarning, match=r"did not record optim\.name"):
        t = _trainer(_config(tmp_path, resume=True))  # with the optimizer that wrote it, it resumes
    with t:
        assert t.engine.steps_done == 2


DEMO = ["--seq-len", "32", "--batch-size", "2", "--lr", "1e-3", "--device", "cpu", "--quiet"]


def _arrays(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {name: ck.read(checkpoint, name) for name in ck.read_manifest(checkpoint).arrays}


def test_resume_run_dir_continues_bitwise_with_more_steps(tmp_path, capsys):
    """``--resume RUN_DIR --max-steps 4`` after a 2-step run is the 4-step run, bit for bit."""
    from slidekit.cli import main

    whole, part = tmp_path / "whole", tmp_path / "part"
    assert main(["finetune", *DEMO, "--steps", "4", "--run-dir", str(whole)]) == 0
    assert main(["finetune", *DEMO, "--steps", "2", "--run-dir", str(part), "--checkpoint-every", "1"]) == 0
    capsys.readouterr()
    assert main(["finetune", "--resume", str(part), "--max-steps", "4", "--keep", "3", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"resuming the run in {part} with its saved configuration ({part / 'config.json'})" in out
    changed = next(line for line in out.splitlines() if line.startswith("changed on the command line: "))
    assert "run.keep 2 -> 3" in changed and "done: 2 steps" in out
    assert (
        "steps 2 -> 4 (the learning rate is constant after the warm-up: the run goes on at the same "
        in changed
    )
    want, got = (
        _arrays(whole / "checkpoints" / "step-00000004"),
        _arrays(part / "checkpoints" / "step-00000004"),
    )
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    losses = [
        [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, part)
    ]
    assert losses[0] == losses[1]
    saved = json.loads((part / "config.json").read_text())
    assert saved["steps"] == 4 and saved["run"]["keep"] == 3 and saved["run"]["resume"] is True
    assert sorted(p.name for p in (part / "checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000003",
        "step-00000004",
    ]
