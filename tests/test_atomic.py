"""core.atomic: a write that fails leaves the old file, a write that succeeds is synced."""

from __future__ import annotations

import json
import os
import stat

import pytest
from bagserve.core.atomic import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
)


@pytest.fixture
def fsyncs(monkeypatch):
    """Every fsync, as (inode, is a directory), recorded before the real fsync runs."""
    calls: list[tuple[int, bool]] = []
    real = os.fsync

    def recording(fd):
        st = os.fstat(fd)
        calls.append((st.st_ino, stat.S_ISDIR(st.st_mode)))
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls


def _fail(*args, **kwargs):
    raise OSError("disk full")


def test_bytes_text_and_json_round_trip(tmp_path):
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    atomic_write_bytes(tmp_path / "v.bin", memoryview(b"view"))
    atomic_write_text(tmp_path / "t.txt", "café\n", encoding="latin-1")
    doc = {"b": [1, 2.5, None], "a": {"é": True}}
    assert atomic_write_json(tmp_path / "d.json", doc, indent=1, sort_keys=True) == (
        tmp_path / "d.json"
    )
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "v.bin").read_bytes() == b"view"
    assert (tmp_path / "t.txt").read_bytes() == "café\n".encode("latin-1")
    assert json.loads((tmp_path / "d.json").read_text()) == doc
    assert (tmp_path / "d.json").read_text() == json.dumps(doc, indent=1, sort_keys=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "d.json", "t.txt", "v.bin"]


def test_a_write_interrupted_before_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "state.json"
    atomic_write_json(target, {"version": 1})
    monkeypatch.setattr(os, "replace", _fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_json(target, {"version": 2})
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(tmp_path / "new.bin", b"never")
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary files


def test_a_document_that_is_not_json_leaves_the_old_file(tmp_path):
    target = tmp_path / "state.json"
    atomic_write_json(target, {"version": 1})
    with pytest.raises(TypeError):
        atomic_write_json(target, {"version": object()})
    with pytest.raises(ValueError, match="JSON compliant"):
        atomic_write_json(target, {"version": float("nan")}, allow_nan=False)
    assert json.loads(target.read_text()) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_the_file_and_its_directory_are_synced(tmp_path, fsyncs):
    target = atomic_write_text(tmp_path / "report.txt", "done\n")
    # The file is synced before the rename (same inode after it), the directory after.
    assert fsyncs == [(target.stat().st_ino, False), (tmp_path.stat().st_ino, True)]


def test_permissions_of_a_replaced_file_are_kept(tmp_path):
    target = tmp_path / "f"
    target.write_text("old")
    target.chmod(0o640)
    atomic_write_text(target, "new")
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    umask = os.umask(0)
    os.umask(umask)
    fresh = atomic_write_text(tmp_path / "g", "x")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask


def test_a_directory_is_published_complete_and_synced(tmp_path, fsyncs):
    target = tmp_path / "models" / "m" / "1"
    with atomic_directory(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".1.tmp-")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.bin").write_bytes(b"a")
        (tmp / "b.txt").write_text("b")
        assert not target.exists()
    assert (target / "sub" / "a.bin").read_bytes() == b"a"
    assert (target / "b.txt").read_text() == "b"
    assert [p.name for p in target.parent.iterdir()] == ["1"]
    synced = set(fsyncs)
    for p in (target / "sub" / "a.bin", target / "b.txt"):
        assert (p.stat().st_ino, False) in synced
    for d in (target, target / "sub", target.parent):
        assert (d.stat().st_ino, True) in synced


def test_a_failed_directory_build_leaves_the_old_one(tmp_path):
    target = tmp_path / "m"
    with atomic_directory(target) as tmp:
        (tmp / "v").write_text("1")

    def build_and_fail() -> None:
        with atomic_directory(target, overwrite=True) as tmp:
            (tmp / "v").write_text("2")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_and_fail()
    assert (target / "v").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    with atomic_directory(target, overwrite=True) as tmp:
        (tmp / "v").write_text("2")
    assert (target / "v").read_text() == "2"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_an_existing_directory_is_replaced_only_when_asked(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    with pytest.raises(FileExistsError, match="already exists"), atomic_directory(target):
        pytest.fail("refused before the block runs")
    # Created by someone else while the block ran: still not replaced.
    other = tmp_path / "n"

    def build_while_another_publishes() -> None:
        with atomic_directory(other) as tmp:
            (tmp / "v").write_text("mine")
            other.mkdir()
            (other / "v").write_text("theirs")

    with pytest.raises(FileExistsError, match="already exists"):
        build_while_another_publishes()
    assert (other / "v").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "n"]


def test_a_failed_publish_puts_the_old_directory_back(tmp_path, monkeypatch):
    target = tmp_path / "m"
    with atomic_directory(target) as tmp:
        (tmp / "v").write_text("1")
    real = os.rename
    calls = {"n": 0}

    def second_rename_fails(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:  # the new directory into place, after the old one moved aside
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="disk full"), atomic_directory(target, overwrite=True) as tmp:
        (tmp / "v").write_text("2")
    monkeypatch.undo()
    assert (target / "v").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
