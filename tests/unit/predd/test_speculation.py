"""Speculative continuation (predd/engine/speculation.py) at the engine: a pred_sample loop
takes every speculation, and whatever a program does between calls, it sees exactly what
it would see with speculation off — same replies, same entries, same pages, fsck clean."""
from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.engine_fakes import ME, Harness, VOCAB

A, B = b"a", b"b"
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.8, "top_k": 5, "seed": 7}


def loop(h: Harness, n: int, sample: dict = GREEDY, prompt=(5, 6, 7)) -> tuple[str, list[int]]:
    kv = h.ok(A, "kv_create")["cap"]
    token = h.ok(A, "pred", cap=kv, tokens=list(prompt), sample=sample)["tokens"][0]
    out = [token]
    for _ in range(n):
        token = h.ok(A, "pred", cap=kv, tokens=[token], sample=sample)["tokens"][0]
        out.append(token)
    return kv, out


def spec_stats(h: Harness) -> dict:
    return h.ok(A, "stats")["speculation"]


def test_a_pred_sample_loop_takes_every_speculation_and_gets_the_same_tokens():
    on, off = Harness(), Harness(speculate=False)
    for sample in (GREEDY, SEEDED):
        kv_on, got = loop(on, 12, sample)
        kv_off, want = loop(off, 12, sample)
        assert got == want
        assert on.entries(kv_on) == off.entries(kv_off)
    assert spec_stats(on) == {"offered": 26, "hits": 24, "misses": 0, "wasted": 0}
    assert spec_stats(off) == {"offered": 0, "hits": 0, "misses": 0, "wasted": 0}
    # the last answer of each loop has its speculation computed and waiting
    assert len(on.engine.speculation) == 2
    assert on.ok(A, "fsck")["clean"]          # fsck discards the waiting ones first
    assert spec_stats(on) == {"offered": 26, "hits": 24, "misses": 2, "wasted": 2}
    assert on.free_pages() == off.free_pages()
    on.clean()


def argmax_loop(h: Harness, n: int, follow=lambda best: best) -> tuple[str, list[bytes]]:
    """A raw pred loop appending `follow(argmax)` each call: the rows it got."""
    kv = h.ok(A, "kv_create")["cap"]
    tokens, rows = [5, 6, 7], []
    for _ in range(n):
        rid = h.send(A, "pred", cap=kv, tokens=tokens)
        h.drain()
        (frame,) = [f for i, head, f in h.replies if i == A and head["rid"] == rid][0]
        rows.append(bytes(frame))
        best = int(np.frombuffer(frame, np.float32).argmax())
        tokens = [follow(best)]
    return kv, rows


def test_a_pred_loop_that_appends_the_argmax_is_speculated_and_gets_the_same_rows():
    on, off = Harness(), Harness(speculate=False)
    kv_on, got = argmax_loop(on, 16)
    kv_off, want = argmax_loop(off, 16)
    assert got == want
    s = spec_stats(on)
    # the first argmax is noted; from the second hit on, each next step is speculated
    assert s["offered"] == 15 and s["hits"] == 14, s
    on.ok(A, "fsck")
    assert on.entries(kv_on) == off.entries(kv_off)
    on.clean()


def test_a_pred_loop_that_does_not_follow_the_argmax_is_not_speculated():
    h = Harness()
    argmax_loop(h, 16, follow=lambda best: (best + 1) % VOCAB)
    assert spec_stats(h)["offered"] == 0
    h.clean()


def test_a_call_that_arrives_before_the_step_joins_the_queued_speculation():
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    first = h.send(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)
    h.engine.step()                      # answers it and queues the speculation
    token = h.reply(A, first)["tokens"][0]
    assert not h.engine.speculation.by_oid[h.engine.caps.lookup(kv).oid].computed
    second = h.send(A, "pred", cap=kv, tokens=[token], sample=GREEDY)
    assert [r for _, r, _ in h.replies if r["rid"] == second] == []   # not computed yet
    h.drain()
    off = Harness(speculate=False)
    kv_off, want = loop(off, 1, prompt=(3, 4))
    assert h.reply(A, second)["tokens"] == [want[1]]
    assert spec_stats(h)["hits"] == 1
    h.ok(A, "fsck")
    assert h.entries(kv) == off.entries(kv_off) == ([3, 4, token], [0, 1, 2])
    h.clean()


