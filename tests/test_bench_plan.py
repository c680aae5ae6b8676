"""The suite presets, their expansion into runs, the cost model and the time plan, computed by hand.

Nothing here starts a process: a suite's runs (``suites.expand``) follow the importance rule, the
prediction of a run (``costs.predict``) is the documented sum over its batches, and the plan under
a budget (``timeplan.make_plan``) keeps the most important runs that fit, leaving a run out without
stopping the walk. The presets are pinned to one property that matters on the GPU machine: every
run of importance 0 of every suite fits one device call's budget.
"""

from __future__ import annotations

import json

import pytest

from slidekit.cli import build_parser
from slidekit.errors import ConfigError
from slidekit.tools.bench.cli import build_suite
from slidekit.tools.bench.costs import (
    BUILD_S,
    MEASURED,
    OOM_BATCH_S,
    PER_BATCH_S,
    START_S,
    Cost,
    cost_of,
    costs_from_records,
    predict,
)
from slidekit.tools.bench.suite_presets import SUITES
from slidekit.tools.bench.suites import Alt, Mode, Suite, expand, importance
from slidekit.tools.bench.timeplan import format_plan, make_plan

#: What one device call leaves the suite: ``--time-budget $((575 - SECONDS))`` after a ~20 s install
#: (docs/benchmarking.md), 25 s short of the call's 600 s for the tables and the unknown.
CALL_BUDGET_S = 555.0


def _suite(**kw) -> Suite:
    base = dict(
        name="t",
        model="m",
        batches=(8, 32),
        modes=(Mode(resident="all"), Mode(resident="none"), Mode(resident="0.25")),
        alternatives=(Alt(name="liger_gc"), Alt(name="deepspeed_partial")),
        clips=(None, 1.0),
        repeats=2,
        partial=0.25,
    )
    return Suite(**{**base, **kw})


def test_a_suite_is_every_mode_and_alternative_crossed_with_recipes_and_repeats_most_important_first():
    runs = expand(_suite(clip_batches=(8,)))
    assert len(runs) == 5 * 2 * 2
    assert [r.importance for r in runs] == sorted(r.importance for r in runs)
    first = [(r.label, r.clip, r.repeat) for r in runs[:3]]
    assert first == [
        ("slidekit (resident all)", None, 1),
        ("slidekit (resident none)", None, 1),
        ("HF + Liger (GC)", None, 1),
    ]
    # The rule: partial share 1, a repeat +1.2, clipping +1 (slidekit), +3 (an offload alternative).
    by = {(r.label, r.clip, r.repeat): r for r in runs}
    assert by[("slidekit (resident 0.25)", None, 1)].importance == 1.0
    assert by[("slidekit (resident all)", None, 2)].importance == pytest.approx(1.2)
    assert by[("slidekit (resident all)", 1.0, 1)].importance == 1.0
    partial = by[("DeepSpeed ZeRO-3 partial offload (ratio 0.75)", 1.0, 2)]
    assert partial.importance == pytest.approx(3.5 + 3.0 + 1.2)
    # DeepSpeed's partial offload keeps on the GPU the share slidekit keeps resident.
    assert partial.flags[-2:] == ("--offload-ratio", "0.75")
    # Clipped runs measure the clip batches only; unclipped ones every batch.
    assert {r.batches for r in runs if r.clip is not None} == {(8,)}
    assert {r.batches for r in runs if r.clip is None} == {(8, 32)}
    assert by[("slidekit (resident none)", None, 1)].flags[:4] == (
        "--resident",
        "none",
        "--optimizer",
        "layer_adam",
    )
    assert importance("no_offload", 1.0, 2) == pytest.approx(4.0 + 2.0 + 1.2)


