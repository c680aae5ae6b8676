"""`slidekit bench`: suites run in subprocesses, records, repeats, recipes, the budget, the watchdog, the table.

The slow end-to-end test runs the tiny preset on the CPU through the command line: slidekit
all-resident and forced full offload and plain HF for real, HF + Liger, torchao and DeepSpeed as
alternatives that cannot run here (not installed, or no CUDA) and must say so instead of failing.
The fake-suite test runs the whole machinery on scripts standing in for every system (through
``--baselines-dir``): two repeats and two recipes, a time budget on a stopped clock, a baseline that
crashes after one batch, one that allocates host memory until the memory watchdog kills it (on a
fake machine whose available memory is computed from the child's real RSS), and checks the table's
medians, [min-max], offload efficiency and ratios by hand. The rest checks the pieces: the figures
of a record, model FLOPs of a preset, parameter counts of every preset against the published sizes,
lane metrics, cells and ratios, the pinned options. The child processes, the watchdog on its own and
the baseline scripts have their own files (test_bench_children.py, test_bench_baselines.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from bench_helpers import (
    FAKE_RECORD,
    assert_figures_of_its_steps,
    clock_of_predictions,
    fake_machine,
    fake_systems,
    table_row,
)
from hypothesis import example, given
from hypothesis import strategies as st

from slidekit import telemetry
from slidekit.cli import build_parser, main
from slidekit.models.base import ArchSpec
from slidekit.tools.bench import (
    PRESETS,
    add_ratios,
    arch_spec,
    bench,
    cells,
    hf_config,
    lane_metrics,
    markdown_table,
    throughput,
)
from slidekit.tools.bench.cli import build_suite
from slidekit.tools.bench.records import did_not_fit, no_room
from slidekit.tools.bench.suites import expand
from slidekit.tools.bench.summary import suite_markdown
from slidekit.tools.bench.timeplan import make_plan

#: Published parameter counts (model cards), billions.
PUBLISHED_B = {
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.77,
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.55,
    "mistral-small-24b": 23.57,
}

RECORD_KEYS = {"system", "status", "model", "batch", "seq", "params", "period_s", "tokens_per_s"}
RECORD_KEYS |= {"model_tflops", "peak_gpu_gib", "peak_host_rss_gib", "wall_s", "losses", "step_seconds"}
RECORD_KEYS |= {"commit", "date", "versions", "repeat", "max_grad_norm", "label", "run_name", "predicted_s"}
SLIDEKIT_KEYS = {
    "t_fwd_s",
    "t_bwd_s",
    "t_d2h_s",
    "t_update_s",
    "eta",
    "gpu_busy",
    "lanes_s",
    "resident_units",
    "device_state_units",
}


def _rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("record") == "run"]


@pytest.mark.slow
def test_tiny_on_cpu_slidekit_against_the_alternatives(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", "--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "2"]
    argv += [
        "--warmup",
        "1",
        "--resident",
        "all,none",
        "--repeats",
        "1",
        "--commit",
        "abc123",
        "--ram-floor-gib",
        "0",
    ]
    argv += ["--baselines", "none,liger,torchao,deepspeed", "--out", str(out), "--timeout", "300"]
    assert main(argv) == 0
    rows = {r["label"]: r for r in _rows(out / "suite-tiny.jsonl")}
    sk_all, sk_none, hf = rows["slidekit (resident all)"], rows["slidekit (resident none)"], rows["HF (GC)"]
    for r in (sk_all, sk_none, hf):
        assert r["status"] == "ok", r
        assert set(r) >= RECORD_KEYS, RECORD_KEYS - set(r)
        assert (r["model"], r["batch"], r["seq"], r["params"]) == (
            "tiny",
            2,
            32,
            arch_spec("tiny").num_params,
        )
        assert (r["commit"], r["repeat"], r["max_grad_norm"]) == ("abc123", 1, None)
        assert r["versions"]["torch"] == torch.__version__
        assert_figures_of_its_steps(r, 2, 32, steps=2)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["peak_gpu_gib"] is None  # CPU run
        # cross-entropy of random weights on random tokens
        assert r["losses"][0] == pytest.approx(math.log(PRESETS["tiny"]["vocab_size"]), abs=0.2)
    assert set(sk_none) >= SLIDEKIT_KEYS
    assert (sk_all["resident_units"], sk_none["resident_units"]) == ("6/6", "0/6")
    for key in ("t_fwd_s", "t_bwd_s", "t_d2h_s", "t_update_s", "eta", "gpu_busy"):
        assert sk_none[key] > 0, key
    assert sk_all["eta"] is None  # nothing offloaded
    assert rows["HF + Liger (no GC)"]["reason"].startswith(
        "liger-kernel not installed"
        if importlib.util.find_spec("liger_kernel") is None
        else "Liger Kernel's Triton"
    )
    for label in (
        "torchao CPUOffloadOptimizer",
        "DeepSpeed ZeRO-2 Offload",
    ):  # not installed, or no CUDA here
        assert rows[label]["status"] == "unavailable"
        assert re.search(r"not installed|cannot be imported|needs a CUDA device", rows[label]["reason"])

    text = (out / "suite-tiny.md").read_text()
    assert text in capsys.readouterr().out and "Commit `abc123`" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| slidekit (resident none) | 2 |"))
    assert f"| {sk_none['tokens_per_s'] / sk_all['tokens_per_s']:.2f} |" in line
    assert f"{sk_none['tokens_per_s'] / hf['tokens_per_s']:.2f}x (HF (GC))" in line
    assert "| HF + Liger (no GC) | all | unavailable: " + rows["HF + Liger (no GC)"]["reason"] in text


def test_the_suite_page_rounds_each_ratio_once():
    """0.8653 is 0.87 on the page, not 0.86 (0.865 rounded to three places first, then to two)."""

    def row(label, tokens, system="slidekit", family=None):
        out = {"record": "run", "label": label, "system": system, "batch": 8, "max_grad_norm": None}
        out |= {"ranks": 1, "family": family or label, "status": "ok", "tokens_per_s": tokens}
        return out | {"model_tflops": 1.0, "mean_step_s": 1.0, "run_name": label}

    rows = [
        row("slidekit (resident all)", 10_000.0),
        row("slidekit (resident 0.5)", 8_653.0),
        row("HF + Liger (no GC)", 7_950.0, system="liger"),
    ]
    page = suite_markdown({"name": "rounding", "suite": {}}, rows, records_name="x.jsonl")
    line = next(ln for ln in page.splitlines() if ln.startswith("| slidekit (resident 0.5) |"))
    assert "| 0.87 |" in line and "1.09x (HF + Liger (no GC))" in line  # 8,653 / 7,950 = 1.0884


@pytest.mark.parametrize(
    ("status", "reason", "where"),
    [
        ("unavailable", "does not fit in GPU memory: tried to allocate 4.00 GiB with 1.00 GiB free of 80.00 GiB", "gpu"),
        ("unavailable", "host RAM exhausted: child RSS 121.4 GiB, peak 121.4 GiB (killed by the bench's ...)", "host"),
        ("unavailable", "ConfigError: this configuration does not fit on this machine (GPU ...): ...", "planner"),
        ("unavailable", "no line for batch 8; timed out after 43 s", None),
        ("unavailable", "no line for batch 8; exit code 3: RuntimeError: boom", None),
        ("unavailable", "liger-kernel not installed", None),
        ("unavailable", "not repeated: repeat 1 did not fit this machine", None),
        ("not run", "not run: time budget (predicted 36 s; 20 s were left)", None),
        ("ok", "host RAM exhausted", None),  # only an unavailable row measured a failure
    ],
)
def test_did_not_fit_is_a_measured_memory_failure_only(status, reason, where):
    row = {"status": status, "reason": reason}
    assert no_room(row) == where and did_not_fit(row) is (where is not None)


# ---------------------------------------------------------------------------- a whole suite on stand-ins

@pytest.mark.skipif(sys.platform != "linux", reason="the watchdog reads /proc")
def test_a_suite_on_stand_ins_repeats_recipes_budget_watchdog_and_table(tmp_path, capsys, monkeypatch):
    scripts, out = tmp_path / "scripts", tmp_path / "out"
    scripts.mkdir()
    fake_systems(scripts)
    argv = ["bench", "--model", "tiny", "--batch", "2,3", "--seq", "16", "--steps", "4", "--warmup", "1"]
    argv += ["--resident", "all,none,0.5", "--clip", "none,1.0", "--repeats", "2", "--commit", "c0ffee"]
    argv += ["--baselines", "liger_gc,liger,none,torchao,deepspeed,deepspeed_partial"]
    argv += ["--baselines-dir", str(scripts), "--out", str(out), "--timeout", "60"]
    args = build_parser().parse_args(argv)
    # The budget: every run of importance up to 4.2, on a clock that takes each run's prediction (the plan
    # alone decides: the suite is never ahead of it, nor behind).
    the_suite = build_suite(args)
    plan = make_plan(the_suite, expand(the_suite), budget_s=None, prebuild=False)
    budget = sum(p.predicted_s for p in plan.runs if p.run.importance <= 4.2 + 1e-9) + 2.0
    assert min(p.predicted_s for p in plan.runs if p.run.importance > 4.2 + 1e-9) > 2.0
    args = build_parser().parse_args([*argv, "--time-budget", str(budget)])
    rows = bench(args, watchdog=fake_machine(), clock=clock_of_predictions(monkeypatch))

    assert rows == _rows(out / "suite-tiny.jsonl")
    by = {(r["label"], r["max_grad_norm"], r["repeat"], r["batch"]): r for r in rows}
    assert len(by) == len(rows) == 9 * 2 * 2 * 2  # every run, recipe, repeat and batch once
    # Left out by the budget: the clipped offload alternatives and plain HF, DeepSpeed partial's repeat
    # (torchao's second repeat started no process, which left time for plain HF's second).
    skipped = {(r["label"], r["max_grad_norm"], r["repeat"]) for r in rows if r["status"] == "not run"}
    assert skipped == {
        ("DeepSpeed ZeRO-3 partial offload (ratio 0.5)", None, 2),
        *((label, 1.0, k) for k in (1, 2) for label in ("HF (GC)", "torchao CPUOffloadOptimizer")),
        *(
            (label, 1.0, k)
            for k in (1, 2)
            for label in ("DeepSpeed ZeRO-2 Offload", "DeepSpeed ZeRO-3 partial offload (ratio 0.5)")
        ),
    }
    assert all(
        r["reason"].startswith("not run: time budget (predicted") for r in rows if r["status"] == "not run"
    )
    # The crash after batch 2: its line is kept, batch 3 says why.
    assert by[("DeepSpeed ZeRO-2 Offload", None, 1, 2)]["tokens_per_s"] == 600
    assert (
        by[("DeepSpeed ZeRO-2 Offload", None, 1, 3)]["reason"]
        == "no line for batch 3; exit code 3: RuntimeError: boom"
    )
    # Host RAM exhausted: killed by the watchdog, with the child's memory, long before its 120 s sleep.
    for batch in (2, 3):
        killed = by[("torchao CPUOffloadOptimizer", None, 1, batch)]
        assert killed["status"] == "unavailable"
        assert re.fullmatch(
            r"host RAM exhausted: child RSS [\d.]+ GiB, peak [\d.]+ GiB \(killed by the bench's memory watchdog: "
            r"[\d.]+ GiB available, under its 0\.8 GiB floor\)",
            killed["reason"],
        ), killed["reason"]
        assert killed["process_peak_rss_gib"] >= 0.19 and killed["process_wall_s"] < 60
        # ... so its second repeat starts no process: a memory failure is the same in every process.
        again = by[("torchao CPUOffloadOptimizer", None, 2, batch)]
        assert again["status"] == "unavailable" and again["not_repeated"] == 1
        assert again["reason"] == "not repeated: repeat 1 did not fit this machine"
        assert "process_wall_s" not in again
    assert not (scripts / "torchao-ended").exists()
    # Out of GPU memory at one batch: the second repeat runs the other batch only.
    assert by[("HF + Liger (no GC)", None, 2, 3)]["not_repeated"] == 1
    assert by[("HF + Liger (no GC)", None, 2, 2)]["tokens_per_s"] == 1400
    # A crash is no memory failure: DeepSpeed's second repeat ran again.
    assert by[("DeepSpeed ZeRO-2 Offload", None, 2, 3)]["reason"] == "no line for batch 3; exit code 3: RuntimeError: boom"
    # Each run started once the (fake) machine's memory was back: what was available is in its rows.
    started = [r for r in rows if r["status"] != "not run" and "not_repeated" not in r]
    assert {r.get("mem_available_at_start_gib") for r in started} == {1.0}
    # Every row says what ran and on which commit.
    assert {r["commit"] for r in rows} == {"c0ffee"} and all(
        r["run_name"] and r["predicted_s"] > 0 for r in rows
    )

    found = {(c.label, c.clip, c.batch): c for c in cells(rows)}
    sk = found[("slidekit (resident none)", None, 2)]
    assert sk.tokens == [1600.0, 1760.0]  # the two repeats, each its own process
    # offload efficiency: median 1680 / all-resident's median 2100; vs best no-offload: HF + Liger (no GC) 1400.
    assert sk.efficiency == 0.8 and sk.vs_best == (1.2, "HF + Liger (no GC)")
    assert sk.vs == {"torchao": None, "deepspeed": round(1680 / 600, 3), "deepspeed_partial": 1.68}
    # At batch 3 Liger without checkpointing does not fit: the best is HF + Liger (GC) at 1800.
    assert found[("slidekit (resident all)", None, 3)].vs_best == (1.75, "HF + Liger (GC)")
    assert (
        found[("slidekit (resident 0.5)", 1.0, 2)].efficiency == 0.9
    )  # clipped: (1620, 1782) / (1800, 1980)

    text = (out / "suite-tiny.md").read_text()
    assert text in capsys.readouterr().out
    assert "| slidekit (resident none) | 2 | 1,680 [1,600-1,760] (2) |" in text
    assert "| 0.80 | 1.20x (HF + Liger (no GC)) | - | 2.80x | 1.68x |" in text
    assert "| HF (GC) | 2 | 1,000 [1,000-1,000] (2) |" in text
    assert (
        "| HF + Liger (no GC) | 3 | unavailable: does not fit in GPU memory: tried to allocate 4.00 GiB"
        in text
    )
    assert "| torchao CPUOffloadOptimizer | all | unavailable: host RAM exhausted: child RSS" in text
    assert "### Recipe: max_grad_norm 1" in text and "Commit `c0ffee`" in text


def _three_runs(tmp_path):
    """A suite of three slidekit runs (resident all, none, 0.5) of the stand-in scripts, one batch each:
    its argv (without a budget), the suite and each run's predicted seconds, in plan order."""
    scripts, out = tmp_path / "scripts", tmp_path / "out"
    scripts.mkdir()
    fake_systems(scripts)
    argv = ["bench", "--model", "tiny", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1"]
    argv += ["--resident", "all,none,0.5", "--baselines", "", "--repeats", "1", "--commit", "c0ffee"]
    argv += ["--baselines-dir", str(scripts), "--out", str(out), "--no-prebuild"]
    the_suite = build_suite(build_parser().parse_args(argv))
    plan = make_plan(the_suite, expand(the_suite), budget_s=None, prebuild=False)
    return argv, the_suite, [p.predicted_s for p in plan.runs]


@pytest.mark.parametrize("speed", [1.0, 0.25])
def test_a_suite_ahead_of_its_plan_takes_up_what_the_plan_left_out(tmp_path, monkeypatch, speed):
    """The plan keeps two of three runs; on time the third is left out, at a quarter of the predicted time
    the suite is ahead when it comes to the third, which fits in what is left, and runs."""
    argv, the_suite, predicted = _three_runs(tmp_path)
    budget = predicted[0] + predicted[1] + 0.5 * predicted[2]
    args = build_parser().parse_args([*argv, "--time-budget", str(budget)])
    assert [
        p.keep for p in make_plan(the_suite, expand(the_suite), budget_s=budget, prebuild=False).runs
    ] == [
        True,
        True,
        False,
    ]
    rows = bench(args, watchdog=None, clock=clock_of_predictions(monkeypatch, speed))
    by = {r["label"]: r for r in rows}
    assert by["slidekit (resident all)"]["status"] == by["slidekit (resident none)"]["status"] == "ok"
    third = by["slidekit (resident 0.5)"]
    if speed == 1.0:
        assert third["status"] == "not run" and "the plan left it out" in third["reason"]
    else:
        assert third["status"] == "ok" and third["taken_up"].startswith("the plan left it out")
        assert "taken_up" not in by["slidekit (resident all)"]


def test_on_a_host_slower_than_the_records_a_run_that_would_overrun_the_budget_is_not_started(tmp_path, monkeypatch):
    """Every run takes twice its prediction (the records came from a faster host). The plan keeps all
    three within the budget; after the first, the call's pace (2x) says the next would not finish
    before the budget's end, so it is not started and the clock never runs past the budget, where
    predictions alone would have started it and had it cut off."""
    argv, the_suite, predicted = _three_runs(tmp_path)
    budget = sum(predicted) + 1.0
    args = build_parser().parse_args([*argv, "--time-budget", str(budget)])
    assert all(p.keep for p in make_plan(the_suite, expand(the_suite), budget_s=budget, prebuild=False).runs)
    assert 2 * (predicted[0] + predicted[1]) > budget  # without the pace the second run would overrun
    clock = clock_of_predictions(monkeypatch, 2.0)
    rows = bench(args, watchdog=None, clock=clock)
    assert clock() <= budget
    assert rows[0]["status"] == "ok" and "pace" not in rows[0]  # nothing measured before the first run
    skipped = [r for r in rows if r["status"] == "not run"]
    assert skipped and all("at this call's pace 2.00x" in r["reason"] for r in skipped)
    assert {r["status"] for r in rows} <= {"ok", "not run"}


def test_a_missing_replacement_script_is_that_run_s_reason(tmp_path):
    argv = [
        "bench",
        "--model",
        "tiny",
        "--batch",
        "2",
        "--resident",
        "all",
        "--repeats",
        "1",
        "--baselines",
        "torchao",
    ]
    argv += ["--baselines-dir", str(tmp_path), "--ram-floor-gib", "0"]
    (tmp_path / "slidekit.py").write_text(FAKE_RECORD + "for b in batches:\n    ok('slidekit', b, 100.0)\n")
    rows = bench(build_parser().parse_args(argv), watchdog=None)
    assert [(r["label"], r["status"]) for r in rows] == [
        ("slidekit (resident all)", "ok"),
        ("torchao CPUOffloadOptimizer", "unavailable"),
    ]
    assert (
        rows[1]["reason"]
        == f"script {tmp_path / 'torchao_offload.py'} not found (pass --baselines-dir with it, or leave --baselines-dir out)"
    )


# ---------------------------------------------------------------------------- figures, FLOPs, presets, causes


def test_unknown_baseline_is_one_clear_line(capsys):
    assert main(["bench", "--model", "tiny", "--baselines", "none,megatron"]) == 2
    err = capsys.readouterr().err
    assert "megatron" in err and "none, liger_gc, liger, torchao, deepspeed, deepspeed_partial" in err


def test_model_flops_of_a_preset_by_hand():
    """Qwen2.5-3B (tied): parameters from its published shapes; FLOPs = 6 N T + 12 L H D S T, whole steps."""
    h, f, layers, heads, kv, d, vocab = 2048, 11008, 36, 16, 2, 128, 151936
    per_layer = 2 * h + (h * heads * d + heads * d) + 2 * (h * kv * d + kv * d) + heads * d * h + 3 * h * f
    params = (
        vocab * h + layers * per_layer + h
    )  # tied LM head (its matmul counts; the lookup is free), final norm
    spec = arch_spec("qwen2.5-3b")
    assert spec.num_params == params and telemetry.matmul_params(spec) == params
    batch, seq = 8, 1024
    tokens = batch * seq
    flops = 6 * params * tokens + 12 * layers * heads * d * seq * tokens
    got = throughput(spec, batch, seq, [3.0, 2.0, 1.0])  # the period: 6 s for 3 steps
    assert got["tokens_per_s"] == pytest.approx(3 * tokens / 6.0) and got["mean_step_s"] == 2.0
    assert got["model_tflops"] == pytest.approx(3 * flops / 6.0 / 1e12, rel=1e-3)
    # Qwen2.5-7B is untied: its 152064 x 3584 input embedding is a lookup, ~7% of its parameters.
    spec7 = arch_spec("qwen2.5-7b")
    assert telemetry.matmul_params(spec7) == spec7.num_params - 152064 * 3584


@functools.cache
def _tiny_spec() -> ArchSpec:
    return arch_spec("tiny")


@example(seconds=[0.031765, 0.031765], batch=3, seq=16)
@given(
    seconds=st.lists(st.floats(1e-4, 1e4), min_size=1, max_size=12),
    batch=st.integers(1, 64),
    seq=st.integers(1, 4096),
)
def test_a_record_s_figures_are_those_of_the_step_times_it_recorded(seconds, batch, seq):
    """What the record says is recomputable exactly from what it recorded, through a JSON line too."""
    spec = _tiny_spec()
    record = json.loads(json.dumps(throughput(spec, batch, seq, seconds)))
    assert record["step_seconds"] == [round(s, 6) for s in seconds]
    assert throughput(spec, batch, seq, record["step_seconds"]) == record


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
    # Where the copy has its own span, T_d2h is the copy (the "d2h" lane also waits for the backward).
    copy = lane_metrics([{"bwd": 1.0, "d2h": 0.6, "d2h_copy": 0.1, "update": 0.7}], [2.0], num_layers=10)
    assert copy["t_d2h_s"] == pytest.approx(0.01) and copy["eta"] == pytest.approx(1.0 / 0.8, abs=1e-3)
    resident = lane_metrics([{"fwd": 0.1, "bwd": 0.3, "update_gpu": 0.1}], [1.0], num_layers=2)
    assert resident["eta"] is None and resident["gpu_busy"] == pytest.approx(0.5)


def test_ratios_and_cells_only_between_runs_of_the_same_batch_and_recipe():
    rows = [
        table_row("slidekit (resident all)", "slidekit", 8, 300.0),
        table_row("HF (GC)", "no_offload", 8, 200.0),
        table_row("torchao", "torchao", 8, None, reason="no CUDA"),
        table_row("deepspeed", "deepspeed", 8, None, reason="ConfigError: does not fit:\n  GPU | needs 2 GiB\nfix"),
        table_row("slidekit (resident all)", "slidekit", 16, 500.0),
        table_row("HF (GC)", "no_offload", 16, 100.0),
        table_row("slidekit (resident all)", "slidekit", 8, 900.0, clip=1.0),
    ]
    add_ratios(rows)
    assert (rows[0]["vs_no_offload"], rows[0]["vs_torchao"]) == (1.5, None)
    assert rows[4]["vs_no_offload"] == 5.0 and "vs_torchao" not in rows[4]
    assert "vs_no_offload" not in rows[6]  # no HF run with clipping
    found = {(c.label, c.clip, c.batch): c for c in cells(rows)}
    assert found[("slidekit (resident all)", None, 8)].vs_best == (1.5, "HF (GC)")
    assert found[("slidekit (resident all)", 1.0, 8)].vs_best is None
    table = markdown_table(rows)
    assert (
        "| torchao | all | unavailable: no CUDA |" in table
        and "1.50x (HF (GC))" in table
        and "5.00x" in table
    )
    # A multi-line reason is one row: its newlines as spaces, its pipes escaped.
    assert "| deepspeed | all | unavailable: ConfigError: does not fit: GPU \\| needs 2 GiB fix |" in table
    assert all(line.startswith("|") for line in table.splitlines() if line.strip() and "deepspeed" in line)


def test_bench_options_are_pinned():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # argparse exposes no public accessor
    options = [o for a in sub.choices["bench"]._actions for o in a.option_strings if o.startswith("--")]
    assert options == [
        "--help",
        "--suite",
        "--model",
        "--batch",
        "--seq",
        "--steps",
        "--warmup",
        "--seed",
        "--baselines",
        "--clip",
        "--repeats",
        "--device",
        "--kernels",
        "--optimizer",
        "--activations",
        "--window",
        "--resident",
        "--state-tier",
        "--state-offload-tier",
        "--state-offload-fraction",
        "--offload-dir",
        "--recompute",
        "--clip-overlap",
        "--timeout",
        "--time-budget",
        "--costs",
        "--plan-only",
        "--prebuild",
        "--no-prebuild",
        "--ram-floor-gib",
        "--continue",
        "--other-host",
        "--commit",
        "--out",
        "--logs",
        "--table",
        "--baselines-dir",
    ]


def test_plan_only_prints_the_plan_and_runs_nothing(capsys, tmp_path):
    assert (
        main(
            ["bench", "--suite", "qwen2.5-7b", "--plan-only", "--time-budget", "540", "--out", str(tmp_path)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "time plan of suite qwen2.5-7b" in text and "not run: time budget" in text
    assert not list(tmp_path.iterdir())
