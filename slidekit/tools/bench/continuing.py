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
* the same kind of machine and software: the GPU (name and memory), the CPU (model and count) and
  the host RAM (within 2%: hosts of one kind report slightly different totals) of
  ``records.machine``, and every version of ``records.versions`` but slidekit's own (the digest
  covers it). A suite's ratios compare runs with each other, so they must not mix an H100's runs with
  an H200's, or one host CPU's update rates with another's. Records written before the machine was
  recorded are refused.
* the same host: the boot id of ``records.machine`` (``records.boot_id``, new on every host and every
  boot) among the earlier calls'. Hosts of one kind have differed by up to 1.3x in the same runs
  (docs/benchmarks/NOTES.md 34-35), which a suite's ratios must not mix. ``--other-host`` continues on
  another host (or after a reboot) all the same; each call's entry keeps its boot id, and the suite's
  page says on how many hosts it ran.

A run counts as measured when every batch it names has a row other than "not run" (a measured
out-of-memory or a failure is a result); the other runs, those whose rows stop midway (a call
cut off) and those the call's end stopped ("not run: stopped at the call's end", ``runner``), run
again, whole, and their earlier rows are dropped. The header's ``calls`` lists each
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

__all__ = [
    "Earlier",
    "boot_ids",
    "check_continuable",
    "continue_header",
    "load_earlier",
    "measured_runs",
    "suite_settings",
]

#: The suite settings a continued suite must share with the records it adds to.
SETTINGS = ("seq", "steps", "warmup", "batches", "clips", "repeats", "partial")
#: The fields of ``records.machine`` that must be equal; ``host_ram_gib`` must agree within ``RAM_SLACK``.
MACHINE = ("gpu", "gpu_mem_gib", "cpu_model", "cpus")
RAM_SLACK = 0.02


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


def check_continuable(earlier: Earlier, header: Mapping[str, Any], *, other_host: bool = False) -> None:
    """Raise a ConfigError unless ``earlier`` is the same suite and code as ``header`` (this call's), on
    the same kind of machine and, unless ``other_host``, on the same host (its boot)."""
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
    differ = _machine_differences(earlier.header, header)
    if differ:
        raise ConfigError(
            f"--continue {earlier.path}: measured on another machine or software ({'; '.join(differ)}); a "
            "table compares runs of one machine: continue it on the machine kind it started on, or start "
            "the suite again with another --out"
        )
    boot, booted = (header.get("machine") or {}).get("boot_id"), boot_ids(earlier.header)
    if not other_host and (boot is None or boot not in booted):
        where = "no boot id recorded there or here"
        if boot is not None and booted:
            there = ", ".join(sorted(b[:8] for b in booted))
            where = f"another host, or the same one rebooted (boot id {there} there, {str(boot)[:8]} here)"
        raise ConfigError(
            f"--continue {earlier.path}: {where}; hosts of one kind have differed by up to 1.3x in the same "
            "runs, so a table holds one host's: continue it on the host it started on, start the suite "
            "again with another --out, or pass --other-host to mix hosts (the page then says so)"
        )


def boot_ids(header: Mapping[str, Any]) -> set[str]:
    """The boot ids (``records.boot_id``) a suite header's calls ran on: each call's entry, else the
    header's machine."""
    found = {c.get("boot_id") for c in header.get("calls") or []}
    found.add((header.get("machine") or {}).get("boot_id"))
    return {str(b) for b in found if b}


def _machine_differences(theirs: Mapping[str, Any], ours: Mapping[str, Any]) -> list[str]:
    """What differs between two suite headers' machines and versions (``MACHINE``, ``RAM_SLACK``), as
    "field X there, Y here" phrases; a header without a machine differs in that."""
    if not isinstance(theirs.get("machine"), Mapping):
        return ["no machine recorded there (written before suites recorded it)"]
    a, b = theirs["machine"], ours.get("machine") or {}
    differ = [f"{k} {a.get(k)!r} there, {b.get(k)!r} here" for k in MACHINE if a.get(k) != b.get(k)]
    ram_a, ram_b = a.get("host_ram_gib"), b.get("host_ram_gib")
    if ram_a is None or ram_b is None or abs(ram_a - ram_b) > RAM_SLACK * max(ram_a, ram_b):
        differ.append(f"host_ram_gib {ram_a!r} there, {ram_b!r} here")
    va, vb = theirs.get("versions") or {}, ours.get("versions") or {}
    differ += [
        f"{k} {va.get(k)!r} there, {vb.get(k)!r} here"
        for k in sorted(set(va) | set(vb))
        if k != "slidekit" and va.get(k) != vb.get(k)
    ]
    return differ


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
    """What the header's ``calls`` keeps of one call, its host's boot id (``records.boot_id``) included."""
    entry = {k: header.get(k) for k in ("commit", "date", "argv", "budget_s", "plan", "builds")}
    return entry | {"boot_id": (header.get("machine") or {}).get("boot_id")}
