"""Checkpoint store: bitwise round trips, atomic commit, failures through the handle, damage detection.

Crashes are injected through the writer's ``progress`` callback (an exception, or ``os._exit`` in a
child process for a hard crash); a full disk is simulated for real with ``RLIMIT_FSIZE``, so the error
comes from the kernel through tensorstore.

Run: ``pytest tests/test_checkpoint.py`` (about 10 s on a 2-core CPU).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from slidekit import checkpoint as ck

SMALL_CHUNK = 64  # bytes: arrays of a few dozen elements span several chunks and checksum segments
CHUNK = 1024  # bytes: still several chunks per array elsewhere, with fewer files to fsync
SHAPES = [(), (1,), (7,), (1001,), (3, 5, 7), (0, 4), (257, 3)]


@pytest.fixture
def make_writer(tmp_path: Path) -> Iterator[Callable[..., ck.CheckpointWriter]]:
    writers: list[ck.CheckpointWriter] = []

    def make(**kwargs: object) -> ck.CheckpointWriter:
        kwargs.setdefault("chunk_bytes", CHUNK)
        w = ck.CheckpointWriter(kwargs.pop("directory", tmp_path / "ckpt"), **kwargs)  # type: ignore[arg-type]
        writers.append(w)
        return w

    yield make
    for w in writers:
        w.close(timeout=30)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, -0.0, infinities, extremes) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "master/0": random_bits((1001,), torch.float32, seed),
        "state/0/exp_avg": random_bits((1001,), torch.float32, seed + 1),
        "master/1": random_bits((333,), torch.bfloat16, seed + 2),
        "state/1/exp_avg": random_bits((333,), torch.float32, seed + 3),
    }


def save_ok(writer: ck.CheckpointWriter, step: int, seed: int = 0) -> Path:
    return writer.save(step, tensors(seed), {"step": step}).result(timeout=30)


def tmp_dirs(directory: Path) -> list[Path]:
    return sorted(directory.glob(".tmp-*"))


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.int8, torch.int64, torch.float16, torch.bool]
)
def test_round_trip_is_bitwise(make_writer, dtype):
    src = {f"x/{i}": random_bits(shape, dtype, seed=i) for i, shape in enumerate(SHAPES)}
    path = make_writer(chunk_bytes=SMALL_CHUNK).save(3, src, {}).result(timeout=30)
    for name, t in src.items():
        assert same_bits(ck.read(path, name), t), name
        dst = torch.full(t.shape, 1, dtype=dtype)
        ck.read_into(path, name, dst)
        assert same_bits(dst, t), name
    ck.verify(path)


def test_deferred_tensors_are_produced_in_order_and_bounded(make_writer):
    """Data not in memory is produced on the writer thread, at most max_inflight at a time."""
    produced: list[str] = []
    live = [0]
    peak = [0]

    def maker(name: str, seed: int):
        def produce() -> torch.Tensor:
            produced.append(name)
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            return random_bits((5000,), torch.float32, seed)

        return produce

    writer = make_writer(
        chunk_bytes=SMALL_CHUNK,
        max_inflight=2,
        progress=lambda stage, d: live.__setitem__(0, live[0] - 1) if stage == "array" else None,
    )
    src = {f"state/{i}": ck.Deferred(torch.float32, (5000,), maker(f"state/{i}", i)) for i in range(6)}
    path = writer.save(1, src, {}).result(timeout=30)
    assert produced == list(src)
    assert peak[0] <= 3  # max_inflight in flight plus the one being started
    for i in range(6):
        assert same_bits(ck.read(path, f"state/{i}"), random_bits((5000,), torch.float32, i))


def test_a_deferred_tensor_that_breaks_its_promise_fails_the_save(make_writer, tmp_path):
    bad = ck.Deferred(torch.float32, (10,), lambda: torch.zeros(11))
    handle = make_writer().save(1, {"x": bad}, {})
    with pytest.raises(ck.CheckpointError, match=r"promised torch.float32 \(10,\)"):
        handle.result(timeout=30)


def test_format_is_plain_zarr3_with_documented_checksums(make_writer):
    import tensorstore as ts

    src = {"master/3": random_bits((1001,), torch.float32, 1), "small": random_bits((5,), torch.bfloat16, 2)}
    path = make_writer(chunk_bytes=1024).save(7, src, {}).result(timeout=30)
    assert path.name == "step-00000007"
    store = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / "arrays/master%2F3")}}
    ).result()
    assert store.dtype.name == "float32" and store.shape == (1001,)
    assert store.chunk_layout.read_chunk.shape == (256,)  # 1024-byte chunks of float32
    assert same_bits(torch.from_numpy(store.read().result()), src["master/3"])  # readable without slidekit
    man = ck.read_manifest(path)
    raw = src["small"].view(torch.uint8).numpy().tobytes()
    assert man.arrays["small"].checksum == hashlib.sha256(raw).hexdigest()  # one segment: plain sha256
    big = src["master/3"].view(torch.uint8).numpy().tobytes()
    segs = [hashlib.sha256(big[a : a + 1024]).digest() for a in range(0, len(big), 1024)]
    assert man.arrays["master/3"].checksum == hashlib.sha256(b"".join(segs)).hexdigest()
    assert man.arrays["master/3"].nbytes == 4004 and man.step == 7


def test_names_are_encoded_injectively():
    names = ["a/b", "a%2Fb", "a_b", ".", "..", ".hidden", "héllo wörld", "state/3/exp_avg"]
    dirs = [ck.array_dir_name(n) for n in names]
    assert len(set(dirs)) == len(names)
    assert all("/" not in d and not d.startswith(".") and d for d in dirs)
    with pytest.raises(ck.CheckpointError, match="non-empty"):
        ck.array_dir_name("")


def test_names_round_trip(make_writer):
    names = ["a/b", "a%2Fb", "..", "héllo wörld"]
    src = {n: torch.full((3,), float(i)) for i, n in enumerate(names)}
    path = make_writer().save(1, src).result(timeout=30)
    assert all(torch.equal(ck.read(path, n), t) for n, t in src.items())
    assert list(ck.read_manifest(path).arrays) == names  # write order is kept


def test_meta_round_trip_with_rng_state(make_writer):
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        rng = torch.get_rng_state()
        expected = torch.rand(4)  # what the saved RNG state draws next
    meta = {
        "step": 1234,
        "schedule": {"lr": 3e-4, "warmup": 100, "name": "cosine"},
        "data": {"epoch": 2, "offset": 2**53 + 1, "files": ["a.jsonl", "b.jsonl"]},
        "rng": {"torch": ck.encode_tensor(rng)},
        "model": "Qwen/Qwen2.5-0.5B",
        "flags": [True, False, None],
        "text": "ünïcode ✓",
    }
    path = make_writer().save(1234, tensors(), meta).result(timeout=30)
    back = ck.load_meta(path)
    assert back == meta
    restored = ck.decode_tensor(back["rng"]["torch"])
    assert same_bits(restored, rng)
    with torch.random.fork_rng():
        torch.set_rng_state(restored)
        assert torch.equal(torch.rand(4), expected)


def test_bad_arguments_are_refused_at_once(make_writer, tmp_path):
    w = make_writer()
    with pytest.raises(ck.CheckpointError, match="JSON-serialisable"):
        w.save(1, tensors(), {"bad": torch.zeros(1)})
    with pytest.raises(ck.CheckpointError, match="cannot be checkpointed; supported"):
        w.save(1, {"q": torch.zeros(2, dtype=torch.float8_e5m2fnuz)})
    with pytest.raises(ck.CheckpointError, match="non-negative int"):
        w.save(-1, tensors())
    with pytest.raises(ck.CheckpointError, match="keep must be at least 1"):
        ck.CheckpointWriter(tmp_path, keep=0)
    with pytest.raises(ck.CheckpointError, match="unknown checksum 'md5'; choose"):
        ck.CheckpointWriter(tmp_path, checksum="md5")
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    save_ok(w, 1)
    with pytest.raises(ck.CheckpointError, match="already exists; pass overwrite=True"):
        w.save(1, tensors())
    replaced = w.save(1, tensors(seed=9), {"v": 2}, overwrite=True).result(timeout=30)
    assert ck.load_meta(replaced) == {"v": 2} and same_bits(
        ck.read(replaced, "master/0"), tensors(9)["master/0"]
    )
    w.close()
    with pytest.raises(ck.CheckpointError, match="closed"):
        w.save(2, tensors())


def test_xxh3_checksums(make_writer):
    pytest.importorskip("xxhash")
    path = make_writer(checksum="xxh3_128").save(1, tensors()).result(timeout=30)
    assert ck.read_manifest(path).checksum == "xxh3_128"
    ck.verify(path)


# --------------------------------------------------------------------------- asynchrony and ordering


def test_tensor_futures_complete_in_order_and_before_the_commit(make_writer):
    gate, events = threading.Event(), []

    def progress(stage: str, detail: str) -> None:
        if (stage, detail) == ("array", "master/0"):
            assert gate.wait(30), "the test never released the writer"

    w = make_writer(progress=progress, max_inflight=3)
    src = tensors()
    handle = w.save(5, src, {})
    for name in handle.names:
        handle.future(name).add_done_callback(lambda _f, n=name: events.append(n))
    handle.add_done_callback(lambda h: events.append("commit"))
    handle.wait_for("master/0", timeout=30)  # returns while the writer is still held after that array
    assert not handle.future("state/1/exp_avg").done() and not handle.done()
    original = src["master/0"].clone()
    src["master/0"].zero_()  # the engine's next update: allowed now, and must not reach the checkpoint
    with pytest.raises(TimeoutError, match="not written within"):
        handle.wait_for("state/1/exp_avg", timeout=0.05)
    gate.set()
    assert handle.result(timeout=30) == handle.path
    assert events == [*src, "commit"]
    ck.verify(handle.path)
    assert same_bits(ck.read(handle.path, "master/0"), original)
    with pytest.raises(KeyError, match="saves no tensor 'nope'"):
        handle.wait_for("nope")


def test_concurrent_saves_are_queued(make_writer):
    gate, held = threading.Event(), threading.Event()
    committed: list[int] = []

    def progress(stage: str, detail: str) -> None:
        if stage == "commit" and "step-00000001" in detail:
            held.set()
            assert gate.wait(30)
        if stage == "committed":
            committed.append(int(Path(detail).name.split("-")[1]))

    w = make_writer(progress=progress)
    first = w.save(1, tensors(1))
    second = w.save(2, tensors(2))  # returns at once: queued behind the first
    assert held.wait(30), "the first save never reached its commit"  # every array of the first is written
    assert not first.done() and not second.done() and w.pending == 2
    assert not any(second.future(n).done() for n in second.names)  # not even started
    with pytest.raises(ck.CheckpointError, match="already queued"):
        w.save(2, tensors())
    gate.set()
    assert second.result(timeout=30).name == "step-00000002" and first.done()
    assert committed == [1, 2] and w.pending == 0
    assert same_bits(ck.read(first.result(), "master/0"), tensors(1)["master/0"])


def test_retention_keeps_exactly_the_last_k_and_deletes_after_commit(make_writer, tmp_path):
    seen_at_commit: list[list[str]] = []

    def progress(stage: str, detail: str) -> None:
        if stage == "commit":
            seen_at_commit.append(sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")))

    w = make_writer(keep=2, progress=progress)
    handles = [w.save(s, tensors(s), {"step": s}) for s in (10, 20, 30, 40)]
    assert [h.result(timeout=30).name for h in handles][-1] == "step-00000040"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000030", "step-00000040"]
    assert seen_at_commit[2] == [
        "step-00000010",
        "step-00000020",
    ]  # older ones still there until step 30 lands
    assert ck.latest(tmp_path / "ckpt").name == "step-00000040"


# --------------------------------------------------------------------------- failures


class Injected(RuntimeError):
    pass


@pytest.mark.parametrize("stage", ["array", "manifest", "commit"])
def test_crash_before_rename_keeps_the_previous_checkpoint(make_writer, tmp_path, stage):
    armed = threading.Event()

    def progress(s: str, detail: str) -> None:
        if armed.is_set() and s == stage and detail != "master/0":
            raise Injected(f"simulated crash at {s}")

    w = make_writer(progress=progress)
    good = save_ok(w, 1, seed=1)
    armed.set()
    handle = w.save(2, tensors(2), {"step": 2})
    err = handle.exception(timeout=30)
    assert isinstance(err, ck.CheckpointError) and isinstance(err.__cause__, Injected)
    assert "step 2 was not saved" in str(err) and "earlier checkpoints are untouched" in str(err)
    with pytest.raises(ck.CheckpointError, match="simulated crash"):
        handle.result()
    if stage == "array":  # the first tensor was written; the ones after it were released unwritten
        handle.wait_for("master/0")
        with pytest.raises(ck.CheckpointError, match="simulated crash"):
            handle.wait_for("state/1/exp_avg")
    assert all(handle.future(n).done() for n in handle.names)
    assert tmp_dirs(tmp_path / "ckpt") == []
    assert ck.latest(tmp_path / "ckpt") == good and not (tmp_path / "ckpt/step-00000002").exists()
    assert same_bits(ck.read(good, "master/0"), tensors(1)["master/0"])


@pytest.mark.parametrize(
    ("keep", "fix"),
    [
        (3, r"keep fewer checkpoints \(keep=3 now\)"),
        (1, r"larger disk \(keep=1 still needs room for 2 checkpoints\)"),
        (None, r"bound the checkpoints kept"),
    ],
)
def test_disk_full_error_names_the_fix(make_writer, tmp_path, keep, fix):
    def progress(stage: str, detail: str) -> None:
        if stage == "array" and detail == "master/1":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    w = make_writer(progress=progress, keep=keep)
    handle = w.save(1, tensors())
    nbytes = sum(t.numel() * t.element_size() for t in tensors().values())
    error = handle.exception(timeout=30)
    text = str(error)
    assert isinstance(error, ck.CheckpointError)
    assert re.search(r"No space left.*array 'master/1'.*free space where ", text), text
    assert f"a checkpoint takes {nbytes / 2**30:.2f} GiB" in text and "GiB are free" in text
    assert re.search(fix, text), text
    if keep == 1:
        assert "keep fewer" not in text  # there is no fewer than one
    assert tmp_dirs(tmp_path / "ckpt") == [] and ck.latest(tmp_path / "ckpt") is None


def test_the_retention_fix_is_worded_once_for_every_setting_that_names_it():
    """The save's full-disk error and the planner's refusal word the keep fix the same way."""
    assert ck.fewer_checkpoints(3, "run.keep") == "keep fewer checkpoints (run.keep=3 now)"
    assert ck.fewer_checkpoints(None, "keep") == "bound the checkpoints kept (keep=None keeps every one)"
    assert ck.fewer_checkpoints(1, "run.keep") is None  # the newest goes only after the next commits


def test_real_file_size_limit_error_surfaces_through_the_handle(make_writer, tmp_path):
    """RLIMIT_FSIZE makes the kernel fail tensorstore's chunk write with EFBIG, like a full disk."""
    w = make_writer(chunk_bytes=1 << 20)
    good = w.save(1, {"w": torch.zeros(16)}).result(timeout=30)
    big = {"w": torch.randn(64 * 1024)}  # one 256 KiB chunk file
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, old_limit[1]))
    try:
        err = w.save(2, big).exception(timeout=30)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert isinstance(err, ck.CheckpointError), err
    assert "File too large" in str(err) and "free space" in str(err), str(err)
    assert tmp_dirs(tmp_path / "ckpt") == [] and ck.latest(tmp_path / "ckpt") == good


