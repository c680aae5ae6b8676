"""``slidekit bench``: slidekit and the usual alternatives on the same model, batch and tokens, in one run.

    slidekit bench --model qwen2.5-3b --batch 8,16,32 --seq 1024 --steps 3 --warmup 2 \\
        --resident none,auto --baselines none,torchao,deepspeed --out bench.jsonl --markdown bench.md
    slidekit bench --model tiny --device cpu --batch 2 --seq 64 --steps 2 --baselines none   # anywhere

The flow (``bench``):

1. slidekit first, batch by batch: one run per ``--resident`` mode, each in its own process
   (``python -m slidekit.tools.bench``: ``main`` below; ``benchmarks/train_throughput.py`` wraps it),
   given min(``--timeout``, what is left of ``--time-budget``).
2. Then each requested alternative, in the order given, ONCE for all batches
   (``--batch 8,16,32``): the script builds its model and optimizer once and prints one JSON
   line per batch as it finishes it (``slidekit/tools/baselines/common.py`` says how). It gets
   min(``--timeout`` x the number of batches, what is left). The lines are read as they come
   (``slidekit.tools.children.stream_child``); a batch's row is recorded at once, so lines printed before a timeout kill
   or a crash are kept, and every batch without a line becomes ``unavailable: no line for batch
   N; <timed out after S s | exit code C: last error line>`` (a record naming no batch, as an
   older script prints, stands for every batch without a line of its own).
   - ``none``: ``slidekit/tools/baselines/no_offload.py``: FP32 master weights and AdamW on the GPU.
   - ``torchao``: ``slidekit/tools/baselines/torchao_offload.py``: torchao's CPUOffloadOptimizer.
   - ``deepspeed``: ``slidekit/tools/baselines/deepspeed_offload.py``: ZeRO-2, optimizer offloaded to the CPU.
3. Every finished row is printed as a progress line on stderr and appended to ``--out`` at once
   (a suite killed midway keeps what finished). At the end the rows are ordered by batch (in
   the order given; each batch's rows in run order), the ratios are added per batch
   (``add_ratios``), and the lines this run appended to ``--out`` are rewritten with them (each
   row written once; earlier content of the file stays); ``run_command`` prints the markdown
   table and writes ``--markdown``.

A run that cannot work (a package missing, no CUDA, too little host RAM, out of GPU memory, a
crash, a timeout, the time budget spent) becomes a row ``unavailable: <reason>`` instead of
stopping the benchmark.

The alternatives build the same model (``hf_config``: a preset's published
shapes, random weights) with transformers and train on the same synthetic
tokens (``synthetic_tokens``). Every row has:

- ``step_seconds``: every timed step (to the microsecond); ``tokens_per_s`` = batch * seq / their
  median, ``model_tflops`` = model FLOPs
  (``slidekit.telemetry.model_flops``: 6 * params * tokens + 12 * layers * heads * head_dim
  * seq * tokens, recompute not counted, the same parameter count for every system) / median step
  (``throughput``: computed from ``step_seconds`` as recorded, so a record can be checked exactly);
- ``peak_gpu_gib`` (``torch.cuda.max_memory_allocated``), ``peak_host_rss_gib`` (``peak_rss_gib``:
  VmHWM): a slidekit run's own process; an alternative's batch (counters reset before each batch;
  ``peak_rss_scope`` "process" where the RSS peak cannot be reset); ``setup_s``: building the
  model and optimizer (an alternative's is shared by the batches in ``setup_shared_by``);
  ``wall_s``: a slidekit run's process, an alternative's batch (``process_wall_s``: its whole
  process, in the rows rewritten at the end);
- slidekit only: per unit (median lane seconds per step / layers) ``t_fwd_s``, ``t_bwd_s``,
  ``t_d2h_s`` (the gradient copy's own time: the engine's ``d2h_copy`` span), ``t_update_s``;
  ``eta`` = T_bwd / (T_d2h + T_update) (null when nothing is
  offloaded); ``gpu_busy`` = compute-lane time (fwd, head, bwd, update_gpu) / step wall time;
  ``gpu_busy_bwd`` = compute time / wall time of the backward pass on the compute stream (from the
  start of the first unit's backward to the end of the last's: ``Timeline``'s ``bwd_window``);
  and ``vs_<alternative>`` = slidekit tokens/s / the alternative's at the same batch.

Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from slidekit.errors import ConfigError
from slidekit.telemetry import d2h_seconds, hiding_factor
from slidekit.tools.children import ChildRun, last_error, run_child, stream_child
from slidekit.tools.presets import PRESETS, arch_spec, hf_config, preset, write_config

if TYPE_CHECKING:
    import torch

    from slidekit.models.base import ArchSpec

__all__ = [
    "BASELINES",
    "COMPUTE_LANES",
    "PRESETS",
    "ChildRun",
    "add_arguments",
    "add_ratios",
    "arch_spec",
    "bench",
    "hf_config",
    "lane_metrics",
    "main",
    "markdown_table",
    "measure_slidekit",
    "peak_gpu_gib",
    "peak_rss_gib",
    "run_child",
    "run_command",
    "run_header",
    "slidekit_parser",
    "stream_child",
    "synthetic_tokens",
    "throughput",
    "write_config",
]


#: ``--baselines`` name -> (system name in the results, script in slidekit/tools/baselines).
BASELINES: dict[str, tuple[str, str]] = {
    "none": ("no_offload", "no_offload.py"),
    "torchao": ("torchao", "torchao_offload.py"),
    "deepspeed": ("deepspeed", "deepspeed_offload.py"),
}

#: Lanes that keep the GPU computing (device time from CUDA events; host time on the CPU).
COMPUTE_LANES = ("fwd", "head", "bwd", "update_gpu")

_GIB = float(2**30)


# ---------------------------------------------------------------------------- the model and the tokens


def synthetic_tokens(
    vocab: int, batch: int, seq: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless uniform-random (inputs, labels), each (batch, seq), labels = inputs shifted by one token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)  # (B, T + 1)
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ---------------------------------------------------------------------------- metrics


def peak_rss_gib() -> float:
    """Peak resident set size of this process, GiB (``slidekit.telemetry.peak_rss_bytes``)."""
    from slidekit.telemetry import peak_rss_bytes

    return round(peak_rss_bytes() / _GIB, 3)


def peak_gpu_gib(device: torch.device) -> float | None:
    """Peak memory allocated through torch on ``device`` (None off CUDA), GiB."""
    if device.type != "cuda":
        return None
    from slidekit.telemetry import memory_metrics

    return round(memory_metrics(device)["gpu_mem_gib"], 3)


def _gpu_name(device: Any) -> str | None:
    if device.type != "cuda":
        return None
    import torch

    return str(torch.cuda.get_device_name(device))


def run_header(system: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The fields every benchmark record starts with: what ran, on what, for how many steps."""
    return {
        "system": system,
        "status": "ok",
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": str(device),
        "gpu": _gpu_name(device),
    }


