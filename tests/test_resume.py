"""Checkpoints and resume: a killed run continues bitwise; a crash mid-checkpoint loses nothing.

The run uses the embedded data (so the data position is restored too), and
optimizer state split between RAM and a tier that cannot map (so state is
checkpointed through deferred reads and restored through writes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

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


def _config(run_dir, *, resume=False, every=2, steps=6, **optim) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01, schedule="cosine", warmup_steps=2, **optim),
        engine=EngineConfig(device="cpu", state_offload_tier="unmapped_ram", state_offload_fraction=0.5),
        run=RunConfig(dir=str(run_dir), checkpoint_every=every, resume=resume),
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


def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(tmp_path):
    with _trainer(_config(tmp_path, every=1)) as t:
        t.fit(steps=3)
    newest = ck.latest(tmp_path / "checkpoints")
    assert newest is not None and newest.name == "step-00000003"
    (newest / "meta.json").write_text("{}")  # damage it
    with pytest.warns(RuntimeWarning), _trainer(_config(tmp_path, resume=True)) as t:
        assert t.engine.steps_done == 2
    assert torch.isfinite(torch.tensor(1.0))
