"""Identity and limits with a real predd and LIPs running as real other uids.

The uid of an ipc client is the kernel's (SO_PEERCRED): a client cannot claim another
one, only predd's own uid (root here, as kvfsd) may make persistent capabilities or
charge objects to another uid, each uid sees only its own sessions in `ps`, and pages
and objects beyond the limits are EDQUOT. tcp: loopback-only without keys, and a
token names the uid with them."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from liblip.client import Client, LipError
from tests.conftest import ROOT, start_predd
from tests.integration.uid_fixtures import AsUid, LipFailed, needs_root, open_rundir

pytestmark = [needs_root, pytest.mark.slow]
ALICE, BOB = 4001, 4002


def errno(fn) -> str:
    with pytest.raises(LipError) as err:
        fn()
    return err.value.code


@pytest.fixture(scope="module")
def quota_predd():
    """A small predd other uids can reach: 64 pages, 4 per session, 6 per uid."""
    rundir = open_rundir()
    daemon = start_predd(rundir, "--kv-pages", "64", "--session-quota", "4",
                         "--uid-quota", "6", "--lease", "3")
    yield daemon
    code = daemon.stop()
    shutil.rmtree(rundir, ignore_errors=True)
    assert code == 0, f"predd exited {code}"


@pytest.fixture
def root(quota_predd):
    """A client as predd's own uid (trusted, like kvfsd); fsck must be clean after."""
    c = Client(quota_predd.addr)
    yield c
    report = c.call("fsck")
    c.close()
    assert report["clean"], report["problems"]


@pytest.fixture
def agents(quota_predd):
    made: list[AsUid] = []

    def make(uid: int) -> AsUid:
        agent = AsUid(uid, quota_predd.addr)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def test_declaring_another_uid_in_hello_is_eperm(predd):
    c = Client(predd.addr)
    try:
        assert c.session["uid"] == os.getuid()
        assert errno(lambda: c.call("hello", uid=os.getuid() + 1000)) == "EPERM"
        assert c.call("hello", uid=os.getuid())["uid"] == os.getuid()
    finally:
        c.close()


def test_another_uid_is_itself_and_untrusted(root, agents):
    alice = agents(ALICE)
    alice.do("a = Client(addr)")
    assert alice.eval("(a.session['uid'], a.session['trusted'])") == [ALICE, False]
    assert alice.errno("a.call('hello', uid=0)") == "EPERM"
    assert root.session["trusted"] is True


def test_persist_and_foreign_owner_are_eperm_for_other_uids(root, agents):
    alice = agents(ALICE)
    alice.do("a = Client(addr)")
    alice.do("kv = a.call('kv_create')['cap']")
    for expr in ("a.call('kv_create', persist=True)",
                 "a.call('kv_fork', cap=kv, persist=True)",
                 "a.call('kv_grant', cap=kv, rights='r', persist=True)",
                 "a.call('kv_extract', cap=kv, ranges=[], persist=True)",
                 "a.call('kv_merge', caps=[kv], persist=True)",
                 "a.call('kv_create', owner=0)",
                 "a.call('kv_fork', cap=kv, owner=4002)"):
        assert alice.errno(expr) == "EPERM", expr
    assert alice.eval("a.call('kv_create', owner=4001)['tokens']") == 0
    # predd's own uid (kvfsd) may do both: a named cache charged to alice
    named = root.call("kv_create", persist=True, owner=ALICE)["cap"]
    ps = alice.eval("a.call('ps')")
    assert [u["objects"] for u in ps["uids"] if u["uid"] == ALICE] == [3]
    root.call("kv_free", cap=named)


def test_ps_hides_other_uids_sessions(root, agents):
    alice, bob = agents(ALICE), agents(BOB)
    alice.do("a = Client(addr, name='alice-lip')")
    alice.do("a2 = Client(addr, name='alice-2')")
    bob.do("b = Client(addr, name='bob-lip')")
    seen = alice.eval("[(r['uid'], r['client']) for r in a.call('ps')['sessions']]")
    assert sorted(seen) == [[ALICE, "alice-2"], [ALICE, "alice-lip"]]
    assert bob.eval("[r['uid'] for r in b.call('ps')['sessions']]") == [BOB]
    everyone = {(r["uid"], r["client"]) for r in root.call("ps")["sessions"]}
    assert {(ALICE, "alice-lip"), (ALICE, "alice-2"), (BOB, "bob-lip")} <= everyone


def test_pages_beyond_the_session_or_uid_quota_are_edquot(root, agents):
    """--session-quota 4 / --uid-quota 6: nothing is half-done, freeing makes room."""
    alice = agents(ALICE)
    alice.do("a = Client(addr); b = Client(addr)")
    alice.do("kv = a.call('kv_create')['cap']")
    alice.do("a.call('pred', cap=kv, tokens=list(range(1, 65)), outputs=[])")  # 4 pages
    assert alice.errno("a.call('pred', cap=kv, tokens=[7], outputs=[])") == "EDQUOT"
    assert alice.eval("a.call('kv_stat', cap=kv)['tokens']") == 64
    assert alice.errno("a.call('kv_fork', cap=kv)") == "EDQUOT"      # 4 more pages
    alice.do("a.call('kv_truncate', cap=kv, length=32)")                # 2 pages now
    alice.do("other = b.call('kv_create')['cap']")                       # same uid
    alice.do("b.call('pred', cap=other, tokens=list(range(1, 65)), outputs=[])")  # 2 + 4
    assert alice.errno("a.call('pred', cap=kv, tokens=list(range(1, 17)), outputs=[])") \
        == "EDQUOT"                                                     # uid would hold 7
    # another uid has its own 6 pages, even while alice is at her limit
    mine = root.call("kv_create", owner=BOB, persist=True)["cap"]   # no session charge
    root.call("pred", cap=mine, tokens=list(range(1, 97)), outputs=[])  # 6 pages: bob's all
    assert errno(lambda: root.call("pred", cap=mine, tokens=[5], outputs=[])) == "EDQUOT"
    root.call("kv_free", cap=mine)
    alice.do("b.call('kv_free', cap=other)")
    alice.do("a.call('pred', cap=kv, tokens=list(range(1, 17)), outputs=[])")     # room
    ps = alice.eval("a.call('ps')")
    assert [u["pages"] for u in ps["uids"]] == [3]
    # root's own objects are exempt from the uid quota (not from a session quota)
    kv = root.call("kv_create", persist=True)["cap"]
    root.call("pred", cap=kv, tokens=list(range(1, 161)), outputs=[])   # 10 pages
    root.call("kv_free", cap=kv)


