"""``slidekit bench``'s command line: a suite preset or ad-hoc flags -> the plan -> the runs -> the table.

    slidekit bench --suite qwen2.5-3b --out results/ --time-budget 540 --commit <sha>
    slidekit bench --suite qwen2.5-7b --plan-only                 # the time plan, nothing run
    slidekit bench --model tiny --device cpu --batch 2 --seq 64 --steps 2 --baselines none --out /tmp/b
    slidekit bench --table results/suite-qwen2.5-3b.jsonl         # the markdown again, from the records
    slidekit bench --suite qwen2.5-7b --out r2/ --continue r1/suite-qwen2.5-7b.jsonl   # the rest, next call
    slidekit bench --model qwen2.5-3b --batch 32 --resident none --baselines '' --clip none,1.0 \
        --clip-overlap defer,speculate                             # the levers, crossed like --resident

``--out DIR`` writes ``suite-<name>.jsonl`` (the raw records: the suite's header line, then one line
per run and batch) and ``suite-<name>.md`` (the tables), and keeps each child's output under
``DIR/logs``. Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slidekit.errors import ConfigError
from slidekit.tools.bench.continuing import (
    Earlier,
    check_continuable,
    continue_header,
    load_earlier,
    measured_runs,
)
from slidekit.tools.bench.costs import costs_from_records
from slidekit.tools.bench.records import FLOPS_FORMULA, machine, versions
from slidekit.tools.bench.runner import Recorder, run_suite
from slidekit.tools.bench.slidekit_run import engine_arguments
from slidekit.tools.bench.suite_presets import SUITES, suite
from slidekit.tools.bench.suites import BASELINES, Suite, adhoc_suite, expand, with_overrides
from slidekit.tools.bench.summary import suite_markdown
from slidekit.tools.bench.timeplan import Plan, format_plan, make_plan
from slidekit.tools.children import MemoryWatchdog
from slidekit.tools.presets import PRESETS, preset
from slidekit.tools.source_digest import REPO_ROOT, source_digest

__all__ = ["add_arguments", "bench", "build_suite", "run_command"]

_GIB = 2**30
#: What a --suite preset decides.
_SUITE_FIXES = ("model", "batch", "resident", "baselines", "recompute", "clip_overlap")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``slidekit bench``."""
    p.add_argument(
        "--suite",
        default=None,
        help=f"a suite preset: {', '.join(SUITES)} (fixes model, batches, modes, baselines)",
    )
    p.add_argument("--model", default=None, help=f"model preset (default tiny): {', '.join(PRESETS)}")
    p.add_argument("--batch", default=None, help="batch sizes, comma-separated (default 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default 1024)")
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per run after the warm-up (default 10)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first, in the same process (default 2)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the synthetic tokens (the same for every run)"
    )
    p.add_argument(
        "--baselines",
        default=None,
        help=f"alternatives, comma-separated, from: {', '.join(BASELINES)} ('none' = plain HF, no offload); "
        "'' for none (default liger_gc,liger,none,torchao,deepspeed)",
    )
    p.add_argument(
        "--clip",
        default=None,
        help="recipes: max_grad_norm values, comma-separated, 'none' = no clipping (default none; a suite: none,1.0)",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="repeats of every run, each its own process (default 2)"
    )
    engine_arguments(
        p,
        resident_help="slidekit residency modes, comma-separated: one run each (default auto)",
        crossed=True,
    )
    p.set_defaults(resident=None, recompute=None, clip_overlap=None)
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per batch a run may take without a budget"
    )
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds for the whole benchmark (0: none)")
    p.add_argument(
        "--costs", default=None, metavar="FILE.jsonl", help="predict from an earlier suite's records"
    )
    p.add_argument("--plan-only", action="store_true", help="print the time plan and stop")
    p.add_argument(
        "--prebuild",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="build kernels first (default: with --suite)",
    )
    p.add_argument(
        "--ram-floor-gib",
        type=float,
        default=3.0,
        help="kill a run when MemAvailable falls under this (0: off)",
    )
    p.add_argument(
        "--continue",
        dest="continue_from",
        default=None,
        metavar="FILE.jsonl",
        help="run what an earlier call's records of the same suite and code lack, into one file of both",
    )
    p.add_argument(
        "--other-host",
        action="store_true",
        help="with --continue: continue on another host (or after a reboot) than the earlier calls ran on",
    )
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument(
        "--out", default=None, metavar="DIR", help="write suite-<name>.jsonl, suite-<name>.md, logs/ here"
    )
    p.add_argument(
        "--logs", default=None, metavar="DIR", help="each run's output (default: DIR/logs of --out)"
    )
    p.add_argument(
        "--table", default=None, metavar="FILE.jsonl", help="print the tables of a suite's records and stop"
    )
    p.add_argument(
        "--baselines-dir",
        default=None,
        help="a directory of replacement scripts (a baseline's script name; slidekit.py for slidekit's runs)",
    )


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _clips(value: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for v in _split(value):
        if v.lower() in ("none", "off", "0"):
            out.append(None)
            continue
        try:
            number = float(v)
        except ValueError:
            raise ConfigError(
                f"--clip {value!r}: give max_grad_norm values or 'none', e.g. none,1.0"
            ) from None
        if not number > 0:
            raise ConfigError(f"--clip {value!r}: a max_grad_norm must be positive (or 'none')")
        out.append(number)
    if not out or len(set(out)) != len(out):
        raise ConfigError(f"--clip {value!r}: give one or more distinct recipes, e.g. none,1.0")
    return tuple(out)


def build_suite(args: argparse.Namespace) -> Suite:
    """The suite ``args`` asks for: a preset (``--suite``) or the ad-hoc flags crossed."""
    clips = _clips(args.clip) if args.clip is not None else None
    if args.suite:
        given = [f"--{k.replace('_', '-')}" for k in _SUITE_FIXES if getattr(args, k) is not None]
        if given:
            raise ConfigError(
                f"--suite {args.suite} fixes {', '.join(given)}; leave them out or leave --suite out"
            )
        return with_overrides(
            suite(args.suite),
            steps=args.steps,
            warmup=args.warmup,
            repeats=args.repeats,
            seq=args.seq,
            clips=clips,
        )
    model = args.model or "tiny"
    preset(model)  # an unknown name is a clear error before anything runs
    try:
        batches = tuple(int(b) for b in _split(args.batch or "8"))
    except ValueError:
        raise ConfigError(f"--batch {args.batch!r}: give batch sizes as integers, e.g. 8,16,32") from None
    residents = tuple(_split(args.resident if args.resident is not None else "auto"))
    if not residents:
        raise ConfigError("--resident needs at least one mode: auto, none, all or a fraction")
    baselines = args.baselines if args.baselines is not None else "liger_gc,liger,none,torchao,deepspeed"
    return adhoc_suite(
        model=model,
        batches=batches,
        residents=residents,
        baselines=tuple(_split(baselines)),
        clips=clips or (None,),
        repeats=args.repeats if args.repeats is not None else 2,
        seq=args.seq or 1024,
        steps=args.steps if args.steps is not None else 10,
        warmup=args.warmup if args.warmup is not None else 2,
        optimizer=args.optimizer,
        state_offload=_state_offload(args),
        recomputes=_levers(args.recompute, "--recompute"),
        clip_overlaps=_levers(args.clip_overlap, "--clip-overlap"),
    )


def _levers(value: str | None, flag: str) -> tuple[str, ...]:
    """The distinct values of a lever flag (``--recompute``, ``--clip-overlap``); () when not given."""
    if value is None:
        return ()
    values = tuple(_split(value))
    if not values or len(set(values)) != len(values):
        raise ConfigError(
            f"{flag} {value!r}: give one or more distinct values, comma-separated, e.g. all,auto"
        )
    return values


def _state_offload(args: argparse.Namespace) -> tuple[str, float] | None:
    """(tier, fraction) of ``--state-offload-tier`` / ``--state-offload-fraction``, or None."""
    if not args.state_offload_fraction:
        return None
    if not args.state_offload_tier:
        raise ConfigError(
            "--state-offload-fraction needs --state-offload-tier (e.g. posix, with --offload-dir)"
        )
    return (args.state_offload_tier, args.state_offload_fraction)


def _commit(given: str | None) -> str:
    if given:
        return given
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: pass --commit)"
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _continued(args: argparse.Namespace, the_suite: Suite) -> tuple[Earlier | None, frozenset[str]]:
    """``--continue``'s earlier records (None without it) and the names of the runs they measured."""
    earlier = load_earlier(Path(args.continue_from)) if args.continue_from else None
    return earlier, frozenset(measured_runs(expand(the_suite), earlier.rows) if earlier else ())


