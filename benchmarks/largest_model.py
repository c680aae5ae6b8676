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

Test: ``pytest tests/test_largest_model.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from slidekit.tools.presets import PRESETS, preset


def register(base: str, layers: int) -> str:
    """Register preset ``base`` with ``layers`` decoder layers as ``<base>@<layers>L``; its name."""
    if layers < 1:
        raise SystemExit(f"--layers {layers}: a model needs at least one decoder layer")
    shape = preset(base)  # an unknown base is a clear error naming the presets
    name = f"{base}@{layers}L"
    PRESETS[name] = {**shape, "num_hidden_layers": layers}
    return name


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help=f"a published preset: {', '.join(PRESETS)}")
    p.add_argument("--layers", type=int, required=True, help="decoder layers of the shape")
    p.add_argument("--seq", type=int, default=1024, help="tokens per row the config must allow (--write-config)")
    p.add_argument("--write-config", type=Path, default=None, help="write the shape's config.json here and stop")
    args = p.parse_args(argv[:cut])
    name = register(args.base, args.layers)
    if args.write_config is not None:
        from slidekit.tools.presets import write_config

        write_config(name, args.write_config, args.seq)
        print(f"{name}: {args.write_config / 'config.json'}")
        return 0
    from slidekit.tools.bench.slidekit_run import main as bench

    return bench(["--model", name, *argv[cut + 1 :]])


if __name__ == "__main__":
    raise SystemExit(main())
