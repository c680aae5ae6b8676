"""``--resume RUN_DIR``: the saved configuration comes back, the command line changes what a resume may
change, and everything else is refused before anything is built, naming the field and why.

These need no training: a run directory is what its ``config.json`` says (``slidekit.run``), so each
test writes one. ``tests/test_resume.py`` continues a real run this way, bitwise.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slidekit.cli import build_parser, config_from_args, main
from slidekit.config import DataConfig, OptimConfig, PluginConfig, RunConfig, TrainConfig, from_dict
from slidekit.errors import ConfigError


def _saved(run_dir: Path, **optim) -> TrainConfig:
    """A run directory whose run saved this configuration (as RunDirectory.start writes it)."""
    config = TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        optim=OptimConfig(lr=1e-3, **optim),
        run=RunConfig(
            dir=str(run_dir), checkpoint_every=2, overwrite=True, export_dir=str(run_dir.parent / "out")
        ),
        steps=40,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=1) + "\n")
    return config


def _resumed(*argv: str) -> tuple[TrainConfig, list[str]]:
    notes: list[str] = []
    return config_from_args(build_parser().parse_args(["finetune", *argv]), notes), notes


def test_the_saved_configuration_comes_back(tmp_path):
    run = tmp_path / "a"
    saved = _saved(run)
    config, notes = _resumed("--resume", str(run))
    want = saved.to_dict()
    want["run"].update(resume=True, overwrite=False)  # the newest checkpoint; overwrite is never inherited
    assert config.to_dict() == want
    assert config.run.resume_target() == "latest" and config.run.dir == str(run)
    assert notes == [f"resuming the run in {run} with its saved configuration ({run / 'config.json'})"]
    same, _ = _resumed("--resume", str(run), "--run-dir", str(run))  # --run-dir naming it too is fine
    assert same == config
    given, _ = _resumed("--resume", str(run), "--overwrite")  # only when given
    assert given.run.overwrite


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["--keep", "5"], "run.keep", 5),
        (["--checkpoint-every", "3"], "run.checkpoint_every", 3),
        (["--save-steps", "3"], "run.checkpoint_every", 3),
        (["--trace", "t.json"], "run.trace", "t.json"),
        (["--export", "elsewhere"], "run.export_dir", "elsewhere"),
        (["--window", "4"], "engine.window", 4),
        (["--state-tier", "posix", "--offload-dir", "off"], "engine.state_tier", "posix"),
        (["--eval-every", "7"], "data.eval_every", 7),
        (["--device", "cpu"], "engine.device", "cpu"),
        (["--dtype", "bfloat16"], "engine.compute_dtype", "bfloat16"),
        (["--weight-decay", "0.1"], "optim.weight_decay", 0.1),
        (["--max-grad-norm", "1.0"], "optim.max_grad_norm", 1.0),
    ],
)
def test_safe_changes_apply_and_are_listed(tmp_path, argv, field, value):
    run = tmp_path / "a"
    _saved(run)
    config, notes = _resumed("--resume", str(run), *argv)
    section, _, name = field.partition(".")
    assert config.to_dict()[section][name] == value
    assert field in notes[-1] and notes[-1].startswith("changed on the command line: ")
    arithmetic = field.startswith(("engine.device", "engine.compute_dtype", "optim."))
    assert ("may change the arithmetic" in notes[-1]) == arithmetic, notes[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seq-len", "64"], r"data\.seq_len: 32 -> 64 \(decides which tokens each step sees"),
        (["--batch-size", "4"], r"data\.batch_size: 2 -> 4 \(decides which tokens"),
        (["--grad-accum", "2"], r"grad_accum: 1 -> 2 \(decides how many rows make one step"),
        (["--data-split", "test"], r"data\.split: 'train' -> 'test' \(picks the records the run reads"),
        (["--data-columns", "text=body"], r"data\.columns: \{\} -> \{'text': 'body'\} \(maps record fields"),
        (["--seed", "3"], r"seed: 0 -> 3 \(decides the order of the batches"),
        (["--lr", "2e-3"], r"optim\.lr: 0\.001 -> 0\.002 \(the peak learning rate"),
        (["--learning-rate", "2e-3"], r"optim\.lr: 0\.001 -> 0\.002"),
        (["--schedule", "linear"], r"optim\.schedule: 'constant' -> 'linear' \(sets the learning rate"),
        (
            ["--warmup-steps", "5"],
            r"the warm-up: 0 -> 5 steps \(optim\.warmup_steps, or warmup_ratio x steps: the warm-up sets",
        ),
        (["--random-init"], r"model\.random_init: False -> True \(decides the weights the run started from"),
        (
            ["--optimizer", "adamw_8bit"],
            r"optim\.name: 'layer_adam' -> 'adamw_8bit' \(the checkpoint holds this optimizer's state, which "
            r"another optimizer cannot continue from: keep --optimizer layer_adam",
        ),
    ],
)
def test_unsafe_changes_are_refused_naming_the_field_and_why(tmp_path, argv, message):
    run = tmp_path / "a"
    _saved(run)
    with pytest.raises(ConfigError, match=message) as err:
        _resumed("--resume", str(run), *argv)
    assert str(err.value).startswith(f"--resume {run} continues the run saved in {run / 'config.json'}")
    assert "Leave those settings out to keep the saved ones, or start a new run" in str(err.value)
    assert "schedule spans" not in str(err.value)  # a new kind of schedule is refused as such, not its length


def test_every_refused_change_is_named_at_once(tmp_path):
    run = tmp_path / "a"
    _saved(run)
    with pytest.raises(ConfigError) as err:
        _resumed("--resume", str(run), "--seq-len", "64", "--optimizer", "adamw_8bit", "--keep", "9")
    text = str(err.value)
    assert "data.seq_len: 32 -> 64" in text and "optim.name: 'layer_adam' -> 'adamw_8bit'" in text
    assert "run.keep" not in text  # allowed, so not among the refusals


def test_more_steps_extend_a_constant_schedule_and_say_so(tmp_path):
    run = tmp_path / "a"
    _saved(run)
    config, notes = _resumed("--resume", str(run), "--max-steps", "60")
    assert config.steps == 60
    assert notes[-1] == (
        "changed on the command line: steps 40 -> 60 (the learning rate is constant after the warm-up: the "
        "run goes on at the same rate and ends after step 60)"
    )


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_keeps_its_step_count(tmp_path, schedule):
    run = tmp_path / "a"
    _saved(run, schedule=schedule)
    with pytest.raises(ConfigError) as err:
        _resumed("--resume", str(run), "--steps", "60")
    assert (
        f"steps: 40 -> 60 (the {schedule} schedule spans the run's 40 steps and the run is on that curve; over "
        "60 steps the learning rate of every remaining step would change, a jump at the resumed step. Only a "
        "constant schedule may be extended: keep --steps 40)"
    ) in str(err.value)


def test_a_warmup_ratio_ties_the_warmup_to_the_step_count(tmp_path):
    run = tmp_path / "a"
    _saved(run, warmup_ratio=0.1)  # 4 warm-up steps of 40
    with pytest.raises(
        ConfigError,
        match=r"the warm-up: 4 -> 6 steps \(optim\.warmup_steps, or warmup_ratio x steps; here warmup_ratio 0\.1 of steps 40 -> 60:",
    ):
        _resumed("--resume", str(run), "--steps", "60")
    config, _ = _resumed("--resume", str(run), "--steps", "38")  # ceil(3.8) = 4: the same warm-up
    assert config.steps == 38


def test_another_run_dir_is_refused(tmp_path):
    run = tmp_path / "a"
    _saved(run)
    with pytest.raises(ConfigError, match=r"--run-dir names another directory .*: give --resume .* alone"):
        _resumed("--resume", str(run), "--run-dir", str(tmp_path / "b"))


def test_a_checkpoint_in_a_run_directory_restores_that_run(tmp_path):
    run = tmp_path / "a"
    _saved(run)
    step = run / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    config, _ = _resumed("--resume", str(step))
    assert config.run.dir == str(run) and config.run.resume_target() == str(step)
    # with --run-dir, a path keeps its old meaning: that checkpoint, the flags as given
    plain, notes = _resumed("--run-dir", str(run), "--resume", str(step))
    assert plain.data.seq_len == TrainConfig().data.seq_len and notes == []


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, r"--resume .*missing: .*missing does not exist; give --resume RUN_DIR"),
        (
            lambda p: p.mkdir(),
            r"--resume .*missing: .* holds no slidekit run \(no config\.json saved by one\)",
        ),
    ],
)
def test_what_is_not_a_run_says_what_to_give(tmp_path, make, message):
    make(tmp_path / "missing")
    with pytest.raises(ConfigError, match=message):
        _resumed("--resume", str(tmp_path / "missing"))


def test_a_refused_resume_is_one_clear_line_and_exit_status_2(tmp_path, capsys):
    run = tmp_path / "a"
    _saved(run)
    before = (run / "config.json").read_bytes()
    assert main(["finetune", "--resume", str(run), "--seq-len", "64", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slidekit: error: --resume ") and err.count("\n") == 1 and "data.seq_len" in err
    assert (run / "config.json").read_bytes() == before and sorted(p.name for p in run.iterdir()) == [
        "config.json"
    ]


def test_a_config_file_next_to_resume_counts_as_changes(tmp_path):
    """Re-running the command that started the run, plus --resume RUN_DIR: its file changes nothing."""
    run = tmp_path / "a"
    saved = _saved(run)
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 40\n[data]\nseq_len = 32\nbatch_size = 2\n[run]\nkeep = 4\n")
    config, notes = _resumed("--config", str(toml), "--resume", str(run))
    assert config.run.keep == 4 and config.data == saved.data
    assert notes[-1] == "changed on the command line: run.keep 2 -> 4"


def test_the_saved_config_json_is_a_config_file_too(tmp_path):
    """--config RUN_DIR/config.json: the run's settings, not how it was last started (resume, overwrite)."""
    run = tmp_path / "a"
    saved = _saved(run)
    resumed = dataclasses.replace(saved, run=dataclasses.replace(saved.run, resume=True))
    (run / "config.json").write_text(json.dumps(resumed.to_dict(), indent=1) + "\n")  # a resumed run's record
    assert from_dict(json.loads((run / "config.json").read_text())) == resumed  # it reads back as it was
    config, notes = _resumed("--config", str(run / "config.json"))
    assert (
        config == dataclasses.replace(saved, run=dataclasses.replace(saved.run, overwrite=False))
        and notes == []
    )
    again, _ = _resumed(
        "--config", str(run / "config.json"), "--steps", "9", "--run-dir", str(tmp_path / "b")
    )
    assert again.steps == 9 and again.run.dir == str(tmp_path / "b") and again.data == saved.data
    assert again.run.resume_target() is None  # a new run, as a settings file starts one
    copy = tmp_path / "settings.json"  # the same JSON elsewhere is a plain settings file: all of it
    copy.write_text((run / "config.json").read_text())
    plain, _ = _resumed("--config", str(copy))
    assert plain == resumed


