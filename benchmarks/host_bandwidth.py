"""Host memory bandwidth on all of torch's threads: the ceiling of any CPU optimizer pass.

    python benchmarks/host_bandwidth.py --gib 1 --repeat 5

STREAM-style kernels over FP32 vectors of ``--gib`` GiB each (far larger than
any cache), run by torch's intra-op threads, best of ``--repeat``:

- read: ``a.sum()`` reads one vector;
- copy: ``b.copy_(a)`` reads one, writes one;
- triad: ``torch.add(b, c, alpha=s, out=a)`` reads two, writes one.

GB/s counts the bytes the kernel must move (a write counted once; the
hardware may also read the written line first, which STREAM does not count).
The record also gives what bandwidth layer_adam's fused pass needs per G
parameters/s: it moves 28 bytes per parameter (read a BF16 gradient and the
FP32 master and two moments, write those three and a BF16 copy), so its rate
is bounded by triad GB/s / 28. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

#: Bytes layer_adam's fused pass moves per parameter (see plugins/slidekit_optim/csrc/fused_adam.cpp).
ADAM_BYTES_PER_PARAM = 2 + 12 + 12 + 2


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # first touch: page faults are not bandwidth
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of each vector")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    n = int(args.gib * (1 << 30)) // 4
    a, b, c = (torch.ones(n) for _ in range(3))
    nbytes = n * 4
    rates = {
        "read": nbytes / best_seconds(lambda: a.sum(), args.repeat),
        "copy": 2 * nbytes / best_seconds(lambda: b.copy_(a), args.repeat),
        "triad": 3 * nbytes / best_seconds(lambda: torch.add(b, c, alpha=0.5, out=a), args.repeat),
    }
    record = {
        "threads": torch.get_num_threads(),
        "vector_gib": args.gib,
        **{f"{k}_gb_s": round(v / 1e9, 1) for k, v in rates.items()},
        "adam_bytes_per_param": ADAM_BYTES_PER_PARAM,
        "adam_bound_g_params_s": round(rates["triad"] / ADAM_BYTES_PER_PARAM / 1e9, 2),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
