"""Triton kernels shared by the ``triton_cuda`` and ``triton_rocm`` kernel sets.

One source for both vendors; the only differences (launch sizes, availability
probes) live in ``vendors.py``. Each op is layered bottom to top as in
Liger-Kernel: ``_xxx_fwd_kernel`` / ``_xxx_bwd_kernel`` (``@triton.jit``), the
host launchers ``xxx_forward`` / ``xxx_backward``, an ``autograd.Function``,
and the functional the kernel set exposes:

    rms_norm.py        RMSNorm (FP32 statistics, cast, times weight), dx and dweight
    rope.py            rotary embedding of q and k in one launch, forward and backward
    swiglu.py          silu(gate) * up, forward and backward
    cross_entropy.py   fused linear + cross-entropy over token chunks (loss and grads in forward)
    kernel_set.py      ``TritonKernelSet``: the five ops behind the ``KernelSet`` protocol

Loops over runtime bounds are written as ``while`` loops: the interpreter of
triton <= 3.6 cannot take a runtime bound in ``range()`` under NumPy >= 2.4
(triton-lang/triton#9171), and these loops (plain loads, no ``tl.dot``) gain
nothing from the software pipelining ``range()`` would allow when compiled.

Importing this package (or ``vendors``) does not import triton; the other
modules do, so they are imported only once a kernel set is built.

Test: ``pytest tests/plugins/test_triton_kernels.py`` (interpreter on the CPU, compiled on a GPU).
"""

from slidekit_kernels.triton_common.vendors import AMD, LAUNCH_CONFIGS, NVIDIA, LaunchConfig, availability

__all__ = ["AMD", "LAUNCH_CONFIGS", "NVIDIA", "LaunchConfig", "availability"]
