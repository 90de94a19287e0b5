"""A call's life through a real Engine over the fake runner (engine_fakes.py): ordering
behind a running generate, refusal at admission (ENOSPC, EDQUOT) that changes nothing,
and the stop rules with their one terminal message. Failures inside a step, and a
re-predict refused at admission, are in test_engine_isolation.py."""
from __future__ import annotations

import numpy as np
import pytest

from predd.memory.policy import MemoryConfig
from predd.server.quotas import QuotaConfig
from tests.unit.engine_fakes import Harness

A, B = b"client-a", b"client-b"
STREAM_KEYS = {"rid", "ok", "more", "tokens", "logprobs"}
TERMINAL_KEYS = STREAM_KEYS | {"generated", "finish_reason", "cost"}


def prefilled(h: Harness, who: bytes, tokens: list[int]) -> str:
    kv = h.ok(who, "kv_create")["cap"]
    h.ok(who, "pred", cap=kv, tokens=tokens, outputs=[])
    return kv


def solo(prefix: list[int], prompt: list[int], max_tokens: int) -> list[int]:
    """What a greedy generate gives on its own, without a stop."""
    h = Harness()
    kv = prefilled(h, A, prefix) if prefix else h.ok(A, "kv_create")["cap"]
    return h.ok(A, "generate", cap=kv, tokens=prompt, max_tokens=max_tokens, stop=[],
                stream=False)["tokens"]


def object_state(h: Harness, who: bytes, cap: str) -> tuple:
    """Everything a reader sees of an object (read at once: no step runs)."""
    stat = h.reply(who, h.send(who, "kv_stat", cap=cap))
    return (h.entries(cap), stat["tokens"], stat["pages"], stat["last_position"],
            h.kv_of(cap).tobytes())


# ---------------------------------------------------------------- ordering

def test_changes_wait_behind_a_running_generate_in_arrival_order_and_reads_do_not():
    h = Harness()
    kv = prefilled(h, A, [1, 2, 3])
    g = h.send(A, "generate", cap=kv, tokens=[4], max_tokens=5, stop=[], stream=False)
    t1 = h.send(A, "kv_truncate", cap=kv, length=6)
    p1 = h.send(A, "pred", cap=kv, tokens=[9], topk=1)
    t2 = h.send(A, "kv_truncate", cap=kv, length=2)
    free = h.send(A, "kv_free", cap=kv)
    # Reads answer at once, from the committed entries: the generate has not run.
    stat = h.reply(A, h.send(A, "kv_stat", cap=kv))
    assert (stat["tokens"], stat["pages"]) == (3, 1)
    assert h.reply(A, h.send(A, "kv_tokens", cap=kv))["tokens"] == [1, 2, 3]
    fork = h.reply(A, h.send(A, "kv_fork", cap=kv))["cap"]
    held = {g, t1, p1, t2, free}
    assert not [r for _, r, _ in h.replies if r["rid"] in held]
    assert h.engine.scheduler.pending() == 1
    assert h.engine.sessions.of_identity(A).deferred == 4

    assert h.engine.step()                 # the prompt is computed and committed
    assert h.reply(A, h.send(A, "kv_tokens", cap=kv))["tokens"] == [1, 2, 3, 4]
    assert not [r for _, r, _ in h.replies if r["rid"] in held]
    h.drain()
    order = [r["rid"] for _, r, _ in h.replies if r["rid"] in held]
    assert order == [g, t1, p1, t2, free]
    generated = h.reply(A, g)["tokens"]
    assert generated == solo([1, 2, 3], [4], 5)
    assert h.reply(A, t1)["tokens"] == 6          # 3 + prompt + 4 of 5 generated, cut to 6
    # the pred ran between the truncates: on exactly 6 entries
    assert h.reply(A, p1)["cost"]["reused"] == 6 and h.reply(A, p1)["cost"]["computed"] == 1
    assert h.reply(A, t2)["tokens"] == 2
    assert h.reply(A, free) == {"rid": free, "ok": True}
    assert h.entries(fork) == ([1, 2, 3], [0, 1, 2])
    assert h.call(A, "kv_stat", cap=kv)["error"]["code"] == "EBADF"
    assert h.engine.sessions.of_identity(A).deferred == 0
    h.clean()


