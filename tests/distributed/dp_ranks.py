"""Run a function on N CPU ranks (gloo over a FileStore) for the data-parallel tests.

``run_ranks(fn, world, *args)`` starts ``world`` processes from a forkserver
that has torch and slidekit imported already (a process starts in well under
a second that way), calls ``fn(rank, world, store_path, *args)`` in each on
one intra-op thread, and returns one ``Outcome`` per rank: its result, or
the exception it raised (type, message, traceback). It never waits forever:
processes still running at the deadline are killed and named in a
``TimeoutError``.

``train(rank, world, store_path, job)`` is the training job the tests run:
the tiny model through ``Trainer``, each rank on its rank-strided share of
the same batches; with ``world`` 1, the single-process run of the same
global batch (``grad_accum`` = ranks x micro-batches per rank).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slidekit.hookspecs import hookimpl

PRELOAD = ["torch", "torch.distributed", "slidekit.trainer", "slidekit.distributed"]


@dataclass
class Outcome:
    """What one rank returned or raised."""

    rank: int
    result: Any = None
    error: str | None = None  # the exception's type name
    message: str = ""
    trace: str = ""
    seconds: float = 0.0  # from the start of all ranks to this rank's end
    extra: dict[str, Any] = field(default_factory=dict)

    def ok(self) -> Any:
        assert self.error is None, f"rank {self.rank} raised {self.error}: {self.message}\n{self.trace}"
        return self.result


def _child(
    fn: Callable[..., Any], rank: int, world: int, store: str, out: str, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)
    outcome = Outcome(rank)
    try:
        outcome.result = fn(rank, world, store, *args)
    except BaseException as exc:
        outcome.error, outcome.message, outcome.trace = type(exc).__name__, str(exc), traceback.format_exc()
    with open(out, "wb") as f:
        pickle.dump(outcome, f)
    os._exit(0)  # do not wait on gloo threads of collectives a failed peer left pending


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list[Outcome]:
    """``fn(rank, world, store_path, *args)`` on ``world`` processes; their outcomes in rank order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="slidekit-dp-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(world)]
        start = time.monotonic()
        procs = [ctx.Process(target=_child, args=(fn, r, world, store, outs[r], args)) for r in range(world)]
        for p in procs:
            p.start()
        ends: dict[int, float] = {}
        deadline = start + timeout
        while len(ends) < world and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in ends and not p.is_alive():
                    ends[r] = time.monotonic() - start
            time.sleep(0.02)
        stuck = [r for r in range(world) if r not in ends]
        for r in stuck:
            procs[r].kill()
        for p in procs:
            p.join(5)
        if stuck:
            raise TimeoutError(f"ranks {stuck} of {world} were still running after {timeout:g} s (killed)")
        outcomes = []
        for r in range(world):
            path = Path(outs[r])
            if not path.exists():
                outcomes.append(Outcome(r, error="Died", message=f"exit code {procs[r].exitcode}"))
                continue
            with path.open("rb") as f:
                outcome = pickle.load(f)
            outcome.seconds = ends[r]
            outcomes.append(outcome)
        return outcomes


# ---------------------------------------------------------------------- the training job


@dataclass
class Job:
    """One training run of the tiny model: the data, the settings, and what to inject."""

    model_dir: str
    ranks: int  # the world the global batch is cut for (the single-process run takes it all)
    steps: int = 3
    micro: int = 1  # micro-batches per rank per step
    batch: int = 2
    seq_len: int = 16
    lr: float = 1e-4
    optimizer: str = "layer_adam"
    max_grad_norm: float | None = None
    clip_overlap: str = "auto"  # optim.clip_overlap
    gpu_resident: str = "none"
    compute_dtype: str = "float32"  # engine.compute_dtype ("bfloat16" for engine.upload_copy "on")
    window: int = 3
    # engine.timeout_s: how long a rank waits for the others. A rank that builds the fused CPU kernel on
    # its first step (~30 s alone, longer on a loaded machine) keeps the others waiting that long.
    timeout_s: float = 120.0
    fail_rank: int | None = None  # this rank raises ...
    fail_lane: str = "optim"  # ... in this pipeline lane ("main": on the main thread) ...
    fail_step: int = 2  # ... during this step
    fault: str = "raise"  # "raise" (Injected), "exit" (the process dies), "data" (its batches raise)
    engine: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)  # RunConfig fields
    fit_steps: int | None = None  # steps this run trains (None: what is left of ``steps``)
    skip_steps: int = 0  # steps whose batches an earlier run took (a resumed run skips them)
    configured: bool = False  # train on config.data (the sample corpus), not on ``_batches``
    shards: bool = False  # return the rank's shards (masters and state) as restored and as trained
    device: str = "cpu"  # engine.device ("cuda": every rank on the one GPU, with backend "gloo")
    backend: str = "auto"  # DataParallel.init's


class Injected(RuntimeError):
    """The fault a test injects into one rank."""


#: An optimizer that declares its state not linear (``Job(optimizer=WHOLE_ADAM)``): layer_adam's
#: arithmetic, updated a unit (a shard) whole, whose state a re-sharded resume cannot re-cut.
WHOLE_ADAM = "whole_adam"


class _WholeAdamPlugin:
    @hookimpl
    def slidekit_optimizers(self) -> Any:
        from slidekit.interfaces import OptimizerDescriptor
        from slidekit_optim.layer_adam import LayerAdam

        class WholeAdam(LayerAdam):
            name = WHOLE_ADAM
            linear_state = False

        yield OptimizerDescriptor(name=WHOLE_ADAM, factory=WholeAdam)


