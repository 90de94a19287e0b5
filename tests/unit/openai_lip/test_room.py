"""The OpenAI program's KV memory among its requests (openai_lip/room.py): a queue past
the running limit, and no request failing for room that others hold — they wait, and
when every holder waits one gives its cache back and computes it again. Fake caches
(lists of tokens) and real threads; no daemon."""
from __future__ import annotations

import threading
import time

import pytest

import liblip as lip
from openai_lip import room as room_mod
from openai_lip.room import Room

NO_ROOM = lip.LipError("EDQUOT", "uid quota")


@pytest.fixture(autouse=True)
def fake_tokens(monkeypatch):
    monkeypatch.setattr(room_mod.lip, "kv_tokens", lambda kv: list(kv))


def never() -> bool:
    return False


def started(r: Room, n: int) -> list[list]:
    """n requests submitted and started; each one's start calls, in a list."""
    calls = [[] for _ in range(n)]
    for i in range(n):
        assert r.submit(i, lambda i=i: calls[i].append(i))
    return calls


def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_past_the_running_limit_requests_queue_first_come_first_started():
    r = Room(never, max_running=2, max_queued=12)
    calls = started(r, 4)
    assert calls == [[0], [1], [], []] and r.running == 2
    assert r.submit(4, lambda: None)
    assert not r.submit(5, lambda: None)             # a quarter of the queue is one caller's
    assert r.withdraw(3) and not r.withdraw(3)       # cancelled before it started
    r.end()
    assert calls[2] == [2] and r.running == 2 and calls[3] == []
    r.end()
    r.end()
    r.end()
    assert r.running == 0 and not r.queues and r.queued == 0


def test_callers_are_started_in_turn():
    r = Room(never, max_running=1, max_queued=64)
    order = []
    for i in range(4):
        assert r.submit(("flood", i), lambda i=i: order.append(("flood", i)), "flood")
    assert r.submit(("alice", 0), lambda: order.append(("alice", 0)), "alice")
    assert r.submit(("bob", 0), lambda: order.append(("bob", 0)), "bob")
    for _ in range(6):
        r.end()
    assert order == [("flood", 0), ("flood", 1), ("alice", 0), ("bob", 0), ("flood", 2),
                     ("flood", 3)]
    assert r.queued == 0 and not r.queues


def test_the_prefix_cache_goes_first():
    dropped = []
    r = Room(lambda: dropped.append(1) or True)
    started(r, 1)
    kv = [1, 2, 3]
    assert r.no_room(NO_ROOM, kv, None, None, threading.Event()) is kv
    assert dropped == [1]


def test_other_errors_and_a_request_alone_fail():
    r = Room(never)
    started(r, 1)
    with pytest.raises(lip.LipError) as e:
        r.no_room(lip.LipError("EINVAL", "bad"), [1], None, None, threading.Event())
    assert e.value.code == "EINVAL"
    with pytest.raises(lip.LipError) as e:           # nobody else holds memory
        r.no_room(NO_ROOM, [1], None, None, threading.Event())
    assert e.value is NO_ROOM


def test_a_request_waits_while_another_runs_and_nothing_new_starts(monkeypatch):
    monkeypatch.setattr(room_mod, "WAIT_S", 30.0)
    r = Room(never, max_running=4)
    calls = started(r, 2)
    out = []
    kv = [7, 8]
    t = threading.Thread(target=lambda: out.append(
        r.no_room(NO_ROOM, kv, None, None, threading.Event())))
    t.start()
    eventually(lambda: r.waiting == 1)
    assert r.submit(9, lambda: calls.append([9])) and len(calls) == 2   # held back
    r.end()                                          # the other ended: try again
    t.join(5)
    assert out == [kv] and r.waiting == 0
    assert calls[-1] == [9]                          # and the queued one started


def test_when_every_holder_waits_one_gives_its_cache_back_and_rebuilds(monkeypatch):
    monkeypatch.setattr(room_mod, "WAIT_S", 30.0)
    r = Room(never)
    started(r, 2)
    first, second = [1, 2, 3], [4, 5]
    given, rebuilt, out = [], [], {}
    t1 = threading.Thread(target=lambda: out.__setitem__(1, r.no_room(
        NO_ROOM, first, given.append, None, threading.Event())))
    t1.start()
    eventually(lambda: r.waiting == 1)

    def rebuild(tokens):
        rebuilt.append(tokens)
        return list(tokens)
    t2 = threading.Thread(target=lambda: out.__setitem__(2, r.no_room(
        NO_ROOM, second, given.append, rebuild, threading.Event())))
    t2.start()
    t1.join(5)                   # the second gave its cache back: the first tries again
    assert out[1] is first and given == [second] and r.parked == 1
    assert rebuilt == []         # it waits for the first to end
    r.end()
    t2.join(5)
    assert rebuilt == [[4, 5]] and out[2] == [4, 5] and out[2] is not second
    assert (r.running, r.waiting, r.parked) == (1, 0, 0)


def test_a_cancelled_request_stops_waiting(monkeypatch):
    monkeypatch.setattr(room_mod, "WAIT_S", 30.0)
    r = Room(never)
    started(r, 2)
    cancelled = threading.Event()
    out = []
    t = threading.Thread(target=lambda: out.append(
        r.no_room(NO_ROOM, [1], None, None, cancelled)))
    t.start()
    eventually(lambda: r.waiting == 1)
    cancelled.set()
    with r.cond:
        r.cond.notify_all()
    t.join(5)
    assert out == [[1]] and r.waiting == 0           # back to its call, which checks
