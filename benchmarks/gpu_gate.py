"""The GPU gate: the whole test suite plus short real-shape runs on the GPU, and the record that says so.

CI sees only the CPU, so a change to slidekit/ or plugins/ is verified by hand
on the GPU machine before its issue is resolved:

    python benchmarks/gpu_gate.py --commit $(git rev-parse HEAD)     # nox -s gpu -- --commit ...
    python benchmarks/gpu_gate.py --check                            # does the record cover this tree?

A gate run does two things, and writes ``docs/benchmarks/GPU-VERIFIED.json``
(atomically, also into ``$OUT`` when set) with what it found, first before
each run and again before the suite (``ok`` false, ``why`` naming what has
not run yet), so a gate killed from outside still leaves what it had found;
``--deadline S`` fits the whole gate into S seconds (a device call's limit):
the runs go first, each at most ``--run-timeout``, and the suite gets the rest.
A deadline shorter than 1.1 times what the record's own gate took (its runs'
wall plus its suite, read from ``--record`` before it is overwritten) is refused
before anything runs, naming the deadline that fits (``--force`` runs it anyway):
a suite cut off at the deadline verifies nothing and spends the device time.
A gate longer than one device call runs in two on one tree: ``--part runs``
records the runs (``ok`` false, the suite pending), and ``--part tests`` runs
the suite and completes the record's runs (replacing any suite it had), only
where they are of this tree's slidekit/ and plugins/ (refused before anything
runs otherwise).

1. the WHOLE test suite (``pytest tests``: the GPU-only files and the tests
   that take a CUDA branch where there is one), with pass, fail, error and skip
   counts and the names of the failures;
2. one short training run per residency mode (every unit kept on the GPU,
   the planner's default ``auto``, half of them, none), each in its own process
   on a real model shape (a Qwen2.5-3B shape at batch 8, 1024 tokens a row by
   default), with tokens/s over whole steps, peak GPU memory and peak host RSS.

A step is a whole step: the timed steps run back to back and the period is
taken start to start, from the first timed step's start to the end of the
last one, after every queued update has been applied and the device has
finished (``Engine.wait_updates`` and a device synchronize), so updates that
overlap the next step are counted; the per-step times are kept as well.

The record names the commit (``--commit``, or ``git rev-parse HEAD`` where the
tree is a checkout) and a digest of every source file under slidekit/ and
plugins/, which ``--check`` recomputes: a record covers a commit when the
digest equals that commit's. Resolve ``--commit`` where the commit was made:
a copy of the working tree on the device machine can carry older git
metadata, whose HEAD is not the tree that runs; ``commit_matches_tree`` in
the record says whether the named commit's sources are the tree's (false,
with a warning, where they are not; null where git there cannot tell). ``ok`` is true only when no test failed and
every run trained and its loss is finite.

Test: ``pytest tests/test_gpu_gate.py`` (the digest, the check, the record and
one run on the CPU).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's slidekit, where this script runs from it uninstalled
from slidekit.tools import source_digest as _digest  # noqa: E402  (after the path it needs)

SOURCE_DIRS = _digest.SOURCE_DIRS
RECORD = ROOT / "docs" / "benchmarks" / "GPU-VERIFIED.json"
#: residency modes of the real-shape runs: engine.gpu_resident values.
MODES = ("all", "auto", "0.5", "none")
#: --deadline must leave this times what the record's gate took (``expected_seconds``), or the gate is
#: refused before it starts: session 30's gate at a 395 s deadline had its suite cut off after 270 s
#: with 0 failures, 417 s of device time that verified nothing.
DEADLINE_MARGIN = 1.1
#: --part: the runs and the suite in one call (all), or the gate in two calls on one tree (runs, then tests):
#: session 35's gate took 531 s of a device call's 600 s on an H100 host (the runs 146 s, the suite 382 s), and
#: the deadline rule above would have asked 581 s of the next.
PARTS = ("all", "runs", "tests")


# ---------------------------------------------------------------------------- what was verified


def source_files(root: Path = ROOT) -> list[Path]:
    """Every source file under slidekit/ and plugins/, sorted (``slidekit.tools.source_digest``)."""
    return _digest.source_files(root)


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the relative path and bytes of every source file under slidekit/ and plugins/."""
    return _digest.source_digest(root)


