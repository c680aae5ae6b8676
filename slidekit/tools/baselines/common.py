"""What every alternative in slidekit/tools/baselines shares: options, the model, the tokens, timing, the JSON lines.

Each baseline script is standalone::

    python -m slidekit.tools.baselines.no_offload --model tiny --device cpu --batch 2,3 --seq 64

and ``slidekit bench`` runs it once per (recipe, repeat) with all its batch sizes. The flow of one run:

1. The model (and optimizer) is built ONCE; its time is ``setup_s`` of every record, shared by
   the batches listed in ``setup_shared_by``. Nothing guesses beforehand whether it fits: a model
   that exhausts host RAM is killed by the bench's memory watchdog, and that is its result; one
   that runs out of GPU memory while building reports "does not fit" for every batch.
2. For each ``--batch`` in order: free cached GPU memory (``gc.collect``, ``empty_cache``),
   reset the peak GPU counter and the peak RSS (``slidekit.telemetry.reset_peak_rss``; where
   that is impossible ``peak_rss_scope`` is "process" instead of "batch"), run ``--warmup`` +
   ``--steps`` steps back to back and time them as slidekit's are: whole steps, start to start
   (``loss.item()`` each step, as a training loop logs it; a ``torch.cuda.synchronize`` inside the
   last step's period, so every update is applied and every copy done when it ends); print that
   batch's JSON line at once (flushed), so a run killed later keeps the batches it finished. Out
   of GPU memory at one batch prints that batch's "does not fit in GPU memory: ..." line (the
   failed allocation's size and the free memory, from torch's message), frees the memory and
   goes on with the next batch (unless the script says its state cannot be reused, as
   DeepSpeed's does).

A script says only what its system does differently: how to build the model and optimizer
(``build_once`` times it; ``cuda_device`` refuses a device the system cannot use), and its step
(``autocast_step`` for a torch-style optimizer, with the script's clipping; ``drop_gradients`` is
such an optimizer's clean-up after an OOM). ``run_batches`` does the rest.

Every line is one record with ``system``, ``status`` and ``batch``:

- ``status: "ok"`` with the figures of ``slidekit.tools.bench.records.throughput`` (every timed
  step's seconds, the period, tokens/s, model TFLOPS with slidekit's parameter count of the same
  preset), ``peak_gpu_gib`` and ``peak_host_rss_gib`` of this batch (``peak_rss_scope``),
  ``wall_s`` (this batch's seconds, warm-up included), ``setup_s``, ``max_grad_norm``; or
- ``status: "unavailable"`` and a ``reason`` (a package missing, no CUDA, out of GPU memory).

The model is the preset's transformers model (``AutoModelForCausalLM.from_config``, random init
on the target device, sdpa attention, no KV cache; gradient checkpointing unless the script
turns it off). The tokens are ``slidekit.tools.bench.records.synthetic_tokens``, the same rows
slidekit trains on (a fresh generator per batch, so each batch sees the rows a separate run
would); the loss is transformers' own (full logits, upcast to FP32) unless the script replaces
it, with ``shift_labels`` so the targets are exactly slidekit's. ``--clip`` clips the global
gradient norm before every update (``torch.nn.utils.clip_grad_norm_``, or the system's own way).
Later batches go on training the weights the earlier ones updated, so only the first batch's
losses start from the random init; the work per step, and so the throughput, does not depend on
the weights' values.

Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import torch

from slidekit.telemetry import reset_peak_rss
from slidekit.tools.bench.records import (
    does_not_fit,
    peak_gpu_gib,
    peak_rss_gib,
    run_header,
    synthetic_tokens,
    throughput,
)
from slidekit.tools.presets import PRESETS, arch_spec, hf_config

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, labels) -> loss
AfterOOM = Callable[[int], str | None]  # (the batch) cleans up after an OOM; a reason stops the rest
T = TypeVar("T")

# ---------------------------------------------------------------------------- options and records


def batch_sizes(text: str) -> list[int]:
    """``--batch``: one size or a comma list (``8,16,32``), each positive."""
    try:
        sizes = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes as integers, e.g. 8,16,32") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive batch sizes, e.g. 8,16,32")
    return sizes


def positive(text: str) -> float:
    """``--clip``: a positive max_grad_norm."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give max_grad_norm as a number, e.g. 1.0") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: max_grad_norm must be a positive number, e.g. 1.0")
    return value


