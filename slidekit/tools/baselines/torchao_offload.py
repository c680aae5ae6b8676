"""torchao's CPUOffloadOptimizer: FP32 master weights on the GPU, their AdamW step and state on the CPU.

    python -m slidekit.tools.baselines.torchao_offload --model qwen2.5-3b --batch 8,16,32 --seq 1024

The model's FP32 master weights stay on the GPU, forward and backward run under
``torch.autocast(bfloat16)``; ``torchao.optim.CPUOffloadOptimizer`` keeps a
pinned host copy of every parameter with its AdamW state
(``torch.optim.AdamW(fused=True)`` on the CPU), streams each gradient to the host
as backward produces it (``offload_gradients=True`` frees it on the GPU), steps
on the CPU and copies the weights back. All of that lives in host RAM (20.2
bytes per parameter measured at Qwen2.5-3B); a model that exhausts it is killed
by the bench's memory watchdog, which is its result. Needs torchao and a CUDA
device; without either it reports "unavailable" and why. The model and
optimizer are built once and every batch size is measured on them in order,
one JSON line each (see common.py); ``slidekit bench --baselines torchao`` runs it.

``--clip``: the optimizer's API has no clipping, and the device gradients are
gone once offloaded, so the clip goes where the gradients are: after the
backward, wait for the gradient copies (the optimizer's copy stream), then
``torch.nn.utils.clip_grad_norm_`` over the pinned host gradients (and the
device gradients of the small parameters it keeps on the GPU), then step. It
costs what clipping costs there: the CPU steps no longer start while the last
copies are in flight, and one pass over the host gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from slidekit.tools.baselines.common import (
    autocast_step,
    build_model,
    build_once,
    clip,
    cuda_device,
    drop_gradients,
    parser,
    run_batches,
    unavailable,
)

SYSTEM = "torchao"


def clip_offloaded(opt: Any, max_norm: float | None) -> None:
    """Clip the global norm of every gradient ``opt`` (a CPUOffloadOptimizer) will step with."""
    if max_norm is None:
        return
    opt.stream.synchronize()  # every queued device-to-host gradient copy has landed
    host = list(opt.param_d2h_map.values())  # pinned FP32 params, .grad filled by those copies
    kept = [p for group in opt.d_param_groups for p in group["params"] if p.grad is not None]
    clip([*host, *kept], max_norm)


def main() -> None:
    args = parser(__doc__).parse_args()
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError as exc:
        unavailable(SYSTEM, f"torchao is not installed ({exc}); pip install torchao", args.batch)
    device = cuda_device(SYSTEM, args, "torchao's CPUOffloadOptimizer needs a CUDA device")

    def build() -> tuple[torch.nn.Module, Any]:
        model = build_model(args.model, args.seq, device, torch.float32, args.seed)
        opt = CPUOffloadOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            offload_gradients=True,
            fused=True,
            lr=args.lr,
            weight_decay=0.0,
        )
        return model, opt

    (model, opt), setup_s = build_once(SYSTEM, args, build)
    step = autocast_step(model, opt, device, lambda: clip_offloaded(opt, args.clip))
    # After an OOM, drop the device gradients a cut-short backward left. The host copies already queued
    # need nothing: the next backward copies every gradient again and re-queues each parameter.
    after_oom = drop_gradients(opt)
    optimizer = "torchao CPUOffloadOptimizer(torch.optim.AdamW, fused, offload_gradients), FP32 master"
    if args.clip is not None:
        optimizer += "; clip_grad_norm_ over the host gradients after their copies"
    run_batches(SYSTEM, args, device, step, setup_s=setup_s, after_oom=after_oom, optimizer=optimizer)


if __name__ == "__main__":
    main()