def commit_digest(commit: str, root: Path = ROOT) -> str:
    """``source_digest`` of the tree of ``commit`` (read from git, not from the working tree)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", "--format=tar", commit, *SOURCE_DIRS],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        return source_digest(Path(tmp))


def _git_head(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit_matches_tree(commit: str | None, digest: str, root: Path = ROOT) -> bool | None:
    """Whether ``commit``'s slidekit/ and plugins/ are the tree's (``digest``); None where git cannot tell
    (no commit, no git, or a commit this checkout's git does not have). The device machine's copy of a
    working tree can carry git metadata older than the tree: there ``git rev-parse HEAD`` names an
    earlier commit than the one that ran (the gate of 2026-12-06's session 23 recorded 33a7a5b for the
    tree of 2af2733), so the record says whether the commit it names is the tree it tested."""
    if commit is None:
        return None
    try:
        return commit_digest(commit, root) == digest
    except (OSError, subprocess.CalledProcessError):
        return None


def check(record_path: Path, commit: str | None, root: Path = ROOT) -> tuple[bool, str]:
    """Whether the record at ``record_path`` verifies ``commit`` (default HEAD): (ok, why)."""
    if not record_path.is_file():
        return False, f"no record at {record_path}: run the gate on the GPU machine (nox -s gpu)"
    try:
        record = json.loads(record_path.read_text())
    except json.JSONDecodeError as e:
        return False, f"{record_path} is not valid JSON ({e}); run the gate again"
    commit = commit or _git_head(root)
    if commit is None:
        return False, "not a git checkout: name the commit to check with --commit"
    want = commit_digest(commit, root)
    if record.get("source_digest") != want:
        return False, (
            f"the record (commit {str(record.get('commit'))[:12]}) verified other sources than {commit[:12]} "
            f"has under {', '.join(SOURCE_DIRS)}: run the gate again on this commit"
        )
    if not record.get("ok"):
        return False, f"the record for {commit[:12]}'s sources says the gate FAILED: {record.get('why')}"
    return (
        True,
        f"verified: {commit[:12]}'s slidekit/ and plugins/ are those of the record ({record['date']})",
    )


# ---------------------------------------------------------------------------- the machine


def machine() -> dict[str, Any]:
    """What the gate ran on: GPU, driver-side versions, CPU and memory."""
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "host_ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out["gpu"] = props.name
        out["gpu_mem_gib"] = round(props.total_memory / 2**30, 1)
        out["cuda"] = torch.version.cuda
    else:
        out["gpu"] = None
    return out


# ---------------------------------------------------------------------------- the test suite


def pytest_workers(requested: str) -> int:
    """Worker processes for the suite: ``requested``, or for "auto", where pytest-xdist is installed, 6 on
    12 cores or more (the GPU machine's 16: the suite took 400 s there on 4 workers in session 7), 4 on 8 to
    11, else 1 (one process, no xdist)."""
    if requested != "auto":
        return max(1, int(requested))
    try:
        import xdist  # noqa: F401
    except ImportError:
        return 1
    cpus = os.cpu_count() or 1
    return 6 if cpus >= 12 else 4 if cpus >= 8 else 1


def xdist_mode() -> str:
    """pytest-xdist's distribution: "worksteal" (3.2 and later), else "load"; never "loadfile".

    Whole files per worker (the gate's first mode) left the 8 re-sharding tests of ~35 s each on
    one worker: that file alone was most of the suite's 369 s on 6 workers (2026-12-02). Test by
    test, a worker that runs out takes tests queued on another. The suite passes so on the CPU
    (2 workers, worksteal, 2026-12-02: 1618 passed, the tests of one file running concurrently)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("pytest-xdist").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return "load"
    return "worksteal" if (major, minor) >= (3, 2) else "load"


#: ``python -m pytest``, with SIGINT handled even where the gate's own process ignores it (a command started
#: in the background by a non-interactive shell inherits SIGINT ignored, and so would the suite: the
#: overrun's interrupt would then do nothing, and the kill after it would lose the JUnit report).
_INTERRUPTIBLE_PYTEST = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); sys.exit(pytest.main())"
)


#: The environment variable that names the slow tests to start first (tests/suite_order.py's ENV).
SLOW_FIRST_ENV = "SLIDEKIT_SLOW_FIRST"


def run_suite(
    timeout: float,
    log: Path,
    extra: Sequence[str] = (),
    workers: int = 1,
    paths: Sequence[str] = ("tests",),
    slow_first: Sequence[Sequence[Any]] = (),
) -> dict[str, Any]:
    """``pytest tests`` (or ``paths``) in a child process: counts, failures and the time it took.

    With ``workers`` > 1 the tests are spread over that many pytest-xdist
    processes, each with a share of the cores, test by test (``xdist_mode``);
    ``slow_first`` (``[[junit id, seconds], ...]``: the last suite's slowest)
    start first, one at the head of each worker's share (tests/suite_order.py).
    Past ``timeout`` the suite is interrupted (SIGINT: pytest still reports
    what ran, the failures included) and then killed.
    """
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        args = ["-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}"]
        env = dict(os.environ)
        env.pop(SLOW_FIRST_ENV, None)
        order = "collected"
        if workers > 1:
            args += ["-n", str(workers), "--dist", xdist_mode()]
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or workers) // workers)))
            if slow_first:
                (Path(tmp) / "slow.json").write_text(json.dumps([list(row) for row in slow_first]))
                env[SLOW_FIRST_ENV] = str(Path(tmp) / "slow.json")
                order = f"slow first ({len(slow_first)} tests named)"
        args += [*extra, *paths]
        cmd = [sys.executable, "-c", _INTERRUPTIBLE_PYTEST, *args]
        t0 = time.perf_counter()
        timed_out = False
        with log.open("w") as out:
            # Its own process group: an overrun stops the xdist workers too, before the runs need the GPU.
            proc = subprocess.Popen(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                code: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGINT)  # pytest reports what ran and writes the JUnit file
                try:
                    code = proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    code = proc.wait()
        seconds = round(time.perf_counter() - t0, 1)
        result: dict[str, Any] = {
            "command": " ".join(["pytest", *(a for a in args if not a.startswith("--junitxml="))]),  # not its tmp path
            "workers": workers,
            "order": order,
            "seconds": seconds,
            "exit_code": code,
            "timed_out": timed_out,
        }
        if not junit.is_file():
            return {
                **result,
                "passed": 0,
                "failed": 0,
                "errors": 1,
                "skipped": 0,
                "failures": ["no JUnit report"],
            }
        write_durations(junit, durations_path(log))
        return {**result, **junit_counts(junit)}


