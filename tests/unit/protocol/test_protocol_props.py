"""Property tests of the wire boundary: whatever bytes or maps arrive, decoding either
gives a well-typed record or raises ProtocolError — never anything else."""
from __future__ import annotations

import dataclasses
import typing

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import symphony_protocol as p
from symphony_protocol import requests as requests_mod
from symphony_protocol import ProtocolError, SampleParams, decode_frames, decode_request

FIELDS = sorted({f.name for cls in p.REQUESTS.values() for f in dataclasses.fields(cls)})

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
           | st.text(max_size=12) | st.binary(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
ops = st.sampled_from(sorted(p.REQUESTS)) | values
keys = st.sampled_from(FIELDS) | st.text(max_size=8)


def value_for(hint) -> st.SearchStrategy:
    """Values of the type a record field declares (the shapes protocol.py uses)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, __import__("types").UnionType):
        return st.one_of([value_for(a) for a in typing.get_args(hint)])
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-2**63, 2**64 - 1)
    if hint is float:
        return st.floats() | st.integers(-10, 10)
    if hint is str:
        return st.text(max_size=40)
    if hint is bytes:
        return st.binary(max_size=40)
    if origin is list:
        (item,) = typing.get_args(hint)
        return st.lists(value_for(item), max_size=6)
    if origin is dict or hint is dict:
        return st.dictionaries(st.text(max_size=12), values, max_size=4)
    raise AssertionError(f"no strategy for {hint}")


@st.composite
def typed_requests(draw) -> dict:
    """Maps whose fields have the declared types (and sometimes one that does not)."""
    op = draw(st.sampled_from(sorted(p.REQUESTS)))
    hints = typing.get_type_hints(p.REQUESTS[op])
    names = [f.name for f in dataclasses.fields(p.REQUESTS[op]) if f.name != "rid"]
    chosen = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    raw = {"op": op, "rid": draw(st.integers(-2**63, 2**64 - 1))}
    for name in chosen:
        raw[name] = draw(value_for(hints[name]))
    if draw(st.booleans()):
        raw[draw(keys)] = draw(values)
    return raw


def decodes_or_protocol_error(frames: list[bytes]) -> None:
    try:
        header, extra = decode_frames(frames)
    except ProtocolError as exc:
        assert exc.code == "EBADMSG"
        return
    assert isinstance(header, dict) and extra == list(frames[1:])
    request_or_protocol_error(header)


def request_or_protocol_error(header: dict) -> None:
    try:
        request = decode_request(header)
    except ProtocolError as exc:
        assert exc.code in ("EINVAL", "E2BIG", "ENOSYS") and exc.message
        return
    assert type(request) is p.REQUESTS[header["op"]]
    hints = typing.get_type_hints(type(request))
    for f in dataclasses.fields(request):
        assert requests_mod._is_instance(getattr(request, f.name), hints[f.name]), f.name


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=3))
def test_arbitrary_frames_decode_or_raise_protocol_error(frames):
    decodes_or_protocol_error(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_msgpack_prefixes_and_mutations_decode_or_raise_protocol_error(tail):
    good = p.encode_request("pred", 1, {"cap": "ab" * 16, "tokens": [1, 2, 3]})
    for frame in (good[:len(tail) % (len(good) + 1)], good + tail, tail + good,
                  bytes(b ^ t for b, t in zip(good, tail)) + good[len(tail):]):
        decodes_or_protocol_error([frame])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=6), ops, values)
def test_arbitrary_maps_decode_or_raise_protocol_error(fields, op, rid):
    raw = {**fields, "op": op, "rid": rid}
    request_or_protocol_error(raw)
    decodes_or_protocol_error([msgpack.packb(raw, use_bin_type=True)])


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(typed_requests())
def test_typed_maps_decode_or_raise_protocol_error(raw):
    request_or_protocol_error(raw)
    decodes_or_protocol_error([msgpack.packb(raw, use_bin_type=True)])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(p.SAMPLE_KEYS)) | st.text(max_size=6)
                       | st.integers(), values, max_size=5))
def test_sample_params_from_wire_never_raises_anything_else(raw):
    try:
        params = SampleParams.from_wire(raw)
    except ProtocolError as exc:
        assert exc.code == "EINVAL"
        return
    assert params.temperature >= 0 and 0 < params.top_p <= 1 and params.top_k >= 0


def test_size_limits_are_e2big():
    big = [1] * (p.MAX_ITEMS + 1)
    for raw, what in [({"op": "pred", "rid": 1, "cap": "x", "tokens": big}, "pred.tokens"),
                      ({"op": "tokenize", "rid": 1, "text": "a" * (p.MAX_CHARS + 1)},
                       "tokenize.text"),
                      ({"op": "pred", "rid": 1, "mask": b"\0" * (p.MAX_CHARS + 1)}, "pred.mask")]:
        try:
            decode_request(raw)
        except ProtocolError as exc:
            assert exc.code == "E2BIG" and exc.message.startswith(what + ":")
        else:
            raise AssertionError(what)


def test_extract_ranges_are_pairs():
    for ranges in ([[1]], [[1, 2, 3]], [[]], [[0, 1], [2]]):
        try:
            decode_request({"op": "kv_extract", "rid": 1, "cap": "x", "ranges": ranges})
        except ProtocolError as exc:
            assert (exc.code, exc.message) == (
                "EINVAL", "kv_extract.ranges: each range is [start, end]")
        else:
            raise AssertionError(ranges)
    assert decode_request({"op": "kv_extract", "rid": 1, "ranges": [[0, 1]]}).ranges == [[0, 1]]