_HARD_CRASH = """
import os, sys, torch
from slidekit import checkpoint as ck
def progress(stage, detail):
    if stage == "commit" and "step-00000002" in detail:
        os._exit(17)  # the process dies with everything synced, just before the rename
w = ck.CheckpointWriter(sys.argv[1], chunk_bytes=64, progress=progress)
w.save(1, {"w": torch.arange(100.0)}, {"step": 1}).result()
w.save(2, {"w": torch.arange(100.0) * 2}, {"step": 2}).result()
"""


def test_hard_crash_leaves_only_an_ignored_tmp_dir(tmp_path):
    directory = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _HARD_CRASH, str(directory)], capture_output=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr.decode()
    (left,) = tmp_dirs(directory)
    assert (left / "manifest.json").is_file()  # complete in every way except the rename
    path = ck.latest(directory, cleanup=False)
    assert path is not None and path.name == "step-00000001" and ck.load_meta(path) == {"step": 1}
    assert tmp_dirs(directory) == [left]
    assert ck.latest(directory) == path and tmp_dirs(directory) == []  # its writer is dead: cleaned up


def test_cleanup_spares_a_tmp_dir_whose_writer_is_alive(make_writer, tmp_path, monkeypatch):
    # A lock-less dir counts as a writer's first instant for _STALE_UNLOCKED_S of wall-clock time after
    # its mtime; made endless here, so that a slow run (or a clock step) cannot age it mid-test.
    monkeypatch.setattr(ck._disk, "_STALE_UNLOCKED_S", float("inf"))
    directory = tmp_path / "ckpt"
    save_ok(make_writer(), 1)
    live = directory / ".tmp-step-00000002-feedbeef"
    live.mkdir()
    fd = os.open(live / ".writer.lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    young = directory / ".tmp-step-00000003-00000000"  # no lock yet: a writer's first instant
    young.mkdir()
    try:
        assert ck.latest(directory).name == "step-00000001"
        assert live.is_dir() and young.is_dir()
    finally:
        os.close(fd)
    assert ck.latest(directory).name == "step-00000001" and not live.exists() and young.is_dir()


_KILLED_IN_RETENTION = """
import os, shutil, sys, torch
from slidekit import checkpoint as ck
real = shutil.rmtree
def rmtree(path, *args, **kwargs):
    if ".tmp-delete-" in str(path):
        os._exit(17)  # killed between retention's rename and its delete
    return real(path, *args, **kwargs)
shutil.rmtree = rmtree
w = ck.CheckpointWriter(sys.argv[1], keep=1, chunk_bytes=64)
w.save(1, {"w": torch.arange(100.0)}, {"step": 1}).result()
w.save(2, {"w": torch.arange(100.0) * 2}, {"step": 2}).result()
"""


def test_a_kill_during_retention_leaves_nothing_after_the_next_cleanup(tmp_path):
    directory = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_IN_RETENTION, str(directory)], capture_output=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr.decode()
    (left,) = tmp_dirs(directory)
    assert left.name.startswith(".tmp-delete-step-00000001-")  # seconds old: no writer's work in progress
    assert ck.remove_leftovers(directory) == [left] and tmp_dirs(directory) == []
    path = ck.latest(directory)
    assert path is not None and path.name == "step-00000002" and ck.load_meta(path) == {"step": 2}


