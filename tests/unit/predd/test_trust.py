"""Identity, trust and limits through the engine's front door, without a model.

A fake runner (zero logits) and the fake page data of test_kvstore stand in for the
model; requests go through `Engine.handle` exactly as the server hands them over, with
the sender's `Peer` (what libzmq reports for ipc: "localhost:UID:GID:PID")."""
from __future__ import annotations

import itertools
import os
import stat
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from symphony_protocol import pack
from predd.engine.config import EngineConfig
from predd.engine.core import Engine
from predd.server.handlers import HANDLERS
from predd.server.identity import (NOBODY, AuthKeys, Peer, check_endpoint, is_loopback, peer_of)
from predd.server.quotas import QuotaConfig
from predd.worker.runner import RunnerConfig
from predd.engine.scheduler import SchedulerConfig
from tests.unit.helpers import secrets_file
from tests.unit.predd.kvstore_world import FakePages

ME = 0            # predd's own uid in these tests (trusted)
VOCAB = 32
PAGES, PS = 64, 4
TOKEN = "s3cret-token-0123456789"


class FakeRunner:
    def __init__(self) -> None:
        self.config = RunnerConfig("fake", kv_pages=PAGES, page_size=PS)
        self.model_config = SimpleNamespace(vocab_size=VOCAB, name="fake", max_position=4096,
                                            num_layers=2)
        self.cache = FakePages(PAGES, PS)
        self.cache.bytes_per_page = 1000
        self.backend = SimpleNamespace(name="fake")
        self.linear = "plain"
        self.linear_reason = "fake"
        self.graphs, self.graphs_reason = None, "fake"
        self.layer_loop, self.layer_loop_reason = None, "fake"
        self.cascade_reason = "fake"
        self.kv_dtype, self.kv_dtype_reason = "float32", "fake"

    def execute(self, chunks, host=True):
        return [torch.zeros(len(c.outputs), VOCAB) for c in chunks]

    def launch(self, chunks):
        return SimpleNamespace(results=self.execute(chunks), ready=lambda: True)

    def land(self, launch, host=True):
        return launch.results


TOKENIZER = SimpleNamespace(eos_ids=(0,), bos_id=1, decode=lambda ids, **kw: "")


def ipc(uid: int, pid: int = 100) -> Peer:
    return peer_of("ipc", f"localhost:{uid}:{uid}:{pid}")


@dataclass
class Conn:
    """One client connection: a routing identity and the peer it sends as."""
    wire: "Wire"
    identity: bytes
    peer: Peer

    def send(self, op: str, *frames: bytes, **fields) -> int:
        rid = next(self.wire.rids)
        self.wire.engine.handle(self.identity, [pack({"op": op, "rid": rid, **fields}),
                                                *frames], self.wire.now, self.peer)
        return rid

    def reply(self, rid: int) -> dict:
        got = [h for i, h, _ in self.wire.sent if i == self.identity and h["rid"] == rid]
        assert len(got) == 1, got
        return got[0]

    def call(self, op: str, *frames: bytes, **fields) -> dict:
        head = self.reply(self.send(op, *frames, **fields))
        assert head["ok"], head
        return head

    def error(self, op: str, *frames: bytes, **fields) -> str:
        head = self.reply(self.send(op, *frames, **fields))
        assert not head["ok"], head
        return head["error"]["code"]


class Wire:
    def __init__(self, auth: AuthKeys | None = None, **quota) -> None:
        self.sent: list[tuple[bytes, dict, list]] = []
        self.rids = itertools.count(1)
        self.now = 1000.0
        self.ids = itertools.count(1)
        config = EngineConfig(lease_s=10.0, scheduler=SchedulerConfig(token_budget=64),
                              quota=QuotaConfig(**quota), trusted_uid=ME, auth=auth)
        self.engine = Engine(FakeRunner(), TOKENIZER, config,
                             lambda i, h, f: self.sent.append((i, h, f)),
                             handlers=HANDLERS)

    def conn(self, peer: Peer) -> Conn:
        return Conn(self, b"id%d" % next(self.ids), peer)

    def clean(self) -> None:
        assert self.engine.fsck() == []


@pytest.fixture
def wire():
    w = Wire()
    yield w
    w.clean()


# ---------------------------------------------------------------- identity

