"""Train a published shape cut to another depth: how issue 17 finds the largest model a machine holds.

A model's width (hidden size, heads, vocabulary) fixes its units' sizes; its depth fixes how many there
are. To find the largest model a machine holds, take the widest published shape (Llama-3.1-70B) and
change only ``num_hidden_layers`` until the run no longer fits:

    python benchmarks/largest_model.py --base llama-3.1-70b --layers 46 --write-config /tmp/l70-46
    slidekit plan --model /tmp/l70-46 --seq-len 1024 --batch-size 8 --optimizer adamw_8bit \\
        --resident-weights auto --offload-dir /var/tmp/sk                  # what the planner expects
    python benchmarks/largest_model.py --base llama-3.1-70b --layers 46 -- \\
        --batch 8 --seq 1024 --optimizer adamw_8bit --resident auto --resident-weights auto \\
        --state-offload-tier posix --state-offload-fraction 0.25 --offload-dir /var/tmp/sk \\
        --steps 20 --warmup 2 --repeat-batch --lr 1e-4 --out records.jsonl

The shape is registered as preset ``<base>@<layers>L`` for this process and trained by the bench's
single-run child (``python -m slidekit.tools.bench``: the same record, whole-step timing, host RSS and
GPU peak); every argument after ``--`` goes to it. Weights are random, as for every preset.

The record comes only when the run ends, so a run cut off by a device call's time limit would say
nothing: ``--progress S`` (default 30) prints to stderr, every S seconds, the time since start and the
process's RSS, and after every step its number, seconds and loss. Such a run's stderr says whether
setup or the steps took the time, and how far the RSS climbed.

Test: ``pytest tests/test_largest_model.py``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TextIO

from slidekit.telemetry import host_rss_bytes
from slidekit.tools.presets import PRESETS, preset, write_config


def register(base: str, layers: int) -> str:
    """Register preset ``base`` with ``layers`` decoder layers as ``<base>@<layers>L``; its name."""
    if layers < 1:
        raise SystemExit(f"--layers {layers}: a model needs at least one decoder layer")
    shape = preset(base)  # an unknown base is a clear error naming the presets
    name = f"{base}@{layers}L"
    PRESETS[name] = {**shape, "num_hidden_layers": layers}
    return name


class Progress:
    """What a cut-off run leaves behind: a line every ``every`` seconds (elapsed, RSS) and one per step."""

    def __init__(self, every: float, out: TextIO = sys.stderr) -> None:
        self.t0, self.every, self.out = time.perf_counter(), every, out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="largest-progress", daemon=True)

    def line(self, text: str) -> None:
        print(
            f"[{time.perf_counter() - self.t0:7.1f} s, rss {host_rss_bytes() / 2**30:6.1f} GiB] {text}",
            file=self.out,
            flush=True,
        )

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        self.line(
            f"step {step}: {metrics.get('seconds', float('nan')):.3f} s, loss {metrics.get('loss', float('nan')):.4f}"
        )

    def _tick(self) -> None:
        while not self._stop.wait(self.every):
            self.line("running")

    def __enter__(self) -> Progress:
        self.line("start")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.line("end")


def _report_steps(progress: Progress) -> None:
    """Make the bench child's step plugin also report each step to ``progress``."""
    from slidekit.hookspecs import hookimpl
    from slidekit.tools.bench import slidekit_run

    base = slidekit_run.StepMetrics

    class Reporting(base):  # type: ignore[misc, valid-type]
        @hookimpl
        def slidekit_step_end(self, step: int, metrics: dict[str, float]) -> None:
            super().slidekit_step_end(step, metrics)
            progress.step(step, metrics)

    slidekit_run.StepMetrics = Reporting  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help=f"a published preset: {', '.join(PRESETS)}")
    p.add_argument("--layers", type=int, required=True, help="decoder layers of the shape")
    p.add_argument(
        "--seq", type=int, default=1024, help="tokens per row the config must allow (--write-config)"
    )
    p.add_argument(
        "--write-config", type=Path, default=None, help="write the shape's config.json here and stop"
    )
    p.add_argument(
        "--progress", type=float, default=30.0, help="seconds between progress lines on stderr (0: none)"
    )
    args = p.parse_args(argv[:cut])
    name = register(args.base, args.layers)
    if args.write_config is not None:
        write_config(name, args.write_config, args.seq)
        print(f"{name}: {args.write_config / 'config.json'}")
        return 0
    from slidekit.tools.bench.slidekit_run import main as bench

    child = ["--model", name, *argv[cut + 1 :]]
    if args.progress <= 0:
        return bench(child)
    with Progress(args.progress) as progress:
        _report_steps(progress)
        return bench(child)


if __name__ == "__main__":
    raise SystemExit(main())
