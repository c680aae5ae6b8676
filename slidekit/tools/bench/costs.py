"""How long each run of a suite takes, predicted from what earlier runs measured on the H200 machine.

A run's seconds = process start (``START_S``: interpreter, imports, CUDA, exit) + setup (the model
and optimizer, once per process for an alternative; a ``Trainer`` per batch for slidekit) + per
batch (warm-up + timed steps) x the step time (x the clipping factor ``CLIP_FACTOR``) +
``PER_BATCH_S``. A batch measured out of GPU memory costs ``OOM_BATCH_S``; a run expected to
exhaust host RAM costs its start + ``host_oom_s`` (the memory watchdog kills it).

``MEASURED`` holds the figures, each with the record it comes from (docs/benchmarks/raw/):
whole-step periods / steps where the record has them (the GPU gate of 2026-12-01), else the median
of 3 timed steps x 1.05 (a median of the step alone misses the drain a whole step includes).
What was never measured is estimated by the rules of ``cost_of`` (said in each Cost's ``source``):
a partial share interpolates between all-resident and none; HF + Liger is plain HF x 0.92 (fused
loss, no FP32 logits) or x 0.75 without checkpointing (no recompute); DeepSpeed's partial offload is
its full offload; a model not measured scales the nearest measured one by parameter count; a step at
an unmeasured batch is linear in the batch through the two nearest measured ones. ``--costs
FILE.jsonl`` replaces the estimates with the records of an earlier suite (``costs_from_records``).

A mode's levers (cost key ``KIND+recompute=V``, ``KIND+clip_overlap=V``, ``suites.Mode.levers``) scale
the kind's step (``LEVER_FACTOR``; the measured steps of ``MEASURED`` recomputed every layer and
deferred every clipped update) and set the clipping factor (``OVERLAP_CLIP_FACTOR``), each with its
arithmetic; what ``--costs`` measured under the exact key comes first.

A run on N GPUs (cost key ``KIND@N``) has never been measured: at the same per-GPU batch it is
estimated as the same kind on one GPU, each step x ``RANK_STEP_FACTOR`` (the collectives and the
ranks waiting for the slowest) and its setup + ``RANK_SETUP_S`` (the process groups), and its
process start + ``TORCHRUN_S`` (the launcher and N interpreters). Where the one-GPU kind exhausted
the 1-GPU machine's RAM (123 GiB), the 2-GPU machine (256 GB) may hold it: its steps then come from
the nearest model where that kind ran, scaled by parameters; ``RANKED`` holds the cases judged
otherwise, each with its arithmetic.

Test: ``pytest tests/test_bench_plan.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from slidekit.tools.bench.records import no_room
from slidekit.tools.bench.suites import RunSpec

__all__ = [
    "BUILD_S",
    "CLIP_FACTOR",
    "LEVER_FACTOR",
    "MEASURED",
    "OOM_BATCH_S",
    "OVERLAP_CLIP_FACTOR",
    "PER_BATCH_S",
    "RANKED",
    "RANK_SETUP_S",
    "RANK_STEP_FACTOR",
    "START_S",
    "TORCHRUN_S",
    "Cost",
    "clip_factor",
    "cost_of",
    "costs_from_records",
    "levers_of",
    "predict",
]

#: Seconds a process takes besides setup and steps (imports, CUDA context, Triton/extension loads, exit).
START_S = {"slidekit": 13.0, "no_offload": 7.0, "liger_gc": 14.0, "liger": 14.0, "torchao": 21.0}
START_S |= {"deepspeed": 23.0, "deepspeed_partial": 25.0}
PER_BATCH_S = 1.0  # freeing one batch's memory, a slidekit Trainer's close
OOM_BATCH_S = 5.0  # a batch that runs out of GPU memory: the steps until it does, the cleanup
#: Step time with max_grad_norm over without (estimates): slidekit defers host updates to the next forward.
CLIP_FACTOR = {"slidekit": 1.10, "slidekit:all": 1.02, "torchao": 1.15, "deepspeed": 1.05}
CLIP_FACTOR |= {"deepspeed_partial": 1.05}
#: A lever's step factor (estimates, NOTES.md 16), applied to the kind without it. recompute "all" is
#: how every measured step ran; "auto" keeps the activations of the layers that fit: NOTES 16 predicts
#: 1.27x at 3B batch 8 and 1.19x at batch 32, and a plan counts on the smaller gain (1 / 1.19). "none"
#: keeps every layer (as "auto" where all fit). Sliding layers keep too (forced offload included).
LEVER_FACTOR = {("recompute", "all"): 1.0, ("recompute", "auto"): 0.84, ("recompute", "none"): 0.84}
#: Step time with max_grad_norm over without, per ``clip_overlap`` (estimates, NOTES.md 15; default:
#: ``CLIP_FACTOR``). "defer": the deferred path measured -32% at 3B batch 32 on the H200 (1 / 0.68).
#: "speculate" priced as if every step rolled back (a plan cannot know whether its clip fires): the
#: deferred step plus the restore of 24 B/param at ~95 GB/s, 0.78 s on 3B's 2.7 s deferred step.
OVERLAP_CLIP_FACTOR = {"defer": 1.47, "speculate": 1.9, "auto": 1.47}
#: A run on N GPUs against one (estimates, module docstring): its step, its setup, its process start.
RANK_STEP_FACTOR = 1.1
RANK_SETUP_S = 5.0
TORCHRUN_S = 5.0
#: What is built once per machine before the runs (``slidekit build``; DeepSpeed's cpu_adam extension).
BUILD_S = {"slidekit": 35.0, "deepspeed": 70.0}

_MEDIAN = 1.05  # a median step -> a whole step (see the module docstring)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cost:
    """What one kind of run costs on one model."""

    setup_s: float = 0.0
    steps: Mapping[int, float] = field(default_factory=dict)  # batch -> seconds per whole step
    source: str = ""
    oom: frozenset[int] = frozenset()  # batches that ran out of GPU memory
    host_oom_s: float | None = None  # expected to exhaust host RAM this long after its start

    def step_s(self, batch: int) -> float:
        """Seconds per step at ``batch``: measured, or linear in the batch through the two nearest."""
        if batch in self.steps:
            return self.steps[batch]
        if not self.steps:
            return 0.0
        points = sorted(self.steps.items(), key=lambda kv: (abs(kv[0] - batch), kv[0]))[:2]
        if len(points) == 1:
            ((b0, s0),) = points
            return s0 * batch / b0
        (b0, s0), (b1, s1) = sorted(points)
        return max(s0 + (s1 - s0) * (batch - b0) / (b1 - b0), 0.05 * s0)

    def scaled(self, factor: float, why: str) -> Cost:
        return replace(
            self,
            setup_s=self.setup_s * factor,
            steps={b: s * factor for b, s in self.steps.items()},
            source=f"{why} ({self.source})",
        )


def _m(setup: float, steps: dict[int, float], source: str, *, median: bool = True, **kw: Any) -> Cost:
    factor = _MEDIAN if median else 1.0
    return Cost(setup_s=setup, steps={b: round(s * factor, 4) for b, s in steps.items()}, source=source, **kw)


_S4 = "raw/2026-11-30-s4/suite-1.5b/bench_qwen2.5-1.5b.jsonl"
_S3 = "raw/2026-11-29-s3/bench_qwen2.5-3b.jsonl"
_S3_7 = "raw/2026-11-29-s3/bench_qwen2.5-7b.jsonl"
_GATE = "raw/2026-12-01-s5/gate-call4-ed0e662.json (whole steps)"
_SPREAD = "raw/2026-11-30-s4/spread/spread.jsonl"

#: (model preset, cost key) -> measured Cost (see the module docstring for the step convention).
MEASURED: dict[tuple[str, str], Cost] = {
    ("qwen2.5-1.5b", "slidekit:all"): _m(
        2.5, {8: 0.190, 16: 0.371, 32: 0.741, 64: 1.467}, f"{_S4} (auto = 30/30)"
    ),
    ("qwen2.5-1.5b", "slidekit:none"): _m(7.6, {8: 0.500, 16: 0.609, 32: 0.897, 64: 1.611}, _S4),
    ("qwen2.5-1.5b", "no_offload"): _m(8.9, {8: 0.280, 16: 0.531, 32: 1.015}, _S4, oom=frozenset({64})),
    ("qwen2.5-1.5b", "torchao"): _m(6.8, {8: 0.732, 16: 0.886, 32: 1.315, 64: 2.211}, _S4),
    ("qwen2.5-1.5b", "deepspeed"): _m(24.1, {8: 0.996, 16: 1.241, 32: 1.659, 64: 2.575}, _S4),
    ("qwen2.5-3b", "slidekit:all"): _m(
        4.3, {8: 0.400, 16: 0.732 * _MEDIAN, 32: 1.432 * _MEDIAN}, f"{_GATE}; {_S3}", median=False
    ),
    ("qwen2.5-3b", "slidekit:0.5"): _m(11.7, {8: 0.505}, _GATE, median=False),
    ("qwen2.5-3b", "slidekit:none"): _m(
        20.0, {8: 1.031, 16: 1.223 * _MEDIAN, 32: 1.750 * _MEDIAN}, f"{_GATE}; {_S3}", median=False
    ),
    ("qwen2.5-3b", "no_offload"): _m(11.5, {8: 0.518, 16: 0.967, 32: 1.877}, _S3),
    ("qwen2.5-3b", "torchao"): _m(15.1, {8: 1.409, 16: 1.738, 32: 2.573}, _S3),
    ("qwen2.5-3b", "deepspeed"): _m(37.1, {8: 1.880, 16: 2.374, 32: 3.190}, _S3),
    ("qwen2.5-7b", "slidekit:all"): _m(12.0, {8: 0.785, 16: 1.519}, f"{_S3_7} (auto = 30/30)"),
    ("qwen2.5-7b", "slidekit:0.65"): _m(23.0, {8: 1.228, 16: 1.548}, f"{_S3_7}; {_SPREAD}"),
    ("qwen2.5-7b", "slidekit:none"): _m(55.0, {8: 2.704, 16: 2.534}, f"{_S3_7}; {_SPREAD}"),
    ("qwen2.5-7b", "no_offload"): _m(11.6, {8: 0.973}, _S3_7, oom=frozenset({16, 32, 64})),
    # 20.2 and 23 B/param on the host (measured at 3B) x 7.6 B > the machine's 123 GiB: killed.
    ("qwen2.5-7b", "torchao"): Cost(
        host_oom_s=70.0, source="expected to exhaust host RAM (20.2 B/param at 3B)"
    ),
    ("qwen2.5-7b", "deepspeed"): Cost(
        host_oom_s=90.0, source="expected to exhaust host RAM (23 B/param at 3B)"
    ),
    ("qwen2.5-14b", "slidekit:auto"): _m(
        50.0, {8: 2.231, 16: 3.181}, f"{_SPREAD} (25-26 of 50 units resident)"
    ),
    ("qwen2.5-14b", "slidekit:all"): Cost(
        setup_s=5.0, source="the planner refuses it (16 B/param > the GPU)"
    ),
    ("qwen2.5-14b", "slidekit:none:adamw_8bit"): Cost(
        setup_s=90.0,
        steps={8: 7.0, 32: 8.0},
        source="estimate: 14.8 B params at adamw_8bit's 2.35 G/s (NOTES 5) + the upload",
    ),
    ("qwen2.5-14b", "liger_gc"): Cost(
        setup_s=20.0, oom=frozenset({8, 16, 32, 64}), source="16 B/param > the GPU"
    ),
    ("qwen2.5-14b", "torchao"): Cost(host_oom_s=90.0, source="expected to exhaust host RAM"),
    ("qwen2.5-14b", "deepspeed"): Cost(host_oom_s=110.0, source="expected to exhaust host RAM"),
}

#: Runs on several GPUs judged apart from the rule (module docstring), each with its arithmetic.
RANKED: dict[tuple[str, str], Cost] = {
    # DeepSpeed's host buffers, ~23 B/param at 3B on one GPU (ZeRO-2 partitions the optimizer state, the
    # other buffers are per rank): >= 23 x 14.8 B = 340 GB > the 2-GPU machine's 256 GB.
    ("qwen2.5-14b", "deepspeed@2"): Cost(
        host_oom_s=150.0, source="estimate: expected to exhaust host RAM (23 B/param x 14.8 B > 256 GB)"
    ),
}

#: Parameters of the presets the table covers, billions (scaling a model the table lacks).
_PARAMS_B = {"qwen2.5-1.5b": 1.54, "qwen2.5-3b": 3.09, "qwen2.5-7b": 7.62, "llama-3.1-8b": 8.03}
_PARAMS_B |= {"qwen2.5-14b": 14.77, "mistral-small-24b": 23.57, "tiny": 0.0}


def _lookup(model: str, key: str, table: Mapping[tuple[str, str], Cost]) -> Cost | None:
    return table.get((model, key))


def cost_of(model: str, key: str, table: Mapping[tuple[str, str], Cost] | None = None) -> Cost:
    """The Cost of run kind ``key`` on ``model``: measured, else estimated (module docstring)."""
    table = MEASURED if table is None else table
    got = _lookup(model, key, table)
    if got is not None:
        return got
    if "@" in key:
        return _on_ranks(model, key, table)
    if "+" in key:
        return _with_levers(model, key, table)
    if key == "slidekit:auto":
        return cost_of(model, "slidekit:all", table).scaled(1.0, "auto as all-resident")
    if key.startswith("slidekit:") and key.count(":") == 1 and key not in ("slidekit:all", "slidekit:none"):
        share = float(key.split(":")[1])
        full, none = cost_of(model, "slidekit:all", table), cost_of(model, "slidekit:none", table)
        batches = sorted(set(full.steps) | set(none.steps))
        return Cost(
            setup_s=full.setup_s + (1 - share) * (none.setup_s - full.setup_s),
            steps={b: full.step_s(b) + (1 - share) * (none.step_s(b) - full.step_s(b)) for b in batches},
            source=f"estimate: {share:g} between all-resident and none",
        )
    derived = {"liger_gc": ("no_offload", 0.92), "liger": ("no_offload", 0.75)}
    derived |= {"deepspeed_partial": ("deepspeed", 1.0), "slidekit:none:adamw_8bit": ("slidekit:none", 1.6)}
    if key in derived and (base := _lookup(model, derived[key][0], table)) is not None:
        return base.scaled(derived[key][1], f"estimate: {derived[key][0]} x {derived[key][1]:g}")
    measured = [m for (m, k) in table if k == key and m in _PARAMS_B and _PARAMS_B[m] > 0]
    if measured and _PARAMS_B.get(model, 0) > 0:
        near = min(measured, key=lambda m: abs(_PARAMS_B[m] - _PARAMS_B[model]))
        return table[(near, key)].scaled(_PARAMS_B[model] / _PARAMS_B[near], f"estimate: {near} x params")
    if key in derived:
        return cost_of(model, derived[key][0], table).scaled(derived[key][1], f"estimate: {derived[key][0]}")
    return Cost(setup_s=5.0, steps={1: 0.5}, source="no measurement: a guess")


def levers_of(key: str) -> tuple[str, dict[str, str]]:
    """A cost key's kind and its levers: ``slidekit:all+recompute=auto`` -> ``slidekit:all``, {recompute: auto}."""
    kind, *rest = key.split("+")
    return kind, dict(part.split("=", 1) for part in rest)


