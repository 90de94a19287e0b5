"""One call that fails in a step fails alone (EIO), and leaves its object exactly as it
was; the other calls of the step get exactly the tokens they get alone. A real Engine
over a fake runner that injects the failure (engine_fakes.py)."""
from __future__ import annotations

import numpy as np
import pytest

from symphony_protocol import KvTruncate
from predd.server.handlers import HANDLERS
from predd.server.request_limits import MAX_POSITION
from predd.memory.policy import MemoryConfig
from tests.unit.engine_fakes import Harness, still

A, B, C = b"client-a", b"client-b", b"client-c"
PROMPTS = {A: [3, 4, 5], B: [9, 8, 7, 6, 5, 4], C: [11, 12]}
POISON = 50   # the fake pass raises on any chunk holding this token (see tests)


def solo_generate(prompt: list[int], max_tokens: int = 8) -> list[int]:
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    return h.ok(A, "generate", cap=kv, tokens=prompt, max_tokens=max_tokens, stop=[],
                stream=False)["tokens"]


SOLO = {who: solo_generate(prompt) for who, prompt in PROMPTS.items() if who != C}


def poison_on_token(h: Harness, token: int = POISON) -> None:
    h.runner.fail = lambda chunk: token in chunk.tokens.tolist()


# Pages the good calls' objects hold at the end: the prompt and 7 of the 8 generated
# tokens, 4 entries a page (A: 3 + 7 -> 3 pages, B: 6 + 7 -> 4 pages).
GOOD_PAGES = 7


def start_generates(h: Harness, who_list=(A, B)) -> dict[bytes, int]:
    """Queue the good calls (not yet run: they share the next step with what follows)."""
    caps = {who: h.ok(who, "kv_create")["cap"] for who in who_list}
    return {who: h.send(who, "generate", cap=caps[who], tokens=PROMPTS[who], max_tokens=8,
                        stop=[], stream=False) for who in who_list}


def check_good_calls(h: Harness, rids: dict[bytes, int]) -> None:
    for who, rid in rids.items():
        reply = h.reply(who, rid)
        assert reply["ok"] and reply["tokens"] == SOLO[who], who


def prefilled(h: Harness, who: bytes, tokens: list[int], first_position: int) -> str:
    kv = h.ok(who, "kv_create")["cap"]
    positions = list(range(first_position, first_position + len(tokens)))
    h.ok(who, "pred", cap=kv, tokens=tokens, positions=positions, outputs=[])
    return kv


def test_a_pass_that_fails_for_one_call_fails_that_call_alone():
    h = Harness()
    kv_c = prefilled(h, C, [21, 22, 23, 24, 25], 100)
    before = (h.entries(kv_c), h.kv_of(kv_c).copy(), h.free_pages())
    poison_on_token(h)
    rids = start_generates(h)
    bad = h.send(C, "pred", cap=kv_c, tokens=[1, POISON, 2])
    h.runner.batches.clear()
    h.drain()
    assert h.runner.batches[:5] == [3, 1, 2, 1, 1]     # the batch, then bisected
    assert h.reply(C, bad) == {"rid": bad, "ok": False, "error": {
        "code": "EIO", "message": "internal error: RuntimeError: injected failure"}}
    check_good_calls(h, rids)
    assert (h.entries(kv_c), h.free_pages()) == (before[0], before[2] - GOOD_PAGES)
    assert np.array_equal(h.kv_of(kv_c), before[1])    # no NaN left behind
    h.clean()
    assert h.ok(C, "pred", cap=kv_c, tokens=[1, 2], topk=1)   # the object still serves


