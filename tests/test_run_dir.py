"""A run directory belongs to one run: it holds only a slidekit run, a fresh run never deletes a previous
one's checkpoints, and two processes never run in it at once (a SIGKILLed holder never blocks)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from slidekit import EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig, Trainer
from slidekit import checkpoint as ck
from slidekit.cli import main
from slidekit.errors import ConfigError
from slidekit.planning import Machine
from slidekit.run import RUN_LOCK, RunDirectory, RunDirectoryBusy, discard_run
from slidekit.testing.models import random_batches

ROOT = Path(__file__).resolve().parents[1]


def _config(model_dir, run_dir, **run) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(run_dir), **run),
        steps=4,
    )


def _started(config: TrainConfig) -> RunDirectory:
    """A run directory as a Trainer leaves it once the run starts (config.json written)."""
    run = RunDirectory(config)
    run.start()
    return run


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_model_directory_is_not_a_run_directory(tiny_model, tmp_path):
    model = tiny_model("llama")
    before = _tree(model)
    with pytest.raises(ConfigError, match=r"holds a config\.json that is not a slidekit run configuration"):
        Trainer(_config(model, model))  # --run-dir pointed at the model
    assert _tree(model) == before  # its config.json is the model's still, and no run.lock was added


def test_a_directory_with_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    with pytest.raises(ConfigError, match=r"is not empty \(data, notes.txt\) and holds no slidekit run"):
        RunDirectory(TrainConfig(run=RunConfig(dir=str(tmp_path))))
    assert sorted(os.listdir(tmp_path)) == ["data", "notes.txt"]


def test_a_file_or_a_path_below_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"run directory .* is a file, not a directory"):
        RunDirectory(TrainConfig(run=RunConfig(dir=str(tmp_path / "f"))))
    with pytest.raises(ConfigError, match=r"cannot be created: '.*f' is a file"):
        RunDirectory(TrainConfig(run=RunConfig(dir=str(tmp_path / "f" / "run"))))
    assert (tmp_path / "f").read_text() == "x"


def test_a_fresh_run_never_deletes_a_previous_runs_checkpoints(tiny_model, tmp_path):
    model, run = tiny_model("llama"), tmp_path / "run"
    with Trainer(_config(model, run, checkpoint_every=1, keep=2)) as t:
        t.fit(random_batches(128, steps=4))
    kept = sorted(os.listdir(run / "checkpoints"))
    assert kept == ["step-00000003", "step-00000004"]
    with pytest.raises(
        ConfigError, match=r"holds a previous run \(checkpoints/: step-00000003, step-00000004"
    ):
        Trainer(_config(model, run, checkpoint_every=1, keep=2))  # no --resume: retention would delete them
    assert sorted(os.listdir(run / "checkpoints")) == kept
    with Trainer(_config(model, run, resume=True)) as t:  # what the message suggests works
        assert t.engine.steps_done == 4
    with Trainer(_config(model, run, checkpoint_every=1, overwrite=True)) as t:  # asked to start afresh
        assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").read_text() == ""
        t.fit(random_batches(128, steps=1, seed=3))
    assert sorted(os.listdir(run / "checkpoints")) == ["step-00000001"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    """The child's next line of output; fails the test after ``timeout`` s instead of waiting forever."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        pytest.fail(f"the child printed nothing in {timeout} s")
    return proc.stdout.readline().strip()


