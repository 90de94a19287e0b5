"""predd's CPU kernels library, loaded and typed, on CPU tensors (`Kernels`): the calls
into predd/kernels/csrc/ through the bindings (bindings.py), each checking its tensors'
dtypes, shapes and layout before it passes their pointers, and the step plans those calls
take (attention's rows and blocks, shared prefixes). Loading, probing and `CpuOps` are
predd/kernels/cpu_kernels.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from predd.kernels import bindings

SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}    # the kernels' dtypes
# A call of ATTENTION_BLOCK_ROWS new tokens or more attends in blocks of 16 query vectors
# (predd/kernels/csrc/attention_tiles.c, `bind_attention`) where they run. Rows of the row
# kernel whose tables begin with the same SHARED_PAGES pages or more (forks of one cached
# document, B2), SHARED_ROWS of them or more, attend to those pages together in blocks
# first (`SharedPrefixes`; cascade attention). The limits were measured per kind of
# blocks with scripts/bench_attention.py (docs/kernels.md, "Attention in blocks of 16 query
# rows").
ATTENTION_BLOCK_ROWS = 4
SHARED_ROWS = 6
SHARED_PAGES = 16


@dataclass(frozen=True)
class BlockLimits:
    """From how many rows of a call (`rows`), and how many rows over how many shared
    pages (`shared_rows`, `shared_pages`), attention takes the blocks of 16 query vectors
    rather than the row kernel: by the kind of blocks (`Kernels.attention_blocks`)."""
    rows: int
    shared_rows: int
    shared_pages: int


BLOCK_LIMITS = {
    "tiles": BlockLimits(ATTENTION_BLOCK_ROWS, SHARED_ROWS, SHARED_PAGES),   # AMX
    # VDPBF16PS dot products and float32 multiply-adds: forks read shared pages together
    # only from 16 rows (the row kernel already reads each entry once for a row's heads)
    "dots": BlockLimits(ATTENTION_BLOCK_ROWS, 16, 16),
}


@dataclass
class SharedPrefixes:
    """Groups of the row kernel's rows whose page tables begin with the same pages
    (`Kernels.shared_prefixes`): group g is rows index[row[g] : row[g] + rows[g]], their
    first pages[g] pages the same and seen whole by each; `start`, per row, the entries
    those pages hold (0 for a row in no group). `prior` holds, per row and query head,
    the prefix's part of the softmax (shared_prefix_tiles_bf16) for the row kernel to
    finish. All int64 and contiguous."""
    index: np.ndarray
    row: np.ndarray
    rows: np.ndarray
    pages: np.ndarray
    start: np.ndarray
    prior: np.ndarray | None = None      # [rows, heads, head_dim + 2] float32, made by `buffer`

    def buffer(self, heads: int, head_dim: int) -> np.ndarray:
        shape = (len(self.start), heads, head_dim + 2)
        if self.prior is None or self.prior.shape != shape:
            self.prior = np.empty(shape, dtype=np.float32)
        return self.prior


class Kernels:
    """The loaded library, on CPU tensors: paged attention (`attend`, `bind_attention`)
    and the step's K/V store (`bind_store`), a layer's small ops (`add_rms_norm`,
    `rope`, `silu_mul`), all in float32 or bfloat16; projections from quantised blocks
    (`quant_linear`, `bind`: float32 rows, bfloat16 where `bf16_blocks`); the greedy
    pick of logits rows (`greedy_pick`, float32)."""

    def __init__(self, path: Path) -> None:
        lib = bindings.load(path)
        self.path = path
        self._typed = {(op, dtype): getattr(lib, f"{op}_{t}")
                       for op in bindings.TYPED for dtype, t in SUFFIX.items()}
        self._lib = lib
        # how the block kernels multiply bfloat16 rows: "vdpbf16ps" (bf16 dot products),
        # "fma" (AVX2: float32 FMAs of the same products), or None (they take none)
        self.bf16_dots = (None, "fma", "vdpbf16ps")[lib.linear_bf16_dots()]
        self.bf16_blocks = self.bf16_dots is not None
        # how the int8 block kernels (predd/kernels/csrc/quant_int8.c) sum: "vnni" (VPDPBUSD),
        # "avx2" (VPMADDUBSW), or "portable" (C loops, for a CPU without AVX2)
        self.int8_dots = ("portable", "avx2", "vnni")[lib.linear_int8_vector()]
        self.shared_prefix = True     # `shared_prefixes` plans groups (predd --cascade)

    @property
    def bf16_tiles(self) -> bool:
        """Whether the bf16 block kernels multiply 2 rows or more with AMX tiles (the CPU
        has them, the OS granted them, and they are not turned off)."""
        return self.bf16_blocks and bool(self._lib.linear_bf16_tiles(-1))

    @property
    def bf16_lanes(self) -> bool:
        """Whether a bfloat16 model holds its Q4_1 blocks in lanes (`QuantBlocks.in_lanes`)
        for predd/kernels/csrc/quant_lanes.c: where the CPU has bf16 dot products and the block
        kernels no AMX tiles (which read the tiles' own layout)."""
        return self.bf16_blocks and not self.bf16_tiles

    def use_bf16_tiles(self, use: bool) -> bool:
        """Turns the AMX tiles of the bf16 block kernels on or off for this process (off:
        the dot-product kernel at every row count), and attention's blocks with them
        (off: the row kernel for every row); whether the tiles are used now."""
        self._lib.linear_bf16_tiles(int(use))
        self._lib.attention_tiles_bf16(int(use))
        return self.bf16_tiles

    @property
    def attention_blocks(self) -> str | None:
        """How attention computes blocks of 16 query vectors (chunks, shared prefixes):
        "tiles" (AMX), "dots" (AVX-512 bf16 dot products), or None (not here, or turned
        off: the row kernel for every row)."""
        return {2: "tiles", 1: "dots"}.get(self._lib.attention_tiles_bf16(-1))

    @property
    def block_limits(self) -> BlockLimits | None:
        """The limits of this process's kind of attention blocks (None: no blocks)."""
        return BLOCK_LIMITS.get(self.attention_blocks or "")

    def attend(self, q: torch.Tensor, out: torch.Tensor, paged: torch.Tensor,
               indices: np.ndarray, row_token: np.ndarray, row_pages: np.ndarray,
               row_visible: np.ndarray, max_visible: int) -> None:
        """Row r of the query rows (`row_token[r]`, a token of q [T, H, D] and of out, a
        contiguous [T, H, D]) attends to the first `row_visible[r]` entries of the page
        table starting at `indices[row_pages[r]]`, in `paged` [P, 2, ps, Hkv, D] (one
        layer of the pool). The arrays are int32 (indices) and int64, contiguous."""
        self.bind_attention(indices, row_token, row_pages, row_visible, max_visible)(q, out, paged)

    def bind_attention(self, indices: np.ndarray, row_token: np.ndarray, row_pages: np.ndarray,
                       row_visible: np.ndarray, max_visible: int,
                       call_rows: np.ndarray | None = None, page_size: int = 0
                       ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """`attend` with one step's rows fixed (their pointers taken once), for every
        layer: `run(q, out, paged)`. `call_rows`: how many rows each call has, in row
        order (each call's rows consecutive tokens); a call of `block_limits.rows` or
        more then takes the block kernel (predd/kernels/csrc/attention_tiles.c: AMX tiles or bf16
        dot products) where it runs: bf16, pages of 16, head_dim a multiple of 64.
        `page_size` (the pool's): the other rows' shared prefixes (`shared_prefixes`) go
        to the blocks first."""
        split = self.tile_calls(call_rows, row_token, row_pages, row_visible)
        if split is None:
            return self._bind_rows(indices, row_token, row_pages, row_visible, max_visible,
                                   page_size)
        # where the chunks' tiles fail at run time, every row takes the row kernel, with
        # no shared prefixes (those tiles would fail too)
        vector = self._bind_rows(indices, row_token, row_pages, row_visible, max_visible)
        call_row, chunk_rows, rest = split
        others = (self._bind_rows(indices, *rest, max_visible, page_size) if len(rest[0])
                  else None)
        tables = (indices.ctypes.data, row_token.ctypes.data, row_pages.ctypes.data,
                  row_visible.ctypes.data, call_row.ctypes.data, chunk_rows.ctypes.data,
                  len(chunk_rows), max_visible)
        tiles = self._lib.paged_attention_tiles_bf16

        def run(q: torch.Tensor, out: torch.Tensor, paged: torch.Tensor) -> None:
            _, _, page_size, kv_heads, head_dim = paged.shape
            if (q.dtype == torch.bfloat16 and out.dtype == q.dtype and paged.dtype == q.dtype
                    and q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous()
                    and paged.is_contiguous() and q.is_cpu
                    and tiles(q.data_ptr(), q.stride(0), out.data_ptr(), paged.data_ptr(),
                              page_size, kv_heads, q.shape[1], head_dim, *tables,
                              head_dim ** -0.5) == 0):
                if others is not None:
                    others(q, out, paged)
                return
            vector(q, out, paged)            # not a shape the tiles take: every row here

        run.keeps = (vector, others, call_row, chunk_rows, indices, row_token, row_pages,
                     row_visible)
        return run

    def tile_calls(self, call_rows: np.ndarray | None, row_token: np.ndarray,
                   row_pages: np.ndarray, row_visible: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]] | None:
        """The calls of `call_rows` (rows each, in row order) that the block kernel takes
        (`block_limits.rows` or more, where the blocks run: on AMX tiles or by dot
        products): (their first rows, their row counts, (row_token, row_pages,
        row_visible) of the rows left to the row kernel); None where it takes none. Every
        array int64 and contiguous (predd/kernels/csrc/step_plan.c: plan_tiles)."""
        limits = self.block_limits
        if call_rows is None or limits is None:
            return None
        call_rows = np.ascontiguousarray(call_rows, dtype=np.int64)
        rows = [np.ascontiguousarray(a, dtype=np.int64) for a in (row_token, row_pages,
                                                                   row_visible)]
        firsts, counts = np.empty(len(call_rows), np.int64), np.empty(len(call_rows), np.int64)
        rest, left = [np.empty(len(rows[0]), np.int64) for _ in range(3)], np.zeros(1, np.int64)
        calls = self._lib.plan_tiles(call_rows.ctypes.data, len(call_rows), limits.rows,
                                     *(a.ctypes.data for a in rows), firsts.ctypes.data,
                                     counts.ctypes.data, *(a.ctypes.data for a in rest),
                                     left.ctypes.data)
        if not calls:
            return None
        return firsts[:calls], counts[:calls], tuple(a[:int(left[0])] for a in rest)

    def plan_limits(self) -> tuple[int, int, int]:
        """What a step's plan takes from `block_limits` (read once): (the rows from which
        a call goes to the blocks, 0 where they do not run; the whole pages and the rows
        a shared prefix group needs at least, 0 and 0 where none are planned: off (predd
        --cascade off), or no blocks here)."""
        limits = self.block_limits
        if limits is None:
            return 0, 0, 0
        if not self.shared_prefix:
            return limits.rows, 0, 0
        return limits.rows, limits.shared_pages, limits.shared_rows

    def shared_prefixes(self, indices: np.ndarray, row_pages: np.ndarray,
                        row_visible: np.ndarray, page_size: int) -> SharedPrefixes | None:
        """The groups of these rows (the row kernel's) that attend to a shared prefix
        first: rows whose page tables begin with the same pages, `shared_pages` whole
        pages or more before each one's last entry, `shared_rows` rows or more
        (`block_limits`; the rows are grouped by their first page; a group's prefix is
        what all its rows share). None: no such group, or the blocks do not run here
        (predd/kernels/csrc/step_plan.c: plan_prefixes)."""
        _, pages, least = self.plan_limits()
        n = len(row_pages)
        if not (least and page_size) or n < 2:
            return None
        row_pages = np.ascontiguousarray(row_pages, dtype=np.int64)
        row_visible = np.ascontiguousarray(row_visible, dtype=np.int64)
        index, row, rows, held, start, order = (np.empty(n, np.int64) for _ in range(6))
        groups = self._lib.plan_prefixes(
            np.ascontiguousarray(indices, dtype=np.int32).ctypes.data, row_pages.ctypes.data,
            row_visible.ctypes.data, n, page_size, pages, least, index.ctypes.data,
            row.ctypes.data, rows.ctypes.data, held.ctypes.data, start.ctypes.data,
            order.ctypes.data)
        if not groups:
            return None
        return SharedPrefixes(index[:int(row[groups - 1] + rows[groups - 1])],
                              row[:groups], rows[:groups], held[:groups], start)

    def plan_rows(self, qo_indptr: np.ndarray, kv_len: np.ndarray, indptr: np.ndarray,
                  calls: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For `calls` of a step's tables (PageTables' int32 arrays): (new tokens each,
        then per query row: its token, where its call's page table starts in
        `indices`, the entries it sees), int64 (predd/kernels/csrc/step_plan.c: plan_rows)."""
        at = np.asarray(calls, dtype=np.int64)
        rows = int(sum(qo_indptr[c + 1] - qo_indptr[c] for c in calls))
        n = np.empty(len(at), np.int64)
        token, pages, visible = (np.empty(rows, np.int64) for _ in range(3))
        most = np.zeros(1, np.int64)
        arrays = [np.ascontiguousarray(a, dtype=np.int32) for a in (qo_indptr, kv_len, indptr)]
        self._lib.plan_rows(*(a.ctypes.data for a in arrays), at.ctypes.data, len(at),
                            token.ctypes.data, pages.ctypes.data, visible.ctypes.data,
                            n.ctypes.data, most.ctypes.data)
        return n, token, pages, visible

    def attend_shared(self, shared: SharedPrefixes, q: int, q_stride: int, paged: int,
                      page_size: int, kv_heads: int, heads: int, head_dim: int,
                      indices: np.ndarray, row_token: np.ndarray, row_pages: np.ndarray
                      ) -> tuple[int | None, int | None]:
        """shared_prefix_tiles_bf16 for `shared`'s groups (q and paged: addresses of
        bf16 data): the row kernel's last two arguments, (start, prior), None and None
        where the tiles did not run."""
        prior = shared.buffer(heads, head_dim)
        if self._lib.shared_prefix_tiles_bf16(
                q, q_stride, paged, page_size, kv_heads, heads, head_dim, indices.ctypes.data,
                row_token.ctypes.data, row_pages.ctypes.data, shared.index.ctypes.data,
                shared.row.ctypes.data, shared.rows.ctypes.data, shared.pages.ctypes.data,
                len(shared.rows), head_dim ** -0.5, prior.ctypes.data) != 0:
            return None, None
        return shared.start.ctypes.data, prior.ctypes.data

    @staticmethod
    def row_span(rows: int, kv_heads: int) -> int:
        """The row kernel's kv heads a task: all of them (each entry read once) when
        there are rows enough for the threads, else one (a task per row and kv head)."""
        return kv_heads if rows >= 2 * torch.get_num_threads() else 1

    def _bind_rows(self, indices: np.ndarray, row_token: np.ndarray, row_pages: np.ndarray,
                   row_visible: np.ndarray, max_visible: int, page_size: int = 0
                   ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """bind_attention by paged_attention.c (a task per row), after their shared
        prefixes on tiles where there are any."""
        rows = len(row_token)
        shared = self.shared_prefixes(indices, row_pages, row_visible, page_size)
        tables = (indices.ctypes.data, row_token.ctypes.data, row_pages.ctypes.data,
                  row_visible.ctypes.data, rows, max_visible)

        def run(q: torch.Tensor, out: torch.Tensor, paged: torch.Tensor) -> None:
            _, _, page_size, kv_heads, head_dim = paged.shape
            op = self._attention_op(q.dtype, paged.dtype)
            if (op is None or out.dtype != q.dtype
                    or q.stride(2) != 1 or q.stride(1) != head_dim or not out.is_contiguous()
                    or not paged.is_contiguous() or not q.is_cpu):
                raise ValueError("paged_attention takes float32 or bfloat16 rows of "
                                 "contiguous heads and out, over a pool of their dtype or "
                                 "(float32 rows) of bfloat16")
            span = self.row_span(rows, kv_heads)
            start = prior = None
            if shared is not None and q.dtype == torch.bfloat16:
                start, prior = self.attend_shared(
                    shared, q.data_ptr(), q.stride(0), paged.data_ptr(), page_size, kv_heads,
                    q.shape[1], head_dim, indices, row_token, row_pages)
            status = op(
                q.data_ptr(), q.stride(0), out.data_ptr(), paged.data_ptr(), page_size,
                kv_heads, q.shape[1], head_dim, *tables, head_dim ** -0.5, span, start, prior)
            if status != 0:
                raise MemoryError("paged_attention could not allocate its score buffers "
                                  "(ENOMEM)")

        run.keeps = (indices, row_token, row_pages, row_visible, shared)   # behind the pointers
        return run

    def _attention_op(self, q: torch.dtype, pool: torch.dtype):
        """The row kernel for rows of `q` over a pool of `pool` (None: none)."""
        if q == pool and q in SUFFIX:
            return self._op("paged_attention", q)
        if q == torch.float32 and pool == torch.bfloat16:
            return self._lib.paged_attention_f32_kvbf16
        return None

    def bind_store(self, rows: np.ndarray, page_size: int
                   ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], bool]:
        """`store(paged, k, v)`: the step's new K and V ([T, Hkv, D], rows may be strided,
        heads contiguous; the pool's dtype, or float32 into a bfloat16 pool, rounded as
        torch rounds) into the K rows `rows` (int64, one
        per new token; predd.worker.paged_kv.PagedKVCache.rows) of `paged` [P, 2, ps, Hkv, D]
        and the V rows page_size after them. False (nothing stored) for tensors of
        another layout: the caller stores them its own way."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        at, n = rows.ctypes.data, len(rows)

        def store(paged: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
            entry = paged.shape[-2] * paged.shape[-1]
            if (k.shape != v.shape or k.shape[0] != n or k.shape[1] * k.shape[2] != entry
                    or k.stride(2) != 1 or k.stride(1) != k.shape[2] or k.stride() != v.stride()
                    or k.dtype != v.dtype or not paged.is_contiguous()
                    or not (k.is_cpu and v.is_cpu and paged.is_cpu)):
                return False
            if k.dtype == paged.dtype:
                copy = self._lib.store_entries
            elif k.dtype == torch.float32 and paged.dtype == torch.bfloat16:
                copy = self._lib.store_entries_bf16
            else:
                return False
            copy(paged.data_ptr(), at, n, k.data_ptr(), v.data_ptr(),
                 k.stride(0) * k.element_size(), entry * paged.element_size(), page_size)
            return True

        store.keeps = rows
        return store

    def _op(self, name: str, dtype: torch.dtype):
        """The kernel `name` for `dtype` (looked up once, at load)."""
        fn = self._typed.get((name, dtype))
        if fn is None:
            raise ValueError(f"{name} takes float32 or bfloat16, not {dtype}")
        return fn

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta in place (when given), then RMSNorm(x) * weight as a new tensor;
        x, delta [T, C] contiguous, all three of one dtype."""
        _contiguous(x, delta, weight, dtype=x.dtype)
        out = torch.empty_like(x)
        self._op("add_rms_norm", x.dtype)(
            x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
            out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def rope(self, x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates the first `heads` heads of x [T, n, D] (rows may be strided, heads
        contiguous) in place by cos, sin [T, D/2]."""
        _contiguous(cos, sin)
        t, _, d = x.shape
        if x.stride(2) != 1 or x.stride(1) != d:
            raise ValueError("rope takes rows of contiguous heads")
        self._op("rope", x.dtype)(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                                  t, heads, d)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2n] = (gate | up) -> [T, n]."""
        _contiguous(gate_up, dtype=gate_up.dtype)
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(t, n, dtype=gate_up.dtype)
        self._op("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), t, n)
        return out


    def greedy_pick(self, blocks: list[torch.Tensor]) -> tuple[list[int], list[float]]:
        """Each float32 logits row's argmax (the first of ties) and its logprob, for the
        rows of `blocks` in order (a block: a row, or a 2-D tensor of rows, each row
        contiguous), without concatenating them or making a tensor a row; token -1
        (logprob NaN) for a row with a NaN or no finite logit."""
        at, v = _row_addresses(blocks)
        n = len(at)
        tokens, logprobs = np.empty(n, np.int64), np.empty(n, np.float32)
        self._lib.greedy_pick_f32(at.ctypes.data, n, v, tokens.ctypes.data,
                                  logprobs.ctypes.data)
        return tokens.tolist(), logprobs.tolist()

    def sample_pick(self, blocks: list[torch.Tensor], temperatures: list[float],
                    draws: list[float]) -> tuple[list[int], list[float]]:
        """A token drawn from each float32 logits row of `blocks` (as `greedy_pick`
        takes them) at its temperature (> 0), by the inverse of its cumulative
        distribution at its uniform draw in [0, 1), and its logprob at temperature 1;
        token -1 (logprob NaN) for a row that is no distribution (csrc/greedy.c)."""
        at, v = _row_addresses(blocks)
        n = len(at)
        if len(temperatures) != n or len(draws) != n:
            raise ValueError(f"sample_pick: {n} rows, {len(temperatures)} temperatures, "
                             f"{len(draws)} draws")
        temps, us = np.asarray(temperatures, np.float64), np.asarray(draws, np.float64)
        if n and not (np.all(temps > 0) and np.all((us >= 0) & (us < 1))):
            raise ValueError("sample_pick: temperatures > 0 and draws in [0, 1)")
        tokens, logprobs = np.empty(n, np.int64), np.empty(n, np.float32)
        self._lib.sample_pick_f32(at.ctypes.data, n, v, temps.ctypes.data, us.ctypes.data,
                                  tokens.ctypes.data, logprobs.ctypes.data)
        return tokens.tolist(), logprobs.tolist()

    def quant_linear(self, x: torch.Tensor, blocks, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] (float32, or bfloat16 where `bf16_blocks`) times the weight held as
        `blocks` (predd.model.loader.QuantBlocks: Q4_1 or Q8_0, [N, K/32, ...]) transposed,
        plus bias (float32) -> [M, N] of x's dtype."""
        return self.bind(blocks, bias, x.dtype)(x)

    def bind(self, blocks, bias: torch.Tensor | None, dtype: torch.dtype = torch.float32,
             widen: bool = False, int8: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """`quant_linear` with `blocks` and `bias` (float32) fixed: their pointers are
        taken once (the closure keeps them alive), so a projection's call costs one
        ctypes call (blocks in the other layout than the kernel's are converted once).
        `dtype` is the rows' and the result's: float32, or bfloat16 where `bf16_blocks`
        (the weights rounded to bf16 as a bf16 model holds them, bf16 products summed in
        float32, the result rounded once; Q4_1 blocks in lanes: the weights exactly).
        `widen`: bfloat16 rows and Q8_0 blocks (a model's head), the bf16 result
        widened to float32 as the kernel stores it (the same values as `.float()` after,
        without the second pass). `int8`: float32 rows quantised per block of 32 to int8
        and multiplied by int8 dot products (predd/kernels/csrc/quant_int8.c, llama.cpp's
        arithmetic)."""
        if widen and (dtype != torch.bfloat16 or blocks.kind != "Q8_0"):
            raise ValueError("the widened result is of bfloat16 rows and Q8_0 blocks")
        if int8 and dtype != torch.float32:
            raise ValueError("the int8 block kernels take float32 rows")
        _contiguous(bias)
        n, k = blocks.rows(), blocks.columns()
        # the bfloat16 kernels read the blocks in tiles of rows (predd/kernels/csrc/quant_blocks.h;
        # Q4_1 in lanes, predd/kernels/csrc/quant_lanes.c, where they come so), the float32 ones by
        # rows: converted here where they come another way
        # and the int8 ones in groups of rows (predd/kernels/csrc/quant_int8.c)
        if int8:
            blocks = blocks.in_groups()
        elif dtype != torch.bfloat16:
            blocks = blocks.in_rows()
        elif not blocks.lanes:
            blocks = blocks.in_tiles()
        # the int8 kernels read half-float scales, as the GGUF stores them; the others
        # float32
        blocks = blocks.with_scales(np.float16 if int8 else np.float32)
        if dtype == torch.bfloat16 and not self.bf16_blocks:
            raise ValueError("the block kernels take bfloat16 rows only where the CPU has "
                             "bf16 dot products (avx512_bf16) or AVX2 and FMA")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the block kernels take float32 or bfloat16 rows, not {dtype}")
        t = "int8" if int8 else SUFFIX[dtype]
        if blocks.lanes:
            fn, weight = self._lib.linear_q4_1_lanes_bf16, (
                blocks.q.ctypes.data, blocks.d.ctypes.data, blocks.m.ctypes.data)
        elif blocks.kind == "Q4_1":
            fn, weight = getattr(self._lib, f"linear_q4_1_{t}"), (
                blocks.q.ctypes.data, blocks.d.ctypes.data, blocks.m.ctypes.data)
        elif blocks.kind == "Q8_0":
            fn, weight = getattr(self._lib, f"linear_q8_0_{t}"), (blocks.q.ctypes.data,
                                                                 blocks.d.ctypes.data)
        else:
            raise ValueError(f"no kernel for {blocks.kind} blocks")
        b = None if bias is None else bias.data_ptr()
        if widen:
            narrow = self.bind(blocks, bias, dtype)

            def widened(x: torch.Tensor) -> torch.Tensor:
                if x.dtype != dtype or not x.is_contiguous() or x.shape[1] != k:
                    return narrow(x)            # its error
                y = torch.empty(x.shape[0], n, dtype=torch.float32)
                if self._lib.linear_q8_0_bf16_f32(x.data_ptr(), x.shape[0], k, *weight, n,
                                                  b, y.data_ptr()) != 0:
                    return narrow(x).float()    # memory short for AMX tiles' bf16 result
                return y

            widened.keeps = (blocks, bias)
            return widened

        def run(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != dtype or not x.is_contiguous() or x.shape[1] != k:
                _contiguous(x, dtype=dtype)
                raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
            y = torch.empty(x.shape[0], n, dtype=dtype)
            if fn(x.data_ptr(), x.shape[0], k, *weight, n, b, y.data_ptr()):
                raise MemoryError("no memory for x's int8 blocks (ENOMEM)")
            return y

        run.keeps = (blocks, bias)          # the memory behind the pointers
        return run


def _row_addresses(blocks: list[torch.Tensor]) -> tuple[np.ndarray, int]:
    """The address of every row of `blocks` (1-D rows or 2-D tensors of contiguous
    float32 CPU rows, all of one length), in order, and that length."""
    at: list[int] = []
    v = blocks[0].shape[-1] if blocks else 0
    for b in blocks:
        if (b.dtype != torch.float32 or not b.is_cpu or b.dim() not in (1, 2)
                or (b.shape[-1] > 1 and b.stride(-1) != 1)):
            raise ValueError("the CPU kernels take contiguous float32 CPU rows here, not "
                             f"{str(b.dtype)[6:]} {tuple(b.shape)} of strides {b.stride()}")
        if b.shape[-1] != v:
            raise ValueError("the picks take rows of one length")
        if b.dim() == 1 or b.shape[0] == 1:
            at.append(b.data_ptr())
        else:
            first, step = b.data_ptr(), b.stride(0) * 4
            at += [first + step * i for i in range(b.shape[0])]
    return np.array(at, np.int64), v


def _contiguous(*tensors: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> None:
    for t in tensors:
        if t is not None and (t.dtype != dtype or not t.is_contiguous() or not t.is_cpu):
            raise ValueError(f"the CPU kernels take contiguous {str(dtype)[6:]} CPU tensors "
                             f"here, not {str(t.dtype)[6:]}{'' if t.is_contiguous() else ' strided'}")
