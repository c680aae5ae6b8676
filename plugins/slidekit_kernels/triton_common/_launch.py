"""Host-side helpers the launchers share: where kernels may run, and how many programs a device fits.

Triton compiles for GPUs; under ``TRITON_INTERPRET=1`` (set before the
kernel modules are imported) the same kernels run in NumPy on CPU tensors,
which is how the tests exercise them without a GPU.

These run on every launch, and a training step launches hundreds of small
kernels, so they stay cheap: no device-context switch when the tensor's GPU is
already the current one, integer arithmetic instead of ``triton.cdiv`` (a
constexpr function, several microseconds per call on the host).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["cdiv", "check_device", "multiprocessors", "on_device"]

#: Programs the interpreter pretends a CPU has, so multi-program reductions are exercised there too.
_INTERPRETER_SMS = 3
#: Reusable: entering and leaving a nullcontext keeps no state.
_NO_SWITCH = contextlib.nullcontext()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ``b``, in integer arithmetic."""
    return -(-a // b)


def check_device(kernel: Any, *tensors: torch.Tensor) -> None:
    """Raise unless every tensor is on one device the (compiled or interpreted) ``kernel`` can reach."""
    device = tensors[0].device
    if any(t.device != device for t in tensors[1:]):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    interpreted = isinstance(kernel, InterpretedFunction)
    if device.type == "cpu" and not interpreted:
        raise RuntimeError(
            "Triton kernels need GPU tensors, got CPU tensors; use the torch_ref kernel set on the CPU, "
            "or set TRITON_INTERPRET=1 before slidekit_kernels.triton_common is imported to interpret them"
        )
    if device.type != "cpu" and interpreted:
        raise RuntimeError(
            f"the Triton kernels were loaded in interpreter mode (TRITON_INTERPRET=1) but got {device} "
            "tensors; unset TRITON_INTERPRET to compile them for the GPU, or pass CPU tensors"
        )


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) / compute units (AMD) of ``device``; a small number on the CPU."""
    if device.type == "cpu":
        return _INTERPRETER_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.cache
def _one_gpu() -> bool:
    return torch.cuda.device_count() <= 1


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Make ``t``'s GPU the current one while launching (Triton launches on the current device).

    A no-op when it already is, which is every launch of a single-GPU run.
    """
    device = t.device
    if device.type != "cuda" or _one_gpu() or device.index == torch.cuda.current_device():
        return _NO_SWITCH
    return torch.cuda.device(device)
