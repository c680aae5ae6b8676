"""The command line: ``slidekit plugins``, ``build``, ``finetune``, ``plan`` and ``report``.

    slidekit plugins                 # every driver, available or not, and why
    slidekit build                   # compile the fused CPU optimizer kernels now, not on first use
    slidekit finetune                # fine-tune the embedded demo model on the sample corpus
    slidekit finetune --model DIR --data FILE.jsonl --steps 500 --lr 2e-5
    slidekit finetune --config run.toml --lr 1e-5       # a TOML file, with flags taking precedence
    slidekit finetune --learning-rate 1e-5 --max-steps 500 --output-dir runs/a   # HF's names work too
    slidekit finetune --resume runs/a --keep 5          # continue runs/a with its saved config.json
    slidekit plan --model DIR --batch-size 16 --seq-len 1024   # memory needed, fits or not, best placement
    slidekit finetune --run-dir runs/a --trace runs/a/trace.json   # metrics and a Chrome trace
    slidekit report runs/a                              # loss curve and pipeline timeline -> runs/a/report.png

Every option of ``finetune`` maps onto one field of ``slidekit.config``
(``FLAGS`` below); a ``--config`` file (TOML, or JSON such as a run's saved
``config.json``) has the same shape as ``TrainConfig.to_dict()``.
``slidekit.cli_options`` makes the options: defaults in ``--help``, the names
transformers' ``TrainingArguments`` uses (``ALIASES``), "did you mean" for an
unknown one. ``--resume RUN_DIR`` restores a run's saved configuration, with
the flags changing what a resume may change (``slidekit.resume_config``).
``tests/test_cli.py`` pins the option names.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slidekit.cli_options import OptionParser, add_flags, given_values
from slidekit.config import TrainConfig, from_dict
from slidekit.errors import ConfigError, SlidekitError

if TYPE_CHECKING:
    from slidekit.plugins import Plugins

__all__ = ["FLAGS", "build_parser", "config_from_args", "finetune", "main", "rescue_dir"]

#: flag -> (dotted TrainConfig field, type, "flag", "noflag" or "optional" (a flag that may take a value),
#: help). Defaults come from slidekit.config.
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--model": ("model.source", str, "local Hugging Face model directory, or 'demo'"),
    "--random-init": ("model.random_init", "flag", "start from random weights (config.json only)"),
    "--tokenizer": ("model.tokenizer", str, "tokenizer directory"),
    "--data": (
        "data.path",
        str,
        "JSONL file (text, prompt/completion, chat, ShareGPT or Alpaca records), a save_to_disk directory, "
        "a .parquet/.csv/.json file, or hf:NAME[:CONFIG] from the local HF cache (default: sample corpus)",
    ),
    "--data-format": ("data.format", str, "auto, text, prompt_completion, chat, sharegpt or alpaca"),
    "--data-split": ("data.split", str, "split of a dataset with splits (default: train)"),
    "--data-columns": (
        "data.columns",
        str,
        "record fields read from other columns: 'text=body,prompt=question' (default: none)",
    ),
    "--completion-only": ("data.completion_only", "flag", "loss only on completions / assistant turns"),
    "--no-packing": ("data.packing", "noflag", "one padded document per row instead of packed rows"),
    "--eval-fraction": ("data.eval_fraction", float, "fraction of documents held out for the eval loss"),
    "--eval-every": ("data.eval_every", int, "steps between evaluations (0: at the end)"),
    "--seq-len": ("data.seq_len", int, "tokens per row"),
    "--batch-size": ("data.batch_size", int, "rows per micro-batch"),
    "--grad-accum": ("grad_accum", int, "micro-batches per optimizer step"),
    "--steps": ("steps", int, "optimizer steps"),
    "--epochs": (
        "epochs",
        float,
        "passes over the training data: ceil(epochs x steps per epoch) steps; --steps wins",
    ),
    "--seed": ("seed", int, "data-order seed"),
    "--optimizer": ("optim.name", str, "optimizer driver"),
    "--lr": ("optim.lr", float, "peak learning rate (default: 2e-3 for the demo model, 2e-5 otherwise)"),
    "--schedule": ("optim.schedule", str, "constant, linear or cosine"),
    "--warmup-steps": ("optim.warmup_steps", int, "linear warm-up steps"),
    "--warmup-ratio": ("optim.warmup_ratio", float, "linear warm-up over this fraction of the steps"),
    "--weight-decay": ("optim.weight_decay", float, "decoupled weight decay (not on norms and biases)"),
    "--max-grad-norm": ("optim.max_grad_norm", float, "clip the global gradient norm"),
    "--on-nonfinite": ("optim.on_nonfinite", str, "stop or skip a step with NaN/Inf loss or gradients"),
    "--clip-overlap": (
        "optim.clip_overlap",
        str,
        "clipped steps: auto, speculate (update during the backward, roll back a step that clips) or defer",
    ),
    "--device": ("engine.device", str, "auto, cpu, cuda or cuda:N"),
    "--dtype": ("engine.compute_dtype", str, "auto, float32 or bfloat16"),
    "--kernels": ("engine.kernels", str, "kernel-set driver, or auto"),
    "--state-tier": ("engine.state_tier", str, "tier for optimizer state"),
    "--state-offload-tier": ("engine.state_offload_tier", str, "a second tier for part of the state"),
    "--state-offload-fraction": ("engine.state_offload_fraction", float, "fraction of units on that tier"),
    "--activation-tier": (
        "engine.activation_tier",
        str,
        "where boundary activations go: auto (the GPU where the placement fits, else RAM, else disk), device "
        "or a tier",
    ),
    "--offload-dir": ("engine.offload_dir", str, "directory for file-backed tiers"),
    "--window": ("engine.window", int, "cache units taking turns on the device"),
    "--gpu-resident": ("engine.gpu_resident", str, "units kept on the GPU: auto, none, all or a fraction"),
    "--recompute": ("engine.recompute", str, "layers recomputed in the backward: auto, all or none"),
    "--resident-weights": (
        "engine.resident_weights",
        str,
        "units on the GPU keep their BF16 weights (keep), slide them through the window (slide), or auto (keep "
        "where that fits and is not predicted slower)",
    ),
    "--upload-copy": (
        "engine.upload_copy",
        str,
        "off or on: host units keep a BF16 copy of their weights, written by their update, and upload it "
        "(2 B/param over the bus instead of 4; needs --dtype bfloat16)",
    ),
    "--update-order": (
        "engine.update_order",
        str,
        "host updates of an unclipped step: arrival (as gradients come down), forward (in the next forward's "
        "order, 2 B/param more host RAM), or auto",
    ),
    "--run-dir": ("run.dir", str, "run directory: checkpoints, metrics.jsonl, config.json"),
    "--checkpoint-every": ("run.checkpoint_every", int, "steps between checkpoints (0: at the end only)"),
    "--keep": ("run.keep", int, "checkpoints to keep"),
    "--resume": (
        "run.resume",
        "optional",
        "continue a run: --resume RUN_DIR restores its saved config.json (flags change what a resume may), "
        "from its newest intact checkpoint; with --run-dir: its newest intact checkpoint, --resume STEP or "
        "--resume PATH",
    ),
    "--export": ("run.export_dir", str, "write the fine-tuned model here as a Hugging Face directory"),
    "--export-dtype": ("run.export_dtype", str, "bfloat16, float16 or float32"),
    "--overwrite": (
        "run.overwrite",
        "flag",
        "discard a previous run in --run-dir (without --resume) and replace a previous slidekit export in "
        "--export; files slidekit did not write are never touched",
    ),
    "--trace": ("run.trace", str, "write a Chrome trace of the pipeline (open in Perfetto)"),
    "--report-to": (
        "run.report_to",
        str,
        "loggers of the metrics: none, tensorboard, wandb or all, or several, comma-separated (in --run-dir)",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OptionParser(
        prog="slidekit",
        description="Full-parameter LLM fine-tuning on one GPU, with the model sliding through it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # unknown options get a "did you mean" from their command's options

    p = sub.add_parser("plugins", help="list every storage tier, optimizer, kernel set and model adapter")
    p.add_argument(
        "--block", action="append", default=[], metavar="NAME", help="plugin to leave out (repeatable)"
    )

    k = sub.add_parser(
        "build",
        help="compile ahead of time what drivers build on first use (the fused CPU optimizer kernels)",
    )
    k.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="drivers to prepare (default: every one with something to build)",
    )
    k.add_argument(
        "--block", action="append", default=[], metavar="NAME", help="plugin to leave out (repeatable)"
    )

    # No abbreviations: "--optim" is not silently "--optimizer"; an unknown option gets a "did you mean".
    f = sub.add_parser(
        "finetune", help="fine-tune a model (default: the embedded demo model and corpus)", allow_abbrev=False
    )
    _add_run_options(f)
    f.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "plan",
        help="GPU memory, host RAM and disk a run needs, whether it fits, and the fastest placement that does",
        allow_abbrev=False,
    )
    _add_run_options(p)
    for flag, what in (
        ("--gpu-gib", "GPU memory free"),
        ("--ram-gib", "host RAM available"),
        ("--disk-gib", "disk free"),
    ):
        p.add_argument(
            flag,
            type=float,
            default=None,
            metavar="GIB",
            help=f"plan for this much {what} (what-if; default: this machine's)",
        )
    p.add_argument(
        "--gpu",
        default=None,
        metavar="NAME",
        help="plan for this GPU (a profile: h200, rtx4090; memory and rates), CUDA here or not (what-if)",
    )
    p.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="plan a published model shape (slidekit.tools.presets, e.g. llama-3.1-70b) instead of --model",
    )
    for flag, what, default in (
        ("--nproc-per-node", "data-parallel ranks per host, as for torchrun (they share its RAM and disks)", 1),
        ("--nnodes", "hosts, as for torchrun (the run has nnodes x nproc-per-node ranks)", 1),
        ("--gpus-per-node", "GPUs per host (default: one per rank, or the GPUs this machine has)", None),
    ):
        p.add_argument(flag, type=int, default=default, metavar="N", help=f"{what}; plans rank 0's shards")

    r = sub.add_parser("report", help="draw a run's loss curve and pipeline timeline as a PNG")
    r.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a finetune run")
    r.add_argument(
        "--out", default=None, metavar="FILE.png", help="where to write (default RUN_DIR/report.png)"
    )

    from slidekit.tools.bench import add_arguments as add_bench_arguments

    b = sub.add_parser("bench", help="whole-step throughput of slidekit vs HF (+ Liger), torchao and DeepSpeed, in suites per model size")
    add_bench_arguments(b)
    return parser


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options that describe a run (``FLAGS``), shared by ``finetune`` and ``plan``."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="settings file, TOML or JSON (a run's config.json); flags override it (default: none)",
    )
    add_flags(parser, FLAGS)
    parser.add_argument(
        "--block",
        action="append",
        default=None,
        metavar="NAME",
        help="plugin to leave out (repeatable; default: none)",
    )
    parser.add_argument(
        "--plugin-option",
        action="append",
        default=None,
        metavar="DRIVER.KEY=VALUE",
        help="a driver's setting, e.g. my_tier.queue_depth=8 (repeatable; plugins.options in TOML; default: none)",
    )


def config_from_args(args: argparse.Namespace, notes: list[str] | None = None) -> TrainConfig:
    """The TrainConfig a ``finetune`` command line describes: defaults, then the ``--config`` file, then
    flags; with ``--resume RUN_DIR``, the run's saved configuration instead of the defaults, and the
    changes a resume may make (``slidekit.resume_config``; what it says goes to ``notes``)."""
    from slidekit.resume_config import flatten, resume_source, resumed_config, settings_file
    from slidekit.run import saved_config

    changes: dict[str, Any] = flatten(settings_file(args.config)) if args.config else {}
    changes.update(given_values(args, FLAGS))
    if args.block:
        changes["plugins.block"] = args.block
    restore = resume_source(changes.get("run.resume"), changes.get("run.dir"))
    if args.plugin_option:  # onto the file's driver settings, or (resuming) the saved ones
        saved = (saved_config(restore[0]) or {}).get("plugins", {}) if restore else {}
        base = changes.get("plugins.options", saved.get("options"))
        changes["plugins.options"] = _plugin_options(base, args.plugin_option)
    if restore is not None:
        run_dir, resume = restore
        changes = {k: v for k, v in changes.items() if k not in ("run.dir", "run.resume")}
        config, said = resumed_config(run_dir, changes, resume=resume)
        if notes is not None:
            notes += said
        return config
    values: dict[str, Any] = TrainConfig().to_dict()
    for dotted, value in changes.items():
        section, _, name = dotted.rpartition(".")
        if section and not isinstance(values.get(section), dict):
            values[section] = {}  # an unknown table: from_dict names it
        (values[section] if section else values)[name] = value
    return from_dict(values, where=args.config or "command line")


def _plugin_options(base: Any, given: Sequence[str]) -> dict[str, Any]:
    """Driver settings: ``base`` (plugins.options) with each ``--plugin-option DRIVER.KEY=VALUE`` set."""
    from slidekit.plugins import parse_plugin_option

    if not isinstance(base, Mapping | None) or not all(isinstance(t, Mapping) for t in (base or {}).values()):
        raise ConfigError(f"plugins.options must be a table of driver settings, got {base!r}")
    options = {driver: dict(table) for driver, table in (base or {}).items()}
    for text in given:
        driver, key, value = parse_plugin_option(text)
        options[driver] = {**options.get(driver, {}), key: value}
    return options


def _plugins(args: argparse.Namespace) -> int:
    from slidekit.plugins import Plugins

    with warnings.catch_warnings():  # a plugin left out is a row of the table, not a warning as well
        warnings.filterwarnings("ignore", r"plugin '.*' is left out", RuntimeWarning)
        plugins = Plugins(block=args.block)
        rows = plugins.listing()
    header = ("FAMILY", "NAME", "PLUGIN", "STATUS", "PRIORITY", "DEVICES", "DETAIL")
    table: list[tuple[str, ...]] = [header]
    for r in rows:
        priority = "-" if r["priority"] is None else str(r["priority"])
        detail = r["reason"] + (f"; settings: {', '.join(r['options'])}" if r["options"] else "")
        table.append(
            (r["family"], r["name"], r["plugin"], r["status"], priority, r["devices"] or "-", detail)
        )
    _print_table(table)
    return 0


def _print_table(table: Sequence[Sequence[str]]) -> None:
    """Rows in aligned columns; the last column, free text, is not padded."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])


