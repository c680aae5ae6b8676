"""DeepSpeed ZeRO-Offload: ZeRO-2 with the optimizer state and step on the CPU; or ZeRO-3 partial offload.

    python -m slidekit.tools.baselines.deepspeed_offload --model qwen2.5-3b --batch 8,16,32 --seq 1024
    python -m slidekit.tools.baselines.deepspeed_offload --model qwen2.5-3b --batch 8,32 --offload-ratio 0.5

One process (RANK 0 of WORLD_SIZE 1, set here, on a free local port), or under
``python -m torch.distributed.run --nproc-per-node N`` one rank of N (torchrun's RANK, LOCAL_RANK,
WORLD_SIZE kept; each rank on ``cuda:LOCAL_RANK``, ``--batch`` rows per GPU, ZeRO-2 partitioning
the optimizer state over the ranks; every rank trains the same seeded rows, which costs what
different rows would; rank 0 alone prints, and its records count every rank's tokens), BF16
weights and compute on the GPU, FP32 master partitions and AdamW moments in
pinned host memory, updated by DeepSpeedCPUAdam (its C++ extension is built
on first use with the system compiler and ninja, then cached under
TORCH_EXTENSIONS_DIR; ``slidekit bench`` builds it before its timed runs),
gradient checkpointing. Those host buffers take about 23 bytes per parameter
(the reference figure at Qwen2.5-3B); a model that exhausts host RAM is killed
by the bench's memory watchdog, which is its result. ``--clip`` is DeepSpeed's
own ``gradient_clipping``. Needs deepspeed and a CUDA device; without either,
or if the extension does not build, it reports "unavailable" and why. Prints
one JSON line per batch (see common.py); ``slidekit bench --baselines
deepspeed`` runs it.

``--offload-ratio R`` (system ``deepspeed_partial``) is ZeRO-Offload++'s
partial offload (``offload_optimizer.ratio``, DeepSpeed >= 0.10; in 0.19.8
``deepspeed/runtime/zero/offload_config.py``: "Percentage of offloaded optimizer
states to CPU Adam. Only valid with ZeRO Stage 3", asserted by ``zero/config.py``):
ZeRO stage 3, the optimizer's sub-groups split so that the last R of them have
their FP32 state and step on the CPU (DeepSpeedCPUAdam) and the rest on the GPU
(``zero/stage3.py``, ``subgroup_to_device``). ``slidekit bench`` sets R to 1 -
slidekit's partial residency share, and ``sub_group_size`` is 1e8 elements so
the split is fine-grained (DeepSpeed's default of 1e9 would give a 7B model
only 8 sub-groups).

One engine serves every batch size. The engine's config names a micro batch
size (``train_micro_batch_size_per_gpu``), but nothing the engine allocates is
shaped by it: in DeepSpeed's source (deepspeed/runtime/engine.py,
``DeepSpeedEngine``) it only feeds the data loader ``deepspeed_io`` builds
(not used here), the throughput timer's samples/s log, the random-LTD and
curriculum schedulers (off) and the pipeline engine (not used); ``forward``
passes the inputs to the module whatever their batch; ZeRO's buffers
(partitioned FP32 masters, gradient partitions, reduce buckets of
``reduce_bucket_size`` elements) are sized by the parameters. DeepSpeed's own
``set_train_micro_batch_size`` changes the batch size of a live engine by
rewriting those two config numbers and nothing else; it is called before
each batch here so the engine's bookkeeping matches. Rebuilding the engine
per batch would instead pay the model build and the ~70 GB of pinned host
buffers again, and would hold two sets of them until the old engine's are
freed, which a 128 GB machine cannot.

For the same reason a batch that runs out of GPU memory ends the run: the
error leaves the engine mid-step (gradients partly reduced into ZeRO's
buckets), so the remaining batches are reported "not run" rather than
measured on an engine in an unknown state or on a second one.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
from typing import Any

import torch

from slidekit.tools.baselines.common import (
    build_model,
    build_once,
    cuda_device,
    loss_of,
    parser,
    run_batches,
    unavailable,
)

SYSTEM = "deepspeed"
PARTIAL = "deepspeed_partial"


def ds_config(batch: int, *, clip: float | None = None, offload_ratio: float | None = None) -> dict[str, Any]:
    """BF16 and the optimizer offloaded to pinned CPU memory: ZeRO-2 (all of it), or ZeRO-3 with
    ``offload_ratio`` of its state on the CPU; DeepSpeed's own clipping at ``clip`` (0: none)."""
    zero: dict[str, Any] = {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 200_000_000,
        "allgather_bucket_size": 200_000_000,
    }
    if offload_ratio is not None:
        zero = {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": offload_ratio},
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": 200_000_000,
            "sub_group_size": 100_000_000,
        }
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "gradient_clipping": clip or 0.0,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


