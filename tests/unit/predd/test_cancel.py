"""`cancel` at the engine: a generate ends between steps keeping what it generated (as at
`length`), any other call or held request gets ECANCELED with its object as it was, and
only the caller's own calls can be cancelled."""
from __future__ import annotations

from tests.unit.engine_fakes import Harness

A, B = b"a", b"b"


def test_a_cancelled_generate_keeps_what_it_generated_but_the_last():
    h, ref = Harness(), Harness()
    kv = h.ok(A, "kv_create")["cap"]
    rid = h.send(A, "generate", cap=kv, tokens=[3, 4, 5], max_tokens=50, stop=[])
    for _ in range(4):
        h.engine.step()
    streamed = [r["tokens"][0] for r in h.stream(A, rid)]
    assert len(streamed) == 4
    pages = h.free_pages()
    assert h.call(A, "cancel", target=rid)["ok"]
    end = h.reply(A, rid)
    assert end["finish_reason"] == "cancelled" and end["generated"] == 4
    assert end["tokens"] == []          # the stream had every token already
    order = [head["rid"] for _, head, _ in h.replies]
    assert order.index(rid, len(order) - 2) < order.index(h.rid)   # generate's end first
    assert h.entries(kv)[0] == [3, 4, 5] + streamed[:-1]
    assert h.free_pages() >= pages and h.engine.scheduler.pending() == 0
    # the same tokens as a generate that stopped at 4 by itself
    want = ref.ok(A, "generate", cap=ref.ok(A, "kv_create")["cap"], tokens=[3, 4, 5],
                  max_tokens=4, stop=[], stream=False)["tokens"]
    assert streamed == want
    h.clean()


def test_a_cancelled_pred_or_held_request_gets_ecanceled_and_changes_nothing():
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    h.ok(A, "pred", cap=kv, tokens=[1, 2], outputs=[])
    running = h.send(A, "generate", cap=kv, tokens=[3], max_tokens=5, stop=[])
    held = h.send(A, "pred", cap=kv, tokens=[9])            # behind the generate
    assert h.call(A, "cancel", target=held)["ok"]
    assert h.reply(A, held)["error"]["code"] == "ECANCELED"
    h.drain()
    assert h.reply(A, running)["finish_reason"] == "length"
    queued = h.send(A, "pred", cap=kv, tokens=[7, 8])       # not yet run
    assert h.call(A, "cancel", target=queued)["ok"]
    assert h.reply(A, queued)["error"]["code"] == "ECANCELED"
    assert len(h.entries(kv)[0]) == 2 + 1 + 4
    h.clean()


def test_only_the_callers_own_calls_in_flight_can_be_cancelled():
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    rid = h.send(A, "generate", cap=kv, tokens=[3], max_tokens=3, stop=[])
    assert h.call(B, "cancel", target=rid)["error"]["code"] == "ESRCH"
    h.drain()
    assert h.reply(A, rid)["finish_reason"] == "length"
    assert h.call(A, "cancel", target=rid)["error"]["code"] == "ESRCH"     # already ended
    assert h.call(A, "cancel", target=10**6)["error"]["code"] == "ESRCH"
    h.clean()


def test_a_change_held_behind_a_cancelled_generate_goes_on_at_once():
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    rid = h.send(A, "generate", cap=kv, tokens=[3, 4], max_tokens=50, stop=[])
    h.engine.step()
    h.engine.step()
    free = h.send(A, "kv_free", cap=kv)                 # held behind the generate
    h.send(A, "cancel", target=rid)                    # no step runs after this
    assert h.reply(A, rid)["finish_reason"] == "cancelled"
    assert h.reply(A, free)["ok"] and h.engine.store.objects == {}
    h.clean()
