"""`slidekit bench`: runs in subprocesses, records and ratios, unavailable alternatives, FLOPs, presets.

The end-to-end test runs the tiny preset on the CPU through the command line:
slidekit and the no-offload baseline for real (2 timed steps each), torchao
and DeepSpeed as alternatives that cannot run here (not installed, or no
CUDA) and must say so instead of failing. A baseline script measures several
batch sizes on one model (run in this process on the CPU), the host-RAM guard
refuses a model too big for the (patched) free RAM with both numbers and
without building anything, and ``bench`` keeps the lines a baseline printed
before it crashed or was killed (fake scripts through ``--baselines-dir``).
The rest checks the pieces with hand computations: model FLOPs, parameter
counts of every preset against the published sizes (from the ArchSpec, no
weights), lane metrics, run failures, the peak-RSS reset.
"""

from __future__ import annotations

import functools
import json
import math
import re
import runpy
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from slidekit import telemetry
from slidekit.cli import build_parser, main
from slidekit.models.base import ArchSpec
from slidekit.tools import bench as bench_module
from slidekit.tools.bench import (
    PRESETS,
    add_ratios,
    arch_spec,
    bench,
    hf_config,
    lane_metrics,
    markdown_table,
    peak_rss_gib,
    run_child,
    stream_child,
    throughput,
)

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
RECORD_KEYS |= {"model_tflops", "peak_gpu_gib", "peak_host_rss_gib", "wall_s", "losses", "step_seconds"}
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
        _assert_figures_of_its_steps(r, 2, 32, steps=2)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["peak_gpu_gib"] is None  # CPU run

    sk = rows["slidekit"]
    assert set(sk) >= SLIDEKIT_KEYS
    assert sk["resident_units"] == "0/6"  # forced full offload: every unit slides
    for key in ("t_fwd_s", "t_bwd_s", "t_d2h_s", "t_update_s", "eta", "gpu_busy"):
        assert sk[key] > 0, key
    # 4 layers; both are roundings of the same median (lanes_s to 1e-4 s, t_bwd_s to 1e-6 s), so they
    # differ by at most 5e-5 / 4 + 5e-7 s, whatever the timings were.
    assert sk["t_bwd_s"] == pytest.approx(sk["lanes_s"]["bwd"] / 4, abs=2e-5)
    for system in ("slidekit", "no_offload"):  # cross-entropy of random weights on random tokens
        assert rows[system]["losses"][0] == pytest.approx(math.log(PRESETS["tiny"]["vocab_size"]), abs=0.2)

    # The ratio of the two recorded throughputs, rounded as add_ratios rounds it: exact, however fast each ran.
    assert sk["vs_no_offload"] == round(sk["tokens_per_s"] / rows["no_offload"]["tokens_per_s"], 3)
    assert sk["vs_torchao"] is None and sk["vs_deepspeed"] is None
    for system in ("torchao", "deepspeed"):  # why: not installed, or no CUDA in a --device cpu run
        assert rows[system]["status"] == "unavailable"
        assert re.search(r"not installed|cannot be imported|needs a CUDA device", rows[system]["reason"])

    text = table.read_text()
    assert text in capsys.readouterr().out
    slidekit_line = next(line for line in text.splitlines() if line.startswith("| slidekit"))
    assert f"{sk['vs_no_offload']:.2f}x" in slidekit_line
    assert "unavailable: " + rows["torchao"]["reason"] in text


def _assert_figures_of_its_steps(record: dict, batch: int, seq: int, *, steps: int) -> None:
    """The record's figures are ``throughput`` of the step times it recorded: exact, whatever they were."""
    assert len(record["step_seconds"]) == steps and all(s > 0 for s in record["step_seconds"])
    figures = throughput(arch_spec(record["model"], seq), batch, seq, record["step_seconds"])
    assert {k: record[k] for k in figures} == figures