def _plan(args: argparse.Namespace, the_suite: Suite, done: frozenset[str] = frozenset()) -> Plan:
    """The time plan of the suite's runs, less those named in ``done`` (measured by an earlier call)."""
    table = None
    if args.costs:
        table = costs_from_records(
            json.loads(line) for line in Path(args.costs).read_text().splitlines() if line.strip()
        )
    prebuild = args.prebuild if args.prebuild is not None else bool(args.suite)
    budget = args.time_budget if args.time_budget and args.time_budget > 0 else None
    runs = [r for r in expand(the_suite) if r.name not in done]
    return make_plan(the_suite, runs, budget_s=budget, prebuild=prebuild, table=table)


def bench(
    args: argparse.Namespace,
    *,
    watchdog: MemoryWatchdog | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, Any]]:
    """Run what ``args`` asks for; the rows (also in ``--out``). ``watchdog`` replaces the one of
    ``--ram-floor-gib`` and ``clock`` the budget's clock (tests watch a fake machine and stop time)."""
    the_suite = build_suite(args)
    earlier, done = _continued(args, the_suite)
    plan = _plan(args, the_suite, done)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.logs is None and out is not None:
        args.logs = str(out / "logs")
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    identity: dict[str, Any] = {
        "commit": _commit(args.commit),
        "source_digest": source_digest() if (REPO_ROOT / "plugins").is_dir() else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": versions(),
        "machine": machine(),
    }
    header: dict[str, Any] = {"record": "suite", "name": the_suite.name, "model": the_suite.model, **identity}
    header["suite"] = {
        "seq": the_suite.seq,
        "steps": the_suite.steps,
        "warmup": the_suite.warmup,
        "batches": list(the_suite.batches),
        "clips": list(the_suite.clips),
        "repeats": the_suite.repeats,
        "partial": the_suite.partial,
        "note": the_suite.note,
    }
    header |= {"budget_s": plan.budget_s, "flops_formula": FLOPS_FORMULA, "argv": sys.argv[1:]}
    header["plan"] = [
        {
            "run": p.run.name,
            "importance": p.run.importance,
            "predicted_s": p.predicted_s,
            "keep": p.keep,
            "source": p.source,
        }
        for p in plan.runs
    ]
    if watchdog is None and args.ram_floor_gib > 0:
        watchdog = MemoryWatchdog(floor_bytes=int(args.ram_floor_gib * _GIB))
    kept: list[dict[str, Any]] = []
    if earlier is not None:
        check_continuable(earlier, header, other_host=getattr(args, "other_host", False))
        kept = [r for r in earlier.rows if r.get("run_name") in done]  # a cut-off run's rows go
        header = continue_header(earlier, header)
        print(
            f"bench: continuing {earlier.path}: {len(done)} runs measured there, {len(plan.runs)} to plan",
            file=sys.stderr,
        )
    records = out / f"suite-{the_suite.name}.jsonl" if out else None
    recorder = Recorder(records, header, rows=kept)
    rows = run_suite(args, plan, recorder, identity=identity, watchdog=watchdog, clock=clock)
    text = suite_markdown(recorder.header, rows, records_name=f"suite-{the_suite.name}.jsonl")
    print(text)
    if out is not None:
        (out / f"suite-{the_suite.name}.md").write_text(text)
    return rows


def _table(path: str) -> int:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    header: dict[str, Any] = next((r for r in records if r.get("record") == "suite"), {})
    print(
        suite_markdown(header, [r for r in records if r.get("record") == "run"], records_name=Path(path).name)
    )
    return 0


def run_command(args: argparse.Namespace) -> int:
    """``slidekit bench``: plan, run, print the tables (and write them under --out)."""
    if args.table:
        return _table(args.table)
    if args.plan_only:
        the_suite = build_suite(args)
        _, done = _continued(args, the_suite)
        print(format_plan(_plan(args, the_suite, done)))
        return 0
    rows = bench(args)
    return 0 if any(r.get("status") == "ok" for r in rows) else 1
