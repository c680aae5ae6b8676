"""The pipeline's threads: errors reach every waiter, waits are bounded, close joins everything.

No test here sleeps to order events or times how fast something happened: the order comes from
events (a gate that is only opened afterwards, a predicate that starts the failing thread), and a
wait that must give up waits on something that can never happen.
"""

from __future__ import annotations

import threading

import pytest

from slidekit.engine.runtime import POOLS, Pipeline
from slidekit.errors import PipelineError, PipelineStalled


class Boom(Exception):
    pass


def test_a_task_error_reaches_a_waiter_on_another_future():
    p = Pipeline(timeout_s=30)
    gate = threading.Event()
    slow = p.submit("h2d", gate.wait)  # runs until the gate opens, which only happens below
    try:

        def explode():
            raise Boom("optimizer died")

        p.submit("optim", explode)
        with pytest.raises(Boom, match="optimizer died"):
            p.result(slow, "the slow upload")  # not the failing future: still raises the root cause
        # The waiter gave up on the error, not on the future (still running) nor on the timeout (that
        # would have been PipelineStalled).
        assert not slow.done()
    finally:
        gate.set()
        p.close()


def test_wait_until_is_interrupted_by_a_failure():
    p = Pipeline(timeout_s=30)
    waiting = threading.Event()

    def fail_once_waiting() -> None:
        assert waiting.wait(30), "wait_until never checked its predicate"
        p.fail(Boom("late"))

    failer = threading.Thread(target=fail_once_waiting)
    failer.start()

    def never() -> bool:
        waiting.set()  # the first check has run: the failure comes while wait_until waits
        return False

    with pytest.raises(Boom, match="late"):
        p.wait_until(never, "something that never happens")
    failer.join(30)
    p.close()


def test_waits_are_bounded():
    p = Pipeline(timeout_s=0.3)
    with pytest.raises(PipelineStalled, match="never happens"):
        p.wait_until(lambda: False, "a thing that never happens")
    gate = threading.Event()
    fut = p.submit("d2h", gate.wait)  # stuck until the gate opens, after the wait gave up
    try:
        with pytest.raises(PipelineStalled, match="a stuck copy"):
            p.result(fut, "a stuck copy")
    finally:
        gate.set()
        p.close()


def test_tasks_after_a_failure_are_not_run():
    p = Pipeline(timeout_s=5)
    p.fail(Boom("first"))
    with pytest.raises(Boom):
        p.submit("optim", lambda: None)
    p.close()
    with pytest.raises(PipelineError, match="closed"):
        p.submit("optim", lambda: None)


def _new_pipeline_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Live threads started since ``before`` that belong to a pipeline (named after its pools)."""
    prefixes = tuple(f"slidekit-{pool}_" for pool in POOLS)
    return [t for t in threading.enumerate() if t not in before and t.name.startswith(prefixes)]


def test_close_joins_every_thread():
    before = set(threading.enumerate())
    p = Pipeline(timeout_s=5)
    for pool in POOLS:
        p.result(p.submit(pool, lambda: None), pool)
    started = _new_pipeline_threads(before)
    assert sorted(t.name.rsplit("_", 1)[0] for t in started) == sorted(f"slidekit-{pool}" for pool in POOLS)
    p.close()
    assert not [t for t in started if t.is_alive()]
    assert not _new_pipeline_threads(before)
