"""The memory planner: what a run needs on the GPU, in host RAM and on disk, and whether it fits.

``Planner.estimate(placement, machine)`` adds up, for one model, workload and
placement (where optimizer state, boundary activations and whole units live),
every buffer the engine allocates:

GPU (the compute device)
    window       ``window`` cache units (+1 for a tied embedding), each parameters + gradients in the
                 compute dtype, sized for the largest unit that is not resident
    resident     units kept on the device: FP32 master, optimizer state, weights and gradients
    staging      one 64 MiB FP32 buffer that uploads are cast through (BF16 compute)
    activations  boundary activations of every layer and micro-batch (``activation_tier="device"``),
                 or the two in flight when they live on a tier
    hidden       the hidden states and their gradients of every micro-batch, as they flow
    working      the peak of one step's work beyond those: the head (final norm, the fused loss's
                 logits chunk, the head weight's gradient before it is added into the cache unit) or
                 one layer's recompute + backward (the tensors autograd keeps, plus the MLP's gradients)

Host RAM
    masters      FP32 masters of the units that are not resident
    state        optimizer state on tiers whose medium is "host"
    staging      three chunk-sized staging sets when state is streamed from a disk tier
    gradients    the shared gradient ring (and, with clipping or skipping, one buffer per unit)
    activations  boundary activations on a host tier
    runtime      the process itself (Python, torch, CUDA libraries): a fixed allowance

Disk (``engine.offload_dir``)
    state, activations on tiers whose medium is "disk"

Run directory (``run.dir``)
    checkpoints  the checkpoints the run must find room for at once, up to ``run.keep + 1``
                 (``slidekit.run_space``); on the offload directory's file system, after the offload files

The layer-working term follows the tensors ``slidekit.models.decoder.layer_forward``
keeps for backward (per token: 4 hidden-sized, 3 head-sized per query head and
2 per key/value head, and the SwiGLU's gate, up and output, then their three
gradients); ``tests/gpu/test_planner.py`` checks the GPU total against
``torch.cuda.max_memory_allocated`` within 10% on the H200.

A run directory that lacks that room is refused up front too, instead of at the first checkpoint,
after training. ``Planner.recommend`` walks the placements from fastest to slowest (more
units resident on the GPU; activations on the device, then in RAM; state in
RAM, then a growing share on disk) and returns the first that fits. The
trainer refuses a configuration that does not fit before it allocates
anything, with the numbers and that recommendation.

    slidekit plan --model DIR --batch-size 8 --seq-len 1024      # what a run needs, and what fits

Test: ``pytest tests/test_planner.py``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from slidekit.config import resident_fraction
from slidekit.errors import ConfigError
from slidekit.models.base import ArchSpec
from slidekit.plan import place_state, plan_residency, ring_numel
from slidekit.run_space import checkpoint_bytes, checkpoint_writes, run_dir_need
from slidekit.telemetry import proc_sizes

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.interfaces import UnitOptimizer
    from slidekit.plugins import Plugins
    from slidekit.resolve import RunSetup

__all__ = [
    "GIB",
    "Estimate",
    "Machine",
    "Placement",
    "PlanReport",
    "Planner",
    "Workload",
    "fmt_gib",
    "plan_run",
]

GIB = 1 << 30
#: Bytes of the FP32 staging buffer uploads are cast through (engine.core.UPLOAD_CHUNK elements).
UPLOAD_STAGING = 4 << 24
#: Host memory the process itself takes (interpreter, torch, CUDA libraries), beyond the planned buffers.
RUNTIME_HOST = {"cpu": 1 << 30, "cuda": 3 << 30, "rocm": 3 << 30}
#: The GPU must have this share of the planned bytes spare (allocator rounding, library workspaces).
DEVICE_HEADROOM = 0.05
#: ... and this much on top (cuBLAS workspaces, Triton and CUDA-graph pools).
DEVICE_SLACK = 512 << 20
#: "auto" residency leaves max(RESIDENT_RESERVE, 5% of the device) free beyond the plan.
RESIDENT_RESERVE = 4 << 30


def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Tokens per step: micro-batches of ``batch_size`` rows of ``seq_len`` tokens, ``grad_accum`` of them."""

    batch_size: int
    seq_len: int
    grad_accum: int = 1

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch_size * self.seq_len


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Where state, activations and whole units live: the fields of ``EngineConfig`` the planner chooses."""

    state_tier: str = "ram"
    state_offload_tier: str | None = None
    state_offload_fraction: float = 0.0
    activation_tier: str = "device"
    gpu_resident: str = "auto"

    @classmethod
    def of(cls, engine: object) -> Placement:
        """The placement an ``EngineConfig`` asks for."""
        return cls(**{f.name: getattr(engine, f.name) for f in dataclasses.fields(cls)})

    def flags(self) -> str:
        """The ``slidekit finetune`` options that select this placement."""
        out = [f"--gpu-resident {self.gpu_resident}", f"--state-tier {self.state_tier}"]
        if self.state_offload_fraction and self.state_offload_tier:
            out += [
                f"--state-offload-tier {self.state_offload_tier}",
                f"--state-offload-fraction {self.state_offload_fraction:g}",
            ]
        out.append(f"--activation-tier {self.activation_tier}")
        return " ".join(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class Machine:
    """What the machine has: free device memory, available RAM, free disk in the offload directory."""

    device_type: str  # "cpu", "cuda" or "rocm"
    device_free: int | None = None  # None on the CPU: the compute device's memory is host RAM
    device_total: int | None = None
    host_available: int
    host_total: int
    disk_free: int | None = None  # None: no offload directory given
    run_dir_free: int | None = None  # free space where run.dir lives; None: no run directory
    run_dir_checkpoints: int = 0  # step-* checkpoints already in the run directory
    run_dir_shares_disk: bool = False  # the run directory is on the offload directory's file system

    @classmethod
    def probe(cls, device: object, offload_dir: str | None, run_dir: str | None = None) -> Machine:
        """Measure this machine, for ``device`` (a torch.device), ``offload_dir`` and ``run_dir``."""
        import torch

        dev = torch.device(str(device))
        free = total = None
        kind = "cpu"
        if dev.type == "cuda":
            free, total = torch.cuda.mem_get_info(dev)
            kind = "rocm" if torch.version.hip else "cuda"
        info = proc_sizes("/proc/meminfo")
        host_total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        host_available = info.get("MemAvailable", host_total)
        disk = run_free = None
        existing, shared = 0, False
        if offload_dir:
            disk = shutil.disk_usage(_existing(offload_dir)).free
        if run_dir:
            from slidekit.checkpoint import step_dirs

            run_free = shutil.disk_usage(_existing(run_dir)).free
            existing = len(step_dirs(Path(run_dir).expanduser() / "checkpoints"))
            if offload_dir:
                shared = os.stat(_existing(run_dir)).st_dev == os.stat(_existing(offload_dir)).st_dev
        return cls(
            device_type=kind,
            device_free=free,
            device_total=total,
            host_available=host_available,
            host_total=host_total,
            disk_free=disk,
            run_dir_free=run_free,
            run_dir_checkpoints=existing,
            run_dir_shares_disk=shared,
        )

    def describe(self) -> str:
        parts = []
        if self.device_free is not None:
            parts.append(f"GPU {fmt_gib(self.device_free)} free of {fmt_gib(self.device_total or 0)}")
        parts.append(f"RAM {fmt_gib(self.host_available)} available of {fmt_gib(self.host_total)}")
        if self.disk_free is not None:
            parts.append(f"disk {fmt_gib(self.disk_free)} free")
        if self.run_dir_free is not None:
            parts.append(f"run directory {fmt_gib(self.run_dir_free)} free")
        return ", ".join(parts)


def _existing(directory: str) -> Path:
    """``directory``, or its nearest existing ancestor (it may not exist yet: ask its file system)."""
    path = Path(directory).expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Bytes a placement needs, per component, on each medium."""

    placement: Placement
    resident: tuple[bool, ...]  # per unit: kept on the device for good
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)
    run_dir: dict[str, int] = field(default_factory=dict)  # checkpoints in run.dir
    run_dir_fix: str = ""  # what to do when the run directory lacks room

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk.values())

    @property
    def run_dir_bytes(self) -> int:
        return sum(self.run_dir.values())

    def shortfalls(self, machine: Machine) -> list[str]:
        """One line per medium that lacks room, with the numbers (empty when the run fits)."""
        return self._placement_shortfalls(machine) + self._run_dir_shortfalls(machine)

    def placement_fits(self, machine: Machine) -> bool:
        """Whether GPU, RAM and offload disk hold the placement (the run directory aside)."""
        return not self._placement_shortfalls(machine)

    def _run_dir_shortfalls(self, machine: Machine) -> list[str]:
        need = self.run_dir_bytes
        if not need or machine.run_dir_free is None:
            return []
        free = machine.run_dir_free - (self.disk_bytes if machine.run_dir_shares_disk else 0)
        if need <= free:
            return []
        shared = " after the offload files (the same file system)" if machine.run_dir_shares_disk else ""
        return [
            f"run directory: needs {fmt_gib(need)} ({_parts(self.run_dir)}), has {fmt_gib(max(free, 0))} "
            f"free{shared}: {self.run_dir_fix}"
        ]

    def _placement_shortfalls(self, machine: Machine) -> list[str]:
        out = []
        host_need = self.host_bytes
        if machine.device_free is None:  # CPU: "device" buffers are host memory
            host_need += self.device_bytes
        else:
            need = self.device_bytes * (1 + DEVICE_HEADROOM) + DEVICE_SLACK
            if need > machine.device_free:
                out.append(
                    f"GPU memory: needs {fmt_gib(need)} ({_parts(self.device)}, plus "
                    f"{DEVICE_HEADROOM:.0%} + {DEVICE_SLACK >> 20} MiB headroom), has {fmt_gib(machine.device_free)} free"
                )
        if host_need > machine.host_available:
            parts = dict(self.host)
            if machine.device_free is None:
                parts.update({f"device {k}": v for k, v in self.device.items()})
            out.append(
                f"host RAM: needs {fmt_gib(host_need)} ({_parts(parts)}), has {fmt_gib(machine.host_available)} available"
            )
        if self.disk_bytes:
            if machine.disk_free is None:
                out.append(
                    f"disk: needs {fmt_gib(self.disk_bytes)} ({_parts(self.disk)}) but no engine.offload_dir "
                    "(CLI: --offload-dir) is set"
                )
            elif self.disk_bytes > machine.disk_free:
                out.append(
                    f"disk: needs {fmt_gib(self.disk_bytes)} ({_parts(self.disk)}), has "
                    f"{fmt_gib(machine.disk_free)} free in the offload directory"
                )
        return out

    def fits(self, machine: Machine) -> bool:
        return not self.shortfalls(machine)

    def table(self, device: str = "GPU") -> str:
        """The components, one per line, grouped by medium (``device`` names the compute device)."""
        lines = []
        media = (
            (device, self.device),
            ("host RAM", self.host),
            ("disk", self.disk),
            ("run directory", self.run_dir),
        )
        for medium, parts in media:
            if not parts:
                continue
            lines.append(f"  {medium:<24} {fmt_gib(sum(parts.values())):>12}")
            lines += [f"    {name:<22} {fmt_gib(n):>12}" for name, n in parts.items() if n]
        resident = sum(self.resident)
        lines.append(f"  {resident} of {len(self.resident)} units resident on the {device}")
        if 0 < resident < len(self.resident):
            host = ", ".join(str(u) for u, r in enumerate(self.resident) if not r)
            lines.append(f"  units on the host (spread over the backward order): {host}")
        return "\n".join(lines)