def test_peer_of_parses_kernel_credentials_only_on_ipc():
    assert peer_of("ipc", "localhost:1000:100:4242") == Peer("localhost:1000:100:4242",
                                                             1000, 100, 4242)
    assert peer_of("ipc", "localhost:1000:100:4242").kernel
    for bad in ("", None, "localhost:1000:100", "localhost:a:1:2", "host:1:2:3"):
        assert not peer_of("ipc", bad).kernel
    assert not peer_of("tcp", "localhost:1000:100:4242").kernel
    assert peer_of("tcp", "127.0.0.1") == Peer("127.0.0.1")


def test_loopback_and_endpoint_policy():
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://127.5.0.1:0")
    assert is_loopback("tcp://localhost:5555") and is_loopback("tcp://[::1]:5555")
    for addr in ("tcp://*:5555", "tcp://0.0.0.0:5555", "tcp://10.0.0.1:5555",
                 "tcp://eth0:5555", "tcp://example.com:5555"):
        assert not is_loopback(addr)
        with pytest.raises(ValueError, match="needs --auth-keys"):
            check_endpoint(addr, None)
        check_endpoint(addr, AuthKeys([(TOKEN.encode(), 1000)]))
    check_endpoint("tcp://127.0.0.1:0", None)
    check_endpoint("ipc:///tmp/x.sock", None)
    for addr in ("inproc://x", "udp://1.2.3.4:5", "/tmp/sock"):
        with pytest.raises(ValueError, match="only ipc:// and tcp://"):
            check_endpoint(addr, None)


def test_auth_keys_file(tmp_path):
    keys = AuthKeys.load(secrets_file(tmp_path, f"# comment\n\n{TOKEN} 1000 alice\n"
                                              "another-token-of-length 2000\n"))
    assert len(keys) == 2
    assert keys.uid_of(TOKEN) == 1000 and keys.uid_of("another-token-of-length") == 2000
    assert keys.uid_of(TOKEN[:-1]) is None and keys.uid_of("") is None
    assert keys.uid_of(TOKEN + "x") is None


@pytest.mark.parametrize("text,mode,message", [
    (f"{TOKEN} 1000\n", 0o640, "lets group or others read it"),
    (f"{TOKEN} 1000\n", 0o604, "lets group or others read it"),
    (f"{TOKEN}\n", 0o600, "expected `TOKEN UID"),
    (f"{TOKEN} alice\n", 0o600, "expected `TOKEN UID"),
    (f"{TOKEN} -1\n", 0o600, "expected `TOKEN UID"),
    ("short 1000\n", 0o600, "shorter than 16"),
    (f"{TOKEN} 1\n{TOKEN} 2\n", 0o600, "listed twice"),
    (f"{TOKEN} 1000 trusted\n", 0o600, "a trusted token must name predd's own uid"),
    ("# nothing\n", 0o600, "no keys"),
])
def test_auth_keys_file_is_refused(tmp_path, text, mode, message):
    with pytest.raises(ValueError, match=message):
        AuthKeys.load(secrets_file(tmp_path, text, mode))


def test_a_trusted_token_names_predds_own_uid(tmp_path):
    me = os.geteuid()
    keys = AuthKeys.load(secrets_file(tmp_path, f"{TOKEN} {me} trusted kvfsd on host b\n"
                                              f"another-token-of-length {me} not trusted\n"))
    assert keys.uid_of(TOKEN) == me and keys.trusts(TOKEN)
    assert not keys.trusts("another-token-of-length") and not keys.trusts(TOKEN[:-1])


def test_auth_keys_file_must_be_a_regular_file(tmp_path):
    with pytest.raises(ValueError, match="No such file"):
        AuthKeys.load(str(tmp_path / "missing"))
    target = secrets_file(tmp_path, f"{TOKEN} 1\n")
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ValueError):
        AuthKeys.load(str(tmp_path / "link"))            # O_NOFOLLOW
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


# ---------------------------------------------------------------- sessions and uids

def test_a_session_takes_the_kernel_uid_and_pid(wire):
    alice = wire.conn(ipc(1000, pid=77))
    hello = alice.call("hello", client="t", pid=5, uid=1000)
    assert (hello["uid"], hello["trusted"]) == (1000, False)
    s = wire.engine.sessions.of_identity(alice.identity)
    assert (s.uid, s.pid, s.via, s.trusted) == (1000, 77, "kernel", False)   # not pid 5
    root = wire.conn(ipc(ME))
    assert root.call("hello", uid=ME)["trusted"] is True
    anon = wire.conn(ipc(1000))
    assert anon.call("hello")["uid"] == 1000            # uid -1: nothing declared


