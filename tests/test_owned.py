"""One lock and owner record for every slidekit lock: ``slidekit.owned``'s flock, record and probe.

The run directory's ``run.lock``, a kernel build's ``<dir>.lock``, a checkpoint writer's
``.writer.lock`` and an owned directory's ``.owner`` all carry the same record, read back by the
same reader; a lock another open file holds is never taken, and one nobody holds reads as free.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from slidekit import checkpoint as ck
from slidekit import owned
from slidekit.config import RunConfig, TrainConfig
from slidekit.run import RUN_LOCK, RunDirectory
from slidekit_optim.build_lock import exclusive_build, lock_path


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def test_a_recorded_owner_reads_back_and_its_lock_is_never_taken_twice(tmp_path):
    path = tmp_path / "x.lock"
    first, second = _open(path), _open(path)
    try:
        assert owned.lock_free(path) is True and owned.holder(first) is None  # nobody, nothing recorded
        before = time.time()
        assert owned.try_lock(first)
        owned.record(first)
        assert not owned.try_lock(second)  # another open file of this very process: still refused
        assert owned.lock_free(path) is False
        record = owned.read_owner(second)
        assert record is not None and record == owned.read_owner(path)
        assert record.pid == os.getpid() and record.host == socket.gethostname()
        assert record.started is not None and before - 1 <= record.started <= time.time() + 1
        assert owned.holder(second) == f"pid {os.getpid()} on host {socket.gethostname()}"
    finally:
        os.close(first)  # drops the lock
    try:
        assert owned.lock_free(path) is True and owned.try_lock(second)
    finally:
        os.close(second)
    assert owned.lock_free(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("123 host-a 1700000000.500\n", owned.Owner(123, "host-a", 1700000000.5)),
        ("123 host-a\n", owned.Owner(123, "host-a")),  # run.lock and build locks of earlier slidekits
        ("123", owned.Owner(123, None)),
        (json.dumps({"pid": 7, "host": "h", "started": 1.5}), owned.Owner(7, "h", 1.5)),  # older .owner
        (json.dumps({"pid": "7", "host": 3}), owned.Owner(None, None)),
        ("", None),
        ("not a record", None),
        ("{broken json", None),
    ],
)
def test_owner_records_of_every_kind_are_read(tmp_path, text, expected):
    path = tmp_path / "lock"
    path.write_text(text)
    assert owned.read_owner(path) == expected


def test_every_lock_carries_the_same_record(tmp_path):
    me = (os.getpid(), socket.gethostname())

    def recorded(path: Path) -> tuple[int | None, str | None]:
        record = owned.read_owner(path)
        assert record is not None, path
        return record.pid, record.host

    directory = owned.OwnedDir.create(tmp_path, "slidekit-test-")
    try:
        assert recorded(Path(directory.path) / owned.OWNER_FILE) == me
    finally:
        directory.release()

    run = RunDirectory(TrainConfig(run=RunConfig(dir=str(tmp_path / "run"))))
    try:
        assert recorded(run.path / RUN_LOCK) == me
    finally:
        run.close()

    with exclusive_build(tmp_path / "build", what="nothing", timeout=0, say=lambda _m: None):
        assert recorded(lock_path(tmp_path / "build")) == me

    seen: list[tuple[int | None, str | None]] = []

    def at(stage: str, detail: str) -> None:
        if stage == "manifest":  # the writer holds the lock of its temporary directory
            seen.append(recorded(Path(detail) / ".writer.lock"))

    writer = ck.CheckpointWriter(tmp_path / "ckpt", progress=at)
    try:
        writer.save(1, {"a": torch.ones(3)}).result(60)
    finally:
        writer.close(60)
    assert seen == [me]
