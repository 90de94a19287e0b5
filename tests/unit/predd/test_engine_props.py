"""Property test of STYLE 17 at the engine: any sequence of requests, pipelined from two
clients, gets exactly one terminal reply each, the engine never raises, and the KV store
stays sound (fsck); when the clients go, every page they held comes back."""
from __future__ import annotations

import time

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from predd.server.request_limits import MAX_POSITION
from tests.unit.engine_fakes import ME, VOCAB, Harness

CLIENTS = (b"one", b"two")
OPS = ["ping", "info", "stats", "fsck", "tokenize", "detokenize", "chat_template",
       "kv_create", "kv_fork", "kv_grant", "kv_free", "kv_stat", "kv_tokens", "kv_truncate",
       "kv_extract", "kv_merge", "kv_export", "kv_import", "pred", "generate", "nonsense"]

small = st.integers(-3, 12)
token = st.integers(-2, VOCAB + 2)
position = st.integers(-2, 40) | st.integers(MAX_POSITION - 4, MAX_POSITION + 2)
any_value = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=4)
             | st.binary(max_size=4))
FIELD = {
    "tokens": st.lists(token, max_size=12),
    "positions": st.none() | st.lists(position, max_size=12),
    "outputs": st.none() | st.lists(small, max_size=5),
    "sample": st.none() | st.fixed_dictionaries({}, optional={
        "temperature": st.floats(-1, 3) | st.just(0.0), "top_p": st.floats(-0.5, 1.5),
        "top_k": small, "seed": st.none() | st.integers(0, 2**64 - 1)}),
    "topk": st.integers(-1, VOCAB + 1),
    "mask": st.none() | st.lists(token, max_size=6) | st.binary(min_size=7, max_size=9),
    "max_tokens": st.integers(-1, 30),
    "stop": st.none() | st.lists(token, max_size=3),
    "stop_text": st.lists(st.text("abcz", max_size=3), max_size=3),
    "stream": st.booleans(),
    "ranges": st.lists(st.lists(small, min_size=2, max_size=2), max_size=3),
    "start": small, "end": st.none() | small, "length": small,
    "rights": st.sampled_from(["r", "rw", "x"]), "persist": st.booleans(),
    "text": st.text(max_size=10), "skip_special": st.booleans(),
    "messages": st.lists(st.fixed_dictionaries({"role": st.text(max_size=3),
                                                "content": st.text(max_size=5)}), max_size=2),
}
OP_FIELDS = {
    "tokenize": ["text"], "detokenize": ["tokens", "skip_special"],
    "chat_template": ["messages"], "kv_create": ["persist"],
    "kv_fork": ["cap", "rights", "persist"], "kv_grant": ["cap", "rights", "persist"],
    "kv_free": ["cap"], "kv_stat": ["cap"], "kv_tokens": ["cap", "start", "end"],
    "kv_truncate": ["cap", "length"], "kv_extract": ["cap", "ranges", "persist"],
    "kv_merge": ["caps", "persist"], "kv_export": ["cap"], "kv_import": ["persist"],
    "pred": ["cap", "tokens", "positions", "outputs", "sample", "topk", "mask"],
    "generate": ["cap", "tokens", "max_tokens", "sample", "stop", "stop_text", "stream"],
}


@st.composite
def requests(draw):
    """(client, op, fields, which cap slots to use, frames hint)."""
    op = draw(st.sampled_from(OPS))
    fields = {}
    for name in draw(st.lists(st.sampled_from(OP_FIELDS.get(op, ["x"])), unique=True)):
        if name in ("cap", "caps"):
            fields[name] = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3)
                                if name == "caps" else st.integers(0, 3))
        else:
            fields[name] = draw(FIELD.get(name, any_value))
    if draw(st.integers(0, 9)) == 0:
        fields[draw(st.text(max_size=5))] = draw(any_value)
    frame = draw(st.sampled_from(["export", "damaged", "garbage", "none"]))
    return draw(st.sampled_from(CLIENTS)), op, fields, frame


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(requests(), min_size=1, max_size=10))
def test_any_requests_get_one_reply_each_and_leave_a_sound_store(reqs):
    h = Harness(kv_pages=48, token_budget=8)
    caps = []
    for who in CLIENTS:   # something to aim at: a prefilled object per client
        cap = h.ok(who, "kv_create")["cap"]
        h.ok(who, "pred", cap=cap, tokens=[1, 2, 3, 4, 5], outputs=[])
        caps.append(cap)
    blob = h.engine.store.export(h.engine.caps.lookup(caps[0]).oid)
    frames = {"export": [blob], "damaged": [blob[:-5] + b"\x00" * 5], "garbage": [b"x"],
              "none": []}
    sent = []
    for who, op, fields, frame in reqs:
        slots = caps + ["f" * 32, ""]
        if "cap" in fields:
            fields["cap"] = slots[fields["cap"]]
        if "caps" in fields:
            fields["caps"] = [slots[i] for i in fields["caps"]]
        h.rid += 1
        head = msgpack.packb({"op": op, "rid": h.rid, **fields}, use_bin_type=True)
        h.engine.handle(who, [head, *frames[frame]], time.monotonic(), ME)
        sent.append((who, h.rid))
        if h.rid % 3 == 0:
            h.engine.step()
    h.drain()
    for who, rid in sent:
        reply = h.reply(who, rid)              # exactly one terminal reply...
        assert reply.get("error", {}).get("code") != "EIO", reply   # ...and no bug hit
    h.clean()
    for s in list(h.engine.sessions):
        h.engine.end_session(s, "test over")
    persistent = {c.oid for c in h.engine.caps._caps.values()}
    held = sum(len(h.engine.store.objects[o].pages) for o in persistent)
    assert h.engine.pool.used_pages <= held    # only persistent objects hold pages
    h.clean()
