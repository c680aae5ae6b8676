"""DeepSpeed ZeRO-Offload: ZeRO stage 2 with the optimizer state and step on the CPU (DeepSpeedCPUAdam).

    python slidekit/tools/baselines/deepspeed_offload.py --model qwen2.5-3b --batch 8,16,32 --seq 1024

One process (RANK 0 of WORLD_SIZE 1, set here, on a free local port), BF16
weights and compute on the GPU, FP32 master partitions and AdamW moments in
pinned host memory, updated by DeepSpeedCPUAdam (its C++ extension is built
on first use with the system compiler and ninja, then cached under
TORCH_EXTENSIONS_DIR), gradient checkpointing. Those host buffers take about
23 bytes per parameter (the reference figure at Qwen2.5-3B), so the host-RAM
guard of common.py refuses a model that would not fit, before anything is
built (``--force`` skips it). Needs deepspeed and a CUDA device; without
either, or if the extension does not build, it reports "unavailable" and why.
Prints one JSON line per batch (see common.py); ``slidekit bench --baselines
deepspeed`` runs it.

One engine serves every batch size. The engine's config names a micro batch
size (``train_micro_batch_size_per_gpu``), but nothing the engine allocates is
shaped by it: in DeepSpeed's source (deepspeed/runtime/engine.py,
``DeepSpeedEngine``) it only feeds the data loader ``deepspeed_io`` builds
(not used here), the throughput timer's samples/s log, the random-LTD and
curriculum schedulers (off) and the pipeline engine (not used); ``forward``
passes the inputs to the module whatever their batch; ZeRO-2's buffers
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

import os
import socket
import time
from typing import Any

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

SYSTEM = "deepspeed"


def ds_config(batch: int) -> dict[str, Any]:
    """ZeRO-2, optimizer offloaded to pinned CPU memory, BF16; no clipping, as slidekit's runs have none."""
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "contiguous_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": 200_000_000,
            "allgather_bucket_size": 200_000_000,
        },
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }


def single_process_env() -> None:
    """The environment torch.distributed reads for a world of one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def build_engine(args: Any, device: torch.device) -> Any:
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
            SYSTEM, f"DeepSpeedCPUAdam's C++ extension did not build or load: {exc}{cause}", args.batch
        )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args.batch[0]))
    return engine


def main() -> None:
    args = parser(__doc__, host_ram_guard=True).parse_args()
    check_host_ram(SYSTEM, args)
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or an error of its own import-time checks
        unavailable(
            SYSTEM,
            f"deepspeed cannot be imported ({type(exc).__name__}: {exc}); pip install deepspeed",
            args.batch,
        )
    device = resolve_device(args.device)
    if device.type != "cuda":
        unavailable(
            SYSTEM, f"DeepSpeed ZeRO-Offload needs a CUDA device (NCCL); this run is on {device}", args.batch
        )
    with fits(SYSTEM, args.batch):
        t0 = time.perf_counter()
        engine = build_engine(args, device)
        setup_s = round(time.perf_counter() - t0, 2)

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
    run_batches(
        SYSTEM,
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