def test_anything_but_the_matching_call_discards_it_unseen():
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    token = h.ok(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)["tokens"][0]
    pages = h.free_pages()
    assert len(h.engine.speculation) == 1
    assert h.ok(A, "kv_tokens", cap=kv)["tokens"] == [3, 4]
    assert len(h.engine.speculation) == 0 and h.free_pages() >= pages
    assert spec_stats(h) == {"offered": 1, "hits": 0, "misses": 1, "wasted": 1}
    # a different token, different sampling, a mask, top-k: each is a miss
    for fields in ({"tokens": [(token + 1) % VOCAB], "sample": GREEDY},
                   {"tokens": [token], "sample": SEEDED},
                   {"tokens": [token], "sample": GREEDY, "mask": [1, 2]},
                   {"tokens": [token], "topk": 2},
                   {"tokens": [token, token], "sample": GREEDY}):
        h.ok(A, "kv_truncate", cap=kv, length=2)
        token = h.ok(A, "pred", cap=kv, tokens=[], sample=GREEDY)["tokens"][0]
        before = spec_stats(h)["misses"]
        h.ok(A, "pred", cap=kv, **fields)
        assert spec_stats(h)["misses"] == before + 1, fields
    h.clean()


def computed(h: Harness, prompt=(3, 4), sample=GREEDY) -> tuple[str, int]:
    """A cache whose pred_sample was answered: its next step computed and parked."""
    kv = h.ok(A, "kv_create")["cap"]
    token = h.ok(A, "pred", cap=kv, tokens=list(prompt), sample=sample)["tokens"][0]
    assert h.engine.speculation.by_oid[h.engine.caps.lookup(kv).oid].parked
    return kv, token


def test_the_loops_next_call_takes_a_computed_step_without_a_request_record(monkeypatch):
    """The exact next call of a pred_sample loop is answered from its map
    (Speculation.taken_by): no request record, no call built, the same answer."""
    import symphony_protocol as p
    h = Harness()
    kv, token = computed(h)
    decoded = []
    real = p.decode_request
    monkeypatch.setattr(p, "decode_request",
                        lambda head: decoded.append(head["op"]) or real(head))
    got = [token]
    for _ in range(5):
        got.append(h.ok(A, "pred", cap=kv, tokens=[got[-1]], sample=GREEDY)["tokens"][0])
    assert spec_stats(h)["hits"] == 5 and decoded == ["stats"]
    # the same values of other types (0 for 0.0) go the full way, and take it there
    got.append(h.ok(A, "pred", cap=kv, tokens=[got[-1]], sample={"temperature": 0})
               ["tokens"][0])
    assert decoded == ["stats", "pred"] and spec_stats(h)["hits"] == 6
    off = Harness(speculate=False)
    assert loop(off, 6, prompt=(3, 4))[1] == got
    h.ok(A, "fsck")
    h.clean()


def test_the_loops_next_call_takes_a_queued_step_at_the_door(monkeypatch):
    """A call that comes while its speculation is still queued (its reply came from a
    step, which queued the next one) takes it from its map too, and is answered when
    that step runs: no request record, the same tokens and entries as with speculation
    off."""
    import symphony_protocol as p
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    oid = h.engine.caps.lookup(kv).oid
    decoded = []
    real = p.decode_request
    monkeypatch.setattr(p, "decode_request",
                        lambda head: decoded.append(head["op"]) or real(head))
    got, tokens = [], [3, 4]
    for _ in range(6):
        rid = h.send(A, "pred", cap=kv, tokens=tokens, sample=GREEDY)
        if got:     # the last reply came from a step: its speculation is queued
            assert oid not in h.engine.speculation.by_oid    # taken by this call
        while not [r for i, r, _ in h.replies if i == A and r["rid"] == rid]:
            assert h.engine.step()
        (reply,) = [r for i, r, _ in h.replies if i == A and r["rid"] == rid]
        got.append(reply["tokens"][0])
        tokens = [got[-1]]
        assert not h.engine.speculation.by_oid[oid].parked
    assert decoded == ["pred"] and spec_stats(h)["hits"] == 5
    off = Harness(speculate=False)
    kv_off, want = loop(off, 5, prompt=(3, 4))
    assert got == want
    h.ok(A, "fsck")       # discards the last queued one
    assert h.entries(kv) == off.entries(kv_off)
    h.clean()


def test_a_map_the_full_path_refuses_is_refused_the_same_with_a_step_computed():
    """Fields the pred request does not have, or of other types, get the full path's
    errno even where the computed speculation would otherwise be taken."""
    for fields, code in (({"bogus": 1}, "EINVAL"), ({"tokens": [True]}, "EINVAL"),
                         ({"rid": True}, "EINVAL"), ({"into": "0"}, "EINVAL"),
                         ({"sample": {"temperature": False}}, "EINVAL"),
                         ({"sample": {"temperature": 0.0, "nope": 1}}, "EINVAL"),
                         ({"cap": "forged"}, "EBADF")):
        h = Harness()
        kv, token = computed(h)
        head = {"op": "pred", "rid": 77, "cap": kv, "tokens": [token], "sample": GREEDY,
                **fields}
        before = len(h.replies)
        h.engine.handle(A, [msgpack.packb(head)], 0.0, ME)
        (reply,) = [r for _, r, _ in h.replies[before:]]
        assert not reply["ok"] and reply["error"]["code"] == code, (fields, reply)
        h.ok(A, "fsck")
        h.clean()


