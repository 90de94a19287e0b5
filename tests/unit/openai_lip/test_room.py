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


def test_a_request_of_several_places_waits_as_many_turns():
    """A batch asking 3 places (its prompts times their choices) beside a caller's
    single requests: the callers' turns alternate over the places that come free, the
    batch keeping those its turns give it, so two of the caller's requests start while
    it gathers three; then it starts holding them, never past the limit."""
    r = Room(never, max_running=3, max_queued=64)
    order = []
    for i in range(7):
        if i == 3:
            assert r.submit("batch", lambda: order.append("batch"), "batch", 3)
        assert r.submit(i, lambda i=i: order.append(i), "x")
    assert order == [0, 1, 2] and r.running == 3 and r.queued == 7
    r.end()                             # the batch's turn: the free place kept
    assert order == [0, 1, 2] and r.reserved == 1 and r.collecting == {"batch": [1, 3]}
    r.end()                             # x's turn
    assert order == [0, 1, 2, 3] and r.running == 2
    for _ in range(3):
        r.end()
    assert order == [0, 1, 2, 3, 4, "batch"] and r.running == 3 and r.idle == 2
    assert r.reserved == 0 and r.collecting == {} and r.backlog("x") == 2
    r.end(3, idle=2)
    assert order == [0, 1, 2, 3, 4, "batch", 5, 6] and r.running == 2 and r.idle == 0
    r.end(2)
    assert r.running == 0 and r.queued == 0 and not r.queues and r.collecting == {}


def test_a_batch_never_takes_more_places_than_there_are():
    """63 places taken, a batch of 64 and then another caller's request: the other
    request starts on the second place to come free, not after the whole batch."""
    r = Room(never, max_running=64, max_queued=4096)
    order = []
    for i in range(63):
        assert r.submit(i, lambda: None, "x")
    assert r.submit("batch", lambda: order.append("batch"), "b", 64)
    assert r.submit("c", lambda: order.append("c"), "c")
    assert r.reserved == 1 and order == []
    r.end()                                       # the batch's turn came first
    assert order == [] and r.running == 62 and r.reserved == 2
    r.end()
    assert order == ["c"] and r.running == 62 and r.reserved == 2
    peak = 0
    while "batch" not in order:
        r.end()
        peak = max(peak, r.running + r.reserved)
    assert peak <= 64 and r.running == 64 and r.reserved == 0


def test_the_queue_limits_count_places():
    r = Room(never, max_running=1, max_queued=16)
    assert r.submit("a", lambda: None, "a")                # running
    assert r.submit("b", lambda: None, "b", 4)             # 4 places asked: b's quarter
    assert not r.submit("b2", lambda: None, "b")
    assert r.submit("c", lambda: None, "c", 4) and r.queued == 8
    assert r.withdraw("b") and r.queued == 4 and r.backlog("b") == 0
    assert r.submit("b2", lambda: None, "b")


def test_requests_gather_places_together_only_where_all_they_ask_for_fits():
    """Two batches of 4 on 4 free places, alone: the first gathers all four and starts;
    had each kept every other place, neither would ever have had its four. Beside a
    batch of 3, a request of 2 gathers too (5 fit in 8) and starts first."""
    r = Room(never, max_running=4, max_queued=64)
    order = []
    assert r.submit("a", lambda: None, "a")
    assert r.submit("b1", lambda: order.append("b1"), "b", 4)
    assert r.submit("c1", lambda: order.append("c1"), "c", 4)
    assert r.collecting == {"b": [3, 4]} and r.reserved == 3 and order == []
    r.end()
    assert order == ["b1"] and r.running == 4 and r.reserved == 0
    r.end(4, idle=3)
    assert order == ["b1", "c1"] and r.running == 4 and r.collecting == {}
    r = Room(never, max_running=8, max_queued=64)
    order = []
    for i in range(8):
        assert r.submit(i, lambda: None, "x")
    assert r.submit("three", lambda: order.append("three"), "t", 3)
    assert r.submit("two", lambda: order.append("two"), "w", 2)
    r.end()
    r.end()
    assert r.collecting == {"t": [1, 3], "w": [1, 2]} and r.reserved == 2
    r.end()
    r.end()
    assert order == ["two"] and r.collecting == {"t": [2, 3]}


def test_a_withdrawn_batch_frees_the_places_kept_for_it():
    r = Room(never, max_running=2, max_queued=64)
    order = []
    assert r.submit("a", lambda: None, "a") and r.submit("c", lambda: None, "c")
    assert r.submit("batch", lambda: None, "b", 4) and r.submit("b2", lambda: None, "b")
    assert r.submit("x1", lambda: order.append("x1"), "x")
    r.end()                          # b's turn: the free place kept for its batch
    assert r.collecting == {"b": [1, 2]} and r.reserved == 1 and r.running == 1
    assert order == [] and r.withdraw("batch")       # ... free again: x's turn
    assert r.collecting == {} and r.reserved == 0 and order == ["x1"] and r.running == 2
    assert list(r.queues) == ["b"]


def test_places_held_for_parts_not_started_do_not_count_as_others_for_room():
    """A request of 3 places whose first thread finds no room while nothing else holds
    memory fails at once: its 2 places for parts not started are no one making
    progress. Once its parts have started (`use`), they are."""
    r = Room(never, max_running=4)
    assert r.submit("req", lambda: None, "", 3) and r.running == 3 and r.idle == 2
    with pytest.raises(lip.LipError) as e:
        r.no_room(NO_ROOM, [1], None, None, threading.Event())
    assert e.value is NO_ROOM
    r.use(2)
    assert r.idle == 0
    gone = threading.Event()
    t = threading.Thread(target=lambda: r.no_room(NO_ROOM, [1], None, None, gone))
    t.start()
    eventually(lambda: r.waiting == 1)                     # two others going on: it waits
    gone.set()
    r.wake()
    t.join(5)
    r.end(3)
    assert r.running == 0 and r.idle == 0


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
