"""Planning: pure decisions about a run, made before anything is allocated. No devices, no files
(``Machine.probe`` aside, which measures them).

    schedule    the visit order of a step (``schedule``, ``Visit``)
    placement   which units stay on the device, where state goes, gradient pieces (pure arithmetic)
    shards      which part of every unit a data-parallel rank owns (``Shard``)
    layout      the run's ``Layout``: every buffer the engine allocates, per unit and for the run
    estimate    the ``Estimate``: a layout's bytes plus a step's transient work, against a ``Machine``
    machine     what the machine has (``Machine.probe``)
    planner     the ``Planner``: layouts, estimates, predictions
    recommend   the fastest placement that fits (a part of ``Planner``)
    rates       what a machine sustains (``Rates``), each figure with its source
    profiles    known GPUs' memory and rates (``--gpu h200``, ``--gpu rtx4090``)
    simulate    the engine's schedule replayed in virtual time
    timing      a layout's predicted step (``predict_step``, ``StepPrediction``)
    what_if     planning for a GPU this machine lacks
    roles       tiers by the role their medium gives them (the core names no bundled tier)
    run_space   the run directory's room for checkpoints
    report      what ``slidekit plan`` prints (``plan_run``)

The engine builder (``slidekit.engine.build``) allocates exactly a ``Layout``.
"""

from slidekit.planning.estimate import DEVICE_HEADROOM, DEVICE_SLACK, RUNTIME_HOST, Estimate
from slidekit.planning.layout import (
    UPLOAD_CHUNK,
    Drivers,
    EngineSettings,
    Layout,
    Placement,
    UnitPlace,
    Workload,
)
from slidekit.planning.machine import GIB, Machine, fmt_gib
from slidekit.planning.placement import (
    GRANULE,
    MemoryPlan,
    place_state,
    plan_memory,
    plan_residency,
    ring_numel,
    spread_host_units,
    unit_pieces,
)
from slidekit.planning.planner import RESIDENT_RESERVE, TIE, Planner
from slidekit.planning.profiles import PROFILES, GpuProfile, profile
from slidekit.planning.rates import Rates, UpdateRate
from slidekit.planning.report import PlanReport, plan_run
from slidekit.planning.schedule import BWD, FWD, HEAD, Visit, schedule
from slidekit.planning.shards import Shard, unit_shard, unit_shards
from slidekit.planning.timing import StepPrediction, StepWork, predict_step

__all__ = [
    "BWD",
    "DEVICE_HEADROOM",
    "DEVICE_SLACK",
    "FWD",
    "GIB",
    "GRANULE",
    "HEAD",
    "PROFILES",
    "RESIDENT_RESERVE",
    "RUNTIME_HOST",
    "TIE",
    "UPLOAD_CHUNK",
    "Drivers",
    "EngineSettings",
    "Estimate",
    "GpuProfile",
    "Layout",
    "Machine",
    "MemoryPlan",
    "Placement",
    "PlanReport",
    "Planner",
    "Rates",
    "Shard",
    "StepPrediction",
    "StepWork",
    "UnitPlace",
    "UpdateRate",
    "Visit",
    "Workload",
    "fmt_gib",
    "place_state",
    "plan_memory",
    "plan_residency",
    "plan_run",
    "predict_step",
    "profile",
    "ring_numel",
    "schedule",
    "spread_host_units",
    "unit_pieces",
    "unit_shard",
    "unit_shards",
]