def test_the_prediction_of_a_run_is_its_documented_sum():
    table = {("m", "slidekit:all"): Cost(setup_s=2.0, steps={8: 0.5, 32: 1.5})}
    table[("m", "liger_gc")] = Cost(setup_s=10.0, steps={8: 0.4}, oom=frozenset({32}))
    runs = {r.cost_key + str(r.clip) + str(r.repeat): r for r in expand(_suite(batches=(8, 32, 64)))}
    sk = runs["slidekit:allNone1"]
    # 64 is linear through 8 and 32: 0.5 + (1.5 - 0.5) x (64 - 8) / 24.
    at64 = 0.5 + 1.0 * 56 / 24
    steps = 2 + 10
    want = START_S["slidekit"] + 3 * (PER_BATCH_S + 2.0) + steps * (0.5 + 1.5 + at64)
    assert predict(sk, "m", steps=10, warmup=2, table=table) == pytest.approx(want)
    # An alternative builds once; a batch measured out of memory costs OOM_BATCH_S; 64 scales 8's step.
    hf = runs["liger_gcNone1"]
    want = START_S["liger_gc"] + 10.0 + 3 * PER_BATCH_S + steps * 0.4 + OOM_BATCH_S + steps * 0.4 * 64 / 8
    assert predict(hf, "m", steps=10, warmup=2, table=table) == pytest.approx(want)
    # A partial share is between all-resident and none: here none is unknown to the table for "m".
    assert cost_of("qwen2.5-3b", "slidekit:0.25").source.startswith("estimate: 0.25 between")
    full, none = cost_of("qwen2.5-3b", "slidekit:all"), cost_of("qwen2.5-3b", "slidekit:none")
    assert cost_of("qwen2.5-3b", "slidekit:0.25").step_s(8) == pytest.approx(
        full.step_s(8) + 0.75 * (none.step_s(8) - full.step_s(8))
    )
    # Expected to exhaust host RAM: its start and the time until the watchdog kills it.
    ds = next(r for r in expand(SUITES["qwen2.5-7b-offload"]) if r.system == "deepspeed")
    assert (
        predict(ds, "qwen2.5-7b", steps=10, warmup=2)
        == START_S["deepspeed"] + MEASURED[("qwen2.5-7b", "deepspeed")].host_oom_s
    )


def test_the_budget_keeps_the_most_important_runs_that_fit_and_goes_on_past_one_that_does_not():
    suite = _suite(
        repeats=1,
        clips=(None,),
        modes=(Mode(resident="all"), Mode(resident="none")),
        alternatives=(Alt(name="liger"),),
    )
    table = {("m", "slidekit:all"): Cost(setup_s=0.0, steps={8: 1.0, 32: 1.0})}
    table[("m", "slidekit:none")] = Cost(setup_s=0.0, steps={8: 30.0, 32: 30.0})
    table[("m", "liger")] = Cost(setup_s=0.0, steps={8: 1.0, 32: 1.0})
    runs = expand(suite)
    seconds = [predict(r, "m", steps=10, warmup=2, table=table) for r in runs]
    assert [r.cost_key for r in runs] == ["slidekit:all", "slidekit:none", "liger"]
    budget = seconds[0] + seconds[2] + BUILD_S["slidekit"] + 1.0  # room for all-resident and liger, not none
    plan = make_plan(suite, runs, budget_s=budget, prebuild=True, table=table)
    assert [p.keep for p in plan.runs] == [True, False, True]
    assert plan.builds == ("slidekit",) and plan.build_s == BUILD_S["slidekit"]
    assert plan.predicted_s == pytest.approx(BUILD_S["slidekit"] + seconds[0] + seconds[2])
    text = format_plan(plan)
    assert "not run: time budget" in text and "kept 2 of 3 runs" in text
    # Without a budget everything runs; without prebuilds nothing is built.
    free = make_plan(suite, runs, budget_s=None, prebuild=False, table=table)
    assert all(p.keep for p in free.runs) and free.builds == ()


@pytest.mark.parametrize("name", sorted(SUITES))
def test_every_suite_s_core_runs_fit_one_device_call(name):
    suite = SUITES[name]
    runs = expand(suite)
    plan = make_plan(suite, runs, budget_s=CALL_BUDGET_S, prebuild=True)
    core = [p for p in plan.runs if p.run.importance == 0.0]
    assert core and all(p.keep for p in core), format_plan(plan)
    assert plan.predicted_s <= CALL_BUDGET_S
    assert {r.repeat for r in runs} == {1, 2}
    # The data-parallel suites (issue 19) measure scaling without clipping; the others both recipes (the
    # levers' suite a clip that never fires too: the speculation's backups alone).
    recipes = {None} if name.startswith("dp-") else {None, 1.0}
    assert {r.clip for r in runs} == (recipes | {1e6} if name.startswith("levers-") else recipes)


