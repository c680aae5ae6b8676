"""What ``slidekit plan`` prints: the run, the machine, the requested placement's layout, estimate and
predicted step, and the placement that fits with the shortest predicted step. Loads no weight.

With a GPU profile (``slidekit plan --gpu NAME``) the plan is a what-if for that GPU, whether or
not this machine has one (``slidekit.planning.what_if``), and it lists the rates and their sources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slidekit.errors import ConfigError
from slidekit.inputs import seq_len_refusal
from slidekit.planning.clip_overlap import overlap_layout
from slidekit.planning.estimate import Estimate
from slidekit.planning.layout import Layout, Placement
from slidekit.planning.machine import Machine
from slidekit.planning.planner import Planner
from slidekit.planning.timing import StepPrediction
from slidekit.planning.update_order import order_layout

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.planning.profiles import GpuProfile
    from slidekit.plugins import Plugins

__all__ = ["PlanReport", "RankShare", "plan_run", "split_line"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """What ``slidekit plan`` prints: the run, the machine, the requested placement and the best that fits."""

    summary: str
    machine: Machine
    requested: Estimate
    recommended: Estimate | None
    refusals: tuple[str, ...] = ()  # what makes the run impossible whatever the memory (e.g. too long rows)
    requested_step: StepPrediction | None = None  # None: no rates for this machine, or the CPU
    recommended_step: StepPrediction | None = None
    rates_note: str = ""  # the rates and their sources (a what-if), or why there is no prediction
    notes: tuple[str, ...] = ()  # what the run's settings made of the layouts (optim.clip_overlap)
    floor: tuple[str, ...] = ()  # when nothing fits: the most offloaded placement, then what it still lacks

    @property
    def fits(self) -> bool:
        return not self.refusals and self.requested.fits(self.machine)

    def render(self) -> str:
        lines = [self.summary, f"machine: {self.machine.describe()}"]
        if self.rates_note:
            lines.append(self.rates_note)
        lines += [f"note: {n}" for n in self.notes]
        lines.append("")
        device = "GPU" if self.machine.device_free is not None else "compute device (host RAM)"
        lines.append(f"requested placement: {self.requested.placement.flags()}")
        if self.requested.layout is not None:
            lines.append(self.requested.layout.describe())
        lines.append(self.requested.table(device))
        problems = [*self.refusals, *self.requested.shortfalls(self.machine)]
        lines += _prediction(self.requested, self.requested_step, fits=not problems)
        lines.append("verdict: fits" if not problems else "verdict: does NOT fit")
        lines += [f"  {p}" for p in problems]
        rec = self.recommended
        if rec is None:
            if self.floor:
                lines.append(
                    f"\nno placement fits, not even the most offloaded ({self.floor[0]}), which lacks:"
                )
                lines += [f"  {p}" for p in self.floor[1:]]
            lines.append(
                ("" if self.floor else "\n")
                + "no placement fits: lower --batch-size (raise --grad-accum to keep the tokens per step), "
                "use --optimizer adamw_8bit, or give --offload-dir so optimizer state can go to disk "
                "(FP32 masters always stay in host RAM)"
            )
        elif rec.placement != self.requested.placement or problems:
            best = (
                "with the shortest predicted step" if self.recommended_step is not None else "(fixed order)"
            )
            lines.append(f"\nfastest placement that fits {best}: {rec.placement.flags()}")
            lines.append(rec.table(device))
            lines += _prediction(rec, self.recommended_step, fits=True)
        return "\n".join(lines)


def split_line(layout: Layout) -> str:
    """Where the units' masters and state went, tier by tier, and where activations go."""
    units = len(layout.units)
    resident = sum(u.resident for u in layout.units)
    ram = sum(u.slides and u.state_medium == "host" for u in layout.units)
    disk = sum(u.slides and u.state_medium == "disk" for u in layout.units)
    acts = (
        "the device"
        if layout.activation_medium == "device"
        else f"{layout.activation_tier} ({layout.activation_medium})"
    )
    return (
        f"  split: {resident} of {units} units resident on the GPU (master and state there), {ram} with "
        f"master and state in RAM, {disk} with master in RAM and state on disk; boundary activations on {acts}"
    )


