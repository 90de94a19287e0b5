"""Wire validation: every bad input is a ProtocolError with an errno name, nothing else."""
from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest

import symphony_protocol as p
from symphony_protocol import ProtocolError, SampleParams, decode_frames, decode_request
from tests.unit.helpers import code


def roundtrip(obj) -> p.Request:
    header, extra = decode_frames([p.pack(obj)])
    assert extra == []
    return decode_request(header)


# ---------------------------------------------------------------- frames

def test_decode_frames_returns_header_and_binary_frames():
    header, extra = decode_frames([p.encode_request("kv_import", 3, {}), b"\x00\x01", b""])
    assert header == {"op": "kv_import", "rid": 3}
    assert extra == [b"\x00\x01", b""]


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x81", b"\x92\x01", b"\xd9\x05ab",
    p.pack({"op": "ping", "rid": 1}) + b"\x00",          # trailing bytes
    b"\xa2\xff\xfe",                                     # str that is not UTF-8
    msgpack.packb({1: 2}),                               # int map key
    msgpack.packb({(1, 2): 1}, use_bin_type=True),       # array map key
    bytes(range(256)),
])
def test_malformed_msgpack_is_ebadmsg(frame):
    assert code(lambda: decode_frames([frame])) == "EBADMSG"


def test_empty_message_is_ebadmsg():
    assert code(lambda: decode_frames([])) == "EBADMSG"


@pytest.mark.parametrize("value", [[1, 2], 3, "ping", None, True, 1.5, b"bin"])
def test_non_map_header_is_ebadmsg(value):
    assert code(lambda: decode_frames([p.pack(value)])) == "EBADMSG"


def test_pack_round_trips_bytes_and_str():
    header, _ = decode_frames([p.pack({"op": "pred", "rid": 1, "mask": b"\x01\x02",
                                       "cap": "ab"})])
    assert header["mask"] == b"\x01\x02" and header["cap"] == "ab"


# ---------------------------------------------------------------- requests

def test_every_op_decodes_into_its_record_with_defaults():
    for op, cls in p.REQUESTS.items():
        req = decode_request({"op": op, "rid": 9})
        assert type(req) is cls and req.op == op and req.rid == 9


def test_a_full_pred_request():
    req = roundtrip({"op": "pred", "rid": 4, "cap": "c" * 32, "tokens": [1, 2, 3],
                     "positions": [0, 1, 5], "outputs": [0, -1], "topk": 5,
                     "sample": {"temperature": 0.5}, "mask": b"\xff"})
    assert isinstance(req, p.Pred)
    assert (req.tokens, req.positions, req.outputs, req.topk) == ([1, 2, 3], [0, 1, 5],
                                                                 [0, -1], 5)
    assert req.sample == {"temperature": 0.5} and req.mask == b"\xff"
    assert roundtrip({"op": "pred", "rid": 1, "mask": [3, 4]}).mask == [3, 4]
    assert roundtrip({"op": "pred", "rid": 1, "positions": None}).positions is None


def test_defaults_are_not_shared_between_requests():
    a = decode_request({"op": "pred", "rid": 1})
    a.tokens.append(5)
    assert decode_request({"op": "pred", "rid": 2}).tokens == []


def test_nested_types():
    req = roundtrip({"op": "kv_extract", "rid": 1, "ranges": [[0, 4], [8, 9]]})
    assert req.ranges == [[0, 4], [8, 9]]
    req = roundtrip({"op": "chat_template", "rid": 1,
                     "messages": [{"role": "user", "content": "hi"}]})
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert roundtrip({"op": "kv_tokens", "rid": 1, "end": None}).end is None
    assert roundtrip({"op": "kv_tokens", "rid": 1, "end": 3}).end == 3


def test_unknown_op_is_enosys():
    assert code(lambda: decode_request({"op": "rm_rf", "rid": 1})) == "ENOSYS"
    assert code(lambda: decode_request({"op": "", "rid": 1})) == "ENOSYS"
    assert code(lambda: decode_request({"op": "PING", "rid": 1})) == "ENOSYS"


