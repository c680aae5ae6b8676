"""What a benchmark runs: the alternatives, the suite presets per model size, and their expansion into runs.

A *run* (``RunSpec``) is one child process: one system (a slidekit residency mode, or one
alternative), one recipe (``max_grad_norm`` None or a value), one repeat, all its batch sizes in
order (the model built once for an alternative, a ``Trainer`` per batch for slidekit). A *suite*
(``Suite``) is every run for one model size: slidekit's modes and the alternatives, crossed with
the recipes and the repeats. ``suite_presets.SUITES`` holds the presets ``slidekit bench --suite NAME``
runs; an ad-hoc ``slidekit bench --model ... --resident ... --baselines ...`` is a suite too
(``adhoc_suite``).

Each run has an *importance* (lower = more important): the time plan keeps runs in that order and
leaves out the least important when the budget is short. The rule (``importance``), so every suite
drops the same kinds first:

- 0: slidekit all-resident and forced full offload, HF + Liger with gradient checkpointing (the
  reference of offload efficiency, the case it measures, the strongest usual no-offload recipe);
  0.5: HF + Liger without checkpointing; 1: slidekit's partial share; 3: the planner's auto,
  torchao, DeepSpeed; 3.5: DeepSpeed's partial offload; 4: plain HF (the weak recipe);
- clipping (``max_grad_norm``) adds 1 for slidekit (its clipped runs rank with the partial share:
  clipping defers its host updates, the recipe's own cost), 1.5 for HF + Liger (GC), 2 for plain HF,
  2.5 for HF + Liger without GC and 3 for the offload alternatives (their slow runs go first);
- each further repeat adds 1.2 (the second repeat of the core runs comes before their clipping).

A suite entry may set its own importance (``Mode.importance``, ``Alt.importance``) where the model
makes a kind more or less telling (14B: only the planner's choice and all-state-on-host fit).

*Ranks*: a mode or an alternative with ``ranks`` N > 1 runs data-parallel on N GPUs of the machine
(``python -m torch.distributed.run --standalone --nproc-per-node N``, ``--batch`` per GPU); its label
says "N GPUs", its cost key ends in ``@N``, and its rows carry ``ranks`` N and ``family``, the label
of the same mode on one GPU, which the table's scaling efficiency compares it with.

*Levers*: a mode may set ``recompute`` (``engine.recompute``: "auto", "all", "none") and
``clip_overlap`` (``optim.clip_overlap``: "auto", "speculate", "defer"); each one set is passed to the
child (``--recompute``, ``--clip-overlap``), said in the label ("slidekit (resident all, recompute
all)") and the cost key (``slidekit:all+recompute=all``), and carried by the rows (``levers``). Left
unset (None) the child runs the engine's default and label, key and rows are those of before. A mode
that sets ``clip_overlap`` runs clipped recipes only (the overlap changes nothing else).

Test: ``pytest tests/test_bench_plan.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from slidekit.config import CLIP_OVERLAP
from slidekit.errors import ConfigError

__all__ = [
    "BASELINES",
    "BASELINE_PACKAGE",
    "RECOMPUTE",
    "Alt",
    "Mode",
    "RunSpec",
    "Suite",
    "adhoc_suite",
    "expand",
    "importance",
    "on_gpus",
    "ranked",
    "with_overrides",
]

#: The bundled baseline scripts: modules of this package, run with ``python -m`` (an installed wheel has them).
BASELINE_PACKAGE = "slidekit.tools.baselines"


@dataclass(frozen=True, kw_only=True, slots=True)
class Baseline:
    """One ``--baselines`` name: the system its records carry, its label, its script and fixed flags."""

    system: str
    label: str
    script: str  # a module of slidekit.tools.baselines (or a file of that name in --baselines-dir)
    flags: tuple[str, ...] = ()
    offload: bool = False  # keeps part of the training state on the host (else: everything on the GPU)
    ranks: bool = False  # runs data-parallel under torchrun (``Alt.ranks`` > 1)


#: ``--baselines`` name -> what runs. "none" is plain Hugging Face (no offload, gradient checkpointing).
BASELINES: dict[str, Baseline] = {
    "none": Baseline(system="no_offload", label="HF (GC)", script="no_offload.py"),
    "liger_gc": Baseline(
        system="liger_gc", label="HF + Liger (GC)", script="liger.py", flags=("--gradient-checkpointing",)
    ),
    "liger": Baseline(system="liger", label="HF + Liger (no GC)", script="liger.py"),
    "torchao": Baseline(
        system="torchao", label="torchao CPUOffloadOptimizer", script="torchao_offload.py", offload=True
    ),
    "deepspeed": Baseline(
        system="deepspeed",
        label="DeepSpeed ZeRO-2 Offload",
        script="deepspeed_offload.py",
        offload=True,
        ranks=True,
    ),
    "deepspeed_partial": Baseline(
        system="deepspeed_partial",
        label="DeepSpeed ZeRO-3 partial offload",
        script="deepspeed_offload.py",
        offload=True,
    ),
}

#: The no-offload baselines, strongest first as usually found: "vs best no-offload" takes the fastest that ran.
NO_OFFLOAD = ("liger_gc", "liger", "no_offload")

_BASE = {"all": 0.0, "none": 0.0, "partial": 1.0, "auto": 3.0, "liger_gc": 0.0, "liger": 0.5}
_BASE |= {"torchao": 3.0, "deepspeed": 3.0, "deepspeed_partial": 3.5, "no_offload": 4.0}
_CLIP = {"liger_gc": 1.5, "liger": 2.5, "no_offload": 2.0, "torchao": 3.0, "deepspeed": 3.0, "all": 1.0}
_CLIP |= {"none": 1.0, "partial": 1.0, "auto": 1.0}
_CLIP |= {"deepspeed_partial": 3.0}
_REPEAT = 1.2
#: ``engine.recompute``'s choices (``EngineConfig``), a mode's ``recompute``.
RECOMPUTE = ("auto", "all", "none")


def importance(kind: str, clip: float | None, repeat: int) -> float:
    """The rule of the module docstring: ``kind`` is a slidekit mode kind (all, none, partial, auto) or a
    baseline system."""
    base = _BASE[kind]
    if clip is not None:
        base += _CLIP[kind]
    return base + _REPEAT * (repeat - 1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Mode:
    """One slidekit residency mode of a suite (``engine.gpu_resident``) and what else it changes."""

    resident: str  # "all", "none", "auto" or a fraction
    optimizer: str = "layer_adam"
    state_offload: tuple[str, float] | None = None  # (tier, fraction) of host units' state on that tier
    batches: tuple[int, ...] | None = None  # default: the suite's
    importance: float | None = None  # default: the rule (module docstring)
    clips: tuple[float | None, ...] | None = None  # default: the suite's
    ranks: int = 1  # data-parallel ranks, one GPU each (torchrun --nproc-per-node); --batch is per GPU
    recompute: str | None = None  # engine.recompute (--recompute); None: the engine's default, not passed
    clip_overlap: str | None = None  # optim.clip_overlap (--clip-overlap); None: the default, not passed

    def __post_init__(self) -> None:
        what = f"Mode(resident={self.resident!r})"
        _check_ranks(self.ranks, what)
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise ConfigError(
                f"{what}: recompute={self.recompute!r} is not engine.recompute's; choose from: {', '.join(RECOMPUTE)}"
            )
        if self.clip_overlap is not None and self.clip_overlap not in CLIP_OVERLAP:
            raise ConfigError(
                f"{what}: clip_overlap={self.clip_overlap!r} is not optim.clip_overlap's; choose from: "
                f"{', '.join(CLIP_OVERLAP)}"
            )

    @property
    def kind(self) -> str:
        return self.resident if self.resident in ("all", "none", "auto") else "partial"

    @property
    def levers(self) -> tuple[tuple[str, str], ...]:
        """The levers this mode sets, (name, value) in a fixed order (module docstring)."""
        pairs = (("recompute", self.recompute), ("clip_overlap", self.clip_overlap))
        return tuple((name, value) for name, value in pairs if value is not None)

    @property
    def label(self) -> str:
        extra = [] if self.optimizer == "layer_adam" else [self.optimizer]
        if self.state_offload:
            extra.append(f"{self.state_offload[1]:g} of state on {self.state_offload[0]}")
        extra += [f"{name} {value}" for name, value in self.levers]
        return on_gpus(f"slidekit (resident {', '.join([self.resident, *extra])})", self.ranks)

    @property
    def family(self) -> str:
        """The label of this mode on one GPU (the reference of its scaling efficiency)."""
        return replace(self, ranks=1).label

    @property
    def flags(self) -> tuple[str, ...]:
        """The child's options for this mode (beyond the common ones)."""
        flags: tuple[str, ...] = ("--resident", self.resident, "--optimizer", self.optimizer)
        if self.state_offload:
            flags += ("--state-offload-tier", self.state_offload[0])
            flags += ("--state-offload-fraction", str(self.state_offload[1]))
        for name, value in self.levers:
            flags += (f"--{name.replace('_', '-')}", value)
        return flags

    @property
    def cost_key(self) -> str:
        key = f"slidekit:{self.kind if self.kind != 'partial' else self.resident}" + (
            f":{self.optimizer}" if self.optimizer != "layer_adam" else ""
        )
        key += "".join(f"+{name}={value}" for name, value in self.levers)
        return ranked(key, self.ranks)


