"""``slidekit report RUN_DIR``: one PNG with a run's loss curve and the timeline of one of its steps.

    slidekit finetune --run-dir runs/a --trace runs/a/trace.json --steps 20
    slidekit report runs/a                       # -> runs/a/report.png
    slidekit report runs/a --out /tmp/a.png

The top panel plots the training loss per step from ``RUN_DIR/metrics.jsonl``
(with the held-out ``eval_loss`` as points where the run evaluated) and
tokens/s on a second axis. The bottom panel draws, from the run's Chrome
trace (``RUN_DIR/trace.json``, or the ``run.trace`` path recorded in
``RUN_DIR/config.json``), one row per pipeline lane and one bar per span,
labelled by unit, over the last step of the trace: from its start until the
work it queued has ended, so it includes the gradient downloads and
optimizer updates that lag its backward pass (``step_window``).
Without a trace the bottom panel plots the seconds each lane spent per step
(the ``t_<lane>`` metrics) and its title says so.

matplotlib is imported only when drawing, and only its Agg canvas is used:
no pyplot state, no change of the process's backend.

Test: ``pytest tests/test_report.py``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidekit.errors import ConfigError
from slidekit.trace import LANE_ORDER, STEP_LANE

__all__ = [
    "DPI",
    "FIGSIZE",
    "StepWindow",
    "draw_report",
    "find_trace",
    "load_metrics",
    "report_figure",
    "step_window",
]

#: Size of the PNG: FIGSIZE inches at DPI dots per inch (1200 x 800 pixels).
FIGSIZE = (12.0, 8.0)
DPI = 100
#: A bar is labelled with its unit when it is at least this fraction of the window wide.
_LABEL_MIN = 0.012


def load_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` by step (a step logged twice, as after a resume, keeps its last row)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: {str(run_dir)!r} is not the run directory of a finetune run; "
            "train with `slidekit finetune --run-dir DIR` and report on DIR"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            by_step[int(row["step"])] = row
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if number == len(lines):  # a torn last line: the run was stopped while writing it
                continue
            raise ConfigError(
                f"{path}, line {number}, is not a metrics row ({exc}); remove the line or report on another run"
            ) from exc
    if not by_step:
        raise ConfigError(f"{path} holds no step yet; report once the run has finished a step")
    return [by_step[step] for step in sorted(by_step)]


def find_trace(run_dir: Path) -> Path | None:
    """``run_dir/trace.json`` if it exists, else the ``run.trace`` recorded in ``run_dir/config.json``
    (a relative one is looked up from the current directory, then from ``run_dir``), else None."""
    candidates = [run_dir / "trace.json"]
    try:
        recorded = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["run"]["trace"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        recorded = None
    if isinstance(recorded, str) and recorded:
        path = Path(recorded).expanduser()
        candidates += [path] if path.is_absolute() else [Path.cwd() / path, run_dir / path]
    return next((p for p in candidates if p.is_file()), None)


def _load_trace(path: Path) -> list[dict[str, Any]]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise ConfigError(
            f"the trace {path} cannot be read ({exc}); delete it to report without a timeline, "
            "or run again with --trace"
        ) from exc
    if not isinstance(events, list):
        raise ConfigError(
            f"the trace {path} holds no list of trace events; delete it or run again with --trace"
        )
    return events


#: Lanes whose work for a step may start after the step's compute is done (the optimizer lags behind).
LAGGING_LANES = frozenset({"d2h_wait", "d2h", "d2h_copy", "update", "checkpoint_wait"})


@dataclass(frozen=True, slots=True)
class StepWindow:
    """The stretch of a trace the timeline panel draws, in the trace's microseconds."""

    step: int
    start: float
    end: float


def step_window(events: list[dict[str, Any]]) -> StepWindow | None:
    """The last step in the trace, from its start until the work it started or queued has ended.

    That is every span that began during the step, and every span of a lagging
    lane (gradient downloads, optimizer updates, checkpoint waits) that began
    after it; other work after it (an evaluation) does not stretch the window.
    None when the trace marks no step.
    """
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e.get("cat") == STEP_LANE), key=lambda e: e["ts"])
    if not steps:
        return None
    chosen = steps[-1]
    start, stop = chosen["ts"], chosen["ts"] + chosen["dur"]
    end = stop
    for e in spans:
        if start <= e["ts"] and (e["ts"] < stop or e.get("cat") in LAGGING_LANES):
            end = max(end, e["ts"] + e["dur"])
    return StepWindow(int(chosen["args"]["step"]), start, end)


def _rows(events: list[dict[str, Any]]) -> list[tuple[tuple[int, int], str]]:
    """(pid, tid) and label of each lane row that holds spans, top to bottom (the step row left out)."""
    names: dict[tuple[int, int], str] = {}
    order: dict[tuple[int, int], int] = {}
    processes: dict[int, str] = {}
    process_order: dict[int, int] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        key, args = (e.get("pid", 0), e.get("tid", 0)), e.get("args", {})
        if e.get("name") == "thread_name":
            names[key] = str(args.get("name"))
        elif e.get("name") == "thread_sort_index":
            order[key] = int(args.get("sort_index", 0))
        elif e.get("name") == "process_name":
            processes[key[0]] = str(args.get("name"))
        elif e.get("name") == "process_sort_index":
            process_order[key[0]] = int(args.get("sort_index", 0))
    used = {
        (e.get("pid", 0), e.get("tid", 0)) for e in events if e.get("ph") == "X" and e.get("cat") != STEP_LANE
    }
    keys = sorted(used, key=lambda k: (process_order.get(k[0], k[0]), order.get(k, k[1]), k))
    several = len({k[0] for k in keys}) > 1
    rows = []
    for key in keys:
        label = names.get(key, f"{key[0]}/{key[1]}")
        rows.append((key, f"{processes.get(key[0], key[0])}: {label}" if several else label))
    return rows