@pytest.mark.parametrize("header", [
    {"op": "ping"},                                   # no rid
    {"op": "ping", "rid": None},
    {"op": "ping", "rid": "1"},
    {"op": "ping", "rid": 1.0},
    {"op": "ping", "rid": True},                      # bool is not int
    {"op": "ping", "rid": [1]},
    {"rid": 1},                                       # no op
    {"op": None, "rid": 1},
    {"op": 5, "rid": 1},
    {"op": b"ping", "rid": 1},
])
def test_missing_or_wrong_typed_rid_or_op_is_einval(header):
    assert code(lambda: decode_request(header)) == "EINVAL"


def test_rid_may_be_any_msgpack_int():
    for rid in (0, -1, 2**63 - 1, 2**64 - 1, -(2**63)):
        assert roundtrip({"op": "ping", "rid": rid}).rid == rid


def test_unknown_field_is_einval():
    assert code(lambda: decode_request({"op": "ping", "rid": 1, "x": 1})) == "EINVAL"
    assert code(lambda: decode_request({"op": "pred", "rid": 1, "temperature": 0})) == "EINVAL"
    assert code(lambda: decode_request({"op": "ping", "rid": 1, b"cap": "x"})) == "EINVAL"


@pytest.mark.parametrize("op,field,value", [
    ("pred", "tokens", [1, "2"]),
    ("pred", "tokens", [1, 2.0]),
    ("pred", "tokens", [1, True]),                    # bool is not int
    ("pred", "tokens", "123"),
    ("pred", "tokens", None),
    ("pred", "tokens", {1: 2}),
    ("pred", "positions", [0.5]),
    ("pred", "outputs", 0),
    ("pred", "topk", True),
    ("pred", "topk", 1.0),
    ("pred", "sample", [0.5]),
    ("pred", "sample", "greedy"),
    ("pred", "mask", "abc"),
    ("pred", "mask", [1.5]),
    ("pred", "mask", 7),
    ("pred", "cap", b"c" * 32),
    ("pred", "cap", None),
    ("generate", "max_tokens", "16"),
    ("generate", "max_tokens", None),
    ("generate", "stop_text", ["a", 1]),
    ("generate", "stream", 1),                        # int is not bool
    ("kv_extract", "ranges", [0, 4]),
    ("kv_extract", "ranges", [[0, "4"]]),
    ("kv_merge", "caps", "ab"),
    ("kv_merge", "caps", [None]),
    ("kv_create", "persist", 0),
    ("kv_fork", "rights", 1),
    ("kv_tokens", "end", "x"),
    ("hello", "lease_s", "10"),
    ("hello", "lease_s", True),                       # bool is not a float either
    ("hello", "pid", 1.0),
    ("chat_template", "messages", ["hi"]),
    ("chat_template", "messages", {"role": "user"}),
    ("tokenize", "text", b"bytes"),
    ("detokenize", "tokens", [None]),
])
def test_wrong_typed_field_is_einval(op, field, value):
    assert code(lambda: decode_request({"op": op, "rid": 1, field: value})) == "EINVAL"


def test_float_fields_accept_ints():
    assert roundtrip({"op": "hello", "rid": 1, "lease_s": 3}).lease_s == 3
    assert roundtrip({"op": "hello", "rid": 1, "lease_s": 2.5}).lease_s == 2.5


def test_error_message_names_the_field():
    with pytest.raises(ProtocolError) as err:
        decode_request({"op": "pred", "rid": 1, "tokens": ["x"]})
    assert "pred.tokens" in err.value.message
    with pytest.raises(ProtocolError) as err:
        decode_request({"op": "pred", "rid": 1, "bogus": 1})
    assert "bogus" in err.value.message


def test_decode_request_raises_only_protocol_errors_on_fuzzed_maps():
    import random
    rng = random.Random(7)
    values = [None, True, 0, -1, 2**64 - 1, 1.5, "", "x", b"", [], [1], [[1]], {}, {"a": 1},
              [None], ["s"], float("nan")]
    ops = list(p.REQUESTS) + ["nope"]
    for _ in range(2000):
        op = rng.choice(ops)
        cls = p.REQUESTS.get(op)
        names = [f.name for f in dataclasses.fields(cls)] if cls else ["x"]
        header = {"op": op, "rid": rng.choice([1, 1, 1, None, "1"])}
        for _ in range(rng.randint(0, 3)):
            header[rng.choice(names + ["zzz"])] = rng.choice(values)
        try:
            decode_request(header)
        except ProtocolError as exc:
            assert exc.code in ("EINVAL", "ENOSYS")


# ---------------------------------------------------------------- replies and helpers