def _prediction(est: Estimate, step: StepPrediction | None, *, fits: bool) -> list[str]:
    if est.layout is None:
        return []
    out = [split_line(est.layout)]
    if step is not None:
        text = step.describe()
        out.append(text if fits else text.replace("predicted step", "predicted step if it fit", 1))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RankShare:
    """A data-parallel run as ``slidekit plan`` sees it: ``world`` ranks, ``host_ranks`` of them on each
    host (sharing its RAM and disks), ``device_ranks`` on each GPU. Rank 0 is planned: its shards are
    the largest."""

    world: int = 1
    host_ranks: int = 1
    device_ranks: int = 1

    @classmethod
    def of(
        cls, per_node: int, nodes: int, gpus_per_node: int | None, machine: Machine, *, what_if: bool
    ) -> RankShare:
        """From torchrun's ``--nproc-per-node`` and ``--nnodes`` and the GPUs per host (default: one per
        rank in a what-if, else this machine's count)."""
        for flag, value in (("--nproc-per-node", per_node), ("--nnodes", nodes), ("--gpus-per-node", gpus_per_node)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} must be at least 1, got {value}")
        if machine.device_free is None:
            return cls(world=per_node * nodes, host_ranks=per_node)  # the CPU: the device is the host's RAM
        if gpus_per_node is None:
            import torch

            gpus_per_node = per_node if what_if or not torch.cuda.is_available() else torch.cuda.device_count()
        return cls(world=per_node * nodes, host_ranks=per_node, device_ranks=-(-per_node // gpus_per_node))

    def describe(self) -> str:
        gpu = f", {self.device_ranks} ranks per GPU" if self.device_ranks > 1 else ""
        return (
            f"data-parallel: {self.world} ranks, {self.host_ranks} per host{gpu}; planned for rank 0 (the "
            "largest shards) on its share of the machine; the collectives are not in the predicted step"
        )


def plan_run(
    config: TrainConfig,
    *,
    plugins: Plugins | None = None,
    machine: Machine | None = None,
    gpu: GpuProfile | None = None,
    model_name: str | None = None,
    ranks: RankShare | None = None,
) -> PlanReport:
    """Plan ``config`` on this machine (or on ``machine``) without loading any weight. ``gpu``: plan for
    that profile's GPU (``machine`` then from ``slidekit.planning.what_if.what_if_machine``);
    ``model_name``: how the summary names the model (default: its source); ``ranks``: plan rank 0 of a
    data-parallel run on its share of the machine."""
    from slidekit.planning.what_if import what_if_machine, what_if_setup
    from slidekit.plugins import Plugins
    from slidekit.resolve import build_optimizer, resolve

    plugins = plugins or Plugins(entry_points=config.plugins.entry_points, block=config.plugins.block)
    setup = what_if_setup(config, plugins) if gpu is not None else resolve(config, plugins)
    optimizer = build_optimizer(config, setup)
    ranks = ranks or RankShare()
    planner = Planner.for_run(
        config, setup, optimizer=optimizer, plugins=plugins, what_if=gpu is not None, world=ranks.world
    )
    if machine is None:
        here = Machine.probe("cpu" if gpu else setup.device, config.engine.offload_dir, config.run.dir)
        machine = what_if_machine(gpu, here) if gpu is not None else here
    machine = machine.share(ranks.host_ranks, ranks.device_ranks)
    placement = Placement.of(config.engine)
    notes: list[str] = []
    policies = (config.optim.clip_overlap, config.engine.update_order)
    chosen = planner.choose(placement, machine)
    requested = planner.estimate_layout(chosen.layout, machine)
    notes.extend(chosen.notes)
    if traded := planner.residency_note(chosen.layout, machine):
        notes.append(traded)
    requested = _overlap(planner, requested, machine, policies, notes)
    recommended = planner.recommend(placement, machine)
    if recommended is not None:
        recommended = _overlap(planner, recommended, machine, policies, notes)
    spec, dc = setup.spec, config.data
    summary = (
        f"model: {model_name or config.model.source} ({spec.family}, {spec.num_layers} layers, "
        f"{_count(spec.num_params)} parameters); micro-batches of {dc.batch_size} x {dc.seq_len} tokens, "
        f"{config.grad_accum} per step; {str(setup.compute_dtype)[6:]} on {setup.device}"
        + (f" ({gpu.name}, what-if)" if gpu is not None else "")
        + f"\ndrivers: optimizer {optimizer.name} ({planner.state_per_param:.2f} B/param of state), kernels "
        f"{setup.selections['kernels'].name}"
        + (f"\n{ranks.describe()}" if ranks.world > 1 else "")
    )
    floor: tuple[str, ...] = ()
    if recommended is None:
        disk = planner.drivers.disk_tier if machine.disk_free is not None else None
        last = planner.candidates(placement, disk)[-1]
        floor = (last.flags(), *planner.estimate(last, machine).shortfalls(machine))
    refusals = []
    why = seq_len_refusal(dc.seq_len, spec.max_positions)
    if why:  # a model limit, not a memory one: no placement changes it
        refusals.append(why)
    return PlanReport(
        summary=summary,
        machine=machine,
        requested=requested,
        recommended=recommended,
        refusals=tuple(refusals),
        requested_step=_predict(planner, requested, machine),
        recommended_step=None if recommended is None else _predict(planner, recommended, machine),
        rates_note=_rates_note(machine, planner, gpu),
        notes=tuple(notes),
        floor=floor,
    )


def _overlap(
    planner: Planner, est: Estimate, machine: Machine, policies: tuple[str, str], notes: list[str]
) -> Estimate:
    """``est`` with the layout the engine builds for ``optim.clip_overlap`` (``overlap_layout``) and
    ``engine.update_order`` (``order_layout``): a clipped run whose backups are dropped is estimated and
    predicted deferring, a run whose units' own gradient buffers are dropped updating as they arrive,
    each saying why."""
    if est.layout is None:
        return est
    layout = est.layout
    for decide, policy in ((overlap_layout, policies[0]), (order_layout, policies[1])):
        layout, note = decide(planner, layout, machine, policy)
        if note and note not in notes:
            notes.append(note)
    return est if layout is est.layout else planner.estimate_layout(layout, machine)


def _predict(planner: Planner, est: Estimate, machine: Machine) -> StepPrediction | None:
    return None if est.layout is None else planner.predict(est.layout, machine)


def _rates_note(machine: Machine, planner: Planner, gpu: GpuProfile | None) -> str:
    if planner.device_type == "cpu":
        return "step time: not predicted on the CPU (the step-time model covers GPUs)"
    if machine.rates is None:
        return (
            f"step time: not predicted: no rates for this GPU ({machine.gpu or 'unknown'}); placements in "
            "the fixed order (--gpu h200 or --gpu rtx4090 plans with a profile's rates)"
        )
    if gpu is None:
        return f"rates: {machine.rates.name} (docs/planning.md)"
    return (
        f"GPU profile {gpu.name}: {gpu.description}; memory {gpu.memory_source}\n"
        f"rates: {machine.rates.name}\n{machine.rates.describe()}"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