def test_a_call_whose_page_table_cannot_be_made_fails_alone(monkeypatch):
    """The step's page tables come from one lookup; where it fails (a bug: a page off
    the device), each call's is made alone, and only the call it fails for gets EIO."""
    h = Harness()
    kv_c = prefilled(h, C, [21, 22, 23, 24, 25], 100)
    before = (h.entries(kv_c), h.kv_of(kv_c).copy(), h.free_pages())
    bad_oid = h.engine.caps.lookup(kv_c).oid
    lookup = h.engine.store.page_tables

    def page_tables(wanted):
        if any(obj.oid == bad_oid for obj, _ in wanted):
            raise AssertionError("page table with a page off the device")
        return lookup(wanted)

    monkeypatch.setattr(h.engine.store, "page_tables", page_tables)
    rids = start_generates(h)
    bad = h.send(C, "pred", cap=kv_c, tokens=[1, 2, 3])
    h.drain()
    assert h.reply(C, bad) == {"rid": bad, "ok": False, "error": {
        "code": "EIO", "message": "internal error: AssertionError: page table with a page "
                                  "off the device"}}
    check_good_calls(h, rids)
    assert (h.entries(kv_c), h.free_pages()) == (before[0], before[2] - GOOD_PAGES)
    monkeypatch.undo()
    h.clean()


def test_a_chunked_prefill_failing_in_its_last_chunk_leaves_nothing_half_done():
    h = Harness(token_budget=16)
    kv_c = prefilled(h, C, [21, 22, 23], 0)
    before = (h.entries(kv_c), h.kv_of(kv_c).copy())
    free = h.free_pages()
    poison_on_token(h)
    rids = start_generates(h, [A])
    prompt = list(range(1, 40)) + [POISON]       # 40 tokens: 3 chunks; the last fails
    bad = h.send(C, "pred", cap=kv_c, tokens=prompt, outputs=[])
    assert h.engine.step()
    # Computed but not committed: every reader sees the object as it was.
    assert h.ok(C, "kv_stat", cap=kv_c)["tokens"] == 3
    assert h.ok(C, "kv_tokens", cap=kv_c)["tokens"] == [21, 22, 23]
    h.drain()
    assert h.reply(C, bad)["error"]["code"] == "EIO"
    check_good_calls(h, rids)
    assert h.entries(kv_c) == before[0] and np.array_equal(h.kv_of(kv_c), before[1])
    assert h.free_pages() == free - 3            # only A's object (11 entries) holds more
    h.clean()


def test_a_generate_failing_mid_way_is_undone_and_ends_with_one_error():
    h = Harness()
    kv_c = prefilled(h, C, [21, 22], 500)
    before = (h.entries(kv_c), h.kv_of(kv_c).copy(), h.free_pages())
    h.runner.fail = lambda chunk: chunk.positions.tolist() == [506]   # its 4th new token
    rids = start_generates(h)
    bad = h.send(C, "generate", cap=kv_c, tokens=[1, 2], max_tokens=10, stop=[])
    h.drain()
    stream = h.stream(C, bad)
    assert [r["ok"] for r in stream] == [True] * 3 + [False]
    assert all(r["more"] for r in stream[:3]) and "more" not in stream[3]
    assert stream[3]["error"]["code"] == "EIO"
    check_good_calls(h, rids)
    assert h.entries(kv_c) == before[0] and np.array_equal(h.kv_of(kv_c), before[1])
    assert h.free_pages() == before[2] - GOOD_PAGES
    h.clean()


@pytest.mark.parametrize("shared", [False, True])
def test_a_failed_re_predict_puts_the_last_entry_back(shared):
    """pred(tokens=[]) recomputes the last entry in place; if that fails, the entry is
    back with its own K/V (the failed pass scribbled NaN over its slot)."""
    h = Harness()
    kv_c = prefilled(h, C, [21, 22, 23, 24, 25, 26], 700)
    fork = h.ok(C, "kv_fork", cap=kv_c)["cap"] if shared else None
    before = (h.entries(kv_c), h.kv_of(kv_c).copy(), h.free_pages())
    h.runner.fail = lambda chunk: chunk.positions.tolist() == [705]
    rids = start_generates(h)
    bad = h.send(C, "pred", cap=kv_c, tokens=[])
    h.drain()
    assert h.reply(C, bad)["error"]["code"] == "EIO"
    check_good_calls(h, rids)
    assert h.entries(kv_c) == before[0] and np.array_equal(h.kv_of(kv_c), before[1])
    if shared:   # the last page was copied before the recompute and stays private
        assert h.entries(fork) == before[0] and np.array_equal(h.kv_of(fork), before[1])
        assert h.free_pages() == before[2] - GOOD_PAGES - 1
    else:
        assert h.free_pages() == before[2] - GOOD_PAGES
    h.clean()
    h.runner.fail = lambda chunk: False
    again = h.ok(C, "pred", cap=kv_c, tokens=[], topk=1)        # now it works
    ref = Harness()
    kv = prefilled(ref, C, [21, 22, 23, 24, 25], 700)
    assert again["topk_ids"] == ref.ok(C, "pred", cap=kv, tokens=[26], positions=[705],
                                       topk=1)["topk_ids"]


