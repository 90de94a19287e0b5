"""A step's pass in flight (Engine.launch .. Engine.land; the server's `_fly`): while the
device computes, a pred_sample loop's next call takes its speculation at once — one in
the pass becomes the caller's and is answered when it lands, a computed one is answered
there and then — and every other message waits, untouched, for the step's end, in its
connection's order. The fake runner's launch is not `ready` until asked `flying` times,
as a GPU's pass is not when the host has launched it."""
from __future__ import annotations

import socket
import time

import msgpack
import torch

from predd.engine.config import EngineConfig
from predd.engine.core import Engine
from predd.engine.scheduler import SchedulerConfig
from predd.server.handlers import HANDLERS
from predd.server.loop import Server
from symphony_protocol.stream import Reader, frame, stream_path
from tests.unit.engine_fakes import ME, FakeRunner, FakeTokenizer, Harness

A, B = b"a", b"b"
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.8, "top_k": 5, "seed": 7}


def message(h: Harness, op: str, **fields) -> tuple[int, list[bytes]]:
    h.rid += 1
    return h.rid, [msgpack.packb({"op": op, "rid": h.rid, **fields}, use_bin_type=True)]


def flown_loops(h: Harness, programs: list[bytes], n: int, sample: dict,
                flying: int, hold: bool = False) -> dict[bytes, list[int]]:
    """pred_sample loops of n + 1 tokens, one a program, driven as predd's server drives
    them: each step launched, and while its pass flies each program's calls that came
    since the launch are offered to `handle_in_flight`; what is not taken is handled
    after the step lands, before the next launch, as are the calls answering what was
    sent as a pass landed. A program sends its next call as soon as it has its answer. `hold`: the steps' logits say they are on a device and the
    server holds their answers until the next launch (`Engine.release_held`)."""
    h.runner.flying = flying
    h.runner.on_device = hold
    h.engine.hold_for = (lambda identity: True) if hold else None
    caps = {who: h.ok(who, "kv_create")["cap"] for who in programs}
    came: dict[bytes, list[list[bytes]]] = {who: [] for who in programs}   # to offer
    left: dict[bytes, list[list[bytes]]] = {}                              # after the step
    waiting: dict[bytes, int | None] = {}
    tokens: dict[bytes, list[int]] = {who: [] for who in programs}
    for i, who in enumerate(programs):
        waiting[who], first = message(h, "pred", cap=caps[who], tokens=[5 + i, 6],
                                      sample=sample)
        left[who] = [first]

    def answered() -> None:
        for who in programs:
            rid = waiting[who]
            got = [head for i, head, _ in h.replies if i == who and head["rid"] == rid]
            if rid is None or not got:
                continue
            (head,) = got
            assert head["ok"], head
            tokens[who].append(head["tokens"][0])
            if len(tokens[who]) > n:
                waiting[who] = None
                continue
            waiting[who], call = message(h, "pred", cap=caps[who], tokens=[head["tokens"][0]],
                                         sample=sample)
            came[who].append(call)

    for _ in range(10 * n * len(programs)):
        for who in programs:
            for call in left[who]:
                h.engine.handle(who, call, time.monotonic(), ME)
            left[who] = []
        flight = h.engine.launch()
        h.engine.release_held()
        answered()
        if flight is None:
            if not any(came.values()):
                break
            left, came = came, {who: [] for who in programs}
            continue
        while not flight.ready():
            for who in programs:
                while came[who] and h.engine.handle_in_flight(who, came[who][0],
                                                              time.monotonic(), ME):
                    came[who].pop(0)
            answered()
        left, came = came, {who: [] for who in programs}
        h.engine.land(flight)
        answered()                 # answers sent as the pass landed: back before the next
        for who in programs:
            left[who] += came[who]
            came[who] = []
    assert all(rid is None for rid in waiting.values())
    return tokens


