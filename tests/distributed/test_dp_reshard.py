"""Re-sharding: a checkpoint written by W data-parallel ranks resumes on W' ranks (gloo, CPU, FP32).

Each case trains a tiny model on W ranks for two steps with a checkpoint, resumes it on W' ranks
with the step's batch kept (grad_accum x W / W' micro-batches a rank), and trains the last two
steps. Right after the resume, every master and optimizer-state tensor, gathered from the new
shards, equals bit for bit the one the W ranks held (gathered from theirs); the continuation equals
the W-rank run that never stopped: bitwise where the reductions add in the same order (two ranks of
one micro-batch each against one process of two, untied, no clipping: ``test_dp_training``), within
the tolerance of the other data-parallel tests elsewhere. One case (the demo model, which has a
tokenizer) reads the configured data, so the data position (each rank's own count of batches) must
be mapped to the new world for it to pass; the others feed the same global batches to both runs.
Some units are resident and some keep their state on the posix tier (streamed), with both optimizers.

Refused, before any tensor is read: state that is not linear (naming the optimizer), and a resume
whose step batch would change (naming the grad_accum that keeps it). ``read_range`` reads and
verifies only the segments a range touches.

Test: ``pytest tests/distributed/test_dp_reshard.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dp_ranks import WHOLE_ADAM, Job, run_ranks, train

from slidekit import checkpoint as ck
from slidekit.distributed.reshard import overlaps
from slidekit.distributed.shards import unit_shard
from slidekit.identity import differences, step_batch_change
from slidekit.planning.placement import GRANULE
from slidekit.testing.asserts import assert_losses_close, assert_states_close, assert_states_equal

CASES = {  # ranks before, ranks after, micro-batches a step (all ranks), model, optimizer, bitwise
    "2 -> 1, layer_adam, bitwise": (2, 1, 2, "llama", "layer_adam", True),
    "1 -> 2, adamw_8bit, bitwise": (1, 2, 2, "mistral", "adamw_8bit", True),
    "2 -> 4, layer_adam, configured data": (2, 4, 4, "demo", "layer_adam", False),
    "4 -> 2, adamw_8bit": (4, 2, 4, "llama", "adamw_8bit", False),
}
RTOL = {"layer_adam": 1e-6, "adamw_8bit": 1e-5}  # test_dp_training's, where the reduction order differs


def _job(model_dir: str, tmp_path, world: int, micro: int, optimizer: str, **kw) -> Job:
    """The run on ``world`` ranks of a step of ``micro`` micro-batches in all."""
    (tmp_path / "offload").mkdir(parents=True, exist_ok=True)
    return Job(
        model_dir=model_dir,
        ranks=world,
        micro=micro // world,
        steps=4,
        optimizer=optimizer,
        gpu_resident="0.5",
        configured=model_dir == "demo",  # the demo model has a tokenizer: it reads the sample corpus
        seq_len=32 if model_dir == "demo" else 16,
        engine={
            "state_offload_tier": "posix",
            "state_offload_fraction": 0.5,
            "offload_dir": str(tmp_path / "offload"),
            "state_chunk": GRANULE,
        },
        **kw,
    )


def _gathered(outs: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Every unit's master and state, from the ranks' shards, as raw bytes (bitwise comparison)."""
    ranks = [o[key] for o in outs]
    out = {}
    for u in ranks[0]:
        shards = sorted((r[u] for r in ranks), key=lambda s: s["start"])
        out[f"master/{u}"] = torch.cat([s["master"] for s in shards]).view(torch.uint8)
        for name in shards[0]["state"]:
            out[f"state/{u}/{name}"] = torch.cat([s["state"][name].reshape(-1) for s in shards]).view(
                torch.uint8
            )
    return out


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_checkpoint_resumes_on_another_world_size(case, tiny_model, tmp_path):
    before, after, micro, family, optimizer, bitwise = CASES[case]
    model = family if family == "demo" else str(tiny_model(family))
    run = {"dir": str(tmp_path / "run")}
    straight = run_ranks(train, before, _job(model, tmp_path / "a", before, micro, optimizer))[0].ok()
    first = _job(model, tmp_path, before, micro, optimizer, run=run, fit_steps=2, shards=True)
    saved = [o.ok() for o in run_ranks(train, before, first)]
    again = _job(
        model, tmp_path, after, micro, optimizer, run={**run, "resume": True}, shards=True, skip_steps=2
    )
    resumed = [o.ok() for o in run_ranks(train, after, again)]
    # Every tensor the W ranks held at step 2, bit for bit, now cut for W' ranks.
    assert_states_equal(_gathered(resumed, "restored"), _gathered(saved, "trained"))
    assert all(r["steps_done"] == 4 for r in resumed)
    note = next(n for n in resumed[0]["notes"] if n.startswith("re-sharded"))
    ways = {1: "one process", 2: "2 data-parallel ranks", 4: "4 data-parallel ranks"}
    assert f"from {ways[before]} to {ways[after]}" in note, note
    assert f"= {micro * 2} rows, as it did on" in note, note
    if family == "demo":  # the data position, each rank's own count, is counted for the new world
        assert f"the configured data goes on from batch {2 * micro} of its stream" in note, note
    # The continuation is the run that never stopped.
    losses = saved[0]["losses"] + resumed[0]["losses"]
    if bitwise:
        assert losses == straight["losses"]
        assert_states_equal(resumed[0]["state"], straight["state"])
    else:
        assert_losses_close(losses, straight["losses"], rtol=RTOL[optimizer])
        assert_states_close(resumed[0]["state"], straight["state"], rtol=RTOL[optimizer])
    for r in resumed[1:]:
        assert_states_equal(r["state"], resumed[0]["state"])


