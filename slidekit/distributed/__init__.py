"""Data parallelism: one process per GPU under torchrun, each running the sliding engine on its shard.

``shards`` says which part of every unit a rank owns; ``group`` holds the
ranks' process groups and failure reports (``DataParallel``). The engine's
side (reduce-scatter after each unit's backward, all-gather before its next
forward) is ``slidekit.engine.collectives``. The design: docs/data-parallel.md.
"""

from slidekit.distributed.group import DataParallel, PeerFailed, env_world
from slidekit.distributed.shards import Shard, unit_shard, unit_shards

__all__ = ["DataParallel", "PeerFailed", "Shard", "env_world", "unit_shard", "unit_shards"]
