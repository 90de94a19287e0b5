"""kvfsd.state: atomic, durable, private, incremental writes; one kvfsd per state
directory; and the namespace journal that feeds it (what is written incrementally is
always exactly the whole namespace)."""
import errno
import json
import os
import sqlite3
import stat

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfsd.check import check_state, problems
from kvfsd.namespace import ROOT, Namespace
from kvfsd.state import StateDir, StateDirBusy

FILE = stat.S_IFREG | 0o600
DIR = stat.S_IFDIR | 0o700


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def commit(state: StateDir, ns: Namespace, pending=()) -> None:
    c = ns.take_changes()
    state.apply(c.rows, c.gone, c.entries,
                {"format": 1, "next_ino": ns.next_ino, "pending_free": list(pending)})


def stored(state: StateDir) -> dict:
    """What a new kvfsd would read, as the namespace document."""
    return Namespace.from_dict(state.load()).to_dict()


def test_namespace_and_snapshots_are_private(tmp_path):
    state = StateDir(str(tmp_path / "s"))
    assert state.load() is None
    ns = Namespace()
    ns.add(ROOT, b"a.kv", FILE, 1000, 1000).cap = "ab" * 16
    commit(state, ns, ["cd" * 16])
    doc = state.load()
    assert doc["pending_free"] == ["cd" * 16]
    assert Namespace.from_dict(doc).to_dict() == ns.to_dict()
    name = state.write_snapshot(7, b"blob")
    assert name == "7.kvx" and state.read_snapshot(name) == b"blob"
    assert mode(state.path) == 0o700
    files = [f for f in os.listdir(state.path) if f != "snapshots"]
    assert sorted(files) == ["lock", "namespace.db", "namespace.db-shm", "namespace.db-wal"]
    for f in files + ["snapshots/7.kvx"]:
        assert mode(os.path.join(state.path, f)) == 0o600, f
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


def test_a_commit_writes_only_what_changed(tmp_path):
    state = StateDir(str(tmp_path / "s"))
    ns = Namespace()
    for i in range(300):
        ns.add(ROOT, f"f{i}.kv".encode(), FILE, 1000, 1000)
    commit(state, ns)
    a = ns.lookup(ROOT, b"f7.kv")
    a.tokens, a.pages, a.lookups = 0, 0, 3          # the same values, and runtime state
    assert not ns.take_changes()
    a.tokens = 5
    c = ns.take_changes()
    assert ([r["ino"] for r in c.rows], c.gone, c.entries) == ([a.ino], [], [])
    ns.untake(c)
    commit(state, ns)
    ns.unlink(ROOT, b"f8.kv")
    ns.lookups = 0
    c = ns.take_changes()
    assert [r["ino"] for r in c.rows] == [ROOT] and len(c.gone) == 1
    assert [(d, name, ino) for d, name, ino, _ in c.entries] == [(ROOT, b"f8.kv", None)]
    ns.untake(c)
    commit(state, ns)
    assert stored(state) == ns.to_dict()
    assert ns.take_changes().rows == []                      # nothing left over
    state.close()


def test_a_failed_commit_changes_nothing_and_is_retried(tmp_path, monkeypatch):
    state = StateDir(str(tmp_path / "s"))
    ns = Namespace()
    ns.add(ROOT, b"a.kv", FILE, 1000, 1000)
    commit(state, ns)
    before = stored(state)
    ns.add(ROOT, b"b.kv", FILE, 1000, 1000)
    c = ns.take_changes()
    with pytest.raises(sqlite3.Error):                   # fails mid-transaction
        state.apply(c.rows, c.gone, c.entries + [(ROOT, b"x", object(), 3)],
                    {"format": 1, "next_ino": ns.next_ino, "pending_free": []})
    assert stored(state) == before
    ns.untake(c)
    commit(state, ns)
    assert stored(state) == ns.to_dict()
    state.close()


