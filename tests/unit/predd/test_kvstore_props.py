"""Property tests of the export format over the unit-level KV store (FakePages):
export -> import round-trips bit-exact, and any damage is EINVAL with no page taken."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symphony_protocol import ProtocolError
from predd.memory.kvstore import EXPORT_MAGIC
from tests.unit.predd.kvstore_world import DIM, HEADS, LAYERS, World

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def objects(draw) -> tuple[World, int]:
    """A store holding a random object built by appends, forks, truncations and merges,
    its K/V overwritten with arbitrary finite float32 values (negative zero and
    subnormals included)."""
    w = World(num_pages=64, page_size=draw(st.sampled_from([1, 2, 4, 16])))
    oid = w.create()
    for _ in range(draw(st.integers(0, 5))):
        step = draw(st.sampled_from(["append", "append", "fork", "truncate", "merge"]))
        n = w.obj(oid).length
        if step == "append":
            k = draw(st.integers(1, 9))
            first = draw(st.integers(0, 2**31 - 1 - k))
            w.append(oid, k, positions=list(range(first, first + k)))
        elif step == "fork":
            oid = w.fork(oid)
        elif step == "truncate":
            w.truncate(oid, draw(st.integers(0, n)))
        elif n and n * 2 <= 40:
            oid = w.merge([oid, oid])
    n = w.obj(oid).length
    kv = draw(st.lists(finite_f32, min_size=n * LAYERS * 2 * HEADS * DIM,
                       max_size=n * LAYERS * 2 * HEADS * DIM))
    w.pages.write_slots(w.store.slots(w.obj(oid)),
                        np.asarray(kv, np.float32).reshape(LAYERS, 2, n, HEADS, DIM))
    return w, oid


def head_end(blob: bytes) -> int:
    (head_len,) = struct.unpack_from("<I", blob, len(EXPORT_MAGIC))
    return len(EXPORT_MAGIC) + 4 + head_len


@SETTINGS
@given(objects(), st.sampled_from([1, 3, 4, 16]))
def test_export_import_round_trips_bit_exact(world, page_size):
    w, oid = world
    blob = w.store.export(oid)
    tokens, positions = w.store.entries(oid)
    kv = w.pages.read_slots(w.store.slots(w.obj(oid)))
    into = World(num_pages=64, page_size=page_size)
    new = into.import_(blob).oid
    t2, p2 = into.store.entries(new)
    assert t2.tolist() == tokens.tolist() and p2.tolist() == positions.tolist()
    assert into.pages.read_slots(into.store.slots(into.obj(new))).tobytes() == kv.tobytes()
    assert into.store.export(new) == blob                  # the bytes, exactly
    assert into.store.check() == []


def assert_refused_and_nothing_taken(w: World, blob: bytes) -> None:
    snap = w.snapshot()
    objects_before = set(w.store.objects)
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "EINVAL"
    assert w.same(snap) and set(w.store.objects) == objects_before
    assert w.store.check() == []


@SETTINGS
@given(objects(), st.data())
def test_a_truncated_export_is_einval_and_takes_no_page(world, data):
    w, oid = world
    blob = w.store.export(oid)
    cut = data.draw(st.integers(0, len(blob) - 1))
    assert_refused_and_nothing_taken(w, blob[:cut])


@SETTINGS
@given(objects(), st.data())
def test_flipped_header_bytes_are_einval_and_take_no_page(world, data):
    w, oid = world
    blob = bytearray(w.store.export(oid))
    end = head_end(bytes(blob))
    where = data.draw(st.lists(st.integers(0, end - 1), min_size=1, max_size=4, unique=True))
    for i in where:
        blob[i] ^= data.draw(st.integers(1, 255))
    assert_refused_and_nothing_taken(w, bytes(blob))


@SETTINGS
@given(objects(), st.data())
def test_any_flipped_byte_is_einval_and_takes_no_page(world, data):
    w, oid = world
    blob = bytearray(w.store.export(oid))
    i = data.draw(st.integers(0, len(blob) - 1))
    blob[i] ^= 1 << data.draw(st.integers(0, 7))
    assert_refused_and_nothing_taken(w, bytes(blob))


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_einval(blob):
    w = World(num_pages=8, page_size=4)
    w.filled(5)
    assert_refused_and_nothing_taken(w, blob)
    assert_refused_and_nothing_taken(w, EXPORT_MAGIC + blob)
