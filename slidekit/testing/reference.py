"""A plain PyTorch training loop: the reference slidekit's results are compared against.

It trains the Hugging Face transformers implementation of the same model,
on the same batches, with ``torch.optim.AdamW`` (or the optimizer a factory
builds) and the same parameter groups, entirely on one device and with no
offloading, so any difference from slidekit is slidekit's.

Two precisions:

* ``"float32"``: parameters, compute and optimizer in FP32 (exact comparison);
* ``"bfloat16"``: BF16 parameters for compute, FP32 master copies updated by
  AdamW and copied back after each step: ordinary mixed precision, what
  slidekit does with its masters on the host.

Plugin authors: ``reference_run`` is public; compare your optimizer or
kernel set by running slidekit with it and this loop on the same inputs. For
an optimizer, pass ``optimizer=``: a factory that builds the
``torch.optim.Optimizer`` your driver's arithmetic is meant to match from the
parameter groups (each a dict with ``params``, ``lr`` and ``weight_decay``)::

    ref = reference_run(hf_config, init, batches, lr=1e-2,
                        optimizer=lambda groups: torch.optim.SGD(groups, momentum=0.9))

``tests/test_reference_optimizer.py`` checks a momentum-SGD driver that way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slidekit.data import Batch

__all__ = ["OptimizerFactory", "ReferenceResult", "build_hf_model", "reference_run"]

#: Builds the reference's optimizer from its parameter groups (dicts with params, lr and weight_decay).
OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
_BETAS, _EPS = (0.9, 0.999), 1e-8  # AdamW's, as slidekit's OptimConfig


@dataclass(frozen=True, slots=True)
class ReferenceResult:
    losses: list[float]
    state: dict[str, torch.Tensor]  # FP32 parameters after the last step, by Hugging Face name
    grad_norms: list[float]  # global gradient norm of each step, before clipping


def build_hf_model(
    hf_config: Any, state: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> Any:
    """The transformers model for ``hf_config`` holding ``state`` (SDPA attention, no KV cache).

    Built as transformers builds it, so its embedding's ``padding_idx`` is
    ``hf_config.pad_token_id``, the field slidekit's ``ArchSpec.pad_token_id`` comes from.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    real_missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if real_missing or unexpected:
        raise ValueError(f"state does not fit the model: missing {real_missing}, unexpected {unexpected}")
    model.config.use_cache = False
    return model.to(device=device, dtype=dtype).train()


def _groups(
    named: Sequence[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float, no_decay: Sequence[str]
) -> list[dict[str, Any]]:
    decay = [p for n, p in named if not any(n.endswith(s) for s in no_decay)]
    rest = [p for n, p in named if any(n.endswith(s) for s in no_decay)]
    return [
        {"params": decay, "lr": lr, "weight_decay": weight_decay},
        {"params": rest, "lr": lr, "weight_decay": 0.0},
    ]


def _step_loss(model: Any, step: Batch | Sequence[Batch], device: torch.device) -> torch.Tensor:
    """Forward and backward of one step; returns its loss (mean cross-entropy over labelled tokens).

    A Batch is one forward pass. A sequence of Batches (micro-batches, of any
    lengths) is gradient accumulation: each micro-batch's summed loss over the
    step's labelled tokens, backpropagated in turn, as transformers' Trainer
    does with ``num_items_in_batch``.
    """
    if isinstance(step, Batch):
        ids, labels = step.input_ids.to(device), step.labels.to(device)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
        )
        loss.backward()
        return loss.detach()
    labelled = sum(int((b.labels != -100).sum()) for b in step)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for b in step:
        logits = model(input_ids=b.input_ids.to(device)).logits
        part = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            b.labels.to(device).reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (part / labelled).backward()
        total += part.detach()
    return total / labelled


def reference_run(
    hf_config: Any,
    init_state: Mapping[str, torch.Tensor],
    batches: Iterable[Batch | Sequence[Batch]],
    *,
    lr: float,
    betas: tuple[float, float] = _BETAS,
    eps: float = _EPS,
    weight_decay: float = 0.0,
    no_decay: Sequence[str] = ("norm.weight", "bias"),
    precision: str = "float32",
    device: torch.device | str = "cpu",
    lr_factor: Callable[[int], float] | None = None,
    max_grad_norm: float | None = None,
    optimizer: OptimizerFactory | None = None,
) -> ReferenceResult:
    """Train the transformers model on ``batches`` with ``torch.optim.AdamW``; return losses and final state.

    One step per item of ``batches``: a Batch, or a sequence of Batches taken
    as micro-batches (gradient accumulation; they may differ in shape). The
    loss is the mean cross-entropy over the step's labelled tokens (label -100
    is ignored). ``lr_factor(step)`` (1-based) scales ``lr`` per step;
    ``max_grad_norm`` clips with ``torch.nn.utils.clip_grad_norm_`` on the FP32
    (master) gradients before the step. ``grad_norms`` holds the norms before clipping.

    ``optimizer``: build another optimizer instead, ``optimizer(groups)``, from the FP32 (master)
    parameters' groups: the decaying ones with ``weight_decay``, the ``no_decay`` ones with 0, each
    with ``lr`` (set again before every step). ``betas`` and ``eps`` configure AdamW only: give them
    to your factory instead.
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision must be 'float32' or 'bfloat16', got {precision!r}")
    if optimizer is not None and (tuple(betas), eps) != (_BETAS, _EPS):
        raise ValueError(
            f"betas={betas!r} and eps={eps!r} configure the default AdamW, which optimizer= replaces; "
            "pass them to your optimizer factory instead"
        )
    device = torch.device(device)
    dtype = torch.float32 if precision == "float32" else torch.bfloat16
    model = build_hf_model(hf_config, init_state, dtype, device)
    named = [(n, p) for n, p in model.named_parameters()]
    if precision == "float32":
        masters = [p for _, p in named]
        master_named = named
    else:  # FP32 masters beside the BF16 compute copy
        masters = [torch.nn.Parameter(p.detach().float().clone()) for _, p in named]
        master_named = [(n, m) for (n, _), m in zip(named, masters, strict=True)]
    groups = _groups(master_named, lr, weight_decay, no_decay)
    opt: torch.optim.Optimizer
    if optimizer is None:
        opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
    else:
        opt = optimizer(groups)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer(groups) must return a torch.optim.Optimizer, got {opt!r}")
    losses, norms = [], []
    for step, batch in enumerate(batches, 1):
        for group in opt.param_groups:
            group["lr"] = lr * (lr_factor(step) if lr_factor else 1.0)
        losses.append(_step_loss(model, batch, device).item())
        if precision != "float32":
            for (_, p), m in zip(named, masters, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
        grads = [m.grad for m in masters if m.grad is not None]
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)))
        else:
            norms.append(
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            )
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if precision != "float32":
            with torch.no_grad():
                for (_, p), m in zip(named, masters, strict=True):
                    p.copy_(m)
    state = {n: m.detach().float().cpu().clone() for n, m in master_named}
    return ReferenceResult(losses, state, norms)
