"""Triton test files that run twice: compiled on a GPU, and on the CPU under ``TRITON_INTERPRET=1``.

Each such file imports its flags from here and has one ``test_interpreted_run`` that, on a CPU machine with
triton installed, runs the file again in a subprocess with the interpreter on (``rerun_interpreted``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

__all__ = ["HAVE_TRITON", "INTERPRETED", "ON_GPU", "rerun_interpreted"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
ON_GPU = torch.cuda.is_available() and not INTERPRETED


def rerun_interpreted(path: str, *, timeout: float = 3600, **env: str) -> subprocess.CompletedProcess[str]:
    """``pytest path`` in a subprocess with ``TRITON_INTERPRET=1`` (and ``env``).

    The timeout only turns a hang into a failure: a child that builds the fused CPU kernel from a cold cache
    took over 8 minutes on the loaded 2-core machine (docs/testing.md).
    """
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        env={**os.environ, "TRITON_INTERPRET": "1", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