def test_hello_declaring_another_uid_is_eperm(wire):
    mallory = wire.conn(ipc(1000))
    assert mallory.error("hello", uid=0) == "EPERM"
    assert mallory.error("hello", uid=1001) == "EPERM"
    reply = mallory.reply(mallory.send("hello", uid=0))
    assert "uid 1000 by the kernel" in reply["error"]["message"]
    assert wire.engine.sessions.of_identity(mallory.identity).uid == 1000


def test_another_peer_under_a_sessions_routing_identity_is_eperm(wire):
    alice = wire.conn(ipc(1000, pid=77))
    kv = alice.call("kv_create")["cap"]
    s = wire.engine.sessions.of_identity(alice.identity)
    wire.now += 5
    for peer in (ipc(0, pid=77), ipc(1000, pid=78), peer_of("ipc", None)):
        thief = Conn(wire, alice.identity, peer)
        assert thief.error("kv_stat", cap=kv) == "EPERM"
        assert thief.error("bye") == "EPERM"
    assert s.last_seen == 1000.0                         # untouched
    assert wire.engine.sessions.of_identity(alice.identity) is s
    assert alice.call("kv_stat", cap=kv)["tokens"] == 0
    assert s.last_seen == 1005.0


def test_ps_shows_only_the_callers_uid_unless_trusted(wire):
    a1, a2 = wire.conn(ipc(1000, 1)), wire.conn(ipc(1000, 2))
    b = wire.conn(ipc(2000, 3))
    root = wire.conn(ipc(ME, 4))
    for c in (a1, a2, b, root):
        c.call("hello", client=f"c{c.peer.pid}")
    a1.call("kv_create")
    ps = a1.call("ps")
    assert [(r["uid"], r["pid"], r["objects"]) for r in ps["sessions"]] == [(1000, 1, 1),
                                                                           (1000, 2, 0)]
    assert [u["uid"] for u in ps["uids"]] == [1000]
    assert ps["uids"][0]["objects"] == 1 and ps["uids"][0]["sessions"] == 2
    assert [r["uid"] for r in b.call("ps")["sessions"]] == [2000]
    assert [r["uid"] for r in root.call("ps")["sessions"]] == [1000, 1000, 2000, ME]


# ---------------------------------------------------------------- persist and owner

def test_persist_is_for_trusted_peers_only(wire):
    user = wire.conn(ipc(1000))
    kv = user.call("kv_create")["cap"]
    blob = user.call("kv_export", cap=kv)
    frames = [f for i, h, f in wire.sent if h["rid"] == blob["rid"]][0]
    for op, fields, extra in [("kv_create", {}, ()), ("kv_fork", {"cap": kv}, ()),
                              ("kv_grant", {"cap": kv}, ()),
                              ("kv_extract", {"cap": kv, "ranges": []}, ()),
                              ("kv_merge", {"caps": [kv]}, ()), ("kv_import", {}, frames)]:
        assert user.error(op, *extra, persist=True, **fields) == "EPERM", op
    assert len(wire.engine.store.objects) == 1 and len(wire.engine.caps) == 1
    kvfsd = wire.conn(ipc(ME))
    named = kvfsd.call("kv_create", persist=True, owner=1000)["cap"]
    assert wire.engine.caps.lookup(named).session is None
    assert wire.engine.quotas.usage(1000)["objects"] == 2
    kvfsd.call("kv_free", cap=named)
    user.call("kv_free", cap=kv)


def test_owner_other_than_oneself_is_for_trusted_peers_only(wire):
    user = wire.conn(ipc(1000))
    kv = user.call("kv_create", owner=1000)["cap"]        # oneself: fine
    assert user.error("kv_create", owner=0) == "EPERM"
    assert user.error("kv_fork", cap=kv, owner=2000) == "EPERM"
    assert user.error("kv_create", owner=-5) == "EINVAL"
    kvfsd = wire.conn(ipc(ME))
    grant = kvfsd.call("kv_create", owner=2000)
    assert wire.engine.quotas.charges[wire.engine.caps.lookup(grant["cap"]).oid].uid == 2000
    assert kvfsd.error("kv_create", owner=2**32) == "EINVAL"
    q = wire.engine.quotas
    assert (q.objects_of_uid, q.objects_of_session) == ({1000: 1, 2000: 1}, {1: 1, 2: 1})


