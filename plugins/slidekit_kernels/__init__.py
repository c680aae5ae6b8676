"""Bundled kernel-set plugins for slidekit: ``torch_ref`` (plain PyTorch, runs anywhere)."""
