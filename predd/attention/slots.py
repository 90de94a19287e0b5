"""Writing a step's new K/V into the slots the engine reserved for them, shared by every
attention backend (predd/attention/backends.py, predd/attention/flashinfer_backend.py)
and by CUDA graphs of decode steps (predd/worker/cuda_graphs.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from predd.attention.page_table import PageTables
from predd.worker.paged_kv import PagedKVCache

StoreKV = Callable[[int, torch.Tensor, torch.Tensor], None]


def slot_writer(cache: PagedKVCache, tables: PageTables) -> StoreKV:
    """`store(layer, k, v)` writes the step's new K/V ([T, Hkv, D], flat-batch order)
    into the slots the engine reserved for them; the row ids are computed once a step."""
    return row_writer(cache, torch.from_numpy(cache.rows(tables.new_slots())).to(cache.device))


def row_writer(cache: PagedKVCache, k_rows: torch.Tensor) -> StoreKV:
    """`store(layer, k, v)` writing row i of k and v at K row `k_rows[i]` of
    `cache.flat(layer)` and its V `page_size` rows later (a CUDA graph's static rows)."""
    v_rows = k_rows + cache.page_size

    def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = cache.flat(layer)                           # [P*2*ps, Hkv, D]
        flat.index_copy_(0, k_rows, k.to(flat.dtype))     # (rounded where the pool is
        flat.index_copy_(0, v_rows, v.to(flat.dtype))     # bf16 under float32 rows)

    return store
