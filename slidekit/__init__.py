"""slidekit: full-parameter LLM fine-tuning on one GPU, for models far larger than its memory.

A window of layers slides through the GPU; FP32 master weights and optimizer
state live on the host; the CPU updates each layer while the GPU computes the
backward pass of the next (SlideFormer, arXiv 2603.16428). Storage tiers,
optimizers, kernel sets and model adapters are plugins.

    from slidekit import Trainer, TrainConfig
    result = Trainer(TrainConfig()).fit()

Run the demo: ``slidekit finetune``; list drivers: ``slidekit plugins``.
"""

from slidekit.config import (
    DataConfig,
    EngineConfig,
    ModelConfig,
    OptimConfig,
    PluginConfig,
    RunConfig,
    TrainConfig,
)
from slidekit.data import Batch
from slidekit.errors import SlidekitError
from slidekit.plugins import Plugins
from slidekit.trainer import FitResult, Trainer

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "DataConfig",
    "EngineConfig",
    "FitResult",
    "ModelConfig",
    "OptimConfig",
    "PluginConfig",
    "Plugins",
    "RunConfig",
    "SlidekitError",
    "TrainConfig",
    "Trainer",
    "__version__",
]
