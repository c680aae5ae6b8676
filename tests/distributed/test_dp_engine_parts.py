"""The engine pieces data parallelism adds, on their own: bounded polling, deterministic claims, the world check.

As in tests/engine/test_runtime.py, nothing here orders events by sleeping: a wait that must give up
waits for something that never happens, and the order of claims comes from the calls themselves.
"""

from __future__ import annotations

import threading

import pytest
import torch

from slidekit.engine.runtime import Pipeline
from slidekit.engine.window import Window
from slidekit.errors import PipelineStalled


class Boom(Exception):
    pass


def test_poll_returns_once_its_condition_holds_and_reports_the_first_failure():
    p = Pipeline(timeout_s=30, on_fail=(reported := []).append)
    try:
        calls = iter([False, False, True])
        p.poll(lambda: next(calls), "a collective")  # returns on the third look
        p.fail(Boom("first"))
        p.fail(Boom("second"))
        assert [str(e) for e in reported] == ["first"]  # a rank reports its first failure, once
        with pytest.raises(Boom, match="first"):
            p.poll(lambda: False, "a collective")
    finally:
        p.close()


def test_poll_runs_its_check_and_gives_up_when_nothing_progresses():
    p = Pipeline(timeout_s=0.3)

    def peer_failed() -> None:
        raise Boom("a peer failed")

    try:
        with pytest.raises(Boom, match="a peer failed"):
            p.poll(lambda: False, "a collective", check=peer_failed)
        with pytest.raises(PipelineStalled, match="the gradient reduction of unit 3"):
            p.poll(lambda: False, "the gradient reduction of unit 3")
    finally:
        p.close()


def _window(deterministic: bool) -> tuple[Pipeline, Window]:
    p = Pipeline(timeout_s=30)
    return p, Window(3, 8, torch.float32, torch.device("cpu"), p, deterministic=deterministic)


def test_a_deterministic_claim_takes_the_least_recently_used_slot_and_waits_for_it():
    p, w = _window(deterministic=True)
    try:
        a, b, c = (w.claim(u, 0) for u in (1, 2, 3))
        w.release(b, None)
        w.release(c, None)
        # Slots b and c are free, but a (held) is the least recently used: a prefetch gets nothing ...
        assert w.try_claim(4, 0) is None
        # ... and a claim waits for a, which the d2h lane releases later.
        got: list[object] = []
        claimer = threading.Thread(target=lambda: got.append(w.claim(4, 0)))
        claimer.start()
        w.release(a, None)  # before or after the claim began to wait: either way it takes a
        claimer.join(30)
        assert got == [a]
    finally:
        p.close()


def test_a_free_running_claim_takes_any_free_slot():
    p, w = _window(deterministic=False)
    try:
        a, b, _c = (w.claim(u, 0) for u in (1, 2, 3))
        w.release(b, None)
        assert w.try_claim(4, 0) is b  # one process: whichever is free
        assert a.users == 1
    finally:
        p.close()
