"""The pipeline's threads: errors reach every waiter, waits are bounded, close joins everything."""

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
    gate = threading.Event()
    slow = p.submit("h2d", gate.wait, 30)

    def explode():
        raise Boom("optimizer died")

    p.submit("optim", explode)
    t0 = time.monotonic()
    with pytest.raises(Boom, match="optimizer died"):
        p.result(slow, "the slow upload")  # not the failing future: still raises the root cause
    assert time.monotonic() - t0 < 2
    gate.set()
    p.close()


def test_wait_until_is_interrupted_by_a_failure():
    p = Pipeline(timeout_s=30)
    threading.Timer(0.2, p.fail, args=(Boom("late"),)).start()
    with pytest.raises(Boom):
        p.wait_until(lambda: False, "something that never happens")
    p.close()


def test_waits_are_bounded():
    p = Pipeline(timeout_s=0.3)
    with pytest.raises(PipelineStalled, match="never happens"):
        p.wait_until(lambda: False, "a thing that never happens")
    gate = threading.Event()
    fut = p.submit("d2h", gate.wait, 5)
    with pytest.raises(PipelineStalled):
        p.result(fut, "a stuck copy")
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


def test_close_joins_every_thread():
    before = set(threading.enumerate())
    p = Pipeline(timeout_s=5)
    for pool in POOLS:
        p.result(p.submit(pool, lambda: None), pool)
    assert len(set(threading.enumerate()) - before) == len(POOLS)
    p.close()
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
