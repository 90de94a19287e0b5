"""A world for the KV store's tests: a page pool and a KVStore over `FakePages`, which
stands in for the runner's cache: it holds a K/V vector per flat slot, and every entry's
vector spells out (token, position, layer, K-or-V), so a test can see exactly which
entry's data sits in which slot after copies, CoW, extract and merge.
"""
from __future__ import annotations

import itertools

import numpy as np

from predd.memory.kvstore import KVStore
from predd.memory.pool import Pool

LAYERS, HEADS, DIM = 2, 1, 4
VOCAB, MAX_LENGTH = 1 << 16, 1 << 12   # what import_ accepts here


class FakePages:
    """PageData over a numpy array [layers, 2, slots, heads, dim]; records copies."""

    def __init__(self, num_pages: int, page_size: int, model: str = "fake") -> None:
        self.kv = np.full((LAYERS, 2, num_pages * page_size, HEADS, DIM), -1.0, np.float32)
        self.copies: list[tuple[list[int], list[int]]] = []
        self.model = model

    def copy_slots(self, src, dst):
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        assert len(src) == len(dst)
        self.copies.append((src.tolist(), dst.tolist()))
        self.kv[:, :, dst] = self.kv[:, :, src]

    def read_slots(self, slots):
        return self.kv[:, :, np.asarray(slots, np.int64)].copy()

    def write_slots(self, slots, data):
        slots = np.asarray(slots, np.int64)
        self.kv[:, :, slots] = np.asarray(data).reshape(LAYERS, 2, len(slots), HEADS, DIM)

    def describe(self):
        return {"model": self.model, "dtype": "float32", "numpy_dtype": "float32",
                "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM}


def payload(tokens, positions) -> np.ndarray:
    """The K/V [layers, 2, n, heads, dim] that entry (token, position) carries."""
    tokens = np.asarray(tokens, np.float32)
    positions = np.asarray(positions, np.float32)
    n = len(tokens)
    out = np.zeros((LAYERS, 2, n, HEADS, DIM), np.float32)
    out[..., 0] = tokens[None, None, :, None]
    out[..., 1] = positions[None, None, :, None]
    out[..., 2] = np.arange(LAYERS, dtype=np.float32)[:, None, None, None]
    out[..., 3] = np.arange(2, dtype=np.float32)[None, :, None, None]
    return out


class World:
    """A store plus a model of what every object must hold; `verify` compares them."""

    def __init__(self, num_pages: int = 16, page_size: int = 4) -> None:
        self.pool = Pool(num_pages, page_size)
        self.pages = FakePages(num_pages, page_size)
        self.store = KVStore(self.pool, self.pages)
        self.want: dict[int, tuple[list[int], list[int]]] = {}
        self._tokens = itertools.count(100)

    # operations that keep the model in step
    def create(self) -> int:
        oid = self.store.create().oid
        self.want[oid] = ([], [])
        return oid

    def append(self, oid: int, n: int, positions=None) -> list[int]:
        tokens = [next(self._tokens) for _ in range(n)]
        if positions is None:
            first = self.store.last_position(self.store.get(oid)) + 1
            positions = list(range(first, first + n))
        slots = self.store.reserve(oid, n)
        self.pages.write_slots(slots, payload(tokens, positions))
        self.store.commit(oid, np.asarray(tokens), np.asarray(positions))
        self.want[oid][0].extend(tokens)
        self.want[oid][1].extend(positions)
        return slots.tolist()

    def import_(self, blob: bytes):
        return self.store.import_(blob, VOCAB, MAX_LENGTH)

    def filled(self, n: int, positions=None) -> int:
        oid = self.create()
        if n:
            self.append(oid, n, positions)
        return oid

    def fork(self, oid: int) -> int:
        new = self.store.fork(oid).oid
        self.want[new] = (list(self.want[oid][0]), list(self.want[oid][1]))
        return new

    def extract(self, oid: int, ranges) -> int:
        new = self.store.extract(oid, ranges).oid
        toks, pos = self.want[oid]
        self.want[new] = ([t for a, b in ranges for t in toks[a:b]],
                          [p for a, b in ranges for p in pos[a:b]])
        return new

    def merge(self, oids) -> int:
        new = self.store.merge(oids).oid
        self.want[new] = ([t for o in oids for t in self.want[o][0]],
                          [p for o in oids for p in self.want[o][1]])
        return new

    def truncate(self, oid: int, length: int) -> None:
        self.store.truncate(oid, length)
        del self.want[oid][0][length:]
        del self.want[oid][1][length:]

    def free(self, oid: int) -> None:
        self.store.free(oid)
        del self.want[oid]

    # views
    def obj(self, oid: int):
        return self.store.get(oid)

    def page_list(self, oid: int) -> list[int]:
        return list(self.store.get(oid).pages)

    def refs(self, n: int | None = None) -> list[int]:
        rc = self.pool.refcount.tolist()
        return rc if n is None else rc[:n]

    def snapshot(self):
        objs = {o.oid: (list(o.pages), o.length, o.reserved) for o in self.store.objects.values()}
        return (objs, self.pool.refcount.tolist(), list(self.pool._free),
                self.pool.token_ids.tolist(), self.pool.positions.tolist(),
                self.pages.kv.copy(), len(self.pages.copies))

    def same(self, snap) -> bool:
        now = self.snapshot()
        return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                   for a, b in zip(snap, now))

    def verify(self) -> None:
        assert self.store.check() == []
        assert set(self.store.objects) == set(self.want)
        for oid, (toks, pos) in self.want.items():
            obj = self.store.get(oid)
            assert obj.length == len(toks)
            got_t, got_p = self.store.entries(oid)
            assert got_t.tolist() == toks, f"object {oid} tokens"
            assert got_p.tolist() == pos, f"object {oid} positions"
            kv = self.pages.read_slots(self.store.slots(obj))
            assert np.array_equal(kv, payload(toks, pos)), f"object {oid} K/V"
            assert self.store.last_position(obj) == (pos[-1] if pos else -1)


def pstr(ps: int, page: int, slots) -> list[int]:
    """Flat slot ids of `slots` in `page`."""
    return [page * ps + s for s in slots]
