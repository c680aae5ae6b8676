"""What every alternative in benchmarks/baselines shares: options, the model, the tokens, timing, the JSON line.

Each baseline script is standalone (``python benchmarks/baselines/no_offload.py --model tiny --device cpu``)
and prints exactly one JSON line, the record ``slidekit bench`` reads:

- ``status: "ok"`` with the metrics of ``slidekit.bench.throughput`` (median timed step, tokens/s,
  model TFLOPS with slidekit's parameter count of the same preset), ``peak_gpu_gib`` and
  ``peak_host_rss_gib`` of this process; or
- ``status: "unavailable"`` and a ``reason`` (a package missing, no CUDA, out of GPU memory).

The model is the preset's transformers model (``AutoModelForCausalLM.from_config``,
random init on the target device, sdpa attention, gradient checkpointing,
no KV cache). The tokens are ``slidekit.bench.synthetic_tokens``, the same
rows slidekit trains on; the loss is transformers' own (full logits,
upcast to FP32), with ``shift_labels`` so the targets are exactly slidekit's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

from slidekit.bench import (
    PRESETS,
    arch_spec,
    hf_config,
    peak_gpu_gib,
    peak_rss_gib,
    run_header,
    synthetic_tokens,
    throughput,
)

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs, labels) -> loss


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--lr", type=float, default=1e-5)
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


def unavailable(system: str, reason: str) -> NoReturn:
    """Report that this alternative cannot run here, and why; exit 0 (it is a result, not a crash)."""
    emit({"system": system, "status": "unavailable", "reason": reason})
    sys.exit(0)


@contextlib.contextmanager
def fits(system: str) -> Iterator[None]:
    """Out of GPU memory anywhere inside becomes the result "does not fit"."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "CUDA out of memory"
        unavailable(system, f"does not fit in GPU memory ({first[:200]})")


def build_model(name: str, seq: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """The preset as a transformers model on ``device`` in ``dtype``, random weights, ready to train."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with device:  # weights are created (and initialised) where they will live
        model = AutoModelForCausalLM.from_config(
            hf_config(name, seq), dtype=dtype, attn_implementation="sdpa"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def loss_of(model: Any, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss with slidekit's targets (``labels`` are already shifted)."""
    return model(input_ids=inputs, labels=labels, shift_labels=labels).loss


def measure(
    system: str, args: argparse.Namespace, device: torch.device, step: Step, **extra: Any
) -> dict[str, Any]:
    """Run ``args.warmup`` untimed then ``args.steps`` timed steps; print and return the record."""
    spec = arch_spec(args.model, args.seq)
    data = synthetic_tokens(spec.vocab_size, args.batch, args.seq, args.seed)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds: list[float] = []
    losses: list[float] = []
    for i in range(args.warmup + args.steps):
        inputs, labels = (t.to(device, non_blocking=True) for t in next(data))
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = float(step(inputs, labels))  # a host read: the step is done on the device
        if cuda:
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
            losses.append(round(loss, 4))
    record = {
        **run_header(system, args, device),
        **throughput(spec, args.batch, args.seq, seconds),
        "peak_gpu_gib": peak_gpu_gib(device),
        "peak_host_rss_gib": peak_rss_gib(),
        **extra,
        "losses": losses,
    }
    emit(record)
    return record
