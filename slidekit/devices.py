"""Which device to compute on, and what kind of device it is. Probes lazily.

``resolve_device("auto")`` is CUDA (or ROCm, which torch also calls "cuda")
when one is visible, else the CPU. ``device_family`` tells drivers apart:
"cpu", "cuda" (NVIDIA) or "rocm" (AMD, a HIP build of torch).
"""

from __future__ import annotations

import torch

from slidekit.errors import ConfigError

__all__ = ["device_family", "resolve_device"]


def resolve_device(name: str) -> torch.device:
    """Turn a user's device name ("auto", "cpu", "cuda", "cuda:1") into a torch.device."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device {name!r} is not a device name; use 'auto', 'cpu' or 'cuda[:N]'") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but torch sees no CUDA device; use 'cpu' or 'auto'")
    return device


def device_family(device: torch.device) -> str:
    """ "cpu", "cuda" or "rocm" for a torch.device."""
    if device.type == "cpu":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"
