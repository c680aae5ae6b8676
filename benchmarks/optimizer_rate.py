"""CPU optimizer throughput on one unit: parameters updated per second.

    python benchmarks/optimizer_rate.py --numel 233000000     # a Qwen2.5-7B layer
    python benchmarks/optimizer_rate.py --numel 20000000      # quick, anywhere

Every installed optimizer driver runs through the plugin registry, as the
engine uses it (BF16 gradient in, BF16 upload copy out, weight decay 0.1);
``layer_adam``, ``adamw_8bit`` and ``adamw_fp8`` run twice, once per
implementation (``impl="cpp"``, the fused kernel, built first if needed, which
is what the engine gets, and ``impl="torch"``, the pure-torch reference and
fallback).
The baseline is ``torch.optim.AdamW(fused=True)`` on the same unit: the BF16
gradient copied into a preallocated FP32 buffer (the fused kernel wants FP32
gradients like its parameters), the step, then a separate BF16 copy.

Each contender gets its own unit (master, state, BF16 copy), all alive at once
(8 to 18 bytes per parameter each, about 15 GB in all at 233M), and one warm-up update;
then --repeat rounds time one update of every contender in turn, so a change
of background load hits them all alike. Prints one JSON line:
``<contender>_gparams_s`` (G parameters per second, median over the rounds),
``layer_adam_cpp_over_baseline``, ``<driver>_cpp_over_torch`` (each fused
kernel against its own torch path), ``adamw_8bit_cpp_over_layer_adam_cpp``,
``adamw_fp8_cpp_over_layer_adam_cpp`` and ``adamw_fp8_cpp_over_adamw_8bit_cpp``
(the fused kernels against each other, measured in the same rounds).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from statistics import median

import torch

from slidekit import Plugins
from slidekit.interfaces import OptimizerHyper, ParamGroupRange

Step = Callable[[], None]

#: Drivers with a fused C++ kernel and a pure-torch path, switched by ``impl``: both are measured.
_TWO_PATHS = ("layer_adam", "adamw_8bit", "adamw_fp8")


def _driver_step(opt, grad: torch.Tensor, groups: list[ParamGroupRange]) -> Step:
    """One update of a fresh unit by an optimizer driver, as the engine calls it."""
    n = grad.numel()
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    state = {k: torch.zeros(c, dtype=dt) for k, (dt, c) in opt.state_layout(n).items()}
    lowp = torch.empty(n, dtype=torch.bfloat16)
    count = 0

    def step() -> None:
        nonlocal count
        count += 1
        opt.step(master, grad, state, lr=1e-4, count=count, groups=groups, lowp_out=lowp)

    return step


def _baseline_step(grad: torch.Tensor) -> Step:
    """torch.optim.AdamW(fused=True) on a fresh unit, with the gradient upcast and the BF16 copy."""
    n = grad.numel()
    param = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(1)))
    grad32 = torch.empty(n)
    param.grad = grad32
    fused = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.1, fused=True)
    lowp = torch.empty(n, dtype=torch.bfloat16)

    def step() -> None:
        grad32.copy_(grad)  # BF16 -> FP32
        fused.step()
        lowp.copy_(param.detach())

    return step


def _rates(steps: dict[str, Step], n: int, repeat: int) -> dict[str, float]:
    """G parameters per second of each step: median over ``repeat`` interleaved rounds."""
    for step in steps.values():
        step()  # warm-up: first touch of the state, kernel caches
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeat):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return {name: n / median(ts) / 1e9 for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=2_000_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.numel
    grad = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    hyper = OptimizerHyper(weight_decay=0.1)
    groups = [ParamGroupRange(start=0, stop=n, weight_decay=0.1)]

    steps: dict[str, Step] = {}
    for reg in Plugins().drivers("optimizer"):
        if reg.name in _TWO_PATHS:
            for impl in ("cpp", "torch"):  # the factory builds or loads the kernel here, untimed
                steps[f"{reg.name}_{impl}"] = _driver_step(
                    reg.descriptor.factory(hyper, impl=impl), grad, groups
                )
        else:
            steps[reg.name] = _driver_step(reg.descriptor.factory(hyper), grad, groups)
    steps["torch_fused_adamw_plus_copy"] = _baseline_step(grad)
    rates = _rates(steps, n, args.repeat)

    out: dict[str, object] = {
        "numel": n,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "repeat": args.repeat,
    }
    out |= {f"{name}_gparams_s": round(rate, 3) for name, rate in rates.items()}
    if "layer_adam_cpp" in rates:
        out["layer_adam_cpp_over_baseline"] = round(
            rates["layer_adam_cpp"] / rates["torch_fused_adamw_plus_copy"], 2
        )
    for name in _TWO_PATHS:
        if f"{name}_cpp" in rates:
            out[f"{name}_cpp_over_torch"] = round(rates[f"{name}_cpp"] / rates[f"{name}_torch"], 2)
    for a, b in (("adamw_8bit", "layer_adam"), ("adamw_fp8", "layer_adam"), ("adamw_fp8", "adamw_8bit")):
        if f"{a}_cpp" in rates and f"{b}_cpp" in rates:
            out[f"{a}_cpp_over_{b}_cpp"] = round(rates[f"{a}_cpp"] / rates[f"{b}_cpp"], 2)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
