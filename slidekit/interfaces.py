"""What a driver must implement, and the descriptors plugins use to offer one.

The core talks to storage tiers, optimizers, kernel sets and model adapters only
through the Protocols below. A plugin offers a driver by yielding a frozen
descriptor from the matching hook (see ``slidekit.hookspecs``); the core
collects the descriptors, rejects duplicate names and builds a driver through
the descriptor's ``factory`` once a run selects it by name.

The Protocols are deliberately narrow: they are the whole surface the engine
uses. ``isinstance`` against them only checks names; the conformance suites in
``slidekit.testing`` do the real checking.

Test: ``pytest tests/test_plugins.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = [
    "TIER_MEDIA",
    "Availability",
    "DriverDescriptor",
    "FusedBackupOptimizer",
    "KernelSet",
    "KernelSetDescriptor",
    "ModelAdapterDescriptor",
    "OptimizerDescriptor",
    "OptimizerHyper",
    "ParamGroupRange",
    "Prepared",
    "StorageTier",
    "TierContext",
    "TierDescriptor",
    "TierStats",
    "UnitOptimizer",
    "always_available",
]

#: ``(available, reason)``: the reason says why not, or how it runs (e.g. "pinned host memory").
Availability = tuple[bool, str]


def always_available() -> Availability:
    """The availability check of a driver that runs anywhere."""
    return True, "runs anywhere"


# --------------------------------------------------------------------------- descriptors


@dataclass(frozen=True, kw_only=True, slots=True)
class Prepared:
    """What a driver's ``prepare()`` did; ``slidekit build`` reports it.

    Fields:
        built: True when the work was done now (e.g. a kernel compiled); False
            when an up-to-date result was there already.
        location: where the result lives (a file or directory), "" if nowhere in particular.
        detail: one line saying what it is, e.g. "fused C++ kernel from fused_adam.cpp for AVX512".
    """

    built: bool
    location: str = ""
    detail: str = ""


#: Where a storage tier keeps its bytes (``TierDescriptor.medium``).
TIER_MEDIA = ("device", "host", "disk")


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverDescriptor:
    """What every driver descriptor carries.

    Fields:
        name: the name users select the driver by; unique within its family.
        factory: builds the driver; its arguments depend on the family.
        available: cheap, side-effect free check: ``(ok, reason)``. Called lazily.
        priority: automatic selection takes the available driver with the highest priority.
        devices: device types the driver serves ("cpu", "cuda", "rocm").
        description: one line for ``slidekit plugins``.
        prepare: optional ahead-of-time work the driver would otherwise do on
            first use, such as compiling a kernel, so that no run waits for it:
            ``prepare() -> Prepared``, raising with the reason when it cannot.
            ``slidekit build`` calls it; None: nothing to prepare.
        options: the settings the driver takes, name -> one line saying what it
            does and its default (``slidekit plugins`` lists them). Users set
            them in ``plugins.options.<driver name>`` (TOML) or with
            ``--plugin-option NAME.KEY=VALUE``; a key the driver does not declare
            is refused before anything is built, naming the driver and the keys it
            takes. The driver receives the values it was given (and only those:
            defaults are its own) in ``TierContext.options`` (tiers),
            ``OptimizerHyper.options`` (optimizers) or as ``factory(options)``
            (kernel sets that declare any), and refuses a bad value by raising
            ``ValueError`` naming the key, the value and what would be valid.
    """

    name: str
    factory: Callable[..., Any]
    available: Callable[[], Availability] = always_available
    priority: int = 0
    devices: tuple[str, ...] = ("cpu", "cuda", "rocm")
    description: str = ""
    prepare: Callable[[], Prepared] | None = None
    options: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"driver name {self.name!r} is not valid: use letters, digits, '_' and '-' only")
        if not isinstance(self.options, Mapping) or not all(
            isinstance(k, str) and k and isinstance(v, str) for k, v in self.options.items()
        ):
            raise TypeError(
                f"driver {self.name!r}: options must map each setting's name to a one-line description "
                f"(str -> str), got {self.options!r}"
            )
        if not callable(self.factory):
            raise TypeError(f"driver {self.name!r}: factory must be callable, got {self.factory!r}")
        if self.prepare is not None and not callable(self.prepare):
            raise TypeError(
                f"driver {self.name!r}: prepare must be callable (returning Prepared) or None, "
                f"got {self.prepare!r}"
            )
        unknown = set(self.devices) - {"cpu", "cuda", "rocm"}
        if unknown:
            raise ValueError(
                f"driver {self.name!r}: unknown device types {sorted(unknown)}; valid: cpu, cuda, rocm"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class TierDescriptor(DriverDescriptor):
    """A storage tier. ``factory(ctx: TierContext) -> StorageTier``.

    ``medium`` says where the tier keeps its bytes, for the memory planner:
    "device" (the accelerator's memory), "host" (RAM) or "disk" (files in
    ``engine.offload_dir``).
    """

    medium: str = "host"

    def __post_init__(self) -> None:
        DriverDescriptor.__post_init__(self)
        if self.medium not in TIER_MEDIA:
            raise ValueError(f"tier {self.name!r}: medium must be one of {TIER_MEDIA}, got {self.medium!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerDescriptor(DriverDescriptor):
    """A per-unit optimizer. ``factory(hyper: OptimizerHyper) -> UnitOptimizer``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelSetDescriptor(DriverDescriptor):
    """A kernel set. ``factory() -> KernelSet``; ``factory(options)`` when it declares ``options``.

    ``loss_workspace_bytes``: device memory the fused linear + cross-entropy
    holds beyond its inputs and the gradients it returns (its logits chunks),
    for the memory planner. The default is a conservative 768 MiB.
    """

    loss_workspace_bytes: int = 768 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelAdapterDescriptor(DriverDescriptor):
    """An architecture adapter. ``factory(hf_config) -> slidekit.models.ArchSpec``.

    ``model_types`` lists the Hugging Face ``config.model_type`` values it serves.
    """

    model_types: tuple[str, ...] = ()


