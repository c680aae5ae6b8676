"""What a run needs on each medium, and whether this machine has it.

An ``Estimate`` is the bytes of a ``Layout`` (``Layout.allocations``: what the
engine builder allocates) plus what a step uses beyond them, on the compute
device (``step_work``):

    activations  boundary activations of every recomputing layer and micro-batch
                 (``activation_tier="device"``), or the two in flight when they live on a tier
    kept         the autograd graphs of the layers that keep their activations (``kept_bytes`` per
                 layer and micro-batch, and the last one's output, held until its backward)
    hidden       the hidden states and their gradients of every micro-batch, as they flow
    working      the peak of one step's work beyond those: the head (final norm, the fused loss's
                 logits chunk, the head weight's gradient before it is added into the cache unit) or
                 one layer's recompute + backward (the tensors autograd keeps, plus the MLP's gradients)

and in host RAM, the process itself (``RUNTIME_HOST``), and in the run
directory, the checkpoints (``slidekit.planning.run_space``).

The layer-working term follows the tensors ``slidekit.models.decoder.layer_forward``
keeps for backward (per token: 4 hidden-sized, 3 head-sized per query head and
2 per key/value head, and the SwiGLU's gate, up and output, then their three
gradients); ``tests/gpu/test_planner_gpu.py`` checks the GPU total against
``torch.cuda.max_memory_allocated`` within 10% on the H200.

``kept_bytes`` is what a layer's autograd graph holds when the layer keeps its activations (its
forward runs with autograd on and its backward needs no recompute): op by op in its docstring, and
``tests/engine/test_keep_activations.py`` checks it against the tensors autograd really saves
(``torch.autograd.graph.saved_tensors_hooks``), for both kinds of kernel set and several shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from slidekit.models.base import ArchSpec
from slidekit.planning.layout import Layout, Placement, Workload
from slidekit.planning.machine import Machine, fmt_gib

__all__ = ["DEVICE_HEADROOM", "DEVICE_SLACK", "RUNTIME_HOST", "Estimate", "kept_bytes", "step_work"]

#: Host memory the process itself takes (interpreter, torch, CUDA libraries), beyond the planned buffers.
RUNTIME_HOST = {"cpu": 1 << 30, "cuda": 3 << 30, "rocm": 3 << 30}
#: The GPU must have this share of the planned bytes spare (allocator rounding, library workspaces).
DEVICE_HEADROOM = 0.05
#: ... and this much on top (cuBLAS workspaces, Triton and CUDA-graph pools).
DEVICE_SLACK = 512 << 20


def step_work(
    spec: ArchSpec,
    workload: Workload,
    *,
    itemsize: int,
    activations_on_device: bool,
    loss_workspace: int,
    keeps: int = 0,
    kept_runs: int = 0,
    fused_kernels: bool = True,
) -> dict[str, int]:
    """Activations, the flowing hidden states and the working peak of a step, on the device.

    ``keeps``: layers that keep their activations (they save no boundary activation; their graphs
    are ``kept``), in ``kept_runs`` runs of consecutive layers; ``fused_kernels``: see ``kept_bytes``."""
    s, w = itemsize, workload
    n, h, a = w.tokens, spec.hidden_size, w.grad_accum
    per_layer = n * h * s  # one boundary activation of one micro-batch
    recomputing = spec.num_layers - keeps
    acts = recomputing * a * per_layer if activations_on_device else (2 * per_layer if recomputing else 0)
    hidden = a * per_layer  # the micro-batches' hidden states, later their gradients
    work = max(head_work(spec, w, s, loss_workspace), layer_work(spec, w, s))
    out = {"activations": acts, "hidden": hidden, "working": work}
    if keeps:
        # Each run's last output is held until that layer's backward, beyond the hidden states.
        out["kept"] = a * (keeps * kept_bytes(spec, n, s, fused_kernels=fused_kernels) + kept_runs * per_layer)
    return out


def kept_bytes(spec: ArchSpec, tokens: int, itemsize: int, *, fused_kernels: bool = True) -> int:
    """Bytes one decoder layer's autograd graph holds over ``tokens`` tokens when it keeps its activations.

    The tensors ``slidekit.models.decoder.layer_forward`` leaves for its backward, per token (s the
    compute dtype's size; H hidden, q = heads x head_dim, kv = kv_heads x head_dim, I intermediate):

        RMSNorm x2      its input (the layer's input; the residual sum), s*H each, + FP32 1/rms
        q/k/v proj      their input, the first norm's output: s*H
        attention       q and k after RoPE, v, its output (o_proj's input, a view): s*(2q + 2kv),
                        + FP32 log-sum-exp per head
        MLP             the second norm's output s*H; gate and up (SwiGLU's inputs) 2s*I; down's input s*I
        q/k norms       (Qwen3) their inputs s*(q + kv) + FP32 1/rms per head

    RoPE keeps only its cos/sin tables (shared by every layer, not counted here); weights are views
    of the unit's cache unit. That is the fused kernel sets (``triton_cuda``, ``triton_rocm``).
    ``fused_kernels=False``: ``torch_ref``, whose plain-PyTorch RMSNorm keeps an FP32 copy of its input
    and its normalised FP32 product (4 B per element each, in place of the input; the product cast
    to the compute dtype as well) and whose SwiGLU keeps SiLU's output too (s*I).
    """
    sp, s = spec, itemsize
    q, kv = sp.num_heads * sp.head_dim, sp.num_kv_heads * sp.head_dim
    h, inter = sp.hidden_size, sp.intermediate_size
    normed = [h, h] + ([q, kv] if sp.flags.qk_norm else [])  # the widths the RMSNorms see, per token
    rows = 2 + ((sp.num_heads + sp.num_kv_heads) if sp.flags.qk_norm else 0)  # their FP32 1/rms
    per_token = s * (2 * h + 2 * q + 2 * kv + 3 * inter) + s * sum(normed) + 4 * rows + 4 * sp.num_heads
    if not fused_kernels:
        per_token += 4 * sum(normed) + s * inter
    return tokens * per_token


def layer_work(spec: ArchSpec, workload: Workload, itemsize: int) -> int:
    """One layer's recompute + backward beyond its input and output gradient (see the module doc)."""
    sp, s, n = spec, itemsize, workload.tokens
    d = sp.head_dim
    kept = 4 * sp.hidden_size + (3 * sp.num_heads + 2 * sp.num_kv_heads) * d + 3 * sp.intermediate_size
    grads = 3 * sp.intermediate_size
    return n * s * (kept + grads) + n * 4 * (2 + sp.num_heads)  # + FP32 norm scales and attention LSE


def head_work(spec: ArchSpec, workload: Workload, itemsize: int, loss_workspace: int) -> int:
    """The head's norm output and its gradient, the weight gradient before accumulation, the logits."""
    sp, s, n = spec, itemsize, workload.tokens
    logits = min(loss_workspace, 3 * 4 * n * sp.vocab_size)  # no kernel keeps 3 FP32 copies of all logits
    return 2 * n * sp.hidden_size * s + sp.vocab_size * sp.hidden_size * s + logits + 8 * n


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Bytes a placement needs, per component, on each medium."""

    placement: Placement
    resident: tuple[bool, ...]  # per unit: kept on the device for good
    layout: Layout | None = None  # what the engine allocates (None: an estimate built by hand)
    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)
    run_dir: dict[str, int] = field(default_factory=dict)  # checkpoints in run.dir
    run_dir_fix: str = ""  # what to do when the run directory lacks room

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def disk_bytes(self) -> int:
        return sum(self.disk.values())

    @property
    def run_dir_bytes(self) -> int:
        return sum(self.run_dir.values())

    def shortfalls(self, machine: Machine) -> list[str]:
        """One line per medium that lacks room, with the numbers (empty when the run fits)."""
        return self.placement_shortfalls(machine) + self._run_dir_shortfalls(machine)

    def placement_fits(self, machine: Machine) -> bool:
        """Whether GPU, RAM and offload disk hold the placement (the run directory aside)."""
        return not self.placement_shortfalls(machine)

    def _run_dir_shortfalls(self, machine: Machine) -> list[str]:
        need = self.run_dir_bytes
        if not need or machine.run_dir_free is None:
            return []
        free = machine.run_dir_free - (self.disk_bytes if machine.run_dir_shares_disk else 0)
        if need <= free:
            return []
        shared = " after the offload files (the same file system)" if machine.run_dir_shares_disk else ""
        return [
            f"run directory: needs {fmt_gib(need)} ({_parts(self.run_dir)}), has {fmt_gib(max(free, 0))} "
            f"free{shared}: {self.run_dir_fix}"
        ]

    def host_need(self, machine: Machine) -> int:
        """Bytes of host RAM the placement needs on ``machine`` (on the CPU the device's buffers too)."""
        return self.host_bytes + (self.device_bytes if machine.device_free is None else 0)

    def host_fits(self, machine: Machine) -> bool:
        """Whether the machine's RAM holds the placement (whatever the GPU and the disk say)."""
        return self.host_need(machine) <= machine.host_available

    def placement_shortfalls(self, machine: Machine) -> list[str]:
        """``shortfalls`` of GPU, RAM and offload disk only (the run directory aside)."""
        out = []
        host_need = self.host_need(machine)
        if machine.device_free is not None:
            need = self.device_bytes * (1 + DEVICE_HEADROOM) + DEVICE_SLACK
            if need > machine.device_free:
                out.append(
                    f"GPU memory: needs {fmt_gib(need)} ({_parts(self.device)}, plus "
                    f"{DEVICE_HEADROOM:.0%} + {DEVICE_SLACK >> 20} MiB headroom), has {fmt_gib(machine.device_free)} free"
                )
        if host_need > machine.host_available:
            parts = dict(self.host)
            if machine.device_free is None:
                parts.update({f"device {k}": v for k, v in self.device.items()})
            out.append(
                f"host RAM: needs {fmt_gib(host_need)} ({_parts(parts)}), has {fmt_gib(machine.host_available)} available"
            )
        if self.disk_bytes:
            if machine.disk_free is None:
                out.append(
                    f"disk: needs {fmt_gib(self.disk_bytes)} ({_parts(self.disk)}) but no engine.offload_dir "
                    "(CLI: --offload-dir) is set"
                )
            elif self.disk_bytes > machine.disk_free:
                out.append(
                    f"disk: needs {fmt_gib(self.disk_bytes)} ({_parts(self.disk)}), has "
                    f"{fmt_gib(machine.disk_free)} free in the offload directory"
                )
        return out

    def fits(self, machine: Machine) -> bool:
        return not self.shortfalls(machine)

    def table(self, device: str = "GPU") -> str:
        """The components, one per line, grouped by medium (``device`` names the compute device)."""
        lines = []
        media = (
            (device, self.device),
            ("host RAM", self.host),
            ("disk", self.disk),
            ("run directory", self.run_dir),
        )
        for medium, parts in media:
            if not parts:
                continue
            lines.append(f"  {medium:<24} {fmt_gib(sum(parts.values())):>12}")
            lines += [f"    {name:<22} {fmt_gib(n):>12}" for name, n in parts.items() if n]
        resident = sum(self.resident)
        lines.append(f"  {resident} of {len(self.resident)} units resident on the {device}")
        if 0 < resident < len(self.resident):
            host = ", ".join(str(u) for u, r in enumerate(self.resident) if not r)
            lines.append(f"  units on the host (spread over the backward order): {host}")
        return "\n".join(lines)


def _parts(parts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {fmt_gib(v)}" for k, v in parts.items() if v)