# ---------------------------------------------------------------- admission

@pytest.mark.parametrize("limit", ["pool", "quota"])
def test_a_call_refused_at_admission_changes_nothing_and_the_others_go_on(limit):
    """ENOSPC (the pool) or EDQUOT (the session's pages): the call gets the errno before
    it takes anything; a generate of another client in the same steps goes on."""
    if limit == "pool":
        h = Harness(kv_pages=8, memory=MemoryConfig(admit_wait_s=0))
    else:
        h = Harness(quota=QuotaConfig(session_pages=3))
    kv_a = prefilled(h, A, [1, 2, 3, 4, 5, 6])               # 2 pages, 2 slots left
    kv_b = h.ok(B, "kv_create")["cap"]
    g = h.send(B, "generate", cap=kv_b, tokens=[9, 8, 7], max_tokens=4, stop=[],
               stream=False)
    assert h.engine.step()                                   # B is admitted and running
    before, free = object_state(h, A, kv_a), h.free_pages()
    sid = h.engine.sessions.of_identity(A).sid
    pages_of_a = h.engine.quotas.pages_of_session[sid]
    tokens = list(range(10, 40)) if limit == "pool" else list(range(10, 18))
    bad = h.send(A, "pred", cap=kv_a, tokens=tokens)
    h.drain()
    if limit == "pool":   # 30 tokens: 2 in the last page, 28 in 7 new pages; 5 free, of
        # which B's generate was promised 1 (its 4th token's page)
        error = {"code": "ENOSPC", "message": "KV pool exhausted: need 7 pages, 4 available "
                 "of 8 (the rest in use, pinned or promised to calls in flight)"}
    else:                 # 8 tokens: 2 new pages, 4 > 3
        error = {"code": "EDQUOT", "message": f"session {sid} would hold more than 3 KV pages"}
    assert h.reply(A, bad) == {"rid": bad, "ok": False, "error": error}
    assert object_state(h, A, kv_a) == before
    assert h.engine.quotas.pages_of_session[sid] == pages_of_a
    assert h.reply(B, g)["tokens"] == solo([], [9, 8, 7], 4)
    assert h.free_pages() == free - 1                        # B's object grew to 2 pages
    assert h.engine.scheduler.pending() == 0
    h.clean()


# ---------------------------------------------------------------- stop rules

def test_a_stream_is_tokens_then_one_terminal_message_with_finish_reason_and_cost():
    h = Harness()
    kv = prefilled(h, A, [1, 2, 3])
    g = h.send(A, "generate", cap=kv, tokens=[4, 5], max_tokens=5, stop=[])
    h.drain()
    stream = h.stream(A, g)
    want = solo([1, 2, 3], [4, 5], 5)
    assert len(stream) == 5
    for reply, token in zip(stream[:4], want):
        assert set(reply) == STREAM_KEYS and reply["more"] is True and reply["ok"] is True
        assert reply["tokens"] == [token] and len(reply["logprobs"]) == 1
    last = stream[-1]
    assert set(last) == TERMINAL_KEYS and last["more"] is False
    assert (last["tokens"], last["generated"], last["finish_reason"]) == ([want[4]], 5, "length")
    # computed: the prompt and 4 tokens fed back; the object holds 3 + 2 + 4 = 9 entries
    cost = last["cost"]
    assert (cost["computed"], cost["reused"], cost["pages"]) == (6, 3, 3)
    assert cost["queue_ms"] >= 0 and cost["step_ms"] >= 0
    assert h.entries(kv)[0] == [1, 2, 3, 4, 5] + want[:4]
    h.clean()