def durations_path(log: Path) -> Path:
    """Where ``run_suite`` writes every test's seconds: beside its log (``gpu-gate-tests.durations.json``)."""
    return log.with_name(f"{log.stem}.durations.json")


def write_durations(junit: Path, path: Path) -> None:
    """Every test of a JUnit report, in the report's order, with its seconds (``[[id, seconds], ...]``): what
    a schedule of the suite over its workers can be worked out from (the record keeps only the slowest)."""
    rows = [
        [f"{case.get('classname', '')}::{case.get('name')}", round(float(case.get("time") or 0.0), 2)]
        for case in ET.parse(junit).getroot().iter("testcase")
        if case.get("name") is not None
    ]
    path.write_text(json.dumps(rows) + "\n")


SLOWEST = 40  # the gate record names this many of the slowest tests: where the suite's time goes, and what
# the next gate starts first (run_suite's slow_first)


def junit_counts(path: Path) -> dict[str, Any]:
    """Passed, failed, errors, skipped, the failed test ids, the ``SLOWEST`` slowest tests (id, seconds)
    and ``test_seconds``, the tests' summed time, of a pytest JUnit XML report. Against the suite's wall
    and its workers that sum says whether the suite is bound by its workers (sum / workers near the
    wall) or by its slowest tests starting late."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    times: list[tuple[float, str]] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.get("name") is None:  # the test an interrupt stopped: it neither passed nor failed
            counts["interrupted"] = counts.get("interrupted", 0) + 1
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        times.append((float(case.get("time") or 0.0), name))
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failures.append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            failures.append(name)
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    slowest = [[name, round(t, 1)] for t, name in sorted(times, reverse=True)[:SLOWEST]]
    total = round(sum(t for t, _ in times), 1)
    return {**counts, "failures": failures, "slowest": slowest, "test_seconds": total}


# ---------------------------------------------------------------------------- one real-shape run


def run_one(model: str, batch: int, seq: int, resident: str, warmup: int, steps: int) -> dict[str, Any]:
    """Train ``warmup`` + ``steps`` steps of preset ``model`` with ``engine.gpu_resident=resident``.

    Everything else is the engine's default, as a user gets it. The timed steps
    run back to back in one ``fit``; the period is start to start, ending once
    every update is applied and the device is idle.
    """
    import torch

    from slidekit import Batch, DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer
    from slidekit.telemetry import model_flops, peak_rss_bytes, reset_peak_rss
    from slidekit.tools.bench import synthetic_tokens
    from slidekit.tools.presets import write_config

    with tempfile.TemporaryDirectory() as tmp:
        write_config(model, Path(tmp), seq)
        cfg = TrainConfig(
            model=ModelConfig(source=tmp, random_init=True),
            data=DataConfig(seq_len=seq, batch_size=batch),
            optim=OptimConfig(lr=1e-5),
            engine=EngineConfig(gpu_resident=resident),
            steps=warmup + steps,
        )
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        setup_s = time.perf_counter() - t0
        with trainer:
            device, spec = trainer.device, trainer.spec
            kept = len(trainer.engine.window.resident)
            data = (Batch(x, y) for x, y in synthetic_tokens(spec.vocab_size, batch, seq))
            if warmup:
                trainer.fit(data, steps=warmup)
            trainer.engine.wait_updates()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            reset_peak_rss()
            start = time.perf_counter()
            result = trainer.fit(data, steps=steps)
            trainer.engine.wait_updates()  # fit drains too; this states it
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            period = time.perf_counter() - start
            peak_gpu = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    tokens = batch * seq * steps
    losses = result.losses
    return {
        "status": "ok" if len(losses) == steps and all(math.isfinite(x) for x in losses) else "failed",
        "model": model,
        "batch": batch,
        "seq": seq,
        "gpu_resident": resident,
        "resident_units": f"{kept}/{len(spec.units)}",
        "params": spec.num_params,
        "warmup": warmup,
        "steps": len(losses),
        "setup_s": round(setup_s, 2),
        "period_s": period,  # unrounded: the figures below derive from it
        "tokens_per_s": round(tokens / period, 1),
        "model_tflops": round(model_flops(spec, batch * seq, seq) * steps / period / 1e12, 2),
        "step_seconds": result.step_seconds,
        "peak_gpu_gib": None if peak_gpu is None else round(peak_gpu, 3),
        "peak_host_rss_gib": round(peak_rss_bytes() / 2**30, 3),
        "losses": [round(x, 4) for x in losses],
        "device": str(device),
    }


def run_mode(args: argparse.Namespace, resident: str, timeout: float) -> dict[str, Any]:
    """``run_one`` in its own process group (peaks belong to a process; a timeout kills what it started,
    a kernel build's compiler too: ``slidekit.tools.children.run_child``); a failure is a record too."""
    from slidekit.tools.children import run_child

    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-one", resident]
    cmd += ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    record = run_child(cmd, timeout=timeout)
    if record["status"] == "unavailable":  # no record printed: timed out, crashed or exited non-zero
        base = {"model": args.model, "batch": args.batch, "seq": args.seq, "gpu_resident": resident}
        return {**base, "status": "failed", "why": record["reason"], "wall_s": record["wall_s"]}
    return record


# ---------------------------------------------------------------------------- the record


def write_record(record: dict[str, Any], paths: Sequence[Path]) -> None:
    """Write ``record`` to each path atomically (``slidekit.atomic``: a temporary file, then a rename)."""
    from slidekit.atomic import write_text_atomically

    text = json.dumps(record, indent=2) + "\n"
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, text)