def test_loops_take_their_speculation_in_flight_and_get_the_tokens_of_a_plain_run():
    for sample in (GREEDY, SEEDED):
        held, flown, plain, off = Harness(), Harness(), Harness(), Harness(speculate=False)
        got = flown_loops(held, [A, B], 10, sample, flying=2, hold=True)
        assert flown_loops(flown, [A, B], 10, sample, flying=2) == got
        assert flown_loops(plain, [A, B], 10, sample, flying=0) == got
        assert flown_loops(off, [A, B], 10, sample, flying=2, hold=True) == got
        # held until the next launch, every answer's next call comes while a pass flies
        # and takes its speculation, but after an end-of-sequence token (none offered)
        ends = sum(tokens[:-1].count(0) for tokens in got.values())
        assert held.ok(A, "stats")["answered_in_flight"] == 20 - ends
        # sent as the pass lands, they are back before the next launch: taken then
        assert flown.ok(A, "stats")["answered_in_flight"] == 0
        assert plain.ok(A, "stats")["answered_in_flight"] == 0
        assert off.ok(A, "stats")["answered_in_flight"] == 0    # nothing to take
        assert held.engine.held == [] and off.engine.held == []
        for h in (held, flown, plain, off):
            assert h.ok(A, "fsck")["clean"]
        assert held.free_pages() == flown.free_pages() == plain.free_pages() == off.free_pages()
        for h in (held, flown, plain, off):
            h.clean()


def test_in_flight_only_the_loops_next_call_is_taken_and_the_rest_is_left_untouched():
    h, off = Harness(), Harness(speculate=False)
    kv = h.ok(A, "kv_create")["cap"]
    h.ok(B, "ping")                           # another session
    first = h.send(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)
    h.engine.step()                           # answered; its next step queued
    token = h.reply(A, first)["tokens"][0]
    h.runner.flying = 3
    flight = h.engine.launch()                # the speculation is in this pass
    assert not flight.ready()
    requests, replies = h.engine.counters.requests, len(h.replies)
    speculations = dict(h.engine.speculation.by_oid)
    others = [message(h, "kv_stat", cap=kv)[1],
              message(h, "pred", cap=kv, tokens=[token + 1], sample=GREEDY)[1],
              message(h, "pred", cap=kv, tokens=[token], sample=GREEDY, mask=[1, 2])[1],
              message(h, "pred", cap=kv, tokens=[token], sample=SEEDED)[1],
              message(h, "pred", cap=kv, tokens=[token], sample=GREEDY)[1] + [b"x"],
              message(h, "pred", cap=kv, tokens=[token], sample=GREEDY, pad="x" * 1024)[1],
              [b"\xc1"]]
    for call in others:
        assert not h.engine.handle_in_flight(A, call, time.monotonic(), ME)
    take = message(h, "pred", cap=kv, tokens=[token], sample=GREEDY)
    assert not h.engine.handle_in_flight(B, take[1], time.monotonic(), ME)  # not its session
    assert (h.engine.counters.requests, len(h.replies)) == (requests, replies)
    assert h.engine.speculation.by_oid == speculations and h.engine.counters.answered_in_flight == 0
    assert h.engine.handle_in_flight(A, take[1], time.monotonic(), ME)
    assert len(h.replies) == replies          # answered when the pass lands
    stray = h.send(B, "ping")                 # a server never does this in flight
    assert h.reply(B, stray)["error"]["code"] == "EIO"
    while not flight.ready():
        pass
    h.engine.land(flight)
    _, want = _plain_loop(off, (3, 4), 1)
    assert h.reply(A, take[0])["tokens"] == [want[1]]
    assert h.engine.counters.answered_in_flight == 1
    assert h.engine.counters.requests == requests + 2        # and the stray ping
    assert h.ok(A, "fsck")["clean"]
    h.clean()


def _plain_loop(h: Harness, prompt, n: int) -> tuple[str, list[int]]:
    kv = h.ok(A, "kv_create")["cap"]
    out = [h.ok(A, "pred", cap=kv, tokens=list(prompt), sample=GREEDY)["tokens"][0]]
    for _ in range(n):
        out.append(h.ok(A, "pred", cap=kv, tokens=[out[-1]], sample=GREEDY)["tokens"][0])
    return kv, out


