"""What ``slidekit plan`` prints: the run, the machine, the requested placement's layout and estimate,
and the fastest placement that fits. Loads no weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slidekit.inputs import seq_len_refusal
from slidekit.planning.estimate import Estimate
from slidekit.planning.layout import Placement
from slidekit.planning.machine import Machine
from slidekit.planning.planner import Planner

if TYPE_CHECKING:
    from slidekit.config import TrainConfig
    from slidekit.plugins import Plugins

__all__ = ["PlanReport", "plan_run"]


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
        if self.requested.layout is not None:
            lines.append(self.requested.layout.describe())
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
    why = seq_len_refusal(dc.seq_len, spec.max_positions)
    if why:  # a model limit, not a memory one: no placement changes it
        refusals.append(why)
    return PlanReport(
        summary=summary,
        machine=machine,
        requested=requested,
        recommended=recommended,
        refusals=tuple(refusals),
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
