"""Training throughput of slidekit on random-weight models shaped like real ones (one process, a JSON line per batch).

    python benchmarks/train_throughput.py --model qwen2.5-1.5b --batch 8,32 --seq 1024 --resident none
    python benchmarks/train_throughput.py --model tiny --device cpu --steps 2      # a smoke run anywhere

A thin wrapper: the presets (``slidekit.tools.presets.PRESETS``), the run and its
record live in ``slidekit.tools.bench`` (this is ``python -m slidekit.tools.bench``,
``slidekit.tools.bench.slidekit_run``), which ``slidekit bench`` runs once per mode,
recipe and repeat of a suite. Per batch: a fresh Trainer, ``--warmup`` + ``--steps``
steps in one fit, and the record of the timed ones: tokens/s and model TFLOPS
over their period (whole steps, start to start, the last ending with every
update applied; ``slidekit.telemetry.model_flops``: 6 x matmul params x tokens
+ 12 x layers x heads x head_dim x seq x tokens, the embedding lookup counting
zero), every step's seconds, peak GPU memory, peak host RSS, the median seconds
each pipeline lane spent per step, per-unit T_fwd/T_bwd/T_d2h/T_update, eta and
the GPU busy fractions. Synthetic uniform-random tokens. The method:
docs/benchmarking.md.
"""

from __future__ import annotations

import sys

from slidekit.tools.bench import PRESETS, main

__all__ = ["PRESETS", "main"]

if __name__ == "__main__":
    sys.exit(main())
