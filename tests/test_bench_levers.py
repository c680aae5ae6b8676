"""The levers in ``slidekit bench``: kept activations (``--recompute``) and speculative clipping (``--clip-overlap``).

A mode that sets a lever passes it to its child, says it in its label and cost key, and its rows carry
it; a mode that does not is exactly what it was. The ad-hoc flags cross like ``--resident``; the
``levers-qwen2.5-3b`` suite fits one device call; the levers' table computes its ratios and rollback
counts from hand-made records; a real slidekit child (tiny, on the CPU) records per timed step whether
it speculated and rolled back.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

import pytest
from bench_helpers import table_row

from slidekit.cli import build_parser, main
from slidekit.errors import ConfigError
from slidekit.tools.bench import bench
from slidekit.tools.bench.cli import build_suite
from slidekit.tools.bench.costs import (
    CLIP_FACTOR,
    LEVER_FACTOR,
    OVERLAP_CLIP_FACTOR,
    START_S,
    Cost,
    clip_factor,
    cost_of,
    predict,
)
from slidekit.tools.bench.levers import levers_markdown
from slidekit.tools.bench.slidekit_run import _config, slidekit_parser
from slidekit.tools.bench.slidekit_run import main as child_main
from slidekit.tools.bench.suite_presets import SUITES
from slidekit.tools.bench.suites import Mode, Suite, expand
from slidekit.tools.bench.summary import suite_markdown
from slidekit.tools.bench.timeplan import format_plan, make_plan

parse = build_parser().parse_args


# ---------------------------------------------------------------------------- modes, flags, labels


def test_a_mode_without_levers_is_what_it_was():
    mode = Mode(resident="all")
    assert mode.label == "slidekit (resident all)" and mode.cost_key == "slidekit:all"
    assert mode.flags == ("--resident", "all", "--optimizer", "layer_adam") and mode.levers == ()
    (run,) = expand(
        Suite(name="t", model="m", batches=(8,), modes=(mode,), alternatives=(), clips=(None,), repeats=1)
    )
    assert run.levers == () and run.flags == mode.flags


def test_a_mode_s_levers_reach_its_flags_label_and_cost_key():
    mode = Mode(resident="none", recompute="all", clip_overlap="speculate", ranks=2)
    assert mode.label == "slidekit (resident none, recompute all, clip_overlap speculate) on 2 GPUs"
    assert mode.family == "slidekit (resident none, recompute all, clip_overlap speculate)"
    assert mode.flags[-4:] == ("--recompute", "all", "--clip-overlap", "speculate")
    assert mode.cost_key == "slidekit:none+recompute=all+clip_overlap=speculate@2"
    with pytest.raises(
        ConfigError, match=r"recompute='some' is not engine\.recompute's; choose from: auto, all, none"
    ):
        Mode(resident="all", recompute="some")
    with pytest.raises(ConfigError, match=r"clip_overlap='later'.*choose from: auto, speculate, defer"):
        Mode(resident="all", clip_overlap="later")
    # clip_overlap changes only clipped steps: an unclipped recipe of such a mode is refused.
    with pytest.raises(ConfigError, match="sets clip_overlap, which changes only clipped steps"):
        Suite(
            name="t",
            model="m",
            batches=(8,),
            modes=(Mode(resident="none", clip_overlap="defer"),),
            alternatives=(),
        )


def test_adhoc_levers_cross_like_resident():
    argv = [
        "bench",
        "--model",
        "qwen2.5-3b",
        "--resident",
        "all,none",
        "--baselines",
        "",
        "--clip",
        "none,1.0",
    ]
    suite = build_suite(parse([*argv, "--recompute", "all,auto", "--clip-overlap", "defer,speculate"]))
    got = {(m.label, m.clips) for m in suite.modes}
    want = set()
    for resident in ("all", "none"):
        for recompute in ("all", "auto"):
            label = f"slidekit (resident {resident}, recompute {recompute}"
            want.add((label + ")", (None,)))
            want |= {(f"{label}, clip_overlap {o})", (1.0,)) for o in ("defer", "speculate")}
    assert got == want and len(suite.modes) == 12
    runs = expand(suite)
    assert len(runs) == 12 * 2  # two repeats; one recipe each
    spec = next(r for r in runs if r.label == "slidekit (resident none, recompute auto, clip_overlap defer)")
    assert spec.clip == 1.0 and spec.levers == (("recompute", "auto"), ("clip_overlap", "defer"))
    assert spec.flags[4:] == ("--recompute", "auto", "--clip-overlap", "defer")
    # Without the flags, the modes are those of before.
    plain = build_suite(parse(argv))
    assert [m.label for m in plain.modes] == ["slidekit (resident all)", "slidekit (resident none)"]
    with pytest.raises(ConfigError, match="--clip-overlap defer changes only clipped steps"):
        build_suite(parse(["bench", "--model", "tiny", "--clip-overlap", "defer"]))
    with pytest.raises(ConfigError, match="--recompute 'all,all': give one or more distinct values"):
        build_suite(parse(["bench", "--model", "tiny", "--recompute", "all,all"]))
    with pytest.raises(ConfigError, match=r"--suite levers-qwen2\.5-3b fixes --recompute, --clip-overlap"):
        build_suite(
            parse(["bench", "--suite", "levers-qwen2.5-3b", "--recompute", "all", "--clip-overlap", "defer"])
        )


def test_the_child_takes_the_levers_into_its_config(tmp_path):
    args = slidekit_parser().parse_args(["--recompute", "all", "--clip-overlap", "defer", "--clip", "1.0"])
    config = _config(argparse.Namespace(**{**vars(args), "batch": 8}), str(tmp_path))  # main: one batch
    assert config.engine.recompute == "all" and config.optim.clip_overlap == "defer"
    default = _config(
        argparse.Namespace(**{**vars(slidekit_parser().parse_args([])), "batch": 8}), str(tmp_path)
    )
    assert default.engine.recompute == "auto" and default.optim.clip_overlap == "auto"


_STAND_IN = """
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--batch")
args, rest = p.parse_known_args()
for b in args.batch.split(","):
    print(json.dumps({"system": "slidekit", "status": "ok", "batch": int(b), "tokens_per_s": 100.0,
                      "model_tflops": 1.0, "argv": rest}), flush=True)
