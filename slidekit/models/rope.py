"""Rotary position embeddings: which RoPE variants slidekit computes, and their frequencies.

transformers 5 keeps every RoPE setting in ``config.rope_parameters`` (it folds
the older ``rope_theta`` + ``rope_scaling`` fields of a config.json into it on
load). slidekit computes the inverse frequencies and the cos/sin scaling of
the supported variants exactly as transformers does, through the same public
functions (``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``), and
refuses every other setting with the field, its value and what is supported.

Supported ``rope_type``: ``default``, ``linear``, ``dynamic`` (equal to
``default`` for sequences up to ``max_position_embeddings``, the longest the
engine accepts), ``yarn`` and ``llama3``. Refused: ``longrope`` (its
frequencies switch with the sequence length), any other type, a
``partial_rotary_factor`` other than 1 and per-layer-type RoPE settings.

Test: ``pytest tests/models/test_math_support.py -k rope``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from slidekit.errors import ModelLoadError
from slidekit.models.support import refuse

__all__ = ["SUPPORTED_ROPE_TYPES", "rope_init", "rope_type"]

#: The RoPE variants slidekit computes, each checked against transformers' forward.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")

_WHY_NOT = {
    "longrope": "its frequencies switch between short and long factors with the sequence length",
}


def _parameters(config: Any) -> dict[str, Any]:
    """The config's single, global set of RoPE parameters (validated shape, not values)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise refuse(config, "rope_parameters", params, "it is not a mapping", "write it as a JSON object")
    layer_types = set(getattr(config, "layer_types", None) or ())
    if params and all(isinstance(v, Mapping) or v is None for v in params.values()):
        raise refuse(
            config,
            "rope_parameters",
            dict(params),
            f"it holds one set per layer type ({', '.join(map(str, params))}) and slidekit applies one RoPE to "
            "every layer",
            "write a single set, e.g. {'rope_type': 'default', 'rope_theta': 10000.0}",
        )
    if layer_types & set(params):
        raise refuse(
            config,
            "rope_parameters",
            dict(params),
            "it mixes per-layer-type sets with global keys",
            "write one set",
        )
    return dict(params)


def rope_type(config: Any) -> str:
    """The config's RoPE variant (``default`` when it names none)."""
    params = getattr(config, "rope_parameters", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _check(config: Any, params: dict[str, Any]) -> str:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        why = _WHY_NOT.get(str(kind), "slidekit does not compute this RoPE variant")
        raise refuse(
            config,
            "rope_parameters.rope_type",
            kind,
            why,
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial is not None and float(partial) != 1.0:
        raise refuse(
            config,
            "partial_rotary_factor",
            partial,
            f"slidekit rotates the whole head ({_head_dim(config)} dimensions), and transformers' "
            f"{config.model_type} model either ignores this factor or fails on it",
            "supported: 1.0 (or leave it out)",
        )
    theta = params.get("rope_theta")
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise refuse(
            config, "rope_parameters.rope_theta", theta, "RoPE needs a positive base", "set it, e.g. 10000.0"
        )
    return str(kind)


def _default_inv_freq(config: Any, theta: float) -> torch.Tensor:
    dim = _head_dim(config)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (D/2,)


def rope_init(config: Any) -> Callable[[], tuple[torch.Tensor, float]]:
    """Check the config's RoPE settings now; return ``() -> (inv_freq (D/2,), attention scaling)``.

    The frequencies are computed here, once, so a missing parameter of a
    supported variant is reported when the model is resolved, not when the
    engine first runs.
    """
    params = _parameters(config)
    kind = _check(config, params)
    if kind == "default":
        inv_freq, scaling = _default_inv_freq(config, float(params["rope_theta"])), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        try:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(
                f"{config.model_type}: rope_parameters {params} cannot be used for rope_type {kind!r}: "
                f"{exc!r}; give every parameter that rope type needs (see transformers' RopeParameters)"
            ) from exc
    if tuple(inv_freq.shape) != (_head_dim(config) // 2,):
        raise ModelLoadError(
            f"{config.model_type}: rope_parameters {params} give {tuple(inv_freq.shape)} frequencies, "
            f"a head of {_head_dim(config)} dimensions needs {_head_dim(config) // 2}"
        )
    inv_freq = inv_freq.detach().to(torch.float32).cpu()
    scaling = float(scaling)
    return lambda: (inv_freq.clone(), scaling)
