"""CPU optimizer throughput on one unit: parameters updated per second.

    python benchmarks/optimizer_rate.py --numel 233000000     # a Qwen2.5-7B layer
    python benchmarks/optimizer_rate.py --numel 2000000       # quick, anywhere

Compares every installed optimizer driver (through the plugin registry, as
the engine uses them; BF16 gradient in, BF16 upload copy out) with
torch.optim.AdamW(fused=True) on the same unit followed by a separate BF16
copy. Prints one JSON line; medians over --repeat updates after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from statistics import median

import torch

from slidekit import Plugins
from slidekit.interfaces import OptimizerHyper, ParamGroupRange


def _time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=2_000_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen).to(torch.bfloat16)
    hyper = OptimizerHyper(weight_decay=0.1)
    groups = [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]
    out: dict[str, object] = {"numel": n, "threads": torch.get_num_threads()}
    plugins = Plugins()
    for reg in plugins.drivers("optimizer"):
        opt = reg.descriptor.factory(hyper)
        master = torch.randn(n, generator=gen)
        state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
        lowp = torch.empty(n, dtype=torch.bfloat16)
        count = [0]

        def step(opt=opt, master=master, state=state, lowp=lowp, count=count) -> None:
            count[0] += 1
            opt.step(master, grad, state, lr=1e-4, count=count[0], groups=groups, lowp_out=lowp)

        out[f"{reg.name}_gparams_s"] = round(n / _time(step, args.repeat) / 1e9, 3)

    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    fused = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, fused=True)
    lowp = torch.empty(n, dtype=torch.bfloat16)

    def baseline() -> None:
        param.grad = grad.float()  # the fused kernel wants FP32 gradients like its parameters
        fused.step()
        lowp.copy_(param.detach())

    out["torch_fused_adamw_plus_copy_gparams_s"] = round(n / _time(baseline, args.repeat) / 1e9, 3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