def _with_levers(model: str, key: str, table: Mapping[tuple[str, str], Cost]) -> Cost:
    """The kind's Cost with its levers' step factors (module docstring)."""
    kind, levers = levers_of(key)
    base = cost_of(model, kind, table)
    factor, why = 1.0, []
    for name, value in levers.items():
        f = LEVER_FACTOR.get((name, value), 1.0)
        if f != 1.0:
            factor *= f
            why.append(f"{name} {value} x {f:g}")
    if not why:  # clip_overlap: its clipping factor (``clip_factor``), not the step's
        return replace(base, source=f"{base.source}; {', '.join(f'{k} {v}' for k, v in levers.items())}")
    steps = {b: s * factor for b, s in base.steps.items()}  # the setup is the kind's
    return replace(base, steps=steps, source=f"estimate: {'; '.join(why)} ({base.source})")


def clip_factor(run: RunSpec) -> float:
    """Step time of ``run``'s clipped recipe over its unclipped one (1.0 without clipping)."""
    if run.clip is None:
        return 1.0
    overlap = dict(run.levers).get("clip_overlap")
    if overlap is not None and run.system == "slidekit":
        return OVERLAP_CLIP_FACTOR[overlap]
    return CLIP_FACTOR.get(run.cost_key, CLIP_FACTOR.get(run.system, 1.02))


