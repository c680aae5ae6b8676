"""benchmarks/reference_sweep.py: random configurations against transformers + torch.optim.AdamW.

A few fixed seeds that between them cross the families, tied and untied embeddings, RoPE types,
accumulation, clipping and the engine's options; and the sweep's own failure report."""

from __future__ import annotations

import pytest
from bench_helpers import load_benchmark

SWEEP = load_benchmark("reference_sweep")
# Between them: all four families, tied and untied, four RoPE types, accumulation 1-3, clipping that fires
# (0.05) and one that never does, every residency mode, both update orders, a clip that fires under each
# way of overlapping it (auto, speculate, defer), every choice of what a resident unit keeps.
SEEDS = [0, 1, 3, 6, 7, 10, 20]


def test_the_seeds_cross_what_they_claim():
    cases = [SWEEP.draw(s) for s in SEEDS]
    assert {c["family"] for c in cases} == {"llama", "qwen2", "qwen3", "mistral"}
    assert {c["model"]["tie_word_embeddings"] for c in cases} == {True, False}
    assert len({c["model"]["rope_parameters"]["rope_type"] for c in cases}) >= 4
    assert {c["recipe"]["max_grad_norm"] for c in cases} >= {0.05, None}
    assert {c["recipe"]["grad_accum"] for c in cases} >= {1, 2}
    assert {c["engine"]["gpu_resident"] for c in cases} == {"none", "all", "0.5", "auto"}
    assert {c["engine"]["update_order"] for c in cases} >= {"arrival", "forward"}
    fired = {c["recipe"]["clip_overlap"] for c in cases if c["recipe"]["max_grad_norm"] == 0.05}
    assert fired == {"auto", "speculate", "defer"}
    assert {c["engine"]["resident_weights"] for c in cases} == {"keep", "slide", "auto"}


@pytest.mark.parametrize("seed", SEEDS)
def test_slidekit_matches_the_reference_loop(seed):
    record = SWEEP.run(seed)
    assert record["status"] == "compared", record
    assert record["ok"], record
    assert record["loss_rel_err"] <= SWEEP.LOSS_RTOL and record["param_rel_err"] <= SWEEP.PARAM_RTOL


def test_one_element_of_a_near_cancelled_gradient_is_isolated_and_more_are_not():
    import torch

    want = torch.zeros(1000)
    got = want.clone()
    got[7] = 1.5 * SWEEP.LR  # one element's first Adam step went another way
    assert SWEEP._isolated(got, want, steps=1) == 1
    got[:6] = 0.5 * SWEEP.LR  # 7 of 1000: more than 1 in 200
    assert SWEEP._isolated(got, want, steps=1) is None
    one = want.clone()
    one[0] = 3 * SWEEP.LR  # more than a step's whole update: not a near-cancelled gradient's difference
    assert SWEEP._isolated(one, want, steps=1) is None


def test_a_wrong_result_fails_the_sweep(monkeypatch, capsys):
    """A slidekit run whose parameters are off by more than the tolerance is a failure, and exits 1."""
    import torch

    from slidekit import Trainer

    state_dict = Trainer.state_dict
    calls = {"n": 0}

    def off(self):
        calls["n"] += 1
        state = state_dict(self)
        if calls["n"] == 2:  # the final state (the first call is the initial one): every element moved
            return {k: v + 0.5 * SWEEP.LR * torch.sign(v) for k, v in state.items()}
        return state

    monkeypatch.setattr(Trainer, "state_dict", off)
    assert SWEEP.main(["--seeds", str(SEEDS[0])]) == 1
    assert '"ok": false' in capsys.readouterr().out


def test_bad_seeds_are_named():
    with pytest.raises(SystemExit, match="--seeds: give A:B"):
        SWEEP.main(["--seeds", "x:y"])
