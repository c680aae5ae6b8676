"""Bundled optimizer plugins for slidekit: ``layer_adam`` (AdamW over one unit's flat vector)."""
