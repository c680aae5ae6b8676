"""The time plan of a suite: predicted seconds per run, and what a time budget leaves out.

``make_plan`` walks the runs most important first (``suites.expand`` orders them) and keeps each
one whose predicted seconds still fit in the budget after the builds and the runs kept before it;
one that does not fit is "not run: time budget" and the walk goes on (a smaller, less important
run may still fit). The bench prints the plan before it starts and checks again before each run
against the real clock: a run whose prediction is more than what is left is skipped then too, so
a suite that runs slower than predicted still ends inside its budget; one that runs faster takes up
a run the plan left out when that run's prediction fits in what is left after the kept runs still to
come (``runner.run_suite``). Nothing here runs anything.

Test: ``pytest tests/test_bench_plan.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from slidekit.tools.bench.costs import BUILD_S, Cost, cost_of, predict
from slidekit.tools.bench.suites import RunSpec, Suite

__all__ = ["Plan", "Planned", "builds_for", "format_plan", "make_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Planned:
    """One run of the plan: its prediction and whether the budget keeps it."""

    run: RunSpec
    predicted_s: float
    keep: bool
    source: str  # where the prediction's figures come from


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every run of a suite with its prediction; the builds it needs first."""

    suite: Suite
    runs: tuple[Planned, ...]
    builds: tuple[str, ...]  # BUILD_S keys
    build_s: float
    budget_s: float | None
    prebuild: bool = True  # the builds run first; False: each run builds what it needs itself

    @property
    def kept(self) -> list[Planned]:
        return [p for p in self.runs if p.keep]

    @property
    def predicted_s(self) -> float:
        return self.build_s + sum(p.predicted_s for p in self.kept)


def builds_for(runs: Sequence[RunSpec]) -> tuple[str, ...]:
    """What must be built before ``runs`` (slidekit's fused CPU kernels; DeepSpeed's cpu_adam)."""
    need = []
    if any(r.system == "slidekit" for r in runs):
        need.append("slidekit")
    if any(r.system.startswith("deepspeed") for r in runs):
        need.append("deepspeed")
    return tuple(need)


def make_plan(
    suite: Suite,
    runs: Sequence[RunSpec],
    *,
    budget_s: float | None,
    prebuild: bool,
    table: Mapping[tuple[str, str], Cost] | None = None,
) -> Plan:
    """Predict every run; with a budget, keep the most important ones that fit (module docstring)."""
    predicted = [
        (r, predict(r, suite.model, steps=suite.steps, warmup=suite.warmup, table=table)) for r in runs
    ]
    sources = {r.cost_key: cost_of(suite.model, r.cost_key, table).source for r in runs}
    planned: list[Planned] = []
    builds: tuple[str, ...] = ()
    build_s = 0.0
    used = 0.0
    for run, seconds in predicted:
        need = builds_for([p.run for p in planned if p.keep] + [run]) if prebuild else ()
        extra = max((BUILD_S[b] for b in need), default=0.0)  # the builds run side by side
        fits = budget_s is None or extra + used + seconds <= budget_s
        if fits:
            used += seconds
            builds, build_s = need, extra
        planned.append(
            Planned(run=run, predicted_s=round(seconds, 1), keep=fits, source=sources[run.cost_key])
        )
    return Plan(
        suite=suite, runs=tuple(planned), builds=builds, build_s=build_s, budget_s=budget_s, prebuild=prebuild
    )


def format_plan(plan: Plan) -> str:
    """The plan as the bench prints it before it starts (and the suite's markdown keeps)."""
    s = plan.suite
    budget = "no budget" if plan.budget_s is None else f"budget {plan.budget_s:.0f} s"
    lines = [
        f"time plan of suite {s.name} ({s.model}, seq {s.seq}, {s.warmup} warm-up + {s.steps} timed steps, "
        f"{budget}):"
    ]
    if plan.builds:
        lines.append(f"  builds first, side by side: {', '.join(plan.builds)} (~{plan.build_s:.0f} s)")
    lines.append(f"  {'#':>3} {'importance':>10}  {'run':<78} {'predicted s':>11}  plan")
    for i, p in enumerate(plan.runs, 1):
        what = "run" if p.keep else "not run: time budget"
        lines.append(f"  {i:>3} {p.run.importance:>10.1f}  {p.run.name:<78} {p.predicted_s:>11.0f}  {what}")
    dropped = [p for p in plan.runs if not p.keep]
    lines.append(
        f"  kept {len(plan.kept)} of {len(plan.runs)} runs, predicted {plan.predicted_s:.0f} s"
        + (f"; left out {len(dropped)} ({sum(p.predicted_s for p in dropped):.0f} s)" if dropped else "")
    )
    return "\n".join(lines)