def _parts(parts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {fmt_gib(v)}" for k, v in parts.items() if v)


class Planner:
    """Memory estimates and placement recommendations for one model and workload.

    ``state_bytes(numel)`` is the optimizer state of a unit of ``numel``
    parameters; ``media`` maps tier names to "device", "host" or "disk".
    ``device_updates``: the optimizer can update units on the device (only
    then can units be resident). ``keep_grads``: every unit's gradients stay
    on the host until the step ends (global-norm clipping, skipping non-finite
    steps).
    """

    def __init__(
        self,
        spec: ArchSpec,
        workload: Workload,
        *,
        compute_itemsize: int,
        state_bytes: Callable[[int], int],
        media: Mapping[str, str],
        device_type: str,
        window: int = 3,
        grad_buffers: int = 2,
        state_chunk: int = 1 << 22,
        loss_workspace: int = 768 << 20,
        device_updates: bool = True,
        keep_grads: bool = False,
        linear_state: bool = True,
        checkpoint_keep: int | None = None,
        checkpoint_writes: int = 0,
    ) -> None:
        self.spec = spec
        self.workload = workload
        self.itemsize = compute_itemsize
        self.numels = [u.numel for u in spec.units]
        self._state_bytes = state_bytes
        self.state = [state_bytes(n) for n in self.numels]
        self.state_per_param = sum(self.state) / sum(self.numels)
        self.media = dict(media)
        self.device_type = device_type
        self.window = window
        self.grad_buffers = grad_buffers
        self.state_chunk = state_chunk
        self.loss_workspace = loss_workspace
        self.device_updates = device_updates
        self.keep_grads = keep_grads
        self.linear_state = (
            linear_state  # gradients come down in layer-sized pieces (slidekit.plan.ring_numel)
        )
        self.checkpoint_keep = checkpoint_keep  # run.keep (None: every checkpoint is kept)
        self.checkpoint_writes = checkpoint_writes  # checkpoints the run writes at most (0: no run.dir)

    @classmethod
    def for_run(
        cls, config: TrainConfig, setup: RunSetup, *, optimizer: UnitOptimizer, plugins: Plugins
    ) -> Planner:
        """The planner of a configured run: its model, workload, engine settings and drivers."""
        from slidekit.engine.state import is_linear

        ec, dc, oc = config.engine, config.data, config.optim

        def state_bytes(numel: int) -> int:
            return sum(n * dt.itemsize for dt, n in optimizer.state_layout(numel).values())

        return cls(
            setup.spec,
            Workload(batch_size=dc.batch_size, seq_len=dc.seq_len, grad_accum=config.grad_accum),
            compute_itemsize=setup.itemsize,
            state_bytes=state_bytes,
            media={r.name: r.descriptor.medium for r in plugins.drivers("tier")},
            device_type=setup.family,
            window=ec.window,
            grad_buffers=ec.grad_buffers,
            state_chunk=ec.state_chunk,
            loss_workspace=setup.selections["kernels"].descriptor.loss_workspace_bytes,
            device_updates=bool(getattr(optimizer, "device_capable", False)),
            keep_grads=oc.max_grad_norm is not None or oc.on_nonfinite == "skip",
            linear_state=is_linear(optimizer),
            checkpoint_keep=config.run.keep,
            checkpoint_writes=checkpoint_writes(config),
        )

    # ------------------------------------------------------------------ pieces

    def medium(self, tier: str) -> str:
        try:
            return self.media[tier]
        except KeyError:
            raise ConfigError(f"unknown storage tier {tier!r}; known tiers: {sorted(self.media)}") from None

    def _slots(self) -> int:
        return self.window + (1 if self.spec.tie_embeddings else 0)

    def window_bytes(self, resident: Sequence[bool]) -> int:
        """Cache units: parameters + gradients, sized for the largest unit that slides."""
        sliding = [n for n, r in zip(self.numels, resident, strict=True) if not r]
        return 2 * self._slots() * max(sliding, default=1) * self.itemsize

    def resident_cost(self, unit: int) -> int:
        """Device bytes of one resident unit: FP32 master, optimizer state, weights and gradients."""
        return self.numels[unit] * (4 + 2 * self.itemsize) + self.state[unit]

    def flow_bytes(self, activation_tier: str) -> dict[str, int]:
        """Activations, the flowing hidden states and the working peak of a step, on the device."""
        s, w, sp = self.itemsize, self.workload, self.spec
        n, h, a = w.tokens, sp.hidden_size, w.grad_accum
        per_layer = n * h * s  # one boundary activation of one micro-batch
        on_device = activation_tier == "device" or self.medium(activation_tier) == "device"
        acts = sp.num_layers * a * per_layer if on_device else 2 * per_layer
        hidden = a * per_layer  # the micro-batches' hidden states, later their gradients
        return {"activations": acts, "hidden": hidden, "working": max(self.head_work(), self.layer_work())}

    def layer_work(self) -> int:
        """One layer's recompute + backward beyond its input and output gradient (see the module doc)."""
        sp, s, n = self.spec, self.itemsize, self.workload.tokens
        d = sp.head_dim
        kept = 4 * sp.hidden_size + (3 * sp.num_heads + 2 * sp.num_kv_heads) * d + 3 * sp.intermediate_size
        grads = 3 * sp.intermediate_size
        return n * s * (kept + grads) + n * 4 * (2 + sp.num_heads)  # + FP32 norm scales and attention LSE

    def head_work(self) -> int:
        """The head's norm output and its gradient, the weight gradient before accumulation, the logits."""
        sp, s, n = self.spec, self.itemsize, self.workload.tokens
        logits = min(
            self.loss_workspace, 3 * 4 * n * sp.vocab_size
        )  # no kernel keeps 3 FP32 copies of all logits
        return 2 * n * sp.hidden_size * s + sp.vocab_size * sp.hidden_size * s + logits + 8 * n

    def checkpoint_bytes(self) -> int:
        """Disk space of one checkpoint: every unit's FP32 master and optimizer state, and its files."""
        return checkpoint_bytes(self.numels, self.state)

    # ------------------------------------------------------------------ estimates

    def residency(self, placement: Placement, machine: Machine) -> list[bool]:
        """Units kept on the device: the configured share, or for "auto" what the device's spare memory holds."""
        fraction = resident_fraction(placement.gpu_resident)
        units = len(self.numels)
        free = machine.device_free
        on_cpu = free is None
        if not on_cpu and not self.device_updates:
            return [False] * units  # an optimizer that updates on the CPU only: nothing can stay on the GPU
        if fraction is not None:  # as configured (on the CPU "resident" units are updated in place in RAM)
            return plan_residency(self.numels, bytes_per_param=0, budget=0, fraction=fraction)
        if free is None:
            return [False] * units  # "auto" on the CPU: nothing to gain
        nothing = [False] * units
        fixed = (
            self.window_bytes(nothing)
            + UPLOAD_STAGING
            + sum(self.flow_bytes(placement.activation_tier).values())
        )
        reserve = max(RESIDENT_RESERVE, (machine.device_total or 0) // 20)
        budget = free - fixed - reserve
        per_param = 4 + 2 * self.itemsize + self.state_per_param
        return plan_residency(self.numels, bytes_per_param=per_param, budget=max(budget, 0))

    def estimate(
        self, placement: Placement, machine: Machine, resident: Sequence[bool] | None = None
    ) -> Estimate:
        """Bytes ``placement`` needs on each medium (``resident`` overrides the residency plan)."""
        res = tuple(self.residency(placement, machine) if resident is None else resident)
        s, sp, w = self.itemsize, self.spec, self.workload
        device: dict[str, int] = {"window": self.window_bytes(res)}
        device["resident"] = sum(self.resident_cost(u) for u, r in enumerate(res) if r)
        device["staging"] = UPLOAD_STAGING if s < 4 and not all(res) else 0
        device.update(self.flow_bytes(placement.activation_tier))

        host: dict[str, int] = {"masters": 4 * sum(n for n, r in zip(self.numels, res, strict=True) if not r)}
        disk: dict[str, int] = {}
        offload = place_state(len(self.numels), placement.state_offload_fraction)
        state = {"device": 0, "host": 0, "disk": 0}
        streamed = False
        for unit, (off, on_dev) in enumerate(zip(offload, res, strict=True)):
            if on_dev:
                continue  # counted with the resident unit
            tier = (
                placement.state_offload_tier if off and placement.state_offload_tier else placement.state_tier
            )
            medium = self.medium(tier)
            state[medium] += self.state[unit]
            streamed |= medium == "disk"
        if state["device"]:
            device["state"] = state["device"]
        host["state"] = state["host"]
        staged = min(self.state_chunk, max(self.numels))  # three staging sets of one chunk's state
        host["state staging"] = 3 * self._state_bytes(staged) if streamed else 0
        sliding = [n for n, r in zip(self.numels, res, strict=True) if not r]
        kinds = [u.kind for u in sp.units]
        ring = ring_numel(self.numels, kinds, [not r for r in res], pieces=self.linear_state)
        host["gradients"] = self.grad_buffers * ring * s + (s * sum(sliding) if self.keep_grads else 0)
        acts_medium = (
            "device" if placement.activation_tier == "device" else self.medium(placement.activation_tier)
        )
        acts = sp.num_layers * w.grad_accum * w.tokens * sp.hidden_size * s
        if acts_medium == "host":
            host["activations"] = acts
        elif acts_medium == "disk":
            disk["activations"] = acts
        host["runtime"] = RUNTIME_HOST.get(self.device_type, RUNTIME_HOST["cuda"])
        if state["disk"]:
            disk["state"] = int(state["disk"])
        host = {k: int(v) for k, v in host.items()}
        run_dir, fix = run_dir_need(
            self.checkpoint_bytes(), self.checkpoint_keep, self.checkpoint_writes, machine.run_dir_checkpoints
        )
        return Estimate(
            placement=placement,
            resident=res,
            device=device,
            host=host,
            disk=disk,
            run_dir=run_dir,
            run_dir_fix=fix,
        )

    # ------------------------------------------------------------------ recommendations

    def candidates(self, base: Placement, disk_tier: str | None) -> list[Placement]:
        """Placements from the fastest to the slowest, keeping ``base``'s tier choices where they work.

        More units resident first (where the optimizer can update on the
        device); then activations on the device before a host tier; then state
        in RAM before a growing share (1/4, 1/2, 3/4, all) on ``disk_tier``;
        activations on disk last.
        """
        host_tier = base.state_tier if self.medium(base.state_tier) == "host" else "ram"
        acts_host = base.activation_tier if base.activation_tier != "device" and self.medium(
            base.activation_tier) == "host" else "ram"  # fmt: skip
        if self.device_type == "cpu":
            residents = [base.gpu_resident]  # the CPU computes where the masters are: nothing to choose
        else:
            residents = ["all", "auto"] if self.device_updates else ["none"]
        out: list[Placement] = []
        fractions = [0.0] + ([0.25, 0.5, 0.75, 1.0] if disk_tier else [])
        for fraction in fractions:
            for acts in ("device", acts_host):
                for res in residents:
                    out.append(
                        Placement(
                            state_tier=host_tier,
                            state_offload_tier=disk_tier if fraction else None,
                            state_offload_fraction=fraction,
                            activation_tier=acts,
                            gpu_resident=res,
                        )
                    )
        if disk_tier:
            out.append(dataclasses.replace(out[-1], activation_tier=disk_tier))
        return list(dict.fromkeys(out))

    def recommend(
        self, base: Placement, machine: Machine, disk_tier: str | None = "posix"
    ) -> Estimate | None:
        """The fastest placement that fits ``machine``, or None. ``disk_tier`` may hold optimizer state
        where the machine has an offload directory (``disk_free`` known)."""
        for placement in self.candidates(base, disk_tier if machine.disk_free is not None else None):
            est = self.estimate(placement, machine)
            if est.placement_fits(machine):  # no placement gives the run directory more room
                return est
        return None


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """What ``slidekit plan`` prints: the run, the machine, the requested placement and the best that fits."""

    summary: str
    machine: Machine
    requested: Estimate
    recommended: Estimate | None
    refusals: tuple[str, ...] = ()  # what makes the run impossible whatever the memory (e.g. too long rows)

    @property
    def fits(self) -> bool:
        return not self.refusals and self.requested.fits(self.machine)

    def render(self) -> str:
        lines = [self.summary, f"machine: {self.machine.describe()}", ""]
        device = "GPU" if self.machine.device_free is not None else "compute device (host RAM)"
        lines.append(f"requested placement: {self.requested.placement.flags()}")
        lines.append(self.requested.table(device))
        problems = [*self.refusals, *self.requested.shortfalls(self.machine)]
        lines.append("verdict: fits" if not problems else "verdict: does NOT fit")
        lines += [f"  {p}" for p in problems]
        rec = self.recommended
        if rec is None:
            lines.append(
                "\nno placement fits: lower --batch-size (raise --grad-accum to keep the tokens per step), "
                "use --optimizer adamw_8bit, or give --offload-dir so optimizer state can go to disk"
            )
        elif rec.placement != self.requested.placement or problems:
            lines.append(f"\nfastest placement that fits: {rec.placement.flags()}")
            lines.append(rec.table(device))
        return "\n".join(lines)


def plan_run(
    config: TrainConfig, *, plugins: Plugins | None = None, machine: Machine | None = None
) -> PlanReport:
    """Plan ``config`` on this machine (or on ``machine``) without loading any weight."""
    from slidekit.plugins import Plugins
    from slidekit.resolve import build_optimizer, resolve

    plugins = plugins or Plugins(entry_points=config.plugins.entry_points, block=config.plugins.block)
    setup = resolve(config, plugins)
    optimizer = build_optimizer(config, setup)
    planner = Planner.for_run(config, setup, optimizer=optimizer, plugins=plugins)
    machine = machine or Machine.probe(setup.device, config.engine.offload_dir, config.run.dir)
    placement = Placement.of(config.engine)
    requested = planner.estimate(placement, machine)
    recommended = planner.recommend(placement, machine)
    spec, dc = setup.spec, config.data
    summary = (
        f"model: {config.model.source} ({spec.family}, {spec.num_layers} layers, {_count(spec.num_params)} "
        f"parameters); micro-batches of {dc.batch_size} x {dc.seq_len} tokens, {config.grad_accum} per step; "
        f"{str(setup.compute_dtype)[6:]} on {setup.device}\n"
        f"drivers: optimizer {optimizer.name} ({planner.state_per_param:.2f} B/param of state), kernels "
        f"{setup.selections['kernels'].name}"
    )
    refusals = []
    if dc.seq_len > spec.max_positions:  # a model limit, not a memory one: no placement changes it
        refusals.append(
            f"data.seq_len {dc.seq_len} exceeds the model's max_position_embeddings {spec.max_positions}; "
            f"use a --seq-len of at most {spec.max_positions}"
        )
    return PlanReport(
        summary=summary,
        machine=machine,
        requested=requested,
        recommended=recommended,
        refusals=tuple(refusals),
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
