"""What the `slidekit bench` tests share: a suite table's row, the check of a record's figures, and a
machine whose free memory the test decides (for the memory watchdog)."""

from __future__ import annotations

from typing import Any

from slidekit.tools.bench import arch_spec, throughput
from slidekit.tools.children import MemoryWatchdog


def table_row(
    label: str, system: str, batch: int, tokens: float | None, *, repeat: int = 1, clip: float | None = None, **kw: Any
) -> dict[str, Any]:
    """A run record as the suite table reads it: "ok" with ``tokens`` per second, "unavailable" with None."""
    row = {"record": "run", "label": label, "system": system, "batch": batch, "repeat": repeat, "run_name": label}
    row |= {"max_grad_norm": clip, "status": "ok" if tokens else "unavailable", "tokens_per_s": tokens}
    return row | kw


def assert_figures_of_its_steps(record: dict, batch: int, seq: int, *, steps: int) -> None:
    """The record's figures are ``throughput`` of the step times it recorded: exact, whatever they were."""
    assert len(record["step_seconds"]) == steps and all(s > 0 for s in record["step_seconds"])
    figures = throughput(arch_spec(record["model"], seq), batch, seq, record["step_seconds"])
    assert {k: record[k] for k in figures} == figures
    assert record["tokens_per_s"] == round(steps * batch * seq / sum(record["step_seconds"]), 1)


def fake_machine(floor_mib: int = 200) -> MemoryWatchdog:
    """A machine with 1 GiB free before the child: it is "exhausted" once the child holds ``floor_mib``."""
    total = 1 << 30
    floor = total - floor_mib * 2**20
    return MemoryWatchdog(floor_bytes=floor, poll_s=0.05, available=lambda rss: total - rss, settle_bytes=floor)
