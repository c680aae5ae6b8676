"""The gate's order of the suite over pytest-xdist workers (tests/suite_order.py): slow tests at the shares'
heads, and the worksteal replay that predicts what that gains."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import suite_order as so
from bench_helpers import load_benchmark


def test_node_ids_are_named_as_the_junit_report_names_them():
    assert so.junit_id("tests/test_a.py::test_b") == "tests.test_a::test_b"
    assert so.junit_id("tests/distributed/test_c.py::test_d[4 -> 2, adamw_8bit]") == (
        "tests.distributed.test_c::test_d[4 -> 2, adamw_8bit]"
    )
    assert so.junit_id("tests/plugins/test_e.py::TestF::test_g") == "tests.plugins.test_e.TestF::test_g"


def test_the_shares_are_worksteals_first_split():
    for total, workers in [(2290, 14), (10, 3), (5, 8), (0, 2)]:
        sizes = so.shares(total, workers)
        assert sum(sizes) == total and len(sizes) == workers and max(sizes) - min(sizes) <= 1


def test_slow_tests_start_the_shares_longest_first_and_the_rest_keep_their_order():
    ids = [f"t{i}" for i in range(20)]
    seconds = {"t3": 100.0, "t4": 90.0, "t5": 80.0, "t6": 30.0, "t7": 20.0, "gone": 500.0}
    order = so.spread_slow_first(ids, seconds, 4)
    assert sorted(order) == list(range(20))  # every test once
    heads = [order[k * 5] for k in range(4)]  # shares of 5
    assert heads == [3, 4, 5, 6]  # the four slowest, one per share, slowest first
    assert order[16] == 7  # the fifth to the share with the least slow time (t6's, 30 s), second in it
    rest = [i for i in order if ids[i] not in seconds]
    assert rest == sorted(rest)
    # Nothing known, or one worker: the order as collected.
    assert so.spread_slow_first(ids, {}, 4) == list(range(20))
    assert so.spread_slow_first(ids, seconds, 1) == list(range(20))
    # More slow tests than a share holds: they fill shares, and still appear once each.
    many = so.spread_slow_first(ids, {f"t{i}": 10.0 + i for i in range(20)}, 3)
    assert sorted(many) == list(range(20))


def test_the_replay_of_worksteal_and_what_the_spread_order_gains():
    assert so.simulate_worksteal([1.0] * 10, 1) == pytest.approx(10.0)
    assert so.simulate_worksteal([1.0] * 28, 14) == pytest.approx(2.0)
    assert so.simulate_worksteal([5.0, 1.0, 1.0, 1.0], 4) == pytest.approx(5.0)
    # A suite shaped like the gate's: 2,000 quick tests and one file of a dozen slow ones, next to each other.
    rng = random.Random(7)
    durations = [rng.expovariate(1.0) for _ in range(2000)]
    for i in range(600, 612):
        durations[i] = 60.0 + 8 * (i - 600)
    ids = [f"t{i}" for i in range(2000)]
    bound = max(max(durations), sum(durations) / 14)
    collected = so.simulate_worksteal(durations, 14)
    order = so.spread_slow_first(ids, {ids[i]: durations[i] for i in range(600, 612)}, 14)
    spread = so.simulate_worksteal([durations[i] for i in order], 14)
    assert collected > 1.5 * bound  # the file's slow tests run one after another on one worker
    assert spread < 1.1 * bound


def test_the_collection_is_reordered_only_under_the_gates_workers(tmp_path, monkeypatch):
    names = ["tests/test_a.py::test_quick", "tests/test_a.py::test_other", "tests/test_b.py::test_slow"]
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps([["tests.test_b::test_slow", 120.0]]))

    def collected(workers: int | None) -> list[str]:
        items = [SimpleNamespace(nodeid=n) for n in names]
        config = SimpleNamespace() if workers is None else SimpleNamespace(workerinput={"workercount": workers})
        so.reorder(config, items)
        return [i.nodeid for i in items]

    monkeypatch.delenv(so.ENV, raising=False)
    assert collected(2) == names  # no file named
    monkeypatch.setenv(so.ENV, str(slow))
    assert collected(None) == names and collected(1) == names  # not an xdist worker, or one
    assert collected(2) == [names[2], names[0], names[1]]
    slow.write_text("{not json")
    assert collected(2) == names  # an unreadable file orders nothing


def test_the_gate_names_the_last_suites_slowest_to_its_suite(tmp_path, monkeypatch):
    gate = load_benchmark("gpu_gate")
    assert gate.SLOW_FIRST_ENV == so.ENV
    monkeypatch.delenv("OUT", raising=False)
    record = tmp_path / "GPU-VERIFIED.json"
    slowest = [["tests.test_b::test_slow", 120.0], ["tests.test_c::test_d", 60.0]]
    # The last suite: 300 s on 14 workers, its tests 2,000 s in all: its workers idle half the time.
    waited = {"seconds": 300.0, "workers": 14, "test_seconds": 2000.0, "slowest": slowest}
    record.write_text(json.dumps({"commit": "0ld", "runs": [], "tests": waited}))
    given = []
    monkeypatch.setattr(gate, "run_mode", lambda a, mode, t: {"gpu_resident": mode, "status": "ok"})

    def suite(timeout, log, extra=(), workers=1, paths=("tests",), slow_first=()):
        given.append(list(slow_first))
        return {"passed": 1, "failed": 0, "errors": 0, "skipped": 0, "exit_code": 0, "seconds": 1.0}

    monkeypatch.setattr(gate, "run_suite", suite)
    monkeypatch.setattr(gate, "source_digest", lambda: "d1")
    base = ["--allow-cpu", "--record", str(record), "--commit", "abc", "--modes", "all"]
    earlier = record.read_text()
    assert gate.main([*base, "--order", "collected"]) == 0 and given == [[]]
    record.write_text(earlier)
    assert gate.main(base) == 0 and given[-1] == slowest  # the whole gate
    record.write_text(earlier)
    assert gate.main([*base, "--part", "runs"]) == 0
    assert json.loads(record.read_text())["last_suite"]["slowest"] == slowest  # kept for the suite's part
    assert gate.main([*base, "--part", "tests"]) == 0 and given[-1] == slowest

    # "auto" (the default) only where the last suite waited on its slowest; "slow-first" always.
    busy = {**waited, "test_seconds": 3900.0}  # 0.93 of 14 x 300 s
    assert gate.slow_first("auto", waited) == slowest and gate.slow_first("auto", busy) == []
    assert gate.slow_first("slow-first", busy) == slowest and gate.slow_first("collected", waited) == []
    assert gate.slow_first("auto", {"seconds": 300.0, "slowest": slowest}) == []  # an older record: no sum
