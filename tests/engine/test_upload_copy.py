"""BF16 upload copies (``engine.upload_copy="on"``) train bitwise as the FP32 uploads do ("off").

With "on" every host unit keeps a BF16 copy of its weights that its host update writes in the same
pass (the optimizer's ``lowp_out``), and uploads that copy instead of casting its FP32 master on the
device. Both round to nearest even, so each case trains the tiny model twice in BF16 compute on the
CPU (torch_ref) and compares losses, gradient norms, masters, optimizer state and the exported
weights bit for bit: both optimizers, accumulation, clipping with rollbacks (speculate) and deferred,
a non-finite step skipped after speculating (the rollback restores the master: the copy must follow)
and after deferring, half the units resident, state streamed from the posix tier, a checkpoint and
resume mid-run. After every run each host unit's copy must equal its master's cast (``_fresh``); the
data-parallel cases are in ``tests/distributed/test_dp_training.py`` and ``test_dp_reshard.py``.

Test: ``pytest tests/engine/test_upload_copy.py``.
"""

from __future__ import annotations

import statistics

import pytest
import torch
from safetensors.torch import load_file

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, RunConfig, TrainConfig, Trainer
from slidekit import checkpoint as ck
from slidekit.errors import ConfigError
from slidekit.models.loading import demo_dir
from slidekit.testing.asserts import assert_states_equal, trained_state
from slidekit.testing.models import random_batches

LR, WD = 1e-3, 0.1
#: The tiny models have no tokenizer, and an export writes one: the demo's will do.
TOKENIZER = str(demo_dir() / "tokenizer")


def _config(
    model_dir,
    steps,
    copy,
    *,
    optimizer="layer_adam",
    clip=None,
    policy="auto",
    grad_accum=1,
    run=None,
    on_nonfinite="stop",
    **engine,
):
    return TrainConfig(
        model=ModelConfig(source=str(model_dir), tokenizer=TOKENIZER),  # an export writes a tokenizer
        optim=OptimConfig(
            lr=LR,
            weight_decay=WD,
            name=optimizer,
            max_grad_norm=clip,
            clip_overlap=policy,
            on_nonfinite=on_nonfinite,
        ),
        engine=EngineConfig(
            device="cpu",
            compute_dtype="bfloat16",
            kernels=engine.pop("kernels", "torch_ref"),
            upload_copy=copy,
            **engine,
        ),
        run=run or RunConfig(),
        steps=steps,
        grad_accum=grad_accum,
    )


def _fresh(trainer: Trainer) -> int:
    """Assert every host unit's upload copy equals its master cast to BF16; the number of copies."""
    engine = trainer.engine
    engine.wait_updates()
    copies = 0
    for unit, (copy, master) in enumerate(zip(engine.host.copies, engine.host.masters, strict=True)):
        if copy is None:
            continue
        copies += 1
        want = master.to(torch.bfloat16)
        assert copy.view(torch.int16).equal(want.view(torch.int16)), f"unit {unit}: its upload copy is stale"
    return copies


def _train(model_dir, batches, copy, *, grad_accum=1, plugins=None, export=None, **kw):
    cfg = _config(model_dir, len(batches) // grad_accum, copy, grad_accum=grad_accum, **kw)
    with Trainer(cfg, plugins=plugins) as t:
        result = t.fit(batches)
        copies = _fresh(t)
        if export is not None:
            t.export(str(export))
        host = [u.index for u in t.engine.layout.units if u.slides]
        assert copies == (len(host) if copy == "on" else 0)
        return result, trained_state(t)


def _same(a, b) -> None:
    (ra, sa), (rb, sb) = a, b
    x, y = torch.tensor(ra.grad_norms + ra.losses), torch.tensor(rb.grad_norms + rb.losses)
    assert x.isnan().equal(y.isnan()) and x.nan_to_num().equal(y.nan_to_num())
    assert (ra.speculated, ra.rollbacks) == (rb.speculated, rb.rollbacks)
    assert_states_equal(sa, sb)


def _both(model_dir, batches, **kw):
    off, on = (_train(model_dir, batches, copy, **kw) for copy in ("off", "on"))
    _same(off, on)
    return on


@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_bitwise_the_fp32_uploads(tiny_model, tmp_path, optimizer):
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=4, seed=1)
    runs = {c: _train(model_dir, batches, c, optimizer=optimizer, export=tmp_path / c) for c in ("off", "on")}
    _same(runs["off"], runs["on"])
    exported = {c: load_file(str(tmp_path / c / "model.safetensors")) for c in runs}
    assert exported["off"].keys() == exported["on"].keys()
    for name, t in exported["off"].items():
        assert t.view(torch.int16).equal(exported["on"][name].view(torch.int16)), name
    # The run moved the weights: a copy that was never written would not pass for a fresh one.
    result = runs["on"][0]
    assert len(set(result.losses)) == len(result.losses)


