"""The sections of a run's configuration that say what trains and how: ``ModelConfig``, ``DataConfig``
(with ``parse_columns``, its columns' command-line spelling), ``OptimConfig`` and ``EngineConfig`` (with
``resident_fraction`` and ``upload_copy_dtype_error``), their choices, and the checks every section shares.

Each section validates itself on construction (see ``slidekit.config``); ``_seed`` and ``_positive`` are
the value checks that the sections of ``slidekit.config.train`` use too.

Test: ``pytest tests/test_config.py``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slidekit.errors import ConfigError
from slidekit.lr_schedule import SCHEDULES
from slidekit.models.overrides import check_values as check_overrides
from slidekit.typecheck import check_types

#: Learning rates used when ``OptimConfig.lr`` is None.
DEMO_LR = 2e-3
DEFAULT_LR = 2e-5

#: The record fields ``DataConfig.columns`` may map to a column of the data (``field=column``).
DATA_FIELDS = ("text", "prompt", "completion", "messages", "conversations", "instruction", "input", "output")

_DTYPES = ("auto", "float32", "bfloat16")
#: ``OptimConfig.clip_overlap``'s choices (``slidekit.engine.speculation`` documents the trade-off).
CLIP_OVERLAP = ("auto", "speculate", "defer")
#: The values of ``engine.resident_weights`` (``slidekit.planning.weights``).
RESIDENT_WEIGHTS = ("keep", "slide", "auto")
#: The values of ``engine.upload_copy`` (``slidekit.engine.host``: the BF16 upload copies).
UPLOAD_COPY = ("off", "on")
#: The values of ``engine.update_order`` (``slidekit.planning.update_order``).
UPDATE_ORDER = ("auto", "arrival", "forward")
_SEED_LIMIT = 2**32  # seeds are in [0, 2**32), the range every generator accepts


def _seed(owner: str, name: str, value: int) -> None:
    if not 0 <= value < _SEED_LIMIT:
        raise ConfigError(f"{owner}.{name} must be an integer in [0, 2**32), got {value!r}")


def _positive(owner: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{owner}.{name} must be {bound}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Which model to fine-tune."""

    source: str = "demo"  # "demo" (embedded tiny Llama-style model) or a local Hugging Face model directory
    random_init: bool = False  # start from random weights instead of the directory's safetensors
    init_seed: int = 0  # seed of the random initialisation
    overrides: Mapping[str, Any] = field(default_factory=dict)  # config.json fields to override
    tokenizer: str | None = None  # directory of the tokenizer; None: the model directory (the demo's own)

    def __post_init__(self) -> None:
        check_types("model", self)
        if not self.source:
            raise ConfigError("model.source is empty; give a model directory or 'demo'")
        if self.tokenizer is not None and not self.tokenizer.strip():
            raise ConfigError("model.tokenizer must be a tokenizer directory, or None for the model's own")
        _seed("model", "init_seed", self.init_seed)
        check_overrides(self.overrides)  # what needs no model; the rest when it loads


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Training data: records (JSONL, or a Hugging Face dataset) packed into fixed-length rows (docs/data.md)."""

    # A JSONL file; a directory saved by datasets' save_to_disk; a .parquet, .csv or .json (array) file;
    # "hf:NAME" (or "hf:NAME:CONFIG") for a dataset in the local Hugging Face cache; None = the sample corpus
    path: str | None = None
    format: str = "auto"  # "auto", "text", "prompt_completion", "chat", "sharegpt" or "alpaca"
    seq_len: int = 128  # tokens per row
    batch_size: int = 8  # rows per micro-batch
    completion_only: bool = False  # loss only on completions / assistant turns
    packing: bool = True  # pack documents into full rows; False: one padded document per row
    eval_fraction: float = 0.0  # fraction of documents held out for the evaluation loss
    eval_every: int = 0  # steps between evaluations (0: only at the end, when eval_fraction > 0)
    seed: int = 0  # seeds the held-out split and, with the run's seed, the batch order
    split: str = "train"  # the split of a dataset with splits (save_to_disk of a DatasetDict, hf:NAME)
    # record field -> the data's column that holds it: a table, or the CLI's "text=body,prompt=question"
    columns: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.columns, str):  # the command line's spelling
            object.__setattr__(self, "columns", parse_columns(self.columns))
        check_types("data", self)
        if not self.split.strip():
            raise ConfigError("data.split must name a split, such as 'train'")
        for key, column in self.columns.items():
            if key not in DATA_FIELDS:
                raise ConfigError(
                    f"data.columns maps {key!r}, which is no record field; the fields are {', '.join(DATA_FIELDS)}"
                )
            if not isinstance(column, str) or not column:
                raise ConfigError(f"data.columns[{key!r}] must name a column, got {column!r}")
        _positive("data", "seq_len", self.seq_len)
        _positive("data", "batch_size", self.batch_size)
        _positive("data", "eval_every", self.eval_every, allow_zero=True)
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"data.eval_fraction must lie in [0, 1), got {self.eval_fraction!r}")
        _seed("data", "seed", self.seed)


def parse_columns(text: str) -> dict[str, str]:
    """``DataConfig.columns`` from its command-line spelling ``field=column,field=column``.

    ``"text=body,prompt=question"`` reads a record's ``text`` from column ``body`` and its ``prompt``
    from ``question``; spaces around names are dropped. An empty string maps nothing."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, column = (s.strip() for s in part.partition("="))
        if not eq or not key or not column:
            raise ConfigError(
                f"data columns {text!r}: {part!r} is not field=column; write e.g. 'text=body,prompt=question'"
            )
        if key in out:
            raise ConfigError(f"data columns {text!r} map {key!r} twice")
        out[key] = column
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimConfig:
    """The optimizer and its hyper-parameters."""

    name: str = "layer_adam"  # optimizer driver
    lr: float | None = None  # peak learning rate; None: 2e-3 for the demo model, 2e-5 otherwise
    schedule: str = "constant"  # "constant", "linear" (decay) or "cosine"; all start with warmup_steps
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many steps
    # ... or over this fraction of the run's steps, rounded up (HF's warmup_ratio); one of the two, not both
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.0  # where linear and cosine decay end, as a fraction of lr
    max_grad_norm: float | None = None  # clip the global norm of the gradients exactly; None: off
    on_nonfinite: str = "stop"  # NaN/Inf loss or gradients: "stop" (raise) or "skip" the step, warning
    # How a step that must see every gradient (clipping, on_nonfinite="skip") overlaps its updates:
    # "speculate" updates host units during the backward as if unclipped, backed up, and rolls back the
    # step that clips (exact; 4 B/param + the state's bytes more host RAM); "defer" queues every update
    # at the step's end; "auto" speculates when host RAM holds the backups, not right after a clipped step.
    clip_overlap: str = "auto"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay
    no_decay: tuple[str, ...] = ("norm.weight", "bias")  # parameter-name suffixes exempt from decay
    threads: int | None = None  # CPU threads for updates; None keeps torch's setting

    def __post_init__(self) -> None:
        check_types("optim", self)
        if self.lr is not None:
            _positive("optim", "lr", self.lr)
        _positive("optim", "eps", self.eps)
        _positive("optim", "weight_decay", self.weight_decay, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.threads is not None:
            _positive("optim", "threads", self.threads)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        _positive("optim", "warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(
                f"optim.warmup_ratio must lie in [0, 1) (a fraction of the run's steps), got {self.warmup_ratio!r}"
            )
        if self.warmup_ratio and self.warmup_steps:
            raise ConfigError(
                f"optim.warmup_steps = {self.warmup_steps} and optim.warmup_ratio = {self.warmup_ratio:g} both "
                "set the warm-up (CLI: --warmup-steps, --warmup-ratio): give one of them"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"optim.min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if self.max_grad_norm is not None:
            _positive("optim", "max_grad_norm", self.max_grad_norm)
        if self.on_nonfinite not in ("stop", "skip"):
            raise ConfigError(f"optim.on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.clip_overlap not in CLIP_OVERLAP:
            raise ConfigError(
                f"optim.clip_overlap must be one of {CLIP_OVERLAP} (CLI: --clip-overlap), got {self.clip_overlap!r}"
            )
        if self.lr is not None and self.lr > 1.0:
            warnings.warn(
                f"optim.lr = {self.lr:g} is far above any usual fine-tuning rate (1e-6 to 1e-3): the run "
                "will most likely diverge; check the value",
                UserWarning,
                stacklevel=3,
            )
        if self.weight_decay > 1.0:
            warnings.warn(
                f"optim.weight_decay = {self.weight_decay:g} is far above usual values (0 to 0.1): each step "
                "shrinks every weight by lr * weight_decay; check the value",
                UserWarning,
                stacklevel=3,
            )

    def warmup(self, total_steps: int) -> int:
        """Warm-up steps of a run of ``total_steps``: ``warmup_steps``, or ``ceil(total_steps * warmup_ratio)``
        (as transformers' ``TrainingArguments.get_warmup_steps``)."""
        return self.warmup_steps or math.ceil(total_steps * self.warmup_ratio)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How the engine runs: device, precision, drivers, window and buffers."""

    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    compute_dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16"
    kernels: str = "auto"  # kernel-set driver, or "auto" for the best available
    state_tier: str = "ram"  # storage tier holding optimizer state
    state_offload_tier: str | None = None  # a second, slower tier for part of the optimizer state
    state_offload_fraction: float = 0.0  # fraction of units whose state goes to state_offload_tier
    state_chunk: int = 1 << 22  # parameters per chunk when state is streamed from a tier that cannot map
    activation_tier: str = "auto"  # where boundary activations go: "device" (where computed), a tier name, or
    # "auto": the device where the placement fits, else the host tier, else the disk tier
    # (slidekit.planning.activations)
    offload_dir: str | None = None  # directory for file-backed tiers
    window: int = 3  # cache units that take turns on the device (a tied embedding adds one)
    gpu_resident: str = "auto"  # units kept on the compute device (the GPU; the CPU takes the same path) with
    # master and state there, updated there: "auto" (what fits on a GPU; nothing on the CPU), "none",
    # "all", or a fraction such as "0.5"; the units left on the host are spread over the backward order
    grad_buffers: int = 2  # shared host gradient buffers
    loss_chunk: int | None = None  # tokens per chunk of the fused linear + cross-entropy; None = auto
    timeout_s: float = 600.0  # a run that makes no progress for this long fails (PipelineStalled), not hangs
    recompute: str = "auto"  # decoder layers recomputed in the backward instead of keeping their activations:
    # "auto" (layers, resident or sliding, keep what the GPU's memory left holds, the last first), "all"
    # (every layer recomputes), "none" (every layer keeps). See slidekit.planning.keeping
    resident_weights: str = "auto"  # what a unit on the device (gpu_resident) holds besides its FP32 master
    # and state: "keep" a compute-dtype copy of its weights and gradients for good, "slide" them through the
    # window (cast there from the master on the device per visit: 4 + state B/param instead of 4 + state + 4),
    # or "auto": "keep" where that fits and is not predicted slower, else as many units on the device as fit
    # at the sliding cost, keeping the copy for as many of those as the memory left holds
    # (slidekit.planning.weights, Planner.weights_layout)
    upload_copy: str = "off"  # "on": every host unit (master in host RAM) keeps a pinned BF16 copy of its
    # weights (2 B/param of host RAM), written by its host update in the same pass, and uploads those bytes as
    # they are (2 B/param over the bus instead of the FP32 master's 4, no device cast); bitwise the same
    # training. Use it where uploads bound the step (forced offload at small batches) and host RAM has the
    # room; not where the host update bounds it (it writes 2 B/param more). Needs compute_dtype "bfloat16".
    # NOTES.md 22
    update_order: str = "auto"  # the order the host updates of a step that does not clip run in: "arrival"
    # (as the gradients come down, through the shared ring of grad_buffers), "forward" (every host unit keeps
    # its gradients in a buffer of its own, 2 B/param more host RAM, and the optimizer takes, of the units whose
    # gradients are down, the one the next forward needs first, so the next forward's uploads overlap the
    # updates still running), or "auto" ("forward" where host RAM holds the buffers and the step-time model,
    # on a GPU with known rates, predicts it faster). Bitwise the same training. NOTES.md 32

    def __post_init__(self) -> None:
        check_types("engine", self)
        if self.compute_dtype not in _DTYPES:
            raise ConfigError(f"engine.compute_dtype must be one of {_DTYPES}, got {self.compute_dtype!r}")
        if self.window < 2:
            raise ConfigError(
                f"engine.window must be >= 2 (one unit computing, one loading), got {self.window}"
            )
        _positive("engine", "grad_buffers", self.grad_buffers)
        _positive("engine", "timeout_s", self.timeout_s)
        if self.loss_chunk is not None:
            _positive("engine", "loss_chunk", self.loss_chunk)
        _positive("engine", "state_chunk", self.state_chunk)
        self.resident_fraction()  # validates gpu_resident
        if self.recompute not in ("auto", "all", "none"):
            raise ConfigError(
                f"engine.recompute (CLI: --recompute) must be 'auto', 'all' or 'none', got {self.recompute!r}"
            )
        if self.resident_weights not in RESIDENT_WEIGHTS:
            raise ConfigError(
                f"engine.resident_weights (CLI: --resident-weights) must be one of {list(RESIDENT_WEIGHTS)}, "
                f"got {self.resident_weights!r}"
            )
        if self.upload_copy not in UPLOAD_COPY:
            raise ConfigError(
                f"engine.upload_copy (CLI: --upload-copy) must be one of {list(UPLOAD_COPY)}, got {self.upload_copy!r}"
            )
        if self.update_order not in UPDATE_ORDER:
            raise ConfigError(
                f"engine.update_order (CLI: --update-order) must be one of {list(UPDATE_ORDER)}, "
                f"got {self.update_order!r}"
            )
        if self.upload_copy == "on" and self.compute_dtype == "float32":
            raise ConfigError(upload_copy_dtype_error("float32"))
        if not 0.0 <= self.state_offload_fraction <= 1.0:
            raise ConfigError(
                f"engine.state_offload_fraction must lie in [0, 1], got {self.state_offload_fraction!r}"
            )
        if self.state_offload_fraction > 0 and not self.state_offload_tier:
            raise ConfigError(
                "engine.state_offload_fraction > 0 needs engine.state_offload_tier (e.g. 'posix' with offload_dir)"
            )

    def resident_fraction(self) -> float | None:
        """``gpu_resident`` as a fraction of units, or None for "auto"."""
        return resident_fraction(self.gpu_resident)


def upload_copy_dtype_error(dtype: str) -> str:
    """The message refusing ``engine.upload_copy="on"`` with compute dtype ``dtype`` (the copy is the BF16
    weights the optimizer kernels write; FP32 training uploads its masters as they are, nothing to halve)."""
    return (
        f"engine.upload_copy='on' keeps BF16 copies of the weights, but the compute dtype is {dtype}: set "
        "engine.compute_dtype='bfloat16' (CLI: --dtype bfloat16), or engine.upload_copy='off' (FP32 compute "
        "uploads the FP32 masters as they are)"
    )


def resident_fraction(gpu_resident: str) -> float | None:
    """An ``engine.gpu_resident`` value as a fraction of units: "none" 0, "all" 1, "auto" None."""
    named = {"auto": None, "none": 0.0, "all": 1.0}
    if gpu_resident in named:
        return named[gpu_resident]
    try:
        value = float(gpu_resident)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ConfigError(
            f"engine.gpu_resident must be 'auto', 'none', 'all' or a fraction in [0, 1], got {gpu_resident!r}"
        )
    return value
