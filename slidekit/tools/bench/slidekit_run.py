"""One slidekit benchmark process: every batch size of one residency mode and one recipe, a record each.

    python -m slidekit.tools.bench --model qwen2.5-3b --batch 8,32 --resident none --clip 1.0
    python -m slidekit.tools.bench --model tiny --device cpu --batch 2 --seq 64 --steps 2   # anywhere
    python -m slidekit.tools.bench --model qwen2.5-3b --batch 32 --resident none --clip 1.0 --clip-overlap defer
    python -m slidekit.tools.bench --model qwen2.5-3b --batch 8,32 --resident none --upload-copy on
    python -m slidekit.tools.bench --model qwen2.5-3b --batch 8,32 --resident none --update-order arrival

For each ``--batch`` in order: a fresh ``Trainer`` (its build is the record's ``setup_s``; the peak
RSS starts over before it, the peak GPU memory after it), then ``--warmup`` + ``--steps`` steps in
ONE ``fit`` call, so the first timed step starts with the warm-up's update backlog as every step of
a long run does. The timed steps are the last ``--steps`` of ``FitResult.step_seconds``: whole steps,
start to start, the last ending once every update is applied and the device is idle. The batch's JSON
line is printed at once (a run killed later keeps it). A batch that does not fit (the planner refuses
it, or the GPU runs out of memory) prints its reason and the next batch still runs. ``--recompute``
(``engine.recompute``) and ``--clip-overlap`` (``optim.clip_overlap``) are the levers; the record says
both, ``--upload-copy`` (``engine.upload_copy``) and ``--update-order`` (``engine.update_order``; the
record also says whether the plan took the forward order, ``forward_updates``), this process's alone:
``slidekit bench`` does not cross them, how many layers kept their activations (``kept_layers``) and, per timed step, whether it
speculated and rolled back (``clip_speculated``, ``clip_rollback``: the Trainer's step metrics, taken
from its ``slidekit_step_end`` hook).

Under ``python -m torch.distributed.run --nproc-per-node N`` it is one data-parallel run: the ranks
join one ``DataParallel`` for the whole process (every batch's ``Trainer`` shares it), ``--batch`` is
per GPU, every rank is fed the same seeded stream and takes every N-th batch of it
(``rank_batches``, from its own index: what a ``Trainer`` does with ``config.data``), a timed step is
the slowest rank's, and rank 0 alone prints the record: ``world``, ``tokens_per_s`` (every rank's
tokens), ``tokens_per_s_per_gpu`` and ``per_rank``, each rank's figures (``ranks``). A batch that fails
on any rank leaves the groups in an unknown state: the later batches are reported, not run.

``slidekit bench`` starts this module once per (mode, GPUs, recipe, repeat); ``benchmarks/train_throughput.py``
wraps it. Test: ``pytest tests/test_bench.py tests/test_bench_dp.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit.hookspecs import hookimpl
from slidekit.tools.bench.ranks import gather_ranks, host_update_s, rank_figures, slowest_steps
from slidekit.tools.bench.records import (
    does_not_fit,
    lane_metrics,
    peak_gpu_gib,
    peak_rss_gib,
    run_header,
    synthetic_tokens,
    throughput,
)
from slidekit.tools.presets import PRESETS, arch_spec, write_config

if TYPE_CHECKING:
    from slidekit.distributed import DataParallel

__all__ = ["engine_arguments", "main", "measure_slidekit", "slidekit_parser"]


def _config(args: argparse.Namespace, model_dir: str) -> Any:
    from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig

    return TrainConfig(
        model=ModelConfig(source=model_dir, random_init=True),
        data=DataConfig(seq_len=args.seq, batch_size=args.batch),
        optim=OptimConfig(
            lr=getattr(args, "lr", 1e-5), name=args.optimizer, max_grad_norm=args.clip, clip_overlap=args.clip_overlap
        ),
        engine=EngineConfig(
            device=args.device,
            kernels=args.kernels,
            activation_tier=args.activations,
            window=args.window,
            gpu_resident=args.resident,
            state_tier=args.state_tier,
            state_offload_tier=args.state_offload_tier,
            state_offload_fraction=args.state_offload_fraction,
            offload_dir=args.offload_dir,
            recompute=args.recompute,
            resident_weights=getattr(args, "resident_weights", "auto"),
            upload_copy=getattr(args, "upload_copy", "off"),
            update_order=getattr(args, "update_order", "auto"),
        ),
        run=RunConfig(trace=getattr(args, "trace", None)),
        steps=args.warmup + args.steps,
    )


class StepMetrics:
    """A lifecycle plugin: every step's metrics as the Trainer reports them (``slidekit_step_end``)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    @hookimpl
    def slidekit_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(dict(metrics))

    def per_step(self, key: str, last: int) -> list[int]:
        """``key`` of the last ``last`` steps, as whole numbers (0 where a step did not report it)."""
        return [int(m.get(key, 0.0)) for m in self.steps[-last:]] if last else []