def test_quarantine_moves_a_damaged_checkpoint_aside_and_frees_its_step(make_writer, tmp_path):
    directory = tmp_path / "ckpt"
    w = make_writer(keep=None)
    good = save_ok(w, 1, seed=1)
    bad = save_ok(w, 2, seed=2)
    (bad / "meta.json").write_text("{}")
    with pytest.warns(RuntimeWarning, match=r"skipping damaged checkpoint .*meta\.json.*moved it aside to"):
        assert ck.latest(directory, quarantine=True) == good
    (aside,) = directory.glob("damaged-step-00000002-*")
    assert not bad.exists() and "meta.json does not match" in (aside / "DAMAGED.txt").read_text()
    assert [s for s, _ in ck.step_dirs(directory)] == [1]
    assert save_ok(w, 2, seed=3) == bad  # the step can be written again, without overwrite=True
    assert ck.latest(directory) == bad and same_bits(ck.read(bad, "master/0"), tensors(3)["master/0"])
    assert aside.is_dir()  # nothing was deleted: a person decides


# --------------------------------------------------------------------------- damage and mismatch


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path) -> None:
    doc = json.loads(path.read_bytes())
    doc["arrays"]["master/0"]["shape"] = [1002]
    path.write_text(json.dumps(doc))


DAMAGE = {
    "flipped bit": ("arrays/master%2F0/c/3", _flip_byte, "fails its sha256 checksum"),
    "truncated chunk": (
        "arrays/master%2F0/c/3",
        lambda p: p.write_bytes(p.read_bytes()[:10]),
        "has 10 bytes, not 1024",
    ),
    "missing chunk": ("arrays/master%2F0/c/3", Path.unlink, "c/3 is missing"),
    "missing array": ("arrays/master%2F1", shutil.rmtree, "zarr.json is missing"),
    "edited meta": (
        "meta.json",
        lambda p: p.write_text('{"step": 99}'),
        "meta.json does not match its checksum",
    ),
    "edited manifest": ("manifest.json", _edit_manifest, "fails its own checksum"),
    "garbage manifest": ("manifest.json", lambda p: p.write_text("{not json"), "unreadable or incomplete"),
    "no manifest": ("manifest.json", Path.unlink, "no manifest.json"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_detected_and_skipped(make_writer, tmp_path, kind):
    relpath, damage, message = DAMAGE[kind]
    w = make_writer(keep=None)
    good = save_ok(w, 1, seed=1)
    bad = save_ok(w, 2, seed=2)
    damage(bad / relpath)
    with pytest.raises(ck.CheckpointCorrupt, match=message):
        ck.verify(bad)
    quick = kind != "flipped bit"  # the default latest() stats files; only verify_data hashes them
    with pytest.warns(RuntimeWarning, match=f"skipping damaged checkpoint .*{message}"):
        assert ck.latest(tmp_path / "ckpt", verify_data=not quick) == good
    if kind in ("flipped bit", "truncated chunk", "missing chunk"):
        with pytest.raises(ck.CheckpointCorrupt, match="'master/0'"):
            ck.read_into(bad, "master/0", torch.empty(1001))
    if kind == "edited meta":
        with pytest.raises(ck.CheckpointCorrupt, match=r"meta\.json"):
            ck.load_meta(bad)
    ck.verify(good)


def test_incompatible_expectations_are_refused(make_writer):
    path = save_ok(make_writer(), 1)
    expected = {n: t for n, t in tensors().items()}
    ck.verify_compatible(path, expected)
    ck.verify_compatible(path, {n: (t.dtype, t.shape) for n, t in expected.items()})
    with pytest.raises(
        ck.CheckpointMismatch,
        match=r"'master/0': checkpoint has torch.float32 \(1001,\), expected torch.float32 \(1000,\)",
    ):
        ck.verify_compatible(path, {**expected, "master/0": (torch.float32, (1000,))})
    with pytest.raises(
        ck.CheckpointMismatch, match=r"'master/1': checkpoint has torch.bfloat16.*expected torch.float16"
    ):
        ck.verify_compatible(path, {**expected, "master/1": torch.zeros(333, dtype=torch.float16)})
    with pytest.raises(ck.CheckpointMismatch, match=r"model/config: missing arrays \['master/2'\]"):
        ck.verify_compatible(path, {**expected, "master/2": torch.zeros(3)})
    fewer = {n: t for n, t in expected.items() if not n.endswith("/1") and "1/" not in n}
    with pytest.raises(ck.CheckpointMismatch, match=r"unexpected arrays \['master/1', 'state/1/exp_avg'\]"):
        ck.verify_compatible(path, fewer)
    ck.verify_compatible(path, fewer, allow_extra=True)
    with pytest.raises(
        ck.CheckpointMismatch, match=r"is torch.float32 \(1001,\), but the destination is torch.bfloat16"
    ):
        ck.read_into(path, "master/0", torch.empty(1001, dtype=torch.bfloat16))
    with pytest.raises(ck.CheckpointMismatch, match="has no array 'master/9'"):
        ck.read(path, "master/9")
