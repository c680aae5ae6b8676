"""The planner counts the checkpoints a run directory must hold, and a run without that room is refused up front."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from slidekit import DataConfig, EngineConfig, RunConfig, TrainConfig, Trainer
from slidekit.cli import main
from slidekit.errors import ConfigError
from slidekit.planning import GIB, Machine, Placement, Planner, Workload
from slidekit.planning.run_space import checkpoint_copies, checkpoint_writes
from slidekit.plugins import Plugins
from slidekit.testing.models import tiny_config


def _config(run_dir: Path, *, steps: int = 6, every: int = 2, keep: int = 2) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(run_dir), checkpoint_every=every, keep=keep),
        steps=steps,
    )


def _disk_bytes(path: Path) -> int:
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


@pytest.mark.parametrize(
    ("keep", "writes", "existing", "copies"),
    [
        (2, 10, 0, 3),  # two kept, and the third written before the oldest goes
        (2, 10, 2, 1),  # a resumed run: the two are there already
        (2, 10, 1, 2),
        (2, 10, 5, 1),  # more than keep there: the first commit prunes them
        (1, 10, 0, 2),
        (3, 2, 0, 2),  # a short run never reaches keep
        (None, 4, 0, 4),  # everything kept: every one written
        (None, 4, 3, 1),
        (2, 0, 0, 0),  # no run directory
    ],
)
def test_checkpoint_copies(keep, writes, existing, copies):
    assert checkpoint_copies(keep, writes, existing) == copies


def test_checkpoint_writes(tmp_path):
    cfg = _config(tmp_path, steps=10, every=3)
    assert checkpoint_writes(cfg) == 4  # steps 3, 6, 9 and the end
    assert checkpoint_writes(dataclasses.replace(cfg, steps=9)) == 3
    assert checkpoint_writes(dataclasses.replace(cfg, run=RunConfig(dir=str(tmp_path)))) == 1  # at the end
    assert checkpoint_writes(dataclasses.replace(cfg, run=RunConfig())) == 0


def test_checkpoint_bytes_cover_a_real_checkpoint(tmp_path):
    with Trainer(_config(tmp_path, steps=1, every=1)) as t:
        t.fit()
        assert t.planner is not None
        planned = t.planner.checkpoint_bytes()
    actual = _disk_bytes(tmp_path / "checkpoints" / "step-00000001")
    assert actual <= planned <= actual * 1.02 + (2 << 20), (actual, planned)


def _machine(run_dir_free: int, **kw: object) -> Machine:
    base = Machine.probe(torch.device("cpu"), None)
    return dataclasses.replace(base, run_dir_free=run_dir_free, **kw)  # type: ignore[arg-type]


def test_a_run_directory_too_small_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    cfg = _config(run)
    with Trainer(_config(tmp_path / "probe", steps=1, every=1)) as t:
        assert t.planner is not None
        size = t.planner.checkpoint_bytes()
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, machine=_machine(int(2.5 * size)))  # room for two checkpoints, the run needs three
    text = str(err.value)
    assert f"run directory: needs {3 * size / GIB:.2f} GiB (checkpoints (3 x {size / GIB:.2f} GiB)" in text
    assert "keep fewer checkpoints (run.keep=2 now)" in text and "only the run directory lacks room" in text
    assert not run.exists()  # refused before anything was written
    keep1 = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, keep=1))
    with Trainer(keep1, machine=_machine(int(2.5 * size))) as t:  # keep=1: two at once, which fit
        assert t.estimate is not None and t.estimate.run_dir_bytes == 2 * size
    with pytest.raises(ConfigError, match="run directory: needs") as err:
        Trainer(keep1, machine=_machine(int(1.5 * size)))
    assert "keep fewer" not in str(err.value) and "larger disk" in str(err.value)


def test_offload_files_and_checkpoints_share_one_disk():
    spec = Plugins().adapter_for("llama").descriptor.factory(tiny_config("llama"))
    planner = Planner(
        spec,
        Workload(batch_size=2, seq_len=16),
        compute_itemsize=4,
        state_bytes=lambda n: 8 * n,
        media={"ram": "host", "posix": "disk"},
        device_type="cpu",
        checkpoint_keep=1,
        checkpoint_writes=1,
    )
    placement = Placement(state_tier="posix")
    size = planner.checkpoint_bytes()
    state = sum(planner.state)
    machine = _machine(size + state // 2, disk_free=size + state // 2)
    est = planner.estimate(placement, machine)
    assert est.disk["state"] == state and est.run_dir_bytes == size
    assert est.fits(machine)  # two disks: each holds its part
    shared = dataclasses.replace(machine, run_dir_shares_disk=True)
    (problem,) = planner.estimate(placement, shared).shortfalls(shared)
    assert problem.startswith("run directory: needs") and "after the offload files" in problem


def test_machine_probe_measures_the_run_directory(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-00000002").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir()
    m = Machine.probe(torch.device("cpu"), str(tmp_path / "off" / "not-yet"), str(tmp_path / "run"))
    assert m.run_dir_free is not None and m.run_dir_free > 0 and m.run_dir_checkpoints == 2
    assert m.run_dir_shares_disk and "run directory" in m.describe()
    fresh = Machine.probe(torch.device("cpu"), None, str(tmp_path / "new" / "run"))
    assert fresh.run_dir_checkpoints == 0 and not fresh.run_dir_shares_disk


def test_slidekit_plan_shows_the_run_directory(tmp_path, capsys):
    assert (
        main(["plan", "--device", "cpu", "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "10"]) == 0
    )
    out = capsys.readouterr().out
    assert "run directory" in out and "checkpoints (3 x" in out
