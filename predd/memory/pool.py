"""The page pool: which KV pages exist, how many holders each has, and where each lives.

Lifetime rules: a page id is either free (refcount 0) or referenced by one or more KV
objects (refcount = number of object page lists that contain it). Only `decref` frees a
page, and only when its count reaches 0. The pool knows nothing about tensors: the tier
store (predd/memory/tiers.py) owns the K/V data and this module owns the bookkeeping, plus the
token id and position of every slot, so that a page carries its entries' identity
wherever it is shared and whichever tier holds it.

Tier rules: page ids are the objects' names for pages; each page lives in one slot of
one tier (DEVICE, the pool the model computes on; HOST; DISK), `tier[page]` and
`slot[page]`. A page moves between tiers without changing its id, so every object that
shares it still does (`relocate`). New pages are always made on the device; `alloc`
leaves `held` device slots alone (promised to calls already admitted: a generate's
future pages), and when that leaves too few it asks `reclaim(n)` to move n pages down
first (predd/memory/policy.py decides which). With no host or disk pages, ids and device slots
coincide.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from symphony_protocol import ProtocolError

DEVICE, HOST, DISK = 0, 1, 2
TIER_NAMES = ("device", "host", "disk")


class Pool:
    def __init__(self, num_pages: int, page_size: int, host_pages: int = 0,
                 disk_pages: int = 0) -> None:
        if num_pages < 1 or page_size < 1 or host_pages < 0 or disk_pages < 0:
            raise ValueError("pool needs at least one page of at least one slot")
        self.num_pages = num_pages            # device pages
        self.page_size = page_size
        self.capacity = (num_pages, host_pages, disk_pages)
        total = sum(self.capacity)
        self.refcount = np.zeros(total, dtype=np.int32)
        self.tier = np.zeros(total, dtype=np.int8)
        self.slot = np.zeros(total, dtype=np.int32)
        # Pop from the end: low ids and slots are handed out first.
        self._free: list[int] = list(range(total - 1, -1, -1))
        self._free_slots: list[list[int]] = [list(range(n - 1, -1, -1)) for n in self.capacity]
        self.token_ids = np.zeros((total, page_size), dtype=np.int32)
        self.positions = np.zeros((total, page_size), dtype=np.int32)
        self.held = 0   # device slots promised to admitted calls
        self.reclaim: Callable[[int], None] = lambda n: None

    @property
    def free_pages(self) -> int:
        """Free device slots."""
        return len(self._free_slots[DEVICE])

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    @property
    def available(self) -> int:
        """Device slots a new page may take now: free and not promised."""
        return self.free_pages - self.held

    def free_in(self, tier: int) -> int:
        return len(self._free_slots[tier])

    def used_in(self, tier: int) -> int:
        return self.capacity[tier] - len(self._free_slots[tier])

    @property
    def all_on_device(self) -> bool:
        """No page lives below the device (O(1): every live page holds one slot of its
        tier), so no page table needs a look at `tier`."""
        return not (self.used_in(HOST) or self.used_in(DISK))

    def alloc(self, n: int) -> list[int]:
        """n fresh device pages with refcount 1, or ENOSPC (nothing is taken then)."""
        if n > self.available:
            self.reclaim(n - self.available)
        if n > self.available:
            held = f", {self.held} promised to calls in flight" if self.held else ""
            raise ProtocolError(
                "ENOSPC", f"KV pool exhausted: need {n} pages, {self.free_pages} free "
                f"of {self.num_pages}{held}")
        if not n:           # most decode steps' reservations: no array ops for nothing
            return []
        pages = [self._free.pop() for _ in range(n)]
        slots = [self._free_slots[DEVICE].pop() for _ in range(n)]
        self.refcount[pages] = 1
        self.tier[pages] = DEVICE
        self.slot[pages] = slots
        return pages

    def incref(self, pages: list[int]) -> None:
        """One more reference to each of `pages` (a page listed twice gets two). One
        array op, not a Python step per page: a fork of a long cache stays as cheap as
        a short one's."""
        at = np.asarray(pages, dtype=np.int64)
        assert not np.any(self.refcount[at] <= 0), "incref of a free page"
        np.add.at(self.refcount, at, 1)

    def decref(self, pages: list[int]) -> None:
        """One reference less to each of `pages`; those left with none are freed, in the
        order they reached zero."""
        at = np.asarray(pages, dtype=np.int64)
        assert not np.any(self.refcount[at] <= 0), "decref of a free page"
        np.subtract.at(self.refcount, at, 1)
        assert not np.any(self.refcount[at] < 0), "decref of a page more times than it is held"
        # a page reaches zero at its last place in `pages`: free in that order
        last = np.sort(len(at) - 1 - np.unique(at[::-1], return_index=True)[1])
        for page in at[last][self.refcount[at[last]] == 0].tolist():
            self._free.append(page)
            self._free_slots[self.tier[page]].append(int(self.slot[page]))

    # ------------------------------------------------------------ tiers

    def device_slots(self, pages: np.ndarray) -> np.ndarray:
        """The device slots of `pages`, which must all be on the device."""
        pages = np.asarray(pages, dtype=np.int64)
        assert self.all_on_device or not np.any(self.tier[pages] != DEVICE), \
            "page table with a page off the device"
        return self.slot[pages]

    def relocate(self, pages: list[int], tier: int) -> tuple[np.ndarray, np.ndarray]:
        """Give `pages` (all in one tier, none in `tier`) slots in `tier`, freeing their
        old ones: (old slots, new slots). The caller copies the data between them.
        Raises ENOSPC, changing nothing, when `tier` lacks room."""
        if len(pages) > len(self._free_slots[tier]):
            raise ProtocolError("ENOSPC", f"no room in the {TIER_NAMES[tier]} tier for "
                                f"{len(pages)} pages")
        old = self.slot[pages].copy()
        olds = self._free_slots[int(self.tier[pages[0]])] if pages else []
        new = np.array([self._free_slots[tier].pop() for _ in pages], dtype=np.int32)
        olds.extend(int(s) for s in old)
        self.tier[pages] = tier
        self.slot[pages] = new
        return old, new

    # ------------------------------------------------------------ integrity

    def check(self, expected: dict[int, int]) -> list[str]:
        """Problems found comparing refcounts with `expected` (page -> holders), and
        every tier's slots with the pages that live there."""
        problems = []
        free = set(self._free)
        total = len(self.refcount)
        if len(free) != len(self._free):
            problems.append("free list holds a page twice")
        for page in range(total):
            want = expected.get(page, 0)
            have = int(self.refcount[page])
            if have != want:
                problems.append(f"page {page}: refcount {have}, referenced {want} times")
            if (page in free) != (want == 0):
                problems.append(f"page {page}: free={page in free} but referenced {want} times")
        if len(free) + len(expected) != total:
            problems.append(f"free {len(free)} + referenced {len(expected)} != {total}")
        live = np.array(sorted(expected), dtype=np.int64)
        for tier, capacity in enumerate(self.capacity):
            used = self.slot[live[self.tier[live] == tier]] if len(live) else np.zeros(0)
            slots = set(self._free_slots[tier]) | {int(s) for s in used}
            if len(used) + len(self._free_slots[tier]) != capacity or \
                    slots != set(range(capacity)):
                problems.append(f"{TIER_NAMES[tier]} tier: {len(used)} used + "
                                f"{len(self._free_slots[tier])} free slots != {capacity}")
        if not 0 <= self.held <= self.free_pages:
            problems.append(f"{self.held} pages promised, {self.free_pages} free")
        return problems
