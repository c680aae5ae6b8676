"""The sliding engine: executes a plan over a window of device cache units.

``core`` runs the schedule; ``host`` keeps masters, optimizer state and the
gradient ring; ``window`` the device cache units; ``activations`` the
boundary activations; ``runtime`` the threads, streams and error handling.
"""

from slidekit.engine.activations import ActivationStore, DeviceActivations, TierActivations
from slidekit.engine.core import Engine, StepResult
from slidekit.engine.host import GradRing, HostStore
from slidekit.engine.runtime import Pipeline, Streams
from slidekit.engine.window import Slot, Window

__all__ = [
    "ActivationStore",
    "DeviceActivations",
    "Engine",
    "GradRing",
    "HostStore",
    "Pipeline",
    "Slot",
    "StepResult",
    "Streams",
    "TierActivations",
    "Window",
]
