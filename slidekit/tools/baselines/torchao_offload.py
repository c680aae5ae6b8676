"""torchao's CPU-offload optimizer: the step on the CPU, the weights on the GPU.

    python slidekit/tools/baselines/torchao_offload.py --model qwen2.5-3b --batch 8,16,32 --seq 1024

The model's FP32 master weights stay on the GPU, forward and backward run under
``torch.autocast(bfloat16)``; ``torchao.optim.CPUOffloadOptimizer`` keeps a
pinned host copy of every parameter with its AdamW state
(``torch.optim.AdamW(fused=True)`` on the CPU), streams each gradient to the host
as backward produces it (``offload_gradients=True`` frees it on the GPU), steps
on the CPU and copies the weights back. All of that lives in host RAM (20.2
bytes per parameter measured at Qwen2.5-3B), so the host-RAM guard of
common.py refuses a model that would not fit, before anything is built
(``--force`` skips it). Needs torchao and a CUDA device; without either it
reports "unavailable" and why. The model and optimizer are built once and
every batch size is measured on them in order, one JSON line each (see
common.py); ``slidekit bench --baselines torchao`` runs it.
"""

from __future__ import annotations

import time

import torch

from slidekit.tools.baselines.common import (
    build_model,
    check_host_ram,
    fits,
    loss_of,
    parser,
    resolve_device,
    run_batches,
    unavailable,
)

SYSTEM = "torchao"


def main() -> None:
    args = parser(__doc__, host_ram_guard=True).parse_args()
    check_host_ram(SYSTEM, args)
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:
        unavailable(SYSTEM, f"torchao is not installed ({exc}); pip install torchao", args.batch)
    device = resolve_device(args.device)
    if device.type != "cuda":
        unavailable(
            SYSTEM, f"torchao's CPUOffloadOptimizer needs a CUDA device; this run is on {device}", args.batch
        )
    with fits(SYSTEM, args.batch):
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

    def after_oom(batch: int) -> None:
        # Drop the device gradients a cut-short backward left. The host copies already queued need
        # nothing: the next backward copies every gradient again and re-queues each parameter.
        opt.zero_grad()

    optimizer = "torchao CPUOffloadOptimizer(torch.optim.AdamW, fused, offload_gradients), FP32 master"
    run_batches(SYSTEM, args, device, step, setup_s=setup_s, after_oom=after_oom, optimizer=optimizer)


if __name__ == "__main__":
    main()
