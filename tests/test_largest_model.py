"""benchmarks/largest_model.py: a published shape cut to another depth, trained by the bench's child.

The shape keeps every field of its base but ``num_hidden_layers`` (so its units are the base's
units); the run's record names it; a run reports its progress on stderr while it goes, so a run cut
off by a time limit still says how far it got. On the CPU with the tiny preset.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench_helpers import load_benchmark

from slidekit.tools.presets import PRESETS, arch_spec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "largest_model.py"


def _script():
    return load_benchmark("largest_model")


def test_a_cut_shape_has_the_bases_units_and_its_own_depth():
    module = _script()
    name = module.register("llama-3.1-70b", 45)
    try:
        assert name == "llama-3.1-70b@45L"
        cut, base = arch_spec(name, 1024), arch_spec("llama-3.1-70b", 1024)
        assert cut.num_layers == 45 and base.num_layers == 80
        assert {k: v for k, v in PRESETS[name].items() if k != "num_hidden_layers"} == {
            k: v for k, v in PRESETS["llama-3.1-70b"].items() if k != "num_hidden_layers"
        }
        layer = [u.numel for u in cut.units if u.kind == "layer"]
        assert len(layer) == 45 and set(layer) == {u.numel for u in base.units if u.kind == "layer"}
        # 45 layers of 856.6 M plus the embedding and the head of 1.05 B each: 40.6 B parameters
        assert 40.5e9 < sum(u.numel for u in cut.units) < 40.7e9
    finally:
        PRESETS.pop(name, None)


def test_bad_shapes_are_refused_with_what_to_give():
    module = _script()
    with pytest.raises(SystemExit, match="at least one decoder layer"):
        module.register("tiny", 0)
    with pytest.raises(Exception, match=r"unknown model preset 'nope'.*tiny"):
        module.register("nope", 4)


def test_write_config_gives_a_model_directory_the_planner_reads(tmp_path):
    out = tmp_path / "cut"
    try:
        assert _script().main(["--base", "tiny", "--layers", "3", "--write-config", str(out)]) == 0
    finally:
        PRESETS.pop("tiny@3L", None)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["hidden_size"] == PRESETS["tiny"]["hidden_size"]


def test_progress_reports_the_ticks_and_every_step():
    module = _script()
    out = io.StringIO()
    with module.Progress(0.01, out) as progress:
        progress.step(1, {"seconds": 0.5, "loss": 2.0})
        time.sleep(0.05)
    lines = out.getvalue().splitlines()
    assert "start" in lines[0] and "end" in lines[-1]
    assert any("step 1: 0.500 s, loss 2.0000" in line for line in lines)
    assert any(line.endswith("running") for line in lines)
    assert all("rss" in line and "GiB]" in line for line in lines)


def test_a_cut_tiny_model_trains_and_reports_each_step_on_stderr(tmp_path):
    out = tmp_path / "records.jsonl"
    args = ["--base", "tiny", "--layers", "2", "--progress", "60", "--", "--batch", "2", "--seq", "32"]
    args += ["--steps", "3", "--warmup", "1", "--repeat-batch", "--lr", "1e-3", "--device", "cpu"]
    args += ["--out", str(out)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["status"] == "ok" and record["model"] == "tiny@2L" and record["steps"] == 3
    assert record["resident_units"].endswith("/4")  # embedding, 2 layers, head
    steps = [line for line in done.stderr.splitlines() if "] step " in line]
    assert [line.split("] step ")[1].split(":")[0] for line in steps] == ["1", "2", "3", "4"]
    assert record["losses"][-1] < record["losses"][0]  # the repeated batch's loss falls
