"""kvfsd.namespace without FUSE or predd: names, links, renames, modes, xattrs, the
round trip through the state file, and the indexes that keep every operation free of
scans (readdir positions, a node's names)."""
import errno
import json
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsd.listing import FIRST, SLACK, Listing
from kvfsd.namespace import ROOT, Namespace
from kvfsd.xattrs import APP_MAX as APP_XATTRS
from kvfsd.xattrs import NAME_MAX as XATTR_NAME_MAX
from kvfsd.xattrs import VALUE_MAX as XATTR_VALUE_MAX
from kvfsd.xattrs import check as check_xattr

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def err(fn, *args, **kwargs) -> int:
    with pytest.raises(OSError) as e:
        fn(*args, **kwargs)
    return e.value.errno


@pytest.fixture
def ns():
    return Namespace()


def test_root_is_sticky_and_world_writable(ns):
    root = ns.get(ROOT)
    assert stat.S_ISDIR(root.mode) and stat.S_IMODE(root.mode) == 0o1777
    assert root.nlink == 2
    assert ns.lookup(ROOT, b".") is root and ns.lookup(ROOT, b"..") is root


def test_add_lookup_and_errors(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 1000, 100)
    assert ns.lookup(ROOT, b"a.kv") is a
    assert (a.uid, a.gid, a.nlink, stat.S_IMODE(a.mode)) == (1000, 100, 1, 0o644)
    assert err(ns.add, ROOT, b"a.kv", FILE, 0, 0) == errno.EEXIST
    assert err(ns.add, ROOT, b"x" * 256, FILE, 0, 0) == errno.ENAMETOOLONG
    assert err(ns.lookup, ROOT, b"missing") == errno.ENOENT
    assert err(ns.lookup, a.ino, b"x") == errno.ENOTDIR
    assert err(ns.add, ROOT, b"dev", stat.S_IFCHR | 0o600, 0, 0) == errno.EPERM


def test_directories_count_links_and_refuse_nonempty_rmdir(ns):
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    e = ns.add(d.ino, b"e", DIR, 0, 0)
    assert ns.get(ROOT).nlink == 3 and d.nlink == 3 and e.nlink == 2
    assert ns.lookup(e.ino, b"..") is d
    assert err(ns.rmdir, ROOT, b"d") == errno.ENOTEMPTY
    assert err(ns.unlink, ROOT, b"d") == errno.EISDIR
    ns.rmdir(d.ino, b"e")
    assert d.nlink == 2 and e.nlink == 0
    ns.add(ROOT, b"f", FILE, 0, 0)
    assert err(ns.rmdir, ROOT, b"f") == errno.ENOTDIR


def test_setgid_directory_passes_its_group_down(ns):
    d = ns.add(ROOT, b"shared", stat.S_IFDIR | 0o2775, 0, 50)
    f = ns.add(d.ino, b"a.kv", FILE, 1000, 100)
    sub = ns.add(d.ino, b"sub", DIR, 1000, 100)
    assert f.gid == 50 and sub.gid == 50 and sub.mode & stat.S_ISGID


