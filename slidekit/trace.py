"""A Chrome trace of the pipeline: every lane's work on every unit, step by step; open it in Perfetto.

``TraceWriter`` turns on span recording in the engine's ``Timeline``, takes
the spans after every step (``step``), and at the end (``close``) writes one
JSON file in the Trace Event Format (https://ui.perfetto.dev or
chrome://tracing open it)::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

* one process row for the host threads (pid 1) and, on CUDA, one for the
  device (pid 2), whose spans are timed by CUDA events and placed on the
  host clock (see ``Timeline``);
* one thread row per lane (``fwd``, ``head``, ``bwd``, ``h2d``, ``d2h``,
  ``d2h_wait``, ``update``, ``update_gpu``, ``stall``, ``checkpoint_wait``,
  ``act_load``, ...), named by ``thread_name`` metadata events; a lane that
  ran on several threads gets one row per thread (``"lane [thread]"``);
* a complete event (``"ph": "X"``, ``ts``/``dur`` in microseconds since the
  trace began) per span, named ``"<lane> <unit>"`` with ``unit`` and ``lane``
  in ``args``; a ``step`` row holds one event per optimizer step with its
  loss and tokens/s.

Spans of one step that finish after it (the optimizer lags the backward
pass) appear where they ran. Traces hold every span of every step: trace
short runs (a few steps tell the story). The file is written atomically,
also when training fails, so a failed run still leaves its trace.

A data-parallel run's ranks each write their own file (``rank_path``): rank 0
the path given, rank r ``<stem>.rank<r><suffix>`` beside it.

Test: ``pytest tests/test_telemetry.py``.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slidekit.atomic import write_text_atomically
from slidekit.errors import ConfigError
from slidekit.telemetry import Span, Timeline

__all__ = ["HOST_PID", "LANE_ORDER", "STEP_LANE", "TraceWriter", "rank_path", "trace_events"]

HOST_PID, DEVICE_PID = 1, 2
STEP_LANE = "step"

#: Rows top to bottom; lanes not listed follow in alphabetical order.
LANE_ORDER = (
    STEP_LANE,
    "stall",
    "fwd",
    "head",
    "bwd",
    "update_gpu",
    "act_load",
    "h2d",
    "d2h_wait",
    "d2h",
    "d2h_copy",
    "update",
    "checkpoint_wait",
)


def rank_path(path: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` of a data-parallel run writes the trace asked for at ``path``: rank 0 there,
    the others beside it (``trace.json`` -> ``trace.rank1.json``), so that no rank overwrites another's."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _duration(ts: float, end: float) -> float:
    """``end - ts``, rounded to nanoseconds as ``ts`` is, so a span ends where the next one may start."""
    return max(0.0, round(end - ts, 3))


def _rows(spans: list[Span]) -> dict[tuple[bool, str, str], tuple[int, int, str]]:
    """(device, lane, track) -> (pid, tid, row name), in display order."""
    keys = sorted({(s.device, s.lane, s.track) for s in spans})
    tracks: dict[tuple[bool, str], int] = {}
    for device, lane, _ in keys:
        tracks[(device, lane)] = tracks.get((device, lane), 0) + 1
    rank = {lane: i for i, lane in enumerate(LANE_ORDER)}
    keys.sort(key=lambda k: (k[0], rank.get(k[1], len(rank)), k[1], k[2]))
    rows = {}
    for tid, (device, lane, track) in enumerate(keys, start=1):
        name = lane if tracks[(device, lane)] == 1 else f"{lane} [{track}]"
        rows[(device, lane, track)] = (DEVICE_PID if device else HOST_PID, tid, name)
    return rows


def trace_events(
    spans: list[Span], steps: list[tuple[int, float, float, dict[str, float]]], origin: float, device: str
) -> list[dict[str, Any]]:
    """Trace events for ``spans`` and ``steps`` (step, start, end, metrics); times relative to ``origin``
    (or to the earliest span, should one have begun before it)."""
    origin = min([origin, *(s.start for s in spans)])
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": HOST_PID, "tid": 0, "args": {"name": "host"}},
        {"ph": "M", "name": "process_sort_index", "pid": HOST_PID, "tid": 0, "args": {"sort_index": 1}},
        {"ph": "M", "name": "thread_name", "pid": HOST_PID, "tid": 0, "args": {"name": STEP_LANE}},
        {"ph": "M", "name": "thread_sort_index", "pid": HOST_PID, "tid": 0, "args": {"sort_index": 0}},
    ]
    rows = _rows(spans)
    if any(s.device for s in spans):
        events.append(
            {"ph": "M", "name": "process_name", "pid": DEVICE_PID, "tid": 0, "args": {"name": device}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": DEVICE_PID, "tid": 0, "args": {"sort_index": 0}}
        )
    for pid, tid, name in rows.values():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    for step, start, end, metrics in steps:
        ts = _us(start - origin)
        args: dict[str, float] = {"step": step}
        args.update({k: metrics[k] for k in ("loss", "tokens_per_s", "tflops") if k in metrics})
        events.append(
            {
                "ph": "X",
                "name": f"step {step}",
                "cat": STEP_LANE,
                "ts": ts,
                "dur": _duration(ts, _us(end - origin)),
                "pid": HOST_PID,
                "tid": 0,
                "args": args,
            }
        )
    for s in sorted(spans, key=lambda s: s.start):
        pid, tid, _ = rows[(s.device, s.lane, s.track)]
        ts = _us(s.start - origin)
        events.append(
            {
                "ph": "X",
                "name": f"{s.lane} {s.unit}",
                "cat": s.lane,
                "ts": ts,
                "dur": _duration(ts, _us(s.end - origin)),
                "pid": pid,
                "tid": tid,
                "args": {"unit": s.unit, "lane": s.lane},
            }
        )
    return events


class TraceWriter:
    """Collects the engine's spans step by step and writes them as a Chrome trace at ``close``."""

    def __init__(self, path: str | os.PathLike[str], timeline: Timeline, *, device: str = "device") -> None:
        """Check that ``path`` can be written (a relative path is relative to the current directory) and
        start recording spans on ``timeline``."""
        self.path = Path(path).expanduser().absolute()
        if self.path.is_dir():
            raise ConfigError(
                f"run.trace {str(self.path)!r} is a directory; give a file name such as trace.json"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the directory of run.trace {str(self.path)!r}: {exc}; choose a writable path"
            ) from exc
        self.device = device
        self._timeline = timeline
        self._origin = time.perf_counter()
        self._spans: list[Span] = []
        self._steps: list[tuple[int, float, float, dict[str, float]]] = []
        self._closed = False
        timeline.record_spans(True)

    def step(self, step: int, start: float, end: float, metrics: Mapping[str, float]) -> None:
        """Record optimizer step ``step`` (``perf_counter`` start and end) and take the spans so far."""
        self._spans.extend(self._timeline.take_spans())
        self._steps.append((step, start, end, dict(metrics)))

    def close(self, *, error: BaseException | None = None) -> Path | None:
        """Take the last spans, stop recording and write the file; idempotent.

        With ``error`` (training failed), a failure to take spans or to write
        is a warning, so it never hides the error that ended the run.
        """
        if self._closed:
            return self.path
        self._closed = True
        try:
            self._spans.extend(self._timeline.take_spans())
            self._timeline.record_spans(False)
            self._write(error)
        except Exception as exc:
            if error is None:
                raise
            warnings.warn(f"could not write the trace {self.path}: {exc}", RuntimeWarning, stacklevel=2)
            return None
        return self.path

    def _write(self, error: BaseException | None) -> None:
        doc = {
            "traceEvents": trace_events(self._spans, self._steps, self._origin, self.device),
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "slidekit",
                "steps": len(self._steps),
                "error": None if error is None else f"{type(error).__name__}: {error}",
            },
        }
        try:
            write_text_atomically(self.path, json.dumps(doc, separators=(",", ":")) + "\n")
        except OSError as exc:
            raise ConfigError(
                f"cannot write the trace {str(self.path)!r}: {exc}; choose a writable path for run.trace (--trace)"
            ) from exc
