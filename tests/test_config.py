"""Config validation names the bad value and what would be valid; the dataclasses are pinned."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, PluginConfig, RunConfig, TrainConfig
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
    "ModelConfig": ["source", "random_init", "init_seed", "overrides", "tokenizer"],
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
        "split",
        "columns",
    ],
    "OptimConfig": [
        "name",
        "lr",
        "schedule",
        "warmup_steps",
        "warmup_ratio",
        "min_lr_ratio",
        "max_grad_norm",
        "on_nonfinite",
        "clip_overlap",
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
        "recompute",
        "resident_weights",
        "upload_copy",
        "update_order",
    ],
    "TrainConfig": ["model", "data", "optim", "engine", "plugins", "run", "steps", "grad_accum", "seed", "epochs"],
}


@pytest.mark.parametrize("cls", [ModelConfig, DataConfig, OptimConfig, EngineConfig, TrainConfig])
def test_config_fields_are_pinned(cls):
    """Ratchet: fields may be added (extend the table), never renamed or removed by accident."""
    assert [f.name for f in dataclasses.fields(cls)] == PINNED_FIELDS[cls.__name__]


# --------------------------------------------------------------------------- types, where values enter

_OWNERS = {
    ModelConfig: "model",
    DataConfig: "data",
    OptimConfig: "optim",
    EngineConfig: "engine",
    PluginConfig: "plugins",
    RunConfig: "run",
    TrainConfig: "train",
}


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ('steps = "ten"', r"train\.steps must be an integer or None \(left out\), got 'ten' \(str\)"),
        ("[data]\nseq_len = 64.5", r"data\.seq_len must be an integer, got 64\.5 \(float\)"),
        ('[engine]\nwindow = "3"', r"engine\.window must be an integer, got '3' \(str\)"),
        ('[optim]\nbetas = "ab"', r"optim\.betas must be a list of 2 finite numbers, got 'ab' \(str\)"),
        ("[optim]\nbetas = [0.9]", r"optim\.betas must be a list of 2 finite numbers, got \[0\.9\]"),
        ("[data]\nbatch_size = true", r"data\.batch_size must be an integer, got True \(bool\)"),
        ("[run]\nkeep = 1.5", r"run\.keep must be an integer, got 1\.5 \(float\)"),
        ('[plugins]\nblock = "ram"', r"plugins\.block must be a list of strings, got 'ram' \(str\)"),
        ("[plugins]\nentry_points = 1", r"plugins\.entry_points must be true or false, got 1 \(int\)"),
        ("[optim]\nlr = inf", r"optim\.lr must be a finite number or None \(left out\), got inf"),
        ("[engine]\ntimeout_s = nan", r"engine\.timeout_s must be a finite number, got nan"),
        ("[model]\noverrides = 3", r"model\.overrides must be a table \(mapping\) with string keys, got 3"),
        ("seed = -1", r"train\.seed must be an integer in \[0, 2\*\*32\), got -1"),
        ("[data]\nseed = -2", r"data\.seed must be an integer in \[0, 2\*\*32\)"),
        ("[model]\ninit_seed = -3", r"model\.init_seed must be an integer in \[0, 2\*\*32\)"),
    ],
)
def test_toml_values_of_the_wrong_type_name_the_key_the_value_and_the_type(toml, match):
    import tomllib

    from slidekit.config import from_dict

    with pytest.raises(ConfigError, match=f"^run.toml: {match}"):
        from_dict(tomllib.loads(toml), where="run.toml")


@pytest.mark.parametrize("cls", list(_OWNERS))
def test_every_field_is_type_checked(cls):
    """Generic, so no field is forgotten: a value of no valid type is refused for each one, by name."""
    for f in dataclasses.fields(cls):
        with pytest.raises(ConfigError, match=rf"^{_OWNERS[cls]}\.{f.name} must be .*, got <object"):
            cls(**{f.name: object()})


def test_ints_are_numbers_and_lists_are_tuples():
    cfg = OptimConfig(lr=1, betas=[0.9, 0.99], eps=1, no_decay=["bias"])
    assert (cfg.lr, cfg.eps) == (1.0, 1.0) and isinstance(cfg.lr, float) and isinstance(cfg.eps, float)
    assert cfg.betas == (0.9, 0.99) and cfg.no_decay == ("bias",)
    assert PluginConfig(block=["ram"]).block == ("ram",)
    assert EngineConfig(timeout_s=5).timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"engine\.timeout_s must be a finite number, got True"):
        EngineConfig(timeout_s=True)  # a bool is not a number


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: OptimConfig(lr=5.0), r"optim\.lr = 5 is far above"),
        (lambda: OptimConfig(weight_decay=3.0), r"optim\.weight_decay = 3 is far above"),
    ],
)
def test_absurd_but_finite_values_warn(build, match):
    with pytest.warns(UserWarning, match=match):
        build()


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"hidden_size": -4}, r"model\.overrides\.hidden_size must be a positive integer .*got -4"),
        ({"num_hidden_layers": 0}, r"model\.overrides\.num_hidden_layers must be a positive integer"),
        ({"vocab_size": 2.5}, r"model\.overrides\.vocab_size must be a positive integer"),
        ({"max_position_embeddings": True}, r"model\.overrides\.max_position_embeddings must be a positive"),
        ({"rms_norm_eps": -1e-5}, r"model\.overrides\.rms_norm_eps must be a positive finite number"),
        ({1: 2}, r"model\.overrides must be a table \(mapping\) with string keys"),
    ],
)
def test_overrides_that_make_no_model_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(overrides=overrides)


def test_overrides_may_leave_derived_sizes_to_the_config():
    assert ModelConfig(overrides={"head_dim": None, "hidden_size": 64}).overrides["hidden_size"] == 64


# --------------------------------------------------------------------------- warm-up ratio, config files


@pytest.mark.parametrize(("ratio", "total"), [(0.1, 25), (0.03, 1000), (0.5, 7), (0.0, 40), (0.999, 3)])
def test_warmup_ratio_rounds_as_transformers_does(ratio, total):
    """``OptimConfig.warmup`` against ``TrainingArguments.get_warmup_steps`` (a float < 1 is a ratio there)."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    # the method reads warmup_steps only; building TrainingArguments itself would need accelerate
    reference = TrainingArguments.get_warmup_steps(SimpleNamespace(warmup_steps=ratio), total)  # type: ignore[arg-type]
    assert OptimConfig(warmup_ratio=ratio).warmup(total) == reference
    assert OptimConfig(warmup_steps=4).warmup(total) == 4


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: OptimConfig(warmup_ratio=1.0), r"optim\.warmup_ratio must lie in \[0, 1\) .*got 1\.0"),
        (lambda: OptimConfig(warmup_ratio=-0.1), r"optim\.warmup_ratio must lie in \[0, 1\)"),
        (
            lambda: OptimConfig(warmup_steps=10, warmup_ratio=0.1),
            r"optim\.warmup_steps = 10 and optim\.warmup_ratio = 0\.1 both set the warm-up .*give one of them",
        ),
    ],
)
def test_a_bad_warmup_ratio_is_named(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_the_identity_holds_the_warmup_as_used():
    """A warm-up given as a ratio is the same run as the same warm-up in steps; a resume compares steps."""
    from slidekit.identity import identity

    def warmup(**kw):
        return identity(TrainConfig(**kw).to_dict(), model={}, fingerprints={})["optim.warmup_steps"]

    assert (
        warmup(steps=40, optim=OptimConfig(warmup_ratio=0.1))
        == 4
        == warmup(optim=OptimConfig(warmup_steps=4))
    )
    assert warmup(steps=60, optim=OptimConfig(warmup_ratio=0.1)) == 6


def test_config_files_are_json_or_toml_by_suffix_or_content(tmp_path):
    from slidekit.config import from_dict, load_config

    config = TrainConfig(steps=9, optim=OptimConfig(lr=1e-4, betas=(0.9, 0.95)), run=RunConfig(dir="r"))
    as_json = json.dumps(config.to_dict())  # null for None: JSON says what TOML cannot
    for name in ("config.json", "settings.conf"):  # a suffix, or a file that opens with "{"
        (tmp_path / name).write_text(as_json)
        assert from_dict(load_config(str(tmp_path / name))) == config
    (tmp_path / "run.toml").write_text("steps = 9\n[optim]\nlr = 1e-4\n")
    (tmp_path / "run.cfg").write_text("steps = 9\n[optim]\nlr = 1e-4\n")
    assert load_config(str(tmp_path / "run.toml")) == load_config(str(tmp_path / "run.cfg"))
    (tmp_path / "bad.json").write_text('{"steps": 9,')
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON: "):
        load_config(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(
        ConfigError, match=r"list\.json: a configuration is a JSON object of settings, got list"
    ):
        load_config(str(tmp_path / "list.json"))
    for missing in ("nope.json", "nope.toml", "nope"):
        with pytest.raises(ConfigError, match=rf"configuration file .*{missing}' does not exist"):
            load_config(str(tmp_path / missing))
