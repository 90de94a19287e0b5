"""Memory policy: which pages live on the device, and which move down when it runs short.

Rules (the pool and the tier store do the moves; this module decides them):
* Residency: a call computes only on an object whose pages are all on the device
  (`bring_in` at admission: its cost reports the tokens swapped in and the time).
  Reads (fork, export, extract, merge, tokens) work in any tier and move nothing.
* Eviction: when a new page finds no available device slot (`Pool.alloc` calls
  `reclaim`), pages move down: device -> host -> disk, whichever has room (the host
  tier spills its own coldest pages to disk first). A page may move only if none of its
  holders is *blocked* — pinned, with a call admitted or slots reserved, or protected by
  the operation in progress — so a fork family's shared prefix moves only once every
  fork is cold, and sharing is kept (a page keeps its id in every tier).
  Order: pages whose holders all wait on I/O (`io_wait`) first, then least recently
  used (a page is as recent as its most recent holder); once one page of an object is
  chosen, the rest of that object's go with it.
* Pins: a pinned object is brought to the device and never moves down. A uid may pin
  at most `pin_pages` device pages (default a quarter of the pool), and all uids
  together half the pool (EDQUOT beyond, at pin time; a pinned object may still grow by
  its own calls): half the device always stays movable, so pins cannot wedge the calls
  of others.
* Promises: a generate is admitted only if the device can hold everything it may still
  write (`promise`); those pages are held back from every other allocation (`pool.held`)
  and drawn as it grows, so two admitted calls never wait on each other for memory.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from symphony_protocol import ProtocolError
from predd.memory.kvstore import KVObject, KVStore
from predd.memory.pool import DEVICE, DISK, HOST, TIER_NAMES
from predd.memory.tiers import TierStore


@dataclass(frozen=True)
class MemoryConfig:
    host_pages: int = 0
    disk_pages: int = 0
    swap_dir: str | None = None       # where the disk tier's file goes (None: $TMPDIR)
    pin_pages: int | None = None      # device pages one uid may pin; None: a quarter
    admit_wait_s: float = 10.0        # a call waits this long for memory, then ENOSPC


class NoRoom(ProtocolError):
    """ENOSPC on the device: `permanent` when the pages asked for exceed the whole pool
    (waiting cannot help), else room may come when calls finish or caches are freed."""

    def __init__(self, permanent: bool, message: str) -> None:
        super().__init__("ENOSPC", message)
        self.permanent = permanent


@dataclass
class Moves:
    down: int = 0          # pages moved to a lower tier
    up: int = 0            # pages brought back to the device
    bytes: int = 0
    swap_s: float = 0.0


class _Protecting:
    """`Memory.protecting`'s `with` block: the objects not already protected are added
    on entry and taken out on exit."""
    __slots__ = ("protected", "oids", "added")

    def __init__(self, protected: set[int], oids: tuple[int, ...]) -> None:
        self.protected, self.oids = protected, oids

    def __enter__(self) -> None:
        self.added = [o for o in self.oids if o not in self.protected]
        self.protected.update(self.added)

    def __exit__(self, *exc: object) -> None:
        self.protected.difference_update(self.added)


class Memory:
    def __init__(self, config: MemoryConfig, store: KVStore, tiers: TierStore,
                 in_flight: Callable[[int], bool], uid_of: Callable[[int], int]) -> None:
        self.config = config
        self.store = store
        self.pool = store.pool
        self.tiers = tiers
        self.in_flight = in_flight
        self.uid_of = uid_of
        self.pin_pages = (self.pool.num_pages // 4 if config.pin_pages is None
                          else config.pin_pages)
        self.pin_total = self.pool.num_pages // 2
        self.protected: set[int] = set()
        self.pinned: dict[int, KVObject] = {}   # oid -> pinned object: the one record of pins
        self.moves = Moves()
        self.pool.reclaim = self.reclaim

    # ------------------------------------------------------------ state of an object

    def touch(self, obj: KVObject, now: float | None = None) -> None:
        obj.last_used = time.monotonic() if now is None else now
        obj.waiting = False

    def tier_of(self, obj: KVObject) -> str:
        """The lowest tier holding one of its pages ("device" when empty)."""
        if not obj.pages:
            return TIER_NAMES[DEVICE]
        return TIER_NAMES[int(self.pool.tier[obj.pages].max())]

    def off_device(self, obj: KVObject) -> list[int]:
        """`obj`'s pages in a lower tier, each once, in its order. Asked of every call
        each step it is admitted: O(1) while the lower tiers hold no page, else one
        vectorised pass (not a Python loop over a long context's pages)."""
        if self.pool.all_on_device or not obj.pages:
            return []
        pages = np.asarray(obj.pages)
        return list(dict.fromkeys(pages[self.pool.tier[pages] != DEVICE].tolist()))

    def is_pinned(self, obj: KVObject) -> bool:
        return obj.oid in self.pinned

    def blocked(self, obj: KVObject) -> bool:
        return (obj.oid in self.pinned or obj.reserved > 0 or obj.oid in self.protected
                or self.in_flight(obj.oid))

    def _blocked_pages(self, but: KVObject | None = None) -> set[int]:
        """Pages some blocked holder (other than `but`) keeps where they are."""
        return {p for o in self.store.objects.values() if o is not but and self.blocked(o)
                for p in o.pages}

    def protecting(self, *oids: int) -> _Protecting:
        """Keep these objects' pages where they are while an operation works on them (a
        `with` block; every admission takes one, so not a generator's context manager,
        which costs several times as much)."""
        return _Protecting(self.protected, oids)

    # ------------------------------------------------------------ moving down

    def _victims(self, tier: int, n: int) -> list[int]:
        """Up to at least n movable pages of `tier`, coldest first, whole objects."""
        blocked = self._blocked_pages()
        score: dict[int, tuple[int, float]] = {}
        for obj in self.store.objects.values():
            if self.blocked(obj):
                continue
            key = (0 if obj.waiting else 1, obj.last_used)
            for page in obj.pages:
                if self.pool.tier[page] == tier:
                    old = score.get(page)
                    score[page] = key if old is None else max(old, key)
        order = sorted((k, p) for p, k in score.items() if p not in blocked)
        chosen: list[int] = []
        last = None
        for key, page in order:
            if len(chosen) >= n and key != last:
                break
            chosen.append(page)
            last = key
        return chosen

    def _lower(self, tier: int) -> list[int]:
        return [t for t in (HOST, DISK) if t > tier and self.pool.capacity[t]]

    def _move_down(self, pages: list[int], tier: int) -> int:
        """Move `pages` of `tier` to the tiers below, as far as they have room (the host
        spills its coldest to disk for them); how many moved."""
        moved = 0
        for lower in self._lower(tier):
            left = pages[moved:]
            if not left:
                break
            short = len(left) - self.pool.free_in(lower)
            if short > 0 and lower == HOST and self.pool.capacity[DISK]:
                self._move_down(self._victims(HOST, short), HOST)
            take = left[:self.pool.free_in(lower)]
            if take:
                self._count(self.tiers.move(take, lower), down=len(take))
                moved += len(take)
        return moved

    def reclaim(self, n: int) -> None:
        """Make n more device slots available by moving cold pages down (as many as can
        be: the caller checks)."""
        if n > 0 and self._lower(DEVICE):
            self._move_down(self._victims(DEVICE, n), DEVICE)

    def evict(self, obj: KVObject) -> None:
        """Move an object's device pages down now (those another holder does not block);
        EBUSY when it is pinned or a call on it is in flight."""
        if obj.oid in self.pinned or obj.reserved or self.in_flight(obj.oid):
            raise ProtocolError("EBUSY", "the cache is pinned or a call on it is in flight")
        blocked = self._blocked_pages(but=obj)
        pages = [p for p in dict.fromkeys(obj.pages)
                 if self.pool.tier[p] == DEVICE and p not in blocked]
        if pages and not self._lower(DEVICE):
            raise ProtocolError("ENOSPC", "no host or disk tier to move the cache to "
                                "(predd --host-pages / --disk-pages)")
        if self._move_down(pages, DEVICE) < len(pages):
            raise ProtocolError("ENOSPC", "the host and disk tiers are full")

    # ------------------------------------------------------------ moving up

    def ensure(self, n: int) -> None:
        """n device slots available (moving cold pages down if needed), or ENOSPC."""
        if n > self.pool.available:
            self.reclaim(n - self.pool.available)
        if n > self.pool.num_pages:
            raise NoRoom(True, f"the call needs {n} pages on the device, more than its "
                         f"{self.pool.num_pages}")
        if n > self.pool.available:
            raise NoRoom(False, f"KV pool exhausted: need {n} pages, {self.pool.available}"
                         f" available of {self.pool.num_pages} (the rest in use, pinned "
                         "or promised to calls in flight)")

    def bring_in(self, obj: KVObject) -> int:
        """All of `obj`'s pages on the device; the entries brought back (0 if none).
        ENOSPC, moving nothing up, when the device cannot hold them."""
        pages = self.off_device(obj)
        if not pages:
            return 0
        started = time.monotonic()
        with self.protecting(obj.oid):
            self.ensure(len(pages))
        self._count(self.tiers.move(pages, DEVICE), up=len(pages))
        self.moves.swap_s += time.monotonic() - started
        return min(len(pages) * self.pool.page_size, obj.length)

    def _count(self, nbytes: int, down: int = 0, up: int = 0) -> None:
        self.moves.bytes += nbytes
        self.moves.down += down
        self.moves.up += up

    # ------------------------------------------------------------ policy requests

    def pin(self, obj: KVObject, on: bool) -> None:
        if not on:
            self.pinned.pop(obj.oid, None)
            return
        if obj.oid in self.pinned:
            return
        uid = self.uid_of(obj.oid)
        pinned = list(self.pinned.values())
        mine = sum(len(o.pages) for o in pinned if self.uid_of(o.oid) == uid)
        if mine + len(obj.pages) > self.pin_pages:
            raise ProtocolError("EDQUOT", f"uid {uid} has {mine} pages pinned; pinning "
                                f"{len(obj.pages)} more passes the pin quota of "
                                f"{self.pin_pages}")
        total = sum(len(o.pages) for o in pinned)
        if total + len(obj.pages) > self.pin_total:
            raise ProtocolError("EDQUOT", f"{total} pages are pinned; pinning "
                                f"{len(obj.pages)} more passes the limit of {self.pin_total}"
                                " (half the device pool) for all users together")
        self.bring_in(obj)
        self.pinned[obj.oid] = obj

    def forget(self, oid: int) -> None:
        """An object is freed."""
        self.pinned.pop(oid, None)

    def io_wait(self, objs: list[KVObject], on: bool) -> None:
        for obj in objs:
            obj.waiting = on

    # ------------------------------------------------------------ promises

    def promise(self, n: int) -> None:
        assert n <= self.pool.available, "promise beyond the available pages"
        self.pool.held += n

    def draw(self, n: int) -> None:
        self.pool.held -= n

    def stats(self) -> dict:
        return {name: {"pages_total": self.pool.capacity[t], "pages_used": self.pool.used_in(t)}
                for t, name in enumerate(TIER_NAMES)}

    def check(self) -> list[str]:
        problems = []
        for oid, obj in self.pinned.items():
            if self.store.objects.get(oid) is not obj:
                problems.append(f"pinned object {oid} is gone")
            elif self.off_device(obj):
                problems.append(f"pinned object {oid} has pages off the device")
        return problems
