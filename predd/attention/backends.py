"""Attention backends over the paged cache, chosen once at start-up.

A backend's `prepare(tables)` runs once per step with the step's `PageTables` and
returns the per-layer callable the model uses: it writes the step's new K/V into their
reserved slots (predd/attention/slots.py, shared by every backend), then lets every new token
attend to all entries of its call before it and causally to the new tokens before it.
`torch` is the reference (CPU and CUDA); `cpu` is torch with predd's own kernel for
every row that reads a past (predd/kernels/cpu_kernels.py: no gather); `flashinfer` (CUDA,
predd/attention/flashinfer_backend.py) takes the same tables. `resolve` picks one for
`predd --attention auto|torch|cpu|flashinfer`; nothing on the per-token path asks which
backend runs.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from predd.kernels import cpu_kernels
from predd.worker.paged_kv import PagedKVCache
from predd.attention import flashinfer_backend
from predd.attention.flashinfer_backend import FlashInferAttention
from predd.attention.page_table import PageTables
from predd.attention.slots import StoreKV, slot_writer

CHOICES = ("auto", "torch", "cpu", "flashinfer")
CPU_DTYPES = ("float32", "bfloat16")            # the cpu kernel's

class TorchAttention:
    """Gathers each call's K and V a page at a time (one `index_select` per layer for
    all calls that decode one token, padded to the longest table and masked), lays them
    out head-major and runs two batched matmuls; longer chunks run one by one with SDPA, and a chunk that sees
    only itself (a fresh prefill) attends to its own K/V without any gather."""

    name = "torch"

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache

    def prepare(self, tables: PageTables) -> Callable:
        single, multi = tables.by_phase()
        return self._attend(tables, self._plan_decode(tables, single), multi)

    def _attend(self, tables: PageTables, rows: Callable, chunk_calls: list[int]) -> Callable:
        """The step's per-layer callable: the new K/V stored, then `rows(layer, q, out)`
        for the calls one kernel serves and one SDPA for each of `chunk_calls`."""
        store = self._slot_writer(tables)
        chunks = self._plan_chunks(tables, chunk_calls)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            store(layer, k, v)
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)   # [T, H, D]
            rows(layer, q, out)
            chunks(layer, q, k, v, out)
            return out

        return attend

    def _slot_writer(self, tables: PageTables) -> StoreKV:
        return slot_writer(self.cache, tables)

    def _plan_decode(self, tables: PageTables, calls: list[int]) -> Callable:
        """`run(layer, q, out)` for `calls`, one new token each: one gather straight into
        K and V as [2, Hkv, B, W*ps, D] (pages picked from the head-major view [2, Hkv,
        P, ps, D]), so that for each (kv head, call) both matmuls take one contiguous
        matrix."""
        if not calls:
            return lambda layer, q, out: None
        cache, dev, ps = self.cache, self.cache.device, self.cache.page_size
        table = tables.padded(calls)                                    # [B, W]
        pages = torch.from_numpy(table.reshape(-1)).to(dev)
        rows = torch.from_numpy(tables.qo_indptr[calls].astype(np.int64)).to(dev)
        lengths = torch.from_numpy(tables.kv_len[calls].astype(np.int64)).to(dev)
        pad = (torch.arange(table.shape[1] * ps, device=dev)[None, :]
               >= lengths[:, None])[None, :, None, :]                  # [1, B, 1, W*ps]
        kv_heads, head_dim = cache.kv[0].shape[-2:]
        shape = (2, kv_heads, len(calls), table.shape[1] * ps, head_dim)

        def run(layer: int, q: torch.Tensor, out: torch.Tensor) -> None:
            kv = cache.kv[layer].permute(1, 3, 0, 2, 4).index_select(2, pages).view(shape)
            kv = kv.to(q.dtype)
            out.index_copy_(0, rows, self._decode(q.index_select(0, rows), kv[0], kv[1], pad))

        return run

    def _plan_chunks(self, tables: PageTables, calls: list[int]) -> Callable:
        """`run(layer, q, k, v, out)` for `calls` of several new tokens, one SDPA each:
        causal over its own K/V when it sees only itself, else over its gathered
        entries with a mask."""
        cache, dev = self.cache, self.cache.device
        parts = []
        q_len = tables.q_len
        for i in calls:
            start, n, kv_len = int(tables.qo_indptr[i]), int(q_len[i]), int(tables.kv_len[i])
            past = kv_len - n
            if not past:                        # sees only itself: no gather, causal
                parts.append((start, n, None, None, kv_len))
                continue
            mask = (torch.arange(kv_len, device=dev)[None, :]
                    <= past + torch.arange(n, device=dev)[:, None])          # [n, L]
            pages_t = torch.from_numpy(tables.pages_of(i).astype(np.int64)).to(dev)
            parts.append((start, n, pages_t, mask, kv_len))

        def run(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor) -> None:
            paged = cache.kv[layer]                        # [P, 2, ps, Hkv, D]
            for start, n, pages_t, mask, kv_len in parts:
                qm = q[start:start + n].transpose(0, 1)[None]             # [1, H, n, D]
                if pages_t is None:
                    km, vm = k[start:start + n], v[start:start + n]       # [n, Hkv, D]
                    if cache.dtype != k.dtype:   # as the pool holds them (bf16 under f32)
                        km, vm = km.to(cache.dtype).to(k.dtype), vm.to(cache.dtype).to(k.dtype)
                else:
                    km = paged[:, 0].index_select(0, pages_t).flatten(0, 1)[:kv_len]
                    vm = paged[:, 1].index_select(0, pages_t).flatten(0, 1)[:kv_len]
                    km, vm = km.to(q.dtype), vm.to(q.dtype)
                o = F.scaled_dot_product_attention(
                    qm, km.transpose(0, 1)[None], vm.transpose(0, 1)[None],
                    attn_mask=mask, is_causal=mask is None, enable_gqa=True)
                out[start:start + n] = o[0].transpose(0, 1)

        return run

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


class CpuAttention(TorchAttention):
    """The torch backend with predd's own kernel (predd/kernels/cpu_kernels.py) for every call
    of up to `KERNEL_ROWS` new tokens: decode calls, chunks after a cached prefix and
    short fresh prefills attend over their pages in place (the new K/V are stored
    first), no gather and no per-call SDPA (measured: docs/kernels.md, "Attention reads
    the pool in place"). Longer chunks stay on SDPA, where a GEMM pays."""

    name = "cpu"
    KERNEL_ROWS = 64

    def __init__(self, cache: PagedKVCache) -> None:
        super().__init__(cache)
        self.kernel = cpu_kernels.kernels()

    def _slot_writer(self, tables: PageTables) -> StoreKV:
        """slot_writer's stores in one kernel call a layer (one copy per entry, cheaper
        than index_copy_ from qkv's strided views; measured: docs/kernels.md, "New K and
        V stored in one call a layer"), and slot_writer's own for K/V of a layout the
        kernel does not take."""
        fast = self.kernel.bind_store(self.cache.rows(tables.new_slots()), self.cache.page_size)
        kv = self.cache.kv
        slow: StoreKV | None = None       # built only if a layer needs it

        def store(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            nonlocal slow
            if not fast(kv[layer], k, v):
                slow = slow or slot_writer(self.cache, tables)
                slow(layer, k, v)

        return store

    def prepare(self, tables: PageTables) -> Callable:
        mine = np.flatnonzero(tables.q_len <= self.KERNEL_ROWS).tolist()   # (one diff)
        others = sorted(set(range(len(tables))) - set(mine))
        if not mine:
            return self._attend(tables, lambda layer, q, out: None, others)
        n, row_token, row_pages, row_visible = self.rows(tables, mine)
        kernel = self.kernel.bind_attention(tables.indices, row_token, row_pages, row_visible,
                                            int(row_visible.max()), call_rows=n,
                                            page_size=self.cache.page_size)
        paged = self.cache.kv
        return self._attend(tables, lambda layer, q, out: kernel(q, out, paged[layer]), others)

    @staticmethod
    def rows(tables: PageTables, calls: list[int]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For `calls`: (new tokens each, then per query row: its token, where its
        call's page table starts in `tables.indices`, the entries it sees), int64
        (`Kernels.plan_rows`: row j of a chunk of n after `past` entries sees past + j +
        1 of them)."""
        return cpu_kernels.kernels().plan_rows(tables.qo_indptr, tables.kv_len,
                                               tables.indptr, calls)


def cpu_problem(device: str, dtype: str) -> tuple[str, str] | None:
    """Why the cpu backend cannot run here, as (reason, errno name), or None; the reason
    reads after "cpu". Building its kernel is the last check (a compile, once)."""
    if device != "cpu":
        return f"is for the CPU, not {device}", "EINVAL"
    if dtype not in CPU_DTYPES:
        return f"computes only in {' or '.join(CPU_DTYPES)}, not {dtype}", "EINVAL"
    problem = cpu_kernels.problem()
    if problem:
        return f"kernel unavailable: {problem}", "ENOPKG"
    return None


def resolve(requested: str, device: str, dtype: str) -> tuple[str, str]:
    """(backend name, why) for `--attention requested` on `device` computing in `dtype`
    (a name from predd.model.dtype.DTYPES). `auto` is flashinfer on CUDA and cpu on the CPU
    where they can run, else torch. Raises ValueError with an errno-named message when
    the asked-for one cannot run."""
    if requested not in CHOICES:
        raise ValueError(f"--attention must be one of {', '.join(CHOICES)}, "
                         f"not {requested!r} (EINVAL)")
    if requested == "torch":
        return "torch", "asked for"
    if requested == "auto":
        name = "cpu" if device == "cpu" else "flashinfer"
    else:
        name = requested
    problem = (cpu_problem if name == "cpu" else flashinfer_backend.flashinfer_problem)(
        device, dtype)
    if requested != "auto":
        if problem:
            raise ValueError(f"--attention {name} {problem[0]} ({problem[1]})")
        return name, "asked for"
    if problem:
        return "torch", f"auto: {name} {problem[0]}"
    return name, ("auto: predd's CPU kernel builds and agrees with torch here" if name == "cpu"
                  else "auto: CUDA and flashinfer are here")


def make_backend(name: str, cache: PagedKVCache):
    """The backend `name` (`auto` is resolved here) over `cache`; ValueError as `resolve`."""
    dtype = str(cache.dtype).removeprefix("torch.")
    name, _ = resolve(name, str(cache.device), dtype)
    if name == "flashinfer":
        return FlashInferAttention(cache)
    if name == "cpu":
        return CpuAttention(cache)
    return TorchAttention(cache)
