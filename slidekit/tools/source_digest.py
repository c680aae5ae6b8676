"""A digest of the engine's source: every file under slidekit/ and plugins/ of a checkout.

Two trees with the same digest run the same code, whatever else (docs, tests, benchmark records)
differs between their commits. The GPU gate's record names it (``benchmarks/gpu_gate.py --check``
compares it with a commit's), and ``slidekit bench --continue`` requires it of the records it adds to,
so a suite measured over several device calls is one code's measurement.

Test: ``pytest tests/test_gpu_gate.py tests/test_bench_continue.py``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["REPO_ROOT", "SOURCE_DIRS", "source_digest", "source_files"]

#: The checkout this package was imported from (an installed wheel has no plugins/ beside it).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The directories whose every source file the digest covers.
SOURCE_DIRS = ("slidekit", "plugins")
#: What a source digest leaves out: build products and caches, never code.
IGNORED_PARTS = frozenset({"__pycache__", ".pytest_cache", "build", ".mypy_cache", ".ruff_cache"})
IGNORED_SUFFIXES = frozenset({".pyc", ".pyo", ".so", ".o"})


def source_files(root: Path = REPO_ROOT) -> list[Path]:
    """Every source file under slidekit/ and plugins/ of ``root``, sorted (caches and build products left out)."""
    out = []
    for top in SOURCE_DIRS:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root)
            ignored = IGNORED_PARTS & set(rel.parts) or any(p.endswith(".egg-info") for p in rel.parts)
            if path.is_file() and not ignored and path.suffix not in IGNORED_SUFFIXES:
                out.append(path)
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def source_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the relative path and bytes of every source file under slidekit/ and plugins/."""
    h = hashlib.sha256()
    for path in source_files(root):
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(len(rel).to_bytes(8, "little") + rel + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()