"""


def test_the_runner_passes_a_mode_s_levers_and_its_rows_carry_them(tmp_path):
    (tmp_path / "slidekit.py").write_text(textwrap.dedent(_STAND_IN))
    argv = [
        "bench",
        "--model",
        "tiny",
        "--batch",
        "2",
        "--resident",
        "none",
        "--baselines",
        "",
        "--repeats",
        "1",
    ]
    argv += ["--clip", "none,1.0", "--clip-overlap", "speculate", "--baselines-dir", str(tmp_path)]
    rows = bench(parse([*argv, "--ram-floor-gib", "0"]), watchdog=None)
    by = {r["label"]: r for r in rows}
    assert set(by) == {"slidekit (resident none)", "slidekit (resident none, clip_overlap speculate)"}
    spec = by["slidekit (resident none, clip_overlap speculate)"]
    assert spec["levers"] == {"clip_overlap": "speculate"} and spec["max_grad_norm"] == 1.0
    assert spec["argv"][spec["argv"].index("--clip-overlap") + 1] == "speculate"
    assert spec["cost_key"] == "slidekit:none+clip_overlap=speculate"
    plain = by["slidekit (resident none)"]
    assert (
        "levers" not in plain and "--clip-overlap" not in plain["argv"] and "--recompute" not in plain["argv"]
    )


# ---------------------------------------------------------------------------- costs and the suite's plan


def test_levers_scale_their_kind_s_cost():
    table = {("m", "slidekit:all"): Cost(setup_s=4.0, steps={8: 1.0, 32: 4.0}, source="measured")}
    table[("m", "slidekit:none")] = Cost(setup_s=20.0, steps={32: 2.0}, source="measured")
    kept = cost_of("m", "slidekit:all+recompute=auto", table)
    f = LEVER_FACTOR[("recompute", "auto")]
    assert kept.steps == {8: pytest.approx(f), 32: pytest.approx(4 * f)} and kept.setup_s == 4.0
    assert cost_of("m", "slidekit:all+recompute=all", table).steps == {8: 1.0, 32: 4.0}
    # Sliding layers keep too; clip_overlap sets the clipping factor, not the step.
    assert cost_of("m", "slidekit:none+recompute=auto", table).steps == {32: pytest.approx(2 * f)}
    assert cost_of("m", "slidekit:none+clip_overlap=defer", table).steps == {32: 2.0}
    # What --costs measured under the exact key wins over the estimate.
    table[("m", "slidekit:all+recompute=auto")] = Cost(
        setup_s=1.0, steps={8: 0.5}, source="measured: --costs"
    )
    assert cost_of("m", "slidekit:all+recompute=auto", table).steps == {8: 0.5}
    suite = Suite(
        name="t",
        model="m",
        batches=(32,),
        modes=(Mode(resident="none", clips=(1.0,), clip_overlap="speculate"), Mode(resident="none")),
        alternatives=(),
        clips=(None, 1.0),
        repeats=1,
    )
    by = {(r.label, r.clip): r for r in expand(suite)}
    spec = by[("slidekit (resident none, clip_overlap speculate)", 1.0)]
    plain, default_clip = by[("slidekit (resident none)", None)], by[("slidekit (resident none)", 1.0)]
    assert clip_factor(spec) == OVERLAP_CLIP_FACTOR["speculate"] and clip_factor(plain) == 1.0
    assert clip_factor(default_clip) == CLIP_FACTOR["slidekit"]  # no lever: as before
    want = START_S["slidekit"] + 1.0 + 20.0 + 12 * 2.0 * OVERLAP_CLIP_FACTOR["speculate"]
    assert predict(spec, "m", steps=10, warmup=2, table=table) == pytest.approx(want)


def test_the_levers_suite_fits_one_device_call(capsys):
    suite = SUITES["levers-qwen2.5-3b"]
    runs = expand(suite)
    plan = make_plan(suite, runs, budget_s=545.0, prebuild=True)
    assert plan.predicted_s <= 545.0
    # Every first repeat runs: (a) both recompute modes at 8 and 32, HF + Liger with and without GC;
    # (b) forced offload at 32 unclipped, clipped deferred, clipped speculated, and the clip that never fires.
    first = {(p.run.label, p.run.clip): p.keep for p in plan.runs if p.run.repeat == 1}
    assert first == {
        ("slidekit (resident all, recompute all)", None): True,
        ("slidekit (resident all, recompute auto)", None): True,
        ("HF + Liger (GC)", None): True,
        ("HF + Liger (no GC)", None): True,
        ("slidekit (resident none)", None): True,
        ("slidekit (resident none, clip_overlap defer)", 1.0): True,
        ("slidekit (resident none, clip_overlap speculate)", 1.0): True,
        ("slidekit (resident none, clip_overlap speculate)", 1e6): True,
    }
    assert {r.batches for r in runs if r.resident == "all"} == {(8, 32)}
    assert {r.batches for r in runs if r.resident == "none"} == {(32,)}
    # The second repeats the budget keeps: the kept / recomputed pair first (docs/benchmarking.md says which).
    second = [p.run.label for p in plan.runs if p.run.repeat == 2 and p.keep]
    assert second[:2] == ["slidekit (resident all, recompute all)", "slidekit (resident all, recompute auto)"]
    assert main(["bench", "--suite", "levers-qwen2.5-3b", "--plan-only", "--time-budget", "545"]) == 0
    text = capsys.readouterr().out
    assert format_plan(plan) in text and f"kept {len(plan.kept)} of {len(runs)} runs" in text


# ---------------------------------------------------------------------------- the levers' table


def _row(label, system, batch, tokens, *, levers=None, resident=None, **kw):
    optimizer = "layer_adam" if system == "slidekit" else None
    row = table_row(label, system, batch, tokens, resident=resident, optimizer=optimizer, **kw)
    return row | ({"levers": levers} if levers else {})


def _levers_rows() -> list[dict]:
    rows = []
    for batch, recomputed, kept in ((8, 1000.0, 1250.0), (32, 900.0, 1080.0)):
        for repeat, jitter in ((1, 0.0), (2, 10.0)):
            for recompute, tokens, layers in (("all", recomputed, 0), ("auto", kept, 36)):
                label = f"slidekit (resident all, recompute {recompute})"
                rows.append(
                    _row(
                        label,
                        "slidekit",
                        batch,
                        tokens + jitter,
                        repeat=repeat,
                        resident="all",
                        levers={"recompute": recompute},
                        kept_layers=layers,
                    )
                )
        rows.append(_row("HF + Liger (GC)", "liger_gc", batch, 1000.0))
        rows.append(_row("HF + Liger (no GC)", "liger", batch, 1200.0 if batch == 8 else None))
    rows[-1] |= {"status": "unavailable", "reason": "does not fit in GPU memory"}
    none = "slidekit (resident none)"
    rows.append(_row(none, "slidekit", 32, 500.0, resident="none"))
    for overlap, clip, tokens, rolled, speculated in (
        ("defer", 1.0, 340.0, [0] * 6, [0] * 6),
        ("speculate", 1.0, 300.0, [1] * 6, [1] * 6),
        ("speculate", 1e6, 475.0, [0] * 6, [1] * 6),
    ):
        label = f"{none[:-1]}, clip_overlap {overlap})"
        rows.append(
            _row(
                label,
                "slidekit",
                32,
                tokens,
                clip=clip,
                resident="none",
                levers={"clip_overlap": overlap},
                clip_rollback=rolled,
                clip_speculated=speculated,
            )
        )
    return rows


def test_the_levers_table_gives_the_ratios_that_matter():
    text = levers_markdown(_levers_rows())
    lines = text.splitlines()

    def line(*cells: str) -> str:
        found = [x for x in lines if x.startswith("| " + " | ".join(cells) + " |")]
        assert len(found) == 1, (cells, text)
        return found[0]

    # Kept / recomputed: medians over the repeats (1255 / 1005 at batch 8), against the HF + Liger cells.
    auto8 = line("slidekit (resident all, recompute auto)", "no clipping", "8")
    assert f"| 1,255 (2) | 36 | {1255 / 1005:.2f}x | {1255 / 1000:.2f}x | {1255 / 1200:.2f}x |" in auto8
    all8 = line("slidekit (resident all, recompute all)", "no clipping", "8")
    assert "| 1,005 (2) | 0 | - | 1.00x | 0.84x |" in all8
    auto32 = line("slidekit (resident all, recompute auto)", "no clipping", "32")
    assert f"| {1085 / 905:.2f}x | {1085 / 1000:.2f}x | - |" in auto32  # no Liger without GC at 32
    # Clipped / unclipped per overlap mode, and every repeat's rollbacks.
    defer = line("slidekit (resident none, clip_overlap defer)", "max_grad_norm 1", "32")
    assert "| 340 (1) | 0.68x | 0/6 rolled back, 0/6 speculated |" in defer
    spec = line("slidekit (resident none, clip_overlap speculate)", "max_grad_norm 1", "32")
    assert "| 0.60x | 6/6 rolled back, 6/6 speculated |" in spec
    never = line("slidekit (resident none, clip_overlap speculate)", "max_grad_norm 1e+06", "32")
    assert "| 0.95x | 0/6 rolled back, 6/6 speculated |" in never
    # The suite's page has the section; a suite without levers has none.
    page = suite_markdown({"name": "levers", "suite": {}}, _levers_rows(), records_name="r.jsonl")
    assert "### Levers" in page
    plain = [r for r in _levers_rows() if "levers" not in r]
    assert levers_markdown(plain) == "" and "### Levers" not in suite_markdown({}, plain, records_name="r")


# ---------------------------------------------------------------------------- a real child


@pytest.mark.slow
@pytest.mark.parametrize(("overlap", "speculated"), [("speculate", 1), ("defer", 0)])
def test_a_slidekit_record_says_per_timed_step_whether_it_speculated_and_rolled_back(
    tmp_path, capsys, overlap, speculated
):
    """The synthetic recipe's norm (~6 on tiny) is far above 1.0: every step clips, so every speculating
    step rolls back; a deferring one never speculates."""
    out = tmp_path / "r.jsonl"
    argv = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "3",
        "--warmup",
        "1",
    ]
    argv += ["--resident", "none", "--clip", "1.0", "--clip-overlap", overlap, "--out", str(out)]
    assert child_main(argv) == 0
    (record,) = [json.loads(x) for x in Path(out).read_text().splitlines()]
    assert record["status"] == "ok" and record["clip_overlap"] == overlap and record["recompute"] == "auto"
    assert record["clip_speculated"] == [speculated] * 3 and record["clip_rollback"] == [speculated] * 3
    assert min(record["grad_norms"]) > 1.0
    capsys.readouterr()


def test_a_run_ended_by_a_signal_says_which(monkeypatch):
    """SIGTERM during the fit (a harness's time limit) ends the run before its next step; the error names
    the signal instead of a bare step count."""
    import os
    import signal

    from slidekit.distributed import launch
    from slidekit.tools.bench.slidekit_run import measure_slidekit

    def terminated_after(stream, parallel, *, batches=3):
        for k, batch in enumerate(stream):
            if k == batches:  # inside fit: its handler takes the signal; the step of this batch is not taken
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    monkeypatch.setattr(launch, "rank_batches", terminated_after)
    argv = ["--model", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "4", "--warmup", "1"]
    args = argparse.Namespace(**{**vars(slidekit_parser().parse_args(argv)), "batch": 2})
    with pytest.raises(RuntimeError, match=r"fit ran 3 steps of 5 \(SIGTERM ended it\)"):
        measure_slidekit(args)
