"""The ranks of a data-parallel run: process groups over torch.distributed, and failure reports.

One ``DataParallel`` per process (one process per GPU, or per CPU rank in
tests). It holds three process groups, one per thread that issues
collectives, so each group sees its collectives in one fixed order on every
rank whatever the threads' timing:

* ``grads``: the reduce-scatter of each unit's gradient, issued by the
  engine's ``d2h`` lane in the order units finish their backward;
* ``weights``: the all-gather of each unit's updated shards, issued by the
  ``h2d`` lane in the order uploads are queued;
* ``control``: the step's scalars (labelled tokens, loss, gradient norm) and
  the ranks' agreements (go on, stop), from the main thread; always gloo,
  on host scalars.

``grads`` and ``weights`` use NCCL on CUDA and gloo on the CPU unless
``backend`` names one ("gloo" lets ranks share one GPU, which NCCL refuses).

Failures: a rank whose step raises reports it under the store's
``slidekit/failed/<rank>`` key (``report``); every wait of every other rank
checks the store (``check_peers``, at most every ``CHECK_S``) and raises
``PeerFailed`` naming that rank and its error, so no rank waits on a
collective that a failed peer will never join. Waits that see no report are
bounded by the pipeline's ``timeout_s`` (and the groups' own timeout).

    dp = DataParallel.from_env(device)          # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    dp = DataParallel.init(store, rank=r, world=n, device=torch.device("cpu"))   # tests, own launchers

Test: ``pytest tests/distributed``.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from slidekit.errors import ConfigError, PipelineError

__all__ = ["CHECK_S", "DataParallel", "PeerFailed", "env_world"]

#: Seconds between two looks at the store for peers' failure reports while waiting.
CHECK_S = 0.05

_PREFIX = "slidekit/"


class PeerFailed(PipelineError):
    """Another rank of a data-parallel run failed (or stopped answering); this rank cannot go on.

    ``rank`` is the failed rank (None when none reported), ``reason`` its error as it reported it.
    """

    def __init__(self, message: str, *, rank: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


def env_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None outside a launched world."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ConfigError(
            f"RANK={os.environ.get('RANK')!r}, WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}, LOCAL_RANK="
            f"{os.environ.get('LOCAL_RANK')!r} must be integers (torchrun sets them)"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} must lie in [0, WORLD_SIZE={world}) (torchrun sets them)")
    return rank, world, local


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 2000 else text[:2000] + " ..."


class DataParallel:
    """This process's place in a data-parallel run: rank, world, process groups, failure reports."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world: int,
        device: torch.device,
        backend: str = "auto",
        timeout_s: float = 600.0,
        owns_default: bool = False,
    ) -> None:
        """Use ``init`` or ``from_env``; this constructor expects the default process group to exist."""
        if backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"the data-parallel backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError(f"backend 'nccl' needs CUDA tensors, but the device is {device}; use 'gloo'")
        self.rank = rank
        self.world = world
        self.device = device
        self.backend = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
        self.timeout_s = timeout_s
        self.store = dist.PrefixStore(_PREFIX, store)
        self._owns_default = owns_default
        self._reported = False
        self._lock = threading.Lock()
        self._last_check = 0.0
        self._peer: PeerFailed | None = None
        timeout = timedelta(seconds=timeout_s)
        ranks = list(range(world))
        # Every rank creates the groups in this order (new_group is collective over the default group).
        self.grads: Any = dist.new_group(ranks, timeout=timeout, backend=self.backend)
        self.weights: Any = dist.new_group(ranks, timeout=timeout, backend=self.backend)
        self.control: Any = dist.new_group(ranks, timeout=timeout, backend="gloo")
        self.store.set(f"pid/{rank}", str(os.getpid()))
        self.store.set(f"place/{rank}", _place(device))
        self._closed = False

    # ------------------------------------------------------------------ building

    @classmethod
    def init(
        cls,
        store: dist.Store,
        *,
        rank: int,
        world: int,
        device: torch.device,
        backend: str = "auto",
        timeout_s: float = 600.0,
    ) -> DataParallel:
        """Initialise torch.distributed's default group over ``store`` (unless it is) and the run's groups."""
        owns = not dist.is_initialized()
        if owns:
            data = ("nccl" if device.type == "cuda" else "gloo") if backend == "auto" else backend
            dist.init_process_group(
                data,
                store=dist.PrefixStore("torch/", store),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise ConfigError(
                f"torch.distributed is initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"not rank {rank} of {world}"
            )
        try:
            return cls(
                store, rank=rank, world=world, device=device, backend=backend, timeout_s=timeout_s,
                owns_default=owns,
            )  # fmt: skip
        except BaseException:
            if owns:
                dist.destroy_process_group()
            raise

    @classmethod
    def from_env(
        cls, device: torch.device, *, backend: str = "auto", timeout_s: float = 600.0
    ) -> DataParallel | None:
        """The run torchrun launched (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or None for one process.

        A world of one is no data-parallel run: None, and the engine runs exactly as without torchrun.
        """
        world = env_world()
        if world is None or world[1] == 1:
            return None
        rank, size, _ = world
        try:
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError):
            raise ConfigError(
                "WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (an integer); launch with "
                "`torchrun --nproc-per-node N -m slidekit finetune ...`, which sets them"
            ) from None
        # torchrun's agent hosts the store itself (TORCHELASTIC_USE_AGENT_STORE): every rank is a client.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
        store: dist.Store = dist.TCPStore(
            host, port, size, is_master=rank == 0 and not agent, timeout=timedelta(seconds=timeout_s),
            multi_tenant=True,
        )  # fmt: skip
        # The agent's store outlives a restart of the workers: each attempt keeps its own keys.
        store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        return cls.init(store, rank=rank, world=size, device=device, backend=backend, timeout_s=timeout_s)

    # ------------------------------------------------------------------ failures

    def report(self, exc: BaseException) -> None:
        """Tell the other ranks this one failed with ``exc`` (once; a peer's failure is not reported)."""
        if self._reported or self._closed or _caused_by_peer(exc):
            return
        self._reported = True
        try:
            self.store.set(f"failed/{self.rank}", _describe(exc))
            self.store.add("failures", 1)
        except Exception:  # the store is gone (rank 0 died): peers find out through their own waits
            pass

    def check_peers(self, *, now: bool = False) -> None:
        """Raise ``PeerFailed`` if another rank reported a failure (looks at most every ``CHECK_S``)."""
        if self._peer is not None:
            raise self._peer
        t = time.monotonic()
        if not now and t - self._last_check < CHECK_S:
            return
        with self._lock:
            self._last_check = t
            try:
                failures = self.store.add("failures", 0)
            except Exception as exc:  # the store lives in rank 0: it is gone
                self._peer = PeerFailed(
                    f"rank {self.rank}: the run's store (hosted by rank 0) stopped answering ({exc}); "
                    "rank 0 has died or was killed",
                    rank=0,
                    reason=str(exc),
                )
                raise self._peer from None
            if not failures:
                return
            failed = [r for r in range(self.world) if r != self.rank and self.store.check([f"failed/{r}"])]
            if not failed:
                return
            reasons = {r: self.store.get(f"failed/{r}").decode(errors="replace") for r in failed}
            first = failed[0]
            named = "; ".join(f"rank {r}: {why}" for r, why in reasons.items())
            self._peer = PeerFailed(
                f"rank {self.rank} stopped because rank {first} of {self.world} failed ({named}); "
                "see that rank's output for the whole error",
                rank=first,
                reason=reasons[first],
            )
        raise self._peer

    def failed_collective(self, what: str, exc: BaseException) -> NoReturn:
        """Raise ``PeerFailed`` for a collective that failed (a peer's connection closed): naming the
        rank that reported a failure, or the peers on this host no longer running."""
        self.check_peers(now=True)
        gone = self.gone_peers()
        raise PeerFailed(
            f"rank {self.rank}: {what} failed ({type(exc).__name__}: {exc}); "
            + (_name_gone(gone) if gone else "no rank reported a failure: a peer died or was killed"),
            rank=gone[0][0] if gone else None,
            reason=str(exc),
        ) from exc

    def gone_peers(self) -> list[tuple[int, int]]:
        """(rank, pid) of the peers on this host that are no longer running (a rank killed or died)."""
        gone = []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                pid = int(self.store.get(f"pid/{r}"))
                os.kill(pid, 0)
            except ProcessLookupError:
                gone.append((r, pid))
            except Exception:
                continue  # another host's rank, or the store is gone: nothing to tell
        return gone

    # ------------------------------------------------------------------ checkpoint parts

    def report_part(self, step: int, error: BaseException | None) -> None:
        """This rank's part of checkpoint ``step`` is committed (``error`` None) or failed."""
        self.store.set(f"ckpt/{step}/{self.rank}", "ok" if error is None else _describe(error))

    def wait_parts(self, step: int) -> None:
        """Block until every other rank reported its part of checkpoint ``step`` committed (rank 0's writer,
        before it commits the checkpoint); raise ``CheckpointError`` naming a rank that failed or did not
        report within ``timeout_s``, or ``PeerFailed`` when a rank failed outright."""
        from slidekit.checkpoint import CheckpointError

        pending = [r for r in range(self.world) if r != self.rank]
        start = time.monotonic()
        while pending:
            for r in list(pending):
                key = f"ckpt/{step}/{r}"
                if self.store.check([key]):
                    said = self.store.get(key).decode(errors="replace")
                    if said != "ok":
                        raise CheckpointError(
                            f"rank {r} could not write its part of checkpoint step {step}: {said}"
                        )
                    pending.remove(r)
            if not pending:
                return
            self.check_peers()
            if time.monotonic() - start > self.timeout_s:
                raise CheckpointError(
                    f"ranks {pending} did not report their part of checkpoint step {step} within "
                    f"{self.timeout_s:g} s; the checkpoint is not committed (raise engine.timeout_s for slow storage)"
                )
            time.sleep(CHECK_S)

    # ------------------------------------------------------------------ scalars and agreements

    def all_reduce(
        self, values: list[float], dtype: torch.dtype = torch.float64, *, op: str = "sum"
    ) -> list[float]:
        """The sum (``op`` "min", "max": the least, the greatest) over ranks of each of ``values`` (in
        ``dtype``, on the ``control`` group), bounded and failing fast when a peer failed. Call from the
        main thread only."""
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        t = torch.tensor(values, dtype=dtype)
        work = dist.all_reduce(t, op=ops[op], group=self.control, async_op=True)
        self.wait(work, "the step's scalars (all ranks)")
        return t.tolist()

    def same(self, value: int) -> bool:
        """True when every rank passes the same ``value`` (an integer below 2**52; one collective)."""
        top, neg_bottom = self.all_reduce([float(value), -float(value)], op="max")
        return top == -neg_bottom

    def sharing(self) -> tuple[int, int]:
        """How many ranks of the run (this one included) run on this host, and on this rank's device.

        Each rank publishes its host name and device (a GPU by its UUID, so ranks that see it under
        different indices count as one device) when it joins; a read waits at most the store's timeout.
        """
        mine = _place(self.device)
        places = [self.store.get(f"place/{r}").decode() for r in range(self.world)]
        host = mine.split("\n")[0]
        on_host = sum(p.split("\n")[0] == host for p in places)
        on_device = sum(p == mine for p in places) if self.device.type != "cpu" else 1
        return on_host, on_device

    def agree(self, flag: bool) -> bool:
        """True when every rank passes True (one collective on ``control``)."""
        return self.all_reduce([0.0 if flag else 1.0])[0] == 0.0

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective issued from the main thread outside the engine's pipeline."""
        start = time.monotonic()
        delay = 1e-4
        while not work.is_completed():
            self.check_peers()
            if time.monotonic() - start > self.timeout_s:
                self.check_peers(now=True)
                gone = self.gone_peers()
                raise PeerFailed(
                    f"rank {self.rank}: {what} did not complete within {self.timeout_s:g} s and no rank "
                    f"reported a failure{'; ' + _name_gone(gone) if gone else ''}: a rank is stuck, died, or "
                    "left the training loop early; if it is merely slow, raise engine.timeout_s",
                    rank=gone[0][0] if gone else None,
                )
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)
        try:
            work.wait()
        except Exception as exc:
            self.failed_collective(what, exc)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Let go of the groups (and of the default group when ``init`` created it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for group in (self.grads, self.weights, self.control):
            dist.destroy_process_group(group)
        if self._owns_default and dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return f"DataParallel(rank={self.rank}, world={self.world}, backend={self.backend!r})"


def _place(device: torch.device) -> str:
    """This process's host and device, as ``sharing`` compares them: "host\ndevice"."""
    import socket

    where = str(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        where = f"cuda {uuid}" if uuid is not None else f"cuda pci {getattr(props, 'pci_bus_id', device.index)}"
    return f"{socket.gethostname()}\n{where}"


def _name_gone(gone: list[tuple[int, int]]) -> str:
    return "; ".join(f"rank {r} (pid {pid}) is no longer running" for r, pid in gone)


def _caused_by_peer(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, PeerFailed):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
