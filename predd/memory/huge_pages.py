"""Transparent huge pages for predd's big, long-lived CPU buffers: the KV pool and the
projections' quantised blocks.

Both are read at addresses a TLB of 4 KB pages cannot cover: a step streams ~80 MB of
blocks, and attention reads pages of the pool wherever the allocator put them (B2's
pool is ~150 MB for SmolLM2: ~37,000 small pages against a second-level TLB of a few
thousand entries, and in a virtual machine each miss walks two levels of page tables).
On 2 MB pages each entry covers 512 times as much: attention's prefetch instructions,
which walk the page tables, then wait less, and a decode step is faster (measured:
docs/kernels.md, "Huge pages for the KV pool").

Huge pages come only to memory advised before it is first touched (MADV_HUGEPAGE;
honoured where /sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise`),
and a buffer of its own fills whole 2 MB pages only from a 2 MB boundary. So each
buffer here is a fresh anonymous mapping (zero-filled by the kernel, never recycled
heap), started at a boundary and advised at once: `zeros` for the pool; `Arena` for
the blocks, each of which is smaller than one huge page (SmolLM2's largest is ~0.9 MB),
copied side by side into shared chunks. Where the kernel refuses the advice the
memory stays on small pages and nothing else changes; SYMPHONY_HUGE_PAGES=0 turns all
of it off (plain torch and numpy allocations), for measuring.
"""
from __future__ import annotations

import functools
import mmap
import os
import threading

import numpy as np
import torch

HUGE = 2 << 20           # a huge page (x86-64, arm64 with 4 KB base pages)
CHUNK = 16 * HUGE        # an arena's chunk; a bigger array gets one of its own
ALIGN = 64               # where each of an arena's arrays starts: a cache line


@functools.cache
def enabled() -> bool:
    """Whether predd asks for huge pages here (read once)."""
    return (os.environ.get("SYMPHONY_HUGE_PAGES", "1") != "0"
            and hasattr(mmap, "MADV_HUGEPAGE"))


def _mapping(size: int) -> tuple[mmap.mmap, int]:
    """A fresh anonymous mapping with `size` bytes from a 2 MB boundary, advised onto
    huge pages: (the mapping, the boundary's offset in it)."""
    whole = -(-size // HUGE) * HUGE
    mapped = mmap.mmap(-1, whole + HUGE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data
    offset = -(-start // HUGE) * HUGE - start
    try:
        mapped.madvise(mmap.MADV_HUGEPAGE, offset, whole)
    except OSError:
        pass                   # THP off (or not built in): small pages, the same memory
    return mapped, offset


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, on huge pages where they are had."""
    count = int(np.prod(shape))
    if not enabled() or count == 0:
        return torch.zeros(shape, dtype=dtype)
    mapped, offset = _mapping(count * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset).view(shape)


class Arena:
    """Long-lived arrays copied side by side into chunks of huge-page memory. Each
    array holds its chunk (numpy's base), and the arena only the chunk it is filling:
    a chunk is unmapped once no array in it is left (a model dropped frees its
    blocks, as in the tests that load many)."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._at = self._end = 0

    def place(self, a: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of `a` in the arena (`a` itself where huge pages are off)."""
        if not enabled() or a.nbytes == 0:
            return a
        size = -(-a.nbytes // ALIGN) * ALIGN
        with self._lock:
            if self._map is None or self._at + size > self._end:
                length = -(-max(self.chunk, size) // HUGE) * HUGE
                self._map, self._at = _mapping(length)
                self._end = self._at + length
            at, self._at = self._at, self._at + size
            mapped = self._map
        out = np.frombuffer(mapped, dtype=np.uint8, count=a.nbytes, offset=at)
        out = out.view(a.dtype).reshape(a.shape)
        out[...] = a
        return out


ARENA = Arena()
