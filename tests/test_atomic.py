"""Atomic text files: the old content or the new one, never a mix, and no temporary left behind."""

from __future__ import annotations

import pytest

from slidekit.atomic import fsync_tree, rename_aside, write_synced, write_text_atomically


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


def test_a_tree_renamed_aside_keeps_its_content_under_a_recognisable_name(tmp_path):
    tree = tmp_path / "step-00000001"
    (tree / "arrays").mkdir(parents=True)
    write_synced(tree / "arrays" / "a.bin", b"\x00\x01")
    fsync_tree(tree)
    aside = rename_aside(tree, ".tmp-delete-")
    assert not tree.exists() and aside.parent == tmp_path
    assert aside.name.startswith(".tmp-delete-step-00000001-") and len(aside.name) == len(".tmp-delete-") + 22
    assert (aside / "arrays" / "a.bin").read_bytes() == b"\x00\x01"
