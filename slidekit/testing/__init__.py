"""Test helpers for slidekit and for plugin authors: the reference loop, tiny models, comparisons."""