HOLDER = """
import sys
from slidekit.config import RunConfig, TrainConfig
from slidekit.run import RunDirectory
run = RunDirectory(TrainConfig(run=RunConfig(dir=sys.argv[1])))
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_second_run_is_refused_with_the_first_ones_pid_and_a_killed_one_blocks_nothing(
    tiny_model, tmp_path
):
    run = tmp_path / "run"
    paths = [str(ROOT), str(ROOT / "plugins"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert _readline(first, timeout=120) == "holding"
        with pytest.raises(
            RunDirectoryBusy, match=rf"in use by another slidekit run \(pid {first.pid} on host"
        ):
            Trainer(_config(tiny_model("llama"), run))
        first.kill()  # SIGKILL: no handler runs, only the OS can release the lock
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=60)
    with Trainer(_config(tiny_model("llama"), run)) as t:
        assert (run / RUN_LOCK).read_text().split()[0] == str(os.getpid())
        t.fit(random_batches(128, steps=1))
    assert ck.latest(run / "checkpoints") is not None


def test_the_lock_is_released_when_the_run_ends_or_fails_to_start(tiny_model, tmp_path):
    run = tmp_path / "run"
    first = RunDirectory(TrainConfig(run=RunConfig(dir=str(run))))
    with pytest.raises(RunDirectoryBusy, match=rf"pid {os.getpid()}"):
        RunDirectory(TrainConfig(run=RunConfig(dir=str(run))))
    first.close()
    first.close()  # idempotent
    with pytest.raises(ConfigError, match="nothing to resume"):
        Trainer(_config(tiny_model("llama"), run, resume=True))
    RunDirectory(TrainConfig(run=RunConfig(dir=str(run)))).close()  # the failed start let go


def test_discarding_a_run_removes_only_its_own_files(tmp_path):
    run = tmp_path / "run"
    _started(TrainConfig(run=RunConfig(dir=str(run)))).close()
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "trace.json").write_text("{}")  # a trace the user put in the run directory
    assert not discard_run(run, checkpoints=False)  # it holds a checkpoint: kept
    assert (run / "checkpoints" / "step-00000001").is_dir()
    assert discard_run(run, checkpoints=True)
    assert sorted(os.listdir(run)) == ["trace.json"]
    (run / "trace.json").unlink()
    _started(TrainConfig(run=RunConfig(dir=str(run)))).close()
    assert discard_run(run, checkpoints=False) and not run.exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    assert not discard_run(foreign, checkpoints=True) and (foreign / "config.json").exists()


def test_resume_step_0_with_overwrite_never_removes_the_previous_run(tmp_path):
    """``--resume 0`` asks for step 0 (``resume_target() == 0``): a resume, not a fresh run, even with
    ``--overwrite``, so the run's checkpoints and metrics stay whatever the resume then finds."""
    run = tmp_path / "run"
    _started(TrainConfig(run=RunConfig(dir=str(run)))).close()
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    for resume in (0, "0"):
        config = TrainConfig(run=RunConfig(dir=str(run), resume=resume, overwrite=True))
        assert config.run.resume_target() == 0
        RunDirectory(config).close()
        assert (run / "checkpoints" / "step-00000002").is_dir()
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


# --------------------------------------------------------------------------- a failed attempt writes nothing


def _record(run: Path) -> dict[str, bytes]:
    """Everything in a run directory but its lock (which records the last process that took it)."""
    return {name: data for name, data in _tree(run).items() if name != RUN_LOCK}


def _tiny_machine() -> Machine:
    return Machine(device_type="cpu", host_available=1 << 20, host_total=1 << 20)


@pytest.fixture
def finished(tiny_model, tmp_path) -> tuple[Path, Path]:
    """A model and a run directory holding a finished 4-step run (checkpoints at 2 and 4)."""
    model, run = tiny_model("llama"), tmp_path / "run"
    with Trainer(_config(model, run, checkpoint_every=2)) as t:
        t.fit(random_batches(128, steps=4))
    return model, run


@pytest.mark.parametrize("attempt", ["no such step", "another optimizer", "does not fit", "a refused change"])
def test_a_failed_resume_leaves_the_run_directory_byte_for_byte(finished, capsys, attempt):
    """Regression: config.json was written before the resume target was checked."""
    model, run = finished
    before = _record(run)
    config = _config(model, run, resume=True, keep=5)  # a change a resume may make, to be recorded
    if attempt == "no such step":
        with pytest.raises(ConfigError, match=r"there is no checkpoint directory .*step-00000007"):
            Trainer(dataclasses.replace(config, run=dataclasses.replace(config.run, resume=7)))
    elif attempt == "another optimizer":
        with pytest.raises(ck.CheckpointMismatch, match=r"holds the state of optimizer 'layer_adam'"):
            Trainer(dataclasses.replace(config, optim=OptimConfig(lr=1e-3, name="adamw_8bit")))
    elif attempt == "does not fit":
        with pytest.raises(ConfigError, match=r"no placement fits"):
            Trainer(config, machine=_tiny_machine())
    else:
        assert main(["finetune", "--resume", str(run), "--seq-len", "64", "--quiet"]) == 2
        assert "data.seq_len: 128 -> 64" in capsys.readouterr().err
    assert _record(run) == before
    with Trainer(config) as t:  # the run resumes as it was; only now is its configuration rewritten
        assert t.engine.steps_done == 4
    assert json.loads((run / "config.json").read_text())["run"]["keep"] == 5


def test_a_fresh_run_that_fails_keeps_a_previous_runs_record(finished, tmp_path):
    """Neither a previous run's checkpoints (--overwrite) nor a config.json alone go before the run starts."""
    model, run = finished
    before = _record(run)
    with pytest.raises(ConfigError, match=r"no placement fits"):
        Trainer(_config(model, run, overwrite=True), machine=_tiny_machine())
    assert _record(run) == before  # the checkpoints the overwrite would discard are still there
    bare = tmp_path / "bare"
    _started(_config(model, bare, keep=3)).close()  # a run that recorded its configuration, nothing else
    (bare / "metrics.jsonl").unlink()
    record = _record(bare)
    with pytest.raises(ConfigError, match=r"no placement fits"):
        Trainer(_config(model, bare), machine=_tiny_machine())
    assert _record(bare) == record
    with pytest.raises(ConfigError, match=r"no placement fits"):  # a directory it made goes again
        Trainer(_config(model, tmp_path / "new"), machine=_tiny_machine())
    assert not (tmp_path / "new").exists()
