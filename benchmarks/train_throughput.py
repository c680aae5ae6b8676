"""Training throughput of slidekit on random-weight models shaped like real ones (one run, one JSON line).

    python benchmarks/train_throughput.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 6
    python benchmarks/train_throughput.py --model tiny --device cpu      # a smoke run anywhere

A thin wrapper: the presets (``slidekit.tools.presets.PRESETS``), the run and its
record live in ``slidekit.tools.bench`` (this is ``python -m slidekit.tools.bench``), which
``slidekit bench`` also uses to compare slidekit with the alternatives in
slidekit/tools/baselines. The record: tokens/s and model TFLOPS of the median timed
step (``slidekit.telemetry.model_flops``, PaLM convention, recompute not
counted: 6 * params * tokens + 12 * layers * (heads * head_dim) * seq_len *
tokens), peak GPU memory, peak host RSS, the median seconds each pipeline lane
spent per step (fwd/head/bwd compute, h2d, d2h, update, stall = main thread
waiting), per-unit T_fwd/T_bwd/T_d2h/T_update, eta and the GPU busy fraction.
Synthetic uniform-random tokens; the first --warmup steps are not timed.
"""

from __future__ import annotations

import sys

from slidekit.tools.bench import PRESETS, main

__all__ = ["PRESETS", "main"]

if __name__ == "__main__":
    sys.exit(main())