def test_nan_logits_fail_a_sampling_pred_alone_and_undo_its_tokens():
    """A NaN row is no distribution to sample from: that call alone gets EIO, and the tokens it
    appended (committed before its reply was built) are taken back."""
    h = Harness()
    kv_c = prefilled(h, C, [21, 22], 898)
    before = (h.entries(kv_c), h.free_pages())
    h.runner.nan = lambda chunk: chunk.positions[0] == 900
    rids = start_generates(h)
    bad = h.send(C, "pred", cap=kv_c, tokens=[33, 34, 35], sample={"temperature": 1.0})
    h.drain()
    reply = h.reply(C, bad)
    assert reply["error"]["code"] == "EIO" and "no distribution" in reply["error"]["message"]
    check_good_calls(h, rids)
    assert (h.entries(kv_c), h.free_pages()) == (before[0], before[1] - GOOD_PAGES)
    h.clean()


def test_a_bug_in_the_step_bookkeeping_fails_only_unanswered_calls(monkeypatch):
    """If the step itself breaks after some calls were answered, the others get EIO,
    and every call still gets exactly one terminal reply."""
    h = Harness()
    kv_a = h.ok(A, "kv_create")["cap"]
    kv_b = h.ok(B, "kv_create")["cap"]
    p = h.send(A, "pred", cap=kv_a, tokens=[1, 2, 3])                 # done in one step
    g = h.send(B, "generate", cap=kv_b, tokens=[4, 5], max_tokens=5, stop=[])

    def broken_update(*args):
        raise KeyError("bookkeeping")

    monkeypatch.setattr(h.engine.scheduler, "update", broken_update)
    assert h.engine.step()
    monkeypatch.undo()
    assert h.reply(A, p)["ok"]
    assert h.reply(B, g)["error"]["code"] == "EIO"
    assert h.entries(kv_b) == ([], [])
    assert h.engine.scheduler.pending() == 0
    h.drain()
    h.clean()


def test_an_unexpected_exception_in_a_deferred_request_is_eio(monkeypatch):
    """replay_deferred used to catch only ProtocolError: any other exception escaped
    into the server loop."""
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    g = h.send(A, "generate", cap=kv, tokens=[1, 2], max_tokens=3, stop=[])
    t = h.send(A, "kv_truncate", cap=kv, length=1)          # deferred behind the generate

    def broken(*args):
        raise ZeroDivisionError("boom")

    monkeypatch.setitem(HANDLERS, KvTruncate, broken)
    h.drain()
    assert h.reply(A, g)["ok"]
    assert h.reply(A, t)["error"] == {"code": "EIO",
                                      "message": "internal error: ZeroDivisionError: boom"}
    assert any("ZeroDivisionError" in line for line in h.logs)
    monkeypatch.undo()
    assert h.ok(A, "kv_truncate", cap=kv, length=1)["tokens"] == 1
    h.clean()


# ---------------------------------------------------------------- admission

def test_re_predict_refused_for_want_of_a_page_keeps_the_last_entry():
    """The bug: re-predict truncated the object before the page check could fail."""
    h = Harness(kv_pages=4, page_size=4, memory=MemoryConfig(admit_wait_s=0))
    kv = prefilled(h, A, [1, 2, 3, 4, 5, 6], 0)              # pages 0, 1
    fork = h.ok(A, "kv_fork", cap=kv)["cap"]                 # shares both
    h.ok(A, "pred", cap=h.ok(A, "kv_create")["cap"], tokens=list(range(1, 9)), outputs=[])
    assert h.free_pages() == 0
    before = (h.entries(fork), h.kv_of(fork).copy(), h.ok(A, "kv_stat", cap=fork))
    reply = h.call(A, "pred", cap=fork, tokens=[])           # needs a copy of page 1
    assert reply["error"] == {"code": "ENOSPC", "message": "KV pool exhausted: need 1 "
                              "pages, 0 available of 4 (the rest in use, pinned or promised "
                              "to calls in flight)"}
    assert h.entries(fork) == before[0] and np.array_equal(h.kv_of(fork), before[1])
    assert still(h.ok(A, "kv_stat", cap=fork)) == still({**before[2], "rid": h.rid})
    assert h.free_pages() == 0
    h.clean()