def test_a_legacy_json_state_is_migrated_once(tmp_path):
    path = tmp_path / "s"
    os.makedirs(path)
    ns = Namespace()
    d = ns.add(ROOT, b"d", DIR, 1000, 1000)
    ns.add(d.ino, b"a.kv", FILE, 1000, 1000).cap = "ab" * 16
    doc = {**ns.to_dict(), "pending_free": ["cd" * 16]}
    (path / "namespace.json").write_text(json.dumps(doc))
    state = StateDir(str(path))
    assert state.load() == doc
    assert not (path / "namespace.json").exists()
    assert Namespace.from_dict(state.load()).to_dict() == ns.to_dict()
    assert state.load()["pending_free"] == ["cd" * 16]
    state.close()


def test_snapshots_are_fsynced_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    state = StateDir(str(tmp_path / "s"))
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    state.write_snapshot(3, b"blob")
    assert len(synced) == 2                      # the file, then its directory

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as e:
        state.write_snapshot(3, b"new blob")
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert state.read_snapshot("3.kvx") == b"blob"
    assert state.snapshot_names() == {"3.kvx"}
    state.close()


def test_unreachable_rows_are_dropped_and_their_caches_reported(tmp_path):
    ns = Namespace()
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    a = ns.add(d.ino, b"a.kv", FILE, 0, 0)
    a.cap = "ab" * 16
    doc = ns.to_dict()
    root = next(n for n in doc["nodes"] if n["ino"] == ROOT)
    root["entries"] = [e for e in root["entries"] if e[1] != d.ino]       # d unnamed
    root["entries"].append(["Z2hvc3Q=", 999])                             # names nothing
    back = Namespace.from_dict(doc)
    assert set(back.nodes) == {ROOT} and back.lost_caps == [("", "ab" * 16)]
    c = back.take_changes()
    assert sorted(c.gone) == [d.ino, a.ino]
    assert [(dd, name, ino) for dd, name, ino, _ in c.entries] == [(ROOT, b"ghost", None)]


# ---------------------------------------------------------------- kvfsd's consistency check

def test_check_finds_each_kind_of_inconsistency():
    ns = Namespace()
    d = ns.add(ROOT, b"d", DIR, 1000, 0)
    a = ns.add(d.ino, b"a.kv", FILE, 1000, 0)
    b = ns.add(ROOT, b"b.kv", FILE, 1000, 0)
    assert problems(ns) == []
    a.nlink = 2
    d.order.remove(b"a.kv")
    del b.links[ROOT, b"b.kv"]
    ns.names_of_uid[1000] += 1
    ns.get(ROOT).entries[b"ghost"] = 999
    found = problems(ns)
    assert found == [
        f"directory {ROOT}: its readdir listing is not its names",
        f"directory {ROOT}: 'ghost' names no node (999)",
        f"directory {d.ino}: its readdir listing is not its names",
        f"node {a.ino}: nlink 2, 1 names",
        f"node {b.ino}: links [] but named by [({ROOT}, b'b.kv')]",
        "names per uid {1000: 4}, counted {1000: 3}"], found


def test_check_state_is_clean_for_what_kvfsd_writes_and_reports_repairs(tmp_path):
    state = StateDir(str(tmp_path / "s"))
    ns = Namespace()
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    a = ns.add(d.ino, b"a.kv", FILE, 0, 0)
    a.cap, a.snapshot, a.replica = "ab" * 16, "9.kvx", "predd.sock"
    commit(state, ns)
    state.close()
    assert check_state(str(tmp_path / "s")) == [
        f"node {a.ino}: snapshot 9.kvx missing",
        f"node {a.ino}: replica 'predd.sock' is not an address"]
    a.snapshot, a.replica = None, "ipc:///run/symphony/predd.sock"
    state = StateDir(str(tmp_path / "s"))
    commit(state, ns)
    state.db.execute("INSERT INTO entry (dir, name, ino, pos) VALUES (?, ?, ?, ?)",
                     (ROOT, b"ghost", 999, 99))                 # a half-written change
    state.db.execute("DELETE FROM entry WHERE dir = ? AND name = ?", (ROOT, b"d"))
    with pytest.raises(StateDirBusy):
        check_state(str(tmp_path / "s"))
    state.close()
    assert check_state(str(tmp_path / "s")) == [
        f"entries naming nothing: ['{ROOT}/ghost']",
        f"stored nodes no name reaches: {sorted([d.ino, a.ino])}"]