def test_a_read_only_capability_cannot_take_a_computed_step():
    h = Harness()
    kv, token = computed(h)
    ro = h.ok(A, "kv_grant", cap=kv, rights="r")["cap"]    # names the object: discards
    h.ok(A, "pred", cap=kv, tokens=[3], sample=GREEDY)       # computed again
    reply = h.call(A, "pred", cap=ro, tokens=[token], sample=GREEDY)
    assert reply["error"]["code"] == "EACCES"
    h.ok(A, "fsck")
    h.clean()


def test_another_session_on_the_same_object_does_not_take_it():
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    token = h.ok(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)["tokens"][0]
    shared = h.ok(A, "kv_grant", cap=kv, rights="rw")["cap"]
    assert len(h.engine.speculation) == 0      # the grant named the object
    h.ok(A, "pred", cap=kv, tokens=[token], sample=GREEDY)
    h.ok(B, "pred", cap=shared, tokens=[1], sample=GREEDY)
    assert spec_stats(h)["hits"] == 0 and spec_stats(h)["misses"] == 2
    h.clean()


def test_a_session_that_ends_or_an_object_freed_leaves_nothing():
    h = Harness()
    kv = h.ok(B, "kv_create")["cap"]
    h.ok(B, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)
    h.engine.end_session(h.engine.sessions.of_identity(B), "test")
    assert len(h.engine.speculation) == 0
    h.clean()
    kv = h.ok(A, "kv_create")["cap"]
    h.ok(A, "pred", cap=kv, tokens=[3, 4], sample=GREEDY)
    h.engine._free_object(h.engine.caps.lookup(kv).oid)
    assert len(h.engine.speculation) == 0 and h.replies[-1][1]["rid"] != -1
    assert all(ident for ident, _, _ in h.replies)   # nothing sent to a speculation


def test_a_call_that_finds_no_room_has_the_speculations_dropped():
    # 4 pages of 4: A's object fills 3 and its speculation takes the 4th at a page edge
    h = Harness(kv_pages=4, page_size=4)
    kv = h.ok(A, "kv_create")["cap"]
    h.ok(A, "pred", cap=kv, tokens=list(range(1, 13)), sample=GREEDY)
    h.drain()
    assert h.free_pages() == 0 and len(h.engine.speculation) == 1
    other = h.ok(B, "kv_create")["cap"]
    reply = h.call(B, "pred", cap=other, tokens=[1, 2], sample=GREEDY)
    assert reply["ok"], reply
    assert spec_stats(h)["misses"] == 1
    h.clean()


# ------------------------------------------------------------ property

ACTIONS = st.lists(st.one_of(
    # a pred_sample: mostly the loop's own next call (taking the speculation)
    st.tuples(st.just("sample"), st.sampled_from(["same"] * 4 + ["other", "again", "two"]),
              st.sampled_from([GREEDY] * 3 + [SEEDED]), st.sampled_from([0] * 4 + [1, 2])),
    st.tuples(st.just("sample"), st.just("same"), st.just(GREEDY), st.just(0)),
    st.tuples(st.just("logits"), st.integers(0, VOCAB - 1), st.integers(0, 2)),
    st.tuples(st.just("argmax"), st.sampled_from([0] * 3 + [1, 2])),
    st.tuples(st.just("generate"), st.integers(1, 4), st.integers(0, 2)),
    st.tuples(st.sampled_from(["fork", "tokens", "stat", "export", "fsck", "free", "stats"]),
              st.integers(0, 2)),
    st.tuples(st.just("truncate"), st.integers(0, 6), st.integers(0, 2)),
), min_size=1, max_size=25)


