"""Bundled kernel-set plugins for slidekit: ``torch_ref`` (plain PyTorch, runs anywhere), ``triton_cuda``
and ``triton_rocm`` (Triton kernels with NVIDIA / AMD launch configurations, sharing ``triton_common``)."""
