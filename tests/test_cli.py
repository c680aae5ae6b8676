"""The command line: option names are pinned, `plugins` lists drivers, `finetune` trains the demo, and
`--export` never destroys: dangerous targets are refused before training, a partial run never replaces an
export, and a failed export leaves a checkpoint to export from."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slidekit import checkpoint as ck
from slidekit.cli import build_parser, config_from_args, finetune, main
from slidekit.data.configured import run_step_count
from slidekit.export import ExportError
from slidekit.hookspecs import hookimpl
from slidekit.models.loading import load_hf_config
from slidekit.plugins import Plugins
from slidekit.telemetry import model_flops

PINNED_FINETUNE_OPTIONS = [
    "--config",
    "--model",
    "--random-init",
    "--tokenizer",
    "--data",
    "--data-format",
    "--data-split",
    "--data-columns",
    "--completion-only",
    "--no-packing",
    "--eval-fraction",
    "--eval-every",
    "--seq-len",
    "--batch-size",
    "--grad-accum",
    "--steps",
    "--epochs",
    "--seed",
    "--optimizer",
    "--lr",
    "--schedule",
    "--warmup-steps",
    "--warmup-ratio",
    "--weight-decay",
    "--max-grad-norm",
    "--on-nonfinite",
    "--clip-overlap",
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
    "--recompute",
    "--resident-weights",
    "--upload-copy",
        "--update-order",
    "--run-dir",
    "--checkpoint-every",
    "--keep",
    "--resume",
    "--export",
    "--export-dtype",
    "--overwrite",
    "--trace",
    "--report-to",
    "--block",
    "--plugin-option",
    "--quiet",
]


def _options(command: str, *, hidden: bool = False) -> list[str]:
    """The options ``--help`` lists (``hidden``: the other names, aliases, which it does not)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse exposes no public accessor
    return [
        o
        for a in sub.choices[command]._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help" and (a.help == argparse.SUPPRESS) == hidden
    ]


def test_finetune_options_are_pinned():
    assert _options("finetune") == PINNED_FINETUNE_OPTIONS


def test_build_options_are_pinned():
    assert _options("build") == ["--block"]


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


@pytest.mark.parametrize(
    ("argv", "value", "target"),
    [
        ([], False, None),
        (["--resume"], True, "latest"),
        (["--resume", "40"], "40", 40),
        (["--resume", "runs/a/step-00000040"], "runs/a/step-00000040", "runs/a/step-00000040"),
        (["--resume", "--steps", "9"], True, "latest"),  # a flag after it is not its value
    ],
)
def test_resume_takes_nothing_a_step_or_a_path(argv, value, target):
    cfg = config_from_args(build_parser().parse_args(["finetune", "--run-dir", "runs/a", *argv]))
    assert cfg.run.resume == value and cfg.run.resume_target() == target


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
        == f"slidekit: error: {toml}: train.steps must be an integer or None (left out), got 'ten' (str)\n"
    )


