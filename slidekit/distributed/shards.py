"""Which part of every unit a data-parallel rank owns: ``slidekit.planning.shards`` (pure arithmetic, part
of the layout the planner decides), named here too for the data-parallel code that reads it."""

from slidekit.planning.shards import Shard, unit_shard, unit_shards

__all__ = ["Shard", "unit_shard", "unit_shards"]
