"""kvfsd.state: atomic, private writes; one kvfsd per state directory."""
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
    state.save({"format": 1, "x": [3]}, durable=True)
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