# ---------------------------------------------------------------- limits

def pred(conn: Conn, cap: str, n: int = 1) -> int:
    return conn.send("pred", cap=cap, tokens=[2 + i % 20 for i in range(n)], outputs=[])


def test_pages_are_charged_through_pred_fork_truncate_and_free(wire):
    user = wire.conn(ipc(1000))
    kv = user.call("kv_create")["cap"]
    rid = pred(user, kv, 9)
    while wire.engine.step():
        pass
    assert user.reply(rid)["ok"]
    q = wire.engine.quotas
    assert q.pages_of_uid == {1000: 3} and q.pages_of_session == {1: 3}
    fork = user.call("kv_fork", cap=kv)["cap"]
    assert q.pages_of_uid == {1000: 6}
    user.call("kv_truncate", cap=fork, length=4)
    assert q.pages_of_uid == {1000: 4}
    user.call("kv_free", cap=kv)
    assert q.pages_of_uid == {1000: 1}
    wire.clean()
    user.call("bye")
    assert q.pages_of_uid == {} and q.objects_of_uid == {}


def test_objects_over_the_limit_are_edquot():
    wire = Wire(session_objects=2, uid_objects=3)
    a, b = wire.conn(ipc(1000, 1)), wire.conn(ipc(1000, 2))
    kv = a.call("kv_create")["cap"]
    a.call("kv_fork", cap=kv)
    assert a.error("kv_create") == "EDQUOT"
    assert a.error("kv_fork", cap=kv) == "EDQUOT"
    b.call("kv_create")
    assert b.error("kv_create") == "EDQUOT"               # the uid's fourth
    assert len(wire.engine.store.objects) == 3
    root = wire.conn(ipc(ME))
    for _ in range(5):
        root.call("kv_create", persist=True)              # the daemon's uid: exempt
    wire.clean()


