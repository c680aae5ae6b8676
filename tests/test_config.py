"""Config validation names the bad value and what would be valid; the dataclasses are pinned."""

from __future__ import annotations

import dataclasses

import pytest

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from slidekit.errors import ConfigError


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: OptimConfig(lr=-1e-4), r"optim.lr must be > 0, got -0.0001"),
        (lambda: OptimConfig(betas=(0.9, 1.0)), r"optim.betas must be two numbers in \[0, 1\)"),
        (lambda: OptimConfig(weight_decay=-0.1), r"optim.weight_decay must be >= 0"),
        (lambda: DataConfig(batch_size=0), r"data.batch_size must be > 0, got 0"),
        (lambda: DataConfig(seq_len=-5), r"data.seq_len must be > 0"),
        (lambda: EngineConfig(window=1), r"engine.window must be >= 2"),
        (lambda: EngineConfig(compute_dtype="fp8"), r"engine.compute_dtype must be one of"),
        (lambda: EngineConfig(grad_buffers=0), r"engine.grad_buffers must be > 0"),
        (lambda: TrainConfig(steps=0), r"train.steps must be > 0"),
        (lambda: ModelConfig(source=""), r"model.source is empty"),
        (lambda: OptimConfig(schedule="step"), r"optim.schedule must be one of"),
        (lambda: OptimConfig(max_grad_norm=0.0), r"optim.max_grad_norm must be > 0"),
        (lambda: OptimConfig(min_lr_ratio=2.0), r"optim.min_lr_ratio must lie in \[0, 1\]"),
        (lambda: TrainConfig(grad_accum=0), r"train.grad_accum must be > 0"),
        (lambda: EngineConfig(state_offload_fraction=0.5), r"needs engine.state_offload_tier"),
        (
            lambda: EngineConfig(state_offload_fraction=1.5, state_offload_tier="posix"),
            r"must lie in \[0, 1\]",
        ),
    ],
)
def test_invalid_values_are_named(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_resume_accepts_a_flag_a_step_or_a_path():
    assert RunConfig().resume_target() is None
    assert RunConfig(dir="r", resume=True).resume_target() == "latest"
    assert RunConfig(dir="r", resume="latest").resume_target() == "latest"
    assert RunConfig(dir="r", resume=12).resume_target() == 12
    assert RunConfig(dir="r", resume=" 12 ").resume_target() == 12
    assert (
        RunConfig(dir="r", resume="r/checkpoints/step-00000012").resume_target()
        == "r/checkpoints/step-00000012"
    )
    for bad in (-1, "", "  ", 1.5):
        with pytest.raises(ConfigError, match=rf"run.resume must be .*got {bad!r}"):
            RunConfig(dir="r", resume=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"run.resume needs run.dir"):
        RunConfig(resume=3)


def test_configs_are_frozen():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3  # type: ignore[misc]


def test_to_dict_is_plain_data():
    d = TrainConfig().to_dict()
    assert d["optim"]["betas"] == [0.9, 0.999]
    assert d["engine"]["state_tier"] == "ram"


PINNED_FIELDS = {
    "ModelConfig": ["source", "random_init", "init_seed", "overrides"],
    "DataConfig": [
        "path",
        "format",
        "seq_len",
        "batch_size",
        "completion_only",
        "packing",
        "eval_fraction",
        "eval_every",
        "seed",
    ],
    "OptimConfig": [
        "name",
        "lr",
        "schedule",
        "warmup_steps",
        "min_lr_ratio",
        "max_grad_norm",
        "on_nonfinite",
        "betas",
        "eps",
        "weight_decay",
        "no_decay",
        "threads",
    ],
    "EngineConfig": [
        "device",
        "compute_dtype",
        "kernels",
        "state_tier",
        "state_offload_tier",
        "state_offload_fraction",
        "state_chunk",
        "activation_tier",
        "offload_dir",
        "window",
        "gpu_resident",
        "grad_buffers",
        "loss_chunk",
        "timeout_s",
    ],
    "TrainConfig": ["model", "data", "optim", "engine", "plugins", "run", "steps", "grad_accum", "seed"],
}


@pytest.mark.parametrize("cls", [ModelConfig, DataConfig, OptimConfig, EngineConfig, TrainConfig])
def test_config_fields_are_pinned(cls):
    """Ratchet: fields may be added (extend the table), never renamed or removed by accident."""
    assert [f.name for f in dataclasses.fields(cls)] == PINNED_FIELDS[cls.__name__]
