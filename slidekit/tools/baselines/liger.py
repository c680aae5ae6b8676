"""HF + Liger Kernel, no offload: what a TRL or transformers Trainer user gets from ``use_liger_kernel=True``.

    python -m slidekit.tools.baselines.liger --model qwen2.5-3b --batch 8,32 --gradient-checkpointing
    python -m slidekit.tools.baselines.liger --model qwen2.5-3b --batch 8,32          # without checkpointing

The no_offload.py recipe (FP32 master weights and ``torch.optim.AdamW(fused=True)``
on the GPU, forward and backward under ``torch.autocast(bfloat16)``) with the
model patched exactly as the transformers Trainer patches it for
``use_liger_kernel=True``: ``transformers.integrations.liger.apply_liger_kernel``
with no config, i.e. Liger's ``apply_liger_kernel_to_<family>`` defaults for
Llama, Qwen2 and Mistral: RMSNorm, RoPE and SwiGLU as Triton kernels, and the
fused linear cross-entropy that never materialises the logits (no FP32 logits
tensor, the usual cause of "does not fit" at large batches). The record names
the classes the patch left in the first decoder layer, so it shows the patch
took. ``--gradient-checkpointing`` (system ``liger_gc``) recomputes each layer
in the backward pass; without it (system ``liger``) activations are kept.
``--clip`` clips with ``torch.nn.utils.clip_grad_norm_`` before each update.

Needs liger-kernel (``pip install liger-kernel``, or ``slidekit[bench]``) and a
CUDA device: without either every batch is "unavailable" with the reason.
``slidekit bench --baselines liger_gc,liger`` runs it (see common.py).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import sys
from typing import Any

import torch

from slidekit.tools.baselines.common import (
    autocast_step,
    build_model,
    build_once,
    clip,
    cuda_device,
    drop_gradients,
    fused_adamw,
    parser,
    run_batches,
    unavailable,
)

#: What ``apply_liger_kernel_to_<family>`` replaces by default (liger-kernel 0.8): the kernels this recipe uses.
KERNELS = "rope, rms_norm, swiglu, fused_linear_cross_entropy"


def _patched(model: Any) -> dict[str, str]:
    """What the first decoder layer, the rotary function and the forward are after the patch."""
    layer = model.model.layers[0]
    module = sys.modules[type(model).__module__]
    return {
        "mlp": layer.mlp._get_name(),
        "norm": layer.input_layernorm._get_name(),
        "rope": getattr(getattr(module, "apply_rotary_pos_emb", None), "__name__", "?"),
        "forward": getattr(model.forward, "__name__", "?"),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute each layer in the backward pass (system liger_gc; without: liger)",
    )
    args = p.parse_args()
    system = "liger_gc" if args.gradient_checkpointing else "liger"
    if importlib.util.find_spec("liger_kernel") is None:
        unavailable(
            system, "liger-kernel not installed (pip install liger-kernel, or slidekit[bench])", args.batch
        )
    device = cuda_device(system, args, "Liger Kernel's Triton kernels need a CUDA device")
    from transformers.integrations.liger import apply_liger_kernel

    def build() -> tuple[Any, torch.optim.AdamW]:
        model = build_model(
            args.model,
            args.seq,
            device,
            torch.float32,
            args.seed,
            gradient_checkpointing=args.gradient_checkpointing,
        )
        apply_liger_kernel(model, None)  # what Trainer does for use_liger_kernel=True
        return model, fused_adamw(model, args.lr)

    (model, opt), setup_s = build_once(system, args, build)
    step = autocast_step(model, opt, device, lambda: clip(model.parameters(), args.clip))
    run_batches(
        system,
        args,
        device,
        step,
        setup_s=setup_s,
        after_oom=drop_gradients(opt),
        optimizer="torch.optim.AdamW(fused=True), FP32 master"
        + (", gradient checkpointing" if args.gradient_checkpointing else ", no checkpointing"),
        liger=importlib.metadata.version("liger-kernel"),
        liger_kernels=KERNELS,
        patched=_patched(model),
    )


if __name__ == "__main__":
    main()