def single_process_env() -> None:
    """The environment torch.distributed reads for a world of one process (under torchrun: its own)."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def build_engine(args: Any, device: torch.device, system: str) -> Any:
    """The DeepSpeed engine around the preset model, with DeepSpeedCPUAdam as its optimizer."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    single_process_env()
    if device.type == "cuda":  # set_device needs an index ("cuda" alone has none): LOCAL_RANK's, i.e. 0
        torch.cuda.set_device(
            device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
        )
    deepspeed.init_distributed(verbose=False)
    model = build_model(args.model, args.seq, device, torch.bfloat16, args.seed)
    try:
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=args.lr, weight_decay=0.0, adamw_mode=True)
    except Exception as exc:  # the JIT build of the cpu_adam extension: compiler, headers, ninja
        cause = f" ({type(exc.__cause__).__name__}: {str(exc.__cause__)[-300:]})" if exc.__cause__ else ""
        unavailable(
            system, f"DeepSpeedCPUAdam's C++ extension did not build or load: {exc}{cause}", args.batch
        )
    config = ds_config(args.batch[0], clip=args.clip, offload_ratio=args.offload_ratio)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def join_torchrun() -> None:
    """Under torchrun with WORLD_SIZE > 1: this rank on ``cuda:LOCAL_RANK`` ("cuda" then means it), and
    standard output only on rank 0 (its records count every rank's tokens; lines of N ranks interleave)."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if int(os.environ.get("RANK", "0")) != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  # for the process's life


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the share of the optimizer state on the CPU, strictly between 0 and 1 (e.g. 0.5)"
        )
    return value


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--offload-ratio",
        type=_ratio,
        default=None,
        help="ZeRO-3 partial offload: this share of the optimizer state on the CPU (system deepspeed_partial)",
    )
    args = p.parse_args()
    join_torchrun()
    system = SYSTEM if args.offload_ratio is None else PARTIAL
    os.environ.setdefault("DS_ACCELERATOR", "cuda")  # the wheel was built where no GPU was
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or an error of its own import-time checks
        unavailable(
            system,
            f"deepspeed cannot be imported ({type(exc).__name__}: {exc}); pip install deepspeed",
            args.batch,
        )
    device = cuda_device(system, args, "DeepSpeed ZeRO-Offload needs a CUDA device (NCCL)")
    engine, setup_s = build_once(system, args, lambda: build_engine(args, device, system))

    def set_batch(batch: int) -> None:
        if hasattr(engine, "set_train_micro_batch_size"):  # DeepSpeed's bookkeeping only (see above)
            engine.set_train_micro_batch_size(batch)

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = loss_of(engine, inputs, labels)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def after_oom(batch: int) -> str:
        return (
            f"not run: batch {batch} ran out of GPU memory, which leaves DeepSpeed's engine mid-step; "
            "a second engine would need a second copy of its pinned host buffers (run these batches "
            "on their own: --batch with only them)"
        )

    optimizer = "DeepSpeed ZeRO-2, offload_optimizer cpu (pinned), DeepSpeedCPUAdam, BF16"
    if args.offload_ratio is not None:
        optimizer = (
            f"DeepSpeed ZeRO-3, offload_optimizer cpu ratio {args.offload_ratio:g}, DeepSpeedCPUAdam, BF16"
        )
    if args.clip is not None:
        optimizer += f", gradient_clipping {args.clip:g}"
    run_batches(
        system,
        args,
        device,
        step,
        setup_s=setup_s,
        after_oom=after_oom,
        before_batch=set_batch,
        optimizer=optimizer,
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
