"""Bundled optimizer plugins for slidekit: ``layer_adam`` (AdamW, FP32 moments, fused C++ kernel) and
``adamw_8bit`` (AdamW with block-wise 8-bit quantized moments)."""
