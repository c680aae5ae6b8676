"""Architecture adapters and layer templates (Llama, Qwen2/2.5, Qwen3, Mistral).

``slidekit.models.adapters`` registers the bundled adapters as the core
plugin "slidekit.models"; ``base`` defines the unit layouts, ``decoder`` the
computation, ``loading`` configs and weights; ``support`` and ``rope`` refuse
the config fields whose math slidekit does not compute (docs/models.md).
"""

from slidekit.models.base import ArchSpec, LayerFlags, ParamEntry, UnitKind, UnitLayout

__all__ = ["ArchSpec", "LayerFlags", "ParamEntry", "UnitKind", "UnitLayout"]
