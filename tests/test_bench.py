"""`slidekit bench`: runs in subprocesses, records and ratios, unavailable alternatives, FLOPs, presets.

The end-to-end test runs the tiny preset on the CPU through the command line:
slidekit and the no-offload baseline for real (2 timed steps each), torchao
and DeepSpeed as alternatives that cannot run here (not installed, or no
CUDA) and must say so instead of failing. The rest checks the pieces with
hand computations: model FLOPs, parameter counts of every preset against the
published sizes (from the ArchSpec, no weights), lane metrics, run failures.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch

from slidekit.bench import (
    PRESETS,
    add_ratios,
    arch_spec,
    hf_config,
    lane_metrics,
    markdown_table,
    run_child,
    throughput,
)
from slidekit.cli import build_parser, main

#: Published parameter counts (model cards), billions.
PUBLISHED_B = {
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.77,
    "llama-3.1-8b": 8.03,
    "mistral-small-24b": 23.57,
}

RECORD_KEYS = {"system", "status", "model", "batch", "seq", "params", "median_step_s", "tokens_per_s"}
RECORD_KEYS |= {"model_tflops", "peak_gpu_gib", "peak_host_rss_gib", "wall_s", "losses"}
SLIDEKIT_KEYS = {
    "t_fwd_s",
    "t_bwd_s",
    "t_d2h_s",
    "t_update_s",
    "eta",
    "gpu_busy",
    "lanes_s",
    "resident_units",
}


def test_tiny_on_cpu_slidekit_against_the_alternatives(tmp_path, capsys):
    out, table = tmp_path / "bench.jsonl", tmp_path / "bench.md"
    argv = ["bench", "--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "2"]
    argv += ["--warmup", "0", "--resident", "none", "--baselines", "none,torchao,deepspeed"]
    argv += ["--out", str(out), "--markdown", str(table), "--timeout", "300"]
    assert main(argv) == 0
    rows = {r["system"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["slidekit", "no_offload", "torchao", "deepspeed"]

    for system in ("slidekit", "no_offload"):
        r = rows[system]
        assert r["status"] == "ok", r
        assert set(r) >= RECORD_KEYS, RECORD_KEYS - set(r)
        assert (r["model"], r["batch"], r["seq"], r["params"]) == (
            "tiny",
            2,
            32,
            arch_spec("tiny").num_params,
        )
        for key in ("median_step_s", "tokens_per_s", "model_tflops", "peak_host_rss_gib", "wall_s"):
            assert r[key] > 0, (system, key)
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["median_step_s"], rel=1e-3, abs=0.06)  # rounding
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["peak_gpu_gib"] is None  # CPU run

    sk = rows["slidekit"]
    assert set(sk) >= SLIDEKIT_KEYS
    assert sk["resident_units"] == "0/6"  # forced full offload: every unit slides
    for key in ("t_fwd_s", "t_bwd_s", "t_d2h_s", "t_update_s", "eta", "gpu_busy"):
        assert sk[key] > 0, key
    assert sk["t_bwd_s"] == pytest.approx(sk["lanes_s"]["bwd"] / 4, abs=2e-5)  # 4 layers, lanes_s rounded
    for system in ("slidekit", "no_offload"):  # cross-entropy of random weights on random tokens
        assert rows[system]["losses"][0] == pytest.approx(math.log(PRESETS["tiny"]["vocab_size"]), abs=0.2)

    ratio = sk["tokens_per_s"] / rows["no_offload"]["tokens_per_s"]
    assert sk["vs_no_offload"] == pytest.approx(ratio, rel=1e-2)
    assert sk["vs_torchao"] is None and sk["vs_deepspeed"] is None
    for system in ("torchao", "deepspeed"):  # why: not installed, or no CUDA in a --device cpu run
        assert rows[system]["status"] == "unavailable"
        assert re.search(r"not installed|cannot be imported|needs a CUDA device", rows[system]["reason"])

    text = table.read_text()
    assert text in capsys.readouterr().out
    slidekit_line = next(line for line in text.splitlines() if line.startswith("| slidekit"))
    assert f"{sk['vs_no_offload']:.2f}x" in slidekit_line
    assert "unavailable: " + rows["torchao"]["reason"] in text


def test_a_run_that_fails_or_hangs_becomes_unavailable_with_its_reason(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('ValueError: bad shape', file=sys.stderr); sys.exit(3)"]
    record = run_child(crash, timeout=60, log=tmp_path / "crash.log")
    assert record["status"] == "unavailable"
    assert record["reason"] == "exit code 3: ValueError: bad shape"
    assert "bad shape" in (tmp_path / "crash.log").read_text()
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    record = run_child(hang, timeout=1)
    assert record["status"] == "unavailable" and record["reason"].startswith("timed out after 1 s")
    assert record["wall_s"] < 30


def test_unknown_baseline_is_one_clear_line(capsys):
    assert main(["bench", "--model", "tiny", "--baselines", "none,megatron"]) == 2
    err = capsys.readouterr().err
    assert "megatron" in err and "none, torchao, deepspeed" in err


def test_model_flops_of_a_preset_by_hand():
    """Qwen2.5-3B: parameters from its published shapes, FLOPs = 6 N T + 12 L H D S T."""
    h, f, layers, heads, kv, d, vocab = 2048, 11008, 36, 16, 2, 128, 151936
    per_layer = 2 * h + (h * heads * d + heads * d) + 2 * (h * kv * d + kv * d) + heads * d * h + 3 * h * f
    params = vocab * h + layers * per_layer + h  # tied LM head, final norm
    spec = arch_spec("qwen2.5-3b")
    assert spec.num_params == params
    batch, seq, step_s = 8, 1024, 2.0
    tokens = batch * seq
    flops = 6 * params * tokens + 12 * layers * heads * d * seq * tokens
    got = throughput(spec, batch, seq, [3.0, step_s, 1.0])  # the median step
    assert got["tokens_per_s"] == pytest.approx(tokens / step_s)
    assert got["model_tflops"] == pytest.approx(flops / step_s / 1e12, rel=1e-3)


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_preset_sizes_match_the_published_models(name):
    spec = arch_spec(name)  # layouts only: no weights are allocated
    assert spec.num_params / 1e9 == pytest.approx(PUBLISHED_B[name], rel=0.02)
    assert spec.vocab_size == PRESETS[name]["vocab_size"]
    inv_freq, _ = spec.rope_init()  # the preset's rope parameters are valid for its family
    assert inv_freq.numel() == spec.head_dim // 2
    # The alternatives build the same model: transformers' count, on the meta device, agrees exactly.
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(name, 1024))
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_lane_metrics_per_unit_eta_and_busy():
    timings = [
        {"fwd": 0.2, "head": 0.1, "bwd": 0.8, "d2h": 0.1, "update": 0.3},
        {"fwd": 0.4, "head": 0.1, "bwd": 1.2, "d2h": 0.3, "update": 0.5},
        {"fwd": 0.3, "head": 0.1, "bwd": 1.0, "d2h": 0.2, "update": 0.4, "stall": 0.1},
    ]
    steps = [2.0, 4.0, 2.8]
    m = lane_metrics(timings, steps, num_layers=10)
    assert m["t_fwd_s"] == pytest.approx(0.03) and m["t_bwd_s"] == pytest.approx(0.1)
    assert m["t_d2h_s"] == pytest.approx(0.02) and m["t_update_s"] == pytest.approx(0.04)
    assert m["eta"] == pytest.approx(1.0 / (0.2 + 0.4), abs=1e-3)
    assert m["gpu_busy"] == pytest.approx(0.5)  # busy per step: 0.55, 0.425, 0.5
    assert m["lanes_s"]["stall"] == 0.0  # a lane missing from a step counts as 0 there
    resident = lane_metrics([{"fwd": 0.1, "bwd": 0.3, "update_gpu": 0.1}], [1.0], num_layers=2)
    assert resident["eta"] is None and resident["gpu_busy"] == pytest.approx(0.5)


def test_ratios_only_between_runs_of_the_same_batch():
    rows = [
        {"system": "slidekit", "label": "slidekit", "batch": 8, "status": "ok", "tokens_per_s": 300.0},
        {"system": "no_offload", "label": "no_offload", "batch": 8, "status": "ok", "tokens_per_s": 200.0},
        {"system": "torchao", "label": "torchao", "batch": 8, "status": "unavailable", "reason": "no CUDA"},
        {"system": "slidekit", "label": "slidekit", "batch": 16, "status": "ok", "tokens_per_s": 500.0},
        {"system": "no_offload", "label": "no_offload", "batch": 16, "status": "ok", "tokens_per_s": 100.0},
    ]
    add_ratios(rows)
    assert (rows[0]["vs_no_offload"], rows[0]["vs_torchao"]) == (1.5, None)
    assert rows[3]["vs_no_offload"] == 5.0 and "vs_torchao" not in rows[3]
    table = markdown_table(rows)
    assert "| unavailable: no CUDA |" in table and "1.50x" in table and "5.00x" in table


def test_bench_options_are_pinned():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse exposes no public accessor
    options = [o for a in sub.choices["bench"]._actions for o in a.option_strings if o.startswith("--")]
    assert options == [
        "--help",
        "--model",
        "--batch",
        "--seq",
        "--steps",
        "--warmup",
        "--seed",
        "--baselines",
        "--device",
        "--kernels",
        "--optimizer",
        "--activations",
        "--window",
        "--resident",
        "--state-tier",
        "--offload-dir",
        "--timeout",
        "--time-budget",
        "--out",
        "--markdown",
        "--logs",
        "--baselines-dir",
    ]