COST = p.Cost(computed=3, reused=5, pages=2, queue_ms=0.5, step_ms=1.25, swapped_in=16,
              swap_ms=0.75)
COST_WIRE = {"computed": 3, "reused": 5, "pages": 2, "queue_ms": 0.5, "step_ms": 1.25,
             "swapped_in": 16, "swap_ms": 0.75}
KV = dict(tokens=9, pages=3, bytes=3072, last_position=8, model="m", tier="host",
          pinned=True, idle_s=1.5)

# One reply of every shape: (op, record, the exact map predd sends with rid 7, frames).
REPLY_CASES = [
    ("ping", p.EmptyReply(), {}, []),
    ("hello", p.HelloReply(session=4, version=1, lease_s=10.0, model="m", uid=1000,
                           trusted=False),
     {"session": 4, "version": 1, "lease_s": 10.0, "model": "m", "uid": 1000,
      "trusted": False, "logits_slot_bytes": 0, "logits_buffer": ""}, []),
    ("tokenize", p.TokenizeReply(tokens=[1, 2]), {"tokens": [1, 2]}, []),
    ("detokenize", p.DetokenizeReply(text="ab"), {"text": "ab"}, []),
    ("tokenizer", p.TokenizerReply(json=b"{}"), {}, [b"{}"]),
    ("chat_template", p.ChatTemplateReply(text="ab", tokens=[1, 2]),
     {"text": "ab", "tokens": [1, 2]}, []),
    ("kv_create", p.KvReply(**KV, cap="c" * 32, rights="rw"),
     {**KV, "cap": "c" * 32, "rights": "rw"}, []),
    ("kv_stat", p.KvReply(**KV, rights="r"), {**KV, "rights": "r"}, []),
    ("kv_truncate", p.KvReply(**KV), KV, []),
    ("kv_export", p.KvExportReply(**KV, snapshot=b"SYKV2..."), KV, [b"SYKV2..."]),
    ("kv_tokens", p.KvTokensReply(tokens=[4, 5], positions=[0, 1]),
     {"tokens": [4, 5], "positions": [0, 1]}, []),
    ("fsck", p.FsckReply(clean=False, problems=["x"], pages_total=8, pages_free=2,
                         objects=1),
     {"clean": False, "problems": ["x"], "pages_total": 8, "pages_free": 2, "objects": 1},
     []),
    ("ps", p.PsReply(sessions=[{"session": 1}], ended=[], uids=[{"uid": 0}]),
     {"sessions": [{"session": 1}], "ended": [], "uids": [{"uid": 0}]}, []),
    ("pred", p.PredLogits(shape=[1, 2], data=b"\0" * 8, cost=COST),
     {"logits": {"shape": [1, 2], "dtype": "float32"}, "cost": COST_WIRE}, [b"\0" * 8]),
    ("pred", p.PredLogits(shape=[1, 2], data=b"", slot=3, cost=COST),      # in the buffer
     {"logits": {"shape": [1, 2], "dtype": "float32", "slot": 3}, "cost": COST_WIRE}, []),
    ("pred", p.PredSample(tokens=[3, 4], logprobs=[-0.5, -0.25], cost=COST),
     {"tokens": [3, 4], "logprobs": [-0.5, -0.25], "token": 4, "logprob": -0.25,
      "cost": COST_WIRE}, []),
    ("pred", p.PredSample(tokens=[], logprobs=[], cost=COST),
     {"tokens": [], "logprobs": [], "token": None, "logprob": None, "cost": COST_WIRE}, []),
    ("pred", p.PredTopk(topk_ids=[[1, 2]], topk_logprobs=[[-0.5, -1.5]], cost=COST),
     {"topk_ids": [[1, 2]], "topk_logprobs": [[-0.5, -1.5]], "cost": COST_WIRE}, []),
    ("generate", p.GenerateChunk(tokens=[7], logprobs=[-0.5]),
     {"more": True, "tokens": [7], "logprobs": [-0.5]}, []),
    ("generate", p.GenerateReply(tokens=[8], logprobs=[-1.0], generated=2,
                                 finish_reason="length", cost=COST),
     {"more": False, "tokens": [8], "logprobs": [-1.0], "generated": 2,
      "finish_reason": "length", "cost": COST_WIRE}, []),
]


@pytest.mark.parametrize("op,record,fields,frames", REPLY_CASES,
                         ids=[f"{c[0]}-{type(c[1]).__name__}" for c in REPLY_CASES])
