"""What a run reports while it trains: a progress bar, step metrics, and where each step's time went.

``Progress`` wraps tqdm; it writes to stderr and disappears when disabled,
so library use stays quiet and the CLI shows it. Each step it shows the
loss, tokens/s, model TFLOPS, peak GPU memory (on CUDA) and host RSS; where
stderr is no terminal (a log file) it prints plain lines instead of a bar.
``loss_summary`` is the loss part of the line a run ends with.

``model_flops`` is the one FLOP count slidekit reports (``FLOPS_FORMULA``;
PaLM convention, recompute not counted) for a step of ``tokens`` tokens in
rows of ``seq_len``::

    6 * matmul_params * tokens  +  12 * layers * (heads * head_dim) * seq_len * tokens

The first term is the weights (2 forward + 4 backward FLOPs per parameter
and token); ``matmul_params`` is every parameter except the input
embedding's, which is a table lookup, not a matmul (a tied LM head keeps the
matrix: its matmul counts once). The second term is the attention scores
and their weighted sum. ``step_tflops`` turns a step's FLOPs into the
metrics ``tflops`` (the whole run's: every rank's FLOPs, as ``tokens`` counts
every rank's tokens) and ``tflops_per_rank`` (its share per rank: what one
GPU did, equal to ``tflops`` in one process).

``Timeline`` records the time every pipeline lane spent per unit, from which
the engine reports per-step totals and the hiding factor
eta = T_bwd / (T_d2h + T_update) (``hiding_factor``; metrics.jsonl calls it
that too). With ``record_spans(True)`` it also keeps every span with absolute
``perf_counter`` times (``take_spans``), which ``slidekit.trace`` writes as a
Chrome trace.

Test: ``pytest tests/test_telemetry.py tests/test_console.py``.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import torch

    from slidekit.models.base import ArchSpec

__all__ = [
    "BACKWARD_WINDOW",
    "FLOPS_FORMULA",
    "GIB",
    "Progress",
    "Span",
    "Timeline",
    "d2h_seconds",
    "hiding_factor",
    "host_rss_bytes",
    "log_every",
    "loss_summary",
    "matmul_params",
    "memory_metrics",
    "model_flops",
    "peak_rss_bytes",
    "proc_sizes",
    "reset_peak_rss",
    "step_tflops",
]

GIB = float(2**30)


#: The formula of ``model_flops``, as the benchmark records and docs/benchmarking.md state it.
FLOPS_FORMULA = (
    "6 x matmul_params x tokens + 12 x layers x heads x head_dim x seq x tokens per step, where "
    "matmul_params = params - vocab x hidden for an untied input embedding (a lookup, not a matmul; "
    "a tied LM head's matrix counts once, for its matmul); recompute not counted"
)


def matmul_params(spec: ArchSpec) -> int:
    """Parameters that take part in a matmul: all but an untied input embedding (a table lookup).

    A tied embedding is the LM head's weight too, and the head's matmul counts: it stays.
    """
    lookup = 0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size
    return spec.num_params - lookup


def model_flops(spec: ArchSpec, tokens: int, seq_len: int) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens in rows of ``seq_len`` (``FLOPS_FORMULA``).

    6 * matmul_params * tokens + 12 * layers * (heads * head_dim) * seq_len * tokens; the input
    embedding lookup counts zero, recompute is not counted.
    """
    weights = 6 * matmul_params(spec) * tokens
    attention = 12 * spec.num_layers * spec.num_heads * spec.head_dim * seq_len * tokens
    return float(weights + attention)


def step_tflops(flops: float, seconds: float, ranks: int = 1) -> dict[str, float]:
    """A step's model TFLOPS from ``flops``, the ``model_flops`` of every rank's micro-batches, over its
    ``seconds``: ``tflops``, the whole run's, and ``tflops_per_rank``, that divided among ``ranks``."""
    if ranks < 1:
        raise ValueError(f"step_tflops: ranks must be 1 or more, got {ranks!r}")
    tflops = flops / seconds / 1e12 if seconds else 0.0
    return {"tflops": tflops, "tflops_per_rank": tflops / ranks}


def proc_sizes(path: str) -> dict[str, int]:
    """The ``Key: N kB`` lines of a /proc file (meminfo, self/status) in bytes; {} where it is missing."""
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields = rest.split()
                if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
                    out[key] = int(fields[0]) * 1024
    except OSError:
        pass
    return out


