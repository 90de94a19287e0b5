"""kvfsd.state: atomic, durable, private writes; one kvfsd per state directory."""
import errno
import os
import stat

import pytest

from kvfsd.state import StateDir, StateDirBusy


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_namespace_and_snapshots_are_private_and_atomic(tmp_path):
    state = StateDir(str(tmp_path / "s"))
    assert state.load() is None
    state.save({"format": 1, "x": [1, 2]})
    state.save({"format": 1, "x": [3]})
    assert state.load() == {"format": 1, "x": [3]}
    name = state.write_snapshot(7, b"blob")
    assert name == "7.kvx" and state.read_snapshot(name) == b"blob"
    assert mode(state.path) == 0o700
    for f in ("namespace.json", "snapshots/7.kvx", "lock"):
        assert mode(os.path.join(state.path, f)) == 0o600
    assert not [n for n in os.listdir(state.path) if n.endswith(".tmp")]
    open(os.path.join(state.path, "snapshots", "9.kvx.tmp"), "wb").close()
    assert state.snapshot_names() == {"7.kvx", "9.kvx.tmp"}
    state.remove_snapshot("7.kvx")
    state.remove_snapshot("7.kvx")          # already gone: fine
    assert state.snapshot_names() == {"9.kvx.tmp"}
    state.close()


def test_a_second_kvfsd_cannot_share_a_state_dir(tmp_path):
    first = StateDir(str(tmp_path / "s"))
    with pytest.raises(StateDirBusy):
        StateDir(str(tmp_path / "s"))
    first.close()
    StateDir(str(tmp_path / "s")).close()


def test_every_write_is_fsynced_and_a_failed_one_leaves_the_previous_version(
        tmp_path, monkeypatch):
    state = StateDir(str(tmp_path / "s"))
    state.save({"format": 1, "x": [1]})
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    state.save({"format": 1, "x": [2]})
    state.write_snapshot(3, b"blob")
    assert len(synced) == 4                      # each file, then its directory

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as e:
        state.save({"format": 1, "x": [3]})
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert state.load() == {"format": 1, "x": [2]}
    assert sorted(os.listdir(state.path)) == ["lock", "namespace.json", "snapshots"]
    state.close()
