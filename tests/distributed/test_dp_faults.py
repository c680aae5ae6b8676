"""A rank that fails makes every other rank fail, naming it; nothing waits for the timeout or hangs.

Rank 1 of two (or of four) fails during step 2: an exception on one of its
pipeline lanes or its main thread, an exception from its data outside the
engine, or its process dying outright. Every other rank must stop with
``PeerFailed`` naming rank 1; with a report (the exceptions) it carries rank
1's error, which shows it came from the report and not from a collective's
timeout (``engine.timeout_s`` is 60 s here, and a timeout raises
``PipelineStalled`` instead). The harness kills and names any rank still
running at its deadline, so a hang fails the test rather than the suite.
"""

from __future__ import annotations

import pytest
from dp_ranks import Job, run_ranks, train

TIMEOUT_S = 60.0


def _job(tiny_model, **faults) -> Job:
    return Job(model_dir=str(tiny_model("llama")), ranks=2, fail_rank=1, timeout_s=TIMEOUT_S, **faults)


def _peers_name_rank_1(outcomes, reason: str | None) -> None:
    for o in outcomes:
        if o.rank == 1:
            continue
        assert o.error == "PeerFailed", f"rank {o.rank}: {o.error}: {o.message}"
        assert "rank 1" in o.message, o.message
        if reason is not None:
            assert reason in o.message, o.message


@pytest.mark.parametrize("lane", ["main", "h2d", "d2h", "optim"])
def test_a_rank_raising_in_its_step_stops_the_others_naming_it(lane, tiny_model):
    outcomes = run_ranks(train, 2, _job(tiny_model, fail_lane=lane), timeout=3 * TIMEOUT_S)
    failed = outcomes[1]
    assert failed.error is not None and "injected failure on rank 1" in failed.message + failed.trace
    _peers_name_rank_1(outcomes, reason=f"injected failure on rank 1, lane {lane}")


def test_four_ranks_all_stop_when_one_raises(tiny_model):
    job = Job(
        model_dir=str(tiny_model("llama")), ranks=4, fail_rank=1, fail_lane="optim", timeout_s=TIMEOUT_S
    )
    outcomes = run_ranks(train, 4, job, timeout=3 * TIMEOUT_S)
    _peers_name_rank_1(outcomes, reason="injected failure on rank 1")


def test_a_rank_whose_data_raises_between_steps_stops_the_others(tiny_model):
    outcomes = run_ranks(train, 2, _job(tiny_model, fault="data"), timeout=3 * TIMEOUT_S)
    assert outcomes[1].error == "Injected"
    _peers_name_rank_1(outcomes, reason="injected data failure on rank 1")


def test_a_rank_that_dies_stops_the_others(tiny_model):
    outcomes = run_ranks(train, 2, _job(tiny_model, fault="exit"), timeout=3 * TIMEOUT_S)
    assert outcomes[1].error == "Died"
    peer = outcomes[0]
    assert peer.error == "PeerFailed", f"{peer.error}: {peer.message}"
    # Its connection closed: rank 0's collective failed at once. Whether the dead process was already
    # reaped when rank 0 looked decides whether rank 0 can name it by its pid.
    assert "rank 1 (pid" in peer.message or "a peer died or was killed" in peer.message, peer.message