def test_hard_links_and_unlink(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    ns.link(a.ino, d.ino, b"b.kv")
    assert a.nlink == 2 and ns.lookup(d.ino, b"b.kv") is a
    assert sorted(ns.names_of(a.ino)) == [(ROOT, b"a.kv"), (d.ino, b"b.kv")]
    assert err(ns.link, d.ino, ROOT, b"d2") == errno.EPERM
    assert ns.unlink(ROOT, b"a.kv") is a and a.nlink == 1
    assert not Namespace.cache_unreferenced(a)
    ns.unlink(d.ino, b"b.kv")
    assert a.nlink == 0 and Namespace.cache_unreferenced(a)
    assert err(ns.link, a.ino, ROOT, b"again") == errno.ENOENT


def test_open_file_keeps_cache_and_kernel_reference_keeps_node(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    a.cap, a.opens, a.lookups = "c" * 32, 1, 1
    ns.unlink(ROOT, b"a.kv")
    assert not Namespace.cache_unreferenced(a)       # still open
    a.opens = 0
    assert Namespace.cache_unreferenced(a)
    assert not ns.collect(a)                          # cache not freed yet
    a.cap = None
    assert not ns.collect(a)                          # the kernel still knows it
    ns.forget(a.ino, 1)
    assert ns.collect(a) and a.ino not in ns.nodes


def test_rename_rules(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    b = ns.add(ROOT, b"b.kv", FILE, 0, 0)
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    sub = ns.add(d.ino, b"sub", DIR, 0, 0)
    assert err(ns.rename, ROOT, b"a.kv", ROOT, b"b.kv", noreplace=True) == errno.EEXIST
    displaced = ns.rename(ROOT, b"a.kv", ROOT, b"b.kv")
    assert displaced is b and b.nlink == 0 and ns.lookup(ROOT, b"b.kv") is a
    assert err(ns.rename, ROOT, b"d", d.ino, b"x") == errno.EINVAL      # into itself
    assert err(ns.rename, ROOT, b"d", sub.ino, b"x") == errno.EINVAL
    assert err(ns.rename, ROOT, b"b.kv", ROOT, b"d") == errno.EISDIR
    assert err(ns.rename, ROOT, b"d", ROOT, b"b.kv") == errno.ENOTDIR
    ns.add(ROOT, b"e", DIR, 0, 0)
    assert err(ns.rename, ROOT, b"e", ROOT, b"d") == errno.ENOTEMPTY
    ns.rename(d.ino, b"sub", ROOT, b"top")
    assert sub.parent == ROOT and d.nlink == 2 and ns.get(ROOT).nlink == 5
    assert ns.lookup(sub.ino, b"..").ino == ROOT


def test_rename_of_two_links_to_one_file_does_nothing(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    ns.link(a.ino, ROOT, b"b.kv")
    assert ns.rename(ROOT, b"a.kv", ROOT, b"b.kv") is None
    assert a.nlink == 2 and ns.lookup(ROOT, b"a.kv") is a


def test_rename_exchange(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    b = ns.add(d.ino, b"b.kv", FILE, 0, 0)
    assert ns.rename(ROOT, b"a.kv", d.ino, b"b.kv", exchange=True) is None
    assert ns.lookup(ROOT, b"a.kv") is b and ns.lookup(d.ino, b"b.kv") is a
    assert err(ns.rename, ROOT, b"a.kv", ROOT, b"nope", exchange=True) == errno.ENOENT


def test_listdir_positions_survive_changes(ns):
    for name in (b"a", b"b", b"c"):
        ns.add(ROOT, name, FILE, 0, 0)
    rows = list(ns.listdir(ROOT))
    assert [r[1] for r in rows] == [b".", b"..", b"a", b"b", b"c"]
    after_a = rows[2][0]
    ns.unlink(ROOT, b"a")
    ns.add(ROOT, b"d", FILE, 0, 0)
    ns.rename(ROOT, b"b", ROOT, b"b2")                   # a rename moves a name to the end
    ns.rename(ROOT, b"c", ROOT, b"d", exchange=True)     # an exchange keeps the places
    rows = list(ns.listdir(ROOT, after_a))
    assert [r[1] for r in rows] == [b"c", b"d", b"b2"]
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    assert [r[1] for r in ns.listdir(ROOT, rows[0][0])] == [b"d", b"b2"]
    back = Namespace.from_dict(json.loads(json.dumps(ns.to_dict())))
    assert [r[1] for r in back.listdir(ROOT)] == [b".", b"..", b"c", b"d", b"b2"]


def test_modes_owners_and_times(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    before = a.ctime_ns
    ns.chmod(a, 0o600)
    ns.chown(a, 65534, None)
    assert stat.S_ISREG(a.mode) and stat.S_IMODE(a.mode) == 0o600
    assert (a.uid, a.gid) == (65534, 0) and a.ctime_ns >= before


def test_xattr_rules(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    ns.setxattr(a, b"user.kv.pin", b"1")
    ns.setxattr(a, b"user.kv.ttl", b"3600")
    ns.setxattr(a, b"user.kv.ttl", b" " * (XATTR_VALUE_MAX - 2) + b"60")
    assert ns.getxattr(a, b"user.kv.pin") == b"1"
    assert err(ns.setxattr, a, b"user.kv.tokens", b"5") == errno.EPERM
    assert err(ns.removexattr, a, b"user.kv.model") == errno.EPERM
    assert err(ns.setxattr, a, b"user.kv.pin", b"yes") == errno.EINVAL
    assert err(ns.setxattr, a, b"user.kv.ttl", b"-1") == errno.EINVAL
    assert err(ns.setxattr, a, b"user.kv.ttl", "\u0663".encode()) == errno.EINVAL
    # In user.kv.* only the known names; outside user.* nothing.
    assert err(ns.setxattr, a, b"user.kv.evict", b"1") == errno.EOPNOTSUPP   # not stored
    check_xattr(b"user.kv.evict", b"1")                  # the FUSE layer carries it out
    assert err(check_xattr, b"user.kv.evict", b"0") == errno.EINVAL
    assert err(ns.setxattr, a, b"user.kv.other", b"1") == errno.EOPNOTSUPP
    assert err(ns.setxattr, a, b"trusted.x", b"1") == errno.EOPNOTSUPP
    assert err(ns.setxattr, a, b"security.x", b"1") == errno.EOPNOTSUPP
    assert err(ns.setxattr, d, b"user.kv.pin", b"1") == errno.EOPNOTSUPP     # files only
    # Names and values are short: checked before the value is looked at.
    assert err(ns.setxattr, a, b"user.kv.ttl", b"1" * (XATTR_VALUE_MAX + 1)) == errno.E2BIG
    assert err(ns.setxattr, a, b"user.kv.pin", b"x" * 65536) == errno.E2BIG
    assert err(ns.setxattr, a, b"user." + b"n" * XATTR_NAME_MAX, b"1") == errno.E2BIG
    assert a.xattrs == {b"user.kv.pin": b"1", b"user.kv.ttl": b" " * 62 + b"60"}
    assert err(ns.getxattr, a, b"user.absent") == errno.ENODATA
    ns.removexattr(a, b"user.kv.ttl")
    assert err(ns.removexattr, a, b"user.kv.ttl") == errno.ENODATA
    check_xattr(b"user.kv.ttl", b"0")


def test_application_xattrs_are_bounded_per_node(ns):
    for node in (ns.add(ROOT, b"a.kv", FILE, 0, 0), ns.add(ROOT, b"d", DIR, 0, 0)):
        ns.setxattr(node, b"user.kv.pin", b"1") if node.is_file else None
        for i in range(APP_XATTRS):
            ns.setxattr(node, f"user.app.n{i}".encode(), b"\x00binary\xff")
        assert err(ns.setxattr, node, b"user.app.more", b"v") == errno.ENOSPC
        ns.setxattr(node, b"user.app.n0", b"replaced")           # replacing is fine
        ns.removexattr(node, b"user.app.n1")
        ns.setxattr(node, b"user.app.more", b"v")                 # a slot came free
        assert ns.getxattr(node, b"user.app.n0") == b"replaced"
        assert len([n for n in node.xattrs if n.startswith(b"user.app.")]) == APP_XATTRS


def test_xattrs_of_an_older_state_are_filtered_on_load(ns):
    a = ns.add(ROOT, b"a.kv", FILE, 0, 0)
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    a.xattrs = {b"user.kv.pin": b"1", b"user.kv.ttl": b"forever", b"user.kv.x": b"1",
                b"trusted.t": b"1", b"user.big": b"v" * 1000}
    a.xattrs.update({f"user.n{i}".encode(): b"v" for i in range(1000)})
    d.xattrs = {b"user.kv.pin": b"1", b"user.note": b"hi"}
    back = Namespace.from_dict(json.loads(json.dumps(ns.to_dict())))
    assert back.lookup(ROOT, b"a.kv").xattrs == \
        {b"user.kv.pin": b"1", **{f"user.n{i}".encode(): b"v" for i in range(APP_XATTRS)}}
    assert back.lookup(ROOT, b"d").xattrs == {b"user.note": b"hi"}


def test_names_per_uid_are_bounded():
    ns = Namespace(names_per_uid=4)
    d = ns.add(ROOT, b"d", DIR, 1000, 1000)                     # 1
    a = ns.add(d.ino, b"a.kv", FILE, 1000, 1000)                # 2
    ns.link(a.ino, ROOT, b"a2.kv")                              # 3: a link costs a name
    ns.add(ROOT, b"s", stat.S_IFLNK | 0o777, 1000, 1000, b"d")  # 4
    assert ns.names_of_uid[1000] == 4
    assert err(ns.add, ROOT, b"b.kv", FILE, 1000, 1000) == errno.EDQUOT
    assert err(ns.check_new, ROOT, b"b.kv", 1000) == errno.EDQUOT
    assert err(ns.link, a.ino, ROOT, b"a3.kv") == errno.EDQUOT
    assert err(ns.add, ROOT, b"d2", DIR, 1000, 1000) == errno.EDQUOT
    # Name checks come first; other uids and root are not affected.
    assert err(ns.check_new, ROOT, b"d", 1000) == errno.EEXIST
    ns.add(ROOT, b"other.kv", FILE, 1001, 1001)
    for i in range(10):
        ns.add(ROOT, f"root{i}".encode(), FILE, 0, 0)
    # Removing a name gives it back; renames cost nothing.
    ns.unlink(ROOT, b"a2.kv")
    ns.rename(ROOT, b"s", d.ino, b"s2")
    ns.add(ROOT, b"b.kv", FILE, 1000, 1000)
    assert ns.names_of_uid[1000] == 4
    # A displaced name is given back by a rename over it.
    ns.rename(ROOT, b"b.kv", d.ino, b"a.kv")
    assert ns.names_of_uid[1000] == 3
    # chown (root's) moves the names to the new owner, even past its bound.
    ns.chown(d, 1001, None)
    assert (ns.names_of_uid[1000], ns.names_of_uid[1001]) == (2, 2)
    back = Namespace.from_dict(json.loads(json.dumps(ns.to_dict())), names_per_uid=4)
    assert back.names_of_uid == ns.names_of_uid
    unbounded = Namespace(names_per_uid=0)
    for i in range(10):
        unbounded.add(ROOT, f"f{i}".encode(), FILE, 1000, 1000)
    assert unbounded.names_of_uid[1000] == 10


def test_deep_nesting_has_no_recursion_limit(ns):
    ino = ROOT
    for _ in range(5000):
        ino = ns.add(ino, b"d", DIR, 0, 0).ino          # root: no bound
    leaf = ns.add(ino, b"a.kv", FILE, 1000, 1000)
    assert ns.path_of(leaf.ino) == "/d" * 5000 + "/a.kv"
    back = Namespace.from_dict(json.loads(json.dumps(ns.to_dict())))
    assert back.path_of(leaf.ino) == ns.path_of(leaf.ino)


def test_persistence_round_trip(ns):
    d = ns.add(ROOT, b"d", DIR, 1000, 1000)
    a = ns.add(d.ino, b"a.kv", FILE, 1000, 1000)
    a.cap, a.tokens, a.pages, a.bytes, a.snapshot = "ab" * 16, 20, 2, 4096, "5.kvx"
    ns.link(a.ino, ROOT, "ü b.kv".encode() + b"\xff")
    ns.add(ROOT, b"link", stat.S_IFLNK | 0o777, 0, 0, target=b"d/a.kv")
    ns.setxattr(a, b"user.kv.pin", b"1")
    gone = ns.add(ROOT, b"gone.kv", FILE, 0, 0)
    ns.unlink(ROOT, b"gone.kv")
    doc = json.loads(json.dumps(ns.to_dict()))
    back = Namespace.from_dict(doc)
    assert gone.ino not in back.nodes
    a2 = back.lookup(back.lookup(ROOT, b"d").ino, b"a.kv")
    assert back.lookup(ROOT, "ü b.kv".encode() + b"\xff") is a2
    assert (a2.ino, a2.nlink, a2.cap, a2.tokens, a2.pages, a2.bytes, a2.snapshot) == \
        (a.ino, 2, a.cap, 20, 2, 4096, "5.kvx")
    assert (a2.uid, a2.mode, a2.mtime_ns) == (1000, a.mode, a.mtime_ns)
    assert a2.xattrs == {b"user.kv.pin": b"1"}
    assert back.lookup(ROOT, b"link").target == b"d/a.kv"
    assert back.get(ROOT).nlink == 3 and back.lookup(ROOT, b"d").nlink == 2
    assert back.next_ino == ns.next_ino
    assert back.path_of(a2.ino) in ("/d/a.kv", "/ü b.kv\\xff")
    with pytest.raises(ValueError):
        Namespace.from_dict({"format": 99})


# ---------------------------------------------------------------- scale: no scans

@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=300),
       st.integers(0, 400))
def test_listing_resumes_at_any_position_like_a_sorted_model(ops, resume):
    """`after(pos)` equals a sorted reference whatever adds and removes came before,
    through the compactions of the position list."""
    listing, model, next_pos = Listing(), {}, FIRST
    for add, n in ops:
        name = b"n%d" % n
        if add and name not in model:
            assert listing.add(name) == next_pos
            model[name], next_pos = next_pos, next_pos + 1
        elif not add and name in model:
            listing.remove(name)
            del model[name]
    expected = sorted((pos, name) for name, pos in model.items() if pos > resume)
    assert list(listing.after(resume)) == expected
    assert len(listing) == len(model)
    assert all(listing.position(name) == pos for name, pos in model.items())


def test_listing_compacts_what_removals_leave(ns):
    listing = Listing(b"f%d" % i for i in range(1000))
    for i in range(999):
        listing.remove(b"f%d" % i)
    assert len(listing._slots) <= 2 * len(listing) + SLACK     # not 1000 stale positions
    assert list(listing.after(0)) == [(FIRST + 999, b"f999")]


def test_a_nodes_names_are_indexed_not_searched(ns):
    """names_of and path_of read each node's links, which every change keeps exact."""
    d = ns.add(ROOT, b"d", DIR, 0, 0)
    sub = ns.add(d.ino, b"sub", DIR, 0, 0)
    a = ns.add(sub.ino, b"a.kv", FILE, 0, 0)
    b = ns.add(ROOT, b"b.kv", FILE, 0, 0)
    ns.link(a.ino, ROOT, b"a2.kv")
    assert ns.path_of(a.ino) == "/d/sub/a.kv" and ns.path_of(ROOT) == "/"
    ns.rename(ROOT, b"d", ROOT, b"e")
    assert ns.path_of(a.ino) == "/e/sub/a.kv"
    ns.rename(ROOT, b"a2.kv", ROOT, b"b.kv", exchange=True)
    assert sorted(ns.names_of(a.ino)) == [(ROOT, b"b.kv"), (sub.ino, b"a.kv")]
    assert ns.names_of(b.ino) == [(ROOT, b"a2.kv")]
    assert ns.rename(ROOT, b"b.kv", sub.ino, b"a.kv", exchange=True) is None  # one file
    assert ns.rename(ROOT, b"a2.kv", ROOT, b"b.kv") is a          # a loses b.kv to b
    assert ns.names_of(b.ino) == [(ROOT, b"b.kv")]
    assert ns.names_of(a.ino) == [(sub.ino, b"a.kv")]
    assert ns.drop_names(a.ino) == [(sub.ino, b"a.kv")]
    assert a.nlink == 0 and ns.names_of(a.ino) == [] and ns.path_of(a.ino) == "?"
    c = ns.add(sub.ino, b"c.kv", FILE, 0, 0)
    back = Namespace.from_dict(json.loads(json.dumps(ns.to_dict())))
    assert back.path_of(c.ino) == "/e/sub/c.kv"
    assert back.names_of(sub.ino) == [(d.ino, b"sub")]
