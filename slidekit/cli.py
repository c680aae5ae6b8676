"""The command line: ``slidekit plugins`` and ``slidekit finetune``.

    slidekit plugins                 # every driver, available or not, and why
    slidekit finetune                # fine-tune the embedded demo model on the sample corpus
    slidekit finetune --model DIR --data FILE.jsonl --steps 500 --lr 2e-5

Every option of ``finetune`` maps onto a field of ``slidekit.config``;
``tests/test_cli.py`` pins the option names.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from slidekit.config import DataConfig, EngineConfig, ModelConfig, OptimConfig, PluginConfig, TrainConfig
from slidekit.errors import SlidekitError

__all__ = ["build_parser", "config_from_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slidekit",
        description="Full-parameter LLM fine-tuning on one GPU, with the model sliding through it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="list every storage tier, optimizer, kernel set and model adapter")
    p.add_argument(
        "--block", action="append", default=[], metavar="NAME", help="plugin to leave out (repeatable)"
    )

    f = sub.add_parser("finetune", help="fine-tune a model (default: the embedded demo model and corpus)")
    defaults = TrainConfig()  # every default comes from slidekit.config
    f.add_argument(
        "--model", default=defaults.model.source, help="local Hugging Face model directory, or 'demo'"
    )
    f.add_argument("--random-init", action="store_true", help="start from random weights (config only)")
    f.add_argument(
        "--data", default=None, help="JSONL file with a 'text' field per line (default: sample corpus)"
    )
    f.add_argument("--seq-len", type=int, default=defaults.data.seq_len)
    f.add_argument("--batch-size", type=int, default=defaults.data.batch_size)
    f.add_argument("--steps", type=int, default=defaults.steps)
    f.add_argument("--seed", type=int, default=defaults.seed)
    f.add_argument("--optimizer", default=defaults.optim.name, help="optimizer driver")
    f.add_argument(
        "--lr",
        type=float,
        default=defaults.optim.lr,
        help="learning rate (default: 2e-3 for the demo model, 2e-5 otherwise)",
    )
    f.add_argument("--weight-decay", type=float, default=defaults.optim.weight_decay)
    f.add_argument("--device", default=defaults.engine.device, help="auto, cpu, cuda or cuda:N")
    f.add_argument("--dtype", default=defaults.engine.compute_dtype, help="auto, float32 or bfloat16")
    f.add_argument("--kernels", default=defaults.engine.kernels, help="kernel-set driver, or auto")
    f.add_argument("--state-tier", default=defaults.engine.state_tier, help="tier for optimizer state")
    f.add_argument(
        "--activation-tier",
        default=defaults.engine.activation_tier,
        help="'device' or a tier name for boundary activations",
    )
    f.add_argument("--offload-dir", default=None, help="directory for file-backed tiers")
    f.add_argument("--window", type=int, default=defaults.engine.window, help="cache units on the device")
    f.add_argument(
        "--block", action="append", default=[], metavar="NAME", help="plugin to leave out (repeatable)"
    )
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig a ``finetune`` command line describes."""
    return TrainConfig(
        model=ModelConfig(source=args.model, random_init=args.random_init),
        data=DataConfig(path=args.data, seq_len=args.seq_len, batch_size=args.batch_size),
        optim=OptimConfig(name=args.optimizer, lr=args.lr, weight_decay=args.weight_decay),
        engine=EngineConfig(
            device=args.device,
            compute_dtype=args.dtype,
            kernels=args.kernels,
            state_tier=args.state_tier,
            activation_tier=args.activation_tier,
            offload_dir=args.offload_dir,
            window=args.window,
        ),
        plugins=PluginConfig(block=tuple(args.block)),
        steps=args.steps,
        seed=args.seed,
    )


def _plugins(args: argparse.Namespace) -> int:
    from slidekit.plugins import Plugins

    rows = Plugins(block=args.block).listing()
    header = ("FAMILY", "NAME", "PLUGIN", "STATUS", "PRIORITY", "DEVICES", "DETAIL")
    table: list[tuple[str, ...]] = [header]
    for r in rows:
        status = "available" if r["available"] else "unavailable"
        table.append(
            (r["family"], r["name"], r["plugin"], status, str(r["priority"]), r["devices"], r["reason"])
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def _finetune(args: argparse.Namespace) -> int:
    from slidekit.trainer import Trainer

    config = config_from_args(args)
    with Trainer(config, progress=not args.quiet) as trainer:
        spec = trainer.spec
        print(
            f"model: {config.model.source} ({spec.family}, {spec.num_layers} layers, "
            f"{spec.num_params / 1e6:.2f}M parameters) on {trainer.device}, {str(trainer.compute_dtype)[6:]}; "
            f"drivers: " + ", ".join(f"{k}={s.name}" for k, s in trainer.selections.items()),
            flush=True,
        )
        result = trainer.fit()
    if not result.losses:
        print("no step was run: the data ran out", file=sys.stderr)
        return 1
    if result.interrupted:
        print(f"stopped by {result.interrupted} after {len(result.losses)} steps")
    head = sum(result.losses[:5]) / min(5, len(result.losses))
    tail = sum(result.losses[-5:]) / min(5, len(result.losses))
    print(
        f"done: {len(result.losses)} steps in {result.seconds:.1f}s, {result.tokens_per_s:.0f} tokens/s; "
        f"loss {head:.3f} -> {tail:.3f} (mean of first and last 5 steps)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    try:
        if args.command == "plugins":
            return _plugins(args)
        return _finetune(args)
    except SlidekitError as exc:
        print(f"slidekit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("slidekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
