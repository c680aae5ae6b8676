"""What a fine-tune prints: progress, evaluations, checkpoints, a resumed run's start, the closing line.

On a terminal the progress bar redraws itself (and a resumed run's bar starts at the step it resumed
from); written to a file or a pipe, it prints plain lines, never a carriage return. Evaluations and
checkpoints get a line each. The closing line compares the first and the last steps without the two
overlapping, whatever the run's length.

Test: ``pytest tests/test_console.py``.
"""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest

from slidekit import DataConfig, EngineConfig, Plugins, RunConfig, TrainConfig
from slidekit.cli import finetune
from slidekit.hookspecs import hookimpl
from slidekit.telemetry import Progress, log_every, loss_summary


class FakeTerminal(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Losses:
    """A plugin that records each step's metrics."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    @hookimpl
    def slidekit_step_end(self, metrics):
        self.metrics.append(dict(metrics))


def _config(run_dir: Path | None, *, steps: int, resume: bool | int = False, **data) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(seq_len=16, batch_size=2, **data),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(run_dir) if run_dir else None, checkpoint_every=2, resume=resume),
        steps=steps,
    )


def _plugins(recorder: Losses) -> Plugins:
    return Plugins(entry_points=["ram", "layer_adam", "torch_ref"], extra=[("losses", recorder)])


# --------------------------------------------------------------------------- the closing line


@pytest.mark.parametrize(
    ("steps", "line"),
    [
        (1, "loss 0.000 (1 step)"),
        (2, "loss 0.000 -> 1.000 (first and last of 2 steps)"),
        (5, "loss 0.500 -> 3.500 (means of the first and last 2 of 5 steps)"),
        (9, "loss 1.500 -> 6.500 (means of the first and last 4 of 9 steps)"),
        (10, "loss 2.000 -> 7.000 (means of the first and last 5 of 10 steps)"),
        (20, "loss 2.000 -> 17.000 (means of the first and last 5 of 20 steps)"),
    ],
)
def test_the_loss_summary_never_lets_the_first_and_last_steps_overlap(steps, line):
    assert loss_summary([float(i) for i in range(steps)]) == line  # losses 0, 1, ..., steps - 1


@pytest.mark.parametrize("steps", [1, 2, 5, 9, 10, 20])
def test_finetune_ends_comparing_its_first_and_last_steps(capsys, steps):
    recorder = Losses()
    assert finetune(_config(None, steps=steps), plugins=_plugins(recorder)) == 0
    (line,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done: ")]
    losses = [m["loss"] for m in recorder.metrics]
    assert len(losses) == steps and line.startswith(f"done: {steps} steps in ")
    assert line.endswith("; " + loss_summary(losses))
    if steps == 1:
        assert line.endswith(f"; loss {losses[0]:.3f} (1 step)")
    else:
        k = min(5, steps // 2)  # the first k and the last k steps are different steps
        head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
        assert f"; loss {head:.3f} -> {tail:.3f} (" in line and line.endswith(f" of {steps} steps)")


# --------------------------------------------------------------------------- progress


def test_a_log_file_gets_plain_lines_evaluations_and_checkpoints_and_no_carriage_return(tmp_path, capsys):
    recorder = Losses()
    cfg = _config(tmp_path / "run", steps=5, eval_fraction=0.01, eval_every=2)
    assert finetune(cfg, progress=True, plugins=_plugins(recorder)) == 0
    shown = capsys.readouterr()  # neither is a terminal
    assert "\r" not in shown.err and "\r" not in shown.out
    steps = [ln for ln in shown.err.splitlines() if ln.startswith("finetune: step ")]  # progress: stderr
    lines = shown.out.splitlines()  # messages: stdout
    assert [ln.split()[2] for ln in steps] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
    for ln, m in zip(steps, recorder.metrics, strict=True):
        assert f"loss={m['loss']:.4f}, tok_s=" in ln
    evals = [(step, m["eval_loss"]) for step, m in enumerate(recorder.metrics, start=1) if "eval_loss" in m]
    assert [step for step, _ in evals] == [2, 4]  # every 2 steps
    for step, loss in evals:
        assert f"step {step}: eval loss {loss:.3f}" in lines
    saved = [ln for ln in lines if ln.startswith("saved checkpoint ")]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert saved == [f"saved checkpoint step {s} -> {checkpoints / f'step-{s:08d}'}" for s in (2, 4, 5)]


def test_plain_lines_come_every_n_steps_the_first_and_the_last():
    out = io.StringIO()
    bar = Progress(60, initial=40, enabled=True, file=out, out=out, every=5)
    bar.write("a note")
    for _ in range(20):
        bar.update({"loss": 2.0, "tokens_per_s": 100.0})
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "a note" and "\r" not in out.getvalue()
    assert [ln.split()[2] for ln in lines[1:]] == ["41/60", "45/60", "50/60", "55/60", "60/60"]
    assert lines[-1].endswith(": loss=2.0000, tok_s=100")
    assert [log_every(n) for n in (1, 20, 21, 60, 100, 150, 400, 1000)] == [1, 1, 2, 5, 5, 10, 20, 50]
    silent = io.StringIO()
    Progress(3, enabled=False, file=silent).update({"loss": 1.0, "tokens_per_s": 1.0})
    assert silent.getvalue() == ""


def test_a_terminal_gets_a_bar_that_starts_where_a_resumed_run_is():
    tty = FakeTerminal()
    bar = Progress(60, initial=40, enabled=True, file=tty)
    bar.update({"loss": 2.0, "tokens_per_s": 100.0})
    bar.close()
    shown = tty.getvalue()
    assert "\r" in shown  # redrawn in place
    assert re.search(r"\b40/60\b", shown) and re.search(r"\b41/60\b", shown) and "loss=2.0000" in shown


def test_a_resumed_run_says_where_it_resumed_and_its_bar_starts_there(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert finetune(_config(run, steps=4), plugins=_plugins(Losses())) == 0
    capsys.readouterr()
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    with pytest.warns(RuntimeWarning, match="moved them aside"):  # the first run's checkpoint of step 4
        assert finetune(_config(run, steps=4, resume=2), progress=True, plugins=_plugins(Losses())) == 0
    counts = re.findall(r"\b(\d)/4\b", tty.getvalue())  # the bar, redrawn
    assert counts[0] == "2" and counts[-1] == "4" and "0" not in counts and "1" not in counts
    out = capsys.readouterr().out
    assert f"resumed from step 2 of 4 ({run / 'checkpoints' / 'step-00000002'})" in out.splitlines()
    assert "done: 2 steps in " in out