def _copies(job: Job, copy: str) -> Job:
    """``job`` in BF16 compute with ``engine.upload_copy`` = ``copy``."""
    engine = {**job.engine, "upload_copy": copy, "kernels": "torch_ref"}
    return dataclasses.replace(job, compute_dtype="bfloat16", engine=engine)


def test_resharding_rebuilds_the_upload_copies(tiny_model, tmp_path):
    """2 ranks -> 1 with upload copies (``engine.upload_copy``): the resumed run casts its copies from the
    re-sharded masters (the copies are never checkpointed), and trains bitwise as the FP32 uploads do."""
    model = str(tiny_model("llama"))
    runs = {}
    for copy in ("off", "on"):
        run = {"dir": str(tmp_path / copy / "run")}
        first = _copies(_job(model, tmp_path / copy, 2, 2, "layer_adam", run=run, fit_steps=2), copy)
        saved = [o.ok() for o in run_ranks(train, 2, first)]
        again = _job(model, tmp_path / copy, 1, 2, "layer_adam", run={**run, "resume": True}, skip_steps=2)
        resumed = run_ranks(train, 1, _copies(again, copy))[0].ok()
        assert resumed["steps_done"] == 4 and any(n.startswith("re-sharded") for n in resumed["notes"])
        assert bool(resumed["upload_copies"]) == (copy == "on")  # each checked against its master
        runs[copy] = (saved[0]["losses"] + resumed["losses"], resumed["state"])
    assert runs["on"][0] == runs["off"][0]
    assert_states_equal(runs["on"][1], runs["off"][1])


