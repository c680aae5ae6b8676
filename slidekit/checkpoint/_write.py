"""Writing checkpoints: ``CheckpointWriter``, its background thread, commit and retention.

See ``slidekit.checkpoint`` for the commit protocol and how the engine uses the per-tensor futures.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slidekit.atomic import fsync_path, fsync_tree, rename_aside, write_synced
from slidekit.checkpoint._disk import (
    _REPLACED,
    _cleanup_tmp,
    _make_tmp,
    _remove_checkpoint,
    _step_dirs,
    save_error,
)
from slidekit.checkpoint._format import (
    _LOCK,
    _MANIFEST,
    _META,
    DEFAULT_CHUNK_BYTES,
    FORMAT,
    FORMAT_VERSION,
    CheckpointError,
    _chunk_shape,
    _combine,
    _context,
    _dtype_name,
    _hash_segments,
    _raw,
    _resolve_checksum,
    _self_checksum,
    _step_name,
    _ts,
    _typed,
    array_dir_name,
)
from slidekit.checkpoint._handle import Deferred, SaveHandle
from slidekit.checkpoint._read import read_manifest


@dataclass(eq=False)
class _Job:
    step: int
    items: list[tuple[str, torch.Tensor | Deferred, str]]  # (name, CPU tensor or Deferred, dtype name)
    meta: bytes
    overwrite: bool
    handle: SaveHandle
    where: str = "waiting"  # what the writer was doing, for error messages


@dataclass(eq=False)
class _Write:
    name: str
    tensor: torch.Tensor
    dtype: str
    chunk: list[int]
    write: Any  # tensorstore WriteFutures, None for an empty array
    hashes: list[Future[str]]

    def done(self) -> bool:
        return (self.write is None or self.write.done()) and all(f.done() for f in self.hashes)

    def quiesce(self) -> None:
        """Wait until nothing reads the tensor any more (after a failure), ignoring errors."""
        for f in self.hashes:
            f.cancel()
        for f in self.hashes:
            if not f.cancelled():
                f.exception()
        if self.write is not None:
            self.write.exception()


def _array_spec(root: Path, name: str, dtype: str, shape: Sequence[int], chunk: list[int]) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(root)},
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "attributes": {"slidekit_name": name},
        },
        "store_data_equal_to_fill_value": True,  # every chunk is on disk: a missing one is damage
    }


def _start_write(store: Any, array: np.ndarray) -> Any:
    try:
        # No copy into tensorstore's cache: the caller keeps the tensor unchanged until its future completes.
        return store.write(array, can_reference_source_data_indefinitely=True)
    except TypeError:  # tensorstore without that option copies the source instead
        return store.write(array)


def _meta_bytes(meta: Mapping[str, Any]) -> bytes:
    if not isinstance(meta, Mapping):
        raise CheckpointError(f"checkpoint meta must be a mapping, got {type(meta).__name__}")
    try:
        return json.dumps(dict(meta), indent=1).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint meta must be JSON-serialisable: {exc}; encode tensors with encode_tensor() "
            "and bytes with base64"
        ) from exc


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("slidekit", "tensorstore"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "unknown"
    return out


class CheckpointWriter:
    """Writes a run's checkpoints into ``directory`` on a background thread (see the module docstring).

    Args:
        directory: where the ``step-*`` directories go (created when first needed).
        keep: how many complete checkpoints to keep, newest by step; None keeps them all.
        checksum: "sha256" (the default: any Python can verify it), "xxh3_128" (faster; verifying needs
            ``xxhash``) or "auto" (xxh3_128 when ``xxhash`` is installed, else sha256).
        chunk_bytes: target size of each zarr chunk and of each checksum segment.
        max_inflight: arrays being written at once (tensorstore also writes each array's chunks in parallel).
        hash_threads: threads hashing segments; default min(8, CPUs).
        progress: called on the writer thread as ``progress(stage, detail)``: ``("array", name)`` after each
            array is written, ``("manifest", tmp_dir)``, ``("commit", tmp_dir)`` when everything is synced,
            just before the rename, and ``("committed", final_dir)``. An exception raised before the rename
            aborts the save exactly as an I/O error would (tests inject crashes this way); one raised at
            "committed" becomes a warning.

    Concurrent saves are queued: ``save`` never blocks on an earlier save, and saves run one at a time
    in the order requested. Saving a step that is already queued is refused at once.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = 2,
        checksum: str = "sha256",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_inflight: int = 4,
        hash_threads: int | None = None,
        progress: Callable[[str, str], None] | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise CheckpointError(f"keep must be at least 1 (or None to keep all), got {keep}")
        if chunk_bytes < 1 or max_inflight < 1:
            raise CheckpointError(
                f"chunk_bytes and max_inflight must be positive, got {chunk_bytes}, {max_inflight}"
            )
        self.directory = Path(directory)
        self.keep = keep
        self.checksum = _resolve_checksum(checksum)
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self._hash_threads = hash_threads or min(8, os.cpu_count() or 1)
        self._progress = progress
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()  # queued and running, oldest first
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    # ---- public

    def save(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor | Deferred],
        meta: Mapping[str, Any] | None = None,
        *,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Queue checkpoint ``step`` of ``tensors`` (written in this order) and ``meta``; return at once.

        CPU tensors are read in place later: keep each unchanged until ``handle.wait_for(name)`` returns.
        Non-contiguous or non-CPU tensors are copied here, synchronously. ``meta`` is serialised here.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        if sys.byteorder != "little":  # pragma: no cover
            raise CheckpointError("checkpoints store little-endian bytes; this host is big-endian")
        items = [self._prepare(name, t) for name, t in tensors.items()]
        data = _meta_bytes({} if meta is None else meta)
        final = self.directory / _step_name(step)
        with self._lock:
            if self._closed:
                raise CheckpointError("this CheckpointWriter is closed; make a new one")
            if any(j.step == step for j in self._jobs):
                raise CheckpointError(f"checkpoint step {step} is already queued or being written")
            if final.exists() and not overwrite:
                raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
            job = _Job(step, items, data, overwrite, SaveHandle(step, [i[0] for i in items], final))
            self._jobs.append(job)
            if self._thread is None:
                # A daemon: a save stuck on hung storage must not keep the interpreter from exiting
                # (the run waits for its saves, bounded, before it returns or closes).
                self._thread = threading.Thread(target=self._worker, name="slidekit-checkpoint", daemon=True)
                self._thread.start()
        newer = [s for s, _ in _step_dirs(self.directory) if s > step]
        if newer:
            warnings.warn(
                f"{self.directory} already holds step {max(newer)} > {step}; latest() will prefer it",
                RuntimeWarning,
                stacklevel=2,
            )
        return job.handle

    @property
    def pending(self) -> int:
        """Saves queued or being written."""
        with self._lock:
            return len(self._jobs)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Wait until every save requested so far has committed or failed (errors stay on the handles)."""
        with self._lock:
            handles = [j.handle for j in self._jobs]
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            h.exception(left)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued saves, then release the writer's threads. Further saves are refused."""
        with self._lock:
            self._closed = True
        self.wait_idle(timeout)
        with self._lock:
            thread, pool, self._pool = self._thread, self._pool, None
        if thread is not None:
            thread.join(timeout)
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- caller side

    def _prepare(self, name: str, t: torch.Tensor | Deferred) -> tuple[str, torch.Tensor | Deferred, str]:
        if isinstance(t, Deferred):
            array_dir_name(name)
            return name, t, _dtype_name(t.dtype)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"checkpoint tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise CheckpointError(f"checkpoint tensor {name!r} has layout {t.layout}; pass a dense tensor")
        array_dir_name(name)  # validates the name
        dtype = _dtype_name(t.dtype)
        t = t.detach().resolve_conj().resolve_neg()
        if t.device.type != "cpu":
            t = t.to("cpu")
        return name, t.contiguous(), dtype

    # ---- writer thread

    def _worker(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs[0]
            try:
                self._run(job)
            except BaseException as exc:  # a bug here must still reach the caller, not hang it
                if not job.handle.done():
                    self._finish(job, error=self._error(job, exc))

    def _finish(self, job: _Job, *, path: Path | None = None, error: CheckpointError | None = None) -> None:
        with self._lock:
            self._jobs.remove(job)
        job.items = []
        if error is not None:
            job.handle._commit.set_exception(error)
        else:
            job.handle._commit.set_result(path)  # type: ignore[arg-type]

    def _error(self, job: _Job, exc: BaseException) -> CheckpointError:
        nbytes = sum(math.prod(t.shape) * t.dtype.itemsize for _, t, _ in job.items)
        return save_error(job.step, job.where, nbytes, exc, self.directory, self.keep)

    def _stage(self, stage: str, detail: str) -> None:
        if self._progress is not None:
            self._progress(stage, detail)

    def _hash_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._hash_threads, thread_name_prefix="slidekit-ckpt-hash")
            return self._pool

    def _run(self, job: _Job) -> None:
        tmp: Path | None = None
        lock_fd: int | None = None
        try:
            job.where = "creating the temporary directory"
            if not self.directory.is_dir():
                self.directory.mkdir(parents=True, exist_ok=True)
                fsync_path(self.directory.parent, directory=True)
            tmp, lock_fd = _make_tmp(self.directory, job.step)
            job.where = f"writing {_META}"
            write_synced(tmp / _META, job.meta)
            (tmp / "arrays").mkdir()
            arrays = self._write_arrays(job, tmp)
            job.where = f"writing {_MANIFEST}"
            write_synced(tmp / _MANIFEST, self._manifest(job, arrays))
            self._stage("manifest", str(tmp))
            job.where = "syncing files"
            fsync_tree(tmp, files=False)  # files synced by their writers (tensorstore, write_synced)
            self._stage("commit", str(tmp))
            job.where = "renaming into place"
            final = self._commit(job, tmp)
        except BaseException as exc:  # every failure must reach the handle, whatever it is
            error = self._error(job, exc)
            for fut in job.handle._tensors.values():
                if not fut.done():
                    fut.set_exception(error)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            if lock_fd is not None:
                os.close(lock_fd)
            self._finish(job, error=error)
            return
        # Committed. What follows can only warn: the checkpoint is good whatever happens now.
        with contextlib.suppress(OSError):
            os.unlink(final / _LOCK)
        os.close(lock_fd)
        try:
            self._prune()
            self._stage("committed", str(final))
        except Exception as exc:
            warnings.warn(
                f"checkpoint {final} committed, but afterwards: {exc!r}", RuntimeWarning, stacklevel=1
            )
        self._finish(job, path=final)

    def _write_arrays(self, job: _Job, tmp: Path) -> dict[str, dict[str, Any]]:
        """Write the arrays in order, ``max_inflight`` at a time; complete their futures in order."""
        written: dict[str, dict[str, Any]] = {}
        inflight: deque[_Write] = deque()
        try:
            for name, tensor, dtype in job.items:
                while len(inflight) >= self.max_inflight:
                    self._complete(job, inflight.popleft(), written)
                job.where = f"writing array {name!r}"
                if isinstance(tensor, Deferred):
                    tensor = self._produce(name, tensor)
                inflight.append(self._start(tmp, name, tensor, dtype))
                while inflight and inflight[0].done():
                    self._complete(job, inflight.popleft(), written)
            while inflight:
                self._complete(job, inflight.popleft(), written)
        except BaseException:
            for w in inflight:  # release every tensor before the handle reports the failure
                w.quiesce()
            raise
        return written

    @staticmethod
    def _produce(name: str, d: Deferred) -> torch.Tensor:
        t = d.produce()
        if t.dtype != d.dtype or tuple(t.shape) != tuple(d.shape) or t.device.type != "cpu":
            raise CheckpointError(
                f"deferred tensor {name!r} produced {t.dtype} {tuple(t.shape)} on {t.device}, "
                f"promised {d.dtype} {tuple(d.shape)} on the CPU"
            )
        return t.contiguous()

    def _start(self, tmp: Path, name: str, tensor: torch.Tensor, dtype: str) -> _Write:
        chunk = _chunk_shape(tensor.shape, tensor.element_size(), self.chunk_bytes)
        spec = _array_spec(tmp / "arrays" / array_dir_name(name), name, dtype, tensor.shape, chunk)
        store = _ts().open(spec, create=True, context=_context()).result()
        w = _Write(name, tensor, dtype, chunk, None, [])
        try:
            if tensor.numel():
                w.write = _start_write(store, _typed(tensor, dtype))
            w.hashes = _hash_segments(self.checksum, _raw(tensor), self.chunk_bytes, self._hash_pool())
        except BaseException:
            w.quiesce()
            raise
        return w

    def _complete(self, job: _Job, w: _Write, written: dict[str, dict[str, Any]]) -> None:
        job.where = f"writing array {w.name!r}"
        try:
            if w.write is not None:
                w.write.result()
            digests = [f.result() for f in w.hashes]
        except BaseException:
            w.quiesce()
            raise
        written[w.name] = {
            "dtype": w.dtype,
            "shape": list(w.tensor.shape),
            "nbytes": w.tensor.numel() * w.tensor.element_size(),
            "chunk_shape": w.chunk,
            "segments": digests,
            "checksum": _combine(self.checksum, digests),
        }
        job.handle._tensors[w.name].set_result(None)
        job.where = f"after writing array {w.name!r}"
        self._stage("array", w.name)

    def _manifest(self, job: _Job, arrays: dict[str, dict[str, Any]]) -> bytes:
        doc: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": job.step,
            "checksum": self.checksum,
            "chunk_bytes": self.chunk_bytes,
            "created_unix": time.time(),
            "writer": _versions(),
            "meta": {"file": _META, "bytes": len(job.meta), "sha256": hashlib.sha256(job.meta).hexdigest()},
            "arrays": arrays,
        }
        doc["manifest_sha256"] = _self_checksum(doc)
        return json.dumps(doc, indent=1).encode()

    def _commit(self, job: _Job, tmp: Path) -> Path:
        final = self.directory / _step_name(job.step)
        aside = None
        if final.exists():
            if not job.overwrite:
                raise CheckpointError(f"{final} appeared while saving; not replacing it (overwrite=False)")
            aside = rename_aside(final, _REPLACED)
        os.rename(tmp, final)  # the commit point
        fsync_path(self.directory, directory=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        return final

    def _prune(self) -> None:
        if self.keep is not None:
            complete = []
            for _step, path in _step_dirs(self.directory):
                try:
                    read_manifest(path)
                except CheckpointError:
                    continue  # damaged ones are left for a person to look at; latest() skips them
                complete.append(path)
            for path in complete[: -self.keep]:
                _remove_checkpoint(path)
        _cleanup_tmp(self.directory)
