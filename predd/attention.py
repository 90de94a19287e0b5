"""Attention backends over the paged cache, chosen once at start-up.

A backend's `prepare(tables)` runs once per step with the step's `PageTables` and
returns the per-layer callable the model uses: it writes the step's new K/V into their
reserved slots, then lets every new token attend to all entries of its call before it
and causally to the new tokens before it. `torch` is the reference (CPU and CUDA);
`flashinfer` (CUDA) plugs in here, taking the same tables.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from predd.paged_kv import PagedKVCache
from predd.page_table import PageTables


class TorchAttention:
    """Gathers each call's K and V a page at a time (one `index_select` per layer for
    all calls that decode one token, padded to the longest table and masked) and runs
    two batched matmuls; longer chunks run one by one with SDPA, and a chunk that sees
    only itself (a fresh prefill) attends to its own K/V without any gather."""

    name = "torch"

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def prepare(self, tables: PageTables) -> Callable:
        cache, dev = self.cache, self.cache.device
        ps = cache.page_size
        new_rows = torch.from_numpy(cache.rows(tables.new_slots())).to(dev)
        q_len = tables.q_len
        single = [i for i in range(len(tables)) if q_len[i] == 1]
        multi = [i for i in range(len(tables)) if q_len[i] > 1]

        if single:
            table = tables.padded(single)                           # [B, W]
            width = int(tables.kv_len[single].max())                # <= W * ps
            pages = torch.from_numpy(table.reshape(-1)).to(dev)
            single_q = torch.from_numpy(tables.qo_indptr[single].astype(np.int64)).to(dev)
            lengths = torch.from_numpy(tables.kv_len[single].astype(np.int64)).to(dev)
            single_pad = (torch.arange(width, device=dev)[None, :] >= lengths[:, None]
                          )[:, None, None, :]                       # [B, 1, 1, W*ps]
            single_shape = (len(single), table.shape[1] * ps, *cache.flat(0).shape[1:])

        multi_parts = []
        for i in multi:
            start, n, kv_len = int(tables.qo_indptr[i]), int(q_len[i]), int(tables.kv_len[i])
            past = kv_len - n
            if not past:                        # sees only itself: no gather, causal
                multi_parts.append((start, n, None, None, kv_len))
                continue
            mask = (torch.arange(kv_len, device=dev)[None, :]
                    <= past + torch.arange(n, device=dev)[:, None])          # [n, L]
            pages_t = torch.from_numpy(tables.pages_of(i).astype(np.int64)).to(dev)
            multi_parts.append((start, n, pages_t, mask, kv_len))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            flat = cache.flat(layer)                       # [P*2*ps, Hkv, D]
            flat.index_copy_(0, new_rows, k)
            flat.index_copy_(0, new_rows + ps, v)
            paged = cache.kv[layer]                        # [P, 2, ps, Hkv, D]
            out = torch.empty_like(q)                      # [T, H, D]
            if single:
                ks = paged[:, 0].index_select(0, pages).view(single_shape)[:, :width]
                vs = paged[:, 1].index_select(0, pages).view(single_shape)[:, :width]
                out.index_copy_(0, single_q, self._decode(
                    q.index_select(0, single_q), ks, vs, single_pad))
            for start, n, pages_t, mask, kv_len in multi_parts:
                qm = q[start:start + n].transpose(0, 1)[None]             # [1, H, n, D]
                if pages_t is None:
                    km, vm = k[start:start + n], v[start:start + n]       # [n, Hkv, D]
                else:
                    km = paged[:, 0].index_select(0, pages_t).flatten(0, 1)[:kv_len]
                    vm = paged[:, 1].index_select(0, pages_t).flatten(0, 1)[:kv_len]
                o = F.scaled_dot_product_attention(
                    qm, km.transpose(0, 1)[None], vm.transpose(0, 1)[None],
                    attn_mask=mask, is_causal=mask is None, enable_gqa=True)
                out[start:start + n] = o[0].transpose(0, 1)
            return out

        return attend

    @staticmethod
    def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor
                ) -> torch.Tensor:
        """One new token per call: q [B, H, D], k/v [B, L, Hkv, D] -> [B, H, D].
        Two batched matmuls; on CPU ~8x faster than SDPA with a padding mask."""
        b, h, d = q.shape
        kv_heads = k.shape[2]
        qg = q.view(b, kv_heads, h // kv_heads, d)                     # head i reads kv i//G
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)) * d ** -0.5    # [B, Hkv, G, L]
        scores = scores.masked_fill(pad, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v.transpose(1, 2)).view(b, h, d)    # [B, Hkv, G, D]


BACKENDS = {"torch": TorchAttention}


def make_backend(name: str, cache: PagedKVCache) -> TorchAttention:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(BACKENDS)}")
    return BACKENDS[name](cache)