def test_state_that_is_not_linear_is_refused_naming_the_optimizer(tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    run = {"dir": str(tmp_path / "run")}
    [o.ok() for o in run_ranks(train, 2, _job(model, tmp_path, 2, 2, WHOLE_ADAM, run=run, fit_steps=2))]
    one = run_ranks(train, 1, _job(model, tmp_path, 1, 2, WHOLE_ADAM, run={**run, "resume": True}))[0]
    assert one.error == "ConfigError", one.message
    assert f"optimizer {WHOLE_ADAM!r} does not declare linear_state" in one.message, one.message
    assert "torchrun --nproc-per-node 2" in one.message
    # The same world size still resumes it.
    again = run_ranks(train, 2, _job(model, tmp_path, 2, 2, WHOLE_ADAM, run={**run, "resume": True}))
    assert [o.ok()["steps_done"] for o in again] == [4, 4]


# ---------------------------------------------------------------------- the pieces, in one process


def test_overlaps_cover_the_new_shard_at_granule_multiples():
    for numel in (1, GRANULE - 1, 3 * GRANULE + 777, 40_001):
        for old_world in (1, 2, 3, 4, 8):
            for new_world in (1, 2, 4, 5):
                for rank in range(new_world):
                    new = unit_shard(numel, new_world, rank)
                    spans = overlaps(new, old_world)
                    covered = [i for _, lo, hi in spans for i in range(lo, hi)]
                    assert covered == list(range(new.start, new.stop))
                    for old, lo, _ in spans:
                        assert old.start <= lo and (lo - old.start) % GRANULE == 0
                        assert new.world == 1 or (lo - new.start) % GRANULE == 0


def test_the_step_batch_decides_what_a_world_size_change_may_do():
    assert step_batch_change(2, 1, (2, 4)) is None  # 2 x 2 = 4 x 1
    assert step_batch_change(2, 4, (2, 1)) is None
    change = step_batch_change(2, 2, (2, 4))
    assert (
        change and "2 on 2 ranks -> 2 on 4 ranks" in change and "grad_accum 1 on 4 ranks keeps it" in change
    )
    change = step_batch_change(1, 1, (2, 4))
    assert change and "no grad_accum keeps it on 4 ranks: resume on a world size dividing 2" in change
    assert step_batch_change(1, 2, (1, 1)) == "grad_accum: 1 -> 2"  # one world: as before
    saved = {"grad_accum": 4}
    assert differences(saved, {"grad_accum": 2}, worlds=(1, 2))[0] == []
    assert differences(saved, {"grad_accum": 4}, worlds=(1, 2))[0]


def _saved(tmp_path, values: torch.Tensor) -> ck.Manifest:
    with ck.CheckpointWriter(tmp_path, chunk_bytes=64) as w:  # 16 float32 a segment
        path = w.save(1, {"a": values}).result()
    return ck.read_manifest(path)


@pytest.mark.parametrize("span", [(0, 100), (0, 0), (5, 6), (16, 48), (3, 77), (95, 100), (17, 31)])
def test_read_range_reads_exactly_the_range(tmp_path, span):
    values = torch.randn(100)
    man = _saved(tmp_path, values)
    out = torch.empty(span[1] - span[0])
    ck.read_range(man.path, "a", *span, out)
    assert torch.equal(out, values[span[0] : span[1]])


def test_read_range_checks_only_the_segments_it_reads(tmp_path):
    values = torch.randn(100)
    man = _saved(tmp_path, values)
    chunk = man.path / "arrays" / "a" / "c" / "2"  # elements 32..47: segment 2
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    ck.read_range(man.path, "a", 0, 32, torch.empty(32))
    ck.read_range(man.path, "a", 48, 100, torch.empty(52))
    for a, b in ((30, 34), (40, 41), (32, 48), (0, 100)):
        with pytest.raises(ck.CheckpointCorrupt, match="segment 2"):
            ck.read_range(man.path, "a", a, b, torch.empty(b - a))


def test_read_range_refuses_a_bad_range_naming_it(tmp_path):
    man = _saved(tmp_path, torch.randn(10))
    with pytest.raises(ck.CheckpointMismatch, match=r"must lie in \[0, 10\]"):
        ck.read_range(man.path, "a", 4, 11, torch.empty(7))
    with pytest.raises(ck.CheckpointMismatch, match="the destination has 3"):
        ck.read_range(man.path, "a", 4, 8, torch.empty(3))
