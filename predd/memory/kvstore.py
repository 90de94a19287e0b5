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
* Every operation that can fail (ENOSPC, E2BIG, a bad export) fails before it changes
  anything: an object is either changed as asked or left exactly as it was.
* Every change of a live object's page-list length is reported to `on_resize(oid,
  delta)` (the quota counters follow it).
The K/V tensors are not here: `PageData` (predd/memory/tiers.py over the runner's cache)
copies, reads and writes slots, addressed as flat slot ids `page * page_size + slot` of
page ids, whichever tier holds the page; only `page_table` hands out device slots.
"""
from __future__ import annotations

import itertools
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgpack
import numpy as np

from symphony_protocol import ProtocolError
from predd.server.request_limits import MAX_POSITION
from predd.memory.pool import Pool

EXPORT_MAGIC = b"SYKV2\n"   # SYKV1 had no checksum


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
    # memory policy (predd/memory/policy.py)
    last_used: float = field(default_factory=time.monotonic)
    waiting: bool = False      # its session said it waits on I/O


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
        pages = src.pages[: self.pages_for(src.length)]
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
        keep = self.pages_for(length)
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
        fresh = self.pool.alloc(self._fresh(obj, n, cow))
        if cow:
            self._copy_page(obj, start // ps, start % ps, fresh.pop())
        obj.pages.extend(fresh)
        obj.reserved += n
        self.on_resize(oid, len(fresh))
        return self.slots(obj, start, start + n)

    def _copy_page(self, obj: KVObject, index: int, filled: int, new: int) -> None:
        """Copy-on-write: page `index` of `obj` becomes `new`, a copy of its first
        `filled` slots; the object drops its reference to the shared original."""
        ps = self.page_size
        old = obj.pages[index]
        self.data.copy_slots(old * ps + np.arange(filled), new * ps + np.arange(filled))
        self.pool.token_ids[new, :filled] = self.pool.token_ids[old, :filled]
        self.pool.positions[new, :filled] = self.pool.positions[old, :filled]
        obj.pages[index] = new
        self.pool.decref([old])

    def reopen_pages(self, oid: int) -> int:
        """Fresh pages `reopen_last` takes: one when the last entry's page is shared."""
        obj = self.get(oid)
        if obj.length == 0:
            return 0
        return int(self.pool.refcount[obj.pages[(obj.length - 1) // self.page_size]] > 1)

    def reopen_last(self, oid: int) -> tuple[int, int, np.ndarray]:
        """Turn the last entry back into a one-slot reservation, so that a call recomputes
        it in place (re-predict). Its page is made private first (all or nothing: ENOSPC
        changes nothing). Returns what `restore_last` needs to undo it: the entry's token,
        position and K/V."""
        obj = self.get(oid)
        assert obj.reserved == 0, "reopen with a call in flight"
        if obj.length == 0:
            raise ProtocolError("EINVAL", "the object is empty: no last entry to recompute")
        ps = self.page_size
        i = obj.length - 1
        if self.reopen_pages(oid):
            self._copy_page(obj, i // ps, i % ps + 1, self.pool.alloc(1)[0])
        page, slot = obj.pages[i // ps], i % ps
        saved = np.ascontiguousarray(self.data.read_slots(np.array([page * ps + slot])))
        token = int(self.pool.token_ids[page, slot])
        position = int(self.pool.positions[page, slot])
        obj.length -= 1
        obj.reserved = 1
        return token, position, saved

    def restore_last(self, oid: int, token: int, position: int, saved: np.ndarray) -> None:
        """Undo `reopen_last` whose call failed: the entry is back as it was."""
        obj = self.get(oid)
        assert obj.reserved >= 1, "restore without the reopened slot"
        self.data.write_slots(self.slots(obj, obj.length, obj.length + 1), saved)
        self.commit(oid, np.array([token], np.int32), np.array([position], np.int32))

    def _needs_copy(self, obj: KVObject) -> bool:
        """Whether the next write lands in a partial last page other objects hold."""
        start = obj.length + obj.reserved
        ps = self.page_size
        return (obj.reserved == 0 and start % ps != 0
                and self.pool.refcount[obj.pages[start // ps]] > 1)

    def pages_needed(self, oid: int, n: int) -> int:
        """Fresh pages `reserve(oid, n)` would take (copy-on-write included)."""
        obj = self.get(oid)
        return self._fresh(obj, n, self._needs_copy(obj))

    def _fresh(self, obj: KVObject, n: int, cow: bool) -> int:
        """Fresh pages for n more entries of `obj`, and one for its copy-on-write."""
        return max(self.pages_for(obj.length + obj.reserved + n) - len(obj.pages), 0) + int(cow)

    def commit(self, oid: int, tokens: Sequence[int], positions: Sequence[int]) -> None:
        """The next len(tokens) reserved slots now hold K/V: make them entries (ids and
        positions as int32 arrays or lists of ints)."""
        obj = self.get(oid)
        n = len(tokens)
        assert n <= obj.reserved, "commit past reservation"
        ps = self.page_size
        if n == 1:          # a decode step's: two scalar stores, no index arrays
            page, at = obj.pages[obj.length // ps], obj.length % ps
            self.pool.token_ids[page, at] = tokens[0]
            self.pool.positions[page, at] = positions[0]
        else:
            slots = self.slots(obj, obj.length, obj.length + n)
            self.pool.token_ids[slots // ps, slots % ps] = tokens
            self.pool.positions[slots // ps, slots % ps] = positions
        obj.length += n
        obj.reserved -= n

    def release_reservation(self, oid: int) -> None:
        obj = self.objects.get(oid)
        if obj is None or obj.reserved == 0:
            return
        obj.reserved = 0
        keep = self.pages_for(obj.length)
        dropped = len(obj.pages) - keep
        self.pool.decref(obj.pages[keep:])
        del obj.pages[keep:]
        self.on_resize(oid, -dropped)

    # ------------------------------------------------------------ reading

    def slots(self, obj: KVObject, start: int = 0, end: int | None = None) -> np.ndarray:
        """The flat slot ids of entries [start, end). Only the pages of that range are
        read: a decode step's one-entry reserve and commit on a long cache stay O(1)
        (converting all of a long object's pages, twice a call a step, costs time that
        grows with the object; measured: docs/kernels.md, "Slot ids of a page range
        only")."""
        end = obj.length if end is None else end
        ps = self.page_size
        if end - start == 1:       # a decode step's reserve: no index arrays
            return np.array([obj.pages[start // ps] * ps + start % ps], dtype=np.int64)
        first = start // ps
        pages = np.asarray(obj.pages[first:(end - 1) // ps + 1], dtype=np.int64)
        idx = np.arange(start, end)
        return pages[idx // ps - first] * ps + idx % ps

    def page_tables(self, wanted: list[tuple[KVObject, int]]) -> list[np.ndarray]:
        """For each (object, length): the device slots of the pages holding its first
        `length` entries (reserved ones included), in order, int32: what the runner reads
        a call's context through. They must all be on the device (predd/memory/policy.py brings
        them in). One lookup for a step's calls, not one each."""
        lists = [obj.pages[:self.pages_for(length)] for obj, length in wanted]
        flat = self.pool.device_slots(list(itertools.chain.from_iterable(lists)))
        flat = flat.astype(np.int32)
        ends = list(itertools.accumulate(len(pages) for pages in lists))
        return [flat[end - len(pages):end] for pages, end in zip(lists, ends)]

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

    def extract(self, oid: int, ranges: list[list[int]], max_length: int | None = None
                ) -> KVObject:
        """A new object with the entries of `ranges`, in order (E2BIG past max_length)."""
        obj = self.get(oid)
        for r in ranges:
            if len(r) != 2 or not 0 <= r[0] <= r[1] <= obj.length:
                raise ProtocolError("EINVAL", f"range {r} outside [0, {obj.length}]")
        self._check_length("kv_extract", sum(r[1] - r[0] for r in ranges), max_length)
        parts = [self.slots(obj, r[0], r[1]) for r in ranges]
        return self._assemble(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def merge(self, oids: list[int], max_length: int | None = None) -> KVObject:
        """A new object with the entries of each object, concatenated (E2BIG past
        max_length)."""
        objs = [self.get(oid) for oid in oids]
        self._check_length("kv_merge", sum(o.length for o in objs), max_length)
        parts = [self.slots(o) for o in objs]
        return self._assemble(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    @staticmethod
    def _check_length(what: str, n: int, max_length: int | None) -> None:
        if max_length is not None and n > max_length:
            raise ProtocolError("E2BIG", f"{what}: the new object would hold {n} entries, "
                                f"more than the limit of {max_length}")

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
        prefix = EXPORT_MAGIC + struct.pack("<I", len(head)) + head
        crc = zlib.crc32(kv.data, zlib.crc32(prefix))
        return b"".join([prefix, kv.data, struct.pack("<I", crc)])

    def import_(self, blob: bytes, vocab: int, max_length: int) -> KVObject:
        """A new object from `export` bytes. The whole blob is checked before any page is
        taken (see `parse_export`); then it is all or nothing like `reserve`."""
        n, tokens, positions, kv = parse_export(blob, self.data.describe(), vocab, max_length)
        obj = self._new([], 0)
        try:
            slots = self.reserve(obj.oid, n)
            self.data.write_slots(slots, kv)
        except BaseException:
            self.free(obj.oid)
            raise
        self.commit(obj.oid, tokens, positions)
        return obj

    # ------------------------------------------------------------ integrity

    def check(self) -> list[str]:
        expected: dict[int, int] = {}
        problems = []
        for obj in self.objects.values():
            if len(obj.pages) != self.pages_for(obj.length + obj.reserved):
                problems.append(f"object {obj.oid}: {len(obj.pages)} pages for "
                                f"{obj.length}+{obj.reserved} entries")
            for page in obj.pages:
                expected[page] = expected.get(page, 0) + 1
        return problems + self.pool.check(expected)

    def pages_for(self, n: int) -> int:
        return -(-n // self.page_size)


# ---------------------------------------------------------------- the export format

def parse_export(blob: bytes, mine: dict, vocab: int, max_length: int
                 ) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """(length, token ids, positions, K/V [layers, 2, n, Hkv, D]) of an export made for
    the cache `mine` describes, its K/V as `mine` holds them (float32 and bfloat16
    entries are read into a pool of the other: widened exactly, or rounded to nearest
    even); EINVAL (E2BIG past `max_length` entries) on anything
    else: a bad header, another model/geometry/dtype, lengths that disagree, token ids
    outside the vocabulary, positions outside [0, MAX_POSITION), K/V of the wrong size
    or holding NaN or infinity (it would poison every call that attends to it).

    Format: EXPORT_MAGIC, a little-endian u32 header length, a msgpack map (the cache's
    `describe()` fields, `length`, `shape`, `tokens`, `positions`), the K/V bytes, and a
    little-endian u32 CRC-32 of everything before it (so a flipped byte anywhere, as on
    a disk that rots under kvfsd's snapshots, is caught rather than served).
    """
    at = len(EXPORT_MAGIC) + 4
    blob = bytes(blob) if isinstance(blob, (bytearray, memoryview)) else blob
    if not isinstance(blob, bytes) or len(blob) < at + 4 or not blob.startswith(EXPORT_MAGIC):
        raise ProtocolError("EINVAL", "not a Symphony KV export (of this version)")
    (crc,) = struct.unpack_from("<I", blob, len(blob) - 4)
    if zlib.crc32(memoryview(blob)[:-4]) != crc:
        raise _corrupt("checksum mismatch (truncated or damaged)")
    blob = memoryview(blob)[:-4]
    (head_len,) = struct.unpack_from("<I", blob, len(EXPORT_MAGIC))
    if head_len > len(blob) - at:
        raise _corrupt(f"a header of {head_len} bytes in {len(blob)}")
    try:
        meta = msgpack.unpackb(blob[at:at + head_len])
    except Exception as exc:   # msgpack raises many types on garbage
        raise _corrupt(f"header is not msgpack ({type(exc).__name__})") from None
    if not isinstance(meta, dict):
        raise _corrupt("header is not a map")
    theirs = meta.get("dtype")
    if (isinstance(theirs, str) and theirs != mine["dtype"] and theirs in CONVERTIBLE
            and mine["dtype"] in CONVERTIBLE
            and meta.get("numpy_dtype") == CONVERTIBLE[theirs]):
        meta = {**meta, "numpy_dtype": mine["numpy_dtype"], "dtype": mine["dtype"]}
    else:
        theirs = mine["dtype"]
    for key, value in mine.items():
        if meta.get(key) != value:
            raise ProtocolError("EINVAL", f"export is for {key}={_short(meta.get(key))}, "
                                f"this predd has {value!r}")
    n = meta.get("length")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise _corrupt(f"length {_short(n)}")
    if n > max_length:
        raise ProtocolError("E2BIG", f"export of {n} entries: more than the limit of "
                            f"{max_length}")
    shape = [mine["layers"], 2, n, mine["kv_heads"], mine["head_dim"]]
    if meta.get("shape") != shape:
        raise _corrupt(f"shape {_short(meta.get('shape'))}, expected {shape}")
    tokens = _int_array(meta.get("tokens"), n, "tokens", vocab)
    positions = _int_array(meta.get("positions"), n, "positions", MAX_POSITION)
    dtype = np.dtype(CONVERTIBLE.get(theirs, mine["numpy_dtype"]))
    want = int(np.prod(shape)) * dtype.itemsize
    if len(blob) - at - head_len != want:
        raise _corrupt(f"{len(blob) - at - head_len} bytes of K/V, expected {want}")
    kv = np.frombuffer(blob, dtype=dtype, offset=at + head_len).reshape(shape)
    if not _finite(kv, theirs):
        raise ProtocolError("EINVAL", "KV export holds NaN or infinite K/V")
    if theirs != mine["dtype"]:
        kv = _convert(kv, mine["dtype"])
        if not _finite(kv, mine["dtype"]):     # float32 beyond bfloat16's range
            raise ProtocolError("EINVAL", f"KV export holds K/V beyond {mine['dtype']}'s range")
    return n, tokens, positions, kv


CONVERTIBLE = {"float32": "float32", "bfloat16": "uint16"}   # dtype: numpy dtype of its bits


def _convert(kv: np.ndarray, to: str) -> np.ndarray:
    """float32 K/V as bfloat16 bits, or bfloat16 bits as float32: torch's conversions
    (rounded to nearest even, as the pool's own stores round; widened exactly)."""
    import torch               # (only here: the store itself is numpy's)
    t = torch.from_numpy(np.array(kv))          # a copy: the export's buffer is read-only
    if to == "float32":
        return t.view(torch.bfloat16).float().numpy()
    return t.to(torch.bfloat16).view(torch.uint16).numpy()


def _corrupt(why: str) -> ProtocolError:
    return ProtocolError("EINVAL", f"corrupt KV export: {why}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_array(values, n: int, what: str, bound: int) -> np.ndarray:
    """`values` as int32 if it is a list of n ints in [0, bound); else EINVAL."""
    if not isinstance(values, list) or len(values) != n:
        raise _corrupt(f"{what}: expected a list of {n}")
    arr = np.asarray(values) if n else np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu" or arr.shape != (n,):
        raise _corrupt(f"{what}: expected integers")
    if n and (arr.min() < 0 or arr.max() >= bound):
        raise _corrupt(f"{what}: out of range [0, {bound})")
    return arr.astype(np.int32)


def _finite(kv: np.ndarray, dtype: str) -> bool:
    if dtype == "bfloat16":   # raw uint16 bits: all-ones exponent is inf or NaN
        return bool(np.all((kv & 0x7F80) != 0x7F80))
    return bool(np.all(np.isfinite(kv)))