def test_objects_beyond_the_session_limit_are_edquot(root, agents):
    alice = agents(ALICE)
    alice.do("a = Client(addr)")
    assert alice.eval("len([a.call('kv_create') for _ in range(1024)])") == 1024
    assert alice.errno("a.call('kv_create')") == "EDQUOT"
    alice.do("b = Client(addr)")                       # a second session of the same uid
    assert alice.eval("b.call('kv_create')['tokens']") == 0
    alice.do("a.close()")
    assert root.call("stats")["objects"] >= 1


# ---------------------------------------------------------------- tcp

def predd_exits(tmp_path, *args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "predd", "--rundir", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc.returncode, proc.stderr


def test_predd_refuses_tcp_off_loopback_without_keys(tmp_path):
    code, err = predd_exits(tmp_path, "--addr", "tcp://0.0.0.0:0")
    assert code == 2 and "needs --auth-keys" in err
    keys = tmp_path / "keys"
    keys.write_text("a-long-enough-token-here 4001\n")
    os.chmod(keys, 0o644)
    code, err = predd_exits(tmp_path, "--addr", "tcp://0.0.0.0:0", "--auth-keys", str(keys))
    assert code == 2 and "lets group or others read it" in err


def test_tcp_sessions_are_nobody_or_named_by_a_token(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# uid 4001\nalice-token-0123456789 4001 alice\n")
    os.chmod(keys, 0o600)
    daemon = start_predd(str(tmp_path / "run"), "--addr", "tcp://0.0.0.0:0",
                         "--auth-keys", str(keys), "--kv-pages", "64")
    try:
        addr = daemon.addr.replace("0.0.0.0", "127.0.0.1")
        assert errno(lambda: Client(addr, token="")) == "EACCES"
        assert errno(lambda: Client(addr, token="wrong-token-0123456789")) == "EACCES"
        c = Client(addr, token="alice-token-0123456789")
        try:
            assert (c.session["uid"], c.session["trusted"]) == (ALICE, False)
            assert errno(lambda: c.call("kv_create", persist=True)) == "EPERM"
            assert c.call("kv_create")["tokens"] == 0
        finally:
            c.close()
        os.environ["SYMPHONY_TOKEN"] = "alice-token-0123456789"
        try:
            c = Client(addr)                           # the token from the environment
            assert c.session["uid"] == ALICE
            c.close()
        finally:
            del os.environ["SYMPHONY_TOKEN"]
    finally:
        assert daemon.stop() == 0
    daemon = start_predd(str(tmp_path / "run2"), "--addr", "tcp://127.0.0.1:0",
                         "--kv-pages", "64")
    try:
        c = Client(daemon.addr)
        try:
            assert (c.session["uid"], c.session["trusted"]) == (65534, False)
            assert errno(lambda: c.call("hello", uid=0)) == "EPERM"
            assert errno(lambda: c.call("kv_create", persist=True)) == "EPERM"
            assert c.call("fsck")["clean"]
        finally:
            c.close()
    finally:
        assert daemon.stop() == 0


def test_an_agent_error_is_reported(agents):
    alice = agents(ALICE)
    with pytest.raises(LipFailed):
        alice.eval("Client(addr).call('kv_stat', cap='0' * 32)")


PROBE = '''
import socket, time
from symphony_protocol.stream import stream_path

def closed(s):
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False

def connect(n):
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(stream_path(addr))
        s.setblocking(False)
        socks.append(s)
    return socks

def closed_ones(socks):
    deadline = time.monotonic() + 20
    while not closed(socks[-1]) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    return [i for i, s in enumerate(socks) if closed(s)]
'''


def test_stream_connections_of_a_uid_stop_at_its_session_limit(root, agents):
    """256 sessions per uid (the quota's default): a uid's 257th stream connection is
    closed as predd accepts it (a client is told EAGAIN); the 256 before it stay open,
    and other uids connect."""
    alice, bob = agents(ALICE), agents(BOB)
    alice.do(PROBE)
    assert alice.eval("closed_ones(socks := connect(257))") == [256]
    assert alice.errno("Client(addr)") == "EAGAIN"      # predd's refusal, not EIO
    bob.do("b = Client(addr)")
    assert bob.eval("b.call('ps')['sessions'][0]['transport']") == "stream"
    alice.do("[s.close() for s in socks]; time.sleep(0.5)")
    alice.do("a = Client(addr)")       # room again once the others closed
    assert alice.eval("a.call('ps')['sessions'][0]['transport']") == "stream"