def _hanging_child(marker: Path, *, prints: str = "") -> list[str]:
    """A child that prints the line ``prints`` (if any) at once, then sleeps 120 s, then creates ``marker``.

    A shell, so the line comes out as soon as the process starts (no interpreter start-up before it).
    ``marker`` missing after a run proves the child was killed before it could end by itself, with no
    assumption on how soon after its deadline the kill came (``wall_s`` depends on the machine's load).
    """
    script = '[ -z "$1" ] || printf "%s\\n" "$1"; sleep 120; touch "$2"'
    return ["/bin/sh", "-c", script, "sh", prints, str(marker)]


def test_a_run_that_fails_or_hangs_becomes_unavailable_with_its_reason(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('ValueError: bad shape', file=sys.stderr); sys.exit(3)"]
    record = run_child(crash, timeout=60, log=tmp_path / "crash.log")
    assert record["status"] == "unavailable"
    assert record["reason"] == "exit code 3: ValueError: bad shape"
    assert "bad shape" in (tmp_path / "crash.log").read_text()
    record = run_child(_hanging_child(tmp_path / "ended"), timeout=1)
    assert record["status"] == "unavailable" and record["reason"].startswith("timed out after 1 s")
    assert record["wall_s"] >= 1.0  # it had its second
    assert not (tmp_path / "ended").exists()  # and was killed, not waited for


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


@functools.cache
def _tiny_spec() -> ArchSpec:
    return arch_spec("tiny")


@example(seconds=[0.031765, 0.031765], batch=3, seq=16)  # 1511.1 tokens/s, but 48 / 0.0318 = 1509.4
@given(
    seconds=st.lists(st.floats(1e-4, 1e4), min_size=1, max_size=7),
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


# ---------------------------------------------------------------------------- baselines over several batches


@pytest.fixture
def baseline_script(monkeypatch):
    """``run(script, *argv)``: run the bundled baseline slidekit.tools.baselines.<script> in this process,
    as ``python -m`` does; its exit code."""

    def run(script: str, *argv: str) -> int:
        monkeypatch.setattr(sys, "argv", [script, *argv])
        try:
            runpy.run_module(f"slidekit.tools.baselines.{script.removesuffix('.py')}", run_name="__main__")
        except SystemExit as exc:
            return int(exc.code or 0)
        return 0

    yield run


def _lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_baseline_builds_once_and_prints_a_record_per_batch(baseline_script, capsys):
    argv = ["--model", "tiny", "--device", "cpu", "--batch", "2,3", "--seq", "16", "--steps", "2"]
    assert baseline_script("no_offload.py", *argv, "--warmup", "1") == 0
    records = _lines(capsys.readouterr().out)
    assert [(r["system"], r["status"], r["batch"]) for r in records] == [
        ("no_offload", "ok", 2),
        ("no_offload", "ok", 3),
    ]
    assert records[0]["setup_s"] == records[1]["setup_s"] > 0  # one build, shared
    for r in records:
        assert r["setup_shared_by"] == [2, 3]
        _assert_figures_of_its_steps(r, r["batch"], 16, steps=2)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["peak_rss_scope"] == ("batch" if sys.platform == "linux" else "process")
        assert r["peak_host_rss_gib"] > 0 and r["wall_s"] > 0
    # The first batch trains from the random init: cross-entropy of random weights on random tokens.
    assert records[0]["losses"][0] == pytest.approx(math.log(PRESETS["tiny"]["vocab_size"]), abs=0.2)


@pytest.mark.parametrize("stop", [None, "not run: the engine is mid-step"])
def test_out_of_memory_at_one_batch_is_that_batch_s_result(baseline_script, capsys, stop):
    from slidekit.tools.baselines import common

    cleaned = []

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if inputs.shape[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return torch.tensor(1.0)

    def after_oom(batch: int) -> str | None:
        cleaned.append(batch)
        return stop

    args = common.parser("test").parse_args(
        ["--batch", "2,3,4", "--seq", "8", "--steps", "1", "--warmup", "0"]
    )
    common.run_batches("fake", args, torch.device("cpu"), step, setup_s=1.5, after_oom=after_oom)
    records = _lines(capsys.readouterr().out)
    assert [(r["batch"], r["status"]) for r in records] == [
        (2, "ok"),
        (3, "unavailable"),
        (4, "unavailable" if stop else "ok"),
    ]
    assert (
        records[1]["reason"] == "does not fit in GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB)"
    )
    assert cleaned == [3]
    if stop:
        assert records[2]["reason"] == stop


@pytest.mark.parametrize(
    ("script", "need"),
    [
        ("torchao_offload.py", "~145 GiB of host RAM (20.2 B/param"),  # 7.616 G x 20.2 B = 143.3 GiB + 2
        ("deepspeed_offload.py", "~165 GiB of host RAM (23 B/param"),  # 7.616 G x 23 B = 163.1 GiB + 2
    ],
)
def test_the_host_ram_guard_refuses_a_model_too_big_for_free_ram(
    baseline_script, monkeypatch, capsys, script, need
):
    from slidekit.tools.baselines import common

    monkeypatch.setattr(common, "mem_available_bytes", lambda: 100 * 2**30)
    monkeypatch.setattr(common, "build_model", lambda *a, **k: pytest.fail("built a model"))
    argv = ["--model", "qwen2.5-7b", "--device", "cpu", "--batch", "8,16"]
    assert baseline_script(script, *argv) == 0
    records = _lines(capsys.readouterr().out)
    assert [(r["status"], r["batch"]) for r in records] == [("unavailable", 8), ("unavailable", 16)]
    for r in records:
        assert need in r["reason"] and "but 100 GiB is available" in r["reason"], r["reason"]
        assert "--force" in r["reason"]
    # --force skips the guard: the run goes on to its next check (no torchao/deepspeed, or no CUDA).
    assert baseline_script(script, *argv, "--force") == 0
    forced = _lines(capsys.readouterr().out)
    assert len(forced) == 2 and all("host RAM" not in r["reason"] for r in forced)


def test_host_ram_estimate_and_its_limits(baseline_script):
    from slidekit.tools.baselines import common

    params = arch_spec("qwen2.5-3b").num_params
    need = 20.2 * params / 2**30 + 2.0  # 60.1 GiB
    assert common.host_ram_shortfall("torchao", "qwen2.5-3b", int((need + 0.5) * 2**30)) is None
    reason = common.host_ram_shortfall("torchao", "qwen2.5-3b", int((need - 1) * 2**30))
    assert (
        reason is not None and f"~{need:.0f} GiB" in reason and f"{need - 1:.0f} GiB is available" in reason
    )
    assert common.host_ram_shortfall("torchao", "qwen2.5-3b", None) is None  # no /proc/meminfo: no guess
    assert (
        common.host_ram_shortfall("no_offload", "mistral-small-24b", 1) is None
    )  # keeps nothing on the host


# ---------------------------------------------------------------------------- bench over a baseline's lines


def _fake_script(path: Path, body: str) -> None:
    path.write_text("import json, sys, time\n" + textwrap.dedent(body))


def _fake_record(system: str, batch: int, tokens_per_s: float) -> str:
    record = {"system": system, "status": "ok", "batch": batch, "tokens_per_s": tokens_per_s}
    record |= {"model_tflops": 1.0, "median_step_s": batch * 16 / tokens_per_s}
    return json.dumps(record)


def test_bench_keeps_the_lines_of_a_baseline_that_crashed_and_says_why_for_the_rest(
    tmp_path, monkeypatch, capsys
):
    out = tmp_path / "bench.jsonl"
    out.write_text('{"earlier": "run"}\n')
    # slidekit: a fake run per batch, 1000 tokens/s x batch.
    monkeypatch.setattr(
        bench_module,
        "_slidekit_cmd",
        lambda args, batch, resident: [
            sys.executable,
            "-c",
            f"print({_fake_record('slidekit', batch, 1000.0 * batch)!r})",
        ],
    )
    _fake_script(
        tmp_path / "no_offload.py",
        f"""
        print({_fake_record("no_offload", 2, 500.0)!r}, flush=True)
        print({_fake_record("no_offload", 3, 600.0)!r}, flush=True)
        """,
    )
    # torchao: batch 2's line, then (once bench has appended that row to --out) a crash. Should the row
    # never be appended while the run goes on, bench kills it at --timeout and the reason says so.
    _fake_script(
        tmp_path / "torchao_offload.py",
        f"""
        print("starting up")
        print({_fake_record("torchao", 2, 400.0)!r}, flush=True)
        while '"system": "torchao"' not in open({str(out)!r}).read():
            time.sleep(0.05)
        print("RuntimeError: boom", file=sys.stderr)
        sys.exit(3)
        """,
    )
    argv = ["bench", "--model", "tiny", "--batch", "2,3", "--seq", "16", "--resident", "none"]
    argv += ["--timeout", "60"]  # per batch: torchao's run is killed after 120 s at most
    argv += ["--baselines", "none,torchao", "--baselines-dir", str(tmp_path), "--out", str(out)]
    rows = bench(build_parser().parse_args(argv))

    assert [(r["system"], r["batch"], r["status"]) for r in rows] == [
        ("slidekit", 2, "ok"),
        ("no_offload", 2, "ok"),
        ("torchao", 2, "ok"),
        ("slidekit", 3, "ok"),
        ("no_offload", 3, "ok"),
        ("torchao", 3, "unavailable"),
    ]
    assert rows[5]["reason"] == "no line for batch 3; exit code 3: RuntimeError: boom"
    sk2, sk3 = rows[0], rows[3]
    assert (sk2["vs_no_offload"], sk2["vs_torchao"]) == (4.0, 5.0)  # 2000 / 500, 2000 / 400
    assert (sk3["vs_no_offload"], sk3["vs_torchao"]) == (5.0, None)  # 3000 / 600, no torchao result
    lines = out.read_text().splitlines()
    assert lines[0] == '{"earlier": "run"}'  # what was there stays; this run's rows appear once
    assert [json.loads(line) for line in lines[1:]] == rows
    progress = capsys.readouterr().err
    assert "torchao batch 3: unavailable: no line for batch 3; exit code 3" in progress


def test_a_killed_run_keeps_the_records_it_printed(tmp_path):
    seen = []
    child = _hanging_child(tmp_path / "ended", prints='{"status": "ok", "batch": 2}')
    run = stream_child(child, timeout=2, on_record=seen.append)
    assert run.returncode is None and run.failure.startswith("timed out after 2 s")
    assert run.records == seen == [{"status": "ok", "batch": 2}]
    assert run.wall_s >= 2.0 and not (tmp_path / "ended").exists()  # killed at its deadline, not waited for


# ---------------------------------------------------------------------------- the peak-RSS reset


def _vm_hwm() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and /proc/self/clear_refs are Linux's")
def test_reset_peak_rss_starts_the_peak_over():
    assert telemetry.reset_peak_rss()
    before = _vm_hwm()
    block = b"\x01" * (200 * 2**20)  # written, so every page is resident
    assert _vm_hwm() >= before + 190 * 2**20
    del block
    assert telemetry.reset_peak_rss()
    assert _vm_hwm() < before + 50 * 2**20  # the 200 MB are no longer in the peak
    assert peak_rss_gib() == pytest.approx(_vm_hwm() / 2**30, abs=0.01)  # the records read VmHWM


def test_reset_peak_rss_says_so_where_it_cannot(monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(telemetry, "open", refuse, raising=False)  # the module's own open()
    assert telemetry.reset_peak_rss() is False
