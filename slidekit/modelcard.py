"""What an export carries beside the weights: the model card (``README.md``) and the generation config.

``model_card(...)`` returns the card's text: a YAML header the Hugging Face Hub
reads (``base_model`` when the source is a Hub model, ``library_name:
transformers``, ``pipeline_tag``, ``tags``, and the source card's ``license``
and ``language``), then the results (the last step's training loss and the
last evaluation loss, each with its step), the settings that made them
(optimizer and its hyper-parameters, learning-rate schedule, steps, batch,
sequence length, data, precision, drivers, slidekit's version) and, folded,
the run's whole configuration as JSON. The metadata is written with
``huggingface_hub``'s ``ModelCardData``, the Hub's own format.

``extra_files`` says which of them an export writes: the source model's
``generation_config.json`` (copied; a model without one, like the demo, gets
none: transformers derives the same defaults from config.json when it loads)
and the card, except where the export target holds a file of that name that
slidekit did not write (a card the user wrote into a previous export): that
one is kept, with a warning.

``base_model_id`` tells the Hub id of a source model where the path says it
(a Hugging Face cache snapshot, ``.../models--ORG--NAME/snapshots/REV``);
a model anywhere else is named by its directory. ``last_logged`` reads a run
directory's ``metrics.jsonl`` back, for an export after a resume that trained
no step in this process.

Test: ``pytest tests/test_modelcard.py``.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slidekit.config import TrainConfig

__all__ = ["CARD", "GENERATION_CONFIG", "Logged", "base_model_id", "extra_files", "last_logged", "model_card"]

#: The card's file name in the export.
CARD = "README.md"
GENERATION_CONFIG = "generation_config.json"

#: metric -> (step, value) of the last time it was logged; ``loss`` and ``eval_loss`` go in the card.
Logged = Mapping[str, tuple[int, float]]

_HUB_CACHE = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")


def extra_files(
    target: Path, ours: Collection[str], source_dir: Path | None, card: str | None
) -> dict[str, Path | str]:
    """What an export to ``target`` writes beside the model: name -> the file to copy, or the text to write.

    ``ours``: the files of the previous export there (its manifest's). A name ``target`` holds that is not
    among them is the user's: left out, with a warning (the export never replaces it).
    """
    extras: dict[str, Path | str] = {}
    if source_dir is not None and (source_dir / GENERATION_CONFIG).is_file():
        extras[GENERATION_CONFIG] = source_dir / GENERATION_CONFIG
    if card is not None:
        extras[CARD] = card
    for name in list(extras):
        if name not in ours and os.path.lexists(target / name):
            del extras[name]
            warnings.warn(
                f"the export target {str(target)!r} holds a {name} that slidekit did not write: it is kept, "
                f"and this export writes no {name} of its own (move it away to get slidekit's)",
                RuntimeWarning,
                stacklevel=3,
            )
    return extras


def base_model_id(directory: Path | None) -> str | None:
    """``ORG/NAME`` for a model in the Hugging Face cache (``models--ORG--NAME/snapshots/REV``), else None."""
    if directory is None:
        return None
    parts = Path(directory).parts
    for i in range(len(parts) - 2):
        found = _HUB_CACHE.match(parts[i])
        if found and parts[i + 1] == "snapshots":
            return f"{found['org']}/{found['name']}"
    return None


def last_logged(metrics_file: Path, *, upto: int | None = None) -> dict[str, tuple[int, float]]:
    """metric -> (step, value) of its last numeric record in a run's ``metrics.jsonl`` (steps <= ``upto``).

    A missing file gives {}; lines that are not JSON objects with a step (a torn last line) are passed over.
    """
    found: dict[str, tuple[int, float]] = {}
    try:
        lines = metrics_file.read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return found
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or (upto is not None and step > upto):
            continue
        for key in ("loss", "eval_loss"):
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                found[key] = (step, float(value))
    return found


def _source_card(directory: Path | None) -> dict[str, Any]:
    """``license`` and ``language`` of the source model's own card, when it has one that reads."""
    if directory is None or not (directory / CARD).is_file():
        return {}
    from huggingface_hub import ModelCard

    try:
        data = ModelCard.load(directory / CARD, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # a damaged card in the source is no reason to fail the export
        return {}
    return {k: data[k] for k in ("license", "license_name", "license_link", "language") if data.get(k)}


def _metadata(base: str | None, source_dir: Path | None, family: str) -> str:
    from huggingface_hub import ModelCardData

    extra: dict[str, Any] = {"base_model_relation": "finetune"} if base else {}
    data = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["slidekit", "full-fine-tune", family],
        **_source_card(source_dir),
        **extra,
    )
    return data.to_yaml()


def _cell(text: str) -> str:
    """``text`` as one cell of a Markdown table (a '|' in a path would end the cell)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _number(x: float) -> str:
    return f"{x:.4f}" if 1e-3 <= abs(x) < 1e4 else f"{x:.4g}"


def _settings(
    config: TrainConfig, *, step: int, lr: float, drivers: Mapping[str, str], dtype: str, compute_dtype: str
) -> list[tuple[str, str]]:
    """(setting, value) rows of the card's settings table."""
    oc, dc = config.optim, config.data
    hyper = f"betas {oc.betas[0]:g}, {oc.betas[1]:g}; eps {oc.eps:g}; weight decay {oc.weight_decay:g}"
    if oc.weight_decay:
        hyper += f" (not on {', '.join(oc.no_decay)})"
    schedule = f"{lr:g} peak, {oc.schedule}"
    if oc.schedule != "constant":
        schedule += f" decay to {oc.min_lr_ratio:g} x peak"
    schedule += f", {oc.warmup_steps} warm-up step(s)"
    rows_per_step = dc.batch_size * config.grad_accum
    data = dc.path or "slidekit's sample corpus"
    shape = f"format {dc.format}, " + ("packed into rows" if dc.packing else "one padded document per row")
    if dc.completion_only:
        shape += ", loss on completions only"
    rows = [
        ("optimizer", f"{drivers.get('optimizer', oc.name)} ({hyper})"),
        ("learning rate", schedule),
        ("gradient clipping", f"global norm {oc.max_grad_norm:g}" if oc.max_grad_norm else "none"),
        ("steps", str(step) if step == config.steps else f"{step} (of {config.steps} configured)"),
        (
            "batch",
            f"{dc.batch_size} rows x {dc.seq_len} tokens per micro-batch, {config.grad_accum} micro-batch(es) "
            f"per step: {rows_per_step} rows, {rows_per_step * dc.seq_len} tokens per step",
        ),
        ("sequence length", str(dc.seq_len)),
        ("data", f"`{data}` ({shape})"),
        ("held out for evaluation", f"{dc.eval_fraction:g} of the documents" if dc.eval_fraction else "none"),
        ("precision", f"{compute_dtype} compute, FP32 master weights and optimizer; exported as {dtype}"),
        ("drivers", ", ".join(f"{k}={v}" for k, v in drivers.items()) or "-"),
        ("seed", f"{config.seed} (data order)"),
    ]
    epochs = getattr(config, "epochs", None) or getattr(dc, "epochs", None)
    if epochs:
        rows.insert(4, ("epochs", str(epochs)))
    return rows


def model_card(
    config: TrainConfig,
    *,
    title: str,
    family: str,
    source_dir: Path | None,
    step: int,
    lr: float,
    drivers: Mapping[str, str],
    dtype: str,
    compute_dtype: str,
    logged: Logged,
    version: str,
) -> str:
    """The export's README.md: Hub metadata, then the results and the settings of the run at ``step``.

    ``title`` heads the card (the export directory's name); ``family`` is the architecture family;
    ``source_dir`` the model directory trained from (None or the demo model: no base model); ``lr``
    the peak learning rate the run used; ``drivers`` family -> driver name; ``dtype`` the export's and
    ``compute_dtype`` the run's;
    ``logged`` the last ``loss`` and ``eval_loss`` with their steps; ``version`` slidekit's.
    """
    from slidekit.models.loading import DEMO_MODEL

    demo = config.model.source == DEMO_MODEL
    base = None if demo else base_model_id(source_dir)
    if demo:
        origin = "slidekit's embedded demo model"
    elif base:
        origin = f"[{base}](https://huggingface.co/{base})"
    else:
        name = source_dir.name if source_dir else config.model.source
        origin = f"the model in a local directory named `{name}`"
    if config.model.random_init:
        origin = (
            f"randomly initialised weights (seed {config.model.init_seed}) in the architecture of {origin}"
        )
    lines = [
        f"---\n{_metadata(base, None if demo else source_dir, family)}\n---",
        "",
        f"# {title}",
        "",
        f"A full-parameter fine-tune of {origin} ({family}), trained for {step} step(s) with "
        f"slidekit {version}. Load it with "
        "`transformers.AutoModelForCausalLM.from_pretrained`.",
        "",
        "## Results",
        "",
        "| | step | value |",
        "|---|---|---|",
    ]
    names = {"loss": "training loss (the last step's)", "eval_loss": "evaluation loss (held-out documents)"}
    for key, what in names.items():
        if key in logged:
            at, value = logged[key]
            lines.append(f"| {what} | {at} | {_number(value)} |")
    if not any(k in logged for k in names):
        lines.append("| no loss was logged | | |")
    lines += ["", "## Training settings", "", "| setting | value |", "|---|---|"]
    lines += [
        f"| {k} | {_cell(v)} |"
        for k, v in _settings(
            config, step=step, lr=lr, drivers=drivers, dtype=dtype, compute_dtype=compute_dtype
        )
    ]
    lines += [
        "",
        "<details><summary>The whole configuration (slidekit.config.TrainConfig)</summary>",
        "",
        "```json",
        json.dumps(config.to_dict(), indent=2, sort_keys=True),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(lines)
