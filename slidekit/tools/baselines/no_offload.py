"""No offload, plain Hugging Face: the whole training state on the GPU, gradient checkpointing, no fused kernels.

    python -m slidekit.tools.baselines.no_offload --model qwen2.5-3b --batch 8,16,32 --seq 1024
    python -m slidekit.tools.baselines.no_offload --model tiny --device cpu --batch 2,3 --seq 64   # anywhere

FP32 master weights on the device, forward and backward under
``torch.autocast(bfloat16)``, ``torch.optim.AdamW(fused=True)``: 16 bytes per
parameter (weights, gradients, two moments) plus activations, with gradient
checkpointing and transformers' own loss (the full logits, upcast to FP32).
``--clip`` clips with ``torch.nn.utils.clip_grad_norm_`` before each update.
The model and optimizer are built once and every batch size is measured on
them in order, one JSON line each (see common.py). A model that does not
fit reports "does not fit" for every batch; a batch whose activations do not
fit reports it for that batch, and the next batch still runs (the gradients
are dropped first; the optimizer state is only ever created whole or per
parameter, so it stays usable). On the CPU (smoke tests) compute stays FP32,
as slidekit's does there. ``slidekit bench --baselines none`` runs it; the
stronger no-offload recipe, with Liger's kernels, is liger.py.
"""

from __future__ import annotations

import torch

from slidekit.tools.baselines.common import (
    autocast_step,
    build_model,
    build_once,
    clip,
    drop_gradients,
    fused_adamw,
    parser,
    resolve_device,
    run_batches,
)

SYSTEM = "no_offload"


def main() -> None:
    args = parser(__doc__).parse_args()
    device = resolve_device(args.device)

    def build() -> tuple[torch.nn.Module, torch.optim.AdamW]:
        model = build_model(args.model, args.seq, device, torch.float32, args.seed)
        return model, fused_adamw(model, args.lr)

    (model, opt), setup_s = build_once(SYSTEM, args, build)
    step = autocast_step(model, opt, device, lambda: clip(model.parameters(), args.clip))
    optimizer = "torch.optim.AdamW(fused=True), FP32 master, gradient checkpointing"
    run_batches(
        SYSTEM, args, device, step, setup_s=setup_s, after_oom=drop_gradients(opt), optimizer=optimizer
    )


if __name__ == "__main__":
    main()
