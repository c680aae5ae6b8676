"""Telemetry: the FLOP formula by hand, memory readings, the progress bar, and the Chrome trace of a fit.

The trace tests run short CPU fits of the embedded demo model and check the
file against what the engine itself reported: every lane it ran has a span
for every unit it ran on, the spans of each row never overlap, and the
main-thread lanes add up to exactly the per-step lane totals of the metrics.
"""

from __future__ import annotations

import itertools
import json
import math
import resource
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from slidekit import DataConfig, EngineConfig, OptimConfig, Plugins, RunConfig, TrainConfig, Trainer
from slidekit.config import from_dict
from slidekit.errors import ConfigError
from slidekit.telemetry import (
    BACKWARD_WINDOW,
    FLOPS_FORMULA,
    GIB,
    Progress,
    Timeline,
    host_rss_bytes,
    matmul_params,
    memory_metrics,
    model_flops,
    step_tflops,
)
from slidekit.testing.models import tiny_config
from slidekit.trace import TraceWriter, rank_path

#: Lanes timed entirely inside Engine.train_step: their trace spans add up to the step totals exactly.
IN_STEP_LANES = ("fwd", "head", "bwd", "stall", "act_load", "h2d", "update_gpu")


def _spec(**overrides):
    return (
        Plugins()
        .adapter_for("llama")
        .descriptor.factory(tiny_config("llama", attention_bias=False, **overrides))
    )


def test_model_flops_by_hand_the_embedding_lookup_counts_zero():
    spec = _spec()
    # vocab 128, hidden 64, intermediate 96, 3 layers, 4 heads of 16 over 2 KV heads, untied head
    layer = 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 64 + 3 * (64 * 96)
    params = 128 * 64 + 3 * layer + 64 + 128 * 64
    assert spec.num_params == params == 108992 and not spec.tie_embeddings
    # The input embedding (128 x 64) is a lookup: only the layers, the final norm and the LM head count.
    assert matmul_params(spec) == 3 * layer + 64 + 128 * 64 == 100800
    tokens, seq = 2 * 16, 16
    assert model_flops(spec, tokens, seq) == 6 * 100800 * 32 + 12 * 3 * (4 * 16) * 16 * 32 == 20533248


def test_model_flops_by_hand_a_tied_head_keeps_its_matmul():
    spec = _spec(tie_word_embeddings=True)
    layer = 64 + 64 * 64 + 2 * (32 * 64) + 64 * 64 + 64 + 3 * (64 * 96)
    # One 128 x 64 matrix, stored once: the lookup is free, the LM head's matmul with it is not.
    assert spec.tie_embeddings and spec.num_params == 128 * 64 + 3 * layer + 64 == 100800
    assert matmul_params(spec) == spec.num_params
    tokens, seq = 3 * 8, 8
    assert model_flops(spec, tokens, seq) == 6 * 100800 * 24 + 12 * 3 * (4 * 16) * 8 * 24 == 14957568
    assert "lookup, not a matmul" in FLOPS_FORMULA  # the formula the records and docs state


def test_step_tflops_are_the_whole_runs_and_its_share_per_rank():
    assert step_tflops(6e12, 2.0, ranks=4) == {"tflops": 3.0, "tflops_per_rank": 0.75}
    assert step_tflops(6e12, 2.0) == {"tflops": 3.0, "tflops_per_rank": 3.0}
    assert step_tflops(6e12, 0.0, ranks=2) == {"tflops": 0.0, "tflops_per_rank": 0.0}
    with pytest.raises(ValueError, match="ranks must be 1 or more, got 0"):
        step_tflops(1.0, 1.0, ranks=0)


def test_host_rss_agrees_with_the_kernel():
    vmrss = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    kernel = int(vmrss.split()[1]) * 1024
    assert abs(host_rss_bytes() - kernel) < 0.1 * kernel
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 0 < host_rss_bytes() <= peak * 1.01
    import torch

    got = memory_metrics(torch.device("cpu"))
    assert set(got) == {"host_rss_gib"} and got["host_rss_gib"] == pytest.approx(kernel / GIB, rel=0.1)


def test_progress_shows_throughput_and_memory(capsys):
    base = {"loss": 2.5, "tokens_per_s": 1234.0, "tflops": 0.0123, "host_rss_gib": 3.21}
    assert Progress.postfix(base) == {"loss": "2.5000", "tok_s": "1234", "tflops": "0.0123", "rss": "3.2GiB"}
    assert Progress.postfix({**base, "gpu_mem_gib": 40.04})["gpu"] == "40.0GiB"
    bar = Progress(1, enabled=True)
    bar.update({**base, "gpu_mem_gib": 40.04})
    bar.close()
    err = capsys.readouterr().err
    assert "tflops=0.0123" in err and "gpu=40.0GiB" in err and "rss=3.2GiB" in err


