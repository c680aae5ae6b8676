"""``engine.resident_weights = "auto"`` (the default; ``Planner.weights_layout``).

It takes the layout of "keep" (every unit on the GPU keeps its BF16 weights) where that fits, leaving the
reserve free, and the step-time model does not predict (both as they run: ``Planner.as_run``) the sliding-first layout (``Planner.placed`` with
"auto": as many units on the GPU as fit at the sliding cost, then copies where room is left) more than
``TIE`` faster; else the sliding-first layout, with a note. Checked against the two named layouts over
machines of every size (hypothesis), and on the shape the issue-15 suite measures: Qwen2.5-14B at batch 8
on an 80 GB card. The engine's bits with a mix of kept and sliding weights are
``tests/engine/test_device_state_units.py``'s.

Run: ``pytest tests/test_resident_weights_auto.py``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from planning_fixtures import cuda_machine, planner, tiny_spec

from slidekit.planning import GIB, Placement
from slidekit.planning.profiles import H200_RATES
from slidekit.planning.recommend import TIE

SPEC = tiny_spec("llama", num_hidden_layers=8, hidden_size=512, intermediate_size=2048, vocab_size=4096)


def _decisions(layout) -> list[tuple[bool, bool]]:
    return [(u.resident, u.weights_slide) for u in layout.units]


@settings(max_examples=80, deadline=None)
@given(
    extra=st.floats(-0.1, 0.25),  # GiB of GPU beyond the reserve and every unit at the sliding cost
    ram=st.floats(2.9, 3.3),  # around the host's need
    rates=st.booleans(),
    resident=st.sampled_from(["auto", "all", "0.5"]),
    clip=st.booleans(),
)
def test_auto_is_keep_where_it_fits_and_is_not_slower(extra, ram, rates, resident, clip):
    p = planner(SPEC, batch=4, seq=256, keep_grads=clip)
    base = Placement(gpu_resident=resident, activation_tier="device")
    roomy = cuda_machine(80, ram=64)
    slide_need = p.estimate(dataclasses.replace(base, gpu_resident="all", resident_weights="slide"), roomy)
    gpu = slide_need.device_bytes / 2**30 + 4 + extra  # the 4 GiB reserve
    machine = cuda_machine(gpu, ram=ram, rates=H200_RATES if rates else None)
    keep = p.layout(dataclasses.replace(base, resident_weights="keep"), machine)
    fill = p.placed(base, machine)  # the sliding-first rule
    chosen = p.choose(base, machine)
    budget = p.device_budget(base, machine)
    assert budget is not None
    kept = sum(p.resident_cost(u.index) for u in keep.units if u.resident)
    keep_run, fill_run = p.as_run(keep, machine), p.as_run(fill, machine)  # the update order, clip overlap
    keep_ok = p.estimate_layout(keep_run, machine).placement_fits(machine) and kept <= budget
    fill_fits = p.estimate_layout(fill_run, machine).placement_fits(machine)
    if _decisions(keep) == _decisions(fill):
        assert chosen.layout == fill and not chosen.notes
        return
    if keep_ok and fill_fits and rates:
        a, b = p.predict(keep_run, machine), p.predict(fill_run, machine)
        assert a is not None and b is not None
        faster = a.seconds > b.seconds * (1 + TIE)
    else:
        faster = fill_fits and not keep_ok
    if faster:
        assert chosen.layout == fill and chosen.layout.placement.resident_weights == "auto"
        assert len(chosen.notes) == 1 and "('keep')" in chosen.notes[0]
    elif keep_ok:
        assert chosen.layout == keep and chosen.layout.placement.resident_weights == "keep"
        assert not chosen.notes
    else:  # neither fits: the sliding-first layout, which needs less of the host, is refused
        assert chosen.layout == fill and not fill_fits


def test_where_every_copy_fits_nothing_changes():
    """The layouts of "keep" and "auto" are one where the GPU holds every unit with its weights."""
    p = planner(SPEC, batch=4, seq=256)
    machine = cuda_machine(80, ram=64, rates=H200_RATES)
    chosen = p.choose(Placement(), machine)
    assert all(u.resident and not u.weights_slide for u in chosen.layout.units) and not chosen.notes
    assert chosen.layout.placement == Placement(activation_tier="device")  # "auto" stays: nothing was traded
    assert _decisions(chosen.layout) == _decisions(p.layout(Placement(resident_weights="keep"), machine))


def test_the_cpu_plan_keeps_every_copy():
    p = planner(SPEC, batch=4, seq=256, device_type="cpu")
    machine = dataclasses.replace(cuda_machine(80, ram=64), device_type="cpu", device_free=None, device_total=None)
    assert not any(u.weights_slide for u in p.layout(Placement(gpu_resident="all"), machine).units)


def test_qwen_14b_at_batch_8_on_an_80_gb_card_slides(capsys):
    """The issue-15 suite's 14B rows: "keep" puts 21 of 50 units on the GPU; "auto" puts 37 there, their
    weights sliding, and the step-time model predicts that about 1.4x faster (H200 rates; an H100 measured
    1.53x in arrival order, NOTES 57: ``test_the_measured_80_gb_runs_are_predicted_within_8_percent``)."""
    from slidekit.cli import main

    argv = ["plan", "--preset", "qwen2.5-14b", "--gpu", "h200", "--gpu-gib", "79.2", "--ram-gib", "123.5"]
    argv += ["--batch-size", "8", "--seq-len", "1024", "--optimizer", "adamw_8bit"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    requested = out.split("requested placement: ")[1]
    assert requested.startswith("--gpu-resident auto --state-tier ram --activation-tier device --resident-weights auto")
    assert "weights slide" in requested
    note = next(line for line in out.splitlines() if line.startswith("note: engine.resident_weights='auto'"))
    assert "the step-time model predicts" in note
    assert main([*argv, "--resident-weights", "keep"]) == 0
    keep = capsys.readouterr().out.split("requested placement: ")[1]
    assert "weights slide" not in keep

    def step(text: str) -> float:
        return float(text.split("predicted step ")[1].split(" s")[0])

    assert step(keep) > 1.3 * step(requested)


#: NOTES 57's A/B on an 80 GB card (an H100, one device call): "keep" and "auto", 7B with layer_adam and 14B
#: with adamw_8bit at batch 8, one process each, host updates in arrival order.
MEASURED = Path(__file__).resolve().parents[1] / "docs/benchmarks/raw/2026-12-07-s34/weights-8bef229-h100"


def test_the_measured_80_gb_runs_are_predicted_within_8_percent(capsys):
    """Each run's plan (H200 rates, the card's free memory from the call's env.txt) has the layout it ran
    and predicts its whole step (10 steps start to start, the last drained) within 8%. The sliding rows
    are what the model missed before it cast their weights into cache units on the upload lane, as the
    engine does: predicted 9% and 11% fast; "keep" within 6-7% either way."""
    from slidekit.cli import main

    free = int(re.search(r"\((\d+), \d+\)", (MEASURED / "env.txt").read_text()).group(1)) / GIB
    records = [json.loads(line) for line in (MEASURED / "weights.jsonl").read_text().splitlines()]
    assert sorted((r["model"], r["resident_weights"]) for r in records) == [
        (m, w) for m in ("qwen2.5-14b", "qwen2.5-7b") for w in ("auto", "keep")
    ]
    off = []
    for r in records:
        argv = ["plan", "--preset", r["model"], "--gpu", "h200", "--gpu-gib", f"{free:.3f}", "--ram-gib", "123.5"]
        argv += ["--batch-size", str(r["batch"]), "--seq-len", str(r["seq"]), "--optimizer", r["optimizer"]]
        argv += ["--resident-weights", r["resident_weights"], "--update-order", r["update_order"]]
        assert main(argv) == 0
        out = capsys.readouterr().out.split("requested placement: ")[1]
        on_gpu, units = r["device_state_units"].split("/")
        assert f"{on_gpu} of {units} units resident on the GPU" in out
        predicted = float(out.split("predicted step ")[1].split(" s")[0])
        measured = r["period_s"] / r["steps"]
        if abs(predicted / measured - 1) > 0.08:
            off.append(f"{r['model']} {r['resident_weights']}: predicted {predicted:.3f} s, measured {measured:.3f} s")
    assert not off, off
