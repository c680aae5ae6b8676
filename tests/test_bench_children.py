"""Child processes of `slidekit bench`: time limits, crashes, the memory watchdog, the peak-RSS reset.

A child that hangs is killed at its deadline with whatever it started, and the records it printed
before are kept; one that allocates host memory until it is killed is killed by the memory watchdog
on a fake machine whose available memory is computed from the child's real RSS (so the outcome does
not depend on how much memory this machine has free, nor on its load); the peak RSS a record reads
starts over where the kernel lets it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from bench_helpers import fake_machine

from slidekit import telemetry
from slidekit.tools.bench import peak_rss_gib
from slidekit.tools.children import MemoryWatchdog, run_child, stream_child


def _hanging_child(marker: Path, *, prints: str = "") -> list[str]:
    """A child that prints the line ``prints`` (if any) at once, then sleeps 120 s, then creates ``marker``.

    A shell, so the line comes out as soon as the process starts (no interpreter start-up before it).
    ``marker`` missing after a run proves the child was killed before it could end by itself, with no
    assumption on how soon after its deadline the kill came (``wall_s`` depends on the machine's load).
    """
    script = '[ -z "$1" ] || printf "%s\\n" "$1"; sleep 120; touch "$2"'
    return ["/bin/sh", "-c", script, "sh", prints, str(marker)]


def test_a_run_that_fails_or_hangs_becomes_unavailable_with_its_reason(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('ValueError: bad shape', file=sys.stderr); sys.exit(3)"]
    record = run_child(crash, timeout=60, log=tmp_path / "crash.log")
    assert record["status"] == "unavailable"
    assert record["reason"] == "exit code 3: ValueError: bad shape"
    assert "bad shape" in (tmp_path / "crash.log").read_text()
    record = run_child(_hanging_child(tmp_path / "ended"), timeout=1)
    assert record["status"] == "unavailable" and record["reason"].startswith("timed out after 1 s")
    assert record["wall_s"] >= 1.0  # it had its second
    assert not (tmp_path / "ended").exists()  # and was killed, not waited for


def test_a_killed_run_keeps_the_records_it_printed(tmp_path):
    seen = []
    child = _hanging_child(tmp_path / "ended", prints='{"status": "ok", "batch": 2}')
    run = stream_child(child, timeout=2, on_record=seen.append)
    assert run.returncode is None and run.failure.startswith("timed out after 2 s")
    assert run.records == seen == [{"status": "ok", "batch": 2}]
    assert run.wall_s >= 2.0 and not (tmp_path / "ended").exists()  # killed at its deadline, not waited for


@pytest.mark.skipif(sys.platform != "linux", reason="the watchdog reads /proc")
def test_the_memory_watchdog_kills_a_child_that_allocates_until_killed(tmp_path):
    marker = tmp_path / "ended"
    grow = (
        "import time\nblocks = []\nwhile len(blocks) < 112:\n    blocks.append(bytearray(b'x' * (8 << 20)))\n"
        f'    time.sleep(0.01)\nprint(\'{{"status": "ok", "batch": 1}}\', flush=True)\ntime.sleep(120)\n'
        f"open({str(marker)!r}, 'w').close()\n"
    )
    run = stream_child([sys.executable, "-c", grow], timeout=100, watchdog=fake_machine(200))
    assert run.killed_by is not None and run.failure == run.killed_by
    assert run.killed_by.startswith("host RAM exhausted: child RSS ") and "memory watchdog" in run.killed_by
    assert run.peak_rss_gib >= 200 / 1024 and run.returncode == -9 and not marker.exists()
    # A child that stays under the floor is watched and left alone.
    quiet = stream_child(
        [sys.executable, "-c", 'print(\'{"status": "ok"}\')'], timeout=60, watchdog=fake_machine()
    )
    assert quiet.failure is None and quiet.killed_by is None and quiet.records == [{"status": "ok"}]


def test_the_watchdog_waits_for_memory_to_come_back_before_the_next_child():
    seen = iter([1 << 30, 2 << 30, 7 << 30, 0])  # bytes available at each look

    dog = MemoryWatchdog(floor_bytes=3 << 30, poll_s=0.01, available=lambda rss: next(seen))
    assert dog.settle(timeout_s=60) == 7 << 30  # the first look at twice the floor or more
    gone = MemoryWatchdog(floor_bytes=3 << 30, poll_s=0.01, available=lambda rss: 1 << 30)
    assert gone.settle(timeout_s=0.05) == 1 << 30  # never back: it gives up at its timeout, not forever
    assert MemoryWatchdog(available=lambda rss: None).settle() is None  # nothing to read: no wait


def test_the_watchdog_s_verdict_by_hand():
    dog = MemoryWatchdog(floor_bytes=3 << 30)
    assert dog.verdict(100 << 30, 110 << 30, 4 << 30) is None and dog.verdict(1, 1, None) is None
    assert dog.verdict(118 << 30, 120 << 30, 2 << 30) == (
        "host RAM exhausted: child RSS 118.0 GiB, peak 120.0 GiB (killed by the bench's memory watchdog: "
        "2.0 GiB available, under its 3.0 GiB floor)"
    )
    with pytest.raises(ValueError, match="poll_s > 0"):
        MemoryWatchdog(poll_s=0)


# ---------------------------------------------------------------------------- the peak-RSS reset


def _vm_hwm() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM and /proc/self/clear_refs are Linux's")
def test_reset_peak_rss_starts_the_peak_over():
    assert telemetry.reset_peak_rss()
    before = _vm_hwm()
    block = b"\x01" * (200 * 2**20)  # written, so every page is resident
    assert _vm_hwm() >= before + 190 * 2**20
    del block
    assert telemetry.reset_peak_rss()
    assert _vm_hwm() < before + 50 * 2**20  # the 200 MB are no longer in the peak
    assert peak_rss_gib() == pytest.approx(_vm_hwm() / 2**30, abs=0.01)  # the records read VmHWM


def test_reset_peak_rss_says_so_where_it_cannot(monkeypatch):
    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(telemetry, "open", refuse, raising=False)  # the module's own open()
    assert telemetry.reset_peak_rss() is False


def test_builds_run_side_by_side_and_say_how_they_went(tmp_path, capsys):
    from slidekit.tools.bench.runner import run_builds

    commands = {
        "good": ([sys.executable, "-c", "import os; print(os.environ['WHO'])"], {"WHO": "built"}),
        "bad": (
            [sys.executable, "-c", "import sys; print('error: no compiler', file=sys.stderr); sys.exit(2)"],
            {},
        ),
    }
    out = run_builds(["good", "bad"], tmp_path, commands)
    assert out["good"]["ok"] is True and out["good"]["failure"] is None
    assert out["bad"] == {
        "ok": False,
        "wall_s": out["bad"]["wall_s"],
        "failure": "exit code 2: error: no compiler",
    }
    assert "built" in (tmp_path / "build_good.log").read_text()  # the variables reach the build
    assert "build bad: exit code 2: error: no compiler" in capsys.readouterr().err
