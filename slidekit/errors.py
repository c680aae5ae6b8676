"""The exceptions slidekit raises on purpose.

Every message names the problem and what to do about it. Catch
``SlidekitError`` to catch them all.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DriverUnavailableError",
    "DuplicateDriverError",
    "ModelLoadError",
    "NonFiniteError",
    "PipelineError",
    "PipelineStalled",
    "PluginError",
    "SlidekitError",
    "UnknownDriverError",
]


class SlidekitError(Exception):
    """Base class of slidekit's own errors."""


class ConfigError(SlidekitError, ValueError):
    """A configuration value is invalid; the message names it and what would be valid."""


class PluginError(SlidekitError):
    """A plugin is malformed: bad hook implementation, wrong descriptor type, failed import."""


class DuplicateDriverError(PluginError):
    """Two plugins offer a driver of the same family under the same name."""


class UnknownDriverError(SlidekitError, LookupError):
    """No driver of that family has that name; the message lists the names there are."""


class DriverUnavailableError(SlidekitError):
    """The driver exists but cannot run here; the message gives its reason and the alternatives."""


class ModelLoadError(SlidekitError):
    """A model directory or config cannot be loaded or is not supported."""


class PipelineError(SlidekitError):
    """The training pipeline stopped; the original exception is chained as ``__cause__``."""


class PipelineStalled(PipelineError, TimeoutError):
    """Nothing progressed for ``engine.timeout_s``: something upstream never finished.

    ``lane`` ("h2d", "d2h", "optim", "main", "checkpoint") and ``unit`` (None when unknown) say where
    the work that holds everything up is stuck.
    """

    def __init__(self, message: str, *, lane: str | None = None, unit: int | None = None) -> None:
        super().__init__(message)
        self.lane = lane
        self.unit = unit


class NonFiniteError(SlidekitError, FloatingPointError):
    """A loss or gradient was NaN or infinite; the message says which step and what was (not) applied."""