def peak_rss_bytes() -> int:
    """Peak resident set size of this process: ``VmHWM`` of /proc/self/status, which ``reset_peak_rss``
    starts over (getrusage's ``ru_maxrss`` where there is no /proc; on Linux that one also counts the
    parent's peak, inherited at exec)."""
    hwm = proc_sizes("/proc/self/status").get("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024


def host_rss_bytes() -> int:
    """Resident set size of this process now, from /proc/self/statm (peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def memory_metrics(device: torch.device) -> dict[str, float]:
    """``gpu_mem_gib`` (peak allocated on ``device``, CUDA only) and ``host_rss_gib`` (RSS now), in GiB."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        import torch

        out["gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    out["host_rss_gib"] = host_rss_bytes() / GIB
    return out


class Progress:
    """Progress over the steps of a run: loss, tokens/s, TFLOPS, GPU memory, host RSS.

    On a terminal (or in a notebook) it is a tqdm bar that counts from ``initial`` (the steps a
    resumed run had already taken) to ``total``. Anywhere else, a log file or a pipe, a bar's
    carriage-return redraws would be noise, so it prints one plain line every ``every`` steps
    (default ``log_every(total - initial)``), on the first step and on the last::

        finetune: step 41/60 (00:05, 01:30 left): loss=2.3140, tok_s=1234, tflops=0.0123, rss=3.2GiB

    ``write`` prints a message line to ``out`` (stdout by default; above the bar, as ``tqdm.write``
    does), the bar or the progress lines go to ``file`` (stderr by default). Disabled, it prints nothing.
    """

    def __init__(
        self,
        total: int,
        *,
        enabled: bool,
        desc: str = "finetune",
        initial: int = 0,
        file: TextIO | None = None,
        out: TextIO | None = None,
        every: int | None = None,
    ) -> None:
        if every is not None and every < 1:
            raise ValueError(f"Progress(every={every}): print every N >= 1 steps")
        self._bar: Any = None
        self._file: TextIO | None = None  # where the plain progress lines go (None: a bar, or disabled)
        self._out: TextIO | None = None  # where ``write`` goes (None: disabled)
        self._desc, self._total, self._n, self._initial = desc, total, initial, initial
        self._every = every if every is not None else log_every(total - initial)
        self._t0 = time.perf_counter()
        if not enabled:
            return
        file = sys.stderr if file is None else file
        self._out = sys.stdout if out is None else out
        if _interactive(file):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, file=file
            )
        else:
            self._file = file

    @staticmethod
    def postfix(metrics: Mapping[str, float]) -> dict[str, str]:
        """What the bar shows after the step counter; quantities missing from ``metrics`` are left out."""
        shown = {"loss": f"{metrics['loss']:.4f}", "tok_s": f"{metrics['tokens_per_s']:.0f}"}
        if "tflops" in metrics:
            shown["tflops"] = f"{metrics['tflops']:.3g}"
        if "gpu_mem_gib" in metrics:
            shown["gpu"] = f"{metrics['gpu_mem_gib']:.1f}GiB"
        if "host_rss_gib" in metrics:
            shown["rss"] = f"{metrics['host_rss_gib']:.1f}GiB"
        return shown

    def update(self, metrics: Mapping[str, float]) -> None:
        if self._bar is not None:
            self._bar.set_postfix(self.postfix(metrics), refresh=False)
            self._bar.update(1)
            return
        self._n += 1
        done = self._n - self._initial
        if self._file is None or not (done == 1 or done % self._every == 0 or self._n == self._total):
            return
        from tqdm import tqdm

        elapsed = time.perf_counter() - self._t0
        left = elapsed / done * (self._total - self._n) if self._total > self._n else 0.0
        shown = ", ".join(f"{k}={v}" for k, v in self.postfix(metrics).items())
        when = f"{tqdm.format_interval(elapsed)}, {tqdm.format_interval(left)} left"
        print(f"{self._desc}: step {self._n}/{self._total} ({when}): {shown}", file=self._file, flush=True)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self._out)
        elif self._out is not None:
            print(line, file=self._out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._file = self._out = None


def log_every(steps: int) -> int:
    """Steps between the plain progress lines of a run of ``steps`` steps: the smallest of 1, 2, 5, 10,
    20, 50, ... that prints at most about 20 lines."""
    every, scale = 1, 1
    while every * 20 < steps:
        for m in (2, 5, 10):
            every = m * scale
            if every * 20 >= steps:
                break
        scale *= 10
    return every


def _interactive(file: Any) -> bool:
    """Whether a redrawn progress bar on ``file`` reaches a person: a terminal, or a notebook's output
    (where ``tqdm.auto`` draws a widget, whatever the stream says)."""
    from tqdm import std
    from tqdm.autonotebook import tqdm as chosen

    if chosen is not std.tqdm:
        return True
    isatty = getattr(file, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def loss_summary(losses: Sequence[float]) -> str:
    """How the loss moved over a run's ``losses`` (one per step), for the line a run ends with.

    The means of the first and the last ``k`` steps, ``k = min(5, n // 2)``, which never overlap
    (an odd short run leaves its middle step out): "loss 2.310 -> 1.020 (means of the first and last
    5 of 40 steps)"; "(first and last of 3 steps)" where ``k`` is 1; one step has one loss.
    """
    n = len(losses)
    if n == 0:
        raise ValueError("loss_summary needs the loss of at least one step")
    if n == 1:
        return f"loss {losses[0]:.3f} (1 step)"
    k = min(5, n // 2)
    head, tail = sum(losses[:k]) / k, sum(losses[-k:]) / k
    which = "first and last" if k == 1 else f"means of the first and last {k}"
    return f"loss {head:.3f} -> {tail:.3f} ({which} of {n} steps)"


@dataclass(frozen=True, slots=True)
class Span:
    """One piece of work of one lane on one unit, in seconds of the timeline's clock (``perf_counter``)."""

    lane: str  # "fwd", "head", "bwd", "h2d", "d2h", "update", "stall", ...
    unit: int
    start: float
    end: float
    track: str  # where it ran: the thread's name, or "cuda:N" for work timed on a CUDA stream
    device: bool  # True when timed by CUDA events (device time aligned to the host clock)


_Anchor = tuple[Any, float]  # (a completed CUDA event, perf_counter when it completed)


class Timeline:
    """What each lane of the pipeline spent on each unit during one step.

    Host spans (``host``) time work on a thread with ``perf_counter``: the
    optimizer update, the gradient download (copy and wait), the main thread
    stalled waiting for an upload or a free cache unit. Device spans
    (``device``) bracket work queued on a CUDA stream with events, resolved
    when the step ends; on the CPU they are host spans, since compute there
    is synchronous. ``finish`` returns seconds per lane and clears the record.

    Spans for a trace (``record_spans``) are kept apart from the totals, so
    ``finish`` is unaffected by them. A device span is placed on the host
    clock through an *anchor*: a CUDA event recorded on the span's stream
    and waited for, with the ``perf_counter`` reading taken when the wait
    returns; the span starts ``anchor.elapsed_time(start)`` after that
    reading. The anchor is renewed every step (on the first device span after
    ``finish``), since ``elapsed_time`` is a 32-bit float of milliseconds and
    loses precision over long intervals.

    ``clock`` is where host readings come from: ``time.perf_counter``, the clock
    the trainer's step marks use; tests pass a fake one to get exact spans.
    """

    def __init__(self, cuda: bool, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = cuda
        self._clock = clock
        self._lock = threading.Lock()
        self._host: list[tuple[str, int, float, float]] = []
        self._device: list[tuple[str, int, Any, Any]] = []
        self._keep = False
        self._anchors: dict[Any, _Anchor] = {}  # device -> anchor of the current step
        self._kept: list[Span] = []
        self._kept_device: list[tuple[str, int, Any, Any, _Anchor, str]] = []

    # ------------------------------------------------------------------ recording

    @contextlib.contextmanager
    def host(self, lane: str, unit: int) -> Iterator[None]:
        t0 = self._clock()
        try:
            yield
        finally:
            t1 = self._clock()
            with self._lock:
                self._host.append((lane, unit, t0, t1))
                if self._keep:
                    track = threading.current_thread().name
                    self._kept.append(Span(lane, unit, t0, t1, track, device=False))

    @contextlib.contextmanager
    def device(self, lane: str, unit: int, stream: Any) -> Iterator[None]:
        if not self.cuda:
            with self.host(lane, unit):
                yield
            return
        import torch

        anchor = self._anchor(stream) if self._keep else None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            with self._lock:
                self._device.append((lane, unit, start, end))
                if anchor is not None and self._keep:
                    self._kept_device.append((lane, unit, start, end, anchor, str(stream.device)))

    def _anchor(self, stream: Any) -> _Anchor:
        """This step's anchor on ``stream``'s device, recorded (and waited for) on first use."""
        with self._lock:
            anchor = self._anchors.get(stream.device)
        if anchor is None:
            import torch

            ref = torch.cuda.Event(enable_timing=True)
            ref.record(stream)
            ref.synchronize()  # the reading below is taken as the event completes on the device
            with self._lock:
                anchor = self._anchors.setdefault(stream.device, (ref, self._clock()))
        return anchor

    # ------------------------------------------------------------------ reading

    def finish(self) -> dict[str, float]:
        """Seconds per lane over the step (device events are waited for), then reset.

        Beside the lanes: ``bwd_window`` and ``bwd_busy`` (``BACKWARD_WINDOW``), the
        backward pass's wall time on the compute stream and its compute time in it."""
        with self._lock:
            host, device = self._host, self._device
            self._host, self._device = [], []
            self._anchors = {}  # the next step's device spans get a fresh anchor
        totals: dict[str, float] = {}
        for lane, _, t0, t1 in host:
            totals[lane] = totals.get(lane, 0.0) + (t1 - t0)
        seconds = []
        for lane, _, start, end in device:
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
            totals[lane] = totals.get(lane, 0.0) + seconds[-1]
        if device:
            totals.update(_backward_window(device, seconds))
        else:
            totals.update(_backward_window(host, [t1 - t0 for *_, t0, t1 in host]))
        return totals

    def record_spans(self, enabled: bool = True) -> None:
        """Keep (or stop keeping) every span for ``take_spans``; turning it off drops what was kept."""
        with self._lock:
            self._keep = enabled
            if not enabled:
                self._kept, self._kept_device = [], []

    def take_spans(self) -> list[Span]:
        """The spans kept since the last call, in absolute ``perf_counter`` seconds (waits for the device)."""
        with self._lock:
            spans, device = self._kept, self._kept_device
            self._kept, self._kept_device = [], []
        for lane, unit, start, end, (ref, t_ref), track in device:
            end.synchronize()
            t0 = t_ref + ref.elapsed_time(start) / 1e3
            t1 = t_ref + ref.elapsed_time(end) / 1e3
            spans.append(Span(lane, unit, t0, t1, track, device=True))
        return spans


def reset_peak_rss() -> bool:
    """Start this process's peak RSS over from its current RSS; False where that is impossible.

    Linux (4.0 and later) resets the high-water mark ``VmHWM`` of /proc/self/status when "5" is
    written to /proc/self/clear_refs. Where the file is missing or cannot be written (another OS,
    a read-only /proc) nothing changes, and a peak read later is still the whole process's.
    ``getrusage``'s ``ru_maxrss`` (``peak_rss_bytes``) is not reset below what the process
    inherited at exec (the parent's peak, through vfork), so a peak taken after a reset reads
    ``VmHWM``.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def d2h_seconds(lanes: Mapping[str, float]) -> float:
    """The gradient transfer's seconds: the copy's own span (``d2h_copy``) where the engine recorded one;
    the ``d2h`` lane also holds the download thread's wait for each unit's backward."""
    return lanes.get("d2h_copy", lanes.get("d2h", 0.0))


def hiding_factor(lanes: Mapping[str, float]) -> float | None:
    """eta = T_bwd / (T_d2h + T_update) over lane seconds: >= 1 when the host side keeps up with the
    backward pass; None when nothing went to the host."""
    cpu = d2h_seconds(lanes) + lanes.get("update", 0.0)
    return lanes.get("bwd", 0.0) / cpu if cpu > 0 else None


#: The keys ``Timeline.finish`` adds beside the lanes.
BACKWARD_WINDOW = ("bwd_window", "bwd_busy")
#: Lanes that run on the compute stream (device) or the main thread (CPU), in the order they ran.
_COMPUTE = ("fwd", "head", "bwd", "update_gpu")


def _backward_window(spans: list[Any], seconds: list[float]) -> dict[str, float]:
    """``bwd_window``: seconds from the start of the first backward span to the end of the last;
    ``bwd_busy``: compute seconds inside that window (backward, and updates of resident units in between).

    ``spans`` are (lane, unit, start, end) in the order they were recorded, which for the compute
    lanes is the order they ran (one stream, or the main thread); ``seconds`` their durations.
    """
    index = [i for i, span in enumerate(spans) if span[0] == "bwd"]
    if not index:
        return {}
    first, last = index[0], index[-1]
    start, end = spans[first][2], spans[last][3]
    window = start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time") else end - start
    busy = sum(seconds[i] for i in range(first, last + 1) if spans[i][0] in _COMPUTE)
    return {"bwd_window": window, "bwd_busy": busy}
