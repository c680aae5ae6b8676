"""torchao's CPU-offload optimizer: the step on the CPU, the weights on the GPU.

    python benchmarks/baselines/torchao_offload.py --model qwen2.5-3b --batch 8 --seq 1024

The model's FP32 master weights stay on the GPU, forward and backward run under
``torch.autocast(bfloat16)``; ``torchao.optim.CPUOffloadOptimizer`` keeps a
pinned host copy of every parameter with its AdamW state
(``torch.optim.AdamW(fused=True)`` on the CPU), streams each gradient to the host
as backward produces it (``offload_gradients=True`` frees it on the GPU), steps
on the CPU and copies the weights back. Needs torchao and a CUDA device;
without either it reports "unavailable" and why. Prints one JSON line (see
common.py); ``slidekit bench --baselines torchao`` runs it.
"""

from __future__ import annotations

import time

import torch
from common import build_model, fits, loss_of, measure, parser, resolve_device, unavailable

SYSTEM = "torchao"


def main() -> None:
    args = parser(__doc__).parse_args()
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:
        unavailable(SYSTEM, f"torchao is not installed ({exc}); pip install torchao")
    device = resolve_device(args.device)
    if device.type != "cuda":
        unavailable(SYSTEM, f"torchao's CPUOffloadOptimizer needs a CUDA device; this run is on {device}")
    with fits(SYSTEM):
        t0 = time.perf_counter()
        model = build_model(args.model, args.seq, device, torch.float32, args.seed)
        opt = CPUOffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            offload_gradients=True,
            fused=True,
            lr=args.lr,
            weight_decay=0.0,
        )
        setup_s = round(time.perf_counter() - t0, 2)

        def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(model, inputs, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        optimizer = "torchao CPUOffloadOptimizer(torch.optim.AdamW, fused, offload_gradients), FP32 master"
        measure(SYSTEM, args, device, step, setup_s=setup_s, optimizer=optimizer)


if __name__ == "__main__":
    main()
