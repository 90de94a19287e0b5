"""The K/V data of every tier, addressed by page id: the KV store's `PageData`.

The device tier is the runner's paged cache (predd/worker/paged_kv.py, reached through its
`PageData` methods only); the host tier an array in host memory,
`[host_pages, layers, 2, page_size, kv_heads, head_dim]` in the cache's dtype (bf16 as
its raw uint16 bits, as exports carry it); the disk tier the same shape in a file under
the swap directory, unlinked as soon as it is mapped (so a killed predd
leaves nothing behind; swap is not persistence — kvfsd's fsync is). Pages move between
tiers whole (`move`); the KV store reads and writes entries as flat slot ids of page ids
(`page * page_size + offset`) and never needs to know where a page is: reads work from
any tier, and writes only ever go to fresh pages, which are on the device.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from symphony_protocol import ProtocolError
from predd.memory.kvstore import PageData
from predd.memory.pool import DEVICE, HOST, TIER_NAMES, Pool


class TierStore:
    def __init__(self, pool: Pool, device: PageData, swap_dir: str | None = None) -> None:
        self.pool = pool
        self.device = device
        d = device.describe()
        _, host_pages, disk_pages = pool.capacity
        self.dtype = np.dtype(d["numpy_dtype"])   # bf16 is kept as its raw uint16 bits
        self.page_shape = (d["layers"], 2, pool.page_size, d["kv_heads"], d["head_dim"])
        self.bytes_per_page = int(np.prod(self.page_shape)) * self.dtype.itemsize
        self.host = np.zeros((host_pages, *self.page_shape), self.dtype) \
            if host_pages else None
        self.disk = _swap_file(swap_dir, disk_pages, self.page_shape, self.dtype) \
            if disk_pages else None

    # ------------------------------------------------------------ whole pages

    def move(self, pages: list[int], tier: int) -> int:
        """Move `pages` (none already in `tier`) to `tier`, keeping their ids; bytes
        copied. Raises ENOSPC, moving nothing, when `tier` lacks room."""
        if len(pages) > self.pool.free_in(tier):
            raise ProtocolError("ENOSPC", f"no room in the {TIER_NAMES[tier]} tier for "
                                f"{len(pages)} pages")
        by_tier: dict[int, list[int]] = {}
        for page in pages:
            by_tier.setdefault(int(self.pool.tier[page]), []).append(page)
        for source, group in by_tier.items():
            assert source != tier, "move of a page to its own tier"
            data = self._read(source, self.pool.slot[group].astype(np.int64))
            _, new = self.pool.relocate(group, tier)
            self._write(tier, new.astype(np.int64), data)
        return len(pages) * self.bytes_per_page

    def _page_slots(self, slots: np.ndarray) -> np.ndarray:
        ps = self.pool.page_size
        return (slots[:, None] * ps + np.arange(ps)).ravel()

    def _read(self, tier: int, slots: np.ndarray) -> np.ndarray:
        """Whole pages of `tier`: [n, layers, 2, page_size, kv_heads, head_dim]."""
        if tier == DEVICE:
            layers, _, ps, heads, dim = self.page_shape
            data = self.device.read_slots(self._page_slots(slots))   # [L, 2, n*ps, H, D]
            return data.reshape(layers, 2, len(slots), ps, heads, dim).transpose(2, 0, 1, 3, 4, 5)
        return (self.host if tier == HOST else self.disk)[slots]

    def _write(self, tier: int, slots: np.ndarray, data: np.ndarray) -> None:
        if tier == DEVICE:
            layers, _, ps, heads, dim = self.page_shape
            flat = np.ascontiguousarray(data.transpose(1, 2, 0, 3, 4, 5))
            self.device.write_slots(self._page_slots(slots),
                                    flat.reshape(layers, 2, len(slots) * ps, heads, dim))
        else:
            (self.host if tier == HOST else self.disk)[slots] = data

    # ------------------------------------------------------------ PageData (entries)

    def _split(self, slots: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """Flat slot ids of pages -> per tier: (tier, where in `slots`, tier page slots,
        offsets in the page)."""
        slots = np.asarray(slots, dtype=np.int64)
        ps = self.pool.page_size
        pages, offsets = slots // ps, slots % ps
        tiers = self.pool.tier[pages]
        out = []
        for tier in np.unique(tiers):
            where = np.nonzero(tiers == tier)[0]
            out.append((int(tier), where, self.pool.slot[pages[where]].astype(np.int64),
                        offsets[where]))
        return out

    def _device(self, slots: np.ndarray) -> np.ndarray:
        """Flat device slots of flat page slots that must all be on the device."""
        slots = np.asarray(slots, dtype=np.int64)
        ps = self.pool.page_size
        return self.pool.device_slots(slots // ps).astype(np.int64) * ps + slots % ps

    def copy_slots(self, src: np.ndarray, dst: np.ndarray) -> None:
        if len(src) == 0:
            return
        if np.all(self.pool.tier[np.asarray(src) // self.pool.page_size] == DEVICE):
            self.device.copy_slots(self._device(src), self._device(dst))
        else:
            self.write_slots(dst, self.read_slots(src))

    def read_slots(self, slots: np.ndarray) -> np.ndarray:
        """[layers, 2, n, kv_heads, head_dim] as numpy (bf16 as its raw uint16 bits)."""
        n = len(slots)
        parts = self._split(slots)
        if len(parts) == 1 and parts[0][0] == DEVICE:
            return self.device.read_slots(self._device(slots))
        layers, _, _, heads, dim = self.page_shape
        out = np.empty((layers, 2, n, heads, dim), dtype=self.dtype)
        for tier, where, pslots, offsets in parts:
            if tier == DEVICE:
                out[:, :, where] = self.device.read_slots(pslots * self.pool.page_size + offsets)
                continue
            # [n, layers, 2, kv_heads, head_dim]: the two index arrays' dim comes first
            data = (self.host if tier == HOST else self.disk)[pslots, :, :, offsets]
            out[:, :, where] = np.moveaxis(data, 0, 2)
        return out

    def write_slots(self, slots: np.ndarray, data: np.ndarray) -> None:
        self.device.write_slots(self._device(slots), data)

    def describe(self) -> dict:
        return self.device.describe()


def _swap_file(directory: str | None, pages: int, page_shape: tuple[int, ...],
               dtype: np.dtype) -> np.memmap:
    """A sparse file of `pages` pages, mapped and already unlinked."""
    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="predd-swap-", suffix=".kv",
                                     delete=True) as f:
        f.truncate(pages * int(np.prod(page_shape)) * dtype.itemsize)
        return np.memmap(f, dtype=dtype, mode="r+", shape=(pages, *page_shape))
