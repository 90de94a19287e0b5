"""KV objects: export and import (round trips, another page size or model, every kind of
garbage refused with the pages untouched)."""
from __future__ import annotations

import struct
import zlib

import msgpack
import numpy as np
import pytest

from symphony_protocol import ProtocolError
from predd.memory.kvstore import EXPORT_MAGIC, KVStore
from predd.memory.pool import Pool
from predd.server.request_limits import MAX_POSITION
from tests.unit.predd.kvstore_world import (FakePages, World, LAYERS, HEADS, DIM, VOCAB,
                                            MAX_LENGTH)


# ---------------------------------------------------------------- export / import

def test_export_import_round_trip():
    w = World(num_pages=16, page_size=4)
    a = w.filled(6, positions=[10, 11, 12, 20, 21, 22])
    blob = w.store.export(a)
    assert blob.startswith(EXPORT_MAGIC)
    (head_len,) = struct.unpack_from("<I", blob, len(EXPORT_MAGIC))
    meta = msgpack.unpackb(blob[len(EXPORT_MAGIC) + 4:len(EXPORT_MAGIC) + 4 + head_len])
    assert meta["length"] == 6 and meta["shape"] == [LAYERS, 2, 6, HEADS, DIM]
    assert meta["tokens"] == w.want[a][0] and meta["positions"] == [10, 11, 12, 20, 21, 22]
    assert meta["model"] == "fake"
    body = LAYERS * 2 * 6 * HEADS * DIM * 4
    assert len(blob) == len(EXPORT_MAGIC) + 4 + head_len + body + 4
    assert struct.unpack('<I', blob[-4:])[0] == zlib.crc32(blob[:-4])

    i = w.import_(blob).oid
    w.want[i] = (list(w.want[a][0]), list(w.want[a][1]))
    assert w.page_list(i) == [2, 3] and w.pool.free_pages == 12
    assert w.store.last_position(w.obj(i)) == 22
    w.verify()
    # into a fresh store too
    w2 = World(num_pages=4, page_size=4)
    j = w2.import_(blob).oid
    w2.want[j] = (list(w.want[a][0]), list(w.want[a][1]))
    assert w2.page_list(j) == [0, 1]
    w2.verify()


def test_export_import_with_another_page_size():
    w = World(num_pages=8, page_size=4)
    a = w.filled(7)
    blob = w.store.export(a)
    w2 = World(num_pages=8, page_size=16)
    j = w2.import_(blob).oid
    w2.want[j] = (list(w.want[a][0]), list(w.want[a][1]))
    assert w2.page_list(j) == [0]
    w2.verify()


def test_export_import_empty_object():
    w = World(num_pages=4, page_size=4)
    a = w.create()
    i = w.import_(w.store.export(a)).oid
    w.want[i] = ([], [])
    assert w.page_list(i) == []
    w.verify()


def test_import_for_another_model_is_einval():
    other = World(num_pages=4, page_size=4)
    other.pages.model = "other"
    blob = other.store.export(other.filled(3))
    w = World(num_pages=4, page_size=4)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "EINVAL" and "model" in err.value.message
    assert w.same(snap) and w.store.objects == {}