def _build(args: argparse.Namespace) -> int:
    """Prepare the drivers; exit status 1 when any requested preparation fails."""
    from slidekit.plugins import Plugins
    from slidekit.prepare import STATUSES, prepare_drivers

    outcomes = prepare_drivers(Plugins(block=args.block), args.names)
    if not outcomes:
        print("nothing to build: no installed driver compiles anything ahead of time")
        return 0
    table = [("FAMILY", "NAME", "STATUS", "SECONDS", "WHERE / WHY")]
    for o in outcomes:
        where = f"{o.location} ({o.detail})" if o.location and o.detail else o.location or o.detail
        table.append((o.family, o.name, o.status, f"{o.seconds:.1f}", where))
    _print_table(table)
    print(", ".join(f"{status} {sum(o.status == status for o in outcomes)}" for status in STATUSES))
    failed = [o for o in outcomes if o.failed]
    for o in failed:
        print(f"slidekit: error: building {o.family} {o.name!r} failed: {o.detail}", file=sys.stderr)
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from slidekit.tools.report import draw_report

    print(f"wrote {draw_report(args.run_dir, args.out)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    """Print the plan; exit status 1 when the requested placement does not fit."""
    import tempfile

    from slidekit.data.configured import planned_steps
    from slidekit.planning import plan_run
    from slidekit.planning.report import RankShare
    from slidekit.planning.what_if import plan_machine

    notes: list[str] = []
    config = config_from_args(args, notes)
    for note in notes:
        print(note)
    with tempfile.TemporaryDirectory(prefix="slidekit-plan-") as tmp:
        name = None
        if args.preset:
            if getattr(args, "model.source") is not None:
                from slidekit.errors import ConfigError

                raise ConfigError("give --model or --preset, not both (--preset plans a published shape)")
            from slidekit.tools.presets import write_config

            write_config(args.preset, Path(tmp), config.data.seq_len)
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, source=tmp))
            name = f"preset {args.preset}"
        config, steps, data = planned_steps(config)  # the Trainer's step count
        machine, gpu = plan_machine(
            config, gpu=args.gpu, gpu_gib=args.gpu_gib, ram_gib=args.ram_gib, disk_gib=args.disk_gib
        )
        ranks = RankShare.of(args.nproc_per_node, args.nnodes, args.gpus_per_node, machine, what_if=gpu is not None)
        report = plan_run(config, machine=machine, gpu=gpu, model_name=name, ranks=ranks)
    print(report.render())
    print(data or f"steps: {steps.describe()}")
    return 0 if report.fits else 1


def _finetune(args: argparse.Namespace) -> int:
    from slidekit.distributed.launch import quiet_unless_rank_zero

    with quiet_unless_rank_zero():  # under torchrun, rank 0 alone prints (slidekit.distributed.launch)
        notes: list[str] = []
        config = config_from_args(args, notes)
        for note in notes:
            print(note, flush=True)
        return finetune(config, progress=not args.quiet)


def finetune(
    config: TrainConfig,
    *,
    progress: bool = False,
    plugins: Plugins | None = None,
    fault_hook: Callable[[str], None] | None = None,
) -> int:
    """``slidekit finetune`` on ``config``: train, then export when the run is complete; the exit status
    (128 + the signal's number for a run a signal stopped). ``plugins`` and ``fault_hook`` go to the
    Trainer (tests inject signals and faults through them).

    With an export and no run directory, the run gets one beside the export target (``rescue_dir``): its
    final checkpoint is written before the export and removed once the export is in place, so an export
    that fails, or a run stopped by a signal, leaves a checkpoint to resume from, and says where.
    """
    from slidekit.distributed.launch import rank_zero
    from slidekit.run import discard_run
    from slidekit.telemetry import loss_summary
    from slidekit.trainer import Trainer

    rescue = rescue_dir(config)
    if rescue is not None:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(rescue)))
    fresh = rescue is not None and not rescue.exists()
    try:
        with Trainer(config, plugins=plugins, progress=progress, fault_hook=fault_hook) as trainer:
            spec = trainer.spec
            print(
                f"model: {config.model.source} ({spec.family}, {spec.num_layers} layers, "
                f"{spec.num_params / 1e6:.2f}M parameters) on {trainer.device}, "
                f"{str(trainer.compute_dtype)[6:]}; drivers: "
                + ", ".join(f"{k}={s.name}" for k, s in trainer.selections.items()),
                flush=True,
            )
            print(trainer.data_summary(), flush=True)
            if rescue is not None:
                print(f"no --run-dir: the final checkpoint goes to {rescue} until the export is written")
            total = trainer.step_count.total
            left = total - trainer.engine.steps_done
            result = trainer.fit()
            exported = _export_after_fit(trainer, config, result)
    except BaseException as exc:
        if fresh and rescue is not None:
            _forget(rescue, mention=str(rescue) not in str(exc))
        raise
    if rescue is not None and exported and rank_zero():  # data-parallel: every rank wrote there, one removes it
        discard_run(rescue, checkpoints=True)
    if result.interrupted:
        print(f"stopped by {result.interrupted} after {len(result.losses)} steps")
    if result.losses:
        print(
            f"done: {len(result.losses)} steps in {result.seconds:.1f}s, {result.tokens_per_s:.0f} tokens/s; "
            + loss_summary(result.losses)
            + (
                f"; clipping: {result.rollbacks} of {result.speculated} speculative steps rolled back"
                if result.speculated
                else ""
            )
        )
    elif left <= 0:
        print(f"nothing left to do: the run already took its {total} steps")
    elif not result.interrupted:
        print("no step was run: the data ran out", file=sys.stderr)
        return 1
    return 128 + signal.Signals[result.interrupted].value if result.interrupted else 0


def rescue_dir(config: TrainConfig) -> Path | None:
    """The run directory ``finetune`` gives a run that exports without one: ``OUT.slidekit-run`` beside OUT."""
    if not config.run.export_dir or config.run.dir:
        return None
    target = Path(os.path.realpath(Path(config.run.export_dir).expanduser()))
    if not target.name:  # the root: refused as a target anyway
        return None
    return target.with_name(f"{target.name}.slidekit-run")


def _export_after_fit(trainer: Any, config: TrainConfig, result: Any) -> bool:
    """Export a run that took all its steps; a partial one never replaces an export. Whether it exported."""
    rc = config.run
    if not rc.export_dir:
        return False
    run = trainer.run
    done, total = trainer.engine.steps_done, trainer.step_count.total
    if result.interrupted or done < total:
        why = f"stopped by {result.interrupted}" if result.interrupted else "the data ran out"
        where = (
            f"; its checkpoint is in {run.checkpoints}: continue with the same command and --run-dir "
            f"{run.path} --resume, which exports when the run completes"
            if run is not None
            else ""
        )
        print(
            f"not exported: the run {why} after step {done} of {total}, and a partial run never "
            f"replaces an export ({rc.export_dir} is left as it was){where}",
            file=sys.stderr,
        )
        return False
    if run is not None:
        print(
            f"the trained model is in the checkpoint {run.last_path}; exporting to {rc.export_dir}",
            flush=True,
        )
    path = trainer.export(rc.export_dir, dtype=rc.export_dtype, overwrite=rc.overwrite)
    print(f"exported the model to {path} ({rc.export_dtype})")
    return True


def _forget(rescue: Path, *, mention: bool) -> None:
    """After a failure: remove the run directory ``finetune`` made, unless it holds a checkpoint (then say so)."""
    from slidekit.run import discard_run

    try:
        if discard_run(rescue, checkpoints=False) or not mention:
            return
    except SlidekitError:
        return
    print(
        f"slidekit: the run's checkpoints are in {rescue}: continue with --run-dir {rescue} --resume",
        file=sys.stderr,
    )


def _attach_negative_numbers(argv: Sequence[str]) -> list[str]:
    """``--lr -1e-3`` as ``--lr=-1e-3``: argparse takes a token like ``-1e-3`` for an option and says
    "expected one argument". A value that is not allowed is then refused by the configuration."""
    out: list[str] = []
    for token in argv:
        previous = out[-1] if out else ""
        if previous.startswith("--") and previous != "--" and "=" not in previous and _negative_number(token):
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def _negative_number(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    args: Any = build_parser().parse_args(_attach_negative_numbers(sys.argv[1:] if argv is None else argv))
    try:
        if args.command == "plugins":
            return _plugins(args)
        if args.command == "build":
            return _build(args)
        if args.command == "report":
            return _report(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "bench":
            from slidekit.tools.bench import run_command

            return run_command(args)
        return _finetune(args)
    except SlidekitError as exc:
        print(f"slidekit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("slidekit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