def test_each_reply_record_sends_its_exact_map_and_decodes_back(op, record, fields, frames):
    assert record.wire(7) == {"rid": 7, "ok": True, **fields}
    assert record.frames() == frames
    received = msgpack.unpackb(p.pack(record.wire(7)), raw=False)
    assert p.decode_reply(op, received, frames) == record


def test_every_request_has_a_reply_record():
    assert set(p.REPLIES) == set(p.REQUESTS.values())
    covered = {op for op, *_ in REPLY_CASES}
    assert {p.REPLIES[p.REQUESTS[op]] for op in covered} >= {
        p.EmptyReply, p.HelloReply, p.KvReply, p.KvExportReply, p.PredReply,
        p.GenerateReply}


def test_error_reply():
    err = p.ErrorReply.of(ProtocolError("EBADF", "no"))
    assert err.wire(None) == {"rid": None, "ok": False,
                              "error": {"code": "EBADF", "message": "no"}}
    assert p.decode_reply("pred", err.wire(3)) == err


def test_a_reply_missing_a_field_is_ebadmsg():
    assert code(lambda: p.decode_reply("kv_stat", {"rid": 1, "ok": True, "tokens": 1})) \
        == "EBADMSG"
    assert code(lambda: p.decode_reply("pred", {"rid": 1, "ok": True, "logits": {
        "shape": [1, 2], "dtype": "float32"}, "cost": COST_WIRE})) == "EBADMSG"   # no frame
    assert code(lambda: p.decode_reply("nope", {"rid": 1, "ok": True})) == "ENOSYS"


def test_a_stats_reply_of_an_older_predd_has_no_logits_rows():
    """`logits_rows` came later than the other stats: a reply without it decodes to {}."""
    wire = {f.name: 0 for f in dataclasses.fields(p.StatsReply)}
    wire.update(rid=1, ok=True, mean_batch=0.0, tiers={}, time_ms={}, queue_wait_hist={},
                step_hist={}, queue_wait_ms=0.0, step_ms=0.0, launch_wait_ms=0.0,
                uptime_s=0.0, logits_rows={"buffer": 3, "frame": 1})
    assert p.decode_reply("stats", wire).logits_rows == {"buffer": 3, "frame": 1}
    del wire["logits_rows"]
    assert p.decode_reply("stats", wire).logits_rows == {}


def test_check_rights():
    assert p.check_rights("r") == "r" and p.check_rights("rw") == "rw"
    for bad in ("w", "", "RW", "wr", "rwx"):
        assert code(lambda: p.check_rights(bad)) == "EINVAL"


def test_protocol_error_carries_code_and_message():
    exc = ProtocolError("ENOSPC", "full")
    assert (exc.code, exc.message, str(exc)) == ("ENOSPC", "full", "ENOSPC: full")


# ---------------------------------------------------------------- sample params

def test_sample_params_from_wire():
    assert SampleParams.from_wire(None) is None
    assert SampleParams.from_wire({}) == SampleParams()
    got = SampleParams.from_wire({"temperature": 0, "top_p": 0.5, "top_k": 40, "seed": 7})
    assert got == SampleParams(temperature=0, top_p=0.5, top_k=40, seed=7)
    assert SampleParams.from_wire({"seed": None}).seed is None
    assert SampleParams.from_wire({"top_p": 1}).top_p == 1       # int accepted as float
    assert SampleParams.from_wire({"seed": -5}).seed == -5


@pytest.mark.parametrize("raw", [
    {"temp": 1.0},                        # unknown key
    {"temperature": "0"},
    {"temperature": None},
    {"temperature": True},
    {"top_k": 1.0},
    {"top_k": True},
    {"top_k": None},
    {"seed": 1.5},
    {"seed": "7"},
    {"seed": False},
    {"temperature": -0.1},
    {"top_p": 0},
    {"top_p": 0.0},
    {"top_p": 1.01},
    {"top_p": -1},
    {"top_p": float("nan")},
    {"top_k": -1},
])
def test_bad_sample_params_are_einval(raw):
    assert code(lambda: SampleParams.from_wire(raw)) == "EINVAL"


@pytest.mark.parametrize("temperature", [math.nan, math.inf])
def test_non_finite_temperature_is_einval(temperature):
    assert code(lambda: SampleParams.from_wire({"temperature": temperature})) == "EINVAL"
