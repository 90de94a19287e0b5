"""Capabilities (issue, lookup, revoke, sessions, persistence) and session leases."""
from __future__ import annotations

import re

import pytest

from symphony_protocol import CAP_HEX_LEN, ProtocolError
from predd.server.capabilities import Capabilities, short
from predd.server.sessions import Sessions
from tests.unit.helpers import code


@pytest.fixture
def caps():
    freed: list[int] = []
    table = Capabilities(freed.append)
    table.freed = freed
    return table


# ---------------------------------------------------------------- capabilities

def test_issue_makes_unguessable_distinct_tokens(caps):
    tokens = {caps.issue(1, "rw", 1).token for _ in range(50)}
    assert len(tokens) == 50 and len(caps) == 50
    assert all(re.fullmatch(rf"[0-9a-f]{{{CAP_HEX_LEN}}}", t) for t in tokens)


def test_lookup_returns_the_capability(caps):
    cap = caps.issue(7, "rw", 3)
    got = caps.lookup(cap.token)
    assert (got.oid, got.rights, got.session, got.writable) == (7, "rw", 3, True)
    assert caps.lookup(cap.token, write=True) is got


def test_lookup_of_unknown_or_malformed_token_is_ebadf(caps):
    cap = caps.issue(7, "rw", 3)
    forged = ("0" * CAP_HEX_LEN, cap.token[:-1] + ("0" if cap.token[-1] != "0" else "1"),
              "", cap.token.upper(), None, 12345, b"x" * 16, [cap.token])
    for token in forged:
        assert code(lambda: caps.lookup(token)) == "EBADF"
        assert code(lambda: caps.lookup(token, write=True)) == "EBADF"


def test_write_through_a_read_only_capability_is_eacces(caps):
    ro = caps.issue(7, "r", 3)
    assert not ro.writable
    assert caps.lookup(ro.token).oid == 7
    assert code(lambda: caps.lookup(ro.token, write=True)) == "EACCES"


def test_the_last_revoke_frees_the_object(caps):
    a = caps.issue(7, "rw", 1)
    b = caps.issue(7, "r", 2)
    c = caps.issue(8, "rw", 1)
    assert caps.objects() == {7, 8}
    caps.revoke(a.token)
    assert caps.freed == [] and caps.objects() == {7, 8}
    assert code(lambda: caps.lookup(a.token)) == "EBADF"
    assert caps.lookup(b.token).oid == 7
    caps.revoke(b.token)
    assert caps.freed == [7] and caps.objects() == {8}
    caps.revoke(c.token)
    assert caps.freed == [7, 8] and caps.objects() == set() and len(caps) == 0


def test_revoke_session_revokes_only_that_session(caps):
    s1a = caps.issue(1, "rw", 1)
    caps.issue(2, "rw", 1)
    s2 = caps.issue(1, "r", 2)
    keep = caps.issue(3, "rw", 2)
    assert caps.revoke_session(1) == 2
    assert caps.freed == [2]                 # object 1 lives on through session 2
    assert code(lambda: caps.lookup(s1a.token)) == "EBADF"
    assert caps.lookup(s2.token).oid == 1 and caps.lookup(keep.token).oid == 3
    assert caps.revoke_session(1) == 0
    assert caps.revoke_session(2) == 2
    assert sorted(caps.freed) == [1, 2, 3]


def test_persistent_capabilities_survive_the_session_that_made_them(caps):
    named = caps.issue(5, "rw", None)
    caps.issue(5, "rw", 1)
    assert caps.revoke_session(1) == 1
    assert caps.freed == [] and caps.lookup(named.token).oid == 5
    assert caps.of_session(1) == []
    caps.revoke(named.token)
    assert caps.freed == [5]


def test_of_session(caps):
    a = caps.issue(1, "rw", 1)
    b = caps.issue(2, "r", 1)
    caps.issue(3, "rw", 2)
    caps.issue(4, "rw", None)
    assert [c.token for c in caps.of_session(1)] == [a.token, b.token]
    assert caps.of_session(9) == []


def test_the_free_callback_may_revoke_other_capabilities():
    """Freeing an object can cascade (the engine cancels calls, kvfsd drops names)."""
    freed = []
    table = Capabilities(lambda oid: freed.append(oid))
    a = table.issue(1, "rw", 1)
    table.issue(2, "rw", 1)
    table.revoke(a.token)
    assert freed == [1] and table.objects() == {2}


def test_short_hides_the_secret():
    token = "0123456789abcdef" * 2
    assert short(token) == "cap:0123…"
    assert token not in short(token)


# ---------------------------------------------------------------- sessions

def test_open_makes_a_session_per_identity_bound_to_its_credentials():
    s = Sessions(default_lease_s=10.0)
    a = s.open(b"A", 100.0, uid=1000, via="kernel", peer="localhost:1000:100:7", pid=7)
    b = s.open(b"B", 101.0, uid=0, via="kernel", peer="localhost:0:0:9", pid=9, trusted=True)
    assert (a.sid, b.sid) == (1, 2) and len(s) == 2
    assert (a.started, a.last_seen, a.lease_s) == (100.0, 100.0, 10.0)
    assert (a.uid, a.via, a.peer, a.pid, a.trusted) == (1000, "kernel", "localhost:1000:100:7",
                                                        7, False)
    assert b.trusted
    assert s.of_identity(b"A") is a and s.of_identity(b"C") is None
    assert s.of_sid(1) is a and s.of_sid(3) is None
    assert list(s) == [a, b]
    with pytest.raises(AssertionError):
        s.open(b"A", 102.0)


