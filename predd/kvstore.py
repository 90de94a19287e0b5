"""KV objects: ordered entries (token, position, K/V) stored in a list of pool pages.

Lifetime rules (checked by `check`):
* An object's page list covers its `length` entries plus `reserved` slots that an
  in-flight call will write; entry i lives in slot i % page_size of pages[i // page_size].
* Every listing of a page in an object's list holds one pool reference (a merge of an
  object with itself lists its whole pages twice, and holds two references).
* An object writes only into slots at or past its length. Before the first write past
  a partially filled last page that other objects also hold, the page is copied
  (copy-on-write), so a fork never sees another object's later entries.
* fork shares every page (O(pages), no tensor copy); extract and merge share whole,
  aligned pages and copy the rest; free drops the object's references.
Every change of a live object's page-list length is reported to `on_resize(oid,
delta)` (the quota counters follow it). The K/V tensors are not here: `PageData` (the runner's cache) copies, reads and writes
slots, addressed as flat slot ids `page * page_size + slot`.
"""
from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgpack
import numpy as np

from liblip.protocol import ProtocolError
from predd.pool import Pool

EXPORT_MAGIC = b"SYKV1\n"


class PageData(Protocol):
    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None: ...
    def read_slots(self, slots: np.ndarray) -> np.ndarray: ...   # [layers, 2, n, Hkv, D]
    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None: ...
    def describe(self) -> dict: ...   # model name, dtype, layer/head shape: checked on import


@dataclass
class KVObject:
    oid: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    reserved: int = 0