def test_measured_records_replace_the_estimates():
    rows = [
        {"record": "run", "model": "m", "cost_key": "liger", "status": "ok", "batch": 8, "setup_s": 4.0},
        {"record": "run", "model": "m", "cost_key": "torchao", "status": "unavailable", "batch": 8},
    ]
    rows[0] |= {"period_s": 6.0, "step_seconds": [0.5] * 12}
    rows[1] |= {"reason": "host RAM exhausted: child RSS 120 GiB", "process_wall_s": 75.0}
    rows.append({**rows[0], "batch": 32, "period_s": 24.0})
    rows.append({"record": "run", "model": "m", "cost_key": "liger", "status": "unavailable", "batch": 64})
    rows[-1]["reason"] = "does not fit in GPU memory: tried to allocate 9 GiB"
    # slidekit's planner refusing a placement (for host RAM, too) fails as fast as a GPU OOM; a repeat the
    # runner did not start ("not repeated") measured nothing and leaves the estimate alone.
    refused = {"record": "run", "model": "m", "cost_key": "slidekit:all", "status": "unavailable", "batch": 8}
    refused["reason"] = "ConfigError: this configuration does not fit on this machine (...): RAM: needs 130 GiB"
    skipped = {**refused, "model": "qwen2.5-3b", "reason": "not repeated: repeat 1 did not fit this machine"}
    rows += [refused, skipped]
    table = costs_from_records(json.loads(json.dumps(r)) for r in rows)
    assert table[("m", "slidekit:all")].oom == {8} and not table[("m", "slidekit:all")].steps
    assert table[("m", "liger")].steps == {8: 0.5, 32: 2.0} and table[("m", "liger")].setup_s == 4.0
    assert table[("m", "liger")].oom == {64}
    assert table[("m", "torchao")].host_oom_s == 75.0
    assert table[("qwen2.5-3b", "slidekit:all")] == MEASURED[("qwen2.5-3b", "slidekit:all")]


def test_suite_flags_and_their_errors():
    parse = build_parser().parse_args
    suite = build_suite(parse(["bench", "--suite", "qwen2.5-3b", "--repeats", "3", "--clip", "none"]))
    assert suite.model == "qwen2.5-3b" and suite.repeats == 3 and suite.clips == (None,)
    with pytest.raises(ConfigError, match=r"--suite qwen2\.5-3b fixes --batch"):
        build_suite(parse(["bench", "--suite", "qwen2.5-3b", "--batch", "8"]))
    with pytest.raises(ConfigError, match="unknown suite 'nope'"):
        build_suite(parse(["bench", "--suite", "nope"]))
    with pytest.raises(ConfigError, match="max_grad_norm must be positive"):
        build_suite(parse(["bench", "--clip", "none,-1"]))
    adhoc = build_suite(
        parse(["bench", "--resident", "all,0.3", "--clip", "none,1.0", "--baselines", "liger"])
    )
    assert adhoc.partial == 0.3 and adhoc.clips == (None, 1.0) and adhoc.repeats == 2
    assert [m.resident for m in adhoc.modes] == ["all", "0.3"] and [a.name for a in adhoc.alternatives] == [
        "liger"
    ]


def test_state_on_disk_reaches_the_slidekit_runs():
    parse = build_parser().parse_args
    argv = ["bench", "--model", "qwen2.5-14b", "--resident", "none", "--baselines", ""]
    suite = build_suite(parse([*argv, "--state-offload-tier", "posix", "--state-offload-fraction", "0.5"]))
    (run, *_) = expand(suite)
    assert run.label == "slidekit (resident none, 0.5 of state on posix)"
    assert run.flags[-4:] == ("--state-offload-tier", "posix", "--state-offload-fraction", "0.5")
    with pytest.raises(ConfigError, match="needs --state-offload-tier"):
        build_suite(parse([*argv, "--state-offload-fraction", "0.5"]))