def test_re_predict_refused_by_quota_keeps_the_last_entry():
    from predd.server.quotas import QuotaConfig
    h = Harness(quota=QuotaConfig(session_pages=2))
    kv = prefilled(h, A, [1, 2, 3, 4, 5, 6], 0)              # 2 pages: at the quota
    other = h.ok(B, "kv_fork", cap=kv)["cap"]                # B's fork shares page 1
    before = (h.entries(kv), h.kv_of(kv).copy(), h.ok(A, "kv_stat", cap=kv), h.free_pages())
    reply = h.call(A, "pred", cap=kv, tokens=[])             # A: a CoW page over quota
    sid = h.engine.sessions.of_identity(A).sid
    assert reply["error"] == {"code": "EDQUOT",
                              "message": f"session {sid} would hold more than 2 KV pages"}
    assert h.entries(kv) == before[0] == h.entries(other)
    assert np.array_equal(h.kv_of(kv), before[1])
    assert still(h.ok(A, "kv_stat", cap=kv)) == still({**before[2], "rid": h.rid})
    assert h.free_pages() == before[3]
    h.clean()


def test_implicit_positions_past_int32_are_eoverflow_and_change_nothing():
    h = Harness()
    kv = prefilled(h, A, [1, 2], MAX_POSITION - 3)          # last position MAX - 2
    before = (h.entries(kv), h.free_pages())
    assert h.ok(A, "pred", cap=kv, tokens=[3], topk=1)       # MAX - 1: the last valid
    before = (h.entries(kv), h.free_pages())
    for op, fields, reach in [("pred", {"tokens": [4]}, MAX_POSITION),
                              ("generate", {"tokens": [4], "max_tokens": 2}, MAX_POSITION + 1),
                              ("pred", {"tokens": [4, 5, 6]}, MAX_POSITION + 2)]:
        reply = h.call(A, op, cap=kv, **fields)
        assert reply["error"] == {"code": "EOVERFLOW", "message":
                                  f"positions would reach {reach}: past the "
                                  f"largest position {MAX_POSITION - 1}"}
    kv2 = prefilled(h, A, [1], MAX_POSITION - 5)             # room for 4 more positions
    # The prompt and every generated token but the last take a position: 1 + 4 > room.
    reply = h.call(A, "generate", cap=kv2, tokens=[2], max_tokens=5, stop=[])
    assert reply["error"]["code"] == "EOVERFLOW"
    ok = h.call(A, "generate", cap=kv2, tokens=[2], max_tokens=4, stop=[], stream=False)
    assert ok["ok"] and len(ok["tokens"]) == 4
    assert h.entries(kv2)[1] == [MAX_POSITION - 5 + i for i in range(5)]
    assert h.entries(kv) == before[0]
    h.clean()


def test_an_object_past_the_context_is_e2big_and_a_generate_stops_at_it():
    h = Harness(context=20)
    kv = prefilled(h, A, list(range(1, 16)), 0)              # 15 of 20
    reply = h.call(A, "pred", cap=kv, tokens=list(range(1, 7)))
    assert reply["error"] == {"code": "E2BIG", "message": "the object would hold 21 "
                              "entries, more than the context of 20"}
    out = h.ok(A, "generate", cap=kv, tokens=[1], max_tokens=20, stop=[], stream=False)
    # Prompt: 16 entries; each generated token but the last is appended: 4 more fit.
    assert (out["finish_reason"], out["generated"]) == ("length", 5)
    assert h.ok(A, "kv_stat", cap=kv)["tokens"] == 20
    h.clean()
