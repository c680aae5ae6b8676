"""A suite measured over several device calls: ``slidekit bench --suite NAME --continue FILE.jsonl``.

One device call holds at most 600 s, and a model size's whole suite (two repeats of every mode and
alternative, each recipe) takes two to four times that at 7B and 14B. ``--continue`` runs what the
earlier records do not have yet and writes one suite file of both: the earlier header and rows,
then the new ones.

What the earlier records must be (else a ``ConfigError`` naming the difference and what to do):

* the same suite: its name, model and every setting the suite fixes (seq, steps, warm-up, batches,
  recipes, repeats, partial share);
* the same code: the source digest of slidekit/ and plugins/ (``slidekit.tools.source_digest``)
  equal to this tree's, so the table is one code's measurement even where the commits differ in
  docs or records alone. Records written before the digest existed carry none and are refused.

A run counts as measured when every batch it names has a row other than "not run" (a measured
out-of-memory or a failure is a result); the other runs, and those whose rows stop midway (a call
cut off), run again, whole, and their earlier rows are dropped. The header's ``calls`` lists each
call: its commit, date, argv and budget. Test: ``pytest tests/test_bench_continue.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slidekit.errors import ConfigError
from slidekit.tools.bench.suites import RunSpec

__all__ = ["Earlier", "check_continuable", "continue_header", "load_earlier", "measured_runs", "suite_settings"]

#: The suite settings a continued suite must share with the records it adds to.
SETTINGS = ("seq", "steps", "warmup", "batches", "clips", "repeats", "partial")


@dataclass(frozen=True, slots=True)
class Earlier:
    """An earlier call's suite file: its header (the ``"record": "suite"`` line) and its run rows."""

    path: Path
    header: dict[str, Any]
    rows: list[dict[str, Any]]


def suite_settings(header: Mapping[str, Any]) -> dict[str, Any]:
    """The settings of a suite header that a continuation must match."""
    fixed = header.get("suite") or {}
    return {"name": header.get("name"), "model": header.get("model")} | {k: fixed.get(k) for k in SETTINGS}


def load_earlier(path: Path) -> Earlier:
    """The records of ``path``, or a ConfigError saying why they cannot be continued."""
    if not path.is_file():
        raise ConfigError(f"--continue {path}: no such file; give the suite-<name>.jsonl of the earlier call")
    header: dict[str, Any] | None = None
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--continue {path}: line {n} is not JSON ({e}); a suite file is one JSON record a line"
            ) from None
        if record.get("record") == "suite":
            header = record
        elif record.get("record", "run") == "run":
            rows.append(record)
    if header is None:
        raise ConfigError(f"--continue {path}: no suite header line; it is not a `slidekit bench --out` file")
    return Earlier(path=path, header=header, rows=rows)


def check_continuable(earlier: Earlier, header: Mapping[str, Any]) -> None:
    """Raise a ConfigError unless ``earlier`` is the same suite and code as ``header`` (this call's)."""
    theirs, ours = suite_settings(earlier.header), suite_settings(header)
    differ = [f"{k} {theirs[k]!r} there, {ours[k]!r} here" for k in ours if theirs[k] != ours[k]]
    if differ:
        raise ConfigError(
            f"--continue {earlier.path}: another suite ({'; '.join(differ)}); continue it with the same "
            "--suite and flags, or start a new file with another --out"
        )
    digest = earlier.header.get("source_digest")
    if digest is None:
        raise ConfigError(
            f"--continue {earlier.path}: its records carry no source digest (written before --continue "
            "existed), so they cannot be shown to measure this code; start the suite again"
        )
    if digest != header.get("source_digest"):
        raise ConfigError(
            f"--continue {earlier.path}: measured other code (source digest {str(digest)[:12]} there, "
            f"{str(header.get('source_digest'))[:12]} here: slidekit/ or plugins/ changed since); "
            "a table holds one code's runs: start the suite again with another --out"
        )


def measured_runs(runs: Sequence[RunSpec], rows: Sequence[Mapping[str, Any]]) -> set[str]:
    """The names of the ``runs`` whose every batch has a row other than "not run" in ``rows``."""
    seen: dict[str, set[int]] = {}
    for row in rows:
        if row.get("status") != "not run" and row.get("run_name") is not None:
            seen.setdefault(str(row["run_name"]), set()).add(int(row["batch"]))
    return {r.name for r in runs if set(r.batches) <= seen.get(r.name, set())}


def continue_header(earlier: Earlier, header: Mapping[str, Any]) -> dict[str, Any]:
    """The header of the continued file: the earlier one, its ``calls`` with this call's appended, this
    call's plan and builds in the call's entry (the earlier calls' stay in theirs)."""
    merged = dict(earlier.header)
    calls = list(merged.get("calls") or [call_entry(earlier.header)])
    calls[-1] = {**calls[-1], "builds": earlier.header.get("builds")}  # set after its header was written
    calls.append(call_entry(header))
    merged["calls"] = calls
    merged["plan"] = header.get("plan", [])
    merged["budget_s"] = header.get("budget_s")
    merged.pop("builds", None)
    return merged


def call_entry(header: Mapping[str, Any]) -> dict[str, Any]:
    """What the header's ``calls`` keeps of one call."""
    return {k: header.get(k) for k in ("commit", "date", "argv", "budget_s", "plan", "builds")}
