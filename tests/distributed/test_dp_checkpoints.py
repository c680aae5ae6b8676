"""Data-parallel checkpoints: every rank writes its part, rank 0's commits them; resume is bitwise.

Two ranks train four steps straight, and again as two steps, a checkpoint, then two more in new
processes resuming it: the same losses and the same final parameters, bit for bit, with clipping,
accumulation and resident units (their shards gathered again after the restore). A checkpoint whose
part on one rank failed is never committed: the previous one stays the newest and resumes. A
checkpoint of another world size (or one process) whose step batch the resuming run would change is
refused, before any tensor is read, naming the grad_accum that keeps it (``test_dp_reshard``
re-shards it when the batch is kept).
"""

from __future__ import annotations

import dataclasses

import pytest
from dp_ranks import Job, run_ranks, train

from slidekit import checkpoint as ck
from slidekit.testing.asserts import assert_states_equal

SETTINGS = {"steps": 4, "micro": 2, "max_grad_norm": 0.5, "gpu_resident": "0.5"}


def _job(tiny_model, tmp_path, **kw) -> Job:
    run = {"dir": str(tmp_path / "run"), **kw.pop("run", {})}
    return Job(model_dir=str(tiny_model("llama")), run=run, **{"ranks": 2, **SETTINGS, **kw})


@pytest.mark.parametrize("engine", [{}, {"resident_weights": "slide"}])  # resident units keep / slide weights
def test_resume_with_the_same_world_size_is_bitwise(tiny_model, tmp_path, engine):
    straight = [o.ok() for o in run_ranks(train, 2, _job(tiny_model, tmp_path / "a", engine=engine))]
    first = [o.ok() for o in run_ranks(train, 2, _job(tiny_model, tmp_path, fit_steps=2, engine=engine))]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ck.step_dirs(checkpoints)] == [2]  # rank 0's part: the checkpoint
    assert [s for s, _ in ck.step_dirs(checkpoints / "rank-1")] == [2]
    resumed = [
        o.ok()
        for o in run_ranks(train, 2, _job(tiny_model, tmp_path, skip_steps=2, run={"resume": True}, engine=engine))
    ]
    assert all(bool(o["weights_slide"]) == bool(engine) for o in resumed)
    for rank in range(2):
        assert resumed[rank]["steps_done"] == 4
        assert any("resumed from step 2" in n for n in resumed[rank]["notes"])
        assert first[rank]["losses"] + resumed[rank]["losses"] == straight[rank]["losses"]
        assert_states_equal(resumed[rank]["state"], straight[rank]["state"])
    assert [s for s, _ in ck.step_dirs(checkpoints)] == [2, 4]
    assert [s for s, _ in ck.step_dirs(checkpoints / "rank-1")] == [2, 4]


def test_a_part_that_fails_leaves_the_previous_checkpoint_the_newest(tiny_model, tmp_path):
    base = _job(tiny_model, tmp_path, run={"checkpoint_every": 2})
    # Rank 1's part of step 4 (the final checkpoint) fails before it commits.
    failing = dataclasses.replace(base, fail_rank=1, fail_lane="checkpoint:commit", fail_step=5)
    outcomes = run_ranks(train, 2, failing)
    assert outcomes[1].error is not None
    assert outcomes[0].error is not None and "rank 1" in outcomes[0].message, outcomes[0].message
    checkpoints = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in ck.step_dirs(checkpoints)] == [2]  # step 4 was never committed
    resumed = [
        o.ok()
        for o in run_ranks(
            train, 2, dataclasses.replace(base, skip_steps=2, run={**base.run, "resume": True})
        )
    ]
    assert [r["steps_done"] for r in resumed] == [4, 4]


def test_another_world_size_that_changes_the_step_batch_is_refused_naming_the_grad_accum_that_keeps_it(
    tiny_model, tmp_path
):
    """A checkpoint of another world size is re-sharded (``test_dp_reshard``), but only with the step's
    batch (ranks x grad_accum) kept: refused otherwise, before any tensor is read."""
    [o.ok() for o in run_ranks(train, 2, _job(tiny_model, tmp_path, fit_steps=2))]
    four = run_ranks(train, 4, _job(tiny_model, tmp_path, ranks=4, run={"resume": True}))
    assert four[0].error == "CheckpointMismatch", four[0].message
    assert "grad_accum: 2 on 2 ranks -> 2 on 4 ranks" in four[0].message, four[0].message
    assert "grad_accum 1 on 4 ranks keeps it" in four[0].message
    assert all(o.error == "PeerFailed" and "rank 0" in o.message for o in four[1:]), [o.message for o in four]
    one = run_ranks(train, 1, _job(tiny_model, tmp_path, ranks=1, run={"resume": True}))[0]
    assert one.error == "CheckpointMismatch" and "grad_accum 4 on one process keeps it" in one.message, (
        one.message
    )


def test_a_one_process_checkpoint_that_changes_the_step_batch_is_refused_by_two_ranks(tiny_model, tmp_path):
    run_ranks(train, 1, _job(tiny_model, tmp_path, ranks=1, fit_steps=2))[0].ok()
    two = run_ranks(train, 2, _job(tiny_model, tmp_path, run={"resume": True}))
    assert two[0].error == "CheckpointMismatch", two[0].message
    assert "grad_accum: 2 on one process -> 2 on 2 ranks" in two[0].message, two[0].message
    assert "grad_accum 1 on 2 ranks keeps it" in two[0].message
    assert two[1].error == "PeerFailed"