def measure_slidekit(args: argparse.Namespace, parallel: DataParallel | None = None) -> dict[str, Any]:
    """Train ``args.warmup`` + ``args.steps`` steps of preset ``args.model`` at batch ``args.batch`` (one
    int, per GPU) in one ``fit``; the record of the timed steps (every rank's, with ``parallel``)."""
    import torch

    from slidekit import Batch, Trainer
    from slidekit.distributed.launch import rank_batches
    from slidekit.plugins import Plugins
    from slidekit.telemetry import reset_peak_rss

    scope = "batch" if reset_peak_rss() else "process"
    with tempfile.TemporaryDirectory() as tmp:
        write_config(args.model, Path(tmp), args.seq)
        config = _config(args, tmp)
        metrics = StepMetrics()  # rank 0's steps (lifecycle hooks run there): the rank that prints
        plugins = Plugins(
            entry_points=config.plugins.entry_points,
            block=config.plugins.block,
            extra=[("slidekit-bench-steps", metrics)],
        )
        t0 = time.perf_counter()
        trainer = Trainer(config, plugins=plugins, parallel=parallel)
        setup_s = time.perf_counter() - t0
        spec, device = trainer.spec, trainer.device
        engine = trainer.engine
        resident = f"{len(engine.window.resident)}/{len(spec.units)}"  # units keeping their weights there too
        device_state = f"{len(set(engine.window.resident) | engine.weights_slide)}/{len(spec.units)}"
        kept = sum(trainer.engine.keeps)  # layers keeping their activations (engine.recompute "auto")
        forward = engine.layout.forward_updates  # the plan took engine.update_order's forward order
        tokens = synthetic_tokens(spec.vocab_size, args.batch, args.seq, args.seed, repeat=args.repeat_batch)
        stream = (Batch(x, y) for x, y in tokens)
        data = rank_batches(stream, parallel)  # fit takes the batches it is given: rank r's share
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with trainer:
            result = trainer.fit(data, steps=args.warmup + args.steps)
            kernels, optimizer = trainer.selections["kernels"].name, trainer.selections["optimizer"].name
    timed = slice(args.warmup, None)
    own_seconds, timings = result.step_seconds[timed], result.timings[timed]
    if len(own_seconds) != args.steps:
        why = f" ({result.interrupted} ended it)" if result.interrupted else ""
        raise RuntimeError(f"fit ran {len(result.step_seconds)} steps of {args.warmup + args.steps}{why}")
    mine = rank_figures(setup_s=setup_s, timings=timings, step_seconds=own_seconds, device=device)
    ranks = gather_ranks(parallel, mine)
    step_seconds = slowest_steps(parallel, own_seconds)  # the ranks wait for each other every step
    world = 1 if parallel is None else parallel.world
    return {
        **run_header("slidekit", args, device),
        "resident": args.resident,
        "resident_units": resident,
        "device_state_units": device_state,  # units whose master and state live on the device (either way)
        "recompute": trainer.config.engine.recompute,
        "kept_layers": kept,
        "clip_overlap": trainer.config.optim.clip_overlap,
        "upload_copy": trainer.config.engine.upload_copy,
        "update_order": trainer.config.engine.update_order,  # asked for; "forward_updates": what the plan gave
        "forward_updates": forward,
        "resident_weights": trainer.config.engine.resident_weights,  # asked for; the plan's choice:
        "resident_weights_chosen": engine.layout.placement.resident_weights,
        "repeat_batch": args.repeat_batch,
        "lr": trainer.config.optim.lr,
        "clip_speculated": metrics.per_step("clip_speculated", args.steps),
        "clip_rollback": metrics.per_step("clip_rollback", args.steps),
        "activations": args.activations,
        "activation_tier": engine.layout.activation_tier,  # where "auto" put them
        "state_tier": args.state_tier,
        "state_offload": [args.state_offload_tier, args.state_offload_fraction]
        if args.state_offload_fraction
        else None,
        "window": args.window,
        "kernels": kernels,
        "optimizer": optimizer,
        "setup_s": max(float(r["setup_s"] or 0.0) for r in ranks),
        **throughput(spec, args.batch, args.seq, step_seconds, world=world),
        "backend": None if parallel is None else parallel.backend,
        "peak_gpu_gib": peak_gpu_gib(device),
        "peak_host_rss_gib": peak_rss_gib(),
        "peak_rss_scope": scope,
        "per_rank": ranks,
        "host_update_s": host_update_s(ranks),
        **lane_metrics(timings, own_seconds, spec.num_layers),
        "losses": [round(x, 4) for x in result.losses[timed]],
        "grad_norms": [round(x, 4) for x in result.grad_norms[timed]] if result.grad_norms else None,
    }