# ---------------------------------------------------------------- the journal, by property

NAMES = st.sampled_from([b"a", b"b", b"c", b"d", "é".encode()])


class JournalMachine(RuleBasedStateMachine):
    """Random namespace operations with commits in between: after each commit, what the
    state directory holds is exactly `to_dict()` of the live namespace."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.tmp = tempfile.mkdtemp(prefix="kvfs-journal-")
        self.state = StateDir(self.tmp)
        self.ns = Namespace(names_per_uid=0)
        commit(self.state, self.ns)

    def dirs(self):
        return sorted(i for i, n in self.ns.nodes.items() if n.is_dir and self.ns.linked(n))

    def teardown(self):
        self.state.close()
        import shutil
        shutil.rmtree(self.tmp)

    def _try(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError:
            return None

    @rule(data=st.data(), name=NAMES, kind=st.sampled_from(["file", "dir", "symlink"]))
    def add(self, data, name, kind):
        parent = data.draw(st.sampled_from(self.dirs()))
        mode = {"file": FILE, "dir": DIR, "symlink": stat.S_IFLNK | 0o777}[kind]
        node = self._try(self.ns.add, parent, name, mode, 1000, 1000, b"t")
        if node is not None and kind == "file":
            node.cap = f"{node.ino:032x}"

    @rule(data=st.data(), name=NAMES)
    def link(self, data, name):
        files = sorted(i for i, n in self.ns.nodes.items() if not n.is_dir and n.nlink)
        if files:
            self._try(self.ns.link, data.draw(st.sampled_from(files)),
                      data.draw(st.sampled_from(self.dirs())), name)

    @rule(data=st.data(), name=NAMES)
    def remove(self, data, name):
        parent = data.draw(st.sampled_from(self.dirs()))
        node = self._try(self.ns.lookup, parent, name)
        if node is None:
            return
        if node.is_dir:
            self._try(self.ns.rmdir, parent, name)
        else:
            self._try(self.ns.unlink, parent, name)
        if not node.nlink:
            node.cap = None
            self.ns.collect(node)

    @rule(data=st.data(), old=NAMES, new=NAMES, exchange=st.booleans())
    def rename(self, data, old, new, exchange):
        src = data.draw(st.sampled_from(self.dirs()))
        dst = data.draw(st.sampled_from(self.dirs()))
        displaced = self._try(self.ns.rename, src, old, dst, new, exchange=exchange)
        if displaced is not None and not displaced.nlink:
            displaced.cap = None
            self.ns.collect(displaced)

    @rule(data=st.data(), value=st.sampled_from([b"0", b"1"]))
    def change_attributes(self, data, value):
        ino = data.draw(st.sampled_from(sorted(self.ns.nodes)))
        node = self.ns.nodes[ino]
        what = data.draw(st.sampled_from(["chmod", "chown", "xattr", "rmxattr", "tokens",
                                          "snapshot", "times"]))
        if what == "chmod":
            self.ns.chmod(node, 0o640)
        elif what == "chown":
            self.ns.chown(node, 1001, None)
        elif what == "xattr":
            self._try(self.ns.setxattr, node, b"user.kv.pin", value)
        elif what == "rmxattr":
            self._try(self.ns.removexattr, node, b"user.kv.pin")
        elif what == "tokens" and node.is_file:       # one field at a time: each must
            node.tokens += 1                          # mark the node by itself
        elif what == "snapshot" and node.is_file:
            node.snapshot = f"{ino}.kvx"
        elif what == "times":
            node.atime_ns += 1

    @rule()
    def commit(self):
        commit(self.state, self.ns)

    @invariant()
    def committed_state_is_the_namespace(self):
        if not (self.ns.dirty or self.ns.dirty_entries):
            assert stored(self.state) == self.ns.to_dict()

    @invariant()
    def indexes_agree_with_the_entries(self):
        assert problems(self.ns) == []


TestJournal = JournalMachine.TestCase
TestJournal.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