def _run(h: Harness, actions) -> tuple[list, list]:
    """Each action as a program would do it (waiting for its answer); what it saw."""
    caps = [h.ok(A, "kv_create")["cap"]]
    h.ok(A, "pred", cap=caps[0], tokens=[9, 8, 7], outputs=[])
    last: dict[str, int] = {}
    best: dict[str, int] = {}       # each cache's last raw row's argmax
    seen = []
    for action in actions:
        kind, cap = action[0], caps[action[-1] % len(caps)]
        if kind == "sample":
            how, sample = action[1], action[2]
            token = last.get(cap, 1)
            tokens = {"same": [token], "other": [(token + 3) % VOCAB], "again": [],
                      "two": [token, 2]}[how]
            r = h.call(A, "pred", cap=cap, tokens=tokens, sample=sample)
            if r["ok"]:
                last[cap] = r["tokens"][-1]
        elif kind in ("logits", "argmax"):
            token = action[1] if kind == "logits" else best.get(cap, 1)
            r = h.call(A, "pred", cap=cap, tokens=[token])
            if r["ok"]:
                best[cap] = int(np.frombuffer(h.replies[-1][2][0], np.float32).argmax())
        elif kind == "generate":
            r = h.call(A, "generate", cap=cap, max_tokens=action[1], sample=GREEDY,
                       stream=False)
            if r["ok"]:
                last[cap] = r["tokens"][-1]
        elif kind == "fork":
            r = h.call(A, "kv_fork", cap=cap)
            if r["ok"]:
                caps.append(r["cap"])
        elif kind == "free":
            r = h.call(A, "kv_free", cap=cap) if len(caps) > 1 else {}
            if r.get("ok"):
                caps.remove(cap)
        elif kind == "truncate":
            r = h.call(A, "kv_truncate", cap=cap, length=action[1])
        elif kind == "stats":      # neutral: leaves a speculation be
            h.call(A, "stats")
            r = {}
        else:
            op = {"tokens": "kv_tokens", "stat": "kv_stat", "export": "kv_export",
                  "fsck": "fsck"}[kind]
            r = h.call(A, op, cap=cap)
        r = {k: v for k, v in r.items() if k not in ("cost", "rid", "idle_s", "cap")}
        frames = [f for _, head, f in h.replies[-1:]]
        seen.append((kind, r, [bytes(x) for x in frames[0]]
                     if kind in ("export", "logits", "argmax") else None))
    h.ok(A, "fsck")
    state = [(h.entries(c), h.call(A, "kv_stat", cap=c)) for c in caps]
    state = [(e, {k: v for k, v in s.items() if k not in ("rid", "idle_s")}) for e, s in state]
    return seen, state + [h.free_pages()]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ACTIONS)
def test_a_program_sees_the_same_with_speculation_on_or_off(actions):
    on, off = Harness(kv_pages=24), Harness(kv_pages=24, speculate=False)
    seen_on, state_on = _run(on, actions)
    seen_off, state_off = _run(off, actions)
    assert seen_on == seen_off
    assert state_on == state_off
    on.clean()
    off.clean()


def test_speculation_is_never_a_reply_to_nobody():
    h = Harness()
    loop(h, 3)
    h.ok(A, "fsck")
    assert all(ident == A for ident, _, _ in h.replies)
    assert all(msgpack.packb(head) for _, head, _ in h.replies)


# ------------------------------------------------------------ room, quota, failed replies

def test_a_generate_elsewhere_is_not_cut_short_by_a_speculations_page():
    from predd.server.quotas import QuotaConfig

    def generated(spec: bool) -> dict:
        h = Harness(page_size=4, quota=QuotaConfig(session_pages=3), speculate=spec)
        first = h.ok(A, "kv_create")["cap"]
        h.ok(A, "pred", cap=first, tokens=[1, 2, 3, 4], sample=GREEDY)   # spec: a 2nd page
        other = h.ok(A, "kv_create")["cap"]
        r = h.call(A, "generate", cap=other, tokens=[5, 6, 7], max_tokens=12, stop=[],
                   stream=False)
        h.clean()
        return {k: r[k] for k in ("finish_reason", "generated", "tokens")}
    assert generated(True) == generated(False) == {**generated(False), "finish_reason": "EDQUOT"}


def test_a_re_predict_that_waits_for_room_stays_a_re_predict():
    for spec in (False, True):
        h = Harness(kv_pages=3, page_size=4, speculate=spec)
        x = h.ok(A, "kv_create")["cap"]
        h.ok(A, "pred", cap=x, tokens=[1, 2, 3], outputs=[])
        h.ok(A, "kv_fork", cap=x)                    # its last page shared: reopening copies
        z = h.ok(A, "kv_create")["cap"]
        h.ok(A, "pred", cap=z, tokens=list(range(1, 9)), outputs=[])   # the pool full
        rid = h.send(A, "pred", cap=x, tokens=[], sample=GREEDY)
        h.drain()                                    # no room: it waits
        h.ok(A, "kv_free", cap=z)
        h.drain()
        assert h.reply(A, rid)["ok"]
        assert h.entries(x) == ([1, 2, 3], [0, 1, 2])
        h.clean()


def test_a_taken_speculation_whose_reply_fails_leaves_the_object_as_it_was():
    seeded = {"temperature": 0.8, "seed": 7}
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    h.runner.nan = lambda chunk: len(chunk.tokens) == 1     # one-token steps give NaN
    token = h.ok(A, "pred", cap=kv, tokens=[3, 4], sample=seeded)["tokens"][0]
    r = h.call(A, "pred", cap=kv, tokens=[token], sample=seeded)
    assert r["error"]["code"] == "EIO"
    assert h.entries(kv)[0] == [3, 4]
    h.clean()
