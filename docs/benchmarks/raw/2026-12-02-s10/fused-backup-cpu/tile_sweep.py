"""Ad-hoc: layer_adam's fused backup with other tile sizes / plain stores (NOTES.md section 23).

Each variant is plugins/slidekit_optim/csrc copied to /tmp/csrc_<variant> with backup_copy.h edited:
t<N>: kBackupTile = N (streaming stores); plain: kBackupTile = 512 and no streaming stores (memcpy).
Usage: python tile_sweep.py NUMEL THREADS VARIANT...   (the worktree's own build runs as "t128").
"""

import sys
import time
from statistics import median

import torch

from slidekit.interfaces import OptimizerHyper, ParamGroupRange
from slidekit_optim.layer_adam import LayerAdam

n, threads, variants = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
torch.set_num_threads(threads)
h = OptimizerHyper(weight_decay=0.1)
opts = {"t128": LayerAdam(h, impl="cpp")}
opts |= {v: LayerAdam(h, impl="cpp", kernel_source=f"/tmp/csrc_{v}/fused_adam.cpp") for v in variants}
master, grad = torch.randn(n), torch.randn(n)
state = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n)}
backup = {k: torch.empty(n) for k in ("master", "exp_avg", "exp_avg_sq")}
groups = [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
count = [0]


def run(opt, b):
    count[0] += 1
    opt.step(master, grad, state, lr=1e-6, count=count[0], groups=groups, backup_out=b)


steps = {k: (lambda o=o: run(o, backup)) for k, o in opts.items()} | {"update": lambda: run(opts["t128"], None)}
for f in steps.values():
    f()
times = {k: [] for k in steps}
for _ in range(9):
    for k, f in steps.items():
        t0 = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t0)
m = {k: median(v) for k, v in times.items()}
print({"numel": n, "threads": threads, "ms": {k: round(v * 1e3, 2) for k, v in m.items()},
       "over_update": {k: round(v / m["update"], 3) for k, v in m.items()}}, flush=True)
