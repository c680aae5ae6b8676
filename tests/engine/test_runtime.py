"""The pipeline's threads: errors reach every waiter, waits are bounded, close joins everything.

No test here sleeps to order events or times how fast something happened: the order comes from
events (a gate that is only opened afterwards, a predicate that starts the failing thread), and a
wait that must give up waits on something that can never happen.
"""

from __future__ import annotations

import threading
import time

import pytest

from slidekit.engine.runtime import POOLS, Pipeline
from slidekit.errors import PipelineError, PipelineStalled


class Boom(Exception):
    pass


def test_a_task_error_reaches_a_waiter_on_another_future():
    p = Pipeline(timeout_s=30)
    gate, started = threading.Event(), threading.Event()

    def upload() -> None:
        started.set()
        gate.wait()

    slow = p.submit("h2d", upload)  # runs until the gate opens, which only happens below
    try:
        # Running before the failure: a task that starts after it is cancelled (finished) instead.
        assert started.wait(30), "the upload lane never started its task"

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
    names = {f"slidekit-{pool}" for pool in POOLS}
    return [t for t in threading.enumerate() if t not in before and t.name.rsplit("_", 1)[0] in names]


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


def _stuck(gate: threading.Event, started: threading.Event):
    """A task that does not return until ``gate`` is set; ``started`` says it runs (so a stall timer
    that starts after it blames it, however late a loaded machine schedules its lane)."""

    def run() -> None:
        started.set()
        gate.wait(60)

    return run


def test_a_stall_names_the_lane_and_unit_that_hold_everything_up():
    p = Pipeline(timeout_s=0.5)
    gate, started = threading.Event(), threading.Event()
    update = p.submit("optim", _stuck(gate, started), unit=3)  # an optimizer update that does not return
    assert started.wait(30)
    upload = p.submit("h2d", lambda: p.result(update, "the optimizer update of unit 3"), unit=3)
    with pytest.raises(PipelineStalled) as info:
        p.result(upload, "the upload of unit 3")
    assert (info.value.lane, info.value.unit) == ("optim", 3)
    assert "the optim lane has been running unit 3" in str(info.value)
    t0 = time.monotonic()
    p.close()  # the stuck task was reported: close does not wait for it
    assert time.monotonic() - t0 < 0.5 + 5
    gate.set()


def test_a_stall_on_a_condition_blames_the_task_that_never_returns():
    p = Pipeline(timeout_s=0.5)
    gate, started = threading.Event(), threading.Event()
    p.submit("optim", _stuck(gate, started), unit=7)
    assert started.wait(30)
    with pytest.raises(PipelineStalled) as info:
        p.wait_until(lambda: False, "a free host gradient buffer")
    assert (info.value.lane, info.value.unit) == ("optim", 7)
    assert "a free host gradient buffer" in str(info.value)
    p.close()
    gate.set()


def test_a_promise_leads_the_report_to_the_lane_that_keeps_it():
    p = Pipeline(timeout_s=0.5)
    gate, started = threading.Event(), threading.Event()
    piece = p.promise("d2h", 2)
    p.submit("d2h", _stuck(gate, started), unit=2)  # the download that would complete ``piece``
    assert started.wait(30)
    update = p.submit("optim", lambda: p.result(piece, "the gradient download of unit 2"), unit=2)
    with pytest.raises(PipelineStalled) as info:
        p.result(update, "the optimizer update of unit 2")
    assert (info.value.lane, info.value.unit) == ("d2h", 2)
    p.close()
    gate.set()


def test_waits_do_not_stall_while_work_progresses():
    p = Pipeline(timeout_s=3.0)
    futs = [p.submit("optim", time.sleep, 0.02, unit=i) for i in range(300)]  # ~6 s in all, 2x the timeout
    p.result(futs[-1], "the last of many short updates")
    p.close()


def test_close_gives_a_running_task_at_most_the_timeout():
    p = Pipeline(timeout_s=1.0)
    gate = threading.Event()
    started = threading.Event()
    p.submit("optim", lambda: (started.set(), gate.wait(60)), unit=5)
    assert started.wait(30)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="optim lane has been running unit 5"):
        p.close()
    assert time.monotonic() - t0 < 1.0 + 5
    gate.set()


def test_lane_threads_never_hold_up_interpreter_exit():
    before = set(threading.enumerate())
    p = Pipeline(timeout_s=5)
    for pool in POOLS:
        p.result(p.submit(pool, lambda: None), pool)
    lanes = _new_pipeline_threads(before)
    assert lanes and all(t.daemon for t in lanes)
    p.close()