def own_shards(engine: Any) -> dict[str, Any]:
    """This rank's shard of every unit: where it starts, its master, its optimizer state (copies)."""
    engine.wait_updates()
    state = engine.host.state
    out: dict[str, Any] = {}
    for u, master in enumerate(engine.host.masters):
        mapped = state.mapped(u)
        out[u] = {
            "start": 0 if engine.collectives is None else engine.collectives.shards[u].start,
            "master": master.detach().cpu().clone(),
            "state": {
                name: mapped[name].cpu().clone() if mapped is not None else state.read_buffer(u, name)
                for name in state.layout(u)
            },
        }
    return out


def _upload_copies(engine: Any) -> list[int]:
    """The units whose upload copy (``engine.upload_copy``) this rank keeps: every host unit, no resident
    one; each must equal the BF16 cast of the rank's master (its shard), or the copy is stale."""
    engine.wait_updates()
    out = []
    for u, (copy, master) in enumerate(zip(engine.host.copies, engine.host.masters, strict=True)):
        slides = engine.layout.units[u].slides  # resident units keep none: their weights are on the device
        assert (copy is not None) == (slides and engine.layout.upload_copy), f"unit {u}"
        if copy is not None:
            want = master.to(torch.bfloat16)
            assert copy.view(torch.int16).equal(want.view(torch.int16)), f"unit {u}: stale copy"
            assert copy.numel() == master.numel()  # the shard's, not the whole unit's
            out.append(u)
    return out


def _batches(job: Job, vocab: int) -> list[Any]:
    from slidekit.testing.models import random_batches

    return random_batches(
        vocab, steps=job.steps * job.ranks * job.micro, batch=job.batch, seq_len=job.seq_len
    )


def train(rank: int, world: int, store: str, job: Job) -> dict[str, Any]:
    """Train ``job`` as rank ``rank`` of ``world`` (1: the single-process reference of the same global batch)."""
    import torch.distributed as dist

    from slidekit import DataConfig, EngineConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig, Trainer
    from slidekit.distributed import DataParallel

    config = TrainConfig(
        model=ModelConfig(source=job.model_dir),
        optim=OptimConfig(
            lr=job.lr,
            weight_decay=0.1,
            name=job.optimizer,
            max_grad_norm=job.max_grad_norm,
            clip_overlap=job.clip_overlap,
        ),
        engine=EngineConfig(
            device=job.device,
            compute_dtype=job.compute_dtype,
            gpu_resident=job.gpu_resident,
            window=job.window,
            timeout_s=job.timeout_s,
            **job.engine,
        ),
        data=DataConfig(batch_size=job.batch, seq_len=job.seq_len),
        run=RunConfig(**job.run),
        steps=job.steps,
        grad_accum=job.micro * (job.ranks if world == 1 else 1),
    )
    parallel = None
    if world > 1:
        parallel = DataParallel.init(
            dist.FileStore(store, world), rank=rank, world=world, device=torch.device(job.device),
            backend=job.backend, timeout_s=job.timeout_s,
        )  # fmt: skip
    trainer_ref: list[Any] = []  # the trainer, once built: the hook asks it for the step

    def hook(lane: str) -> None:
        engine = trainer_ref[0].engine if trainer_ref else None
        if engine is not None and lane == job.fail_lane and engine.steps_done + 1 == job.fail_step:
            if job.fault == "exit":
                os._exit(3)
            raise Injected(f"injected failure on rank {rank}, lane {lane}")

    def failing(batches: list[Any]) -> Any:
        for i, b in enumerate(batches):
            if i == (job.fail_step - 1) * job.micro:
                raise Injected(f"injected data failure on rank {rank}")
            yield b

    injected = job.fail_rank == rank and job.fault != "data"
    plugins = None
    if job.optimizer == WHOLE_ADAM:
        from slidekit import Plugins

        plugins = Plugins(extra=[("whole-adam", _WholeAdamPlugin())])
    try:
        with Trainer(config, parallel=parallel, plugins=plugins, fault_hook=hook if injected else None) as t:
            trainer_ref.append(t)
            batches = _batches(job, t.spec.vocab_size)
            mine = batches if world == 1 else batches[rank::world]
            per_step = job.micro * (job.ranks if world == 1 else 1)
            mine = mine[job.skip_steps * per_step :]
            if job.fail_rank == rank and job.fault == "data":
                mine = failing(mine)
            init = t.state_dict() if world == 1 else None
            restored = own_shards(t.engine) if job.shards else None
            result = t.fit(None if job.configured else mine, steps=job.fit_steps)
            host = t.engine.host
            return {
                "restored": restored,
                "trained": own_shards(t.engine) if job.shards else None,
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "state": t.state_dict(),
                "init": init,
                "steps_done": t.engine.steps_done,
                "speculated": result.speculated,
                "rollbacks": result.rollbacks,
                "notes": list(t.notes),
                "master_numel": sum(m.numel() for m in host.masters),
                "state_bytes": sum(host.state.nbytes(u) for u in range(len(host.masters))),
                "weights_slide": [u.index for u in t.engine.layout.units if u.weights_slide],
                "upload_copies": _upload_copies(t.engine),
            }
    finally:
        if parallel is not None:
            parallel.close()