def parser(description: str) -> argparse.ArgumentParser:
    """The options every baseline takes."""
    p = argparse.ArgumentParser(description=description.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=batch_sizes, default=[8], help="batch sizes, e.g. 8,16,32 (in this order)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps per batch, after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per batch, back to back")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--clip", type=positive, default=None, help="max_grad_norm (default: no clipping)")
    return p


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def unavailable_record(system: str, batch: int, reason: str) -> dict[str, Any]:
    return {"system": system, "status": "unavailable", "batch": batch, "reason": reason}


def unavailable(system: str, reason: str, batches: Sequence[int]) -> NoReturn:
    """Report that this alternative cannot run here, and why, once per batch; exit 0 (a result)."""
    for batch in batches:
        emit(unavailable_record(system, batch, reason))
    sys.exit(0)


def oom_reason(exc: BaseException, args: argparse.Namespace, batch: int) -> str:
    """A GPU out-of-memory error as the record's reason: size, free memory, and the cause it names."""
    vocab = arch_spec(args.model, args.seq).vocab_size
    return does_not_fit(str(exc), batch=batch, seq=args.seq, vocab=vocab)


@contextlib.contextmanager
def fits(system: str, args: argparse.Namespace) -> Iterator[None]:
    """Out of GPU memory while building becomes the result "does not fit" for every batch."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        unavailable(system, "while building: " + oom_reason(exc, args, args.batch[0]), args.batch)


def cuda_device(system: str, args: argparse.Namespace, needs: str) -> torch.device:
    """``args.device``, which must be a CUDA device; any other ends the run with every batch
    "unavailable" and the reason ``needs`` gives ("torchao's ... needs a CUDA device")."""
    device = resolve_device(args.device)
    if device.type != "cuda":
        unavailable(system, f"{needs}; this run is on {device}", args.batch)
    return device


def build_once(system: str, args: argparse.Namespace, build: Callable[[], T]) -> tuple[T, float]:
    """What ``build()`` returns (the model and its optimizer, once for every batch) and its seconds,
    the ``setup_s`` every record shares; out of GPU memory while building ends the run ``fits`` says."""
    with fits(system, args):
        t0 = time.perf_counter()
        built = build()
        return built, round(time.perf_counter() - t0, 2)


# ---------------------------------------------------------------------------- model, steps, batches


def build_model(
    name: str,
    seq: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    *,
    gradient_checkpointing: bool = True,
) -> Any:
    """The preset as a transformers model on ``device`` in ``dtype``, random weights, ready to train."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:  # weights are created (and initialised) where they will live
        model = AutoModelForCausalLM.from_config(
            hf_config(name, seq), dtype=dtype, attn_implementation="sdpa"
        )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def loss_of(model: Any, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's causal-LM loss with slidekit's targets (``labels`` are already shifted)."""
    return model(input_ids=inputs, labels=labels, shift_labels=labels).loss


def clip(params: Iterable[torch.Tensor], max_norm: float | None) -> None:
    """Clip the global gradient norm of ``params`` to ``max_norm`` (nothing when None)."""
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(params), max_norm)


def fused_adamw(model: Any, lr: float) -> torch.optim.AdamW:
    """The optimizer of the torch recipes: ``torch.optim.AdamW(fused=True)``, no weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)


