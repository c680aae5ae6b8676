"""Where a run's setup goes: ``Trainer(config)`` of a preset shape under cProfile, as the bench child builds it.

The bench child's setup is 40-67 s for forced offload at 7B on the H200 (NOTES 28) and dominates the
suites' device time; this names its parts. It takes the bench child's options (``python -m
slidekit.tools.bench --help``; ``--batch`` one size) and prints one JSON line: the setup's seconds and
the ``--top`` functions by cumulative time (file:line name, calls, cumulative and own seconds).
``--profile-out FILE`` also keeps the whole profile (``python -m pstats FILE``).

    python benchmarks/setup_profile.py --model qwen2.5-7b --batch 8 --resident none [--top 30] [--profile-out prof]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def top_functions(stats: pstats.Stats, n: int) -> list[dict[str, Any]]:
    """The ``n`` functions of the largest cumulative time, largest first."""
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(filename).name}:{line} {name}",
                "calls": calls,
                "cum_s": cumulative,
                "own_s": own,
            }
        )
    rows.sort(key=lambda r: -r["cum_s"])
    return [{**r, "cum_s": round(r["cum_s"], 3), "own_s": round(r["own_s"], 3)} for r in rows[:n]]


def main(argv: Sequence[str] | None = None) -> int:
    from slidekit.tools.bench.slidekit_run import _config, slidekit_parser
    from slidekit.tools.presets import write_config

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--top", type=int, default=30)
    extra.add_argument("--profile-out", dest="profile_out", type=Path, default=None)
    mine, rest = extra.parse_known_args(argv)
    args = slidekit_parser().parse_args(rest)
    try:
        args.batch = int(args.batch)
    except ValueError:
        raise SystemExit(f"--batch {args.batch!r}: give one batch size") from None
    from slidekit import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        write_config(args.model, Path(tmp), args.seq)
        config = _config(args, tmp)
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        trainer = Trainer(config)
        profile.disable()
        setup_s = time.perf_counter() - t0
        trainer.close()
    stats = pstats.Stats(profile)
    if mine.profile_out is not None:
        stats.dump_stats(str(mine.profile_out))
    record = {
        "model": args.model,
        "batch": args.batch,
        "resident": args.resident,
        "optimizer": args.optimizer,
    }
    print(json.dumps({**record, "setup_s": round(setup_s, 3), "top": top_functions(stats, mine.top)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
