"""Checkpoint store: named tensors and metadata, written asynchronously and atomically, verified on load.

A fine-tune runs for days; this module makes sure a crash, a full disk or a damaged file never costs more
than the steps since the last good checkpoint.

On-disk format (version 1), one directory per checkpoint under a run's checkpoint directory::

    step-00001234/
      manifest.json          format + version, step, checksum algorithm, and per array: dtype, shape,
                             byte count, chunk shape, segment checksums and the array checksum;
                             plus meta.json's size and sha256, and a sha256 of the manifest itself
      meta.json              the caller's JSON metadata (step, schedule, data position, RNG states, config)
      arrays/<encoded name>/ one zarr v3 array per named tensor (tensorstore, driver "zarr3"):
        zarr.json            shape, data type (bfloat16 included), regular chunk grid, "bytes" codec
        c/<i>/<j>/...        one uncompressed file per chunk (little-endian raw elements)

Array names are free-form ("master/3", "state/3/exp_avg"); the directory name keeps ``[A-Za-z0-9_.-]``
and percent-encodes every other byte of the UTF-8 name ("master%2F3"), which is injective, so two names
never share a directory. Chunks split dimension 0 into blocks of about ``chunk_bytes`` (64 MiB), so
writes parallelise and a reader can fetch part of an array. Every chunk is stored, even an all-zero one,
so a missing chunk file is damage, not zeros. Checksums (sha256 by default, or xxh3-128 from ``xxhash``)
cover the raw little-endian bytes of the flattened tensor in segments of ``chunk_bytes`` bytes, hashed
in parallel; the array checksum is the segment digest when there is one segment (so it is the plain hash
of the raw bytes) and otherwise the hash of the concatenated binary segment digests. Float NaN payloads,
-0.0 and every integer bit pattern round-trip bitwise. The arrays are plain zarr v3: any zarr reader
opens them without slidekit.

Commit protocol (``CheckpointWriter.save``): everything is written into ``.tmp-step-00001234-<random>/``
beside the final directory; every file and directory in it is fsynced (chunk files by tensorstore's
``file_io_sync``, the rest here); it is renamed to ``step-00001234`` (atomic on POSIX) and the parent
directory is fsynced. A crash, an exception or a full disk before the
rename leaves only a ``.tmp-*`` directory: it is never taken for a checkpoint, and the next successful
save, ``latest()`` or ``remove_leftovers()`` removes it (one whose writer still holds its ``.writer.lock``
flock is left alone). Retention (``keep``) deletes older complete checkpoints only after the new one is
committed, and deletes by renaming to ``.tmp-delete-*`` first, so a crash mid-delete never leaves a
half-deleted ``step-*`` (and the ``.tmp-delete-*`` it leaves goes at the next cleanup, whatever its age);
damaged checkpoints are neither counted nor deleted. ``quarantine()`` moves a damaged checkpoint aside
to ``damaged-step-*`` (kept for a person to inspect) so that its step can be written again.
``overwrite=True`` replaces an existing step: the old directory is renamed aside just before the new
one is renamed in (a crash between the two loses that step, never an older one). One writer per
directory: two processes saving into it are not supported.

Guarantees: ``latest()`` returns only a directory whose manifest is intact, whose meta.json matches its
checksum and whose chunk files all exist at their exact sizes (``verify_data=True`` also hashes every
byte). ``read_into`` checks dtype, shape and every segment checksum. ``verify_compatible`` refuses a
checkpoint of another model or config and names each difference. Damage is reported as
``CheckpointCorrupt`` naming the array, file or checksum at fault; mismatches as ``CheckpointMismatch``.

How the engine uses the per-tensor futures: at a step boundary it calls
``handle = writer.save(step, {"master/0": m0, "state/0/exp_avg": ..., ...}, meta)`` with the units in the
order it will next modify them, and returns to training at once. Writes go in that order on a background
thread. Before the optimizer next updates unit ``i`` in place it calls
``handle.wait_for("master/i", "state/i/exp_avg", ...)``: that returns as soon as those tensors are written,
while later units are still being written. If the save fails, ``wait_for`` raises ``CheckpointError``;
either way the writer no longer reads those tensors afterwards, so the update may proceed.
``handle.result()`` returns the committed path (after retention has run) or raises the error. A save
requested while another is still running is queued (FIFO, one writer thread); its tensors are not read
before the earlier save has finished. Resuming: ``path = latest(directory)``, then
``verify_compatible(path, {name: tensor, ...})``, ``load_meta(path)`` and ``read_into(path, name, t)``
for every tensor; ``read_range(path, name, start, stop, dst)`` reads part of a flat array, checking
the segments it touches (a data-parallel resume into another world size reads each new shard's
ranges that way). ``read_into`` is where a flipped bit shows, so a run's resume (``slidekit.resume``)
quarantines a checkpoint that fails there too and falls back to the next older one.

A full disk: the save's error says how large the checkpoint is and how much is free, and suggests a
lower ``keep`` only where one is possible (with ``keep=1`` the disk still holds two checkpoints while
the new one commits).

Test: ``pytest tests/test_checkpoint.py`` (about 15 s on a 2-core CPU).
"""

from __future__ import annotations

from slidekit.checkpoint._disk import (
    fewer_checkpoints,
    quarantine,
    remove_leftovers,
    set_aside,
    step_dir,
    step_dirs,
)
from slidekit.checkpoint._format import (
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    array_dir_name,
    decode_tensor,
    encode_tensor,
)
from slidekit.checkpoint._handle import Deferred, SaveHandle
from slidekit.checkpoint._range import read_range
from slidekit.checkpoint._read import (
    ArrayInfo,
    Manifest,
    latest,
    load_meta,
    problems,
    read,
    read_into,
    read_manifest,
    verify,
    verify_compatible,
)
from slidekit.checkpoint._write import CheckpointWriter

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "ArrayInfo",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointWriter",
    "Deferred",
    "Manifest",
    "SaveHandle",
    "array_dir_name",
    "decode_tensor",
    "encode_tensor",
    "fewer_checkpoints",
    "latest",
    "load_meta",
    "problems",
    "quarantine",
    "read",
    "read_into",
    "read_manifest",
    "read_range",
    "remove_leftovers",
    "set_aside",
    "step_dir",
    "step_dirs",
    "verify",
    "verify_compatible",
]