def _on_ranks(model: str, key: str, table: Mapping[tuple[str, str], Cost]) -> Cost:
    """The estimate of a run on N GPUs (module docstring)."""
    if (model, key) in RANKED:
        return RANKED[(model, key)]
    one, ranks = key.rsplit("@", 1)
    base = cost_of(model, one, table)
    if base.host_oom_s is not None:  # on the 1-GPU machine; the 2-GPU machine has twice its RAM
        ran = [m for (m, k), c in table.items() if k == one and c.steps and _PARAMS_B.get(m, 0) > 0]
        if ran and _PARAMS_B.get(model, 0) > 0:
            near = min(ran, key=lambda m: abs(_PARAMS_B[m] - _PARAMS_B[model]))
            base = table[(near, one)].scaled(
                _PARAMS_B[model] / _PARAMS_B[near], f"estimate: {near} x params, host RAM of 256 GB"
            )
    return Cost(
        setup_s=base.setup_s + RANK_SETUP_S,
        steps={b: s * RANK_STEP_FACTOR for b, s in base.steps.items()},
        source=f"estimate: {ranks} GPUs as one x {RANK_STEP_FACTOR:g} per step ({base.source})",
        oom=base.oom,
        host_oom_s=base.host_oom_s,
    )


def predict(
    run: RunSpec, model: str, *, steps: int, warmup: int, table: Mapping[tuple[str, str], Cost] | None = None
) -> float:
    """Predicted wall seconds of ``run`` on ``model`` (the module docstring's sum)."""
    cost = cost_of(model, run.cost_key, table)
    start = START_S.get(run.system, 13.0) + (TORCHRUN_S if run.ranks > 1 else 0.0)
    if cost.host_oom_s is not None:
        return start + cost.host_oom_s
    clip = clip_factor(run)
    per_batch_setup = run.system == "slidekit"
    total = start + (0.0 if per_batch_setup else cost.setup_s)
    for batch in run.batches:
        total += PER_BATCH_S + (cost.setup_s if per_batch_setup else 0.0)
        if batch in cost.oom:
            total += OOM_BATCH_S
        else:
            total += (warmup + steps) * cost.step_s(batch) * clip
    return total