def test_plugins_lists_every_driver(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    drivers = ("ram", "layer_adam", "adamw_8bit", "adamw_fp8", "torch_ref", "llama", "qwen2", "qwen3")
    for name in (*drivers, "mistral"):
        assert name in out
    assert "available" in out
    fp8 = next(line for line in out.splitlines() if " adamw_fp8 " in line)
    assert fp8.split()[:4] == ["optimizer", "adamw_fp8", "adamw_fp8", "available"], fp8


@pytest.mark.slow
def test_build_compiles_the_optimizer_kernels_and_reports():
    """`slidekit build` in the shared extensions cache (the kernel tests build the same kernels there)."""
    proc = subprocess.run(
        [sys.executable, "-m", "slidekit.cli", "build"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    header, *rows, _ = (re.split(r"\s{2,}", ln.strip()) for ln in lines)
    assert header == ["FAMILY", "NAME", "STATUS", "SECONDS", "WHERE / WHY"]
    by_name = {row[1]: row for row in rows}
    assert set(by_name) == {"layer_adam", "adamw_8bit", "adamw_fp8"}, proc.stdout
    for name, source in (
        ("layer_adam", "fused_adam.cpp"),
        ("adamw_8bit", "adamw8.cpp"),
        ("adamw_fp8", "adamwfp8.cpp"),
    ):
        family, _, status, seconds, where = by_name[name]
        library, detail = where.split(" (", 1)
        assert family == "optimizer" and status in ("built", "up to date"), by_name[name]
        assert float(seconds) >= 0 and library.endswith(".so") and Path(library).is_file(), by_name[name]
        assert detail.startswith(f"fused C++ kernel from {source} for "), by_name[name]
    assert lines[-1].endswith("skipped 0, failed 0")


def test_build_without_a_compiler_fails_with_the_reason(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert main(["build", "adamw_8bit"]) == 1
    captured = capsys.readouterr()
    row = next(ln for ln in captured.out.splitlines() if "adamw_8bit" in ln)
    assert row.split()[:3] == ["optimizer", "adamw_8bit", "failed"] and "no C++ compiler" in row
    assert captured.out.splitlines()[-1] == "built 0, up to date 0, skipped 0, failed 1"
    assert "slidekit: error: building optimizer 'adamw_8bit' failed: no C++ compiler" in captured.err
    assert main(["build", "adamw_9bit"]) == 2
    assert "no driver is named 'adamw_9bit'" in capsys.readouterr().err


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


#: The demo's whole run in model FLOPs (``slidekit.telemetry.model_flops``), its current 3.88e12 (150
#: steps of 8 x 128 tokens on 3.95 M parameters) plus 3%: the work that lets it learn in a couple of
#: minutes on a 2-core CPU. Its seconds depend on the machine and its load (133 s with a load average
#: of 5 on the 2-core machine, where the old "under 120 s" bound of this test failed), so the test
#: pins the work, which does not; a demo that needs more must be measured again and the figure raised.
DEMO_FLOPS_BUDGET = 4.0e12


@pytest.mark.slow
def test_the_demo_with_no_arguments_learns_within_its_work_budget():
    """README's first command: `slidekit finetune`, on the embedded model and corpus."""
    cfg = config_from_args(build_parser().parse_args(["finetune"]))
    hf_config, _ = load_hf_config(cfg.model.source)
    spec = Plugins().adapter_for(hf_config.model_type).descriptor.factory(hf_config)
    tokens = cfg.data.batch_size * cfg.data.seq_len * cfg.grad_accum
    steps = run_step_count(cfg, None).total  # no --steps, no --epochs: DEFAULT_STEPS
    assert steps * model_flops(spec, tokens, cfg.data.seq_len) <= DEMO_FLOPS_BUDGET
    proc = subprocess.run(
        [sys.executable, "-m", "slidekit.cli", "finetune"], capture_output=True, text=True, timeout=1800
    )  # the timeout only turns a hang into a failure
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("done:"))
    assert line.startswith(f"done: {steps} steps in "), line  # the run the budget is about
    first, last = (float(x) for x in line.split("loss ")[1].split(" (")[0].split(" -> "))
    assert last < first - 1.0, line  # clearly lower: more than one nat
    assert "loss=" in proc.stderr and "tok_s=" in proc.stderr  # the progress bar


# --------------------------------------------------------------------------- --export never destroys


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("cwd", "is the current directory"),
        ("run dir", "is the run directory"),
        ("parent of run dir", "contains the run directory"),
        ("model dir", "is the source model"),
        ("contains the data", "contains the data file"),
        ("a file", "is a file, not a directory"),
        ("below a file", "cannot be created: .* is a file, not a directory"),
    ],
)
def test_a_dangerous_export_target_is_refused_before_training(
    tiny_model, tmp_path, monkeypatch, capsys, case, message
):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama"), model)
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("\n".join('{"text": "the cat sat on the mat"}' for _ in range(20)))
    runs = tmp_path / "runs"
    (runs / "a").mkdir(parents=True)
    (runs / "a" / "keep.txt").write_text("a run dir the user made, with a note")  # refused as a run dir too
    (tmp_path / "file").write_text("x")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    target = {
        "cwd": work,
        "run dir": runs / "a",
        "parent of run dir": runs,
        "model dir": model,
        "contains the data": data.parent,
        "a file": tmp_path / "file",
        "below a file": tmp_path / "file" / "out",
    }[case]
    before = _tree(tmp_path)
    argv = ["finetune", "--model", str(model), "--data", str(data), "--seq-len", "8", "--device", "cpu"]
    argv += ["--run-dir", str(runs / "a"), "--export", str(target), "--steps", "2", "--quiet", "--overwrite"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "slidekit: error: the export target" in err and re.search(message, err), err
    assert "model:" not in out  # refused before the engine was built, let alone trained
    assert _tree(tmp_path) == before


def test_a_bad_export_dtype_is_refused_before_training(capsys, tmp_path):
    assert main(["finetune", "--export", str(tmp_path / "out"), "--export-dtype", "int8", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert "run.export_dtype (CLI: --export-dtype) must be one of" in err and "'int8'" in err
    assert "model:" not in out and os.listdir(tmp_path) == []


class Interrupter:
    """Sends ``sig`` to this process at the end of step ``after`` (as a scheduler's SIGTERM would)."""

    def __init__(self, after: int, sig: int = signal.SIGTERM) -> None:
        self.after, self.sig = after, sig

    @hookimpl
    def slidekit_step_end(self, step):
        if step == self.after:
            os.kill(os.getpid(), self.sig)


DEMO = ["--seq-len", "32", "--batch-size", "2", "--lr", "1e-3", "--device", "cpu", "--quiet"]


def _config(*flags: str):
    return config_from_args(build_parser().parse_args(["finetune", *DEMO, *flags]))


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The export of an uninterrupted 6-step run (no --run-dir)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    assert finetune(_config("--steps", "6", "--export", str(out))) == 0
    assert os.listdir(out.parent) == ["out"]  # the checkpoint kept until the export was written is gone
    return out


def test_a_run_stopped_by_sigterm_never_replaces_a_good_export(tmp_path, capsys):
    good = tmp_path / "model"
    assert finetune(_config("--steps", "2", "--run-dir", str(tmp_path / "a"), "--export", str(good))) == 0
    before = _tree(good)
    capsys.readouterr()
    stop = Plugins(extra=[("term", Interrupter(4))])
    cfg = _config("--steps", "40", "--run-dir", str(tmp_path / "b"), "--export", str(good), "--overwrite")
    assert finetune(cfg, plugins=stop) == 128 + signal.SIGTERM
    assert _tree(good) == before  # the partial model did not replace the good export
    err = capsys.readouterr().err
    assert "not exported: the run stopped by SIGTERM after step 4 of 40" in err
    assert f"continue with the same command and --run-dir {tmp_path / 'b'} --resume" in err
    latest = ck.latest(tmp_path / "b" / "checkpoints")
    assert latest is not None and latest.name == "step-00000004"


def test_a_stopped_run_without_a_run_dir_keeps_its_checkpoint_and_resumes_to_the_export(
    tmp_path, capsys, reference
):
    out, rescue = tmp_path / "out", tmp_path / "out.slidekit-run"
    assert finetune(
        _config("--steps", "6", "--export", str(out)), plugins=Plugins(extra=[("t", Interrupter(3))])
    ) == (128 + signal.SIGTERM)
    assert not out.exists()
    err = capsys.readouterr().err
    assert f"and --run-dir {rescue} --resume" in err
    latest = ck.latest(rescue / "checkpoints")
    assert latest is not None and latest.name == "step-00000003"
    assert (
        main(["finetune", *DEMO, "--steps", "6", "--run-dir", str(rescue), "--resume", "--export", str(out)])
        == 0
    )
    for name, t in _weights(reference).items():
        assert torch.equal(_weights(out)[name], t), name  # bitwise the uninterrupted run's model


def test_an_export_failing_after_training_leaves_a_checkpoint_and_says_where(tmp_path, capsys, reference):
    out, rescue = tmp_path / "out", tmp_path / "out.slidekit-run"

    def disk_full_at_export(lane: str) -> None:
        if lane == "export:install":
            raise OSError(28, "No space left on device (injected)")

    with pytest.raises(ExportError) as failed:
        finetune(_config("--steps", "6", "--export", str(out)), fault_hook=disk_full_at_export)
    message = str(failed.value)
    assert "No space left on device (injected)" in message
    latest = ck.latest(rescue / "checkpoints")
    assert latest is not None and latest.name == "step-00000006"
    assert f"safe in the checkpoint {latest} (step 6)" in message
    assert f"--run-dir {rescue} --resume --export {out}" in message
    assert "exporting to" in capsys.readouterr().out  # said where the weights were before exporting
    assert sorted(os.listdir(tmp_path)) == ["out.slidekit-run"]  # no half-written export, no staging left
    # Following the message: the export is written, nothing is trained again, the model is the run's.
    assert (
        main(["finetune", *DEMO, "--steps", "6", "--run-dir", str(rescue), "--resume", "--export", str(out)])
        == 0
    )
    assert "nothing left to do" in capsys.readouterr().out
    for name, t in _weights(reference).items():
        assert torch.equal(_weights(out)[name], t), name


# --------------------------------------------------------------------------- HF names, defaults, did you mean

#: Every alias, pinned: an HF / TRL name, the slidekit flag it stands for (slidekit.cli_options).
PINNED_ALIASES = {
    "--learning-rate": "--lr",
    "--gradient-accumulation-steps": "--grad-accum",
    "--max-steps": "--steps",
    "--per-device-train-batch-size": "--batch-size",
    "--save-steps": "--checkpoint-every",
    "--save-total-limit": "--keep",
    "--eval-steps": "--eval-every",
    "--output-dir": "--run-dir",
    "--bf16": "--dtype",
    "--lr-scheduler-type": "--schedule",
    "--model-name-or-path": "--model",
    "--num-train-epochs": "--epochs",
}


def test_aliases_are_pinned():
    from slidekit.cli_options import ALIASES

    assert ALIASES == PINNED_ALIASES


def _field(config, dotted: str):
    value = config.to_dict()
    for part in dotted.split("."):
        value = value[part]
    return value


#: (alias argv, the canonical argv it means, the field, the value it lands on)
ALIAS_CASES = [
    (["--learning-rate", "3e-4"], ["--lr", "3e-4"], "optim.lr", 3e-4),
    (["--learning_rate", "3e-4"], ["--lr", "3e-4"], "optim.lr", 3e-4),  # HF's underscore spelling
    (["--gradient-accumulation-steps", "3"], ["--grad-accum", "3"], "grad_accum", 3),
    (["--max-steps", "7"], ["--steps", "7"], "steps", 7),
    (["--max_steps=7"], ["--steps", "7"], "steps", 7),
    (["--num_train_epochs", "2.5"], ["--epochs", "2.5"], "epochs", 2.5),
    (["--per-device-train-batch-size", "2"], ["--batch-size", "2"], "data.batch_size", 2),
    (["--save-steps", "5"], ["--checkpoint-every", "5"], "run.checkpoint_every", 5),
    (["--save-total-limit", "4"], ["--keep", "4"], "run.keep", 4),
    (["--eval-steps", "6"], ["--eval-every", "6"], "data.eval_every", 6),
    (["--output-dir", "runs/x"], ["--run-dir", "runs/x"], "run.dir", "runs/x"),
    (["--bf16"], ["--dtype", "bfloat16"], "engine.compute_dtype", "bfloat16"),
    (["--bf16", "True"], ["--dtype", "bfloat16"], "engine.compute_dtype", "bfloat16"),
    (["--bf16", "false"], ["--dtype", "float32"], "engine.compute_dtype", "float32"),
    (["--lr-scheduler-type", "cosine"], ["--schedule", "cosine"], "optim.schedule", "cosine"),
    (["--lr-scheduler-type", "linear"], ["--schedule", "linear"], "optim.schedule", "linear"),
    (
        ["--lr_scheduler_type", "constant_with_warmup"],
        ["--schedule", "constant"],
        "optim.schedule",
        "constant",
    ),
    (["--model-name-or-path", "demo"], ["--model", "demo"], "model.source", "demo"),
    (["--warmup_steps", "3"], ["--warmup-steps", "3"], "optim.warmup_steps", 3),
    (["--warmup_ratio", "0.1"], ["--warmup-ratio", "0.1"], "optim.warmup_ratio", 0.1),
    (["--weight_decay", "0.1"], ["--weight-decay", "0.1"], "optim.weight_decay", 0.1),
    (["--max_grad_norm", "0.5"], ["--max-grad-norm", "0.5"], "optim.max_grad_norm", 0.5),
    (["--max-grad-norm", "0"], [], "optim.max_grad_norm", None),  # HF: "Set to 0 to disable"
    (["--report_to", "none"], ["--report-to", "none"], "run.report_to", []),
]


@pytest.mark.parametrize(("alias", "canonical", "field", "value"), ALIAS_CASES)
def test_each_hf_name_lands_on_its_field(alias, canonical, field, value):
    got = config_from_args(build_parser().parse_args(["finetune", *alias]))
    assert _field(got, field) == value
    assert got == config_from_args(build_parser().parse_args(["finetune", *canonical]))


def test_every_alias_is_tested():
    from slidekit.cli import FLAGS
    from slidekit.cli_options import ALIASES

    tested = {argv[0].split("=")[0].replace("_", "-") for argv, *_ in ALIAS_CASES}
    assert {a for a, flag in ALIASES.items() if flag in FLAGS} <= tested


def test_an_alias_and_its_flag_together_are_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["finetune", "--lr", "1e-3", "--learning-rate", "2e-3"])
    assert exited.value.code == 2
    assert (
        "argument --learning-rate: --lr is given too, and sets the same option: give one"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bf16", "maybe"], "argument --bf16: takes true or false, got 'maybe'"),
        (
            ["--lr-scheduler-type", "polynomial"],
            "argument --lr-scheduler-type: 'polynomial' has no slidekit schedule",
        ),
        (
            ["--warmup-steps", "0.1"],
            "0.1 is not a whole number of steps; for a fraction of the run's steps use --warmup-ratio 0.1",
        ),
    ],
)
def test_an_hf_value_slidekit_lacks_is_refused_saying_so(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(["finetune", *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_epochs_alias_waits_for_its_flag(monkeypatch):
    """--num-train-epochs is --epochs: registered only where slidekit.cli.FLAGS has --epochs."""
    from slidekit import cli

    # A copy stands in for FLAGS: deleting and restoring the key in the module's own dict would move
    # --epochs to its end, and test_finetune_options_are_pinned, run after this in the same process,
    # would see the options reordered (the H200 gate on 2416426, whose workers ran them in that order).
    monkeypatch.setattr(cli, "FLAGS", dict(cli.FLAGS))
    monkeypatch.delitem(cli.FLAGS, "--epochs", raising=False)
    assert "--num-train-epochs" not in _options("finetune", hidden=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["finetune", "--num-train-epochs", "2"])
    monkeypatch.setitem(cli.FLAGS, "--epochs", ("seed", int, "stand-in for the epochs flag"))
    assert config_from_args(build_parser().parse_args(["finetune", "--num-train-epochs", "2"])).seed == 2


def test_help_shows_every_default_and_the_hf_names(capsys):
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for fragment in (
        "--steps STEPS optimizer steps (default: 150); also --max-steps",
        "--seq-len SEQ_LEN tokens per row (default: 128)",
        "--lr LR peak learning rate (default: 2e-3 for the demo model, 2e-5 otherwise); also --learning-rate",
        "--max-grad-norm MAX_GRAD_NORM clip the global gradient norm (default: off)",
        "(default: none, nothing is kept); also --output-dir",
        "--dtype COMPUTE_DTYPE auto, float32 or bfloat16 (default: auto); also --bf16",
        "--no-packing one padded document per row instead of packed rows (default: off)",
        "--keep KEEP checkpoints to keep (default: 2); also --save-total-limit",
        "--warmup-ratio WARMUP_RATIO linear warm-up over this fraction of the steps (default: 0)",
    ):
        assert fragment in text
    from slidekit.cli import FLAGS

    fields = {path for path, _, _ in FLAGS.values()}
    parser = next(a for a in build_parser()._actions if a.dest == "command").choices["finetune"]
    for action in parser._actions:
        if action.help != argparse.SUPPRESS and action.dest in fields:
            assert "(default: " in action.help, action.option_strings


@pytest.mark.parametrize("command", ["finetune", "plan"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--learnig-rate", "1e-3"], "unrecognized option --learnig-rate; did you mean --learning-rate?"),
        (["--sed=3"], "unrecognized option --sed; did you mean --seed?"),
        (["--stpes", "3"], "unrecognized option --stpes; did you mean --steps?"),
        (
            ["--fp16"],
            "unrecognized option --fp16: slidekit computes in bfloat16 or float32 (--dtype, or --bf16)",
        ),
        (["--adam-epsilon", "1e-6"], "unrecognized option --adam-epsilon: set optim.eps in a --config file"),
        (["--zzzzzz"], "unrecognized option --zzzzzz\n"),
        # An abbreviation is not taken for the option it starts (argparse would: --optim as --optimizer).
        (["--optim", "adamw_8bit"], "unrecognized option --optim; did you mean --optimizer?"),
    ],
)
def test_an_unknown_option_gets_the_closest_name(capsys, command, argv, message):
    with pytest.raises(SystemExit) as exited:
        main([command, *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"slidekit {command}: error: {message}" in err


def test_unknown_settings_in_a_config_file_get_the_closest_name(tmp_path, capsys):
    for text, hint in (
        ("[optim]\nweight_decy = 0.1\n", "'weight_decy': did you mean 'weight_decay'?"),
        ("lr = 1e-4\n", "'lr': did you mean 'lr' in [optim]?"),
        ("[data]\nsteps = 3\n", "'steps': did you mean 'steps' at the top level, outside [data]?"),
        ("[optimm]\nlr = 1e-4\n", "'optimm': did you mean 'optim'?"),
    ):
        toml = tmp_path / "run.toml"
        toml.write_text(text)
        assert main(["finetune", "--config", str(toml), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"slidekit: error: {toml}: unknown setting") and hint in err, err


def test_a_warmup_ratio_is_the_warmup_over_that_fraction_of_the_steps(tmp_path):
    """--warmup-ratio 0.5 of 4 steps is --warmup-steps 2: the same learning rate at every step."""
    rates = []
    for name, flag in (("ratio", ["--warmup-ratio", "0.5"]), ("steps", ["--warmup-steps", "2"])):
        run = tmp_path / name
        assert main(["finetune", *DEMO, "--steps", "4", "--run-dir", str(run), *flag]) == 0
        rates.append([json.loads(line)["lr"] for line in (run / "metrics.jsonl").read_text().splitlines()])
    assert rates[0] == rates[1] == [5e-4, 1e-3, 1e-3, 1e-3]
