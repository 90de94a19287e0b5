"""A step's page tables: where each call's entries live in the paged KV pool.

Every attention backend reads one step's layout from `PageTables`, in the compressed
form FlashInfer's paged kernels take (and vLLM's block tables hold): for call i of the
step, its pages are `indices[indptr[i]:indptr[i+1]]` in order, its last page holds
`last_page_len[i]` entries (1..page_size), and its query rows in the flat batch are
`qo_indptr[i]:qo_indptr[i+1]`. A call attends to `kv_len[i]` entries: its object's,
then its own new ones last (written into their reserved slots during the step).

Built on the CPU from each call's page table (`Chunk.pages`) once per step; backends
derive what they need (the new tokens' slots, padded tables for batched decode) from it
without ever expanding a context into per-token slot ids.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PageTables:
    page_size: int
    indptr: np.ndarray          # [B+1] int32
    indices: np.ndarray         # [indptr[-1]] int32: page ids
    last_page_len: np.ndarray   # [B] int32, 1..page_size
    kv_len: np.ndarray          # [B] int32: entries each call attends to
    qo_indptr: np.ndarray       # [B+1] int32: each call's rows of the flat batch

    @classmethod
    def build(cls, page_size: int, pages: Sequence[np.ndarray], kv_len: Sequence[int],
              q_len: Sequence[int]) -> PageTables:
        """Tables for calls with page lists `pages`, `kv_len` entries and `q_len` new
        tokens each (their last q_len entries). Raises ValueError when a call's pages
        cannot hold its entries or it has more new tokens than entries."""
        # a step's few calls in Python ints, four arrays made at the end: ~25 small
        # numpy ops cost more (each op several times its own cost after the step's
        # weights have streamed through the caches; measured: docs/kernels.md, "A
        # step's tables and plans without small numpy ops")
        kv = [int(k) for k in kv_len]
        q = [int(n) for n in q_len]
        counts = [len(p) for p in pages]
        if not len(kv) == len(q) == len(counts):
            raise ValueError("pages, kv_len and q_len differ in length")
        if any(n < 1 or n > k for n, k in zip(q, kv)):
            raise ValueError("each call computes 1..kv_len of its entries")
        if any(c != -(-k // page_size) for c, k in zip(counts, kv)):
            raise ValueError("a call's page table does not cover exactly its entries")
        indices = (np.concatenate(pages).astype(np.int32, copy=False) if len(pages)
                   else np.zeros(0, dtype=np.int32))
        return cls(page_size, np.array([0, *itertools.accumulate(counts)], dtype=np.int32),
                   indices, np.array([(k - 1) % page_size + 1 for k in kv], dtype=np.int32),
                   np.array(kv, dtype=np.int32),
                   np.array([0, *itertools.accumulate(q)], dtype=np.int32))

    def __len__(self) -> int:
        return len(self.kv_len)

    @property
    def q_len(self) -> np.ndarray:
        return np.diff(self.qo_indptr)

    def by_phase(self) -> tuple[list[int], list[int]]:
        """(calls of one new token, calls of more): the split every backend makes,
        since one query row per call is a cheaper kernel than a causal chunk."""
        q = self.q_len
        return ([i for i in range(len(q)) if q[i] == 1],
                [i for i in range(len(q)) if q[i] > 1])

    def select(self, calls: Sequence[int]) -> PageTables:
        """The tables of `calls` alone, in that order and numbered from 0 (their
        query rows in this step's batch are `query_rows(calls)`)."""
        calls = list(calls)
        return PageTables.build(self.page_size, [self.pages_of(i) for i in calls],
                                self.kv_len[calls], self.q_len[calls])

    def query_rows(self, calls: Sequence[int]) -> np.ndarray:
        """The flat-batch rows of `calls`' new tokens, in order, as int64."""
        calls = np.asarray(calls, dtype=np.int64)
        start = self.qo_indptr[calls].astype(np.int64)
        n = self.qo_indptr[calls + 1] - start
        # row k of the result: its call's first row, plus k less the rows before its call
        return np.repeat(start - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))

    def pages_of(self, i: int) -> np.ndarray:
        return self.indices[self.indptr[i]:self.indptr[i + 1]]

    def slots(self, i: int, start: int, end: int) -> np.ndarray:
        """Flat slot ids (page * page_size + offset) of call i's entries [start, end)."""
        idx = np.arange(start, end)
        return self.pages_of(i).astype(np.int64)[idx // self.page_size] * self.page_size \
            + idx % self.page_size

    def new_slots(self) -> np.ndarray:
        """The slots the step's new tokens are written to, in flat-batch order (slots()
        of every call's last q_len entries, for all calls at once)."""
        q = self.q_len
        call = np.repeat(np.arange(len(q)), q)
        rows = np.arange(len(call))
        entry = (self.kv_len - q)[call] + rows - self.qo_indptr[call]   # within its call
        page = self.indices[self.indptr[call] + entry // self.page_size].astype(np.int64)
        return page * self.page_size + entry % self.page_size

    def padded(self, rows: Sequence[int]) -> np.ndarray:
        """The page tables of calls `rows` as one [len(rows), most pages] int64 array,
        short tables padded with their own first page (masked out by `kv_len`)."""
        widths = self.indptr[1:] - self.indptr[:-1]
        width = int(max((widths[i] for i in rows), default=0))
        table = np.zeros((len(rows), width), dtype=np.int64)
        for r, i in enumerate(rows):
            pages = self.pages_of(i)
            table[r, :len(pages)] = pages
            table[r, len(pages):] = pages[0] if len(pages) else 0
        return table
