"""The alternatives of `slidekit bench` (slidekit/tools/baselines): one model built for every batch, whole-step
timing, clipping, out-of-memory as a batch's result with its cause, and why a system cannot run here.

The plain-HF baseline trains the tiny preset for real on the CPU (in this process, as ``python -m``
runs it); HF + Liger, torchao and DeepSpeed say why they cannot run on a machine without CUDA (or
without the package) instead of failing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import runpy
import sys

import pytest
import torch
from bench_helpers import assert_figures_of_its_steps

from slidekit.tools.bench import PRESETS, does_not_fit


def test_whole_steps_are_start_to_start_the_last_ending_at_the_drain():
    from slidekit.tools.baselines.common import whole_steps

    assert whole_steps([10.0, 10.5, 11.25], 12.0) == [0.5, 0.75, 0.75]


def test_out_of_memory_messages_are_made_short_with_their_cause():
    torch_message = (
        "CUDA out of memory. Tried to allocate 37.09 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "22.05 GiB is free. Including non-PyTorch memory, this process has 117.74 GiB memory in use."
    )
    # 64 x 1024 tokens x 151936 x 4 B = 37.09 GiB: Qwen2.5's FP32 logits.
    assert does_not_fit(torch_message, batch=64, seq=1024, vocab=151936) == (
        "does not fit in GPU memory: tried to allocate 37.09 GiB with 22.05 GiB free of 139.80 GiB "
        "(the FP32 logits: 64 x 1024 tokens x 151936 vocab x 4 B)"
    )
    assert does_not_fit(torch_message, batch=32, seq=1024, vocab=151936).endswith("free of 139.80 GiB")
    assert (
        does_not_fit("something else\nmore", batch=1, seq=1, vocab=1)
        == "does not fit in GPU memory (something else)"
    )


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
    argv = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--batch",
        "2,3",
        "--seq",
        "16",
        "--steps",
        "2",
        "--clip",
        "1.0",
    ]
    assert baseline_script("no_offload.py", *argv, "--warmup", "1") == 0
    records = _lines(capsys.readouterr().out)
    assert [(r["system"], r["status"], r["batch"]) for r in records] == [
        ("no_offload", "ok", 2),
        ("no_offload", "ok", 3),
    ]
    assert records[0]["setup_s"] == records[1]["setup_s"] > 0  # one build, shared
    for r in records:
        assert r["setup_shared_by"] == [2, 3] and r["max_grad_norm"] == 1.0
        assert_figures_of_its_steps(r, r["batch"], 16, steps=2)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["peak_rss_scope"] == ("batch" if sys.platform == "linux" else "process")
        assert r["peak_host_rss_gib"] > 0 and r["wall_s"] > 0
    # The first batch trains from the random init: cross-entropy of random weights on random tokens.
    assert records[0]["losses"][0] == pytest.approx(math.log(PRESETS["tiny"]["vocab_size"]), abs=0.2)


@pytest.mark.parametrize("flags", [(), ("--gradient-checkpointing",)])
def test_liger_says_why_it_cannot_run_here(baseline_script, capsys, flags):
    argv = ["--model", "tiny", "--device", "cpu", "--batch", "2,3", *flags]
    assert baseline_script("liger.py", *argv) == 0
    records = _lines(capsys.readouterr().out)
    system = "liger_gc" if flags else "liger"
    assert [(r["system"], r["status"], r["batch"]) for r in records] == [
        (system, "unavailable", 2),
        (system, "unavailable", 3),
    ]
    if importlib.util.find_spec("liger_kernel") is None:
        assert (
            records[0]["reason"]
            == "liger-kernel not installed (pip install liger-kernel, or slidekit[bench])"
        )
    else:
        assert records[0]["reason"] == "Liger Kernel's Triton kernels need a CUDA device; this run is on cpu"


@pytest.mark.parametrize(
    ("script", "flags"), [("torchao_offload.py", ()), ("deepspeed_offload.py", ("--offload-ratio", "0.5"))]
)
def test_the_offload_alternatives_say_why_they_cannot_run_here(baseline_script, capsys, script, flags):
    assert baseline_script(script, "--model", "qwen2.5-7b", "--device", "cpu", "--batch", "8,16", *flags) == 0
    records = _lines(capsys.readouterr().out)
    assert [(r["status"], r["batch"]) for r in records] == [("unavailable", 8), ("unavailable", 16)]
    assert all(
        re.search(r"not installed|cannot be imported|needs a CUDA device", r["reason"]) for r in records
    )
    assert all(r["system"] == ("deepspeed_partial" if flags else "torchao") for r in records)


@pytest.mark.parametrize("stop", [None, "not run: the engine is mid-step"])
def test_out_of_memory_at_one_batch_is_that_batch_s_result(capsys, stop):
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
    assert records[1]["reason"] == "does not fit in GPU memory: tried to allocate 2.00 GiB"
    assert cleaned == [3]
    if stop:
        assert records[2]["reason"] == stop
