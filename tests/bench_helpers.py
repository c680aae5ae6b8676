"""What the `slidekit bench` tests share: a suite table's row, the check of a record's figures, a
machine whose free memory the test decides (for the memory watchdog), scripts standing in for every
system (``--baselines-dir``) and a budget clock on which each run takes its predicted time; and, for
the tests of the scripts under benchmarks/, each script loaded as a module (``load_benchmark``)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from slidekit.tools.bench import arch_spec, throughput
from slidekit.tools.children import MemoryWatchdog

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """The script ``benchmarks/<name>.py`` as a module named ``name``, registered in ``sys.modules`` (so
    that its dataclasses and pickles can find it)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


# ---------------------------------------------------------------------------- a whole suite on stand-ins

FAKE_RECORD = '''
import argparse, json, os, sys, time
p = argparse.ArgumentParser()
for flag in ("--model", "--batch", "--seq", "--steps", "--warmup", "--seed", "--device", "--clip", "--resident",
             "--optimizer", "--kernels", "--activations", "--window", "--state-tier", "--offload-ratio"):
    p.add_argument(flag)
p.add_argument("--gradient-checkpointing", action="store_true")
args, _ = p.parse_known_args()
batches = [int(b) for b in args.batch.split(",")]
clip = 0.9 if args.clip else 1.0

def repeat(key):
    """0 on this kind of run's first start, 1 on its second (a file beside the script counts)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "count-" + key)
    n = int(open(path).read()) if os.path.exists(path) else 0
    open(path, "w").write(str(n + 1))
    return n

def ok(system, batch, tokens, **extra):
    steps = int(args.steps)
    step = batch * int(args.seq) / tokens
    tokens = round(tokens, 1)  # as real records round it
    record = {"system": system, "status": "ok", "batch": batch, "tokens_per_s": tokens, "model_tflops": 1.0,
              "step_seconds": [step] * steps, "period_s": step * steps, "mean_step_s": step, "params": 1000,
              "peak_gpu_gib": None, "peak_host_rss_gib": 0.1, "setup_s": 1.0, **extra}
    print(json.dumps(record), flush=True)
'''


def fake_script(directory: Path, name: str, body: str) -> None:
    (directory / name).write_text(FAKE_RECORD + textwrap.dedent(body))


def fake_systems(directory: Path) -> None:
    fake_script(
        directory,
        "slidekit.py",
        """
        base = {"all": 1000, "none": 800, "0.5": 900}[args.resident]
        k = repeat(args.resident + str(args.clip))
        for b in batches:
            ok("slidekit", b, base * b * (1 + 0.1 * k) * clip, resident_units="x/6", t_fwd_s=0.001, t_bwd_s=0.002,
               t_d2h_s=0.0, t_update_s=0.0, eta=None, gpu_busy=0.9, gpu_busy_bwd=0.95)
        """,
    )
    fake_script(
        directory,
        "liger.py",
        """
        for b in batches:
            if args.gradient_checkpointing:
                ok("liger_gc", b, 600 * b)
            elif b == 3:
                reason = "does not fit in GPU memory: tried to allocate 4.00 GiB with 1.00 GiB free of 80.00 GiB"
                print(json.dumps({"system": "liger", "status": "unavailable", "batch": b, "reason": reason}))
            else:
                ok("liger", b, 700 * b)
        """,
    )
    fake_script(directory, "no_offload.py", "for b in batches:\n    ok('no_offload', b, 500 * b)\n")
    fake_script(
        directory,
        "deepspeed_offload.py",
        """
        if args.offload_ratio:
            for b in batches:
                ok("deepspeed_partial", b, 500 * b)
        else:
            ok("deepspeed", batches[0], 300 * batches[0])
            print("RuntimeError: boom", file=sys.stderr)
            sys.exit(3)
        """,
    )
    # Host memory grows until the watchdog kills the process (900 MiB at most, then it waits to be killed).
    fake_script(
        directory,
        "torchao_offload.py",
        """
        blocks = []
        while len(blocks) < 112:
            blocks.append(bytearray(b"x" * (8 << 20)))
            time.sleep(0.01)
        time.sleep(120)
        open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchao-ended"), "w").close()
        """,
    )


def clock_of_predictions(monkeypatch, speed: float = 1.0) -> Callable[[], float]:
    """A budget clock on which every run takes ``speed`` x its predicted seconds (and nothing else takes time)."""
    from slidekit.tools.bench import runner

    now = [0.0]
    real = runner._one_run

    def one_run(run, cmd, limit, base, *rest):
        real(run, cmd, limit, base, *rest)
        now[0] += speed * base["predicted_s"]

    monkeypatch.setattr(runner, "_one_run", one_run)
    return lambda: now[0]
