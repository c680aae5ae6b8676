"""``epochs``: the run's step count (``ceil(epochs x steps per epoch)``; ``steps`` wins, as max_steps does
in transformers), the learning-rate schedule spanning it, resume, and the CLI and plan that state it.

Test: ``python -m pytest -q tests/test_epochs.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slidekit import DataConfig, EngineConfig, OptimConfig, RunConfig, TrainConfig, Trainer
from slidekit.cli import build_parser, config_from_args, main
from slidekit.config import DEFAULT_STEPS
from slidekit.data import count_steps, steps_per_epoch
from slidekit.errors import ConfigError
from slidekit.hookspecs import hookimpl
from slidekit.lr_schedule import lr_factor
from slidekit.plugins import Plugins
from slidekit.testing.asserts import assert_states_equal


@pytest.mark.parametrize(
    ("steps", "epochs", "rows", "batch", "accum", "total", "source"),
    [
        (None, None, None, 8, 1, DEFAULT_STEPS, "default"),
        (None, 2.0, 42, 4, 2, 10, "epochs"),  # 42 // 8 = 5 steps per epoch
        (None, 1.5, 40, 8, 1, 8, "epochs"),  # ceil(7.5)
        (None, 0.1, 30, 1, 1, 3, "epochs"),  # 0.1 x 30 is 3.0000000000000004 in floats: still 3
        (None, 0.01, 40, 8, 1, 1, "epochs"),  # at least one step
        (7, 2.0, 42, 4, 2, 7, "steps"),  # steps wins over epochs
        (7, None, None, 4, 2, 7, "steps"),
    ],
)
def test_the_step_count(steps, epochs, rows, batch, accum, total, source):
    count = count_steps(steps, epochs, rows=rows, batch_size=batch, grad_accum=accum)
    assert (count.total, count.source) == (total, source)
    if rows is not None:
        assert count.per_epoch == rows // (batch * accum)


def test_the_step_count_says_where_it_comes_from():
    assert (
        count_steps(None, 2, rows=42, batch_size=4, grad_accum=2).describe()
        == "10 steps = 2 epochs of 5 steps"
    )
    assert (
        count_steps(None, 1, rows=8, batch_size=4, grad_accum=1).describe() == "2 steps = 1 epoch of 2 steps"
    )
    assert count_steps(7, 2, rows=42, batch_size=4, grad_accum=2).describe() == (
        "7 steps (steps; steps wins over epochs = 2, as max_steps does in transformers; 1.4 epochs of 5 steps)"
    )
    assert count_steps(None, None, batch_size=8, grad_accum=1).describe() == (
        f"{DEFAULT_STEPS} steps (the default: neither steps nor epochs set)"
    )


def test_fewer_rows_than_one_step_is_an_error_with_the_numbers():
    assert steps_per_epoch(16, 4, 2) == 2
    with pytest.raises(
        ConfigError, match=r"holds 7 rows, fewer than one step takes: 4 rows per micro-batch x 2 "
    ):
        steps_per_epoch(7, 4, 2)


def test_epochs_in_the_configuration():
    assert TrainConfig(epochs=2).epochs == 2.0 and TrainConfig(epochs=2).steps is None
    for bad in (0, -1.5):
        with pytest.raises(ConfigError, match=r"train\.epochs must be > 0"):
            TrainConfig(epochs=bad)
    args = build_parser().parse_args(["finetune", "--epochs", "2.5"])
    assert config_from_args(args).epochs == 2.5 and config_from_args(args).steps is None


def _data(tmp_path: Path, n: int = 30) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"Line {i} of the sample, {'word ' * (i % 5)}"}) + "\n" for i in range(n))
    )
    return path


def _cfg(tmp_path: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(path=str(_data(tmp_path)), seq_len=16, batch_size=2),
        optim=OptimConfig(lr=1e-3, schedule="linear", warmup_steps=1, min_lr_ratio=0.1),
        engine=EngineConfig(device="cpu"),
        **kw,
    )


class _LRs:
    def __init__(self) -> None:
        self.lrs: list[float] = []

    @hookimpl
    def slidekit_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.lrs.append(metrics["lr"])


def test_an_epochs_run_takes_its_steps_and_the_schedule_spans_them(tmp_path):
    seen = _LRs()
    with Trainer(_cfg(tmp_path, epochs=2, grad_accum=2), plugins=Plugins(extra=[("lrs", seen)])) as t:
        rows = len(t.datasets()[0])
        per_epoch = rows // 4
        assert per_epoch >= 2  # what the data is for
        assert (t.step_count.total, t.step_count.per_epoch) == (2 * per_epoch, per_epoch)
        assert t.config.steps == 2 * per_epoch  # the count is fixed in the (saved) configuration
        assert f"{2 * per_epoch} steps = 2 epochs of {per_epoch} steps" in t.notes
        result = t.fit()
    total = 2 * per_epoch
    assert len(result.losses) == total
    want = [
        1e-3 * lr_factor(s, schedule="linear", total=total, warmup=1, min_ratio=0.1)
        for s in range(1, total + 1)
    ]
    assert seen.lrs == pytest.approx(want, rel=1e-12)
    assert seen.lrs[-1] == pytest.approx(1e-4)  # the decay ends at the last step of the last epoch


def test_steps_win_over_epochs(tmp_path):
    with Trainer(_cfg(tmp_path, epochs=2, steps=3)) as t:
        assert t.step_count.total == 3 and t.step_count.source == "steps"
        assert len(t.fit().losses) == 3


def test_a_resumed_epochs_run_continues_bitwise(tmp_path):
    def cfg(run: Path, resume: bool = False) -> TrainConfig:
        return _cfg(tmp_path, epochs=2, run=RunConfig(dir=str(run), checkpoint_every=2, resume=resume))

    with Trainer(cfg(tmp_path / "a")) as t:
        whole = t.fit()
        want = t.state_dict()
        total = t.step_count.total
    with Trainer(cfg(tmp_path / "b")) as t:
        first = t.fit(steps=3)  # stopped after step 3 (checkpointed at the end of fit)
    with Trainer(cfg(tmp_path / "b", resume=True)) as t:
        assert t.step_count.total == total
        rest = t.fit()
        assert_states_equal(t.state_dict(), want)
    assert first.losses + rest.losses == whole.losses


def test_finetune_and_plan_state_the_epochs(tmp_path, capsys):
    data = _data(tmp_path)
    argv = ["--data", str(data), "--seq-len", "16", "--batch-size", "2", "--device", "cpu", "--epochs", "1"]
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    run = next(line for line in out.splitlines() if line.startswith("  run: "))
    assert run.endswith(" steps = 1 epoch of " + run.split()[1] + " steps")
    assert main(["plan", *argv[:-2], "--steps", "4"]) == 0
    assert "steps: 4 steps (steps)" in capsys.readouterr().out.splitlines()
    assert main(["finetune", *argv, "--quiet"]) == 0
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:"))
    assert done.startswith(f"done: {run.split()[1]} steps in ")


def test_epochs_need_enough_rows_for_one_step(tmp_path):
    cfg = TrainConfig(
        data=DataConfig(path=str(_data(tmp_path, n=3)), seq_len=16, batch_size=64),
        engine=EngineConfig(device="cpu"),
        epochs=1,
    )
    with pytest.raises(
        ConfigError, match=r"training data holds \d+ rows, fewer than one step takes: 64 rows"
    ):
        Trainer(cfg)