def _unavailable(args: argparse.Namespace, reason: str) -> dict[str, Any]:
    return {"system": "slidekit", "status": "unavailable", "batch": args.batch, "reason": reason}


def _measure_or_why(args: argparse.Namespace, parallel: DataParallel | None = None) -> dict[str, Any]:
    """``measure_slidekit``, or the record of why this batch cannot run (the next batch still runs in
    one process; with ``parallel`` the caller stops)."""
    import torch

    from slidekit.errors import SlidekitError

    try:
        record = measure_slidekit(args, parallel)
    except torch.OutOfMemoryError as exc:
        spec = arch_spec(args.model, args.seq)
        record = _unavailable(
            args, does_not_fit(str(exc), batch=args.batch, seq=args.seq, vocab=spec.vocab_size)
        )
        _tell_peers(parallel, exc)
    except SlidekitError as exc:  # the planner refusing a layout, a driver missing: its own message
        record = _unavailable(args, f"{type(exc).__name__}: {exc}")
        _tell_peers(parallel, exc)
    except BaseException as exc:
        _tell_peers(parallel, exc)
        raise
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if record["status"] == "ok" and not all(math.isfinite(x) for x in record["losses"]):
        record = {**record, "status": "failed", "reason": f"non-finite loss: {record['losses']}"}
    return record


def _tell_peers(parallel: DataParallel | None, exc: BaseException) -> None:
    """Report this rank's failure to the others (once; ``Trainer`` reports its own), so no rank waits in a
    gathering collective for one that left."""
    if parallel is not None:
        parallel.report(exc)


def slidekit_parser() -> argparse.ArgumentParser:
    """Options of one slidekit process (``python -m slidekit.tools.bench``, benchmarks/train_throughput.py)."""
    p = argparse.ArgumentParser(description="Training throughput of slidekit on a preset model shape.")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", default="8", help="batch sizes, comma-separated: one record each, in order")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up, in the same fit)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    p.add_argument("--clip", type=float, default=None, help="optim.max_grad_norm (default: no clipping)")
    p.add_argument("--lr", type=float, default=1e-5, help="optim.lr, constant (default: %(default)s)")
    p.add_argument(
        "--repeat-batch",
        action="store_true",
        help="train on one batch every step (the loss then falls: the largest-model runs)",
    )
    engine_arguments(p, resident_help="engine.gpu_resident: auto, none, all or a fraction")
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    p.add_argument("--trace", default=None, help="Chrome trace of the steps (open in Perfetto)")
    p.add_argument(
        "--resident-weights",
        default="auto",
        help="engine.resident_weights: keep, slide or auto (units on the GPU keep or slide their weights)",
    )
    p.add_argument(
        "--upload-copy",
        default="off",
        choices=("off", "on"),
        help="engine.upload_copy: on = host units upload a BF16 copy their update writes (2 B/param, not 4)",
    )
    p.add_argument(
        "--update-order",
        default="auto",
        choices=("auto", "arrival", "forward"),
        help="engine.update_order: host updates of an unclipped step as gradients arrive, or in the next "
        "forward's order (2 B/param more host RAM)",
    )
    return p