# --------------------------------------------------------------------------- storage tiers


@dataclass(frozen=True, kw_only=True, slots=True)
class TierStats:
    """Counters a tier reports. Bytes are cumulative since the tier was built."""

    bytes_written: int
    bytes_read: int
    bytes_allocated: int
    capacity: int | None  # bytes the tier can still hold; None when unknown
    detail: str = ""  # how it runs, e.g. "pinned host memory"


@dataclass(frozen=True, kw_only=True, slots=True)
class TierContext:
    """What the engine hands a tier factory (``factory(ctx)``): runtime facts and the tier's settings.

    The trainer builds one instance of each tier a run uses, on the main thread, and shares it: the
    optimizer state, the boundary activations and the checkpoint writer may all use one tier at once.
    """

    device: torch.device  # the compute device; tiers may read into / write from its tensors
    directory: str | None = None  # engine.offload_dir: where file-backed tiers keep their files
    io_threads: int = 2  # worker threads for tiers that do blocking I/O
    # The tier's settings from plugins.options.<tier name>, keys among those its descriptor declares
    # (``TierDescriptor.options``); {} when none are configured. Defaults are the tier's own.
    options: Mapping[str, Any] = field(default_factory=dict)
    # The longest close() waits for I/O in flight; then it warns, naming the tier, and leaves it behind
    # (engine.timeout_s).
    close_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.close_timeout_s > 0:
            raise ValueError(f"TierContext.close_timeout_s must be > 0 seconds, got {self.close_timeout_s!r}")


@runtime_checkable
class StorageTier(Protocol):
    """Moves bytes between tensors and the tier's own storage; never computes.

    Regions are named, fixed-size byte ranges. ``write`` and ``read`` return
    futures that complete once the bytes have arrived; the caller keeps ``src``
    alive and unchanged, and does not touch ``dst``, until then. Sources and
    destinations are contiguous tensors of any dtype on the host or on the
    compute device; a source on the device must be ready on the current stream
    when ``write`` is called. Because a tier only moves bytes, results of
    training never depend on which tier holds what.

    ``map`` may return a host tensor aliasing the region (memory tiers): the
    engine then updates state in place instead of staging it. Tiers whose
    storage is not addressable return None.

    Several threads call one tier at once (the main thread for activations,
    the optimizer lane and the checkpoint writer for streamed state), so its
    bookkeeping must be thread safe; a device transfer is ordered after the
    calling thread's current stream as it was at the call, and its future
    completes only once the bytes have arrived (docs/plugins.md, "Storage
    tiers"; ``slidekit.tierkit`` has the pieces).
    """

    name: str

    def allocate(self, key: str, nbytes: int) -> None: ...

    def write(self, key: str, src: Tensor, offset: int = 0) -> Future[None]: ...

    def read(self, key: str, dst: Tensor, offset: int = 0) -> Future[None]: ...

    def map(self, key: str) -> Tensor | None: ...

    def free(self, key: str) -> None: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- optimizers


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerHyper:
    """Hyper-parameters every optimizer receives (the learning rate comes per step), and its own settings.

    ``options`` holds the settings of ``plugins.options.<optimizer name>`` (keys among those its
    descriptor declares, ``OptimizerDescriptor.options``; {} when none are configured): what an
    optimizer needs beyond the common fields (a momentum, a quantization block size, ...).
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    threads: int | None = None  # intra-op threads for the update; None keeps torch's setting
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamGroupRange:
    """A contiguous range of a unit's flat vector that shares optimizer settings."""

    start: int
    stop: int
    weight_decay: float