def autocast_step(model: Any, opt: Any, device: torch.device, clip_grads: Callable[[], None]) -> Step:
    """A step of a recipe with a torch-style optimizer ``opt``: forward under ``torch.autocast(bfloat16)``
    on CUDA (FP32 on the CPU, as slidekit computes there), backward, ``clip_grads()``, ``opt.step()``,
    and the gradients freed (``zero_grad``'s default, set_to_none)."""

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_of(model, inputs, labels)
        loss.backward()
        clip_grads()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def drop_gradients(opt: Any) -> AfterOOM:
    """``after_oom`` of a torch-style optimizer: a backward cut short leaves some gradients behind, and
    ``zero_grad`` drops them; the optimizer state is created whole or per parameter, so it stays usable."""

    def after_oom(batch: int) -> None:
        opt.zero_grad()

    return after_oom


def free_memory(device: torch.device) -> None:
    """Drop unreachable objects and give cached GPU blocks back, so the next batch starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def whole_steps(starts: Sequence[float], end: float) -> list[float]:
    """Start-to-start seconds of each step: step i ends where step i+1 starts, the last at ``end``."""
    return [b - a for a, b in zip(starts, [*starts[1:], end], strict=True)]


def measure(
    system: str, args: argparse.Namespace, batch: int, device: torch.device, step: Step, **extra: Any
) -> dict[str, Any]:
    """Run ``args.warmup`` + ``args.steps`` steps of ``batch`` rows back to back; the record of the timed ones.

    A step starts when its batch is on the device; it ends where the next one starts, the last after a
    device synchronisation (every update applied, every copy done). The caller has reset the peaks.
    """
    t_batch = time.perf_counter()
    spec = arch_spec(args.model, args.seq)
    data = synthetic_tokens(spec.vocab_size, batch, args.seq, args.seed)
    starts: list[float] = []
    losses: list[float] = []
    for _ in range(args.warmup + args.steps):
        inputs, labels = (t.to(device, non_blocking=True) for t in next(data))
        starts.append(time.perf_counter())
        losses.append(float(step(inputs, labels)))  # loss.item(): what a training loop logs every step
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = whole_steps(starts, time.perf_counter())[args.warmup :]
    return {
        **run_header(system, argparse.Namespace(**{**vars(args), "batch": batch}), device),
        **throughput(spec, batch, args.seq, seconds),
        "peak_gpu_gib": peak_gpu_gib(device),
        "peak_host_rss_gib": peak_rss_gib(),
        **extra,
        "wall_s": round(time.perf_counter() - t_batch, 2),
        "losses": [round(x, 4) for x in losses[args.warmup :]],
    }


def run_batches(
    system: str,
    args: argparse.Namespace,
    device: torch.device,
    step: Step,
    *,
    setup_s: float,
    after_oom: AfterOOM,
    before_batch: Callable[[int], None] | None = None,
    **extra: Any,
) -> None:
    """Measure every ``args.batch`` in order on the model built once, printing each batch's line at once.

    ``before_batch(batch)`` runs before a batch's steps; ``after_oom(batch)`` after a batch ran out
    of GPU memory (clear gradients and the like): a reason it returns is given to the remaining
    batches instead of running them.
    """
    shared = {"setup_s": setup_s, "setup_shared_by": list(args.batch)}
    stop: str | None = None
    for batch in args.batch:
        if stop is not None:
            emit(unavailable_record(system, batch, stop))
            continue
        free_memory(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        scope = "batch" if reset_peak_rss() else "process"
        if before_batch is not None:
            before_batch(batch)
        oom = None
        try:
            emit(measure(system, args, batch, device, step, **shared, peak_rss_scope=scope, **extra))
        except torch.OutOfMemoryError as exc:
            oom = oom_reason(
                exc, args, batch
            )  # the traceback (and the batch's tensors) go when this block ends
        if oom is not None:
            emit(unavailable_record(system, batch, oom))
            free_memory(device)
            stop = after_oom(batch)
            free_memory(device)
