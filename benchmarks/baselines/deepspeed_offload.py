"""DeepSpeed ZeRO-Offload: ZeRO stage 2 with the optimizer state and step on the CPU (DeepSpeedCPUAdam).

    python benchmarks/baselines/deepspeed_offload.py --model qwen2.5-3b --batch 8 --seq 1024

One process (RANK 0 of WORLD_SIZE 1, set here, on a free local port), BF16
weights and compute on the GPU, FP32 master partitions and AdamW moments in
pinned host memory, updated by DeepSpeedCPUAdam (its C++ extension is built
on first use with the system compiler and ninja, then cached under
TORCH_EXTENSIONS_DIR), gradient checkpointing. Needs deepspeed and a CUDA
device; without either, or if the extension does not build, it reports
"unavailable" and why. Prints one JSON line (see common.py); ``slidekit bench
--baselines deepspeed`` runs it.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import torch
from common import build_model, fits, loss_of, measure, parser, resolve_device, unavailable

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
        unavailable(SYSTEM, f"DeepSpeedCPUAdam's C++ extension did not build or load: {exc}{cause}")
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(args.batch))
    return engine


def main() -> None:
    args = parser(__doc__).parse_args()
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or an error of its own import-time checks
        unavailable(
            SYSTEM, f"deepspeed cannot be imported ({type(exc).__name__}: {exc}); pip install deepspeed"
        )
    device = resolve_device(args.device)
    if device.type != "cuda":
        unavailable(SYSTEM, f"DeepSpeed ZeRO-Offload needs a CUDA device (NCCL); this run is on {device}")
    with fits(SYSTEM):
        t0 = time.perf_counter()
        engine = build_engine(args, device)
        setup_s = round(time.perf_counter() - t0, 2)

        def step(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            loss = loss_of(engine, inputs, labels)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        optimizer = "DeepSpeed ZeRO-2, offload_optimizer cpu (pinned), DeepSpeedCPUAdam, BF16"
        measure(SYSTEM, args, device, step, setup_s=setup_s, optimizer=optimizer)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
