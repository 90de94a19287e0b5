"""predd/memory/huge_pages.py: the pool's zeros and the arena's arrays are exact, aligned and
packed, on 2 MB pages where the kernel gives them (read back from /proc/self/smaps),
and plain allocations where huge pages are off."""
from __future__ import annotations

import re
import weakref

import numpy as np
import pytest
import torch

from predd.memory import huge_pages
from predd.model.loader import QuantBlocks

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    try:
        with open(THP) as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return "never"


needs_thp = pytest.mark.skipif(thp_mode() == "never", reason="transparent huge pages are off")


def huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def switch(monkeypatch):
    """Sets SYMPHONY_HUGE_PAGES for one test (huge_pages reads it once)."""
    def set_to(value: str) -> None:
        monkeypatch.setenv("SYMPHONY_HUGE_PAGES", value)
        huge_pages.enabled.cache_clear()
    yield set_to
    monkeypatch.delenv("SYMPHONY_HUGE_PAGES", raising=False)
    huge_pages.enabled.cache_clear()


def test_arena_copies_exactly_aligned_and_side_by_side(switch):
    switch("1")
    arena = huge_pages.Arena(chunk=4 * huge_pages.HUGE)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**32, size=(3, 5, 7), dtype=np.uint32)
    b = rng.standard_normal((9, 11)).astype(np.float32)
    c = np.arange(5, dtype=np.int8)
    pa, pb, pc = (arena.place(x) for x in (a, b, c))
    for orig, placed in ((a, pa), (b, pb), (c, pc)):
        assert placed.dtype == orig.dtype and placed.shape == orig.shape
        assert np.array_equal(placed, orig) and placed.flags.c_contiguous
        assert placed.flags.writeable and not np.shares_memory(placed, orig)
        assert placed.ctypes.data % huge_pages.ALIGN == 0
    # packed one after another (each rounded up to 64 bytes), the first at a 2 MB boundary
    assert pa.ctypes.data % huge_pages.HUGE == 0
    assert pb.ctypes.data == pa.ctypes.data + 448          # 420 bytes -> 448
    assert pc.ctypes.data == pb.ctypes.data + 448          # 396 bytes -> 448


def test_arena_starts_a_chunk_when_one_is_full_and_gives_a_big_array_its_own(switch):
    switch("1")
    arena = huge_pages.Arena(chunk=huge_pages.HUGE)
    first = arena.place(np.ones(huge_pages.HUGE - 64, np.uint8))
    second = arena.place(np.ones(128, np.uint8))          # does not fit after `first`
    assert second.ctypes.data % huge_pages.HUGE == 0
    assert second.ctypes.data != first.ctypes.data
    big = arena.place(np.full(3 * huge_pages.HUGE + 1, 7, np.uint8))
    assert big.ctypes.data % huge_pages.HUGE == 0 and int(big.sum()) == 7 * big.size
    after = arena.place(np.ones(64, np.uint8))           # in the rest of the big one's
    assert after.ctypes.data == big.ctypes.data + 3 * huge_pages.HUGE + 64
    assert np.all(first == 1) and np.all(second == 1)    # earlier arrays untouched


def test_a_chunk_goes_with_its_last_array(switch):
    switch("1")
    arena = huge_pages.Arena(chunk=4 * huge_pages.HUGE)
    held, chunks = [], []
    for _ in range(4):                  # 6 MB each: a chunk of its own every time
        held.append(arena.place(np.ones(3 * huge_pages.HUGE, np.uint8)))
        chunks.append(weakref.ref(arena._map))
    assert len({id(c()) for c in chunks}) == 4
    del held[1]
    assert chunks[1]() is None and all(c() is not None for c in (chunks[0], chunks[2]))
    held.clear()
    assert [c() is None for c in chunks] == [True, True, True, False]   # the one filling
    assert np.all(arena.place(np.ones(64, np.uint8)) == 1)           # still fills it


def test_zeros_is_torch_zeros(switch):
    switch("1")
    pool = huge_pages.zeros((3, 5, 2, 16, 3, 64), torch.bfloat16)
    assert pool.shape == (3, 5, 2, 16, 3, 64) and pool.dtype == torch.bfloat16
    assert pool.is_contiguous() and pool.data_ptr() % huge_pages.HUGE == 0
    assert torch.count_nonzero(pool) == 0
    pool[1, 2] = 1.5                                     # writable, and only there
    assert torch.count_nonzero(pool) == 2 * 16 * 3 * 64
    assert huge_pages.zeros((0, 4), torch.float32).shape == (0, 4)


def fallbacks() -> int:
    """Huge page faults the kernel served with small pages (none free), so far."""
    with open("/proc/vmstat") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("thp_fault_fallback "))


@needs_thp
def test_arena_and_zeros_land_on_huge_pages(switch):
    switch("1")
    before = fallbacks()
    placed = huge_pages.Arena().place(np.ones(3 * huge_pages.HUGE, np.uint8))
    pool = huge_pages.zeros((5, huge_pages.HUGE), torch.uint8)
    pool.fill_(1)                                        # the first touch
    if fallbacks() != before:
        pytest.skip("the kernel had no free huge page to give (memory fragmented)")
    assert huge_kb(placed.ctypes.data) >= 2048
    assert huge_kb(pool.data_ptr()) >= 2048


def test_off_is_plain_allocations(switch):
    switch("0")
    a = np.arange(1 << 20, dtype=np.float32)
    assert huge_pages.ARENA.place(a) is a
    pool = huge_pages.zeros((4, huge_pages.HUGE), torch.float32)
    assert torch.count_nonzero(pool) == 0 and pool.shape == (4, huge_pages.HUGE)


def test_quant_blocks_on_huge_pages_keep_their_values(switch):
    switch("1")
    rng = np.random.default_rng(1)
    blocks = QuantBlocks("Q4_1", rng.integers(0, 256, (32, 4, 16), dtype=np.uint8),
                         rng.standard_normal((32, 4)).astype(np.float32),
                         rng.standard_normal((32, 4)).astype(np.float32)).in_lanes()
    moved = blocks.on_huge_pages()
    assert (moved.kind, moved.n) == (blocks.kind, blocks.n)
    for x, y in ((moved.q, blocks.q), (moved.d, blocks.d), (moved.m, blocks.m)):
        assert x.dtype == y.dtype and np.array_equal(x, y) and not np.shares_memory(x, y)
    assert np.array_equal(moved.dequantised(), blocks.dequantised())
