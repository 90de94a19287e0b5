"""The `.kv` descriptor: render/parse round trip; anything else is a ValueError."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from symphony_protocol.descriptor import MAGIC, MAX_COUNT, MAX_LEN, MODEL_MAX, Descriptor, parse

CAP = "0123456789abcdef" * 2


def test_render_is_the_documented_text():
    d = Descriptor(CAP, "rw", 1000, 63, "SmolLM2-135M-Instruct")
    assert d.render() == (f"kvfs 1\ncap {CAP}\nrights rw\ntokens 1000\npages 63\n"
                          "model SmolLM2-135M-Instruct\n")
    assert d.encode() == d.render().encode()


@pytest.mark.parametrize("d", [
    Descriptor(CAP),
    Descriptor(CAP, "rw", 1000, 63, "SmolLM2-135M-Instruct"),
    Descriptor("f" * 32, "r", 0, 0, ""),
    Descriptor(CAP, "r", 5, 1, "a model with spaces"),
    Descriptor(CAP, "rw", 10**12, 10**9, "Llama-3/8B ünïcode"),
])
def test_round_trip(d):
    assert parse(d.encode()) == d
    assert parse(d.render()) == d


def test_minimal_descriptor_gets_defaults():
    assert parse(f"kvfs 1\ncap {CAP}\n") == Descriptor(CAP, "r", 0, 0, "")
    assert parse(f"kvfs 1\ncap {CAP}") == Descriptor(CAP)


def test_whitespace_and_line_order_are_tolerated():
    text = f"  kvfs 1  \r\nmodel m\r\ncap   {CAP}\r\ntokens 7\nrights rw\n\n\n"
    assert parse(text.encode()) == Descriptor(CAP, "rw", 7, 0, "m")


@pytest.mark.parametrize("data", [
    b"",
    b"\n\n",
    b"kvfs 2\ncap " + CAP.encode(),
    b"KVFS 1\ncap " + CAP.encode(),
    b"cap " + CAP.encode() + b"\nkvfs 1",             # magic not first
    b"kvfs 1\n",                                       # no cap
    b"kvfs 1\ncap\n",
    b"kvfs 1\ncap " + CAP.upper().encode(),
    b"kvfs 1\ncap " + CAP[:-1].encode(),
    b"kvfs 1\ncap " + CAP.encode() + b"0",
    b"kvfs 1\ncap " + CAP[:-1].encode() + b"g",
    b"kvfs 1\ncap " + CAP.encode() + b" extra",
    b"kvfs 1\ncap " + CAP.encode() + b"\ncap " + CAP.encode(),          # duplicate
    b"kvfs 1\ncap " + CAP.encode() + b"\nowner root",                     # unknown key
    b"kvfs 1\ncap " + CAP.encode() + b"\n\nrights r",                     # blank line inside
    b"kvfs 1\ncap " + CAP.encode() + b"\nrights w",
    b"kvfs 1\ncap " + CAP.encode() + b"\nrights RW",
    b"kvfs 1\ncap " + CAP.encode() + b"\nrights",
    b"kvfs 1\ncap " + CAP.encode() + b"\ntokens many",
    b"kvfs 1\ncap " + CAP.encode() + b"\ntokens 1.5",
    b"kvfs 1\ncap " + CAP.encode() + b"\npages ",
    b"kvfs 1\ncap " + CAP.encode() + b"\npages 0x10",
    b"kvfs 1\ncap " + CAP.encode() + b"\ntokens -5",
    b"kvfs 1\ncap " + CAP.encode() + b"\ntokens 1_000",
    "kvfs 1\ncap {}\ntokens \u0663".format(CAP).encode(),          # a non-ASCII digit
    b"kvfs 1\ncap " + CAP.encode() + b"\ntokens " + b"9" * 19,       # over MAX_COUNT
    b"kvfs 1\ncap " + CAP.encode() + b"\nmodel a\x00b",              # not printable
    b"kvfs 1\ncap " + CAP.encode() + b"\nmodel " + b"m" * (MODEL_MAX + 1),
    b"\xff\xfe\x00garbage",                            # not UTF-8
    b"kvfs 1\ncap " + CAP.encode() + b"\nmodel \xc3\x28",
    b"kvfs 1\ncap " + CAP.encode() + b"\nmodel " + b"m" * MAX_LEN,     # too long
    bytes(range(256)) * 4,
    b"\x00" * 100,
])
def test_garbage_is_value_error(data):
    with pytest.raises(ValueError):
        parse(data)


def test_length_limit_is_inclusive():
    head = f"{MAGIC}\ncap {CAP}\nmodel {'m' * MODEL_MAX}".encode()
    fits = head + b" " * (MAX_LEN - len(head))           # trailing blanks are tolerated
    assert len(fits) == MAX_LEN
    assert parse(fits).model == "m" * MODEL_MAX
    assert parse(fits.decode()).model == "m" * MODEL_MAX
    with pytest.raises(ValueError):
        parse(fits + b" ")
    with pytest.raises(ValueError):
        parse(fits.decode() + " ")


@pytest.mark.parametrize("fields", [
    {"cap": CAP.upper()}, {"cap": CAP[:-1]}, {"cap": 5}, {"rights": "w"},
    {"tokens": -1}, {"tokens": MAX_COUNT + 1}, {"pages": 1.0}, {"pages": True},
    {"model": " padded"}, {"model": "two\nlines"}, {"model": "nel\x85"},
    {"model": "m" * (MODEL_MAX + 1)}, {"model": "\ud800"},
])
def test_an_invalid_descriptor_cannot_be_made(fields):
    with pytest.raises(ValueError):
        Descriptor(**{"cap": CAP, **fields})


def test_random_bytes_never_raise_anything_but_value_error():
    import random
    rng = random.Random(5)
    good = Descriptor(CAP, "rw", 3, 1, "m").encode()
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            data[i] = rng.randrange(256)
        try:
            d = parse(bytes(data))
        except ValueError:
            continue
        assert isinstance(d, Descriptor) and len(d.cap) == 32


# ---------------------------------------------------------------- properties

descriptors = st.builds(
    Descriptor,
    cap=st.text("0123456789abcdef", min_size=32, max_size=32),
    rights=st.sampled_from(["r", "rw"]),
    tokens=st.integers(0, MAX_COUNT),
    pages=st.integers(0, MAX_COUNT),
    model=st.text(st.characters(codec="utf-8"), max_size=MODEL_MAX // 4).map(str.strip)
    .filter(lambda m: m.isprintable()),
)


@settings(max_examples=500, deadline=None)
@given(descriptors)
def test_every_valid_descriptor_round_trips(d):
    assert len(d.encode()) <= MAX_LEN
    assert parse(d.encode()) == d
    assert parse(d.render()) == d
    assert parse(bytearray(d.encode())) == d


def _parse_or_value_error(data):
    try:
        d = parse(data)
    except ValueError:
        return None
    # Whatever parses is a valid descriptor that round-trips.
    assert isinstance(d, Descriptor) and parse(d.encode()) == d
    return d


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=MAX_LEN + 64))
@example(b"kvfs 1\ncap " + CAP.encode() + b"\ntokens " + b"1" * 5000)
@example(b"kvfs 1\x85cap " + CAP.encode())
@example(b"kvfs 1\ncap " + CAP.encode() + b"\nmodel \xed\xa0\x80")     # a surrogate
def test_arbitrary_bytes_raise_only_value_error(data):
    _parse_or_value_error(data)


@settings(max_examples=1000, deadline=None)
@given(st.text(max_size=600))
def test_arbitrary_text_raises_only_value_error(text):
    _parse_or_value_error(text)
    _parse_or_value_error(f"{MAGIC}\ncap {CAP}\n{text}")


@settings(max_examples=1000, deadline=None)
@given(descriptors, st.data())
def test_mutated_descriptors_raise_only_value_error(d, data):
    raw = bytearray(d.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    _parse_or_value_error(bytes(raw))


@given(st.one_of(st.none(), st.integers(), st.lists(st.integers()), st.floats()))
def test_non_text_input_is_a_value_error(value):
    with pytest.raises(ValueError):
        parse(value)


def test_replica_line_is_optional_and_round_trips():
    d = Descriptor(CAP, "rw", 3, 1, "m", "ipc:///run/symphony/predd-1.sock")
    assert d.render().endswith("model m\nreplica ipc:///run/symphony/predd-1.sock\n")
    assert parse(d.encode()) == d
    assert parse(Descriptor(CAP, "r", 3, 1, "m").encode()).replica == ""
    assert parse(f"kvfs 1\ncap {CAP}\nreplica tcp://10.0.0.2:5555\n").replica == \
        "tcp://10.0.0.2:5555"


@pytest.mark.parametrize("replica", ["predd.sock", "http://h:1", "ipc://", "ipc://a b",
                                     "tcp://h\x00", "ipc://" + "x" * 251, "ipc://é"])
def test_replica_must_be_an_address(replica):
    with pytest.raises(ValueError):
        Descriptor(CAP, replica=replica)
    with pytest.raises(ValueError):
        parse(f"kvfs 1\ncap {CAP}\nreplica {replica}\n")