def throughput(spec: ArchSpec, batch: int, seq: int, step_seconds: Sequence[float]) -> dict[str, Any]:
    """median_step_s, tokens_per_s and model_tflops of timed steps of ``batch`` rows of ``seq`` tokens.

    ``step_seconds`` is kept in the record too, to the microsecond, and the figures are computed from
    those recorded values: ``throughput`` of a record's own ``step_seconds`` gives back its figures
    exactly, whatever the timings were.
    """
    from slidekit.telemetry import model_flops

    seconds = [round(s, 6) for s in step_seconds]
    step_s = median(seconds)
    tokens = batch * seq
    return {
        "params": spec.num_params,
        "step_seconds": seconds,
        "median_step_s": round(step_s, 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops": float(f"{model_flops(spec, tokens, seq) / step_s / 1e12:.4g}"),
    }


def lane_metrics(
    timings: Sequence[dict[str, float]], step_seconds: Sequence[float], num_layers: int
) -> dict[str, Any]:
    """Median seconds per lane, per-unit T_fwd/T_bwd/T_d2h/T_update, eta and the GPU busy fraction."""
    lanes = {
        lane: median(t.get(lane, 0.0) for t in timings) for lane in sorted({k for t in timings for k in t})
    }
    out: dict[str, Any] = {"lanes_s": {k: round(v, 4) for k, v in lanes.items()}}
    seconds = {"fwd": lanes.get("fwd", 0.0), "bwd": lanes.get("bwd", 0.0), "d2h": d2h_seconds(lanes)}
    seconds["update"] = lanes.get("update", 0.0)
    for lane, s in seconds.items():
        out[f"t_{lane}_s"] = round(s / num_layers, 6)
    eta = hiding_factor(lanes)
    out["eta"] = None if eta is None else round(eta, 3)
    busy = [sum(t.get(k, 0.0) for k in COMPUTE_LANES) / s for t, s in zip(timings, step_seconds, strict=True)]
    out["gpu_busy"] = round(median(busy), 3)
    in_bwd = [t["bwd_busy"] / t["bwd_window"] for t in timings if t.get("bwd_window")]
    out["gpu_busy_bwd"] = round(median(in_bwd), 3) if in_bwd else None
    return out


# ---------------------------------------------------------------------------- one slidekit run


def measure_slidekit(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.warmup`` + ``args.steps`` steps of preset ``args.model`` on synthetic tokens; the record."""
    import torch

    from slidekit import (
        Batch,
        DataConfig,
        EngineConfig,
        ModelConfig,
        OptimConfig,
        RunConfig,
        TrainConfig,
        Trainer,
    )

    with tempfile.TemporaryDirectory() as tmp:
        write_config(args.model, Path(tmp), args.seq)
        cfg = TrainConfig(
            model=ModelConfig(source=tmp, random_init=True),
            data=DataConfig(seq_len=args.seq, batch_size=args.batch),
            optim=OptimConfig(lr=1e-5, name=args.optimizer),
            engine=EngineConfig(
                device=args.device,
                kernels=args.kernels,
                activation_tier=args.activations,
                window=args.window,
                gpu_resident=args.resident,
                state_tier=args.state_tier,
                offload_dir=args.offload_dir,
            ),
            run=RunConfig(trace=getattr(args, "trace", None)),
            steps=args.warmup + args.steps,
        )
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        setup_s = time.perf_counter() - t0
        spec, device = trainer.spec, trainer.device
        resident = f"{len(trainer.engine.window.resident)}/{len(spec.units)}"
        data = (Batch(x, y) for x, y in synthetic_tokens(spec.vocab_size, args.batch, args.seq, args.seed))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with trainer:
            if args.warmup:
                trainer.fit(data, steps=args.warmup)
            result = trainer.fit(data, steps=args.steps)
            kernels, optimizer = trainer.selections["kernels"].name, trainer.selections["optimizer"].name
    return {
        **run_header("slidekit", args, device),
        "resident": args.resident,
        "resident_units": resident,
        "activations": args.activations,
        "state_tier": args.state_tier,
        "window": args.window,
        "kernels": kernels,
        "optimizer": optimizer,
        "setup_s": round(setup_s, 2),
        **throughput(spec, args.batch, args.seq, result.step_seconds),
        "peak_gpu_gib": peak_gpu_gib(device),
        "peak_host_rss_gib": peak_rss_gib(),
        **lane_metrics(result.timings, result.step_seconds, spec.num_layers),
        "losses": [round(x, 4) for x in result.losses],
    }


def slidekit_parser() -> argparse.ArgumentParser:
    """Options of one slidekit throughput run (``python -m slidekit.tools.bench``, benchmarks/train_throughput.py)."""
    p = argparse.ArgumentParser(description="Training throughput of slidekit on a preset model shape.")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    _engine_arguments(p, resident_help="engine.gpu_resident: auto, none, all or a fraction")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line to this file")
    p.add_argument("--trace", default=None, help="Chrome trace of the timed steps (open in Perfetto)")
    return p


def _engine_arguments(p: argparse.ArgumentParser, *, resident_help: str) -> None:
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kernels", default="auto", help="kernel-set driver, or auto")
    p.add_argument("--optimizer", default="layer_adam", help="slidekit optimizer driver")
    p.add_argument("--activations", default="ram", help="'device' or a tier for boundary activations")
    p.add_argument("--window", type=int, default=3, help="cache units taking turns on the device")
    p.add_argument("--resident", default="auto", help=resident_help)
    p.add_argument("--state-tier", default="ram", help="tier for the optimizer state of host units")
    p.add_argument("--offload-dir", default=None, help="directory for file-backed tiers")


def main(argv: Sequence[str] | None = None) -> int:
    """One slidekit run: print its JSON line (and append it to --out)."""
    args = slidekit_parser().parse_args(argv)
    line = json.dumps(measure_slidekit(args))
    print(line, flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")
    return 0


def _slidekit_cmd(args: argparse.Namespace, batch: int, resident: str) -> list[str]:
    cmd = [sys.executable, "-m", "slidekit.tools.bench", *_common_flags(args, str(batch))]
    cmd += ["--kernels", args.kernels, "--optimizer", args.optimizer, "--activations", args.activations]
    cmd += ["--window", str(args.window), "--resident", resident, "--state-tier", args.state_tier]
    if args.offload_dir:
        cmd += ["--offload-dir", args.offload_dir]
    return cmd


def _common_flags(args: argparse.Namespace, batch: str) -> list[str]:
    return [
        *("--model", args.model, "--batch", batch, "--seq", str(args.seq)),
        *("--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed)),
        *("--device", args.device),
    ]


#: The bundled baseline scripts: modules of this package, run with ``python -m`` (an installed wheel has them).
BASELINE_PACKAGE = "slidekit.tools.baselines"


def _slidekit_runs(args: argparse.Namespace, batch: int) -> Iterator[tuple[dict[str, Any], list[str]]]:
    """(the row's identity, the command) of every slidekit run at ``batch``: one per residency mode."""
    for resident in _split(args.resident):
        ident = {"system": "slidekit", "label": f"slidekit (resident {resident})", "resident": resident}
        yield ident, _slidekit_cmd(args, batch, resident)


def _baseline_runs(
    args: argparse.Namespace, batches: Sequence[int]
) -> Iterator[tuple[dict[str, Any], list[str] | None]]:
    """(the rows' identity, the command for all ``batches``; None with a reason if there is no script)."""
    for name in _split(args.baselines):
        system, script = BASELINES[name]
        ident = {"system": system, "label": system}
        flags = _common_flags(args, ",".join(map(str, batches)))
        if not args.baselines_dir:  # the bundled script, from the installed package
            yield ident, [sys.executable, "-m", f"{BASELINE_PACKAGE}.{script.removesuffix('.py')}", *flags]
            continue
        path = Path(args.baselines_dir) / script
        if not path.is_file():
            yield {**ident, "reason": f"script {path} not found (pass --baselines-dir)"}, None
        else:
            yield ident, [sys.executable, str(path), *flags]


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


class _Rows:
    """The rows so far: each printed as a progress line and appended to ``--out`` when it is done (a
    killed suite keeps them); ``finish`` orders them by batch, adds the ratios and rewrites what this
    run appended."""

    def __init__(self, out: str | None, batches: Sequence[int]) -> None:
        self.batches = list(batches)
        self.rows: list[dict[str, Any]] = []
        self.out = Path(out) if out else None
        self.start = self.out.stat().st_size if self.out and self.out.exists() else 0

    def add(self, row: dict[str, Any]) -> None:
        print(_progress_line(row), file=sys.stderr, flush=True)
        self.rows.append(row)
        if self.out:
            with self.out.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def finish(self) -> list[dict[str, Any]]:
        # Stable: the batches in the order given, each batch's rows in the order they ran.
        rows = sorted(self.rows, key=lambda r: self.batches.index(r["batch"]))
        add_ratios(rows)
        if self.out:
            with self.out.open("a+") as f:  # earlier content stays; this run's rows are written once
                f.truncate(self.start)
                f.writelines(json.dumps(r) + "\n" for r in rows)
        return rows


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of ``args`` (see ``add_arguments``): rows per batch with ratios, in ``args.out`` too.

    First every slidekit run, batch by batch, each in its own process; then each alternative in the
    order given, once for all batches (one process, the model built once).
    """
    _validate(args)
    start = time.perf_counter()
    batches = [int(b) for b in _split(args.batch)]
    rows = _Rows(args.out, batches)

    def left() -> float:
        return args.time_budget - (time.perf_counter() - start) if args.time_budget else math.inf

    for batch in batches:
        for ident, cmd in _slidekit_runs(args, batch):
            row = {"model": args.model, "batch": batch, "seq": args.seq, **ident}
            row.update(_outcome(args, cmd, min(args.timeout, left()), f"{ident['label']}_b{batch}"))
            row.update(ident)  # the parent's names win over what the run calls itself
            rows.add(row)
    for ident, base_cmd in _baseline_runs(args, batches):
        seconds = min(args.timeout * len(batches), left())
        _baseline(args, ident, base_cmd, batches, seconds, rows.add)
    return rows.finish()


def _baseline(
    args: argparse.Namespace,
    ident: dict[str, Any],
    cmd: list[str] | None,
    batches: Sequence[int],
    seconds: float,
    add: Callable[[dict[str, Any]], None],
) -> None:
    """One alternative over all ``batches`` in one process: a row per batch as its line arrives, then a row
    "unavailable" for every batch it printed nothing for (saying why: timeout, exit code, last error)."""

    def row(batch: int, fields: dict[str, Any]) -> dict[str, Any]:
        out = {"model": args.model, "batch": batch, "seq": args.seq, **fields, **ident}
        out["batch"] = batch  # the parent's names win over what the run calls itself
        return out

    if cmd is None or seconds < _MIN_RUN_S:
        for batch in batches:
            add(row(batch, _outcome(args, cmd, seconds, "")))
        return
    done: dict[int, dict[str, Any]] = {}
    general: list[dict[str, Any]] = []  # records naming no batch speak for every batch

    def on_record(record: dict[str, Any]) -> None:
        batch = record.get("batch")
        if batch is None:
            general.append(record)
        elif batch in batches and batch not in done:  # a line printed twice is kept once
            done[batch] = row(batch, {"wall_s": round(time.perf_counter() - t0, 1), **record})
            add(done[batch])

    name = f"{ident['label']}_b{'-'.join(map(str, batches))}"
    t0 = time.perf_counter()
    run = stream_child(cmd, timeout=seconds, log=_log_path(args, name), on_record=on_record)
    for r in done.values():
        r["process_wall_s"] = run.wall_s  # in the final rewrite of --out
    for batch in (b for b in batches if b not in done):
        if general:
            fields = general[-1]
        else:
            why = run.failure or f"exit code 0: {last_error(run.stderr)}"
            fields = {"status": "unavailable", "reason": f"no line for batch {batch}; {why}"}
        add(row(batch, {**fields, "wall_s": run.wall_s, "process_wall_s": run.wall_s}))


_MIN_RUN_S = 15.0  # too little to build a model and time a step


def _outcome(args: argparse.Namespace, cmd: list[str] | None, seconds: float, name: str) -> dict[str, Any]:
    """The record of one run given ``seconds`` at most (its log under ``args.logs``), or why it did not run."""
    if cmd is None:
        return {"status": "unavailable"}  # the reason is already in the row
    if seconds < _MIN_RUN_S:
        return {
            "status": "unavailable",
            "reason": f"not run: the time budget ({args.time_budget} s) is spent",
        }
    return run_child(cmd, timeout=seconds, log=_log_path(args, name))


def _log_path(args: argparse.Namespace, name: str) -> Path | None:
    return (
        Path(args.logs) / (re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_") + ".log") if args.logs else None
    )


def _validate(args: argparse.Namespace) -> None:
    preset(args.model)  # an unknown name is a clear error before anything runs
    unknown = [b for b in _split(args.baselines) if b not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown baseline(s) {unknown}; choose from: {', '.join(BASELINES)}")
    try:
        batches = [int(b) for b in _split(args.batch)]
    except ValueError:
        raise ConfigError(f"--batch {args.batch!r}: give batch sizes as integers, e.g. 8,16,32") from None
    if not batches or min(batches) < 1 or args.steps < 1 or args.warmup < 0:
        raise ConfigError("--batch needs positive sizes, --steps >= 1 and --warmup >= 0")
    if len(set(batches)) != len(batches):
        raise ConfigError(f"--batch {args.batch!r}: give each batch size once")
    if not _split(args.resident):
        raise ConfigError("--resident needs at least one mode: auto, none, all or a fraction")


def _progress_line(row: dict[str, Any]) -> str:
    what = f"{row['label']} batch {row['batch']}"
    if row.get("status") != "ok":
        return f"{what}: unavailable: {row.get('reason', '?')}"
    return f"{what}: {row['tokens_per_s']:.0f} tokens/s, {row['model_tflops']:.1f} TFLOPS ({row['wall_s']} s)"


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Give every slidekit row ``vs_<system>`` = its tokens/s / that alternative's at the same batch (None if
    the alternative has no result)."""
    for row in rows:
        if row["system"] != "slidekit":
            continue
        for other in rows:
            if other["system"] == "slidekit" or other["batch"] != row["batch"]:
                continue
            ok = row.get("status") == "ok" and other.get("status") == "ok"
            row[f"vs_{other['system']}"] = (
                round(row["tokens_per_s"] / other["tokens_per_s"], 3) if ok else None
            )


# ---------------------------------------------------------------------------- the table


def _cell(value: Any, scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    return "-" if value is None else fmt.format(value * scale)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per run; slidekit rows carry their throughput as a ratio of each alternative's."""
    alternatives = list(dict.fromkeys(r["system"] for r in rows if r["system"] != "slidekit"))
    head = ["run", "batch", "tokens/s", "TFLOPS", "step s", "peak GPU GiB", "peak RSS GiB", "RSS B/param"]
    head += ["T_fwd ms", "T_bwd ms", "T_d2h ms", "T_update ms", "eta", "GPU busy", "GPU busy in bwd"]
    head += [f"vs {a}" for a in alternatives]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("status") != "ok":
            cells = [r["label"], str(r["batch"]), f"unavailable: {r.get('reason', '?')}"]
            cells += ["-"] * (len(head) - 3)
        else:
            cells = [r["label"], str(r["batch"]), f"{r['tokens_per_s']:,.0f}", _cell(r.get("model_tflops"))]
            cells += [_cell(r.get(k)) for k in ("median_step_s", "peak_gpu_gib", "peak_host_rss_gib")]
            per_param = r["peak_host_rss_gib"] * 2**30 / r["params"] if r.get("params") else None
            cells.append(_cell(per_param, fmt="{:.1f}"))
            cells += [_cell(r.get(f"t_{k}_s"), 1e3) for k in ("fwd", "bwd", "d2h", "update")]
            cells += [_cell(r.get("eta")), _cell(r.get("gpu_busy"), fmt="{:.2f}")]
            cells.append(_cell(r.get("gpu_busy_bwd"), fmt="{:.2f}"))
            cells += [_cell(r.get(f"vs_{a}"), fmt="{:.2f}x") for a in alternatives]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _caption(args: argparse.Namespace, rows: Sequence[dict[str, Any]]) -> str:
    params = next((r["params"] for r in rows if r.get("params")), None)
    size = f" ({params / 1e9:.2f} B parameters)" if params and params >= 1e8 else ""
    size = f" ({params / 1e6:.1f} M parameters)" if params and params < 1e8 else size
    return (
        f"{args.model}{size}, seq {args.seq}, synthetic tokens; median of {args.steps} timed steps after "
        f"{args.warmup} warm-up steps per batch; each slidekit run in its own process, each alternative in "
        "one process for all batches (model built once, peaks reset per batch). TFLOPS = (6 x params x "
        "tokens + 12 x layers x heads x head_dim x seq x tokens) / step s, recompute not counted. T_* = lane "
        "seconds per step / layers (T_d2h: the gradient copy alone); eta = T_bwd / (T_d2h + T_update); GPU busy = compute-lane time / step "
        "time; GPU busy in bwd = compute time / wall time of the backward pass; RSS B/param = peak RSS "
        "bytes / params; vs X = slidekit tokens/s / X's at the same batch."
    )


# ---------------------------------------------------------------------------- the command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``slidekit bench``."""
    p.add_argument("--model", default="tiny", help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--batch", default="8", help="batch sizes, comma-separated (e.g. 8,16,32)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic tokens (the same for every run)"
    )
    p.add_argument(
        "--baselines",
        default="none,torchao,deepspeed",
        help=f"alternatives, comma-separated, from: {', '.join(BASELINES)} ('none' = no offload); '' for none",
    )
    _engine_arguments(
        p, resident_help="slidekit residency modes, comma-separated: one run each (e.g. none,auto)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a slidekit run may take before it is killed; an alternative's one run over all "
        "batches gets this x the number of batches",
    )
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds for the whole benchmark (0: none)")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="append one JSON line per run")
    p.add_argument("--markdown", default=None, metavar="FILE.md", help="also write the table here")
    p.add_argument("--logs", default=None, metavar="DIR", help="keep each run's stdout and stderr here")
    p.add_argument(
        "--baselines-dir", default=None, help="a directory of replacement baseline scripts (default: the bundled ones, slidekit.tools.baselines)"
    )


def run_command(args: argparse.Namespace) -> int:
    """``slidekit bench``: run, print the table (and write it to --markdown)."""
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    rows = bench(args)
    text = _caption(args, rows) + "\n\n" + markdown_table(rows) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
