"""Every op's reply from a real predd is exactly its record in symphony_protocol/: it
decodes (a missing field would be EBADMSG), and the record sends back the very map
predd sent — no field more, none less. A streamed generate is chunks, then one
terminal GenerateReply."""
from __future__ import annotations

import symphony_protocol as p
VOCAB = 49152


def check(client, op: str, cls: type, frames: tuple[bytes, ...] = (), **fields) -> p.Reply:
    header, extra = client.request(op, frames, **fields)
    record = p.decode_reply(op, header, extra)
    assert type(record) is cls
    assert record.wire(header["rid"]) == header
    assert record.frames() == extra
    return record


def test_every_reply_is_exactly_its_record(lip):
    c = lip.client()
    hello = p.decode_reply("hello", c.session)
    assert isinstance(hello, p.HelloReply) and hello.wire(c.session["rid"]) == c.session
    check(c, "ping", p.EmptyReply)
    info = check(c, "info", p.InfoReply)
    assert info.vocab_size == VOCAB and info.model == "SmolLM2-135M-Instruct"
    check(c, "stats", p.StatsReply)
    check(c, "ps", p.PsReply)
    assert check(c, "fsck", p.FsckReply).clean
    tokens = check(c, "tokenize", p.TokenizeReply, text="Hello world").tokens
    assert len(tokens) == 2
    assert check(c, "detokenize", p.DetokenizeReply, tokens=tokens).text == "Hello world"
    assert b'"model"' in check(c, "tokenizer", p.TokenizerReply).json
    check(c, "chat_template", p.ChatTemplateReply, messages=[{"role": "user", "content": "Hi"}])

    kv = check(c, "kv_create", p.KvReply)
    assert (kv.tokens, kv.pages, kv.last_position, kv.rights, len(kv.cap)) == (0, 0, -1, "rw", 32)
    raw = check(c, "pred", p.PredLogits, cap=kv.cap, tokens=tokens)
    assert raw.shape == [1, VOCAB] and len(raw.data) == VOCAB * 4
    assert (raw.cost.computed, raw.cost.reused) == (2, 0)
    top = check(c, "pred", p.PredTopk, cap=kv.cap, tokens=[], topk=3)
    greedy = check(c, "pred", p.PredSample, cap=kv.cap, tokens=[],
                   sample={"temperature": 0.0})
    assert greedy.tokens == [top.topk_ids[0][0]]

    stat = check(c, "kv_stat", p.KvReply, cap=kv.cap)
    assert (stat.tokens, stat.pages, stat.rights, stat.cap) == (2, 1, "rw", "")
    fork = check(c, "kv_fork", p.KvReply, cap=kv.cap)
    grant = check(c, "kv_grant", p.KvReply, cap=kv.cap, rights="r")
    assert grant.rights == "r" and grant.cap not in (kv.cap, fork.cap)
    assert check(c, "kv_tokens", p.KvTokensReply, cap=kv.cap).tokens == tokens
    check(c, "kv_extract", p.KvReply, cap=kv.cap, ranges=[[0, 1]])
    check(c, "kv_merge", p.KvReply, caps=[kv.cap, fork.cap])
    export = check(c, "kv_export", p.KvExportReply, cap=kv.cap)
    imported = check(c, "kv_import", p.KvReply, (export.snapshot,))
    assert imported.tokens == 2
    truncated = check(c, "kv_truncate", p.KvReply, cap=fork.cap, length=1)
    assert (truncated.tokens, truncated.rights, truncated.cap) == (1, "", "")

    whole = c.ask("generate", cap=fork.cap, tokens=tokens[1:], max_tokens=4, stop=[],
                  stream=False)
    assert isinstance(whole, p.GenerateReply)
    assert (whole.generated, whole.finish_reason, len(whole.tokens)) == (4, "length", 4)
    again = c.ask("kv_create")
    c.call("pred", cap=again.cap, tokens=tokens[:1], outputs=[])
    headers = list(c.stream("generate", cap=again.cap, tokens=tokens[1:], max_tokens=4,
                            stop=[]))
    stream = [p.decode_reply("generate", h) for h in headers]
    assert [r.wire(h["rid"]) for r, h in zip(stream, headers)] == headers   # exactly
    assert [type(r) for r in stream] == [p.GenerateChunk] * 3 + [p.GenerateReply]
    assert [t for r in stream for t in r.tokens] == whole.tokens
    assert (stream[-1].generated, stream[-1].finish_reason) == (4, "length")
    again_stream = list(c.ask_stream("generate", cap=again.cap, tokens=[], max_tokens=1))
    assert [type(r) for r in again_stream] == [p.GenerateReply]
    check(c, "kv_free", p.EmptyReply, cap=again.cap)
