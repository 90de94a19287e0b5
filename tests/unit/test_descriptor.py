"""The `.kv` descriptor: render/parse round trip; anything else is a ValueError."""
from __future__ import annotations

import pytest

from liblip.descriptor import MAGIC, MAX_LEN, Descriptor, parse

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
    head = f"{MAGIC}\ncap {CAP}\nmodel ".encode()
    fits = head + b"m" * (MAX_LEN - len(head))
    assert len(fits) == MAX_LEN
    assert parse(fits).model == "m" * (MAX_LEN - len(head))
    with pytest.raises(ValueError):
        parse(fits + b"m")


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