def test_a_computed_speculation_is_answered_and_committed_while_another_pass_flies():
    h, off = Harness(), Harness(speculate=False)
    kv = h.ok(A, "kv_create")["cap"]
    token = h.ok(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)["tokens"][0]
    assert h.engine.speculation.by_oid[h.engine.caps.lookup(kv).oid].parked
    other = h.ok(B, "kv_create")["cap"]
    late = h.send(B, "pred", cap=other, tokens=[1, 2], sample=GREEDY)
    h.runner.flying = 2
    flight = h.engine.launch()                # B's call; A's computed step waits apart
    rid, call = message(h, "pred", cap=kv, tokens=[token], sample=GREEDY)
    assert h.engine.handle_in_flight(A, call, time.monotonic(), ME)
    kv_off, want = _plain_loop(off, (3, 4), 1)
    assert h.reply(A, rid)["tokens"] == [want[1]]           # at once
    assert h.entries(kv) == off.entries(kv_off) == ([3, 4, token], [0, 1, 2])
    while not flight.ready():
        pass
    h.engine.land(flight)
    assert h.reply(B, late)["ok"]
    h.drain()
    assert h.ok(A, "fsck")["clean"]
    h.clean()


def test_a_pass_that_fails_where_it_lands_fails_its_calls_alone_by_halves(monkeypatch):
    """A device-side error is raised where the pass lands: the batch runs again by
    halves, and a call taken in flight gets the plain run's token."""
    h, off = Harness(), Harness(speculate=False)
    kv, other = h.ok(A, "kv_create")["cap"], h.ok(B, "kv_create")["cap"]
    first = h.send(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)
    h.engine.step()
    token = h.reply(A, first)["tokens"][0]
    late = h.send(B, "pred", cap=other, tokens=[1, 2], sample=GREEDY)
    h.runner.flying = 2
    flight = h.engine.launch()
    assert len(flight.chunks) == 2
    rid, call = message(h, "pred", cap=kv, tokens=[token], sample=GREEDY)
    assert h.engine.handle_in_flight(A, call, time.monotonic(), ME)

    def land(launch, host=True):
        raise RuntimeError("device-side assert triggered")
    monkeypatch.setattr(h.runner, "land", land)
    batches = len(h.runner.batches)
    while not flight.ready():
        pass
    h.engine.land(flight)
    assert h.runner.batches[batches:] == [1, 1]                # by halves
    assert any("retrying it in halves" in line for line in h.logs)
    _, want = _plain_loop(off, (3, 4), 1)
    assert h.reply(A, rid)["tokens"] == [want[1]]
    assert h.reply(B, late)["ok"]
    assert h.ok(A, "fsck")["clean"]
    h.clean()


def test_a_launch_whose_event_raises_is_done_and_lands():
    """An asynchronous device-side error makes the event's query raise: the pass counts
    as done, and its error is raised where it lands."""
    from predd.worker.runner import Launch

    class Broken:
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert Launch(torch.empty(0), [], Broken()).ready()


# ---------------------------------------------------------------- through the server

class Client:
    """A raw local stream connection to the server under test."""

    def __init__(self, srv: Server) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(stream_path(srv.addr))
        self.sock.setblocking(False)
        self.reader = Reader(1 << 20)
        self.rid = 0
        self.replies: list[dict] = []

    def send(self, *calls: dict) -> list[int]:
        rids, data = [], b""
        for fields in calls:
            self.rid += 1
            rids.append(self.rid)
            data += b"".join(frame([msgpack.packb({"rid": self.rid, **fields})]))
        self.sock.sendall(data)
        return rids

    def read(self) -> None:
        try:
            while self.reader.receive(self.sock, 1 << 16) > 0:
                pass
        except BlockingIOError:
            pass
        self.replies += [msgpack.unpackb(m[0]) for m in self.reader.feed(b"")]

    def reply(self, rid: int) -> dict | None:
        self.read()
        return next((r for r in self.replies if r["rid"] == rid), None)


def served(srv: Server, client: Client, rid: int) -> dict:
    """Turns of the server (messages, then a step) until `rid` is answered."""
    for _ in range(200):
        srv._drain()
        srv._step()
        reply = client.reply(rid)
        if reply is not None:
            return reply
    raise AssertionError(f"no reply to {rid}")