def engine_arguments(p: argparse.ArgumentParser, *, resident_help: str, crossed: bool = False) -> None:
    """The engine options a slidekit run takes (``slidekit bench`` passes them through; ``crossed``: its
    --recompute and --clip-overlap are comma-separated lists, crossed with the residency modes)."""
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kernels", default="auto", help="kernel-set driver, or auto")
    p.add_argument("--optimizer", default="layer_adam", help="slidekit optimizer driver")
    p.add_argument(
        "--activations",
        default="auto",
        help="engine.activation_tier: auto, device or a tier for boundary activations",
    )
    p.add_argument("--window", type=int, default=3, help="cache units taking turns on the device")
    p.add_argument("--resident", default="auto", help=resident_help)
    p.add_argument("--state-tier", default="ram", help="tier for the optimizer state of host units")
    p.add_argument("--state-offload-tier", default=None, help="a second tier for part of the state (posix)")
    p.add_argument(
        "--state-offload-fraction",
        type=float,
        default=0.0,
        help="fraction of host units whose state goes there",
    )
    p.add_argument("--offload-dir", default=None, help="directory for file-backed tiers")
    listed = "comma-separated, crossed with --resident (default: the engine's, auto): " if crossed else ""
    p.add_argument(
        "--recompute",
        default="auto",
        help=f"engine.recompute, {listed}auto (layers keep their activations where memory allows), "
        "all or none",
    )
    p.add_argument(
        "--clip-overlap",
        default="auto",
        help=f"optim.clip_overlap of clipped steps, {listed}auto, speculate or defer",
    )


def _join(args: argparse.Namespace) -> tuple[argparse.Namespace, DataParallel | None]:
    """Under torchrun with WORLD_SIZE > 1: ``args`` with this rank's device, and the run's groups (one
    ``DataParallel`` for every batch of the process); else ``(args, None)``."""
    from slidekit import EngineConfig, TrainConfig
    from slidekit.distributed.launch import launch

    config, parallel = launch(TrainConfig(engine=EngineConfig(device=args.device)))
    if parallel is None:
        return args, None
    return argparse.Namespace(**{**vars(args), "device": config.engine.device}), parallel


def main(argv: Sequence[str] | None = None) -> int:
    """Every ``--batch`` in order: print its JSON line at once (and append it to --out); under torchrun,
    rank 0 alone prints (module docstring)."""
    args = slidekit_parser().parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"--batch {args.batch!r}: give batch sizes as integers, e.g. 8,32") from None
    args, parallel = _join(args)
    ok = False
    stopped: str | None = None
    try:
        for batch in batches:
            if stopped is not None:
                record = _unavailable(argparse.Namespace(batch=batch), stopped)
            else:
                record = _measure_or_why(argparse.Namespace(**{**vars(args), "batch": batch}), parallel)
                if parallel is not None and record["status"] != "ok":
                    stopped = f"not run: batch {batch} failed on the ranks, whose groups cannot go on ({record['reason']})"
            ok |= record["status"] == "ok"
            if parallel is not None and parallel.rank != 0:
                continue  # rank 0's record has every rank's figures; lines of several processes interleave
            line = json.dumps(record)
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(line + "\n")
    finally:
        if parallel is not None:
            parallel.close()
    return 0 if ok else 1