def verdict(
    tests: dict[str, Any] | None, runs: Sequence[dict[str, Any]], pending: str | None = None
) -> tuple[bool, str]:
    """(ok, why): ok only when the suite ran with no failure or error and every run trained.

    ``pending``: what of the gate has not run yet (the record written while it runs says so).
    """
    problems = [f"incomplete: {pending}"] if pending else []
    if tests is None:
        problems.append("the test suite was not run")
    elif tests.get("timed_out"):
        problems.append(
            f"the test suite timed out after {tests['seconds']} s ({tests['failed']} failed by then)"
        )
    elif tests["failed"] or tests["errors"] or tests.get("exit_code") not in (0, None):
        problems.append(f"{tests['failed']} tests failed, {tests['errors']} errors")
    problems += [
        f"run gpu_resident={r['gpu_resident']}: {r.get('why', 'failed')}" for r in runs if r["status"] != "ok"
    ]
    if not runs:
        problems.append("no training run")
    return not problems, "; ".join(problems) or "all passed"


def _read_record(path: Path) -> dict[str, Any]:
    """The record at ``path``, or {} where there is none readable."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _last_suite(record: dict[str, Any]) -> dict[str, Any] | None:
    """The latest suite a record knows (its fields, and ``of_commit``: the gate that ran it): its own, or for a
    record of the runs alone (``--part runs``) what it kept of the suite of the record it replaced, so the
    next deadline and order have one to go by."""
    if isinstance(record.get("tests"), dict):
        return {**record["tests"], "of_commit": record.get("commit")}
    last = record.get("last_suite")
    return last if isinstance(last, dict) else None


def expected_seconds(
    record_path: Path, modes: Sequence[str], *, suite: bool = True
) -> tuple[float, str] | None:
    """What the gate recorded at ``record_path`` took for ``modes`` and the suite, and which gate that was:
    each mode's run wall (the record's run of that mode, else the mean of its runs) plus its suite's
    seconds (a lower bound where that suite timed out; without ``suite``, the runs alone). None where no
    readable record has a suite."""
    record = _read_record(record_path)
    try:
        suite_s = float((_last_suite(record) or {})["seconds"]) if suite else 0.0
    except (KeyError, TypeError, ValueError):
        return None
    if not record:
        return None
    walls = {
        r.get("gpu_resident"): float(r["wall_s"])
        for r in record.get("runs") or []
        if isinstance(r, dict) and isinstance(r.get("wall_s"), (int, float))
    }
    mean = sum(walls.values()) / len(walls) if walls else 0.0
    runs = sum(walls.get(mode, mean) for mode in modes)
    gpu = (record.get("machine") or {}).get("gpu") or "an unnamed GPU"
    return runs + suite_s, f"{str(record.get('commit'))[:12]} on {gpu}, {record.get('date', 'undated')}"


def deadline_too_short(args: argparse.Namespace, modes: Sequence[str]) -> str | None:
    """Why ``--deadline`` cannot fit the gate's ``--part`` (``expected_seconds`` times ``DEADLINE_MARGIN``),
    or None."""
    part = getattr(args, "part", "all")
    expected = expected_seconds(args.record, modes if part != "tests" else (), suite=part != "runs")
    if args.deadline is None or args.force or expected is None:
        return None
    seconds, which = expected
    needed = math.ceil(DEADLINE_MARGIN * seconds)
    if args.deadline >= needed:
        return None
    what = {"all": "these runs and the suite", "runs": "these runs", "tests": "the suite"}[part]
    split = "" if part != "all" else "; or split the gate over two calls (--part runs, then --part tests)"
    return (
        f"--deadline {args.deadline:.0f} s is too short: the recorded gate ({which}) took {seconds:.0f} s for "
        f"{what}, and a suite cut off at the deadline verifies nothing. Give it "
        f"--deadline {needed} or more (the call's limit less the install; run nothing else in that call)"
        f"{split}, or --force"
    )


#: ``--order auto`` starts the slow tests first only where the last suite's tests summed to less than this
#: share of its workers' time (its wall x its workers): a suite that waited on its slowest tests. Where the
#: workers were busy throughout, no order shortens it (tests/suite_order.py's replay of session 35's suite
#: with CPU-machine durations: 152 s as collected, 109 s slow first, on 14 workers and a bound of 95 s).
TAIL_BOUND = 0.8


def slow_first(order: str, last_suite: dict[str, Any]) -> list[Any]:
    """The slow tests the suite starts first (``run_suite``'s ``slow_first``) for ``--order``: none
    ("collected"), the last suite's slowest ("slow-first"), or for "auto" those where that suite was
    bound by its slowest tests (``TAIL_BOUND``), none where it cannot tell."""
    slow = list(last_suite.get("slowest") or [])
    if order != "auto":
        return slow if order == "slow-first" else []
    busy: Any = last_suite.get("test_seconds")
    wall: Any = last_suite.get("seconds")
    workers: Any = last_suite.get("workers")
    try:
        waited = float(busy) < TAIL_BOUND * float(wall) * int(workers)
    except (TypeError, ValueError):
        return []
    return slow if waited else []


def continued_runs(record: dict[str, Any], record_path: Path, digest: str) -> tuple[dict[str, Any] | None, str]:
    """``--part tests``: the record whose runs the suite completes, or None and why not. ``record`` (read
    from ``record_path``) must hold runs of this tree's slidekit/ and plugins/ (``digest``): a suite
    completes only the runs of the sources it tests. A suite the record had (a gate cut off, or failed by a
    test mended since in tests/) is replaced."""
    if not record.get("runs"):
        return None, f"the record at {record_path} holds no runs (or is not there, or not readable)"
    if record.get("source_digest") != digest:
        return None, (
            f"the record's runs (commit {str(record.get('commit'))[:12]}) are of other slidekit/ and plugins/ "
            "than this tree's"
        )
    return record, ""


def gate(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "gpu_gate: no CUDA device here; the gate verifies the GPU path (--allow-cpu only tests the script)"
        )
        return 2
    t0 = time.perf_counter()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    commit = args.commit or _git_head(ROOT)
    started = dt.datetime.now(dt.UTC)
    modes = args.modes.split(",")
    short = deadline_too_short(args, modes)
    if short is not None:
        print(f"gpu_gate: not started: {short}", flush=True)
        return 2
    digest = source_digest()
    previous = _read_record(args.record)  # read once, before this gate's record replaces it
    earlier: dict[str, Any] | None = None  # --part tests: the record of the runs it completes
    if args.part == "tests":
        earlier, why_not = continued_runs(previous, args.record, digest)
        if earlier is None:
            print(
                f"gpu_gate: not started: --part tests completes the runs of a record of this tree's sources, and "
                f"{why_not}: run --part runs first (or the whole gate, --part all)",
                flush=True,
            )
            return 2
    last_suite = _last_suite(previous)
    matches = commit_matches_tree(commit, digest)
    if matches is False:
        print(
            f"gpu_gate: commit {str(commit)[:12]}'s slidekit/ and plugins/ are not this tree's (stale git "
            "metadata, or uncommitted changes): the record's source_digest names what ran; pass --commit "
            "with the commit the tree is",
            flush=True,
        )
    record: dict[str, Any] = {
        "commit": commit,
        "commit_matches_tree": matches,
        "source_digest": digest,
        "date": started.isoformat(timespec="seconds"),
        "machine": machine(),
        "command": " ".join(["python", "benchmarks/gpu_gate.py", *args.argv]),
        "part": args.part,
    }
    paths = [args.record] + ([out / "GPU-VERIFIED.json"] if out else [])
    tests: dict[str, Any] | None = None
    runs: list[dict[str, Any]] = []
    if earlier is not None:  # --part tests: the runs part's runs, and where and when they ran
        runs = list(earlier["runs"])
        keys = ("commit", "date", "machine", "command", "seconds")
        record["runs_part"] = earlier.get("runs_part") or {k: earlier.get(k) for k in keys}
    elif args.part == "runs" and last_suite is not None:  # the suite the next deadline and order go by
        keys = ("seconds", "of_commit", "slowest", "test_seconds", "workers")
        record["last_suite"] = {k: last_suite[k] for k in keys if k in last_suite}

    def save(pending: str | None) -> tuple[bool, str]:
        """Write the record as it stands; ``pending`` names what has not run yet (then it fails)."""
        ok, why = verdict(tests, runs, pending)
        seconds = round((dt.datetime.now(dt.UTC) - started).total_seconds())
        record.update(ok=ok, why=why, tests=tests, runs=runs, seconds=seconds)
        write_record(record, paths)
        return ok, why

    def left() -> float:
        return math.inf if args.deadline is None else args.deadline - (time.perf_counter() - t0)

    # The runs go first: each takes what it takes (at most --run-timeout), and the suite, whose length
    # varies most, gets what is left of --deadline instead of a share reserved for runs up front.
    for i, mode in enumerate(modes if args.part != "tests" else ()):
        save(f"the runs {', '.join(modes[i:])} had not finished")
        run = run_mode(args, mode, max(1.0, min(args.run_timeout, left())))
        print(f"gpu_gate: run {json.dumps(run)}", flush=True)
        runs.append(run)
    if args.part == "runs":
        ok, why = save("the test suite (gpu_gate.py --part tests on this tree completes this record)")
        print(f"gpu_gate: runs recorded ({why}); record {', '.join(map(str, paths))}", flush=True)
        return 0 if all(r["status"] == "ok" for r in runs) else 1
    if not args.skip_tests:
        log = (out or Path(tempfile.gettempdir())) / "gpu-gate-tests.log"
        budget = max(1.0, min(args.tests_timeout, left()))
        print(f"gpu_gate: the whole test suite, at most {budget:.0f} s (log {log})", flush=True)
        save("the test suite is running")  # a gate killed from outside leaves this much
        slow = slow_first(args.order, last_suite or {})
        tests = run_suite(budget, log, shlex.split(args.pytest_args), pytest_workers(args.workers), slow_first=slow)
        print(
            f"gpu_gate: tests {json.dumps({k: v for k, v in tests.items() if k != 'failures'})}", flush=True
        )
        for name in tests.get("failures", []):
            print(f"gpu_gate:   FAILED {name}", flush=True)
    ok, why = save(None)
    print(
        f"gpu_gate: {'PASSED' if ok else 'FAILED'} ({why}); record {', '.join(map(str, paths))}", flush=True
    )
    return 0 if ok else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--commit", default=None, help="the commit the tree is (default: git rev-parse HEAD)")
    p.add_argument("--check", action="store_true", help="only check that the record covers --commit (HEAD)")
    p.add_argument("--record", type=Path, default=RECORD, help="where the record goes (default: %(default)s)")
    p.add_argument("--model", default="qwen2.5-3b", help="preset shape of the runs (default: %(default)s)")
    p.add_argument("--batch", type=int, default=8, help="rows per step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="timed steps (default: %(default)s)")
    p.add_argument(
        "--modes", default=",".join(MODES), help="engine.gpu_resident of each run (default: %(default)s)"
    )
    p.add_argument(
        "--tests-timeout", type=float, default=480.0, help="seconds for the suite (default: %(default)s)"
    )
    p.add_argument("--run-timeout", type=float, default=240.0, help="seconds per run (default: %(default)s)")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds the whole gate may take: the runs go first, the suite gets what is left"
        " (default: none)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help=f"start even where --deadline is shorter than {DEADLINE_MARGIN} times what the recorded gate took",
    )
    p.add_argument(
        "--skip-tests", action="store_true", help="runs only (the record then says the gate failed)"
    )
    p.add_argument(
        "--part",
        choices=PARTS,
        default="all",
        help="all: the runs and the suite; runs, then tests: the gate in two calls on one tree, the second "
        "completing the first's record (default: %(default)s)",
    )
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string (e.g. '-x --lf')")
    p.add_argument(
        "--order",
        choices=("auto", "slow-first", "collected"),
        default="auto",
        help="the suite's order over its workers: the last suite's slowest tests first, one at the head of each "
        "worker's share (tests/suite_order.py), or as collected; auto: slow first where the last suite's "
        f"tests summed to under {TAIL_BOUND} of its workers' time (default: %(default)s)",
    )
    p.add_argument(
        "--workers",
        default="auto",
        help="pytest-xdist processes for the suite, or auto: 4 with xdist and 8+ cores",
    )
    p.add_argument("--allow-cpu", action="store_true", help="run without CUDA (to test this script)")
    p.add_argument("--run-one", default=None, metavar="RESIDENT", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.argv = argv
    if args.run_one is not None:
        print(json.dumps(run_one(args.model, args.batch, args.seq, args.run_one, args.warmup, args.steps)))
        return 0
    if args.check:
        ok, why = check(args.record, args.commit)
        print(f"gpu_gate: {why}")
        return 0 if ok else 1
    return gate(args)


if __name__ == "__main__":
    sys.exit(main())
