"""The page pool: which KV pages are free and how many holders each one has.

Lifetime rules: a page is either on the free list (refcount 0) or referenced by one or
more KV objects (refcount = number of object page lists that contain it). Only
`decref` returns a page to the free list, and only when its count reaches 0. The pool
knows nothing about tensors: the runner owns the page tensors and this module owns
their bookkeeping, plus the token id and position of every slot so that a page carries
its entries' identity wherever it is shared.
"""
from __future__ import annotations

import numpy as np

from liblip.protocol import ProtocolError


class Pool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("pool needs at least one page of at least one slot")
        self.num_pages = num_pages
        self.page_size = page_size
        self.refcount = np.zeros(num_pages, dtype=np.int32)
        # Pop from the end: low page ids are handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.token_ids = np.zeros((num_pages, page_size), dtype=np.int32)
        self.positions = np.zeros((num_pages, page_size), dtype=np.int32)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """n fresh pages with refcount 1, or ENOSPC (nothing is taken then)."""
        if n > len(self._free):
            raise ProtocolError(
                "ENOSPC", f"KV pool exhausted: need {n} pages, {len(self._free)} free "
                f"of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self.refcount[pages] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for page in pages:
            assert self.refcount[page] > 0, f"incref of free page {page}"
            self.refcount[page] += 1

    def decref(self, pages: list[int]) -> None:
        for page in pages:
            assert self.refcount[page] > 0, f"decref of free page {page}"
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self._free.append(page)

    def check(self, expected: dict[int, int]) -> list[str]:
        """Problems found comparing refcounts with `expected` (page -> holders)."""
        problems = []
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("free list holds a page twice")
        for page in range(self.num_pages):
            want = expected.get(page, 0)
            have = int(self.refcount[page])
            if have != want:
                problems.append(f"page {page}: refcount {have}, referenced {want} times")
            if (page in free) != (want == 0):
                problems.append(f"page {page}: free={page in free} but referenced {want} times")
        if len(free) + len(expected) != self.num_pages:
            problems.append(f"free {len(free)} + referenced {len(expected)} != {self.num_pages}")
        return problems