def _lane_rank(lane: str) -> int:
    return LANE_ORDER.index(lane) if lane in LANE_ORDER else len(LANE_ORDER) + sum(map(ord, lane)) % 7


def _lane_color(lane: str, cmap: Any) -> Any:
    return cmap(_lane_rank(lane) % cmap.N)


def _draw_timeline(ax: Any, events: list[dict[str, Any]], window: StepWindow, trace: Path) -> None:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    rows = _rows(events)
    length = max(window.end - window.start, 1e-9)
    for y, (key, _) in enumerate(rows):
        for e in events:
            if e.get("ph") != "X" or (e.get("pid", 0), e.get("tid", 0)) != key:
                continue
            a, b = max(e["ts"], window.start), min(e["ts"] + e["dur"], window.end)
            if b < a or (b == a and e["dur"] > 0):  # outside the window (instants inside it are kept)
                continue
            x0, width = (a - window.start) / 1e3, (b - a) / 1e3  # milliseconds into the window
            lane = str(e.get("cat", ""))
            ax.broken_barh(
                [(x0, width)],
                (y - 0.4, 0.8),
                facecolors=_lane_color(lane, cmap),
                edgecolor="white",
                linewidth=0.3,
            )
            unit = e.get("args", {}).get("unit")
            if unit is not None and (b - a) >= _LABEL_MIN * length:
                ax.text(x0 + width / 2, y, str(unit), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [label for _, label in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, length / 1e3)
    ax.set_xlabel("milliseconds since the step started")
    ax.set_title(
        f"step {window.step} and the updates it queued ({length / 1e3:.1f} ms): one bar per span, labelled by unit "
        f"[{trace.name}]",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)


def _draw_lanes(ax: Any, rows: list[dict[str, Any]], why: str) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    lanes = sorted({k[2:] for r in rows for k in r if k.startswith("t_")}, key=lambda x: (_lane_rank(x), x))
    for lane in lanes:
        ax.plot(steps, [r.get(f"t_{lane}", 0.0) for r in rows], marker=".", label=lane)
    if any("seconds" in r for r in rows):
        ax.plot(steps, [r.get("seconds", float("nan")) for r in rows], "k--", label="step")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"{why}: seconds per lane per step", fontsize=10)
    if lanes:
        ax.legend(fontsize=8, ncol=min(6, len(lanes) + 1), loc="upper right")
    ax.grid(alpha=0.3)


def _draw_loss(ax: Any, rows: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    lines = ax.plot(steps, [r.get("loss", float("nan")) for r in rows], color="tab:blue", label="train loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if evals:
        lines += [ax.scatter(*zip(*evals, strict=True), color="tab:red", zorder=3, label="eval loss")]
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if any("tokens_per_s" in r for r in rows):
        twin = ax.twinx()
        lines += twin.plot(
            steps,
            [r.get("tokens_per_s", float("nan")) for r in rows],
            color="tab:gray",
            ls=":",
            label="tokens/s",
        )
        twin.set_ylabel("tokens/s")
    ax.legend(handles=lines, fontsize=8, loc="upper right")


def _summary(run_dir: Path, rows: list[dict[str, Any]]) -> str:
    first, last = rows[0].get("loss", float("nan")), rows[-1].get("loss", float("nan"))
    text = f"{run_dir.name or run_dir}: {len(rows)} steps, loss {first:.3f} -> {last:.3f}"
    tail = rows[len(rows) // 2 :]  # the second half: past warm-up
    for key, unit, fmt in (("tokens_per_s", "tokens/s", ".0f"), ("tflops", "TFLOPS", ".3g")):
        values = sorted(r[key] for r in tail if key in r)
        if values:
            text += f", {values[len(values) // 2]:{fmt}} {unit}"
    return text


def report_figure(run_dir: str | os.PathLike[str]) -> Any:
    """The report of ``run_dir`` as a matplotlib ``Figure`` (on an Agg canvas): loss panel, then timeline."""
    run = Path(run_dir).expanduser()
    if not run.is_dir():
        raise ConfigError(
            f"run directory {str(run)!r} does not exist; pass the --run-dir of a finetune run "
            "(`slidekit finetune --run-dir DIR --trace DIR/trace.json`)"
        )
    rows = load_metrics(run)
    trace = find_trace(run)
    events = _load_trace(trace) if trace is not None else []
    window = step_window(events) if events else None

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=[1.0, 1.4])
    _draw_loss(top, rows)
    if trace is not None and window is not None:
        _draw_timeline(bottom, events, window, trace)
    elif trace is not None:
        _draw_lanes(bottom, rows, f"the trace {trace.name} marks no complete step")
    else:
        _draw_lanes(bottom, rows, "no trace (run with --trace FILE.json for a per-unit timeline)")
    fig.suptitle(_summary(run, rows), fontsize=11)
    return fig


def draw_report(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw ``run_dir``'s report as a PNG (default ``run_dir/report.png``) and return its path."""
    fig = report_figure(run_dir)
    target = Path(out).expanduser() if out is not None else Path(run_dir).expanduser() / "report.png"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(target, format="png", dpi=DPI)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the report to {str(target)!r}: {exc}; pass a writable --out"
        ) from exc
    return target
