"""The Python API: ``Trainer(config).fit()``.

Building a Trainer resolves the device and precision, loads the plugins,
selects every driver (explicit names must work; "auto" says what it chose),
loads the model's config and weights into FP32 masters on the host, and
builds the engine. ``fit`` runs the steps and returns the losses.

Two parts live in modules of their own, as mixins of ``Trainer``: building
the engine (``slidekit.building``: tiers, the layout planned on this machine,
the refusal of what does not fit) and the export (``slidekit.exporting``).

    from slidekit import Trainer, TrainConfig
    with Trainer(TrainConfig(steps=50)) as trainer:
        result = trainer.fit()
    print(result.losses[0], "->", result.losses[-1])
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slidekit import leftovers
from slidekit.building import EngineBuilding
from slidekit.config import TrainConfig
from slidekit.data import Batch, PackedDataset, StepCount
from slidekit.data.configured import configured_datasets, configured_summary, run_step_count
from slidekit.data.epochs import needs_rows
from slidekit.distributed import DataParallel
from slidekit.distributed.checkpoints import resume_run, run_directory
from slidekit.distributed.launch import describe, launch, on_rank_zero, rank_batches
from slidekit.distributed.weights import fill_shards
from slidekit.engine import Engine
from slidekit.errors import ConfigError, ModelLoadError
from slidekit.export import check_target
from slidekit.exporting import Exporting
from slidekit.graceful import GracefulStop
from slidekit.identity import changed_settings, effective_lr, run_identity
from slidekit.inputs import seq_len_refusal
from slidekit.interfaces import StorageTier
from slidekit.lr_schedule import lr_factor
from slidekit.models.loading import (
    DEMO_MODEL,
    weight_files,
)
from slidekit.owned import Leftover
from slidekit.param_groups import param_groups
from slidekit.planning import Estimate, Machine, Planner
from slidekit.plugins import Plugins, Selection
from slidekit.reporting import check_loggers
from slidekit.resolve import resolve
from slidekit.run import RunDirectory
from slidekit.telemetry import Progress, hiding_factor, memory_metrics, model_flops, step_tflops
from slidekit.trace import TraceWriter, rank_path

__all__ = ["FitResult", "Trainer", "param_groups"]


@dataclass(slots=True)
class FitResult:
    """What ``fit`` returns."""

    losses: list[float]
    tokens: int
    seconds: float
    #: Whole steps: start of step i+1 - start of step i, the last ending once every update is applied
    #: and the device is idle (``Engine.drain``); data, metrics and evaluation between steps included.
    step_seconds: list[float] = field(default_factory=list)
    timings: list[dict[str, float]] = field(default_factory=list)  # seconds per pipeline lane, per step
    grad_norms: list[float] = field(default_factory=list)  # global gradient norm per step, before clipping
    interrupted: str | None = None  # the signal ("SIGINT", "SIGTERM", "SIGHUP") that ended the run early
    speculated: int = 0  # steps that updated host units during the backward (optim.clip_overlap)
    rollbacks: int = 0  # ... of which clipped (or were not finite) and were restored and redone exactly

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _hiding_factor(timings: dict[str, float]) -> dict[str, float]:
    """``hiding_factor`` (``slidekit.telemetry.hiding_factor``) of a step's lane seconds; nothing for a step
    that sent nothing to the host (every unit resident)."""
    eta = hiding_factor(timings)
    return {} if eta is None else {"hiding_factor": eta}


class Trainer(EngineBuilding, Exporting):
    """Fine-tunes every parameter of a model with the sliding engine."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        plugins: Plugins | None = None,
        progress: bool = False,
        fault_hook: Callable[[str], None] | None = None,
        machine: Machine | None = None,
        parallel: DataParallel | None = None,
    ) -> None:
        """Build everything a run needs. ``fault_hook(lane)`` is called before every pipeline task
        ("h2d", "d2h", "optim") and every visit of the main thread ("main"): a seam for fault and
        delay injection in tests. ``machine`` stands in for this machine's measured memory and disk
        (what-if planning, tests); the run is refused when it does not fit (``slidekit.planning``)."""
        self._owned_parallel: DataParallel | None = None
        if parallel is None:  # under torchrun (WORLD_SIZE > 1): this rank's device and the run's groups
            config, parallel = launch(config)
            self._owned_parallel = parallel
        self.config = config
        self.parallel = parallel  # this process's rank of a data-parallel run (slidekit.distributed)
        self._machine = machine
        self._machine_shared = False  # a data-parallel rank's machine is its agreed share of the host's
        self.planner: Planner | None = None
        self.estimate: Estimate | None = None
        self._fault_hook = fault_hook
        self.progress = progress and (parallel is None or parallel.rank == 0)  # rank 0's bar only
        self.plugins = plugins or Plugins(
            entry_points=config.plugins.entry_points, block=config.plugins.block
        )
        check_loggers(config, self.plugins)  # a logger no plugin answers to: refused now
        self.plugins = on_rank_zero(self.plugins, parallel)  # loggers and other lifecycle hooks: rank 0's
        self.setup = setup = resolve(config, self.plugins)
        self.device, self.compute_dtype, self.spec = setup.device, setup.compute_dtype, setup.spec
        self.hf_config, self.model_dir = setup.hf_config, setup.model_dir
        self.selections: dict[str, Selection] = setup.selections
        self.notes = [s.reason for s in self.selections.values() if s.automatic]
        self.lr: float = effective_lr(config.model.source, config.optim.lr)
        if config.optim.lr is None:
            self.notes.append(f"learning rate {self.lr:g} (the default for this model; set optim.lr / --lr)")
        if parallel is not None:
            self.notes.append(describe(parallel, config.data.batch_size, config.grad_accum))

        self._tiers: dict[str, StorageTier] = {}
        self._engine: Engine | None = None
        self.run: RunDirectory | None = None
        self._datasets: tuple[PackedDataset, PackedDataset | None] | None = None
        self._consumed = 0  # batches taken from the configured data (restored on resume)
        self._identity: dict[str, Any] | None = None
        self._kept_leftovers: list[Leftover] = []  # other runs' offload files, named if space runs short
        self._guards: list[Any] | None = None  # what an export may not replace (export_guards), once
        self._files: dict[str, Path] | None = None  # the model's weight files (weight_files), looked up once
        self._saving: list[Any] = []  # checkpoints not yet reported saved (SaveHandle)
        self._logged: dict[str, tuple[int, float]] = {}  # loss / eval_loss -> (step, value), for the card
        self._tokenizer: Any | None = None
        # The run's step count, fixed now (an epochs run reads its data here): config.steps holds it from here
        # on, in the saved configuration too, and a resume of the same data counts the same.
        rows = len(self.datasets()[0]) if needs_rows(config.steps, config.epochs) else None
        self.step_count: StepCount = run_step_count(config, rows)
        if config.steps != self.step_count.total:
            self.config = config = dataclasses.replace(config, steps=self.step_count.total)
        if self.step_count.source == "epochs":
            self.notes.append(self.step_count.describe())
        try:
            if config.run.export_dir:  # refused before any training: a target the export would refuse, and
                check_target(  # a run without a tokenizer (the export writes it)
                    config.run.export_dir,
                    overwrite=config.run.overwrite,
                    guards=self._export_guards(),
                    dtype=config.run.export_dtype,
                )
                self.tokenizer()
            if config.run.dir:  # claimed (locked) before the engine is built: a second run is refused at once
                hook = self._fault_hook
                on_stage = (lambda stage, _detail: hook(f"checkpoint:{stage}")) if hook else None
                self.run = run_directory(config, parallel, progress=on_stage)  # data-parallel: rank 0's, or a part
            reclaimed = leftovers.reclaim(config)  # before planning: what killed runs left is free again
            self._kept_leftovers = reclaimed.kept
            self.notes += reclaimed.notes(config.engine.offload_dir)
            self._engine = self._build_engine()
            if self.run is not None:
                self.identity()  # fingerprint the weights and data as they are now, before training
            target = config.run.resume_target()
            if target is not None:
                assert self.run is not None
                meta = resume_run(self.run, self._engine, target, self.identity(), parallel)
                self._consumed = int(meta["batches_consumed"])
                done = self._engine.steps_done
                self.notes.append(f"resumed from step {done} of {config.steps} ({self.run.resumed_from})")
                if "resharded" in meta:  # another world size wrote it (slidekit.distributed.reshard)
                    self.notes.append(meta["resharded"])
                changed = changed_settings(meta.get("config", {}), config.to_dict())
                if changed:
                    self.notes.append("resumed with changed settings: " + "; ".join(changed))
            else:
                self._load_weights()
            if self.run is not None:  # everything checked: only now is config.json written
                self.run.start()
        except BaseException as exc:
            if self.parallel is not None:  # the other ranks must not wait for this one
                self.parallel.report(exc)
            run = self.run
            self.close()
            fresh = config.run.resume_target() is None
            if run is not None and fresh:  # a fresh run that never started leaves no trace
                run.abandon()
            raise

    # ------------------------------------------------------------------ building

    def _weight_files(self) -> dict[str, Path]:
        """The model's safetensors files by tensor name, looked up once ({} for random or demo weights)."""
        if self._files is None:
            mc = self.config.model
            fresh = mc.random_init or mc.source == DEMO_MODEL
            self._files = {} if fresh else weight_files(self.model_dir)
        return self._files

    def _load_weights(self) -> None:
        mc = self.config.model
        assert self._engine is not None
        fresh = mc.random_init or mc.source == DEMO_MODEL
        files = self._weight_files()
        if not files and not fresh:
            raise ModelLoadError(
                f"{str(self.model_dir)!r} has no model.safetensors or model.safetensors.index.json; "
                "set model.random_init (CLI: --random-init) to start from random weights"
            )
        shards = None if self._engine.collectives is None else self._engine.collectives.shards
        fill_shards(self.spec, self._engine.host.masters, shards, files, mc.init_seed)
        self._engine.sync_resident()

    # ------------------------------------------------------------------ data

    def datasets(self) -> tuple[PackedDataset, PackedDataset | None]:
        """The training set and the held-out set (None without ``eval_fraction``) of ``config.data``."""
        if self._datasets is None:
            self._check_seq_len()
            self._datasets = configured_datasets(
                self.config, self.tokenizer(), vocab_size=self.spec.vocab_size
            )
        return self._datasets

    def data_summary(self) -> str:
        """What ``config.data`` became (documents, tokens, labelled tokens, rows, truncation, steps per
        epoch) and the run's step count: what ``slidekit finetune`` prints before the first step."""
        train, held_out = self.datasets()
        steps = self.step_count
        if steps.per_epoch is None:  # a run of config.steps: its epochs are known once the data is
            per_step = self.config.data.batch_size * self.config.grad_accum
            steps = dataclasses.replace(steps, per_epoch=len(train) // per_step)
        return configured_summary(self.config, train, held_out, steps)

    def _check_seq_len(self) -> None:
        why = seq_len_refusal(self.config.data.seq_len, self.spec.max_positions)
        if why:
            raise ConfigError(why)

    def default_batches(self) -> Iterator[Batch]:
        """Endless shuffled training batches from ``config.data`` (the sample corpus when no path is set)."""
        dc = self.config.data
        batches = self.datasets()[0].batches(dc.batch_size, dc.seed + self.config.seed)
        return rank_batches(batches, self.parallel)  # data-parallel: every world-th batch, from the rank's

    def eval_loss(self) -> float | None:
        """Loss on the held-out split of ``config.data`` (None when there is none)."""
        held_out = self.datasets()[1]
        return None if held_out is None else self.evaluate(held_out.one_pass(self.config.data.batch_size))

    # ------------------------------------------------------------------ training

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the trainer is closed")
        return self._engine

    def fit(self, batches: Iterable[Batch] | None = None, *, steps: int | None = None) -> FitResult:
        """Train ``steps`` steps on ``batches`` (default: ``config.data``).

        ``steps`` defaults to the steps left of the run's step count
        (``step_count``: ``config.steps``, or ``config.epochs`` passes over
        ``config.data``): all of them for a fresh run, the rest for a resumed one.

        Each step takes ``config.grad_accum`` batches as micro-batches. The
        learning-rate schedule counts steps across calls, over the run's step count.
        SIGINT, SIGTERM or SIGHUP ends the run after the current step (``interrupted``
        says which); a second one abandons the step. If anything raises, the
        trainer closes (threads, buffers and tier storage are released).
        """
        engine = self.engine
        steps = max(0, self.step_count.total - engine.steps_done) if steps is None else steps
        configured = batches is None
        data = (
            iter(batches)
            if batches is not None
            else itertools.islice(self.default_batches(), self._consumed, None)
        )
        trace = None
        if self.config.run.trace:  # every span of every step, written when fit ends (also on failure)
            rank = 0 if self.parallel is None else self.parallel.rank
            trace = TraceWriter(rank_path(self.config.run.trace, rank), engine.timeline, device=str(self.device))
        drivers = {k: s.name for k, s in self.selections.items()}
        done = engine.steps_done
        bar = Progress(done + steps, initial=done, enabled=self.progress)  # a resumed run's starts at done
        for note in self.notes:
            bar.write(note)
        result = FitResult([], 0, 0.0)
        starts: list[float] = []  # when each step began
        t0 = time.perf_counter()
        try:
            # In the try: a logger that cannot start (its library missing) stops the run before its first
            # step, and every plugin still gets slidekit_fit_end with the error.
            self.plugins.hook.slidekit_fit_start(config=self.config, drivers=drivers, steps_done=done)
            with GracefulStop() as stop:
                for step in range(1, steps + 1):
                    micro = list(itertools.islice(data, self.config.grad_accum))
                    go = not stop.signal and len(micro) == self.config.grad_accum
                    if self.parallel is not None:  # data-parallel: every rank takes the step, or none does
                        go = self.parallel.agree(go)
                    if not go:
                        break  # interrupted, or the data ran out (on any rank): no partial step
                    t_step = time.perf_counter()
                    starts.append(t_step)
                    metrics = self._step(engine, step, micro, result)
                    if trace is not None:
                        trace.step(engine.steps_done, t_step, time.perf_counter(), metrics)
                    self._consumed += len(micro) if configured else 0
                    self._after_step(engine, metrics, bar, last=step == steps)
                    bar.update(metrics)
                engine.drain()
                ends = [*starts[1:], time.perf_counter()] if starts else []
                result.step_seconds = [b - a for a, b in zip(starts, ends, strict=True)]
                if self.run is not None:  # the final state is on disk before fit returns
                    if self.run.last_saved != engine.steps_done:
                        self.checkpoint()
                    self.run.wait()
                    self._report_saved(bar)
        except BaseException as exc:
            if self.parallel is not None:  # the other ranks must not wait for this one
                self.parallel.report(exc)
            bar.close()
            if trace is not None:
                trace.close(error=exc)
            self.plugins.hook.slidekit_fit_end(steps=len(result.losses), error=exc)
            self.close()  # the pipeline is in an unknown state: release everything
            raise
        bar.close()
        if trace is not None:
            trace.close()
        self.plugins.hook.slidekit_fit_end(steps=len(result.losses), error=None)
        result.seconds = time.perf_counter() - t0
        result.interrupted = stop.signal
        return result

    def _after_step(self, engine: Engine, metrics: dict[str, float], bar: Progress, last: bool) -> None:
        step = engine.steps_done
        every = self.config.data.eval_every
        if self.config.data.eval_fraction and ((every and step % every == 0) or (last and not every)):
            loss = self.eval_loss()
            if loss is not None:
                metrics["eval_loss"] = loss
                bar.write(f"step {step}: eval loss {loss:.3f}")
                self.plugins.hook.slidekit_evaluate(step=step, metrics={"eval_loss": loss})
        self.plugins.hook.slidekit_step_end(step=step, metrics=metrics)
        self._logged.update({k: (step, metrics[k]) for k in ("loss", "eval_loss") if k in metrics})
        if self.run is not None:
            self.run.log(step, metrics)
            every = self.config.run.checkpoint_every
            if every and step % every == 0:
                self.checkpoint()
            self._report_saved(bar)

    def _report_saved(self, bar: Progress | None) -> None:
        """Say which checkpoints have completed since the last call (on the bar, and to the plugins'
        ``slidekit_checkpoint_saved``), in the order they were taken; failed ones are ``RunDirectory.wait``'s
        to raise."""
        while self._saving and self._saving[0].done():
            handle = self._saving.pop(0)
            if handle.exception(0) is not None:
                continue
            path = handle.result(0)
            if bar is not None:
                bar.write(f"saved checkpoint step {handle.step} -> {path}")
            self.plugins.hook.slidekit_checkpoint_saved(step=handle.step, path=path)

    def checkpoint(self) -> Any:
        """Write a checkpoint of the current state into ``run.dir`` (asynchronously; returns the SaveHandle)."""
        if self.run is None:
            raise ConfigError("checkpoints need a run directory: set run.dir (CLI: --run-dir)")
        engine = self.engine
        meta = {
            "step": engine.steps_done,
            "updates_applied": engine.updates_applied,
            "batches_consumed": self._consumed,
            "model": RunDirectory.model_identity(engine),
            "config": self.config.to_dict(),
            "identity": self.identity(),
        }
        deferred = self.config.optim.max_grad_norm is not None or self.config.optim.on_nonfinite == "skip"
        handle = self.run.save(engine, meta, deferred_updates=deferred)
        self._saving.append(handle)
        return handle

    def identity(self) -> dict[str, Any]:
        """What a resume of this run may not change (``slidekit.identity``), computed once."""
        if self._identity is None:
            self._identity = run_identity(self.config, self.spec, self.model_dir, self._weight_files())
        return self._identity

    def _step(self, engine: Engine, step: int, micro: list[Batch], result: FitResult) -> dict[str, float]:
        """One optimizer step; records it in ``result`` and returns its metrics."""
        oc = self.config.optim
        lr = self.lr * self._lr_factor(engine.steps_done + 1)
        res = engine.train_step(
            [(b.input_ids, b.labels) for b in micro],
            lr,
            max_grad_norm=oc.max_grad_norm,
            skip_nonfinite=oc.on_nonfinite == "skip",
            clip_overlap=oc.clip_overlap,
        )
        if res.skipped:
            warnings.warn(
                f"step {step}: loss {res.loss} / gradient norm {res.grad_norm} is not finite; "
                "the step was skipped (optim.on_nonfinite='skip')",
                RuntimeWarning,
                stacklevel=3,
            )
        result.losses.append(res.loss)
        result.timings.append(res.timings)
        result.grad_norms.append(res.grad_norm)
        result.speculated += res.speculated
        result.rollbacks += res.rolled_back
        result.tokens += res.tokens
        flops = sum(model_flops(self.spec, b.input_ids.numel(), b.input_ids.shape[1]) for b in micro)
        if self.parallel is not None:  # every rank's, as res.tokens counts every rank's tokens
            flops = self.parallel.all_reduce([flops])[0]
        return {
            "loss": res.loss,
            "tokens": float(res.tokens),
            "seconds": res.seconds,
            "tokens_per_s": res.tokens / res.seconds if res.seconds else 0.0,
            **_hiding_factor(res.timings),
            "grad_norm": res.grad_norm,
            "skipped": float(res.skipped),
            "clip_speculated": float(res.speculated),
            "clip_rollback": float(res.rolled_back),
            "lr": lr,
            **step_tflops(flops, res.seconds, 1 if self.parallel is None else self.parallel.world),
            **memory_metrics(self.device),  # gpu_mem_gib (CUDA only), host_rss_gib
            **{f"t_{lane}": t for lane, t in res.timings.items()},
        }

    def _lr_factor(self, step: int) -> float:
        oc = self.config.optim
        return lr_factor(
            step,
            schedule=oc.schedule,
            total=self.step_count.total,
            warmup=oc.warmup(self.step_count.total),
            min_ratio=oc.min_lr_ratio,
        )

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> float:
        """Mean cross-entropy over the labelled tokens of ``batches``, with the current weights."""
        total, labelled = 0.0, 0
        for b in batches:
            total += float(self.engine.forward(b.input_ids, b.labels))
            labelled += int((b.labels != -100).sum())
        if not labelled:
            raise ValueError("the evaluation batches hold no labelled token")
        return total / labelled

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face name -> FP32 parameter (a copy), once every update has been applied."""
        return {k: v.clone() for k, v in self.engine.master_state().items()}

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Finish pending checkpoints, stop the threads, release device memory, host buffers and tier
        storage. Idempotent."""
        if self.run is not None:
            run, self.run = self.run, None
            run.close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        for tier in self._tiers.values():
            tier.close()
        self._tiers.clear()
        if self._owned_parallel is not None:
            parallel, self._owned_parallel = self._owned_parallel, None
            parallel.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
