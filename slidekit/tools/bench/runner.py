"""Running a suite: the builds, then every kept run of the time plan in its own process, each row recorded.

``run_suite`` does, in order:

1. The builds the kept runs need (``slidekit build``; DeepSpeed's cpu_adam extension), side by side,
   before anything is timed, so no run compiles while another is measured.
2. Each kept run, most important first, in its own process group (``stream_child``), under the
   memory watchdog (host RAM exhausted is that run's result, not the end of the benchmark) and a
   time limit: with a budget, min(what is left, 2 x its prediction + 30 s); without, ``--timeout``
   x its batches. A run whose prediction is more than what is left of the budget is not started
   ("not run: time budget"). A run the plan left out starts after all when the suite is ahead of its
   plan: when its prediction, plus the predictions of the kept runs still to come, fits in what is
   left (and it needs no build the plan did not make). Predictions come from other machines' records,
   so once runs have finished each prediction is scaled by this call's pace: the seconds the runs
   so far took over the seconds predicted for them (``pace``, 0.5-3x): on a host 1.5x slower than the
   records', a run that would be cut off by the budget's end is not started, and its time goes to
   the runs that fit. Each JSON line a child prints becomes a row at once: printed as a
   progress line on stderr and appended to the suite's JSONL, so a suite killed midway keeps what
   finished. Every batch a run printed nothing for gets a row saying why (timed out, exit code and
   last error line, host RAM exhausted); a record naming no batch speaks for every batch. A run
   stopped by the call's end (its limit was what was left of the budget, less than its own
   allowance) is no result: its unfinished batches are "not run: stopped at the call's end", so
   ``--continue`` runs it again, whole.
3. The runs left out (by the plan and not taken up when ahead) get a row per batch: "not run: time
   budget (predicted S s; ...)".

A later repeat does not run again a batch that an earlier repeat of the same run (label, recipe,
GPUs), in this call or in the records it continues, measured not to fit this machine (out of GPU
memory, host RAM exhausted, slidekit's planner refusing the placement: ``records.did_not_fit``). Those
results do not vary from one process to the next as times do, and at 7B and 14B the alternatives'
attempts take a minute or more each until the watchdog stops them. Such a batch gets the row
"unavailable" with "not repeated: repeat N did not fit this machine" (``not_repeated``: N); the run's
other batches still run, and a run with none left starts no process.

A run on N GPUs (``RunSpec.ranks``) is ``python -m torch.distributed.run --standalone
--nproc-per-node N`` around the same module or script (``torchrun_command``): its ranks run in
sessions of their own, and the deadline and the memory watchdog take the whole tree
(``children.kill_tree``). Every child of a suite with such a run, builds and one-GPU runs included,
gets ``MULTICAST_OFF`` in its environment (NVLink multicast off: NCCL's NVLS, torch's symmetric
memory, NVSHMEM); a run on N GPUs also gets ``OMP_NUM_THREADS`` = the CPUs / N (torchrun would set
1, leaving each rank's host update one thread) unless the bench's own environment sets it.

Every row carries the run's identity (suite, label, recipe, repeat, GPUs, cost key, prediction, the
levers its mode sets), the commit, the date and the package versions; the suite's first JSONL line
(``"record": "suite"``) has the plan, the builds and the machine-independent settings. Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from slidekit.tools.bench.costs import BUILD_S
from slidekit.tools.bench.records import did_not_fit
from slidekit.tools.bench.suites import BASELINE_PACKAGE, RunSpec, Suite, expand
from slidekit.tools.bench.timeplan import Plan, Planned, builds_for, format_plan
from slidekit.tools.children import ChildRun, MemoryWatchdog, last_error, stream_child

__all__ = ["BUILD_COMMANDS", "MULTICAST_OFF", "Recorder", "child_env", "run_suite", "torchrun_command"]

#: NVLink multicast off, in every process of a suite with a run on several GPUs (the 2-GPU machine's
#: advice, docs/benchmarking.md): NCCL's NVLS algorithms, torch's symmetric memory, NVSHMEM's NVLS.
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_MIN_RUN_S = 15.0  # too little to build a model and time a step

#: How each build runs (a child process, side by side with the others), and the variables it needs.
BUILD_COMMANDS: dict[str, tuple[list[str], dict[str, str]]] = {
    "slidekit": ([sys.executable, "-m", "slidekit.cli", "build"], {}),
    "deepspeed": (
        [
            sys.executable,
            "-c",
            "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()",
        ],
        {"DS_ACCELERATOR": "cuda", "DS_SKIP_CUDA_CHECK": "1"},
    ),
}
#: A build may take this many times its prediction (``costs.BUILD_S``) before it is stopped: a stuck
#: compiler must not eat the suite's budget (a run whose build failed says so itself).
_BUILD_SLACK = 3.0


class Recorder:
    """The suite's rows: each printed as a progress line and appended to the JSONL as it comes."""

    def __init__(
        self, path: Path | None, header: dict[str, Any], rows: Sequence[dict[str, Any]] = ()
    ) -> None:
        """``rows``: an earlier call's, which the file holds first (``slidekit bench --continue``)."""
        self.path = path
        self.header = header
        self.rows: list[dict[str, Any]] = list(rows)
        self.rewrite()

    def add(self, row: dict[str, Any]) -> None:
        print(_progress_line(row), file=sys.stderr, flush=True)
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    def rewrite(self) -> None:
        """Write the header and every row once more (process walls added at the end of each run)."""
        if self.path is not None:
            text = "".join(json.dumps(r) + "\n" for r in [self.header, *self.rows])
            self.path.write_text(text)