def test_timeline_totals_are_unchanged_by_span_recording():
    tl = Timeline(cuda=False)
    tl.record_spans(True)
    with tl.host("update", 3):
        pass
    with tl.device("bwd", 2, None):
        pass
    spans = tl.take_spans()
    totals = tl.finish()
    assert [(s.lane, s.unit, s.device) for s in spans] == [("update", 3, False), ("bwd", 2, False)]
    lanes = {s.lane: s.end - s.start for s in spans}
    assert {k: totals[k] for k in lanes} == lanes
    assert totals["bwd_window"] == totals["bwd_busy"] == lanes["bwd"]  # one backward span: all of it busy
    assert tl.take_spans() == [] and tl.finish() == {}
    tl.record_spans(False)
    with tl.host("update", 1):
        pass
    assert tl.take_spans() == [] and set(tl.finish()) == {"update"}


class FakeClock:
    """A clock that stands still until the test moves it: spans of exactly the seconds given."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backward_window_counts_compute_between_the_first_and_last_backward_span():
    clock = FakeClock()
    tl = Timeline(cuda=False, clock=clock)
    with tl.device("fwd", 0, None):  # before the backward: not in the window
        clock.now += 2.0
    with tl.device("bwd", 1, None):
        clock.now += 2.0
    with tl.host("update", 1):  # another lane (the optimizer's thread): not GPU work
        clock.now += 3.0
    with tl.device("update_gpu", 0, None):  # a resident unit's update between backward spans: busy
        clock.now += 1.0
    clock.now += 0.5  # nothing runs
    with tl.device("bwd", 0, None):
        clock.now += 2.0
    totals = tl.finish()
    assert (totals["fwd"], totals["bwd"], totals["update"], totals["update_gpu"]) == (2.0, 4.0, 3.0, 1.0)
    assert totals["bwd_busy"] == totals["bwd"] + totals["update_gpu"]
    # From the first backward span's start to the last one's end: the idle update and gap are in it.
    assert totals["bwd_window"] == 2.0 + 3.0 + 1.0 + 0.5 + 2.0


def test_run_trace_is_a_validated_config_field(tmp_path):
    with pytest.raises(ConfigError, match=r"run.trace must be a file path"):
        RunConfig(trace=" ")
    cfg = TrainConfig(run=RunConfig(trace="t.json"))
    assert cfg.to_dict()["run"]["trace"] == "t.json" and from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="is a directory"):
        TraceWriter(tmp_path, Timeline(cuda=False))


def test_each_rank_has_its_own_trace_file():
    assert rank_path("out/t.json", 0) == Path("out/t.json")
    assert rank_path("out/t.json", 3) == Path("out/t.rank3.json")
    assert rank_path("trace", 1) == Path("trace.rank1") and rank_path("a.b.json.gz", 2) == Path("a.b.json.rank2.gz")


def _config(trace: Path, *, resident: str, run_dir: Path | None = None, steps: int = 3) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu", gpu_resident=resident, activation_tier="ram"),
        run=RunConfig(dir=str(run_dir) if run_dir else None, checkpoint_every=2, trace=str(trace)),
        grad_accum=2,
        steps=steps,
    )


def _spans(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]


def _expected_units(lane: str, layers: int, resident: set[int], micro: int) -> Counter[int] | None:
    """Spans per unit and step of ``lane``, where the schedule fixes them (None: it does not)."""
    units = range(layers + 2)
    streamed = [u for u in units if u not in resident]
    fixed: dict[str, Counter[int]] = {
        "fwd": Counter(range(layers + 1)),
        "head": Counter([layers + 1]),
        "bwd": Counter({0: 1, **{u: micro for u in range(1, layers + 1)}}),
        "act_load": Counter({u: micro for u in range(1, layers + 1)}),
        "stall": Counter({0: 1, layers + 1: 1, **{u: 2 for u in range(1, layers + 1)}}),
        "d2h": Counter(streamed),
        "d2h_copy": Counter(streamed),
        "update": Counter(streamed),
        "update_gpu": Counter(sorted(resident)),
    }
    return fixed.get(lane)


@pytest.mark.parametrize("resident", ["none", "0.5"])
def test_trace_of_a_fit_covers_every_lane_and_unit(tmp_path, resident):
    trace = tmp_path / "out" / "trace.json"
    steps, micro = 3, 2
    with Trainer(_config(trace, resident=resident, run_dir=tmp_path / "run", steps=steps)) as t:
        layers, on_device = t.spec.num_layers, set(t.engine.window.resident)
        result = t.fit()
    assert (resident == "none") == (not on_device)
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"]
    spans = _spans(doc)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}

    # Well-formed complete events, each on a named row, named after its lane and unit.
    for e in [*spans, *(e for e in events if e["ph"] == "X")]:
        assert e["ts"] >= 0 and e["dur"] >= 0 and (e["pid"], e["tid"]) in names
    assert all(e["name"] == f"{e['cat']} {e['args']['unit']}" for e in spans)

    # Every lane the engine ran has its spans for every unit of the schedule, every step.
    lanes = {lane for timings in result.timings for lane in timings} - set(BACKWARD_WINDOW)
    assert lanes == {e["cat"] for e in spans}
    by_lane: dict[str, Counter[int]] = defaultdict(Counter)
    for e in spans:
        by_lane[e["cat"]][e["args"]["unit"]] += 1
    all_units = set(range(layers + 2))
    for lane in lanes:
        want = _expected_units(lane, layers, on_device, micro)
        if want is not None:
            assert by_lane[lane] == Counter({u: n * steps for u, n in want.items()}), lane
        else:
            assert set(by_lane[lane]) <= all_units, lane
    assert set(by_lane["h2d"]) == all_units - on_device  # each streamed unit is uploaded anew every step
    assert "checkpoint_wait" in lanes  # the updates after the checkpoint of step 2 waited on it

    # No row holds overlapping spans.
    rows: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            rows[(e["pid"], e["tid"])].append(e)
    for row in rows.values():
        row.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(row):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (names[(a["pid"], a["tid"])], a, b)

    # Lanes timed inside the step add up to the step totals; the rest lag into later steps or the end.
    for lane in lanes:
        traced = sum(e["dur"] for e in spans if e["cat"] == lane) / 1e6
        reported = sum(timings.get(lane, 0.0) for timings in result.timings)
        if lane in IN_STEP_LANES:
            assert traced == pytest.approx(reported, abs=1e-8 * len(spans)), lane
        else:
            assert traced >= reported - 1e-8 * len(spans), lane

    # Step rows carry the losses; compute spans lie inside their step.
    marks = sorted((e for e in events if e["ph"] == "X" and e["cat"] == "step"), key=lambda e: e["ts"])
    assert [m["args"]["step"] for m in marks] == [1, 2, 3]
    assert [m["args"]["loss"] for m in marks] == result.losses
    for e in spans:
        if e["cat"] in ("fwd", "head", "bwd"):
            assert any(m["ts"] <= e["ts"] and e["ts"] + e["dur"] <= m["ts"] + m["dur"] + 1e-3 for m in marks)


def test_metrics_carry_flops_and_memory(tmp_path):
    with Trainer(_config(tmp_path / "t.json", resident="none", run_dir=tmp_path / "run", steps=2)) as t:
        spec = t.spec
        t.fit()
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        flops = model_flops(spec, int(row["tokens"]), 32)
        assert row["tflops"] == pytest.approx(flops / row["seconds"] / 1e12, rel=1e-12)
        assert row["tflops_per_rank"] == row["tflops"]  # one process: the run is its one rank
        assert 0.01 < row["host_rss_gib"] < 1024 and "gpu_mem_gib" not in row
        assert math.isfinite(row["t_fwd"]) and row["t_fwd"] > 0


@pytest.mark.parametrize("resident", ["none", "all"])
def test_metrics_name_the_hiding_factor_what_it_is(tmp_path, resident):
    """metrics.jsonl's ``hiding_factor`` (once ``eta``) is T_bwd / (T_d2h + T_update) of the step's own lanes;
    a step that sent nothing to the host (every unit resident) has none."""
    run = tmp_path / "run"
    with Trainer(_config(tmp_path / "t.json", resident=resident, run_dir=run, steps=2)) as t:
        t.fit()
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert "eta" not in row
        lanes = {k[2:]: v for k, v in row.items() if k.startswith("t_")}
        if resident == "all":
            assert "hiding_factor" not in row and "update" not in lanes
        else:
            cpu = lanes.get("d2h_copy", lanes.get("d2h", 0.0)) + lanes["update"]
            assert row["hiding_factor"] == pytest.approx(lanes["bwd"] / cpu, rel=1e-12) and cpu > 0


def test_trace_is_written_when_fit_fails(tmp_path):
    calls = Counter()

    def hook(lane: str) -> None:
        calls[lane] += 1
        if lane == "optim" and calls[lane] == 9:  # an update of the second step
            raise OSError("injected failure")

    trace = tmp_path / "trace.json"
    trainer = Trainer(_config(trace, resident="none"), fault_hook=hook)
    with pytest.raises(OSError, match="injected failure"):
        trainer.fit()
    doc = json.loads(trace.read_text())
    assert doc["otherData"]["error"] == "OSError: injected failure"
    marks = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    assert len(marks) >= 1 and {"fwd", "bwd", "update"} <= {e["cat"] for e in _spans(doc)}