def test_the_server_answers_a_loops_call_in_flight_and_keeps_each_connections_order(tmp_path):
    runner, logs = FakeRunner(), []
    runner.flying = 3
    config = EngineConfig(scheduler=SchedulerConfig(token_budget=16, max_batch=8))
    srv = Server(f"ipc://{tmp_path}/predd.sock",
                 lambda send, log: Engine(runner, FakeTokenizer(), config, send, log,
                                          handlers=HANDLERS), log=logs.append)
    try:
        c = Client(srv)
        kv = served(srv, c, c.send({"op": "kv_create"})[0])["cap"]
        first = served(srv, c, c.send({"op": "pred", "cap": kv, "tokens": [3, 4],
                                       "sample": GREEDY})[0])["tokens"][0]
        # its next step is queued: the call that takes it is read while that step flies
        (rid,) = c.send({"op": "pred", "cap": kv, "tokens": [first], "sample": GREEDY})
        assert srv._step() and srv.engine.counters.answered_in_flight == 1
        second = c.reply(rid)["tokens"][0]
        # a kv_stat first: it and the call behind it wait for the step's end, in order
        stat, late = c.send({"op": "kv_stat", "cap": kv},
                            {"op": "pred", "cap": kv, "tokens": [second], "sample": GREEDY})
        assert srv._step() and c.reply(stat) is None and c.reply(late) is None
        third = served(srv, c, late)["tokens"][0]
        assert [r["rid"] for r in c.replies[-2:]] == [stat, late]
        assert c.reply(stat)["tokens"] == 3      # the speculation unseen: discarded first
        assert srv.engine.counters.answered_in_flight == 1
        off = Harness(speculate=False)
        _, want = _plain_loop(off, (3, 4), 2)
        assert [first, second, third] == want
        # a connection that closes while a pass flies ends its session after the step
        c.send({"op": "pred", "cap": kv, "tokens": [third], "sample": GREEDY})
        c.sock.close()
        assert srv._step()
        assert len(srv.engine.sessions) == 0 and srv.engine.fsck() == []
        assert srv.engine.pool.free_pages == srv.engine.pool.num_pages
        assert not [line for line in logs if "error" in line.lower() or "failed" in line]
    finally:
        srv.close()


def test_the_server_holds_a_device_steps_answer_until_the_next_pass_is_launched(tmp_path):
    """An answer whose next call a speculation waits for goes out once the pass that
    computes that speculation is launched, so the call comes while it flies and is
    taken there; an answer with no speculation after it (a mask) goes at once. Only a
    local stream's answers are held: a server on tcp holds none."""
    runner = FakeRunner()
    runner.on_device = True
    config = EngineConfig(scheduler=SchedulerConfig(token_budget=16, max_batch=8))

    def engine(send, log):
        return Engine(runner, FakeTokenizer(), config, send, log, handlers=HANDLERS)
    srv = Server(f"ipc://{tmp_path}/predd.sock", engine, log=lambda line: None)
    try:
        c = Client(srv)
        kv = served(srv, c, c.send({"op": "kv_create"})[0])["cap"]
        (rid,) = c.send({"op": "pred", "cap": kv, "tokens": [3, 4], "sample": GREEDY})
        srv._drain()
        assert srv._step() and c.reply(rid) is None and len(srv.engine.held) == 1
        assert len(srv.engine.speculation) == 1
        # the next step: launched, then the answer goes; the program's next call comes
        # while that pass flies and takes its speculation there
        runner.flying, fly, seen = 3, srv._fly, []

        def flying(flight):
            reply = c.reply(rid)
            seen.append(reply)
            c.send({"op": "pred", "cap": kv, "tokens": [reply["tokens"][0]],
                    "sample": GREEDY})
            return fly(flight)
        srv._fly = flying
        assert srv._step() and seen[0]["ok"]
        srv._fly = fly
        assert srv.engine.counters.answered_in_flight == 1
        off = Harness(speculate=False)
        _, want = _plain_loop(off, (3, 4), 1)
        assert [seen[0]["tokens"][0], c.reply(rid + 1)] == [want[0], None]   # held again
        assert srv._step() and c.reply(rid + 1)["tokens"] == [want[1]]
        (masked,) = c.send({"op": "pred", "cap": kv, "tokens": [5], "sample": GREEDY,
                            "mask": [1, 2]})
        srv._drain()
        assert srv._step() and c.reply(masked)["ok"]   # a mask: nothing after it, sent
        assert srv.engine.held == [] and srv.engine.fsck() == []
    finally:
        srv.close()
    tcp = Server("tcp://127.0.0.1:0", engine, log=lambda line: None)
    try:
        assert tcp.streams is None and tcp.engine.hold_for is None
    finally:
        tcp.close()
