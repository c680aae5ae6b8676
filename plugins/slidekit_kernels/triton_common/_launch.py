"""Host-side helpers the launchers share: where kernels may run, and how many programs a device fits.

Triton compiles for GPUs; under ``TRITON_INTERPRET=1`` (set before the
kernel modules are imported) the same kernels run in NumPy on CPU tensors,
which is how the tests exercise them without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["check_device", "multiprocessors", "on_device"]

#: Programs the interpreter pretends a CPU has, so multi-program reductions are exercised there too.
_INTERPRETER_SMS = 3


def check_device(kernel: Any, *tensors: torch.Tensor) -> None:
    """Raise unless every tensor is on one device the (compiled or interpreted) ``kernel`` can reach."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    (device,) = devices
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


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Make ``t``'s GPU the current one while launching: Triton launches on the current device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