def test_the_uid_page_quota_defaults_to_half_the_pool():
    wire = Wire()
    user = wire.conn(ipc(1000))
    kv = user.call("kv_create")["cap"]
    rid = pred(user, kv, PAGES // 2 * PS)
    while wire.engine.step():
        pass
    assert user.reply(rid)["ok"]
    rid = pred(user, kv, 1)
    wire.engine.step()
    assert user.reply(rid)["error"]["code"] == "EDQUOT"
    wire.clean()


def test_request_rate_is_eagain_beyond_the_burst():
    wire = Wire(rate=10.0, burst=5.0)
    user = wire.conn(ipc(1000))
    assert [user.reply(user.send("ping"))["ok"] for _ in range(6)] == [True] * 5 + [False]
    assert user.error("ping") == "EAGAIN"
    wire.now += 0.1                                       # one more token
    user.call("ping")
    assert user.error("ping") == "EAGAIN"
    root = wire.conn(ipc(ME))
    for _ in range(50):
        root.call("ping")                                 # trusted: no bucket
    assert wire.engine.counters.throttled == 3


def test_calls_in_flight_are_eagain_beyond_the_limit():
    wire = Wire(session_calls=3, uid_calls=4)
    a, b = wire.conn(ipc(1000, 1)), wire.conn(ipc(1000, 2))
    kvs = [a.call("kv_create")["cap"] for _ in range(2)]
    first = [pred(a, kvs[0]), pred(a, kvs[1]), pred(a, kvs[0])]   # the last one is held
    assert wire.engine.sessions.of_identity(a.identity).deferred == 1
    assert a.error("pred", cap=kvs[1], tokens=[2]) == "EAGAIN"
    assert a.error("generate", cap=kvs[1], tokens=[2]) == "EAGAIN"
    a.call("kv_stat", cap=kvs[0])                         # other requests still answer
    other = b.call("kv_create")["cap"]
    pred(b, other)                                        # the uid's fourth
    assert b.error("pred", cap=other, tokens=[3]) == "EAGAIN"
    ps = a.call("ps")
    assert [r["calls"] for r in ps["sessions"]] == [3, 1] and ps["uids"][0]["calls"] == 4
    wire.clean()
    while wire.engine.step():
        pass
    assert all(a.reply(rid)["ok"] for rid in first)
    pred(a, kvs[0])
    wire.clean()
    while wire.engine.step():
        pass


def test_held_requests_of_a_freed_object_get_ebadf_and_are_uncounted(wire):
    a = wire.conn(ipc(1000))
    kv = a.call("kv_create")["cap"]
    busy = pred(a, kv)
    held = pred(a, kv)
    s = wire.engine.sessions.of_identity(a.identity)
    assert s.deferred == 1
    wire.engine.caps.revoke(kv)                           # the object goes
    assert a.reply(busy)["error"]["code"] == "EBADF"
    assert a.reply(held)["error"]["code"] == "EBADF"
    assert s.deferred == 0 and wire.engine.deferred.of_uid == {}


def test_ending_a_session_uncounts_its_held_requests(wire):
    a = wire.conn(ipc(1000))
    kv = a.call("kv_create")["cap"]
    pred(a, kv)
    pred(a, kv)
    assert wire.engine.deferred.of_uid == {1000: 1}
    a.call("bye")
    assert wire.engine.deferred.of_uid == {} and wire.engine.scheduler.pending() == 0


def test_capabilities_per_session_are_emfile():
    wire = Wire(session_caps=3)
    a = wire.conn(ipc(1000))
    kv = a.call("kv_create")["cap"]
    a.call("kv_grant", cap=kv)
    a.call("kv_fork", cap=kv)
    assert a.error("kv_grant", cap=kv) == "EMFILE"
    assert a.error("kv_create") == "EMFILE"
    assert len(wire.engine.store.objects) == 2
    wire.clean()


def test_sessions_per_uid_are_eagain():
    wire = Wire(uid_sessions=2)
    a, b, c = (wire.conn(ipc(1000, pid)) for pid in (1, 2, 3))
    a.call("ping")
    b.call("ping")
    assert c.error("ping") == "EAGAIN"
    assert wire.engine.sessions.of_identity(c.identity) is None
    wire.conn(ipc(2000)).call("ping")                     # another uid
    for _ in range(3):
        wire.conn(ipc(ME)).call("ping")                   # trusted: no limit
    a.call("bye")
    c.call("ping")


# ---------------------------------------------------------------- tcp

def test_loopback_tcp_without_keys_is_nobody(wire):
    t = wire.conn(peer_of("tcp", "127.0.0.1"))
    hello = t.call("hello", client="remote", pid=33)
    assert (hello["uid"], hello["trusted"]) == (NOBODY, False)
    s = wire.engine.sessions.of_identity(t.identity)
    assert (s.via, s.pid) == ("nobody", 33)
    assert t.error("hello", uid=0) == "EPERM"
    assert t.error("kv_create", persist=True) == "EPERM"


def test_tcp_with_keys_needs_a_token_first():
    wire = Wire(auth=AuthKeys([(TOKEN.encode(), 1000), (b"the-other-token-xyz", 2000)]))
    t = wire.conn(peer_of("tcp", "10.1.2.3"))
    assert t.error("ping") == "EACCES"
    assert t.error("hello") == "EACCES"
    assert t.error("hello", token="not-a-valid-token-at-all") == "EACCES"
    assert wire.engine.sessions.of_identity(t.identity) is None
    hello = t.call("hello", token=TOKEN)
    assert (hello["uid"], hello["trusted"]) == (1000, False)
    t.call("ping")
    t.call("hello", token=TOKEN)
    assert t.error("hello", token="the-other-token-xyz") == "EPERM"
    assert t.error("kv_create", persist=True) == "EPERM"
    ipc_user = wire.conn(ipc(3000))
    assert ipc_user.call("hello", token="whatever")["uid"] == 3000   # ipc: the kernel's
    wire.clean()


def test_a_trusted_token_opens_a_trusted_tcp_session():
    me = os.geteuid()
    wire = Wire(auth=AuthKeys([(TOKEN.encode(), me), (b"the-other-token-xyz", me)],
                              trusted=[TOKEN.encode()]))
    kvfsd = wire.conn(peer_of("tcp", "10.1.2.3"))
    hello = kvfsd.call("hello", token=TOKEN)
    assert (hello["uid"], hello["trusted"]) == (me, True)
    kvfsd.call("kv_create", persist=True, owner=1000)
    plain = wire.conn(peer_of("tcp", "10.1.2.4"))
    assert plain.call("hello", token="the-other-token-xyz")["trusted"] is False
    assert plain.error("kv_create", persist=True) == "EPERM"
    wire.clean()