def test_driver_settings_given_on_resume_join_the_saved_ones(tmp_path):
    run = tmp_path / "a"
    saved = _saved(run)
    with_options = dataclasses.replace(saved, plugins=PluginConfig(options={"my_tier": {"depth": 4}}))
    (run / "config.json").write_text(json.dumps(with_options.to_dict(), indent=1) + "\n")
    config, notes = _resumed("--resume", str(run), "--plugin-option", "my_tier.width=2")
    assert config.plugins.options == {"my_tier": {"depth": 4, "width": 2}}
    assert "plugins.options" in notes[-1] and "an optimizer's may change the arithmetic" in notes[-1]


def test_a_new_epoch_count_is_counted_again_from_the_data_or_refused(tmp_path):
    """The saved steps are what the epochs gave: a new --epochs drops them (the Trainer counts the run again
    from the data) under a constant schedule, and is refused under a decaying one or a warm-up ratio; the
    saved epoch count given again changes nothing."""
    run = tmp_path / "a"
    _saved(run)
    config, notes = _resumed("--resume", str(run), "--epochs", "3")
    assert config.steps is None and config.epochs == 3.0
    assert "epochs None -> 3.0 (the run's length is counted again from the data" in notes[-1]
    assert "steps 40: counted again from the epochs" in notes[-1]
    kept, _ = _resumed("--resume", str(run), "--epochs", "3", "--max-steps", "50")  # steps given: they win
    assert kept.steps == 50
    for optim in ({"schedule": "cosine"}, {"warmup_ratio": 0.1}):
        run = tmp_path / str(optim)
        _saved(run, **optim)
        with pytest.raises(ConfigError, match=r"epochs: None -> 3\.0 \(the run's 40 steps decide its"):
            _resumed("--resume", str(run), "--epochs", "3")
    again = tmp_path / "b"
    saved = _saved(again)
    (again / "config.json").write_text(json.dumps({**saved.to_dict(), "epochs": 3.0}, indent=1) + "\n")
    same, _ = _resumed("--resume", str(again), "--epochs", "3")
    assert same.steps == 40  # the same epochs: the saved count stands
