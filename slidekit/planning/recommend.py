"""The planner's recommendations: the placement that fits a machine with the shortest predicted step.

``recommend`` fills the fastest tier first, per unit: as many units resident
on the GPU as fit, then their state in RAM, then on disk the smallest share
of units that makes RAM suffice (``split_candidates``, spread over the model),
with activations on the device or on a host tier, and lets the predicted step
choose among those; where predictions tie (within ``TIE``), or the machine has
no rates, the fixed order of ``candidates`` decides. Part of
``slidekit.planning.planner.Planner`` (a mixin).

Test: ``pytest tests/test_planner.py tests/test_timing.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from slidekit.planning.estimate import Estimate
from slidekit.planning.layout import Drivers, Layout, Placement
from slidekit.planning.machine import Machine

if TYPE_CHECKING:
    from slidekit.planning.timing import StepPrediction

__all__ = ["TIE", "Recommendations"]

#: Predicted steps within this share of the fastest tie: the fixed order picks among them.
TIE = 0.01


class Recommendations:
    """The recommending half of ``Planner``."""

    # The Planner's state these methods share (set by ``Planner.__init__``).
    drivers: Drivers
    device_type: str
    numels: list[int]

    if TYPE_CHECKING:

        @property
        def device_updates(self) -> bool: ...

        def medium(self, tier: str) -> str: ...

        def estimate(
            self, placement: Placement, machine: Machine, resident: Sequence[bool] | None = None
        ) -> Estimate: ...

        def predict(self, layout: Layout, machine: Machine) -> StepPrediction | None: ...

    def candidates(self, base: Placement, disk_tier: str | None) -> list[Placement]:
        """Placements from the fastest to the slowest, keeping ``base``'s tier choices where they work.

        More units resident first (where the optimizer can update on the
        device; with ``base``'s ``resident_weights``, then, where that is "keep", with "auto": units on the
        GPU that slide their weights cost 4 + state instead of 4 + state + 4 B/param, so more of a model
        too large for the device keeps its master and state there, ``slidekit.planning.weights``); then
        activations on the device before a host tier; then state in RAM before a growing share (1/4, 1/2,
        3/4, all) on ``disk_tier``; activations on disk last.
        """
        host = self.drivers.host_tier
        host_tier = base.state_tier if self.medium(base.state_tier) == "host" else host
        concrete = base.activation_tier not in ("device", "auto")  # "auto" is what candidates spell out
        acts_host = base.activation_tier if concrete and self.medium(base.activation_tier) == "host" else host
        weights = [base.resident_weights]
        if self.device_type == "cpu":
            residents = [base.gpu_resident]  # the CPU computes where the masters are: nothing to choose
        else:
            residents = ["all", "auto"] if self.device_updates else ["none"]
            if base.resident_weights == "keep" and self.device_updates:
                weights.append("auto")  # "keep" where that fits and is not predicted slower
        out: list[Placement] = []
        fractions = [0.0] + ([0.25, 0.5, 0.75, 1.0] if disk_tier else [])
        for fraction in fractions:
            for acts in ("device", acts_host):
                for res in residents:
                    for kept in weights if res != "none" else weights[:1]:
                        out.append(
                            Placement(
                                state_tier=host_tier,
                                state_offload_tier=disk_tier if fraction else None,
                                state_offload_fraction=fraction,
                                activation_tier=acts,
                                gpu_resident=res,
                                resident_weights=kept,
                            )
                        )
        if disk_tier:
            out.append(dataclasses.replace(out[-1], activation_tier=disk_tier))
        return list(dict.fromkeys(out))

    def recommend(
        self, base: Placement, machine: Machine, disk_tier: str | None = None
    ) -> Estimate | None:
        """The placement that fits ``machine`` with the shortest predicted step, or None (see the module
        doc). ``disk_tier`` (default: the disk role's tier, ``slidekit.planning.roles``) may hold
        optimizer state where the machine has an offload directory. Without rates for the machine
        (``Machine.rates``) or on the CPU: the first that fits in the fixed order."""
        disk_tier = disk_tier or self.drivers.disk_tier
        disk = disk_tier if machine.disk_free is not None else None
        rates = machine.rates
        if rates is None or self.device_type == "cpu":
            for placement in self.candidates(base, disk):
                est = self.estimate(placement, machine)
                if est.placement_fits(machine):  # no placement gives the run directory more room
                    return est
            return None
        fitting = [
            est
            for placement in self.split_candidates(base, disk, machine)
            if (est := self.estimate(placement, machine)).placement_fits(machine)
        ]
        if not fitting:
            return None
        seconds = [self.predict_layout(est, machine) for est in fitting]
        best = min(seconds)
        return next(est for est, t in zip(fitting, seconds, strict=True) if t <= best * (1 + TIE))

    def predict_layout(self, est: Estimate, machine: Machine) -> float:
        """The predicted step of an estimate's layout on ``machine`` (infinite without a prediction)."""
        pred = self.predict(est.layout, machine) if est.layout is not None else None
        return float("inf") if pred is None else pred.seconds

    def split_candidates(self, base: Placement, disk_tier: str | None, machine: Machine) -> list[Placement]:
        """``candidates`` plus, for each residency and activation tier, the smallest share of units'
        state on ``disk_tier`` that lets host RAM hold the rest (state goes to disk by whole units,
        ``place_state``), in the same order: the split the fastest-tier-first rule gives."""
        out = self.candidates(base, disk_tier)
        if not disk_tier:
            return out
        units = len(self.numels)
        exact = []
        for placement in dict.fromkeys(
            dataclasses.replace(c, state_offload_tier=None, state_offload_fraction=0.0) for c in out
        ):
            if placement.activation_tier == disk_tier:
                continue
            least = self._least_on_disk(placement, disk_tier, machine)
            if least is not None and least > 0:
                exact.append(
                    dataclasses.replace(
                        placement, state_offload_tier=disk_tier, state_offload_fraction=least / units
                    )
                )
        merged = sorted(
            dict.fromkeys([*out, *exact]),
            key=lambda c: (c.activation_tier == disk_tier, c.state_offload_fraction),
        )
        return merged

    def _least_on_disk(self, placement: Placement, disk_tier: str, machine: Machine) -> int | None:
        """The fewest units whose state must go to ``disk_tier`` for host RAM to hold ``placement``
        (None: not even all of it is enough)."""

        def host_fits(k: int) -> bool:
            place = dataclasses.replace(
                placement,
                state_offload_tier=disk_tier if k else None,
                state_offload_fraction=k / len(self.numels),
            )
            return self.estimate(place, machine).host_fits(machine)

        lo, hi = 0, len(self.numels)
        if not host_fits(hi):
            return None
        while lo < hi:  # host bytes only fall as units move to disk
            mid = (lo + hi) // 2
            if host_fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo
