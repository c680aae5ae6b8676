"""Refusing a layout this machine cannot hold: the numbers, and the fastest placement that would fit."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

from slidekit.errors import ConfigError
from slidekit.planning.estimate import Estimate
from slidekit.planning.layout import Layout
from slidekit.planning.machine import Machine
from slidekit.planning.planner import Planner
from slidekit.planning.update_order import arrival_order, grad_buffer_bytes

__all__ = ["check_fit"]


def check_fit(
    planner: Planner,
    layout: Layout,
    machine: Machine,
    *,
    seq_len_refusal: Callable[[], None] | None = None,
    disk_notes: Sequence[str] = (),
) -> Estimate:
    """``layout``'s estimate when it fits ``machine``; else a ConfigError naming every shortfall and the fix.

    When rows longer than the model's positions are all that fails, ``seq_len_refusal`` raises its own
    error first (the model limit, not memory, is the cause). ``disk_notes`` are added when the disk lacks room.
    """
    estimate = planner.estimate_layout(layout, machine)
    problems = estimate.shortfalls(machine)
    if not problems:
        return estimate
    placement, resident = layout.placement, layout.resident
    positions = planner.spec.max_positions
    if seq_len_refusal is not None and planner.workload.seq_len > positions:
        clamped = copy.copy(planner)
        clamped.workload = dataclasses.replace(planner.workload, seq_len=positions)
        if not clamped.estimate(placement, machine, resident).shortfalls(machine):
            seq_len_refusal()
    if any(p.startswith("disk") for p in problems):
        problems += disk_notes
    better = planner.recommend(placement, machine)
    arrival = arrival_order(layout)
    if estimate.placement_fits(machine):
        fix = "the placement fits; only the run directory lacks room"
    elif arrival is not layout and planner.estimate_layout(arrival, machine).placement_fits(machine):
        fix = (
            "it fits with the host updates as the gradients arrive: set engine.update_order='arrival' (CLI: "
            f"--update-order arrival); the next forward's order needs every sliding unit's own gradient "
            f"buffer, {grad_buffer_bytes(layout) / 2**30:.2f} GiB"
        )
    elif better is not None:
        fix = f"this placement fits: {better.placement.flags()}"
    else:
        fix = (
            "no placement fits this batch: lower data.batch_size (and raise grad_accum to keep the tokens "
            "per step), use optim.name='adamw_8bit', or set engine.offload_dir so state can go to disk"
        )
    raise ConfigError(
        f"this configuration does not fit on this machine ({machine.describe()}):\n  "
        + "\n  ".join(problems)
        + f"\n{fix} (see `slidekit plan`)"
    )
