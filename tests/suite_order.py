"""The order of the suite over pytest-xdist workers under the GPU gate: the last gate's slowest tests first,
one share each.

pytest-xdist's ``worksteal`` (the gate's distribution, ``benchmarks/gpu_gate.py``) gives each of N
workers an equal share of the collected tests, in collection order, and a worker that runs out steals
the back half of the longest queue. A test keeps its place in its worker's share, so the slow tests of
one file (tests/distributed/ has a dozen of 60-100 s) run one after another on one worker while the
others steal the quick tests around them and go idle. ``spread_slow_first`` puts the known slow tests
at the heads of the shares instead, spread by the longest-first rule, the rest after them in
collection order.

The gate names the slow tests through ``ENV``: a JSON file of ``[[junit id, seconds], ...]``, the
slowest tests of the last gate's suite (its record's ``slowest``). ``reorder`` (``tests/conftest.py``'s
hook) reorders only in a pytest-xdist worker with more than one worker and ``ENV`` set; every worker
computes the same order from the same file, as xdist requires.

``simulate_worksteal`` replays worksteal's scheduling over known durations (the rules of
pytest-xdist 3.x's ``WorkStealingScheduling``: shares split as ``shares`` splits them, a worker idle
below 2 queued tests, steals of half the longest queue but 2): what the order is predicted to gain.

Test: ``pytest tests/test_suite_order.py``.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Mapping, MutableSequence, Sequence
from pathlib import Path
from typing import Any

ENV = "SLIDEKIT_SLOW_FIRST"
MIN_PENDING = 2  # pytest-xdist's worksteal: a worker with fewer queued tests (the running one counted) is idle


def junit_id(nodeid: str) -> str:
    """A pytest node id as a JUnit report names the test (``classname::name``): ``tests/a/test_b.py::C::t[x]``
    -> ``tests.a.test_b.C::t[x]``."""
    path, *scopes = nodeid.split("::")
    module = path.removesuffix(".py").replace("/", ".")
    return "::".join([".".join([module, *scopes[:-1]]), scopes[-1]]) if scopes else module


def read_seconds(path: Path) -> dict[str, float]:
    """``ENV``'s file: {junit id: seconds}; {} where it is missing or not ``[[id, seconds], ...]``."""
    try:
        rows = json.loads(path.read_text())
        return {str(name): float(seconds) for name, seconds in rows}
    except (OSError, ValueError, TypeError):
        return {}


def shares(total: int, workers: int) -> list[int]:
    """How many of ``total`` tests each of ``workers`` gets first: worksteal's split, in its order."""
    sizes, left = [], total
    for i in range(workers):
        size = left // (workers - i)
        sizes.append(size)
        left -= size
    return sizes


def spread_slow_first(ids: Sequence[str], seconds: Mapping[str, float], workers: int) -> list[int]:
    """The positions of ``ids`` in the order that starts every known slow test (``seconds``) at the head of a
    worker's share: the slowest first, each to the share with the least slow time so far, the other tests
    after them in their order. Where no id is known, or one worker: the order as it is."""
    slow = sorted((i for i, name in enumerate(ids) if name in seconds), key=lambda i: -seconds[ids[i]])
    if not slow or workers < 2:
        return list(range(len(ids)))
    sizes = shares(len(ids), workers)
    heads: list[list[int]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for i in slow:
        k = min((k for k in range(len(sizes)) if len(heads[k]) < sizes[k]), key=lambda k: load[k])
        heads[k].append(i)
        load[k] += seconds[ids[i]]
    known = set(slow)
    rest = iter(i for i in range(len(ids)) if i not in known)
    order: list[int] = []
    for head, size in zip(heads, sizes, strict=True):
        order += head + [next(rest) for _ in range(size - len(head))]
    return order


def reorder(config: Any, items: MutableSequence[Any]) -> None:
    """``tests/conftest.py``'s ``pytest_collection_modifyitems``: in a pytest-xdist worker of more than one
    (``config.workerinput``) with ``ENV`` naming a file, ``items`` in ``spread_slow_first``'s order; else
    as they are."""
    path = os.environ.get(ENV)
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if not path or workers < 2:
        return
    order = spread_slow_first([junit_id(i.nodeid) for i in items], read_seconds(Path(path)), workers)
    items[:] = [items[i] for i in order]


def simulate_worksteal(durations: Sequence[float], workers: int) -> float:
    """Seconds until the last of ``durations`` (in collection order) finishes on ``workers`` under
    worksteal's rules (the module's doc), with no cost of its own and no test slowed by another."""
    pending = list(range(len(durations)))
    queues: list[list[int]] = [[] for _ in range(workers)]
    running = [False] * workers
    events: list[tuple[float, int]] = []
    now = 0.0

    def start_heads() -> None:
        for k in range(workers):
            if queues[k] and not running[k]:
                running[k] = True
                heapq.heappush(events, (now + durations[queues[k][0]], k))

    def check() -> None:
        while True:
            idle = [k for k in range(workers) if len(queues[k]) < MIN_PENDING]
            if not idle:
                return
            if pending:
                for n, k in enumerate(idle):
                    take = len(pending) // (len(idle) - n)
                    queues[k] += pending[:take]
                    del pending[:take]
                if all(len(queues[k]) >= MIN_PENDING for k in range(workers)):
                    return
            src = max(range(workers), key=lambda k: len(queues[k]))
            steal = min(len(queues[src]) // 2, max(0, len(queues[src]) - MIN_PENDING))
            if steal == 0:
                return
            pending.extend(queues[src][-steal:])
            del queues[src][-steal:]

    check()
    start_heads()
    while events:
        now, k = heapq.heappop(events)
        queues[k].pop(0)
        running[k] = False
        check()
        start_heads()
    return now