def _first_new(tokens: list[int], key) -> int:
    """The first index k >= 1 whose token's key differs from every earlier one's."""
    return next(k for k in range(1, len(tokens)) if key(tokens[k]) not in
                {key(t) for t in tokens[:k]})


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("rule", ["stop", "stop_text"])
def test_a_stop_ends_a_generate_at_its_token_which_is_output_but_not_appended(rule, stream):
    free = solo([1, 2, 3], [4], 12)
    h = Harness()
    letter = h.tokenizer.decode
    if rule == "stop":
        k = _first_new(free, lambda t: t)
        fields = {"stop": [free[k]]}
    else:
        k = _first_new(free, lambda t: letter([t]))
        fields = {"stop": [], "stop_text": [letter([free[k]])]}
    kv = prefilled(h, A, [1, 2, 3])
    g = h.send(A, "generate", cap=kv, tokens=[4], max_tokens=12, stream=stream, **fields)
    h.drain()
    replies = h.stream(A, g)
    assert len(replies) == (k + 1 if stream else 1)
    assert [r["more"] for r in replies] == [True] * (len(replies) - 1) + [False]
    assert [t for r in replies for t in r["tokens"]] == free[:k + 1]
    last = replies[-1]
    assert (last["finish_reason"], last["generated"]) == ("stop", k + 1)
    assert last["cost"]["computed"] == 1 + k
    assert h.entries(kv)[0] == [1, 2, 3, 4] + free[:k]
    h.clean()


def test_no_room_for_the_next_token_ends_a_generate_with_the_errno():
    """The ninth entry needs a third page over the session's quota: the fifth token is
    output, not appended."""
    h = Harness(quota=QuotaConfig(session_pages=2))
    kv = prefilled(h, A, [1, 2, 3])
    g = h.send(A, "generate", cap=kv, tokens=[4], max_tokens=10, stop=[])
    h.drain()
    replies = h.stream(A, g)
    want = solo([1, 2, 3], [4], 5)
    assert [r["more"] for r in replies] == [True] * 4 + [False]
    assert [t for r in replies for t in r["tokens"]] == want
    assert (replies[-1]["finish_reason"], replies[-1]["generated"]) == ("EDQUOT", 5)
    assert h.entries(kv)[0] == [1, 2, 3, 4] + want[:4]
    assert h.ok(A, "kv_stat", cap=kv)["pages"] == 2
    assert np.isfinite(h.kv_of(kv)).all()
    h.clean()


def test_a_generate_the_device_could_never_finish_is_refused_at_admission():
    """3 entries + 1 prompt token + 9 fed back = 13 entries: 4 pages of 4, and the pool
    has 2. It is refused before it starts (never admitted to fail half-way), at once
    (waiting cannot help), the object unchanged."""
    h = Harness(kv_pages=2)
    kv = prefilled(h, A, [1, 2, 3])
    reply = h.call(A, "generate", cap=kv, tokens=[4], max_tokens=10, stop=[])
    assert reply["error"] == {"code": "ENOSPC", "message": "the call needs 3 pages on the "
                              "device, more than its 2"}
    assert h.entries(kv)[0] == [1, 2, 3]
    assert h.engine.scheduler.pending() == 0 and h.engine.pool.held == 0
    h.clean()


def test_a_masked_pred_that_asks_for_no_rows_gets_none():
    """`outputs: []` with a `mask` (found by test_engine_props): nothing to mask, an
    empty reply, not an internal error."""
    h = Harness()
    cap = h.ok(b"a", "kv_create")["cap"]
    reply = h.ok(b"a", "pred", cap=cap, tokens=[0], outputs=[], mask=[0])
    assert reply["logits"] == {"shape": [0, 0], "dtype": "float32"}
    assert h.ok(b"a", "kv_stat", cap=cap)["tokens"] == 1


# ---------------------------------------------------------------- counting

def test_a_steps_cpu_outside_its_forward_is_counted_and_an_empty_step_is_not(monkeypatch):
    """`step_cpu`: predd's thread CPU in a step that ran, less what the forward took
    (read before and after it): 0.75 - 0.25 here; a step with nothing to run reads
    the clock once and counts nothing."""
    import predd.engine.core as core
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    ticks = iter([1.0, 1.25, 1.5, 1.75, 7.0])
    monkeypatch.setattr(core.time, "thread_time", lambda: next(ticks))
    h.send(A, "pred", cap=kv, tokens=[1, 2], outputs=[])
    assert h.engine.step()
    assert h.engine.counters.time_s["step_cpu"] == 0.5
    assert not h.engine.step()
    assert h.engine.counters.time_s["step_cpu"] == 0.5
    assert next(ticks, None) is None
