"""Joining a data-parallel run that torchrun launched: this rank's device, its groups, its share of the data.

    torchrun --nproc-per-node 2 -m slidekit finetune --model DIR ...

torchrun starts one process per rank with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``
set; ``Trainer`` calls ``launch(config)``, which (for a world of more than
one) binds the rank to ``cuda:LOCAL_RANK`` (modulo the GPUs there are, so
ranks may share one) unless the configured device names one, and joins the
run's process groups (``DataParallel.from_env``). The groups' backend is
NCCL on CUDA, gloo on the CPU and wherever ranks share a GPU (NCCL refuses
two ranks on one device); ``SLIDEKIT_DP_BACKEND=gloo|nccl`` overrides it.

CPU threads (``host_threads``): torchrun sets ``OMP_NUM_THREADS=1`` for every
rank unless told otherwise, which would leave each rank's host update (the
optimizer's threads are torch's) on one core. A rank of a run with several
ranks per host therefore takes its share of the host's CPUs, ``CPUs // local
ranks``, when it finds that default; ``SLIDEKIT_CPU_THREADS=N`` sets the
count outright. The run's note says how many each rank uses.

Data: rank ``r`` of ``N`` takes batches ``r, r + N, r + 2N, ...`` of the
one shuffled stream a single process would read (``rank_batches``), so a
step of ``grad_accum`` micro-batches per rank trains on ``N x grad_accum``
consecutive batches of that stream: the batch of a single process with
``N x grad_accum`` micro-batches. Output: the progress bar, the lifecycle
hooks (loggers) and the export are rank 0's (``on_rank_zero``); the CLI's
standard output too (``quiet_unless_rank_zero``).

Test: ``pytest tests/distributed/test_dp_launch.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from slidekit import hookspecs
from slidekit.distributed.group import DataParallel, env_world
from slidekit.errors import ConfigError

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.plugins import Plugins

__all__ = [
    "ENV_BACKEND",
    "ENV_THREADS",
    "describe",
    "host_threads",
    "launch",
    "on_rank_zero",
    "quiet_unless_rank_zero",
    "rank_batches",
    "rank_zero",
]

#: Overrides the backend of the gradient and weight collectives: "gloo" or "nccl".
ENV_BACKEND = "SLIDEKIT_DP_BACKEND"

#: Sets the CPU threads of each rank (its host update's), over torchrun's OMP_NUM_THREADS=1 default.
ENV_THREADS = "SLIDEKIT_CPU_THREADS"

T = TypeVar("T")


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def host_threads(local_world: int) -> int:
    """Set this rank's CPU threads (see the module doc) and return how many it uses."""
    own = os.environ.get(ENV_THREADS, "").strip()
    if own:
        try:
            threads = int(own)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ConfigError(f"{ENV_THREADS}={own!r} must be a positive integer (CPU threads per rank)")
        torch.set_num_threads(threads)
    elif os.environ.get("OMP_NUM_THREADS", "").strip() == "1" and local_world > 1:
        torch.set_num_threads(max(1, _usable_cpus() // local_world))
    return torch.get_num_threads()


def _device(config: TrainConfig, local: int) -> tuple[TrainConfig, torch.device, int]:
    """The config with this rank's device, the device, and how many ranks of this host share a GPU."""
    from slidekit.devices import resolve_device

    device = resolve_device(config.engine.device)
    if device.type != "cuda":
        return config, device, 1
    count = torch.cuda.device_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if device.index is None:
        device = torch.device("cuda", local % count)
        engine = dataclasses.replace(config.engine, device=str(device))
        config = dataclasses.replace(config, engine=engine)
        return config, device, -(-local_world // count)
    return config, device, local_world  # every local rank on the one configured GPU


def launch(config: TrainConfig) -> tuple[TrainConfig, DataParallel | None]:
    """Under torchrun with WORLD_SIZE > 1: ``config`` on this rank's device, and the run's ``DataParallel``.

    Otherwise ``(config, None)``: one process, the single-process engine.
    """
    world = env_world()
    if world is None or world[1] == 1:
        return config, None
    import torch.distributed as dist

    if dist.is_initialized():
        raise ConfigError(
            "torch.distributed is initialised already, so slidekit cannot join torchrun's run by itself; "
            "pass Trainer(config, parallel=slidekit.distributed.DataParallel.init(store, rank=..., "
            "world=..., device=...)) with the store your group was made from"
        )
    rank, size, local = world
    host_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    config, device, sharing = _device(config, local)
    backend = os.environ.get(ENV_BACKEND, "auto").strip().lower() or "auto"
    if backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"{ENV_BACKEND}={backend!r} must be 'gloo' or 'nccl' (or unset: automatic)")
    if backend == "auto" and device.type == "cuda" and sharing > 1:
        backend = "gloo"  # NCCL wants one GPU per rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel = DataParallel.from_env(device, backend=backend, timeout_s=config.engine.timeout_s)
    assert parallel is not None and parallel.rank == rank and parallel.world == size
    return config, parallel


def rank_batches(batches: Iterable[T], parallel: DataParallel | None) -> Iterator[T]:
    """This rank's share of ``batches``: every ``world``-th one, from the rank's own index."""
    if parallel is None:
        return iter(batches)
    return itertools.islice(batches, parallel.rank, None, parallel.world)


def describe(parallel: DataParallel, batch_size: int, grad_accum: int) -> str:
    """The note a data-parallel run prints: its ranks and its effective batch."""
    n = parallel.world
    return (
        f"data-parallel: rank {parallel.rank} of {n} ({parallel.backend}); each step trains on {n} ranks x "
        f"{grad_accum} micro-batches x {batch_size} rows = {n * grad_accum * batch_size} rows (the batch of one "
        f"process with grad_accum {n * grad_accum}); rank r reads batches r, r + {n}, ... of the data; "
        f"{torch.get_num_threads()} CPU threads per rank ({ENV_THREADS} sets them)"
    )


# ---------------------------------------------------------------------- rank 0's output

#: The lifecycle hooks (those returning nothing: loggers, tools); drivers' hooks yield descriptors.
LIFECYCLE = frozenset(
    name
    for name, fn in vars(hookspecs).items()
    if name.startswith("slidekit_")
    and callable(fn)
    and inspect.signature(fn).return_annotation in (None, "None")
)


class _QuietRelay:
    """A hook relay that does not call the lifecycle hooks."""

    def __init__(self, relay: Any) -> None:
        self._relay = relay

    def __getattr__(self, name: str) -> Any:
        if name in LIFECYCLE:
            return _nothing
        return getattr(self._relay, name)


def _nothing(**_: Any) -> list[Any]:
    return []


class _RankPlugins:
    """``Plugins`` as a rank other than 0 sees them: drivers as they are, lifecycle hooks silent."""

    def __init__(self, plugins: Plugins) -> None:
        self._plugins = plugins
        self.hook = _QuietRelay(plugins.hook)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plugins, name)


def on_rank_zero(plugins: Plugins, parallel: DataParallel | None) -> Plugins:
    """``plugins`` whose lifecycle hooks (loggers and the like) run on rank 0 only."""
    if parallel is None or parallel.rank == 0:
        return plugins
    return cast("Plugins", _RankPlugins(plugins))


def rank_zero() -> bool:
    """Whether this process is rank 0 of a torchrun world, or no rank at all (one process)."""
    world = env_world()
    return world is None or world[0] == 0


def quiet_unless_rank_zero() -> contextlib.AbstractContextManager[Any]:
    """Standard output discarded on the ranks other than 0 of a torchrun world (the CLI's messages)."""
    if rank_zero():
        return contextlib.nullcontext()
    return contextlib.redirect_stdout(open(os.devnull, "w"))
