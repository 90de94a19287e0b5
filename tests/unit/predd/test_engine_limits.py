"""Every bound of predd/server/request_limits.py: the exact errno and message, and nothing queued,
allocated or half-done. A real Engine over the fake runner (context 256, vocab 64)."""
from __future__ import annotations

import pytest

from predd.server.request_limits import Limits
from tests.unit.engine_fakes import CONTEXT, VOCAB, Harness

A = b"client-a"


def e2big(what: str, n: int, limit: int) -> tuple[str, str]:
    return "E2BIG", f"{what}: {n} is more than the limit of {limit}"


L = Limits()
CASES = {
    "pred tokens past the context": (
        lambda kv: ("pred", {"cap": kv, "tokens": [1] * (CONTEXT + 1)}),
        e2big("pred.tokens", CONTEXT + 1, CONTEXT)),
    "pred outputs repeated past the row limit": (
        lambda kv: ("pred", {"cap": kv, "tokens": [1], "outputs": [0] * (L.output_rows + 1)}),
        e2big("pred.outputs", L.output_rows + 1, L.output_rows)),
    "pred topk past the vocabulary": (
        lambda kv: ("pred", {"cap": kv, "tokens": [1], "topk": VOCAB + 1}),
        ("EINVAL", f"pred.topk must be in [0, {VOCAB}]")),
    "pred topk negative": (
        lambda kv: ("pred", {"cap": kv, "tokens": [1], "topk": -1}),
        ("EINVAL", f"pred.topk must be in [0, {VOCAB}]")),
    "pred mask list longer than the vocabulary": (
        lambda kv: ("pred", {"cap": kv, "tokens": [1], "mask": [1] * (VOCAB + 1)}),
        e2big("pred.mask", VOCAB + 1, VOCAB)),
    "pred position past int32": (
        lambda kv: ("pred", {"cap": kv, "tokens": [1], "positions": [2**31 - 1]}),
        ("EINVAL", "pred.positions: one per token, in [0, 2147483647)")),
    "generate tokens past the context": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1] * (CONTEXT + 1)}),
        e2big("generate.tokens", CONTEXT + 1, CONTEXT)),
    "generate max_tokens 2**62": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1], "max_tokens": 2**62}),
        ("EINVAL", f"generate.max_tokens must be in [1, {CONTEXT}]")),
    "generate max_tokens 0": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1], "max_tokens": 0}),
        ("EINVAL", f"generate.max_tokens must be in [1, {CONTEXT}]")),
    "generate too many stop ids": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1], "stop": [1] * (L.stop_ids + 1)}),
        e2big("generate.stop", L.stop_ids + 1, L.stop_ids)),
    "generate stop id past the vocabulary": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1], "stop": [VOCAB]}),
        ("EINVAL", f"generate.stop: token ids must be in [0, {VOCAB})")),
    "generate too many stop strings": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1],
                                 "stop_text": ["x"] * (L.stop_texts + 1)}),
        e2big("generate.stop_text", L.stop_texts + 1, L.stop_texts)),
    "generate a huge stop string": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1], "stop_text": ["x" * 10**6]}),
        e2big("generate.stop_text characters", 10**6, L.stop_text_chars)),
    "generate an empty stop string": (
        lambda kv: ("generate", {"cap": kv, "tokens": [1], "stop_text": [""]}),
        ("EINVAL", "generate.stop_text: an empty string")),
    "kv_merge of one cap 65 times": (
        lambda kv: ("kv_merge", {"caps": [kv] * (L.merge_caps + 1)}),
        e2big("kv_merge.caps", L.merge_caps + 1, L.merge_caps)),
    "kv_merge longer than the context": (
        lambda kv: ("kv_merge", {"caps": [kv] * 2}),
        ("E2BIG", f"kv_merge: the new object would hold 400 entries, more than the limit "
         f"of {CONTEXT}")),
    "kv_extract of too many ranges": (
        lambda kv: ("kv_extract", {"cap": kv, "ranges": [[0, 1]] * (L.extract_ranges + 1)}),
        e2big("kv_extract.ranges", L.extract_ranges + 1, L.extract_ranges)),
    "kv_extract longer than the context": (
        lambda kv: ("kv_extract", {"cap": kv, "ranges": [[0, 200], [0, 100]]}),
        ("E2BIG", f"kv_extract: the new object would hold 300 entries, more than the limit "
         f"of {CONTEXT}")),
    "kv_tokens of a huge range": (
        lambda kv: ("kv_tokens", {"cap": kv, "start": 0, "end": 2**62}),
        ("EINVAL", f"range [0, {2**62}) outside 0..200")),
    "detokenize a huge list": (
        lambda kv: ("detokenize", {"tokens": [1] * (L.text_tokens + 1)}),
        e2big("detokenize.tokens", L.text_tokens + 1, L.text_tokens)),
    "tokenize a huge text": (
        lambda kv: ("tokenize", {"text": "a" * (L.text_chars + 1)}),
        e2big("tokenize.text characters", L.text_chars + 1, L.text_chars)),
    "chat_template of too many messages": (
        lambda kv: ("chat_template", {"messages": [{"role": "u", "content": ""}] * 4097}),
        e2big("chat_template.messages", 4097, L.messages)),
    "chat_template of too much text": (
        lambda kv: ("chat_template", {"messages": [{"role": "u", "content": "a" * L.text_chars}]}),
        e2big("chat_template characters", L.text_chars + 1, L.text_chars)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_limit_has_its_errno_and_takes_nothing(case):
    build, (code, message) = CASES[case]
    h = Harness(kv_pages=128)
    kv = h.ok(A, "kv_create")["cap"]
    h.ok(A, "pred", cap=kv, tokens=[1] * 200, outputs=[])
    before = (h.free_pages(), len(h.engine.store.objects), h.entries(kv))
    op, fields = build(kv)
    reply = h.call(A, op, **fields)
    assert reply["error"] == {"code": code, "message": message}
    assert (h.free_pages(), len(h.engine.store.objects), h.entries(kv)) == before
    assert h.engine.scheduler.pending() == 0
    h.clean()


def test_requests_right_at_the_limits_are_served():
    h = Harness(kv_pages=256)
    kv = h.ok(A, "kv_create")["cap"]
    out = h.ok(A, "pred", cap=kv, tokens=[1] * CONTEXT, outputs=[0] * 2 + [CONTEXT - 1],
               topk=VOCAB)
    assert len(out["topk_ids"]) == 3 and len(out["topk_ids"][0]) == VOCAB
    assert out["topk_ids"][0] == out["topk_ids"][1]                 # a repeat is a copy
    h.ok(A, "kv_truncate", cap=kv, length=128)
    merged = h.ok(A, "kv_merge", caps=[kv, kv])                     # exactly the context
    assert merged["tokens"] == CONTEXT
    one = h.ok(A, "kv_create")["cap"]
    h.ok(A, "pred", cap=one, tokens=[1], outputs=[])
    assert h.ok(A, "kv_merge", caps=[one] * Limits().merge_caps)["tokens"] == 64
    assert h.ok(A, "kv_extract", cap=kv, ranges=[[0, 0]] * Limits().extract_ranges)
    g = h.ok(A, "generate", cap=h.ok(A, "kv_create")["cap"], tokens=[1], max_tokens=CONTEXT,
             stop=[], stream=False, stop_text=["z" * 256] * 16)
    assert g["generated"] == CONTEXT
    h.clean()


def test_pred_logits_reply_is_bounded_by_the_rows_asked():
    """A repeated output costs its row: 4096 rows of `vocab` float32 at most."""
    h = Harness()
    kv = h.ok(A, "kv_create")["cap"]
    rid = h.send(A, "pred", cap=kv, tokens=[1, 2], outputs=[1] * Limits().output_rows)
    h.drain()
    (frames,) = [f for i, head, f in h.replies if head["rid"] == rid]
    assert len(frames[0]) == Limits().output_rows * VOCAB * 4
    h.clean()


def test_configured_limits_replace_the_defaults():
    h = Harness(limits=Limits(context=8, output_rows=2))
    assert h.engine.limits.context == 8
    kv = h.ok(A, "kv_create")["cap"]
    assert h.call(A, "pred", cap=kv, tokens=[1] * 9)["error"]["code"] == "E2BIG"
    assert h.call(A, "pred", cap=kv, tokens=[1] * 3, outputs=[0, 1, 2])["error"] == {
        "code": "E2BIG", "message": "pred.outputs: 3 is more than the limit of 2"}
    assert Limits().resolved(4096).context == 4096
    assert Limits(context=10).resolved(4096).context == 10