def test_accumulation_and_tied_embeddings(tiny_model):
    _both(tiny_model("qwen2"), random_batches(128, steps=8, seed=2), grad_accum=2)


def _median_norm(model_dir, batches, **kw) -> float:
    return statistics.median(_train(model_dir, batches, "off", **kw)[0].grad_norms)


@pytest.mark.parametrize("policy", ["speculate", "defer"])
@pytest.mark.parametrize("optimizer", ["layer_adam", "adamw_8bit"])
def test_clipping_with_rollbacks(tiny_model, policy, optimizer):
    model_dir = tiny_model("mistral")
    batches = random_batches(128, steps=6, seed=3)
    clip = _median_norm(model_dir, batches, optimizer=optimizer)  # some steps clip, others do not
    on = _both(model_dir, batches, clip=clip, policy=policy, optimizer=optimizer)
    if policy == "speculate":
        assert 0 < on[0].rollbacks < on[0].speculated == 6  # rolled back and redone, with the copy


@pytest.mark.parametrize("policy", ["speculate", "defer"])
def test_skipped_nonfinite_step(tiny_model, policy):
    """Speculating, the rollback of a non-finite step restores the speculated masters and applies nothing:
    their copies, which the speculated update wrote, must be cast again from the restored masters
    (``HostStore.restore``), or the next forward uploads the speculated weights and the runs part.
    Deferring, nothing is written: master and copy stay as they were."""
    from test_speculative_clip import LateNaN

    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=4, seed=7)
    runs = {}
    for copy in ("off", "on"):
        plugins = Plugins(extra=[("late_nan", LateNaN({2}, layers=3))])
        with pytest.warns(RuntimeWarning, match="step 2.*skipped"):
            runs[copy] = _train(
                model_dir,
                batches,
                copy,
                clip=1e6,
                policy=policy,
                plugins=plugins,
                kernels="late_nan",
                on_nonfinite="skip",
            )
    _same(runs["off"], runs["on"])
    if policy == "speculate":
        assert runs["on"][0].rollbacks == 1 and "restore" in runs["on"][0].timings[1]
    else:
        assert runs["on"][0].speculated == 0


@pytest.mark.parametrize(
    "engine",
    [
        {"gpu_resident": "0.5"},
        {"gpu_resident": "0.5", "resident_weights": "slide"},
        {"state_offload_fraction": 0.5},
    ],
    ids=["half resident", "half resident, sliding weights", "streamed state"],
)
def test_resident_and_streamed_units(tiny_model, tmp_path, engine):
    """Resident units (their weights kept or sliding) have no copy and are updated as before; host units
    whose state streams from disk write their copy chunk by chunk."""
    if "state_offload_fraction" in engine:
        engine = {**engine, "state_offload_tier": "posix", "offload_dir": str(tmp_path), "state_chunk": 4096}
    _both(tiny_model("qwen2"), random_batches(128, steps=4, seed=4), clip=1.0, policy="speculate", **engine)


def test_checkpoint_and_resume(tiny_model, tmp_path):
    """Resuming rebuilds the copies from the restored masters (never checkpointed): bitwise the whole run."""
    model_dir = tiny_model("llama")
    batches = random_batches(128, steps=4, seed=9)

    def cfg(d, resume=False):
        run = RunConfig(dir=str(tmp_path / d), checkpoint_every=1, resume=resume)
        return _config(model_dir, 4, "on", clip=1.0, policy="speculate", run=run)

    want = _train(model_dir, batches, "off", clip=1.0, policy="speculate")
    with Trainer(cfg("cut")) as t:
        first = t.fit(batches[:2], steps=2)
    saved = sorted((tmp_path / "cut" / "checkpoints").glob("step-*"))
    assert len(saved) == 2
    for path in saved:  # masters and optimizer state only: the copies are derived, never saved
        assert {name.split("/")[0] for name in ck.read_manifest(path).arrays} == {"master", "state"}
    with Trainer(cfg("cut", resume=True)) as t:
        assert t.engine.steps_done == 2
        _fresh(t)  # right after the restore
        rest = t.fit(batches[2:])
        _fresh(t)
        got = trained_state(t)
    assert first.losses + rest.losses == want[0].losses
    assert_states_equal(got, want[1])


def test_fp32_compute_is_refused(tiny_model):
    with pytest.raises(ConfigError, match=r"engine.upload_copy='on'.*compute dtype is float32.*bfloat16"):
        EngineConfig(compute_dtype="float32", upload_copy="on")
    with pytest.raises(ConfigError, match=r"engine.upload_copy \(CLI: --upload-copy\) must be one of"):
        EngineConfig(upload_copy="yes")
    # "auto" is FP32 on the CPU: refused when the run resolves it.
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(device="cpu", upload_copy="on"),
    )
    with pytest.raises(ConfigError, match=r"compute dtype is float32: set engine.compute_dtype='bfloat16'"):
        Trainer(cfg)
