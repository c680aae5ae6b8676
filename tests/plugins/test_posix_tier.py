"""The posix tier: conformance, O_DIRECT and its fallback, directory errors, a full disk, file cleanup.

The conformance checks run three ways: O_DIRECT (where the temporary
directory allows it) with the default 16 MiB chunks; with 8 KiB chunks, so
that every transfer above 8 KiB is split and the partial-block rewrites at
chunk edges are exercised; and with buffered I/O.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import itertools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slidekit import Plugins
from slidekit.errors import ConfigError
from slidekit.interfaces import TierContext
from slidekit.testing.tiers import CHECKS, check_partial_regions, check_round_trips
from slidekit_tiers.posix import PosixTier, chunk_spans, direct_io_support, probe_direct_io

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VARIANTS = {"default": {}, "chunks-8k": {"chunk_bytes": 8192}, "buffered": {"direct": False}}


def _make(directory: Path | str | None, **options: object) -> PosixTier:
    return PosixTier(
        TierContext(device=DEVICE, directory=None if directory is None else str(directory), options=options)
    )


def _files(tier: PosixTier) -> list[str]:
    """The tier's region files (not the .owner file that marks the directory as a live run's)."""
    return sorted(f for f in os.listdir(tier.root) if f != ".owner")


# --------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(check, variant, tmp_path):
    check(lambda: _make(tmp_path, **VARIANTS[variant]))


def test_registered_through_its_entry_point():
    plugins = Plugins()
    assert plugins.get("tier", "posix").plugin == "posix"
    ok, reason = plugins.availability("tier", "posix")
    assert ok and "O_DIRECT" in reason and "buffered" in reason


# --------------------------------------------------------------------------- chunk geometry


@pytest.mark.parametrize("offset", [0, 1, 4095, 4096, 8190])
@pytest.mark.parametrize("nbytes", [0, 1, 4096, 4097, 20000])
@pytest.mark.parametrize("align", [1, 4096])
def test_chunk_spans_cover_the_transfer_on_aligned_bounds(offset, nbytes, align):
    chunk = 8192
    spans = chunk_spans(offset, nbytes, align, chunk)
    if nbytes == 0:
        assert spans == []
        return
    assert spans[0][0] <= offset and spans[-1][1] >= offset + nbytes
    assert spans[0][0] > offset - align and spans[-1][1] < offset + nbytes + align
    for (_, b), (c, _) in itertools.pairwise(spans):
        assert b == c  # contiguous, no overlap
    for a, b in spans:
        assert a % align == 0 and b % align == 0 and 0 < b - a <= chunk


# --------------------------------------------------------------------------- O_DIRECT


def _refuse_direct(monkeypatch):
    """Make every open with O_DIRECT fail as tmpfs on an older kernel does (EINVAL)."""
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_falls_back_to_buffered_io_where_o_direct_is_refused(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)  # stays on: after the probe, the tier must never ask for O_DIRECT
    assert direct_io_support(str(tmp_path), fresh=True) == (
        False,
        "the file system refuses O_DIRECT (Invalid argument)",
    )
    for check in (check_round_trips, check_partial_regions):
        check(lambda: _make(tmp_path))
    tier = _make(tmp_path)
    try:
        assert not tier.direct
        assert "buffered I/O (the file system refuses O_DIRECT" in tier.stats().detail
    finally:
        tier.close()


def test_o_direct_is_required_only_when_asked(tmp_path, monkeypatch):
    _refuse_direct(monkeypatch)
    direct_io_support(str(tmp_path), fresh=True)
    with pytest.raises(
        ConfigError, match=r"cannot do O_DIRECT: the file system refuses O_DIRECT.*leave direct at 'auto'"
    ):
        _make(tmp_path, direct=True)
    assert os.listdir(tmp_path) == []  # the failed tier left nothing behind


def test_o_direct_can_be_switched_off(tmp_path):
    tier = _make(tmp_path, direct=False)
    try:
        assert not tier.direct and "buffered I/O (O_DIRECT switched off" in tier.stats().detail
    finally:
        tier.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_dev_shm_runs_with_whatever_tmpfs_allows():
    """tmpfs takes O_DIRECT only on newer kernels: the tier must agree with a direct probe, and work."""
    truth, _ = probe_direct_io("/dev/shm")
    tier = _make("/dev/shm")
    try:
        assert tier.direct == truth
        assert ("O_DIRECT, 16 MiB chunks" in tier.stats().detail) == truth
    finally:
        tier.close()
    check_partial_regions(lambda: _make("/dev/shm"))


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_o_direct_files_are_opened_direct_when_supported(tmp_path):
    ok, _ = probe_direct_io(str(tmp_path))
    tier = _make(tmp_path)
    try:
        tier.allocate("a", 10)
        region = tier._files.acquire("a", 0, 0)  # white box: the region's open file
        try:
            assert os.stat(region.path).st_size == 4096
            assert fcntl.fcntl(region.handle, fcntl.F_GETFL) & os.O_DIRECT == (os.O_DIRECT if ok else 0)
        finally:
            tier._files.release(region)
    finally:
        tier.close()


def _page_aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start : start + nbytes]


def test_aligned_host_tensors_move_in_place(tmp_path, monkeypatch):
    """Page-aligned host bytes covering whole blocks go straight to and from the file: no bounce copy."""

    def no_bounce(self):
        raise AssertionError("an aligned host transfer went through a bounce buffer")

    monkeypatch.setattr(PosixTier, "_bounce", no_bounce)
    tier = _make(tmp_path, chunk_bytes=8192)
    try:
        src = _page_aligned(5 * 4096).copy_(torch.randint(0, 256, (5 * 4096,), dtype=torch.uint8))
        tier.allocate("a", 6 * 4096 + 1)
        tier.write("a", src, 4096).result(timeout=60)
        dst = _page_aligned(5 * 4096).zero_()
        tier.read("a", dst, 4096).result(timeout=60)
        assert torch.equal(dst, src)
        if tier.direct:  # under O_DIRECT an unaligned one must not skip it
            with pytest.raises(AssertionError, match="bounce"):
                tier.write("a", src[1:], 4097).result(timeout=60)
    finally:
        tier.close()


# --------------------------------------------------------------------------- the directory


def test_no_directory_is_an_error_naming_the_setting():
    with pytest.raises(ConfigError, match=r"no directory: set engine.offload_dir \(CLI: --offload-dir\)"):
        _make(None)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist: create it \(mkdir -p\)"):
        _make(tmp_path / "nope")


def test_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        _make(tmp_path / "file")


def _unwritable_directory(tmp_path: Path) -> str:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        (locked / "probe").touch()
    except PermissionError:
        return str(locked)
    (locked / "probe").unlink()  # root ignores modes: use a directory even root cannot write
    for candidate in ("/sys", "/proc"):
        try:
            Path(candidate, "slidekit-probe").touch()
        except OSError:
            return candidate
    pytest.skip("no directory here refuses this user's writes")


def test_unwritable_directory(tmp_path):
    path = _unwritable_directory(tmp_path)
    with pytest.raises(ConfigError, match=r"cannot create files in .* make it writable for this user"):
        _make(path)


# --------------------------------------------------------------------------- a full disk


def test_allocating_more_than_the_disk_holds_fails_at_allocate(tmp_path):
    tier = _make(tmp_path)
    try:
        # More than the whole disk: refused however much others write or delete on it meanwhile.
        need = shutil.disk_usage(tmp_path).total + (1 << 30)
        with pytest.raises(
            OSError, match=rf"needs {need} bytes .* for region 'huge'.*has \d+ bytes \(\d+\.\d\d GiB\) free"
        ) as e:
            tier.allocate("huge", need)
        assert e.value.errno == errno.ENOSPC
        assert _files(tier) == []  # nothing half-made
        tier.allocate("huge", 100)  # the name is still free
    finally:
        tier.close()


def test_a_disk_that_fills_during_fallocate(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    tier = _make(tmp_path)
    try:
        with pytest.raises(OSError, match=r"needs 4096 bytes .* for region 'r'") as e:
            tier.allocate("r", 3000)
        assert e.value.errno == errno.ENOSPC and _files(tier) == []
    finally:
        tier.close()


def test_file_systems_without_fallocate_still_work_and_say_so(tmp_path, monkeypatch):
    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    check_round_trips(lambda: _make(tmp_path))
    tier = _make(tmp_path)
    try:
        tier.allocate("r", 5000)
        assert os.path.getsize(os.path.join(tier.root, _files(tier)[0])) == 8192
        assert "space not reserved up front" in tier.stats().detail
    finally:
        tier.close()


# --------------------------------------------------------------------------- cleanup


def test_files_go_on_free_and_close(tmp_path):
    tier = _make(tmp_path)
    tier.allocate("a", 10)
    tier.allocate("b/with/slashes", 5000)
    assert len(_files(tier)) == 2
    assert all(os.path.getsize(os.path.join(tier.root, f)) % 4096 == 0 for f in _files(tier))
    tier.free("a")
    assert len(_files(tier)) == 1 and "b_with_slashes" in _files(tier)[0]
    root = tier.root
    tier.close()
    assert not os.path.exists(root) and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        tier.allocate("c", 1)
    with pytest.raises(RuntimeError, match="closed"):
        tier.write("b/with/slashes", torch.zeros(1))


def test_files_go_when_the_tier_is_dropped(tmp_path):
    tier = _make(tmp_path)
    tier.allocate("a", 10)
    tier.write("a", torch.ones(2)).result()
    root = tier.root
    del tier
    gc.collect()
    assert not os.path.exists(root)


def test_files_go_at_interpreter_exit(tmp_path):
    script = (
        "import torch, sys\n"
        "from slidekit.interfaces import TierContext\n"
        "from slidekit_tiers.posix import PosixTier\n"
        "t = PosixTier(TierContext(device=torch.device('cpu'), directory=sys.argv[1]))\n"
        "t.allocate('a', 10000)\n"
        "t.write('a', torch.ones(100)).result()\n"
        "_keep = [t]  # never closed, still referenced at exit\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120)
    assert os.listdir(tmp_path) == []


def test_free_during_io_waits_for_it_before_removing_the_file(tmp_path):
    tier = _make(tmp_path, chunk_bytes=8192)
    try:
        src = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
        tier.allocate("r", src.numel())
        future = tier.write("r", src)
        tier.free("r")  # the write has hundreds of chunks still queued
        future.result(timeout=60)
        assert _files(tier) == []
        with pytest.raises(KeyError, match="'r'"):
            tier.read("r", src)
    finally:
        tier.close()


# --------------------------------------------------------------------------- stats and options


def test_stats_report_disk_space_and_how_it_runs(tmp_path):
    tier = _make(tmp_path, chunk_bytes=1 << 20)
    try:
        tier.allocate("a", 1)
        tier.allocate("b", 4097)
        s = tier.stats()
        assert s.bytes_allocated == 4096 + 8192  # what the files take on disk
        free = shutil.disk_usage(tmp_path).free
        assert s.capacity is not None and abs(s.capacity - free) < (256 << 20)
        assert tier.root in s.detail and "I/O threads" in s.detail
        assert ("O_DIRECT, 1 MiB chunks" in s.detail) == tier.direct
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chunk": 1}, r"unknown options \['chunk'\]; valid: chunk_bytes, direct, io_threads"),
        (
            {"chunk_bytes": 1000},
            r"plugins\.options\.posix\.chunk_bytes must be a positive multiple of 4096, ",
        ),
        ({"chunk_bytes": 0}, "chunk_bytes must be a positive multiple of 4096"),
        ({"chunk_bytes": True}, "chunk_bytes must be a positive multiple of 4096, .* got True"),
        ({"direct": "yes"}, r"plugins\.options\.posix\.direct must be 'auto', true or false, got 'yes'"),
        ({"direct": 1}, "direct must be 'auto', true or false, got 1"),
        ({"io_threads": 0}, r"plugins\.options\.posix\.io_threads must be an integer from 1 to 64, got 0"),
        ({"io_threads": 65}, "io_threads must be an integer from 1 to 64, got 65"),
        ({"io_threads": 2.5}, "io_threads must be an integer from 1 to 64, got 2.5"),
        ({"io_threads": True}, "io_threads must be an integer from 1 to 64, got True"),
    ],
)
def test_bad_options(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message) as err:
        _make(tmp_path, **options)
    assert "CLI: --plugin-option posix." in str(err.value) or "unknown options" in str(err.value)


def test_io_threads_sets_the_workers_and_the_default_is_the_contexts(tmp_path):
    tier = _make(tmp_path, io_threads=5, chunk_bytes=8192)
    try:
        assert "5 I/O threads" in tier.stats().detail
    finally:
        tier.close()
    check_round_trips(lambda: _make(tmp_path, io_threads=5, chunk_bytes=8192))  # 8 KiB chunks over 5 workers
    ctx = TierContext(device=DEVICE, directory=str(tmp_path), io_threads=3)
    tier = PosixTier(ctx)
    try:
        assert "3 I/O threads" in tier.stats().detail
    finally:
        tier.close()


def test_its_settings_are_declared_so_a_run_takes_them(tmp_path):
    """``plugins.options.posix`` (CLI ``--plugin-option posix.KEY=VALUE``) reaches the tier a run builds;
    a key it does not declare is refused by the core, naming the ones it takes."""
    from slidekit import EngineConfig, PluginConfig, TrainConfig, Trainer

    plugins = Plugins()
    assert sorted(plugins.get("tier", "posix").descriptor.options) == ["chunk_bytes", "direct", "io_threads"]
    with pytest.raises(
        ConfigError, match=r"has no setting 'threads'; it takes chunk_bytes \(.*direct .*io_threads"
    ):
        plugins.check_options({"posix": {"threads": 4}})
    settings = {"direct": False, "chunk_bytes": 8192, "io_threads": 3}
    engine = EngineConfig(device="cpu", state_tier="posix", offload_dir=str(tmp_path))
    with Trainer(TrainConfig(engine=engine, plugins=PluginConfig(options={"posix": settings}))) as t:
        tier = t._tier("posix")  # the run's one instance of the tier, as its engine was built with
        assert isinstance(tier, PosixTier) and not tier.direct and tier.chunk == 8192
        assert "3 I/O threads" in tier.stats().detail and "switched off" in tier.stats().detail
