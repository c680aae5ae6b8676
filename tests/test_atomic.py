"""Atomic text files: the old content or the new one, never a mix, and no temporary left behind."""

from __future__ import annotations

import pytest

from slidekit.atomic import write_text_atomically


def test_replaces_the_file_whole(tmp_path):
    path = tmp_path / "config.json"
    write_text_atomically(path, "first\n")
    write_text_atomically(path, "second ✓\n")
    assert path.read_text(encoding="utf-8") == "second ✓\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_text_atomically(path, "kept\n")
    with pytest.raises(TypeError):
        write_text_atomically(path, 123)  # type: ignore[arg-type]
    assert path.read_text() == "kept\n"
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
