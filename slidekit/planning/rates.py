"""What a machine sustains, for the step-time model: ``Rates``, each figure with where it comes from.

The step-time model (``slidekit.planning.timing``) turns a ``Layout`` into
seconds with these figures: the device's achieved matmul rate for decoder
layers and for the LM head, its memory bandwidth for streaming passes
(gradient zeroing and norms, the fused update of resident units), the bus
each way, the host's optimizer rate per optimizer (and its memory bandwidth
for the clipping pass, for optimizers without a figure and for restoring
speculative clipping's backups), the rate of those backups (written in the
update's pass, or copied beside it), the disk each way, and a fixed host
cost per step. Every figure carries its source:
``measured: ...`` (a dated benchmark page or raw record), ``published: ...``
(a vendor's data sheet, not measured here), ``assumed: ...`` or ``derived:
...`` (arithmetic on the others, said how). The machine profiles that fill
them are in ``slidekit.planning.profiles``.

Test: ``pytest tests/test_timing.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from slidekit.errors import ConfigError

__all__ = ["Rates", "UpdateRate"]

#: Bytes per parameter the clipping pass moves: the BF16 gradient read and written once more
#: (``grad.mul_(scale)`` before the update, ``slidekit.engine.updates.Updates._apply``).
CLIP_PASS_BYTES = 4
#: Bytes per parameter a host update writes more with upload copies (``engine.upload_copy``): the BF16
#: weights, in the same pass as the FP32 master (``slidekit.engine.host``).
COPY_WRITE_BYTES = 2
#: Bytes per parameter of the gradient passes every unit gets on the device each step: its BF16
#: gradient zeroed before its backward, and read for its norm after (``Updates._finish_unit``).
GRAD_PASS_BYTES = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateRate:
    """An optimizer's update rate: on the host in parameters per second, on the device as the bytes per
    parameter its fused pass moves (at the device's memory bandwidth)."""

    host_params_per_s: float
    device_bytes_per_param: float
    source: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    """What one machine sustains (see the module doc); ``sources`` says where each figure comes from."""

    name: str
    layer_tflops: float  # decoder layers' matmuls (forward, recompute, backward), model-FLOPs convention
    head_tflops: float  # the LM head's fused linear + cross-entropy (forward and backward at once)
    device_gbps: float  # device memory, streaming passes (gradient zeroing and norms, device updates)
    h2d_gbps: float  # pinned host -> device copies (FP32 masters up)
    d2h_gbps: float  # device -> pinned host copies (BF16 gradients down)
    host_gbps: float  # host memory bandwidth (the clipping pass; optimizers without a figure)
    disk_read_gbps: float  # the offload directory's disk, O_DIRECT reads
    disk_write_gbps: float  # ... and writes
    step_overhead_s: float  # host time per step the device idles through (launches, syncs, the batch)
    #: Speculative clipping's backups (``slidekit.engine.speculation``), effective: a unit's master and
    #: state bytes, counted twice (read and written), over the time its update takes longer for them.
    #: ``backup_gbps``: written in the update's own pass (``fused_backup``, both bundled optimizers);
    #: ``backup_copy_gbps``: copied beside each chunk's update (any other optimizer). None: ``host_gbps``.
    #: A rollback's restore is a plain copy of the same bytes, at ``host_gbps``.
    backup_gbps: float | None = None
    backup_copy_gbps: float | None = None
    updates: Mapping[str, UpdateRate] = field(default_factory=dict)  # optimizer name -> its rate
    sources: Mapping[str, str] = field(default_factory=dict)  # field name -> where the figure comes from

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not value > 0 and f.name != "step_overhead_s":
                raise ConfigError(f"rates {self.name!r}: {f.name} must be positive, got {value}")
        if self.step_overhead_s < 0:
            raise ConfigError(
                f"rates {self.name!r}: step_overhead_s must be >= 0, got {self.step_overhead_s}"
            )

    def backup_rate_gbps(self, fused: bool) -> float:
        """Effective GB/s of speculative clipping's backups: ``backup_gbps`` for an optimizer that writes them
        in its update's pass (``fused``), ``backup_copy_gbps`` for one whose backups are copied; else
        ``host_gbps``."""
        rate = self.backup_gbps if fused else self.backup_copy_gbps
        return self.host_gbps if rate is None else rate

    def update(self, optimizer: str, state_bytes_per_param: float) -> UpdateRate:
        """The rate of ``optimizer``: its own figure, else an estimate from the bytes it moves per
        parameter (gradient 2, master read and written 8, its state read and written) at the host's
        memory bandwidth, said so in the source."""
        known = self.updates.get(optimizer)
        if known is not None:
            return known
        moved = 2 + 8 + 2 * state_bytes_per_param
        return UpdateRate(
            host_params_per_s=self.host_gbps * 1e9 / moved,
            device_bytes_per_param=moved + 2,  # the device pass also writes the BF16 weights
            source=(
                f"estimated: {optimizer!r} has no figure in rates {self.name!r}; {moved:.1f} B/param "
                f"moved at the host's {self.host_gbps:g} GB/s"
            ),
        )

    def describe(self) -> str:
        """One line per figure with its source (``slidekit plan`` prints it for a what-if)."""
        rows = [
            ("layer_tflops", f"decoder layers {self.layer_tflops:g} TFLOPS"),
            ("head_tflops", f"LM head {self.head_tflops:g} TFLOPS"),
            ("device_gbps", f"device memory {self.device_gbps:g} GB/s"),
            ("h2d_gbps", f"host->device {self.h2d_gbps:g} GB/s"),
            ("d2h_gbps", f"device->host {self.d2h_gbps:g} GB/s"),
            ("host_gbps", f"host memory {self.host_gbps:g} GB/s"),
            ("disk_read_gbps", f"disk read {self.disk_read_gbps:g} GB/s"),
            ("disk_write_gbps", f"disk write {self.disk_write_gbps:g} GB/s"),
            ("step_overhead_s", f"per-step host overhead {self.step_overhead_s * 1e3:g} ms"),
        ]
        if self.backup_gbps is not None:
            rows.append(("backup_gbps", f"clipping backups {self.backup_gbps:g} GB/s (fused)"))
        if self.backup_copy_gbps is not None:
            rows.append(("backup_copy_gbps", f"clipping backups {self.backup_copy_gbps:g} GB/s (copied)"))
        lines = [f"    {text}: {self.sources.get(key, 'no source given')}" for key, text in rows]
        for name, rate in self.updates.items():
            lines.append(
                f"    {name}: host {rate.host_params_per_s / 1e9:g} G params/s, device "
                f"{rate.device_bytes_per_param:g} B/param: {rate.source}"
            )
        return "\n".join(lines)
