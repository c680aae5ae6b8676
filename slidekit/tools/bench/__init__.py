"""``slidekit bench``: slidekit against the usual alternatives on the same model, tokens and recipe.

    slidekit bench --suite qwen2.5-3b --out results/ --time-budget 540 --commit <sha>
    slidekit bench --model tiny --device cpu --batch 2 --seq 64 --steps 2 --baselines none   # anywhere

A suite (``suites``) is every run for one model size: slidekit all-resident, the planner's auto, a
partial share and forced full offload; HF + Liger Kernel with and without gradient checkpointing,
plain HF, torchao's CPUOffloadOptimizer, DeepSpeed ZeRO-2 Offload and ZeRO-3 partial offload; each
without clipping and with ``max_grad_norm`` 1.0, each repeated in separate processes. The time plan
(``timeplan``, from the measured costs of ``costs``) predicts every run and, under a budget, leaves
out the least important ones; the runner (``runner``) runs the rest one process each under a memory
watchdog; the summary (``summary``) makes the table: the median and [min-max] over repeats, offload
efficiency against slidekit's own all-resident run, ratios against the strongest baseline that ran.
A step is a whole step (start to start, the last ending with every update applied); the FLOP count
is ``slidekit.telemetry.model_flops`` (the embedding lookup counts zero). docs/benchmarking.md has
the method; ``python -m slidekit.tools.bench`` is one slidekit process (``slidekit_run``).

Test: ``pytest tests/test_bench.py tests/test_bench_plan.py``.
"""

from __future__ import annotations

from slidekit.tools.bench.cli import add_arguments, bench, build_suite, run_command
from slidekit.tools.bench.records import (
    COMPUTE_LANES,
    FLOPS_FORMULA,
    does_not_fit,
    lane_metrics,
    peak_gpu_gib,
    peak_rss_gib,
    run_header,
    synthetic_tokens,
    throughput,
    versions,
)
from slidekit.tools.bench.slidekit_run import main, measure_slidekit, slidekit_parser
from slidekit.tools.bench.suite_presets import SUITES
from slidekit.tools.bench.suites import BASELINE_PACKAGE, BASELINES
from slidekit.tools.bench.summary import add_ratios, cells, markdown_table, suite_markdown
from slidekit.tools.children import ChildRun, MemoryWatchdog, run_child, stream_child
from slidekit.tools.presets import PRESETS, arch_spec, hf_config, write_config

__all__ = [
    "BASELINES",
    "BASELINE_PACKAGE",
    "COMPUTE_LANES",
    "FLOPS_FORMULA",
    "PRESETS",
    "SUITES",
    "ChildRun",
    "MemoryWatchdog",
    "add_arguments",
    "add_ratios",
    "arch_spec",
    "bench",
    "build_suite",
    "cells",
    "does_not_fit",
    "hf_config",
    "lane_metrics",
    "main",
    "markdown_table",
    "measure_slidekit",
    "peak_gpu_gib",
    "peak_rss_gib",
    "run_child",
    "run_command",
    "run_header",
    "slidekit_parser",
    "stream_child",
    "suite_markdown",
    "synthetic_tokens",
    "throughput",
    "versions",
    "write_config",
]