class Bf16Pages(FakePages):
    """FakePages of a bfloat16 pool (its values' raw bits, as PagedKVCache reads them)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.kv = np.zeros(self.kv.shape, np.uint16)

    def describe(self):
        return {**super().describe(), "dtype": "bfloat16", "numpy_dtype": "uint16"}


def test_import_converts_between_float32_and_bfloat16_entries():
    """A float32 export into a bfloat16 pool is rounded as torch rounds (to nearest even;
    a float32 model's `--kv-dtype bfloat16`), and back it is widened exactly; a value
    beyond bfloat16's range is EINVAL with nothing taken."""
    import torch
    src = World(num_pages=4, page_size=4)
    a = src.filled(3)
    slots = src.store.slots(src.obj(a))
    # ties to even both ways, a value between two bf16 steps, a float32 denormal
    src.pages.kv[0, 0, slots[0], 0, :] = [1.00390625, 1.01171875, -3.0000002, 1e-40]
    pages = Bf16Pages(4, 4)
    store = KVStore(Pool(4, 4), pages)
    b = store.import_(src.store.export(a), VOCAB, MAX_LENGTH)
    got = pages.read_slots(store.slots(b))
    want = torch.from_numpy(src.pages.read_slots(slots)).to(torch.bfloat16)
    assert np.array_equal(got, want.view(torch.uint16).numpy())
    assert got[0, 0, 0, 0].tolist() == [0x3F80, 0x3F82, 0xC040, 0x0001]
    assert store.entries(b.oid)[0].tolist() == src.want[a][0]

    back = World(num_pages=4, page_size=4)
    c = back.import_(store.export(b.oid)).oid
    assert np.array_equal(back.pages.read_slots(back.store.slots(back.obj(c))),
                          want.float().numpy())

    src.pages.kv[1, 1, slots[2], 0, 3] = 3.4e38          # rounds past bf16's largest
    with pytest.raises(ProtocolError) as err:
        store.import_(src.store.export(a), VOCAB, MAX_LENGTH)
    assert err.value.code == "EINVAL" and "beyond bfloat16's range" in err.value.message
    assert store.pool.free_pages == 3 and len(store.objects) == 1


def seal(unsealed: bytes) -> bytes:
    """An export with a valid checksum around whatever `unsealed` holds."""
    return unsealed + struct.pack("<I", zlib.crc32(unsealed))


def corrupt_blobs(blob: bytes) -> dict[str, bytes]:
    """Damaged exports; all but the first few carry a valid checksum, so that each one
    reaches the check it is about."""
    at = len(EXPORT_MAGIC)
    (head_len,) = struct.unpack_from("<I", blob, at)
    meta = msgpack.unpackb(blob[at + 4:at + 4 + head_len])
    body = blob[at + 4 + head_len:-4]
    n = meta["length"]

    def rebuild(m, data=body):
        head = msgpack.packb(m)
        return seal(EXPORT_MAGIC + struct.pack("<I", len(head)) + head + data)

    def kv_with(value: float) -> bytes:
        kv = np.frombuffer(body, np.float32).copy()
        kv[len(kv) // 2] = value
        return kv.tobytes()

    return {
        "empty": b"",
        "garbage": b"not a kv export at all",
        "magic only": EXPORT_MAGIC,
        "short length": EXPORT_MAGIC + b"\x01\x00",
        "old format": b"SYKV1\n" + blob[at:-4],
        "checksum wrong": blob[:-4] + struct.pack("<I", zlib.crc32(blob[:-4]) ^ 1),
        "truncated": blob[:-1],
        "flipped header byte": blob[:at + 6] + bytes([blob[at + 6] ^ 0x20]) + blob[at + 7:],
        "flipped K/V byte": blob[:-9] + bytes([blob[-9] ^ 1]) + blob[-8:],
        "huge head": seal(EXPORT_MAGIC + struct.pack("<I", 1 << 30) + blob[at + 4:-4]),
        "zero head": seal(EXPORT_MAGIC + struct.pack("<I", 0) + blob[at + 4:-4]),
        "head not msgpack": seal(EXPORT_MAGIC + struct.pack("<I", 3) + b"\xc1\xc1\xc1" + body),
        "head not a map": rebuild([1, 2, 3]),
        "no length": rebuild({k: v for k, v in meta.items() if k != "length"}),
        "length not an int": rebuild({**meta, "length": float(n)}),
        "length a bool": rebuild({**meta, "length": True}),
        "length negative": rebuild({**meta, "length": -1}),
        "no shape": rebuild({k: v for k, v in meta.items() if k != "shape"}),
        "length mismatch": rebuild({**meta, "length": n + 1}),
        "tokens short": rebuild({**meta, "tokens": meta["tokens"][:-1]}),
        "tokens not ints": rebuild({**meta, "tokens": [0.5] * n}),
        "tokens bools": rebuild({**meta, "tokens": [True] * n}),
        "tokens not a list": rebuild({**meta, "tokens": b"\x01" * n}),
        "positions short": rebuild({**meta, "positions": meta["positions"][:-1]}),
        "shape mismatch": rebuild({**meta, "shape": [LAYERS, 2, 4, HEADS, DIM]}),
        # Same number of elements but another geometry: once, this reserved pages and
        # then failed to write them (a leak).
        "shape of another geometry": rebuild(
            {**meta, "shape": [LAYERS, 2, n, HEADS, DIM * 2]}, body + body),
        "shape reordered": rebuild({**meta, "shape": [LAYERS, 2, HEADS, n, DIM]}),
        "data short by a row": rebuild(meta, body[:-4 * DIM]),
        "data extra": rebuild(meta, body + b"\0" * 4),
        "token too big": rebuild({**meta, "tokens": [1 << 40] + meta["tokens"][1:]}),
        "token past the vocabulary": rebuild({**meta, "tokens": [VOCAB] + meta["tokens"][1:]}),
        "token negative": rebuild({**meta, "tokens": [-1] + meta["tokens"][1:]}),
        "position negative": rebuild({**meta, "positions": [-1] + meta["positions"][1:]}),
        "position past int32": rebuild(
            {**meta, "positions": [MAX_POSITION] + meta["positions"][1:]}),
        "NaN K/V": rebuild(meta, kv_with(float("nan"))),
        "infinite K/V": rebuild(meta, kv_with(float("inf"))),
        "dtype": rebuild({**meta, "dtype": "float16"}),
        "bfloat16 named, float32 sent": rebuild({**meta, "dtype": "bfloat16"}),
        "bfloat16's bits named, float32 sent": rebuild(
            {**meta, "dtype": "bfloat16", "numpy_dtype": "uint16"}),
        "dtype a list": rebuild({**meta, "dtype": ["bfloat16"]}),
        "model": rebuild({**meta, "model": "other"}),
        "layers": rebuild({**meta, "layers": LAYERS + 1}),
        "head_dim": rebuild({**meta, "head_dim": DIM * 2}),
    }


def _case_names() -> list[str]:
    w = World()
    return list(corrupt_blobs(w.store.export(w.filled(3))))


NOT_AN_EXPORT = "not a Symphony KV export"
CHECKSUM = "checksum mismatch"
LENGTH, SHAPE = "corrupt KV export: length", "corrupt KV export: shape"
K_V_SIZE, NON_FINITE = "bytes of K/V, expected", "NaN or infinite K/V"
# What the EINVAL message of each damaged export names.
EXPECTED_MESSAGE = {
    "empty": NOT_AN_EXPORT, "garbage": NOT_AN_EXPORT, "magic only": NOT_AN_EXPORT,
    "short length": NOT_AN_EXPORT, "old format": NOT_AN_EXPORT,
    "checksum wrong": CHECKSUM, "truncated": CHECKSUM, "flipped header byte": CHECKSUM,
    "flipped K/V byte": CHECKSUM,
    "huge head": "a header of", "zero head": "header is not msgpack",
    "head not msgpack": "header is not msgpack", "head not a map": "header is not a map",
    "no length": LENGTH, "length not an int": LENGTH, "length a bool": LENGTH,
    "length negative": LENGTH,
    "no shape": SHAPE, "length mismatch": SHAPE, "shape mismatch": SHAPE,
    "shape of another geometry": SHAPE, "shape reordered": SHAPE,
    "tokens short": "tokens: expected a list of 3",
    "tokens not a list": "tokens: expected a list of 3",
    "tokens not ints": "tokens: expected integers", "tokens bools": "tokens: expected integers",
    "positions short": "positions: expected a list of 3",
    "data short by a row": K_V_SIZE, "data extra": K_V_SIZE,
    "token too big": "tokens: out of range [0, 65536)",
    "token past the vocabulary": "tokens: out of range [0, 65536)",
    "token negative": "tokens: out of range [0, 65536)",
    "position negative": f"positions: out of range [0, {MAX_POSITION})",
    "position past int32": f"positions: out of range [0, {MAX_POSITION})",
    "NaN K/V": NON_FINITE, "infinite K/V": NON_FINITE,
    "dtype": "export is for dtype='float16', this predd has 'float32'",
    "bfloat16 named, float32 sent": "export is for dtype='bfloat16', this predd has 'float32'",
    "bfloat16's bits named, float32 sent": K_V_SIZE,
    "dtype a list": "export is for dtype=['bfloat16'], this predd has 'float32'",
    "model": "export is for model='other', this predd has 'fake'",
    "layers": "export is for layers=3", "head_dim": "export is for head_dim=8",
}


@pytest.mark.parametrize("case", _case_names())
def test_import_garbage_is_einval_and_changes_nothing(case):
    src = World(num_pages=4, page_size=4)
    blob = corrupt_blobs(src.store.export(src.filled(3)))[case]
    w = World(num_pages=4, page_size=4)
    keep = w.filled(2)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "EINVAL", case
    assert EXPECTED_MESSAGE[case] in err.value.message, (case, err.value.message)
    assert w.same(snap) and set(w.store.objects) == {keep} and w.pool.free_pages == 3
    w.verify()


def test_import_longer_than_the_limit_is_e2big_and_changes_nothing():
    src = World(num_pages=8, page_size=4)
    blob = src.store.export(src.filled(5))
    w = World(num_pages=8, page_size=4)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.store.import_(blob, VOCAB, 4)
    assert (err.value.code, err.value.message) == (
        "E2BIG", "export of 5 entries: more than the limit of 4")
    assert w.same(snap) and w.store.objects == {} and w.pool.free_pages == 8
    i = w.store.import_(blob, VOCAB, 5).oid                 # exactly at the limit
    w.want[i] = (list(src.want[1][0]), list(src.want[1][1]))
    w.verify()


def test_import_whose_write_fails_takes_no_page():
    """Defence in depth: if writing K/V fails after the pages are reserved, the new
    object is freed again (an exception from the cache, not a bad blob)."""
    src = World(num_pages=8, page_size=4)
    blob = src.store.export(src.filled(6))
    w = World(num_pages=8, page_size=4)

    def broken(slots, data):
        raise RuntimeError("device lost")

    w.pages.write_slots = broken
    with pytest.raises(RuntimeError):
        w.import_(blob)
    assert w.store.objects == {} and w.pool.free_pages == 8
    assert w.store.check() == []


def test_import_enospc_changes_nothing():
    src = World(num_pages=8, page_size=4)
    blob = src.store.export(src.filled(9))          # needs 3 pages
    w = World(num_pages=4, page_size=4)
    keep = w.filled(5)                              # 2 pages used, 2 free
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "ENOSPC"
    assert w.same(snap) and set(w.store.objects) == {keep}
    w.verify()