def test_sessions_are_indexed_by_uid():
    s = Sessions(default_lease_s=10.0)
    a = s.open(b"A", 0.0, uid=1000)
    b = s.open(b"B", 0.0, uid=1000)
    c = s.open(b"C", 0.0, uid=65534)
    assert (s.count(1000), s.count(65534), s.count(0)) == (2, 1, 0)
    assert s.of_uid(1000) == [a, b] and s.of_uid(65534) == [c] and s.of_uid(0) == []
    s.end(a.sid)
    s.end(c.sid)
    assert (s.count(1000), s.count(65534)) == (1, 0)
    assert s.of_uid(1000) == [b]


def test_lease_expires_strictly_after_lease_seconds_of_silence():
    s = Sessions(default_lease_s=10.0)
    a = s.open(b"A", 0.0)
    assert not a.expired(10.0)
    assert a.expired(10.5)
    assert s.expired(10.0) == []
    assert s.expired(10.5) == [a]
    a.last_seen = 10.25                       # a late ping still renews
    assert s.expired(20.25) == [] and s.expired(20.5) == [a]


def test_expired_lists_only_silent_sessions_each_with_its_own_lease():
    s = Sessions(default_lease_s=10.0)
    a = s.open(b"A", 0.0)
    b = s.open(b"B", 0.0)
    c = s.open(b"C", 0.0)
    b.lease_s = 3.0                           # hello may set a session's lease
    c.last_seen = 8.0
    assert s.expired(5.0) == [b]
    assert s.expired(12.0) == [a, b]
    assert s.expired(18.5) == [a, b, c]


def test_end_forgets_the_session_and_a_new_open_makes_a_fresh_one():
    s = Sessions(default_lease_s=10.0)
    a = s.open(b"A", 0.0, uid=5)
    s.end(a.sid)
    s.end(a.sid)                              # twice: no-op
    s.end(999)
    assert len(s) == 0 and s.of_sid(a.sid) is None and s.expired(100.0) == []
    assert s.count(5) == 0
    again = s.open(b"A", 1.0)
    assert again is not a and again.sid == 2


def test_iterating_while_ending_sessions():
    s = Sessions(default_lease_s=1.0)
    for ident in (b"A", b"B", b"C"):
        s.open(ident, 0.0)
    for session in s:                         # iterates over a copy
        s.end(session.sid)
    assert len(s) == 0


def test_rate_bucket_allows_a_burst_then_the_rate():
    s = Sessions(default_lease_s=10.0)
    a = s.open(b"A", 0.0, burst=4.0)
    assert [a.allow(0.0, rate=2.0, burst=4.0) for _ in range(5)] == [True] * 4 + [False]
    assert a.allow(0.25, rate=2.0, burst=4.0) is False     # half a token so far
    assert a.allow(0.5, rate=2.0, burst=4.0) is True       # one token after 0.5 s
    assert a.allow(0.5, rate=2.0, burst=4.0) is False
    assert [a.allow(100.0, rate=2.0, burst=4.0) for _ in range(5)] == [True] * 4 + [False]


def test_trusted_sessions_and_a_zero_rate_are_not_limited():
    s = Sessions(default_lease_s=10.0)
    t = s.open(b"T", 0.0, trusted=True, burst=1.0)
    u = s.open(b"U", 0.0, burst=1.0)
    assert all(t.allow(0.0, rate=1.0, burst=1.0) for _ in range(100))
    assert all(u.allow(0.0, rate=0.0, burst=1.0) for _ in range(100))


# ---------------------------------------------------------------- capability index

def test_count_and_the_index_follow_issue_and_revoke(caps):
    a = caps.issue(1, "rw", 1)
    caps.issue(2, "rw", 1)
    caps.issue(3, "rw", None)
    assert (caps.count(1), caps.count(2)) == (2, 0)
    caps.revoke(a.token)
    assert caps.count(1) == 1 and caps.check() == []
    caps.revoke_session(1)
    assert caps.count(1) == 0 and caps.check() == []
    assert len(caps) == 1


def test_a_grant_from_a_per_open_grant_dies_with_it(caps):
    """kvfsd's per-open grant (from the file's persistent name) ends at release; a
    program that re-granted it must not keep the object (rights follow chmod/rm)."""
    name = caps.issue(7, "rw", None)                     # the file's name: persistent
    per_open = caps.issue(7, "rw", 1, parent=name)       # kvfsd's session: a root grant
    assert per_open.parent is None
    mine = caps.issue(7, "rw", 2, parent=per_open)       # a user re-grants it
    again = caps.issue(7, "r", 3, parent=mine)
    assert (mine.parent, again.parent) == (per_open.token, mine.token)
    caps.revoke(per_open.token)                          # the open is released
    for token in (per_open.token, mine.token, again.token):
        with pytest.raises(ProtocolError) as err:
            caps.lookup(token)
        assert err.value.code == "EBADF"
    assert caps.lookup(name.token).oid == 7 and caps.objects() == {7}
    assert caps.check() == [] and caps.count(2) == 0 and caps.count(3) == 0


def test_a_derived_grant_revoked_alone_leaves_its_parent(caps):
    parent = caps.issue(3, "rw", 1)
    child = caps.issue(3, "r", 2, parent=parent)
    caps.revoke(child.token)
    assert caps.lookup(parent.token).oid == 3 and caps.check() == []
    caps.revoke(parent.token)                             # the last one frees the object
    assert caps.freed == [3] and caps.check() == []


def test_persistent_grants_are_never_derived(caps):
    session_cap = caps.issue(5, "rw", 1)
    named = caps.issue(5, "rw", None, parent=session_cap)
    assert named.parent is None
    caps.revoke(session_cap.token)
    assert caps.lookup(named.token).oid == 5 and caps.check() == []
