"""The command line: option names are pinned, `plugins` lists drivers, `finetune` trains the demo."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from slidekit.cli import build_parser, config_from_args, main

PINNED_FINETUNE_OPTIONS = [
    "--config",
    "--model",
    "--random-init",
    "--data",
    "--data-format",
    "--completion-only",
    "--no-packing",
    "--eval-fraction",
    "--eval-every",
    "--seq-len",
    "--batch-size",
    "--grad-accum",
    "--steps",
    "--seed",
    "--optimizer",
    "--lr",
    "--schedule",
    "--warmup-steps",
    "--weight-decay",
    "--max-grad-norm",
    "--on-nonfinite",
    "--device",
    "--dtype",
    "--kernels",
    "--state-tier",
    "--state-offload-tier",
    "--state-offload-fraction",
    "--activation-tier",
    "--offload-dir",
    "--window",
    "--gpu-resident",
    "--run-dir",
    "--checkpoint-every",
    "--keep",
    "--resume",
    "--export",
    "--export-dtype",
    "--trace",
    "--block",
    "--quiet",
]


def _options(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse exposes no public accessor
    return [
        o
        for a in sub.choices[command]._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    ]


def test_finetune_options_are_pinned():
    assert _options("finetune") == PINNED_FINETUNE_OPTIONS


def test_options_map_onto_the_config():
    args = build_parser().parse_args(
        [
            "finetune",
            "--steps",
            "7",
            "--lr",
            "3e-4",
            "--state-tier",
            "ram",
            "--block",
            "x",
            "--window",
            "4",
            "--random-init",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.steps == 7 and cfg.optim.lr == 3e-4 and cfg.engine.window == 4
    assert cfg.plugins.block == ("x",) and cfg.model.random_init


def test_toml_file_and_flags_land_on_the_same_config(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 9\n[optim]\nlr = 1e-4\nbetas = [0.9, 0.95]\n[engine]\nwindow = 5\n")
    args = build_parser().parse_args(["finetune", "--config", str(toml), "--lr", "2e-4"])
    cfg = config_from_args(args)
    assert cfg.steps == 9 and cfg.engine.window == 5 and cfg.optim.betas == (0.9, 0.95)
    assert cfg.optim.lr == 2e-4  # the flag wins over the file
    from slidekit.config import from_dict

    assert from_dict(cfg.to_dict()) == cfg  # what a run saves reads back to the same configuration


def test_bad_toml_names_the_file_and_the_setting(tmp_path, capsys):
    toml = tmp_path / "bad.toml"
    toml.write_text("[optim]\nlearning_rate = 1e-4\n")
    assert main(["finetune", "--config", str(toml), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "learning_rate" in err and "valid: name, lr" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "-1e-3"], "command line: optim.lr must be > 0, got -0.001"),  # not "expected one argument"
        (
            ["--lr", "inf"],
            "command line: optim.lr must be a finite number or None (left out), got inf (float)",
        ),
        (
            ["--weight-decay", "nan"],
            "command line: optim.weight_decay must be a finite number, got nan (float)",
        ),
        (["--seed", "-1"], "command line: train.seed must be an integer in [0, 2**32), got -1"),
        (["--max-grad-norm=-2"], "command line: optim.max_grad_norm must be > 0, got -2.0"),
    ],
)
def test_bad_numbers_on_the_command_line_are_one_clear_line(capsys, argv, message):
    assert main(["finetune", *argv, "--quiet"]) == 2
    assert capsys.readouterr().err == f"slidekit: error: {message}\n"


def test_toml_values_of_the_wrong_type_are_one_clear_line(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('steps = "ten"\n')
    assert main(["finetune", "--config", str(toml), "--quiet"]) == 2
    assert (
        capsys.readouterr().err
        == f"slidekit: error: {toml}: train.steps must be an integer, got 'ten' (str)\n"
    )


def test_plugins_lists_every_driver(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for name in ("ram", "layer_adam", "torch_ref", "llama", "qwen2", "qwen3", "mistral"):
        assert name in out
    assert "available" in out


def test_bad_input_is_one_clear_line(capsys, tmp_path):
    assert main(["finetune", "--model", str(tmp_path / "missing"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slidekit: error: model directory") and "does not exist" in err
    assert main(["finetune", "--optimizer", "adamw_9bit", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown optimizer 'adamw_9bit'; choose one of:" in err and "layer_adam" in err


def test_finetune_a_few_steps(capsys, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join('{"text": "the cat sat on the mat and looked at the dog"}' for _ in range(40)))
    assert (
        main(
            [
                "finetune",
                "--steps",
                "3",
                "--data",
                str(data),
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    assert "done: 3 steps" in capsys.readouterr().out


@pytest.mark.slow
def test_the_demo_with_no_arguments_learns_in_under_two_minutes():
    """README's first command: `slidekit finetune`, on the embedded model and corpus."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "slidekit.cli", "finetune"], capture_output=True, text=True, timeout=300
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("done:"))
    first, last = (float(x) for x in line.split("loss ")[1].split(" (")[0].split(" -> "))
    assert last < first - 1.0, line  # clearly lower: more than one nat
    assert "loss=" in proc.stderr and "tok_s=" in proc.stderr  # the progress bar
    assert elapsed < 120, f"the demo took {elapsed:.0f}s"
