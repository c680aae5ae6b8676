"""The gds tier: why it is (un)available here, and the conformance checks where kvikio and a GPU exist.

Everywhere: the availability reason (never an exception) and the decision
between "not installed", "no CUDA driver" and the two I/O modes. With kvikio
and CUDA (the GPU machine): every conformance check, in whichever mode the
machine runs (GPUDirect Storage or kvikio's compatibility mode).
"""

from __future__ import annotations

import importlib.util
import os
import re
import types

import numpy as np
import pytest
import torch

from slidekit import Plugins
from slidekit.errors import DriverUnavailableError
from slidekit.interfaces import TierContext
from slidekit.testing.tiers import CHECKS
from slidekit_tiers import gds
from slidekit_tiers.gds import COMPAT, GDS, NOT_INSTALLED, GdsTier, decide_availability

AVAILABLE, REASON = gds._available()
needs_gds = pytest.mark.skipif(not AVAILABLE, reason=f"gds tier unavailable here: {REASON}")


def _make(directory) -> GdsTier:
    return GdsTier(TierContext(device=torch.device("cuda"), directory=str(directory)))


# --------------------------------------------------------------------------- availability, everywhere


def test_availability_here_has_the_right_reason():
    if importlib.util.find_spec("kvikio") is None:
        assert (AVAILABLE, REASON) == (False, "kvikio is not installed (pip install 'slidekit[gds]')")
    elif not torch.cuda.is_available():
        assert not AVAILABLE and REASON.startswith("no CUDA")
    else:
        assert AVAILABLE and (REASON == GDS or REASON.startswith(COMPAT)), REASON


def test_registered_through_its_entry_point_and_reports_the_same():
    plugins = Plugins()
    assert plugins.get("tier", "gds").plugin == "gds"
    assert plugins.availability("tier", "gds") == (AVAILABLE, REASON)
    assert plugins.get("tier", "gds").descriptor.devices == ("cuda",)


def _boom() -> str:
    raise RuntimeError("cuFile exploded")


@pytest.mark.parametrize(
    ("installed", "problem", "mode", "expected"),
    [
        (False, None, lambda: GDS, (False, NOT_INSTALLED)),
        (
            True,
            "no CUDA driver (libcuda.so.1 cannot be loaded)",
            lambda: GDS,
            (False, "no CUDA driver (libcuda.so.1 cannot be loaded)"),
        ),
        (True, None, lambda: GDS, (True, "GPUDirect Storage")),
        (True, None, lambda: COMPAT, (True, "kvikio compatibility mode (no GDS driver)")),
        (True, None, _boom, (False, "probing kvikio failed (RuntimeError: cuFile exploded)")),
    ],
    ids=["not-installed", "no-driver", "gds", "compat", "probe-raises"],
)
def test_the_decision(installed, problem, mode, expected):
    assert decide_availability(lambda: installed, lambda: problem, mode) == expected


def test_the_decision_probes_in_order_and_stops_early():
    called = []

    def driver() -> str | None:
        called.append("driver")
        return None

    assert decide_availability(lambda: False, driver, _boom) == (False, NOT_INSTALLED)
    assert called == []


@pytest.mark.skipif(AVAILABLE, reason="the gds tier is available here")
def test_building_it_where_unavailable_says_why(tmp_path):
    with pytest.raises(
        DriverUnavailableError, match=re.escape(f"the gds tier cannot run here: {REASON}; the posix tier")
    ):
        _make(tmp_path)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- the tier's logic, on a stand-in


class _IOFuture:
    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes

    def get(self) -> int:
        return self._nbytes


class _HostCuFile:
    """kvikio.CuFile as documented, for host (numpy) buffers only: positional POSIX I/O."""

    def __init__(self, path: str, flags: str = "r") -> None:
        assert flags == "r+", flags
        self._fd = os.open(path, os.O_RDWR)

    def pwrite(self, buf, size=None, file_offset=0, task_size=None) -> _IOFuture:
        assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and size == buf.nbytes
        view = memoryview(buf)
        done = 0
        while done < size:
            done += os.pwrite(self._fd, view[done:], file_offset + done)
        return _IOFuture(done)

    def pread(self, buf, size=None, file_offset=0, task_size=None) -> _IOFuture:
        assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and size == buf.nbytes
        view = memoryview(buf)
        done = 0
        while done < size:
            got = os.preadv(self._fd, [view[done:]], file_offset + done)
            assert got, "read past the end of the file"
            done += got
        return _IOFuture(done)

    def close(self) -> None:
        os.close(self._fd)


_STAND_IN = types.SimpleNamespace(
    CuFile=_HostCuFile, __version__="stand-in", defaults=types.SimpleNamespace(get=lambda name: 1)
)


def _make_stand_in(directory) -> GdsTier:
    return GdsTier(TierContext(device=torch.device("cpu"), directory=str(directory)), kvikio=_STAND_IN)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance_on_a_host_stand_in_for_kvikio(check, tmp_path):
    """The tier's own logic (regions, offsets, locks, futures, counters, errors) on the CPU."""
    if check.__name__ == "check_device_tensors":
        pytest.skip("the stand-in moves host buffers only")
    check(lambda: _make_stand_in(tmp_path))


def test_stand_in_stats_and_cleanup(tmp_path):
    tier = _make_stand_in(tmp_path)
    tier.allocate("a", 5000)
    tier.write("a", torch.ones(1000)).result(timeout=60)
    s = tier.stats()
    assert (
        s.detail.startswith("a kvikio stand-in; files in") and "kvikio stand-in, 1 kvikio threads" in s.detail
    )
    assert (s.bytes_allocated, s.bytes_written) == (8192, 4000)
    root = tier.root
    tier.close()
    assert not os.path.exists(root) and os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- with kvikio and CUDA


@needs_gds
@pytest.mark.gpu
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_conformance(check, tmp_path):
    check(lambda: _make(tmp_path))


@needs_gds
@pytest.mark.gpu
def test_stats_say_how_it_runs_and_files_go_on_close(tmp_path):
    tier = _make(tmp_path)
    tier.allocate("a", 5000)
    tier.write("a", torch.ones(1000, device="cuda")).result(timeout=60)
    s = tier.stats()
    assert s.detail.startswith(REASON) and tier.root in s.detail and "kvikio" in s.detail
    assert s.bytes_allocated == 8192 and s.bytes_written == 4000
    root = tier.root
    tier.close()
    assert not os.path.exists(root)