def _progress_line(row: dict[str, Any]) -> str:
    what = f"{row['run_name']} batch {row['batch']}"
    if row.get("status") != "ok":
        status, reason = str(row.get("status")), str(row.get("reason", "?"))
        return f"{what}: {reason if reason.startswith(status) else f'{status}: {reason}'}"
    return f"{what}: {row['tokens_per_s']:,.0f} tokens/s, {row['model_tflops']:.1f} TFLOPS ({row.get('wall_s')} s)"


def torchrun_command(ranks: int, target: list[str]) -> list[str]:
    """``target`` (``["-m", module, ...]`` or ``[script, ...]``) on ``ranks`` processes of this host."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    return [*launcher, *target]


def child_env(suite: Suite, run: RunSpec | None, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables a child of ``suite`` gets beside the bench's own (``run`` None: a build); see the
    module docstring."""
    env: dict[str, str] = {}
    if any(r.ranks > 1 for r in expand(suite)):
        env |= MULTICAST_OFF
    if run is not None and run.ranks > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = str(max(1, _cpus() // run.ranks))
    return env


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _command(args: argparse.Namespace, run: RunSpec, suite: Suite) -> list[str] | str:
    """The child's command line, or why there is none (a replacement script missing)."""
    target = _target(args, run, suite)
    if isinstance(target, str) or run.ranks == 1:
        return target if isinstance(target, str) else [sys.executable, *target]
    return torchrun_command(run.ranks, target)


def _target(args: argparse.Namespace, run: RunSpec, suite: Suite) -> list[str] | str:
    """What the interpreter runs (``-m module`` or a script) and its options, or why there is none."""
    common = ["--model", suite.model, "--batch", ",".join(map(str, run.batches)), "--seq", str(suite.seq)]
    common += ["--steps", str(suite.steps), "--warmup", str(suite.warmup), "--seed", str(args.seed)]
    common += ["--device", args.device]
    if run.clip is not None:
        common += ["--clip", f"{run.clip:g}"]
    flags = [*common, *run.flags]
    directory = Path(args.baselines_dir) if args.baselines_dir else None
    if run.script == "slidekit":
        flags += ["--kernels", args.kernels, "--activations", args.activations, "--window", str(args.window)]
        flags += ["--state-tier", args.state_tier] + (
            ["--offload-dir", args.offload_dir] if args.offload_dir else []
        )
        if directory is not None and (directory / "slidekit.py").is_file():
            return [str(directory / "slidekit.py"), *flags]
        return ["-m", "slidekit.tools.bench", *flags]
    if directory is None:
        return ["-m", f"{BASELINE_PACKAGE}.{run.script.removesuffix('.py')}", *flags]
    path = directory / run.script
    if not path.is_file():
        return f"script {path} not found (pass --baselines-dir with it, or leave --baselines-dir out)"
    return [str(path), *flags]


def _log_path(logs: Path | None, name: str) -> Path | None:
    return logs / (re.sub(r"[^A-Za-z0-9.-]+", "_", name).strip("_") + ".log") if logs else None


def run_builds(
    names: Sequence[str],
    logs: Path | None,
    commands: Mapping[str, tuple[list[str], dict[str, str]]] = BUILD_COMMANDS,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run the builds ``names`` (of ``commands``) side by side, each for at most ``_BUILD_SLACK`` x its
    prediction, with ``extra_env`` beside each build's own variables; per build: ok, seconds, and why not."""
    out: dict[str, dict[str, Any]] = {}

    def one(name: str) -> None:
        cmd, own = commands[name]
        env = {**(extra_env or {}), **own}
        limit = _BUILD_SLACK * BUILD_S.get(name, 60.0)
        run = stream_child(cmd, timeout=limit, log=_log_path(logs, f"build_{name}"), env=env)
        out[name] = {"ok": run.failure is None, "wall_s": run.wall_s, "failure": run.failure}

    threads = [threading.Thread(target=one, args=(n,), name=f"build-{n}") for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in names:
        print(
            f"build {name}: {'ok' if out[name]['ok'] else out[name]['failure']} ({out[name]['wall_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    return out


def run_suite(
    args: argparse.Namespace,
    plan: Plan,
    recorder: Recorder,
    *,
    identity: dict[str, Any],
    watchdog: MemoryWatchdog | None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict[str, Any]]:
    """Run ``plan`` (module docstring); every row goes through ``recorder``. ``identity``: fields every
    row carries (commit, date, versions)."""
    start = clock()
    suite = plan.suite
    logs = Path(args.logs) if args.logs else None
    print(format_plan(plan), file=sys.stderr, flush=True)
    if plan.builds:
        recorder.header["builds"] = run_builds(plan.builds, logs, extra_env=child_env(suite, None))
        recorder.rewrite()

    def left() -> float:
        return plan.budget_s - (clock() - start) if plan.budget_s is not None else math.inf

    took_s = predicted_so_far_s = 0.0  # seconds the runs started so far took, and their predictions
    kept_after = [sum(p.predicted_s for p in plan.runs[i + 1 :] if p.keep) for i in range(len(plan.runs))]
    for i, planned in enumerate(plan.runs):
        rate = pace(took_s, predicted_so_far_s)
        need = planned.predicted_s * rate
        run = planned.run
        base = {"record": "run", "suite": suite.name, "model": suite.model, "seq": suite.seq, **identity}
        base |= {"system": run.system, "label": run.label, "kind": run.kind, "cost_key": run.cost_key}
        base |= {"max_grad_norm": run.clip, "repeat": run.repeat, "run_name": run.name}
        base |= {"predicted_s": planned.predicted_s, "resident": run.resident}
        base |= {"ranks": run.ranks, "family": run.family or run.label}
        if run.levers:  # only where the mode sets them: other suites' rows stay as they were
            base["levers"] = dict(run.levers)
        no_room = _no_room(recorder.rows, run)
        for batch, repeat in no_room.items():
            why = f"not repeated: repeat {repeat} did not fit this machine"
            row = {**base, "batch": batch, "status": "unavailable", "reason": why, "not_repeated": repeat}
            recorder.add(row)
        if len(no_room) == len(run.batches):
            continue
        if no_room:
            run = dataclasses.replace(run, batches=tuple(b for b in run.batches if b not in no_room))
        ahead = not planned.keep and _taken_up(planned, plan, left() - rate * kept_after[i], rate)
        if not (planned.keep or ahead) or need > left() or left() < _MIN_RUN_S:
            why = f"not run: time budget (predicted {planned.predicted_s:.0f} s"
            why += f", {need:.0f} s at this call's pace {rate:.2f}x; " if rate != 1.0 else "; "
            why += f"{max(left(), 0):.0f} s were left)" if planned.keep else "the plan left it out)"
            for batch in run.batches:
                recorder.add({**base, "batch": batch, "status": "not run", "reason": why})
            continue
        if watchdog is not None:  # a child killed before may still be giving its memory back
            available = watchdog.settle(timeout_s=min(60.0, max(left() - need, 0.0)))
            base["mem_available_at_start_gib"] = None if available is None else round(available / 2**30, 1)
        own_limit = 2 * need + 30
        limit = min(left(), own_limit) if plan.budget_s is not None else args.timeout * len(run.batches)
        call_end = plan.budget_s is not None and limit < own_limit  # the call's end may stop it first
        cmd = _command(args, run, suite)
        if isinstance(cmd, str):
            for batch in run.batches:
                recorder.add({**base, "batch": batch, "status": "unavailable", "reason": cmd})
            continue
        if ahead:
            base["taken_up"] = "the plan left it out; the suite was ahead of its plan"
        env = child_env(suite, run)
        if env:
            base["env"] = env
        if rate != 1.0:
            base["pace"] = round(rate, 3)
        t0 = clock()
        _one_run(run, cmd, limit, base, recorder, logs, watchdog, env, call_end)
        took_s += clock() - t0
        predicted_so_far_s += planned.predicted_s
    recorder.rewrite()
    return recorder.rows


def _no_room(rows: Sequence[dict[str, Any]], run: RunSpec) -> dict[int, int]:
    """The batches of ``run`` that an earlier repeat of the same run (label, recipe, GPUs) measured not to
    fit this machine (``records.did_not_fit``), each with the first such repeat."""
    found: dict[int, int] = {}
    for row in rows:
        repeat, batch = row.get("repeat"), row.get("batch")
        if not (isinstance(repeat, int) and isinstance(batch, int)) or repeat >= run.repeat:
            continue
        which = (row.get("label"), row.get("max_grad_norm"), row.get("ranks", 1))
        if which == (run.label, run.clip, run.ranks) and batch in run.batches and did_not_fit(row):
            found[batch] = min(found.get(batch, repeat), repeat)
    return found


#: The range a call's pace is held to: a run that fails at once must not make every later one look short.
PACE_RANGE = (0.5, 3.0)


def pace(took_s: float, predicted_s: float) -> float:
    """This call's pace: the seconds the runs so far took over their predicted seconds, within
    ``PACE_RANGE``; 1 before any run has finished."""
    if predicted_s <= 0:
        return 1.0
    low, high = PACE_RANGE
    return min(max(took_s / predicted_s, low), high)


def _taken_up(planned: Planned, plan: Plan, spare_s: float, rate: float = 1.0) -> bool:
    """Whether a run the plan left out starts after all: its prediction at this call's ``rate`` fits in
    ``spare_s`` (what is left once the kept runs still to come have their time) and every build it
    needs was made."""
    built = not plan.prebuild or set(builds_for([planned.run])) <= set(plan.builds)
    return planned.predicted_s * rate <= spare_s and built


def _one_run(
    run: RunSpec,
    cmd: list[str],
    limit: float,
    base: dict[str, Any],
    recorder: Recorder,
    logs: Path | None,
    watchdog: MemoryWatchdog | None,
    env: dict[str, str] | None = None,
    call_end: bool = False,
) -> None:
    """One process (``run.ranks`` under torchrun) over all of ``run``'s batches: a row per batch as its line arrives, then a row for every
    batch it printed nothing for, saying why. ``call_end``: ``limit`` is what was left of the call's
    budget, not the run's own allowance, so a timeout there stopped an unfinished run, not a slow one:
    its batches without a line are "not run" (``--continue`` runs the whole run again)."""
    done: dict[int, dict[str, Any]] = {}
    general: list[dict[str, Any]] = []  # records naming no batch speak for every batch
    t0 = time.perf_counter()

    def row(batch: int, fields: dict[str, Any]) -> dict[str, Any]:
        # The parent's identity wins over what the run calls itself; the record's own fields stay.
        return {**fields, **base, "batch": batch}

    def on_record(record: dict[str, Any]) -> None:
        batch = record.get("batch")
        if batch is None:
            general.append(record)
        elif batch in run.batches and batch not in done:  # a line printed twice is kept once
            done[batch] = row(batch, {"wall_s": round(time.perf_counter() - t0, 1), **record})
            recorder.add(done[batch])

    result: ChildRun = stream_child(
        cmd, timeout=limit, log=_log_path(logs, run.name), on_record=on_record, watchdog=watchdog, env=env
    )
    for r in done.values():
        r["process_wall_s"] = result.wall_s
        r["process_peak_rss_gib"] = result.peak_rss_gib
    stopped = result.killed_by is None and result.returncode is None and call_end
    for batch in (b for b in run.batches if b not in done):
        fields: dict[str, Any]
        if stopped:
            why = f"stopped at the call's end after {result.wall_s:.0f} s (predicted {base['predicted_s']:.0f} s)"
            fields = {"status": "not run", "reason": f"not run: {why}; a --continue call runs it again"}
        elif general:
            fields = dict(general[-1])
        else:
            why = result.failure or f"exit code 0: {last_error(result.stderr)}"
            fields = {"status": "unavailable", "reason": f"no line for batch {batch}; {why}"}
            if result.killed_by is not None:  # host RAM exhausted: the measured result itself
                fields = {"status": "unavailable", "reason": result.killed_by}
        fields |= {"wall_s": result.wall_s, "process_wall_s": result.wall_s}
        fields["process_peak_rss_gib"] = result.peak_rss_gib
        recorder.add(row(batch, fields))
