"""Training throughput of slidekit on random-weight models shaped like real ones.

    python benchmarks/train_throughput.py --model qwen2.5-1.5b --batch 8 --seq 1024 --steps 6
    python benchmarks/train_throughput.py --model tiny --device cpu      # a smoke run anywhere

Reports tokens/s, model TFLOPS, peak GPU memory, peak host RSS and the median
seconds each pipeline lane spent per step (fwd/head/bwd compute, h2d, d2h,
update, stall = main thread waiting) as one JSON line per run (and appends it to --out if given). Model FLOPs per step follow
the PaLM convention, recompute not counted: 6 * params * tokens for the
weights plus 12 * layers * (heads * head_dim) * seq_len * tokens for attention.
Synthetic uniform-random tokens; the first --warmup steps are not timed.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from slidekit import Batch, DataConfig, EngineConfig, ModelConfig, OptimConfig, TrainConfig, Trainer

#: Shapes from the published config.json of each model (weights are random here).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 2048,
        "tie_word_embeddings": False,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen2.5-3b": {
        "model_type": "qwen2",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
    },
    "qwen2.5-14b": {
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "rope_theta": 1000000.0,
    },
}


def write_config(name: str, directory: Path, seq: int) -> None:
    from transformers import AutoConfig

    values = dict(PRESETS[name])
    model_type = values.pop("model_type")
    theta = values.pop("rope_theta", 10000.0)
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    values["max_position_embeddings"] = max(seq, 4096)
    AutoConfig.for_model(model_type, **values).save_pretrained(directory)


def synthetic(vocab: int, batch: int, seq: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    while True:
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        yield Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        write_config(args.model, Path(tmp), args.seq)
        cfg = TrainConfig(
            model=ModelConfig(source=tmp, random_init=True),
            data=DataConfig(seq_len=args.seq, batch_size=args.batch),
            optim=OptimConfig(lr=1e-5, name=args.optimizer),
            engine=EngineConfig(
                device=args.device,
                kernels=args.kernels,
                activation_tier=args.activations,
                window=args.window,
                gpu_resident=args.resident,
                state_tier=args.state_tier,
                offload_dir=args.offload_dir,
            ),
            steps=args.steps,
        )
        t0 = time.perf_counter()
        trainer = Trainer(cfg)
        setup_s = time.perf_counter() - t0
        spec = trainer.spec
        resident = f"{len(trainer.engine.window.resident)}/{len(spec.units)}"
        data = synthetic(spec.vocab_size, args.batch, args.seq)
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with trainer:
            trainer.fit(data, steps=args.warmup)
            result = trainer.fit(data, steps=args.steps)
        tokens = args.batch * args.seq
        step_s = sorted(result.step_seconds)[len(result.step_seconds) // 2]
        flops = (
            6 * spec.num_params * tokens
            + 12 * spec.num_layers * spec.num_heads * spec.head_dim * args.seq * tokens
        )
        out = {
            "model": args.model,
            "params": spec.num_params,
            "batch": args.batch,
            "seq": args.seq,
            "device": str(trainer.device),
            "gpu": torch.cuda.get_device_name() if trainer.device.type == "cuda" else None,
            "activations": args.activations,
            "state_tier": args.state_tier,
            "window": args.window,
            "resident_units": resident,
            "kernels": trainer.selections["kernels"].name,
            "setup_s": round(setup_s, 2),
            "median_step_s": round(step_s, 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "model_tflops": round(flops / step_s / 1e12, 2),
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
            if trainer.device.type == "cuda"
            else None,
            "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
            "lanes_s": {
                lane: round(median([t.get(lane, 0.0) for t in result.timings]), 4)
                for lane in sorted({k for t in result.timings for k in t})
            },
            "losses": [round(x, 4) for x in result.losses],
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--kernels", default="auto")
    p.add_argument("--optimizer", default="layer_adam")
    p.add_argument("--activations", default="ram")
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--resident", default="auto", help="engine.gpu_resident: auto, none, all or a fraction")
    p.add_argument("--state-tier", default="ram", help="tier for the optimizer state of host units")
    p.add_argument("--offload-dir", default=None, help="directory for file-backed tiers")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line to this file")
    args = p.parse_args()
    line = json.dumps(run(args))
    print(line, flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
