"""The suite presets of ``slidekit bench --suite NAME``: one per model size against the no-offload recipes,
one against the alternatives that offload, each sized for one device call of the GPU machine.

The importance rule of ``suites`` orders every suite's runs; an entry here sets its own importance
where a model size makes a kind more or less telling, and says why. ``slidekit bench --suite NAME
--plan-only`` prints what a budget keeps (docs/benchmarking.md lists the suites).

Test: ``pytest tests/test_bench_plan.py``.
"""

from __future__ import annotations

from typing import Any

from slidekit.errors import ConfigError
from slidekit.tools.bench.suites import Alt, Mode, Suite

__all__ = ["SUITES", "suite"]


def _main(
    model: str,
    batches: tuple[int, ...],
    partial: float,
    *,
    big: tuple[int, ...] = (),
    partial_importance: float | None = None,
    **kw: Any,
) -> Suite:
    """slidekit's modes (all, none, the partial share, auto) against the no-offload recipes (HF + Liger
    with and without checkpointing, plain HF); ``big`` batches run all-resident, forced offload and
    HF + Liger (GC) only, in runs of their own (importance 2: the budget drops them before the core)."""
    modes = [
        Mode(resident="all"),
        Mode(resident="none"),
        Mode(resident=f"{partial:g}", importance=partial_importance),
        Mode(resident="auto"),
    ]
    alts = [Alt(name="liger_gc"), Alt(name="liger"), Alt(name="none")]
    if big:
        modes += [Mode(resident=r, batches=big, importance=2.0, clips=(None,)) for r in ("all", "none")]
        alts.append(Alt(name="liger_gc", batches=big, importance=2.0, clips=(None,)))
    note = f"the offload alternatives (torchao, DeepSpeed) are suite {model}-offload, a call of their own"
    return Suite(
        name=model,
        model=model,
        batches=batches,
        modes=tuple(modes),
        alternatives=tuple(alts),
        partial=partial,
        note=kw.pop("note", note),
        **kw,
    )


def _offload(
    model: str,
    batches: tuple[int, ...],
    partial: float,
    *,
    alt_batches: tuple[int, ...] | None = None,
    reference: float = 0.0,
    planner: float | None = None,
    **kw: Any,
) -> Suite:
    """slidekit all-resident (the efficiency reference, importance ``reference``), its partial share and
    forced offload against the alternatives that offload too: torchao, DeepSpeed ZeRO-2 Offload and
    DeepSpeed ZeRO-3 partial offload (ratio 1 - the partial share), on ``alt_batches`` (default: all).
    ``planner``: also the planner's choice (``auto``), at that importance, where the fixed shares are
    sized for one GPU and another may come (an 80 GB card, where all-resident and the share do not fit)."""
    # Here the alternatives are the point: they rank with slidekit's core runs, not after them.
    modes = (
        Mode(resident="all", importance=reference),
        Mode(resident=f"{partial:g}", importance=0.0),
        Mode(resident="none"),
    ) + ((Mode(resident="auto", importance=planner),) if planner is not None else ())
    names = ("torchao", "deepspeed", "deepspeed_partial")
    alts = tuple(Alt(name=n, batches=alt_batches, importance=0.0) for n in names)
    return Suite(
        name=f"{model}-offload",
        model=model,
        batches=batches,
        modes=modes,
        alternatives=alts,
        partial=partial,
        **kw,
    )


_HOST = (
    "torchao and DeepSpeed ZeRO-2 Offload keep ~20-23 B/param on the host (measured at 3B), more than the "
    "machine's RAM at 7B: they are tried, and host RAM exhausted is their measured result"
)


def _dp(model: str, batch: int, *, offload_importance: float, alt_importance: float, note: str) -> Suite:
    """slidekit data-parallel on 2 GPUs against slidekit on 1 GPU (issue 19), the same per-GPU batch:
    the planner's choice and forced full offload, each on 1 and on 2 GPUs, and DeepSpeed ZeRO-2 Offload on
    the same 2 GPUs; no clipping (its cost is the main suites'), one batch (forced offload builds ~1 min)."""
    modes = [Mode(resident=r, ranks=n, importance=0.0) for r in ("auto",) for n in (1, 2)]
    modes += [Mode(resident="none", ranks=n, importance=offload_importance) for n in (1, 2)]
    return Suite(
        name=f"dp-{model}",
        model=model,
        batches=(batch,),
        modes=tuple(modes),
        alternatives=(Alt(name="deepspeed", ranks=2, importance=alt_importance),),
        clips=(None,),
        steps=6,
        warmup=1,
        note=note,
    )


_DP_NOTE = (
    "the 2-GPU machine (nvidia-h200-x2: 256 GB of RAM, 32 CPUs shared by the ranks); --batch is per GPU; "
    "each rank's host update gets OMP_NUM_THREADS = CPUs / ranks; NVLink multicast off in every process"
)