@runtime_checkable
class UnitOptimizer(Protocol):
    """Updates one unit's flat FP32 master from its gradient, on the CPU.

    ``state_layout(numel)`` names the state buffers a unit of ``numel``
    parameters needs, with their dtypes and element counts; the engine
    allocates them (on whatever tier the plan chose) and passes them back
    zero-initialised to ``step``. ``step`` updates ``master`` and ``state`` in
    place from ``grad`` (FP32 or BF16) and, when ``lowp_out`` is given, writes the
    updated parameters cast to its dtype there. ``count`` is the 1-based number
    of updates this unit has received, for bias correction.

    Two capabilities, declared as bools (the engine and the planner read them, never probe; a run
    refuses an optimizer that lacks one, or whose ``linear_state`` its ``state_layout`` contradicts:
    ``slidekit.capabilities``):

    ``device_update``
        ``step`` also runs on tensors on the compute device (CUDA, ROCm), so units
        can be resident there: master, state and update on the device.
    ``linear_state``
        the state of parameters [a, a + m) sits at the offsets ``state_layout(a)``
        gives and has the size of ``state_layout(m)`` whenever ``a`` is a multiple
        of ``slidekit.planning.GRANULE`` (per-element moments; block-wise quantized
        state with blocks dividing it). Only then can a unit be updated, and its
        state streamed, piece by piece.

    Two optional capabilities, read with ``getattr(optimizer, name, False)``
    (``slidekit.capabilities.fuses_backup`` and ``updates_out_of_place``), so an optimizer that does not
    declare them keeps working:

    ``fused_backup``
        ``step`` also takes ``backup_out`` (``FusedBackupOptimizer``): speculative clipping
        (``slidekit.engine.speculation``) then hands it the unit's backup and the optimizer writes the
        old master and state there in the update's own pass, instead of the engine copying each chunk
        first. Without it (False, or not declared) the engine copies, chunk by chunk, then calls ``step``
        without ``backup_out``: the same bits, more memory traffic.
    ``fused_update_out``
        ``step`` also takes ``update_out`` (``FusedBackupOptimizer``): speculative clipping then has the
        updated master and state written into the unit's second set of buffers, its inputs left as they
        were, and swaps the two sets when the bet wins; a step that clips finds the old values where they
        were and restores nothing. Reads the inputs once and writes the outputs once: no more bytes than
        an update in place.
    """

    name: str
    device_update: bool
    linear_state: bool

    def state_layout(self, numel: int) -> Mapping[str, tuple[torch.dtype, int]]: ...

    def step(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        *,
        lr: float,
        count: int,
        groups: Sequence[ParamGroupRange],
        lowp_out: Tensor | None = None,
    ) -> None: ...


@runtime_checkable
class FusedBackupOptimizer(UnitOptimizer, Protocol):
    """A ``UnitOptimizer`` declaring ``fused_backup = True``: ``step`` also takes ``backup_out``.

    ``backup_out`` maps "master" and each name of ``state`` to a tensor of the same dtype and number of
    elements (contiguous, on the master's device, overlapping no other argument). ``step`` writes
    there the values ``master`` and ``state`` hold *before* the update, bit for bit, and updates them
    exactly as without ``backup_out`` (same bits). Bad buffers (a name missing or unknown, another
    dtype or size) are refused before anything is written, with an error naming the buffer. None:
    no backup, the plain ``UnitOptimizer.step``.

    With ``fused_update_out = True`` too, ``step`` also takes ``update_out``, buffers as ``backup_out``'s:
    it writes there the values an update in place would leave in ``master`` and ``state``, bit for bit,
    and leaves ``master`` and ``state`` as they were (``lowp_out``, if given, gets the updated weights).
    ``backup_out`` and ``update_out`` together are refused.
    """

    fused_backup: bool

    def step(
        self,
        master: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        *,
        lr: float,
        count: int,
        groups: Sequence[ParamGroupRange],
        lowp_out: Tensor | None = None,
        backup_out: Mapping[str, Tensor] | None = None,
        update_out: Mapping[str, Tensor] | None = None,
    ) -> None: ...


# --------------------------------------------------------------------------- kernel sets


@runtime_checkable
class KernelSet(Protocol):
    """The fused operations a decoder layer and the head are built from.

    Each is differentiable through autograd. Shapes: ``x`` (..., H);
    ``q``/``k`` (B, heads, T, D); ``cos``/``sin`` (T, D); ``hidden`` (N, H);
    ``weight`` (V, H); ``labels`` (N,), with ``ignore_index`` marking tokens
    that carry no loss.
    """

    name: str

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...

    def rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]: ...

    def swiglu(self, gate: Tensor, up: Tensor) -> Tensor: ...

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, window: int | None = None
    ) -> Tensor: ...

    def linear_cross_entropy(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        *,
        ignore_index: int = -100,
        chunk_size: int | None = None,
        reduction: str = "sum",
    ) -> Tensor: ...