def on_gpus(label: str, ranks: int) -> str:
    """``label`` of a run on ``ranks`` GPUs (unchanged for one)."""
    return label if ranks == 1 else f"{label} on {ranks} GPUs"


def ranked(key: str, ranks: int) -> str:
    """The cost key of kind ``key`` on ``ranks`` GPUs: ``key@N`` (``key`` itself for one)."""
    return key if ranks == 1 else f"{key}@{ranks}"


def _check_ranks(ranks: int, what: str) -> None:
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(
            f"{what}: ranks={ranks!r} must be a whole number of GPUs >= 1 (torchrun --nproc-per-node)"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Alt:
    """One alternative of a suite (a ``BASELINES`` name)."""

    name: str
    batches: tuple[int, ...] | None = None
    importance: float | None = None
    clips: tuple[float | None, ...] | None = None
    ranks: int = 1  # data-parallel ranks, one GPU each (deepspeed only: it reads torchrun's RANK, WORLD_SIZE)

    def __post_init__(self) -> None:
        if self.name not in BASELINES:
            raise ConfigError(f"unknown baseline {self.name!r}; choose from: {', '.join(BASELINES)}")
        _check_ranks(self.ranks, f"Alt(name={self.name!r})")
        if self.ranks > 1 and not BASELINES[self.name].ranks:
            able = [n for n, b in BASELINES.items() if b.ranks]
            raise ConfigError(
                f"Alt(name={self.name!r}, ranks={self.ranks}): {self.name} runs in one process only; "
                f"on several GPUs choose from: {', '.join(able)}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Suite:
    """Every run for one model preset (see the module docstring)."""

    name: str
    model: str
    batches: tuple[int, ...]
    modes: tuple[Mode, ...]
    alternatives: tuple[Alt, ...]
    seq: int = 1024
    steps: int = 10
    warmup: int = 2
    clips: tuple[float | None, ...] = (None, 1.0)
    clip_batches: tuple[int, ...] | None = None  # batches of the clipped recipes (default: all of them)
    repeats: int = 2
    partial: float = 0.5  # slidekit's partial share; DeepSpeed's partial offload gets ratio 1 - this
    note: str = ""  # why the suite is shaped so (printed with the plan and the table)

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or len(set(self.batches)) != len(self.batches):
            raise ConfigError(f"suite {self.name}: batches {self.batches} must be distinct positive sizes")
        if self.steps < 1 or self.warmup < 0 or self.repeats < 1:
            raise ConfigError(
                f"suite {self.name}: needs steps >= 1, warmup >= 0 and repeats >= 1, got "
                f"{self.steps}, {self.warmup}, {self.repeats}"
            )
        if not 0.0 < self.partial < 1.0:
            raise ConfigError(f"suite {self.name}: partial {self.partial} must lie strictly between 0 and 1")
        for mode in self.modes:
            recipes = mode.clips if mode.clips is not None else self.clips
            if mode.clip_overlap is not None and None in recipes:
                raise ConfigError(
                    f"suite {self.name}: {mode.label} sets clip_overlap, which changes only clipped steps, but "
                    "runs an unclipped recipe too; give it clipped recipes only, e.g. clips=(1.0,), and "
                    "measure the unclipped recipe with a mode that leaves clip_overlap unset"
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """One child process of a suite."""

    system: str  # the records' system: "slidekit" or a baseline's
    label: str  # the table's row name
    kind: str  # for the importance rule and the cost model: a mode kind or a baseline system
    cost_key: str  # the cost model's key (``slidekit:all``, ``slidekit:0.5``, ``liger_gc``, ...)
    script: str  # "slidekit" (``python -m slidekit.tools.bench``) or a baseline's script name
    flags: tuple[str, ...]  # options beyond the common ones (model, batches, seq, steps, seed, clip)
    batches: tuple[int, ...]
    clip: float | None
    repeat: int
    importance: float
    resident: str | None = None  # slidekit's mode
    ranks: int = 1  # processes under torchrun, one GPU each (1: a plain process)
    family: str = ""  # the label of the same run on one GPU (default: ``label``)
    levers: tuple[tuple[str, str], ...] = ()  # slidekit's recompute / clip_overlap where the mode sets them

    @property
    def name(self) -> str:
        """A short unique name: label, recipe, repeat, batches (log files, the plan)."""
        recipe = "clip " + f"{self.clip:g}" if self.clip is not None else "no clip"
        return f"{self.label} [{recipe}, repeat {self.repeat}, batch {','.join(map(str, self.batches))}]"


def _batches(suite: Suite, own: tuple[int, ...] | None, clip: float | None) -> tuple[int, ...]:
    batches = own or suite.batches
    if clip is not None and suite.clip_batches:
        return tuple(b for b in batches if b in suite.clip_batches) or batches
    return batches


def expand(suite: Suite) -> list[RunSpec]:
    """Every run of ``suite``, most important first (ties: modes before alternatives, in suite order; recipes,
    then repeats, in order)."""
    runs: list[tuple[float, int, RunSpec]] = []
    for repeat in range(1, suite.repeats + 1):
        for mode in suite.modes:
            for clip in mode.clips if mode.clips is not None else suite.clips:
                rank = importance(mode.kind, clip, repeat)
                if mode.importance is not None:
                    rank = mode.importance + (
                        importance(mode.kind, clip, repeat) - importance(mode.kind, None, 1)
                    )
                spec = RunSpec(
                    system="slidekit",
                    label=mode.label,
                    kind=mode.kind,
                    cost_key=mode.cost_key,
                    script="slidekit",
                    flags=mode.flags,
                    batches=_batches(suite, mode.batches, clip),
                    clip=clip,
                    repeat=repeat,
                    importance=rank,
                    resident=mode.resident,
                    ranks=mode.ranks,
                    family=mode.family,
                    levers=mode.levers,
                )
                runs.append((rank, len(runs), spec))
        for alt in suite.alternatives:
            base = BASELINES[alt.name]
            for clip in alt.clips if alt.clips is not None else suite.clips:
                flags: tuple[str, ...] = tuple(base.flags)
                label = base.label
                if alt.name == "deepspeed_partial":
                    ratio = round(1.0 - suite.partial, 4)
                    flags += ("--offload-ratio", str(ratio))
                    label += f" (ratio {ratio:g})"
                rank = importance(base.system, clip, repeat)
                if alt.importance is not None:
                    rank = alt.importance + (rank - importance(base.system, None, 1))
                spec = RunSpec(
                    system=base.system,
                    label=on_gpus(label, alt.ranks),
                    kind=base.system,
                    cost_key=ranked(base.system, alt.ranks),
                    script=base.script,
                    flags=flags,
                    batches=_batches(suite, alt.batches, clip),
                    clip=clip,
                    repeat=repeat,
                    importance=rank,
                    ranks=alt.ranks,
                    family=label,
                )
                runs.append((rank, len(runs), spec))
    return [spec for _, _, spec in sorted(runs, key=lambda r: (r[0], r[1]))]


def adhoc_suite(
    *,
    model: str,
    batches: tuple[int, ...],
    residents: tuple[str, ...],
    baselines: tuple[str, ...],
    clips: tuple[float | None, ...],
    repeats: int,
    seq: int,
    steps: int,
    warmup: int,
    optimizer: str = "layer_adam",
    state_offload: tuple[str, float] | None = None,
    recomputes: tuple[str, ...] = (),
    clip_overlaps: tuple[str, ...] = (),
) -> Suite:
    """The suite of a ``slidekit bench`` without ``--suite``: its flags, crossed. ``recomputes`` and
    ``clip_overlaps`` (empty: not given) cross the residency modes as ``--resident`` does; the clipped
    recipes run once per overlap, the unclipped one once (a mode without ``clip_overlap``)."""
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown baseline(s) {unknown}; choose from: {', '.join(BASELINES)}")
    clipped = tuple(c for c in clips if c is not None)
    if clip_overlaps and not clipped:
        raise ConfigError(
            f"--clip-overlap {','.join(clip_overlaps)} changes only clipped steps; give a clipped recipe "
            "too, e.g. --clip none,1.0"
        )
    fractions = [float(r) for r in residents if r not in ("all", "none", "auto")]
    modes: list[Mode] = []
    for resident, recompute in product(residents, recomputes or (None,)):
        base = Mode(resident=resident, optimizer=optimizer, state_offload=state_offload, recompute=recompute)
        if not clip_overlaps:
            modes.append(base)
            continue
        if None in clips:
            modes.append(replace(base, clips=(None,)))
        modes += [replace(base, clips=clipped, clip_overlap=overlap) for overlap in clip_overlaps]
    return Suite(
        name=model,
        model=model,
        batches=batches,
        modes=tuple(modes),
        alternatives=tuple(Alt(name=b) for b in baselines),
        seq=seq,
        steps=steps,
        warmup=warmup,
        clips=clips,
        repeats=repeats,
        partial=fractions[0] if fractions and 0 < fractions[0] < 1 else 0.5,
    )


def with_overrides(base: Suite, **changes: object) -> Suite:
    """``base`` with some fields changed (``--repeats``, ``--steps``, ... given with ``--suite``)."""
    return replace(base, **{k: v for k, v in changes.items() if v is not None})  # type: ignore[arg-type]