#: The suites of issue 15: per model size one of slidekit against the no-offload recipes, and one against
#: the alternatives that offload, each sized for one device call (docs/benchmarking.md says how). What the
#: time budget leaves out is in the suite's table as "not run: time budget".
SUITES: dict[str, Suite] = {
    "qwen2.5-1.5b": _main("qwen2.5-1.5b", (8, 32, 64), 0.5, clip_batches=(8, 32)),
    "qwen2.5-1.5b-offload": _offload("qwen2.5-1.5b", (8, 32), 0.5, clip_batches=(8,)),
    "qwen2.5-3b": _main("qwen2.5-3b", (8, 32), 0.5, big=(64,), clip_batches=(8,)),
    "qwen2.5-3b-offload": _offload("qwen2.5-3b", (8, 32), 0.5, alt_batches=(8,), clip_batches=(8,)),
    # At 7B forced offload costs ~55 s of setup per batch: the partial share (a headline at this size) goes
    # before the clipped runs, which then do not fit one call (run them as --suite qwen2.5-7b --clip 1.0).
    "qwen2.5-7b": _main("qwen2.5-7b", (8, 32), 0.65, partial_importance=0.5, clip_batches=(8,)),
    # All-resident is the main 7B suite's core; here it comes after the alternatives the issue names.
    # On an 80 GB card all-resident and 65% do not fit 7B (NOTES 51): the planner's choice is what runs there.
    "qwen2.5-7b-offload": _offload("qwen2.5-7b", (8,), 0.65, reference=0.5, planner=0.5, note=_HOST),
    "qwen2.5-14b": Suite(
        name="qwen2.5-14b",
        model="qwen2.5-14b",
        batches=(8, 32),
        modes=(
            Mode(resident="auto", importance=0.0),
            # Every state on the host: layer_adam's 12.3 B/param (~182 GiB) is more than the machine's
            # RAM; adamw_8bit's block-quantized moments (~6 B/param) fit. layer_adam with half of its
            # state on the 64 GiB disk would stream ~120 GB a step (~60 s at 2 GB/s): not in one call.
            Mode(resident="none", optimizer="adamw_8bit", batches=(8,), importance=0.5),
            Mode(resident="all", batches=(8,), importance=0.5, clips=(None,)),  # the planner's refusal
        ),
        alternatives=(
            Alt(
                name="liger_gc", batches=(8,), importance=0.5, clips=(None,)
            ),  # no-offload: its measured cause
            Alt(name="torchao", batches=(8,), clips=(None,)),
            Alt(name="deepspeed", batches=(8,), clips=(None,)),
            Alt(name="deepspeed_partial", batches=(8,)),
        ),
        clip_batches=(8,),
        partial=0.5,
        note="no all-resident run fits 14B (16 B/param on a 141 GB GPU), so there is no offload "
        "efficiency; every state on the host uses adamw_8bit (layer_adam's would need ~182 GiB of RAM)",
    ),
}


# Data parallelism on the 2-GPU machine (issue 19), each one device call; per-GPU batches from
# `slidekit plan --preset MODEL --gpu h200 --nproc-per-node 2 --batch-size 8 --gpu-resident none|auto`:
# 7B forced offload needs 46 GiB of host RAM per rank (92 GiB of the 256), the planner keeps all 30 units
# resident (72 GiB of GPU per rank, compute-bound); 14B forced offload 86 GiB per rank (172 GiB; one
# GPU: 169 GiB), the planner 45 of 50 units resident per rank on 2 GPUs (27 of 50 on one).
SUITES["dp-qwen2.5-7b"] = _dp(
    "qwen2.5-7b",
    8,
    offload_importance=0.0,
    alt_importance=0.0,
    note=_DP_NOTE,
)
# 14B does not fit one call whole (forced offload builds ~2 min a run): the planner's choice first, then
# forced offload on 1 and 2 GPUs; DeepSpeed (expected to exhaust the 256 GB: >= 23 B/param x 14.8 B) last.
SUITES["dp-qwen2.5-14b"] = _dp(
    "qwen2.5-14b",
    8,
    offload_importance=0.5,
    alt_importance=1.0,
    note=_DP_NOTE + "; DeepSpeed is last: expected to exhaust host RAM (>= 23 B/param x 14.8 B = 340 GB)",
)


def _levers(model: str, *, never: float = 1e6) -> Suite:
    """This session's levers side by side in one call (NOTES.md 15, 16): (a) every unit resident at batch 8
    and 32, every layer recomputing against kept activations (``recompute`` "all" / "auto"), against HF +
    Liger with and without checkpointing; (b) forced offload at batch 32 unclipped, clipped at 1.0 with
    ``clip_overlap`` "defer" and "speculate", and clipped at ``never`` (a norm the synthetic recipe never
    reaches) speculating: the backups' cost alone. Every first repeat ranks 0 (the clipped ones 1, by the
    rule); second repeats follow, the kept/recomputed pair first."""
    modes = (
        Mode(resident="all", recompute="all", clips=(None,)),
        Mode(resident="all", recompute="auto", clips=(None,)),
        Mode(resident="none", batches=(32,), clips=(None,)),
        Mode(resident="none", batches=(32,), clips=(1.0,), clip_overlap="defer"),
        Mode(resident="none", batches=(32,), clips=(1.0, never), clip_overlap="speculate"),
    )
    alts = (Alt(name="liger_gc", clips=(None,)), Alt(name="liger", clips=(None,), importance=0.0))
    return Suite(
        name=f"levers-{model}",
        model=model,
        batches=(8, 32),
        modes=modes,
        alternatives=alts,
        clips=(None, 1.0, never),
        steps=6,
        warmup=2,
        note="the levers of issue 16 (NOTES.md 15, 16): kept activations against recomputing every layer and "
        "HF + Liger; clipped forced offload deferred, speculated, and speculated with a clip that never "
        f"fires ({never:g}); per run its rollbacks (the Levers table)",
    )


SUITES["levers-qwen2.5-3b"] = _levers("qwen2.5-3b")


def suite(name: str) -> Suite:
    """The preset ``name``, or a clear error listing them."""
    if name not in SUITES:
        raise ConfigError(f"unknown suite {name!r}; choose one of: {', '.join(SUITES)}")
    return SUITES[name]