def costs_from_records(rows: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], Cost]:
    """``MEASURED`` with what the suite records ``rows`` measured in its place (their setup and whole steps;
    batches out of GPU memory or refused by the planner; host RAM exhausted: ``records.no_room``)."""
    table = dict(MEASURED)
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        if row.get("record") != "run" or "cost_key" not in row:
            continue
        entry = found.setdefault((row["model"], row["cost_key"]), {"setup": [], "steps": {}, "oom": set()})
        if row.get("status") == "ok":
            entry["setup"].append(float(row.get("setup_s") or 0.0))
            entry["steps"].setdefault(int(row["batch"]), []).append(
                float(row["period_s"]) / len(row["step_seconds"])
            )
        elif (room := no_room(row)) in ("gpu", "planner"):  # the batch fails soon after its setup
            entry["oom"].add(int(row["batch"]))
        elif room == "host":
            entry["host_oom_s"] = float(row.get("process_wall_s") or 60.0)
    for key, e in found.items():
        if e.get("host_oom_s") is not None:
            table[key] = Cost(host_oom_s=e["host_oom_s"], source="measured: host RAM exhausted")
        elif e["steps"] or e["oom"]:
            steps = {b: sum(v) / len(v) for b, v in e["steps"].items()}
            setup = sum(e["setup"]) / len(e["setup"]) if e["setup"] else 0.0
            table[key] = Cost(setup_s=setup, steps=steps, oom=frozenset(e["oom"]), source="measured: --costs")
    return table
