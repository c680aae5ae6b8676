"""``slidekit report``: a PNG of a run's loss curve and the timeline of one step, with or without a trace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slidekit import DataConfig, EngineConfig, OptimConfig, RunConfig, TrainConfig, Trainer
from slidekit.cli import main
from slidekit.errors import ConfigError
from slidekit.telemetry import Span
from slidekit.tools import report as report_module
from slidekit.tools.report import (
    DPI,
    FIGSIZE,
    draw_report,
    find_trace,
    load_metrics,
    report_figure,
    step_window,
)
from slidekit.trace import trace_events

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step CPU run of the demo model with evaluation, metrics and a trace in its run directory."""
    run = tmp_path_factory.mktemp("traced") / "run"
    cfg = TrainConfig(
        data=DataConfig(seq_len=32, batch_size=2, eval_fraction=0.05, eval_every=2),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(device="cpu", gpu_resident="none"),
        run=RunConfig(dir=str(run), trace=str(run / "trace.json")),
        steps=3,
    )
    with Trainer(cfg) as t:
        t.fit()
    return run


def _copy_without_trace(run: Path, dest: Path) -> Path:
    dest.mkdir()
    shutil.copy(run / "metrics.jsonl", dest / "metrics.jsonl")
    return dest


def _assert_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(path).shape[:2] == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI))


def test_report_with_a_trace_draws_the_timeline_of_a_step(traced_run, tmp_path):
    out = draw_report(traced_run, tmp_path / "nested" / "r.png")
    assert out == tmp_path / "nested" / "r.png"
    _assert_png(out)

    events = json.loads((traced_run / "trace.json").read_text())["traceEvents"]
    window = step_window(events)
    assert window is not None and window.step == 3  # the last step
    units = 1 + max(e["args"]["unit"] for e in events if e["ph"] == "X" and e["cat"] != "step")
    last_updates = sorted((e for e in events if e.get("cat") == "update"), key=lambda e: e["ts"])[-units:]
    assert all(window.start <= e["ts"] and e["ts"] + e["dur"] <= window.end for e in last_updates)
    fig = report_figure(traced_run)
    loss_ax, timeline_ax = fig.axes[0], fig.axes[1]  # then the twin axis of tokens/s
    assert timeline_ax.get_title().startswith("step 3 and the updates it queued")
    lanes = {t.get_text() for t in timeline_ax.get_yticklabels()}
    assert {"fwd", "head", "bwd", "h2d", "d2h", "update", "stall"} <= lanes
    inside = [
        e
        for e in events
        if e["ph"] == "X"
        and e["cat"] != "step"
        and e["ts"] < window.end
        and e["ts"] + e["dur"] > window.start
    ]
    assert len(timeline_ax.collections) == len(inside)  # one bar per span in the window
    # A bar carries its unit when it is wide enough: which ones are depends on this run's timings, so
    # the labels are checked against the bars' recorded widths (the rule itself: the test below).
    length = window.end - window.start
    wide = [
        str(e["args"]["unit"])
        for e in inside
        if min(e["ts"] + e["dur"], window.end) - max(e["ts"], window.start)
        >= report_module._LABEL_MIN * length
    ]
    assert sorted(t.get_text() for t in timeline_ax.texts) == sorted(wide)
    rows = load_metrics(traced_run)
    eval_points = loss_ax.collections[0].get_offsets()
    assert [tuple(p) for p in eval_points] == [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]


def test_bars_wide_enough_carry_their_unit(tmp_path):
    """A trace of known times: the layers' bars (8% of the window each) are labelled, a 0.5% one is not."""
    spans = [
        Span("fwd", unit, 0.01 * unit, 0.01 * unit + 0.008, "MainThread", False) for unit in (1, 2, 3, 4)
    ]
    spans.append(Span("stall", 5, 0.06, 0.0605, "MainThread", False))
    spans.append(Span("update", 6, 0.07, 0.09, "slidekit-optim_0", False))  # lags the step: still in
    steps = [(1, 0.0, 0.08, {"loss": 2.0})]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": trace_events(spans, steps, 0.0, "cpu")}))
    timeline_ax = report_figure(tmp_path).axes[1]
    assert len(timeline_ax.collections) == len(spans)
    assert sorted(t.get_text() for t in timeline_ax.texts) == ["1", "2", "3", "4", "6"]


def test_report_without_a_trace_plots_lane_seconds(traced_run, tmp_path):
    run = _copy_without_trace(traced_run, tmp_path / "plain")
    assert find_trace(run) is None
    out = draw_report(run)
    assert out == run / "report.png"
    _assert_png(out)
    ax = report_figure(run).axes[1]
    assert ax.get_title().startswith("no trace")
    assert {"fwd", "bwd", "update", "step"} <= {line.get_label() for line in ax.get_lines()}


def test_trace_recorded_in_the_config_is_found(traced_run, tmp_path, monkeypatch):
    run = _copy_without_trace(traced_run, tmp_path / "elsewhere")
    (tmp_path / "traces").mkdir()
    shutil.copy(traced_run / "trace.json", tmp_path / "traces" / "t.json")
    config = json.loads((traced_run / "config.json").read_text())
    config["run"]["trace"] = "traces/t.json"  # relative to the directory the run was started from
    (run / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert find_trace(run) == tmp_path / "traces" / "t.json"
    assert report_figure(run).axes[1].get_title().startswith("step 3")


def test_metrics_rows_keep_the_last_of_each_step_and_skip_a_torn_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo'
    )
    assert [(r["step"], r["loss"]) for r in load_metrics(tmp_path)] == [(1, 3.0), (2, 1.5)]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\nnot json\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ConfigError, match="line 2, is not a metrics row"):
        load_metrics(tmp_path)


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; pass the --run-dir of a finetune run"):
        draw_report(tmp_path / "missing")
    with pytest.raises(ConfigError, match="not the run directory of a finetune run"):
        draw_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no step yet"):
        draw_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (tmp_path / "trace.json").write_text('{"traceEvents": [')
    with pytest.raises(ConfigError, match="cannot be read"):
        draw_report(tmp_path)


def test_the_cli_writes_the_report(traced_run, tmp_path, capsys):
    out = tmp_path / "cli.png"
    assert main(["report", str(traced_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    _assert_png(out)
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("slidekit: error: run directory")