class KVStore:
    def __init__(self, pool: Pool, data: PageData,
                 on_resize: Callable[[int, int], None] = lambda oid, delta: None) -> None:
        self.pool = pool
        self.data = data
        self.on_resize = on_resize
        self.objects: dict[int, KVObject] = {}
        self._next_oid = itertools.count(1)

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def get(self, oid: int) -> KVObject:
        obj = self.objects.get(oid)
        if obj is None:
            raise ProtocolError("ENOENT", f"KV object {oid} does not exist")
        return obj

    def _new(self, pages: list[int], length: int) -> KVObject:
        obj = KVObject(next(self._next_oid), pages, length)
        self.objects[obj.oid] = obj
        return obj

    # ------------------------------------------------------------ lifecycle

    def create(self) -> KVObject:
        return self._new([], 0)

    def fork(self, oid: int) -> KVObject:
        src = self.get(oid)
        pages = src.pages[: self._pages_for(src.length)]
        self.pool.incref(pages)
        return self._new(list(pages), src.length)

    def free(self, oid: int) -> None:
        obj = self.objects.pop(oid)
        self.pool.decref(obj.pages)
        self.on_resize(oid, -len(obj.pages))

    def truncate(self, oid: int, length: int) -> None:
        obj = self.get(oid)
        assert obj.reserved == 0, "truncate with a call in flight"
        if not 0 <= length <= obj.length:
            raise ProtocolError("EINVAL", f"truncate to {length}: object has {obj.length} entries")
        keep = self._pages_for(length)
        dropped = len(obj.pages) - keep
        self.pool.decref(obj.pages[keep:])
        del obj.pages[keep:]
        obj.length = length
        self.on_resize(oid, -dropped)

    # ------------------------------------------------------------ writing

    def reserve(self, oid: int, n: int) -> np.ndarray:
        """Room for n more entries after those already reserved; their flat slot ids.

        All or nothing: on ENOSPC the object is unchanged.
        """
        obj = self.get(oid)
        start = obj.length + obj.reserved
        ps = self.page_size
        cow = self._needs_copy(obj)
        fresh = self.pool.alloc(self.pages_needed(oid, n))
        if cow:
            old = obj.pages[start // ps]
            new = fresh.pop()
            filled = start % ps
            self.data.copy_slots(old * ps + np.arange(filled), new * ps + np.arange(filled))
            self.pool.token_ids[new, :filled] = self.pool.token_ids[old, :filled]
            self.pool.positions[new, :filled] = self.pool.positions[old, :filled]
            obj.pages[start // ps] = new
            self.pool.decref([old])
        obj.pages.extend(fresh)
        obj.reserved += n
        self.on_resize(oid, len(fresh))
        return self.slots(obj, start, start + n)

    def _needs_copy(self, obj: KVObject) -> bool:
        """Whether the next write lands in a partial last page other objects hold."""
        start = obj.length + obj.reserved
        ps = self.page_size
        return (obj.reserved == 0 and start % ps != 0
                and self.pool.refcount[obj.pages[start // ps]] > 1)

    def pages_needed(self, oid: int, n: int) -> int:
        """Fresh pages `reserve(oid, n)` would take (copy-on-write included)."""
        obj = self.get(oid)
        grow = self._pages_for(obj.length + obj.reserved + n) - len(obj.pages)
        return max(grow, 0) + int(self._needs_copy(obj))

    def commit(self, oid: int, tokens: np.ndarray, positions: np.ndarray) -> None:
        """The next len(tokens) reserved slots now hold K/V: make them entries."""
        obj = self.get(oid)
        n = len(tokens)
        assert n <= obj.reserved, "commit past reservation"
        slots = self.slots(obj, obj.length, obj.length + n)
        ps = self.page_size
        self.pool.token_ids[slots // ps, slots % ps] = tokens
        self.pool.positions[slots // ps, slots % ps] = positions
        obj.length += n
        obj.reserved -= n

    def release_reservation(self, oid: int) -> None:
        obj = self.objects.get(oid)
        if obj is None or obj.reserved == 0:
            return
        obj.reserved = 0
        keep = self._pages_for(obj.length)
        dropped = len(obj.pages) - keep
        self.pool.decref(obj.pages[keep:])
        del obj.pages[keep:]
        self.on_resize(oid, -dropped)

    # ------------------------------------------------------------ reading

    def slots(self, obj: KVObject, start: int = 0, end: int | None = None) -> np.ndarray:
        end = obj.length if end is None else end
        idx = np.arange(start, end)
        ps = self.page_size
        return np.asarray(obj.pages, dtype=np.int64)[idx // ps] * ps + idx % ps

    def entries(self, oid: int, start: int = 0, end: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, positions) of entries [start, end)."""
        obj = self.get(oid)
        end = obj.length if end is None else end
        if not 0 <= start <= end <= obj.length:
            raise ProtocolError("EINVAL", f"range [{start}, {end}) outside 0..{obj.length}")
        slots = self.slots(obj, start, end)
        ps = self.page_size
        return (self.pool.token_ids[slots // ps, slots % ps].copy(),
                self.pool.positions[slots // ps, slots % ps].copy())

    def last_position(self, obj: KVObject) -> int:
        if obj.length == 0:
            return -1
        i = obj.length - 1
        ps = self.page_size
        return int(self.pool.positions[obj.pages[i // ps], i % ps])

    # ------------------------------------------------------------ extract / merge

    def extract(self, oid: int, ranges: list[list[int]]) -> KVObject:
        obj = self.get(oid)
        parts = []
        for r in ranges:
            if len(r) != 2 or not 0 <= r[0] <= r[1] <= obj.length:
                raise ProtocolError("EINVAL", f"range {r} outside [0, {obj.length}]")
            parts.append(self.slots(obj, r[0], r[1]))
        return self._assemble(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def merge(self, oids: list[int]) -> KVObject:
        objs = [self.get(oid) for oid in oids]
        parts = [self.slots(o) for o in objs]
        return self._assemble(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def _assemble(self, src: np.ndarray) -> KVObject:
        """A new object whose entries are the slots `src`, in order."""
        ps = self.page_size
        n = len(src)
        chunks = [src[i:i + ps] for i in range(0, n, ps)]
        whole = [len(c) == ps and c[0] % ps == 0 and np.all(np.diff(c) == 1) for c in chunks]
        fresh = self.pool.alloc(sum(1 for w in whole if not w))
        pages, copy_src, copy_dst = [], [], []
        for chunk, is_whole in zip(chunks, whole):
            if is_whole:
                page = int(chunk[0] // ps)
                self.pool.incref([page])
            else:
                page = fresh.pop()
                copy_src.append(chunk)
                copy_dst.append(page * ps + np.arange(len(chunk)))
            pages.append(page)
        if copy_src:
            s, d = np.concatenate(copy_src), np.concatenate(copy_dst)
            self.data.copy_slots(s, d)
            self.pool.token_ids[d // ps, d % ps] = self.pool.token_ids[s // ps, s % ps]
            self.pool.positions[d // ps, d % ps] = self.pool.positions[s // ps, s % ps]
        return self._new(pages, n)

    # ------------------------------------------------------------ export / import

    def export(self, oid: int) -> bytes:
        obj = self.get(oid)
        slots = self.slots(obj)
        tokens, positions = self.entries(oid)
        kv = np.ascontiguousarray(self.data.read_slots(slots))
        meta = {**self.data.describe(), "length": obj.length, "shape": list(kv.shape),
                "tokens": tokens.tolist(), "positions": positions.tolist()}
        head = msgpack.packb(meta)
        return EXPORT_MAGIC + struct.pack("<I", len(head)) + head + kv.tobytes()

    def import_(self, blob: bytes) -> KVObject:
        if not blob.startswith(EXPORT_MAGIC) or len(blob) < len(EXPORT_MAGIC) + 4:
            raise ProtocolError("EINVAL", "not a Symphony KV export")
        at = len(EXPORT_MAGIC)
        (head_len,) = struct.unpack_from("<I", blob, at)
        try:
            meta = msgpack.unpackb(blob[at + 4: at + 4 + head_len])
            mine = self.data.describe()
            for key, value in mine.items():
                if meta.get(key) != value:
                    raise ProtocolError("EINVAL", f"export is for {key}={meta.get(key)!r}, "
                                        f"this predd has {value!r}")
            n = int(meta["length"])
            shape = tuple(meta["shape"])
            dtype = np.dtype(mine["numpy_dtype"])
            kv = np.frombuffer(blob, dtype=dtype, offset=at + 4 + head_len).reshape(shape)
            tokens = np.asarray(meta["tokens"], np.int32)
            positions = np.asarray(meta["positions"], np.int32)
            if len(tokens) != n or len(positions) != n or shape[2] != n:
                raise ValueError("length mismatch")
            if n and (tokens.min() < 0 or positions.min() < 0):
                raise ValueError("negative token id or position")
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError("EINVAL", f"corrupt KV export: {exc}") from None
        obj = self._new([], 0)
        try:
            slots = self.reserve(obj.oid, n)
        except ProtocolError:
            self.free(obj.oid)
            raise
        self.data.write_slots(slots, kv)
        self.commit(obj.oid, tokens, positions)
        return obj

    # ------------------------------------------------------------ integrity

    def check(self) -> list[str]:
        expected: dict[int, int] = {}
        problems = []
        for obj in self.objects.values():
            if len(obj.pages) != self._pages_for(obj.length + obj.reserved):
                problems.append(f"object {obj.oid}: {len(obj.pages)} pages for "
                                f"{obj.length}+{obj.reserved} entries")
            for page in obj.pages:
                expected[page] = expected.get(page, 0) + 1
        return problems + self.pool.check(expected)

    def _pages_for(self, n: int) -> int:
        return -(-n // self.page_size)
