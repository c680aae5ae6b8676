"""What killed runs leave behind: found at the next start, removed when its owner is dead, never when it lives.

Kills are real: a child process builds a posix tier (or a whole Trainer, or starts an export) and
SIGKILLs itself, so nothing of its own cleanup runs. Live owners are this test process's own tiers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slidekit import EngineConfig, Plugins, RunConfig, TrainConfig, Trainer, export, leftovers, owned
from slidekit.errors import ConfigError
from slidekit.export import export_model
from slidekit.interfaces import TierContext
from slidekit.planning import Machine
from slidekit.testing.models import tiny_config

pytestmark = pytest.mark.skipif(
    not Plugins().availability("tier", "posix")[0], reason="needs the posix tier (Linux)"
)

_KILLED_TIER = """
import os, signal, sys, torch
from slidekit.interfaces import TierContext
from slidekit_tiers.posix import PosixTier
tier = PosixTier(TierContext(device=torch.device("cpu"), directory=sys.argv[1]))
tier.allocate("state/0", 1 << 20)
tier.write("state/0", torch.ones(1 << 18)).result()
print(tier.root, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed(script: str, *args: str) -> tuple[int, str]:
    """Run ``script`` in a child that kills itself; its pid and what it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    return proc.pid, out.strip()


def _posix(directory: Path):
    from slidekit_tiers.posix import PosixTier

    return PosixTier(TierContext(device=torch.device("cpu"), directory=str(directory)))


def test_a_dead_owners_directory_is_reclaimed_a_live_ones_never(tmp_path):
    live = _posix(tmp_path)
    live.allocate("x", 4096)
    live.write("x", torch.arange(1024, dtype=torch.float32)).result()
    pid, dead_root = _killed(_KILLED_TIER, str(tmp_path))
    dead = Path(dead_root)
    assert dead.name.startswith(f"slidekit-posix-{pid}-") and (dead / ".owner").is_file()
    # From before .owner files: the pid in the name decides, and only region files may be inside.
    old_dead = tmp_path / f"slidekit-posix-{pid}-abcdefgh"
    old_dead.mkdir()
    (old_dead / "000001-state_0.bin").write_bytes(b"\0" * 4096)
    old_reused = tmp_path / f"slidekit-posix-{os.getpid()}-abcdefgh"  # a live pid: maybe reused, kept
    old_reused.mkdir()
    (old_reused / "000001-state_0.bin").write_bytes(b"\0" * 4096)
    not_ours = tmp_path / f"slidekit-data-{pid}-abcdefgh"  # a dead pid, but files we never write
    not_ours.mkdir()
    (not_ours / "notes.txt").write_text("keep me")
    elsewhere = tmp_path / "slidekit-posix-1-abcdefgh"  # another machine's run on a shared disk
    elsewhere.mkdir()
    (elsewhere / ".owner").write_text(json.dumps({"pid": 1, "host": "another-host"}))
    unrelated = tmp_path / "slidekit-cache"
    unrelated.mkdir()

    removed, kept = owned.reclaim(tmp_path, "slidekit-")
    assert sorted(r.path for r in removed) == sorted([dead, old_dead])
    assert all(r.owner == "dead" and r.nbytes >= 1 << 20 for r in removed if r.path == dead)
    assert {k.path: k.owner for k in kept} == {
        Path(live.root): "alive",
        old_reused: "alive",
        not_ours: "unknown",
        elsewhere: "unknown",
    }
    assert not dead.exists() and not old_dead.exists()
    assert all(p.exists() for p in (Path(live.root), old_reused, not_ours, elsewhere, unrelated))
    back = torch.empty(1024)
    live.read("x", back).result()  # the live tier never noticed
    assert torch.equal(back, torch.arange(1024, dtype=torch.float32))
    live.close()
    assert not Path(live.root).exists()


_KILLED_TRAINER = """
import os, signal, sys
from slidekit import EngineConfig, RunConfig, TrainConfig, Trainer
cfg = TrainConfig(
    engine=EngineConfig(device="cpu", state_tier="posix", offload_dir=sys.argv[1]),
    run=RunConfig(dir=sys.argv[2]),
    steps=2,
)
t = Trainer(cfg)
t.fit(steps=1)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_runs_offload_files_go_when_the_next_run_starts(tmp_path):
    off, run = tmp_path / "off", tmp_path / "run"
    off.mkdir()
    pid, _ = _killed(_KILLED_TRAINER, str(off), str(run))
    (left,) = off.glob(f"slidekit-posix-{pid}-*")
    assert sum(f.stat().st_size for f in left.iterdir()) > 1 << 20  # the optimizer state, leaked
    live = _posix(off)  # a concurrent run on the same disk
    try:
        cfg = TrainConfig(
            engine=EngineConfig(device="cpu", state_tier="posix", offload_dir=str(off)),
            run=RunConfig(dir=str(run), resume=True),
            steps=2,
        )
        with Trainer(cfg) as t:
            note = next(n for n in t.notes if n.startswith("removed what killed runs left"))
            assert f"offload files in {off}" in note and left.name in note and "dead" in note
            assert any("left alone" in n and Path(live.root).name in n for n in t.notes)
            assert not left.exists() and Path(live.root).exists()
            assert t.engine.steps_done == 1 and len(t.fit().losses) == 1
        # Short of disk space, the refusal names the files that take it.
        small = Machine(device_type="cpu", host_available=64 << 30, host_total=64 << 30, disk_free=4096)
        with pytest.raises(ConfigError) as err:
            Trainer(cfg, machine=small)
        text = str(err.value)
        assert "disk: needs" in text and "other slidekit processes' files, left alone" in text
        assert f"{Path(live.root).name} (pid {os.getpid()}, alive" in text
    finally:
        live.close()


_KILLED_EXPORT = """
import os, signal, sys, torch
import slidekit.export as export
from slidekit.testing.models import tiny_config
def killed(stage, detail):
    if stage == "written":  # every file written, nothing in place yet
        os.kill(os.getpid(), signal.SIGKILL)
state = {"model.embed_tokens.weight": torch.zeros(2, 2)}
export.export_model(sys.argv[1], hf_config=tiny_config("llama"), state=state, tokenizer=None, progress=killed)
"""


def test_a_killed_export_and_checkpoint_deletion_go_when_the_next_run_starts(tmp_path):
    out, run = tmp_path / "exports" / "model", tmp_path / "run"
    _killed(_KILLED_EXPORT, str(out))
    (left,) = out.parent.glob(f".{out.name}.slidekit-export-*")
    live, held = export._staging_dir(out)  # an export in progress elsewhere: its lock is held
    doomed = run / "checkpoints" / ".tmp-delete-step-00000001-0123abcd"  # retention, killed mid-delete
    doomed.mkdir(parents=True)
    (doomed / "manifest.json").write_text("{}")
    try:
        got = leftovers.reclaim(TrainConfig(run=RunConfig(dir=str(run), export_dir=str(out))))
        assert not left.exists() and not doomed.exists() and live.is_dir()
        text = "; ".join(got.removed)
        assert f"a half-written export beside {out}" in text and doomed.name in text
    finally:
        held.release()
    export.remove_leftovers(out)  # released now: a later export removes it
    # A finished export carries no trace of its staging.
    state = {"model.embed_tokens.weight": torch.zeros(2, 2)}
    path = export_model(out, hf_config=tiny_config("llama"), state=state, tokenizer=None)
    assert not (path / ".owner").exists() and (path / "model.safetensors").is_file()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_a_dead_export_behind_a_symlinked_target_is_reclaimed(tmp_path):
    """Staging lies beside the real target (``check_target`` resolves symlinks), so the leftovers of an
    export killed there are found through the link as well."""
    real = tmp_path / "exports" / "model"
    real.parent.mkdir()
    link = tmp_path / "model-link"
    link.symlink_to(real, target_is_directory=True)
    staging, held = export._staging_dir(export.check_target(link).path)
    (staging / "model.safetensors").write_bytes(b"partial")
    held.release()  # what a kill leaves: the owner record, its lock free
    assert staging.parent.parent == real.parent
    (note,) = leftovers.reclaim_export(link)
    assert f"a half-written export beside {link}" in note and staging.parent.name in note
    assert not staging.parent.exists() and os.listdir(real.parent) == []
