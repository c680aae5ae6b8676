"""What every alternative in slidekit/tools/baselines shares: options, the model, the tokens, timing, the JSON lines.

Each baseline script is standalone::

    python slidekit/tools/baselines/no_offload.py --model tiny --device cpu --batch 2,3 --seq 64

and ``slidekit bench`` runs it once per model with all its batch sizes. The flow of one run:

1. (torchao, DeepSpeed) the host-RAM guard, before their package is imported or anything is
   built: they keep FP32 masters and Adam state in host RAM, ``HOST_BYTES_PER_PARAM`` x the
   preset's parameter count + ``HOST_HEADROOM_GIB``; above ``MemAvailable`` of /proc/meminfo
   every batch is reported "unavailable" with both numbers and the run exits 0 without
   allocating (``--force`` skips it). A model that does not fit would otherwise take the whole
   machine down with the OOM killer.
2. The model (and optimizer) is built ONCE; its time is ``setup_s`` of every record, shared by
   the batches listed in ``setup_shared_by``.
3. For each ``--batch`` in order: free cached GPU memory (``gc.collect``, ``empty_cache``),
   reset the peak GPU counter and the peak RSS (``slidekit.telemetry.reset_peak_rss``; where
   that is impossible ``peak_rss_scope`` is "process" instead of "batch"), run ``--warmup``
   untimed and ``--steps`` timed steps, and print that batch's JSON line at once (flushed), so a
   run killed later keeps the batches it finished. Out of GPU memory at one batch prints that
   batch's "does not fit in GPU memory" line, frees the memory and goes on with the next batch
   (unless the script says its state cannot be reused, as DeepSpeed's does).

Every line is one record with ``system``, ``status`` and ``batch``:

- ``status: "ok"`` with the metrics of ``slidekit.tools.bench.throughput`` (the timed steps' seconds,
  their median, tokens/s, model TFLOPS with slidekit's parameter count of the same preset),
  ``peak_gpu_gib`` and ``peak_host_rss_gib`` of this batch (``peak_rss_scope``), ``wall_s`` (this
  batch's seconds, warm-up included), ``setup_s``; or
- ``status: "unavailable"`` and a ``reason`` (a package missing, no CUDA, too little host RAM,
  out of GPU memory).

The model is the preset's transformers model (``AutoModelForCausalLM.from_config``,
random init on the target device, sdpa attention, gradient checkpointing,
no KV cache). The tokens are ``slidekit.tools.bench.synthetic_tokens``, the same
rows slidekit trains on (a fresh generator per batch, so each batch sees the
rows a separate run would); the loss is transformers' own (full logits,
upcast to FP32), with ``shift_labels`` so the targets are exactly slidekit's.
Later batches go on training the weights the earlier ones updated, so only
the first batch's losses start from the random init; the work per step, and
so the throughput, does not depend on the weights' values.

Test: ``pytest tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import torch

from slidekit.telemetry import proc_sizes, reset_peak_rss
from slidekit.tools.bench import (
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
AfterOOM = Callable[[int], str | None]  # (the batch) cleans up after an OOM; a reason stops the rest

_GIB = float(2**30)

# ---------------------------------------------------------------------------- the host-RAM guard

#: Peak host RSS per parameter of the alternatives that keep the FP32 masters, the gradients' host
#: copies and the Adam moments in host RAM: (bytes per parameter, where it was measured).
HOST_BYTES_PER_PARAM: dict[str, tuple[float, str]] = {
    # 58.0 GiB peak RSS for 3.09 B parameters, on the H200 machine (2026-11-29, batches 8-32, seq 1024):
    # docs/benchmarks/raw/2026-11-29-s2/bench_3b.jsonl.
    "torchao": (20.2, "measured at Qwen2.5-3B"),
    # ZeRO-2 with the optimizer offloaded: 71 GB for 3.09 B parameters, the reference figures
    # for the H200 machine (not yet measured by this script).
    "deepspeed": (23.0, "the reference figure at Qwen2.5-3B"),
}
#: Added to the estimate: the interpreter, torch, CUDA's host allocations, the tokens.
HOST_HEADROOM_GIB = 2.0


def mem_available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is no such file)."""
    return proc_sizes("/proc/meminfo").get("MemAvailable")


def host_ram_shortfall(system: str, model: str, available: int | None) -> str | None:
    """Why ``system`` cannot train ``model`` in ``available`` bytes of host RAM, or None if it can (or if
    nobody knows: no estimate for ``system``, or no MemAvailable)."""
    if system not in HOST_BYTES_PER_PARAM or available is None:
        return None
    per_param, where = HOST_BYTES_PER_PARAM[system]
    need_gib = per_param * arch_spec(model).num_params / _GIB + HOST_HEADROOM_GIB
    have_gib = available / _GIB
    if need_gib <= have_gib:
        return None
    return (
        f"needs ~{need_gib:.0f} GiB of host RAM ({per_param:g} B/param, {where}) but {have_gib:.0f} GiB "
        "is available; pass --force to run it anyway"
    )


def check_host_ram(system: str, args: argparse.Namespace) -> None:
    """Report every batch "unavailable" and exit 0 if ``system`` would exhaust host RAM (not with --force)."""
    if getattr(args, "force", False):
        return
    reason = host_ram_shortfall(system, args.model, mem_available_bytes())
    if reason is not None:
        unavailable(system, reason, args.batch)


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


def parser(description: str, *, host_ram_guard: bool = False) -> argparse.ArgumentParser:
    """The options every baseline takes (``--force`` only where the host-RAM guard applies)."""
    p = argparse.ArgumentParser(description=description.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=batch_sizes, default=[8], help="batch sizes, e.g. 8,16,32 (in this order)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed steps per batch (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, per batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--lr", type=float, default=1e-5)
    if host_ram_guard:
        p.add_argument(
            "--force", action="store_true", help="skip the host-RAM guard (the machine may run out of RAM)"
        )
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


def _oom_reason(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "CUDA out of memory"
    return f"does not fit in GPU memory ({first[:200]})"


@contextlib.contextmanager
def fits(system: str, batches: Sequence[int]) -> Iterator[None]:
    """Out of GPU memory while building becomes the result "does not fit" for every batch."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        unavailable(system, _oom_reason(exc), batches)


# ---------------------------------------------------------------------------- model, steps, batches


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


def free_memory(device: torch.device) -> None:
    """Drop unreachable objects and give cached GPU blocks back, so the next batch starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure(
    system: str, args: argparse.Namespace, batch: int, device: torch.device, step: Step, **extra: Any
) -> dict[str, Any]:
    """Run ``args.warmup`` untimed then ``args.steps`` timed steps of ``batch`` rows; the record.

    The caller has reset the peaks; the record's peaks are those since then.
    """
    t_batch = time.perf_counter()
    spec = arch_spec(args.model, args.seq)
    data = synthetic_tokens(spec.vocab_size, batch, args.seq, args.seed)
    cuda = device.type == "cuda"
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
    return {
        **run_header(system, argparse.Namespace(**{**vars(args), "batch": batch}), device),
        **throughput(spec, batch, args.seq, seconds),
        "peak_gpu_gib": peak_gpu_gib(device),
        "peak_host_rss_gib": peak_rss_gib(),
        **extra,
        "wall_s": round(time.perf_counter() - t_batch, 2),
        "losses": losses,
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
            oom = _oom_reason(exc)  # the traceback (and the batch's tensors) go when this block ends
        if oom is not None:
            emit(unavailable_record(system, batch, oom))
            free_memory(device)
            stop = after_oom(batch)
            free_memory(device)
