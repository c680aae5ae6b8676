"""Data-parallel metrics count the same thing: ``tokens`` and ``tflops`` are every rank's (gloo, CPU).

Two ranks train the tiny model with a run directory; rank 0 writes metrics.jsonl. Each step's
``tokens`` is the whole step's (both ranks' micro-batches, as many as one process with twice the
accumulation takes), ``tflops`` the model FLOPs of those tokens over the step's seconds, and
``tflops_per_rank`` that divided by the two ranks. One process taking the same global batch reports
the same tokens, and its ``tflops_per_rank`` is its ``tflops``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from dp_ranks import Job, run_ranks, train

from slidekit import ModelConfig, Plugins, TrainConfig
from slidekit.resolve import resolve_spec
from slidekit.telemetry import model_flops

SEQ = 16


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tflops_count_every_rank_as_tokens_do(tiny_model, tmp_path):
    model = tiny_model("llama")
    job = Job(model_dir=str(model), ranks=2, steps=2, micro=2, seq_len=SEQ)
    for world in (1, 2):
        run = {"dir": str(tmp_path / f"world-{world}")}
        for outcome in run_ranks(train, world, dataclasses.replace(job, run=run)):
            outcome.ok()
    spec, _, _ = resolve_spec(TrainConfig(model=ModelConfig(source=str(model))), Plugins())
    one, two = _rows(tmp_path / "world-1"), _rows(tmp_path / "world-2")
    assert len(one) == len(two) == 2
    for single, dp in zip(one, two, strict=True):
        both = 2 * job.micro * job.batch * SEQ  # both ranks' micro-batches, or the one process's
        assert dp["tokens"] == single["tokens"] == both
        for row, ranks in ((dp, 2), (single, 1)):
            whole = model_flops(spec, int(row["tokens"]), SEQ) / row["seconds"] / 1e12
            assert row["tflops"] == pytest.approx(whole, rel=1e-12)
            assert row["tflops_per_rank"] == pytest.approx(whole / ranks, rel=1e-12)
            assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-12)
