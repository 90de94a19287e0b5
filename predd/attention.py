"""Attention backends over the paged cache, chosen once at start-up.

A backend's `prepare(tables)` runs once per step with the step's `PageTables` and
returns the per-layer callable the model uses: it writes the step's new K/V into their
reserved slots (`slot_writer`, shared by every backend), then lets every new token
attend to all entries of its call before it and causally to the new tokens before it.
`torch` is the reference (CPU and CUDA); `flashinfer` (CUDA, predd/attention_flashinfer.py)
takes the same tables. `resolve` picks one for `predd --attention auto|torch|flashinfer`;
nothing on the per-token path asks which backend runs.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from predd.paged_kv import PagedKVCache
from predd.page_table import PageTables

CHOICES = ("auto", "torch", "flashinfer")
FLASHINFER_DTYPES = ("bfloat16", "float16")      # its kernels have no float32 variant

StoreKV = Callable[[int, torch.Tensor, torch.Tensor], None]


def slot_writer(cache: PagedKVCache, tables: PageTables) -> StoreKV:
    """`store(layer, k, v)` writes the step's new K/V ([T, Hkv, D], flat-batch order)
    into the slots the engine reserved for them; the row ids are computed once a step."""
    k_rows = torch.from_numpy(cache.rows(tables.new_slots())).to(cache.device)
    v_rows = k_rows + cache.page_size

    def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = cache.flat(layer)                           # [P*2*ps, Hkv, D]
        flat.index_copy_(0, k_rows, k)
        flat.index_copy_(0, v_rows, v)

    return store


class TorchAttention:
    """Gathers each call's K and V a page at a time (one `index_select` per layer for
    all calls that decode one token, padded to the longest table and masked), lays them
    out head-major and runs two batched matmuls; longer chunks run one by one with SDPA, and a chunk that sees
    only itself (a fresh prefill) attends to its own K/V without any gather."""

    name = "torch"

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def prepare(self, tables: PageTables) -> Callable:
        cache, dev = self.cache, self.cache.device
        ps = cache.page_size
        store = slot_writer(cache, tables)
        q_len = tables.q_len
        single, multi = tables.by_phase()

        if single:
            table = tables.padded(single)                           # [B, W]
            pages = torch.from_numpy(table.reshape(-1)).to(dev)
            single_q = torch.from_numpy(tables.qo_indptr[single].astype(np.int64)).to(dev)
            lengths = torch.from_numpy(tables.kv_len[single].astype(np.int64)).to(dev)
            single_pad = (torch.arange(table.shape[1] * ps, device=dev)[None, :]
                          >= lengths[:, None])[None, :, None, :]    # [1, B, 1, W*ps]
            kv_heads, head_dim = cache.kv[0].shape[-2:]
            single_shape = (2, kv_heads, len(single), table.shape[1] * ps, head_dim)

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
            store(layer, k, v)
            paged = cache.kv[layer]                        # [P, 2, ps, Hkv, D]
            out = torch.empty_like(q)                      # [T, H, D]
            if single:
                # One gather straight into K and V as [2, Hkv, B, W*ps, D] (pages picked
                # from the head-major view [2, Hkv, P, ps, D]): each (kv head, call) one
                # contiguous matrix, so both matmuls run without another copy.
                kv = (paged.permute(1, 3, 0, 2, 4).index_select(2, pages)
                      .view(single_shape))
                out.index_copy_(0, single_q, self._decode(
                    q.index_select(0, single_q), kv[0], kv[1], single_pad))
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
        """One new token per call: q [B, H, D]; k, v [Hkv, B, L, D] (kv head-major, then
        call); pad [1, B, 1, L] -> [B, H, D]. Two batched matmuls, the G query heads
        that share a kv head as one [G, D] block; on CPU ~8x faster than SDPA with a
        padding mask."""
        b, h, d = q.shape
        kv_heads, _, length, _ = k.shape
        g = h // kv_heads
        qg = q.view(b, kv_heads, g, d).transpose(0, 1).reshape(kv_heads * b, g, d)
        scores = torch.bmm(qg, k.view(kv_heads * b, length, d).transpose(1, 2))
        scores = (scores * d ** -0.5).view(kv_heads, b, g, length).masked_fill(
            pad, float("-inf"))                                     # head i reads kv i//G
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs.view(kv_heads * b, g, length), v.view(kv_heads * b, length, d))
        return out.view(kv_heads, b, g, d).transpose(0, 1).reshape(b, h, d)


def flashinfer_problem(device: str, dtype: str) -> tuple[str, str] | None:
    """Why the flashinfer backend cannot run here, as (reason, errno name), or None;
    the reason reads after "flashinfer". Checked in this order so that a CPU machine
    never imports flashinfer."""
    if not device.startswith("cuda"):
        return f"needs a CUDA device, not {device}", "EINVAL"
    if dtype not in FLASHINFER_DTYPES:
        return (f"computes only in {' or '.join(FLASHINFER_DTYPES)}, not {dtype} "
                "(pass --dtype bfloat16)", "EINVAL")
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:        # ImportError, or a broken CUDA install underneath
        return f"is not importable ({type(exc).__name__}: {exc})", "ENOPKG"
    return None


def resolve(requested: str, device: str, dtype: str) -> tuple[str, str]:
    """(backend name, why) for `--attention requested` on `device` computing in `dtype`
    (a name from predd.dtype.DTYPES). `auto` is flashinfer where it can run, else torch.
    Raises ValueError with an errno-named message when the asked-for one cannot run."""
    if requested not in CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(CHOICES)}, "
                         f"not {requested!r} (EINVAL)")
    if requested == "torch":
        return "torch", "asked for"
    problem = flashinfer_problem(device, dtype)
    if requested == "flashinfer":
        if problem:
            raise ValueError(f"--attention flashinfer {problem[0]} ({problem[1]})")
        return "flashinfer", "asked for"
    if problem:
        return "torch", f"auto: flashinfer {problem[0]}"
    return "flashinfer", "auto: CUDA and flashinfer are here"


def make_backend(name: str, cache: PagedKVCache):
    """The backend `name` (`auto` is resolved here) over `cache`; ValueError as `resolve`."""
    dtype = str(cache.dtype).removeprefix("torch.")
    name, _ = resolve(name, str(cache.device), dtype)
    if name == "flashinfer":
        from predd.attention_flashinfer import FlashInferAttention
        return FlashInferAttention(cache)
    return TorchAttention(cache)
