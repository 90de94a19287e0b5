"""The `flashinfer` attention backend: FlashInfer's paged kernels over predd's pool (CUDA).

The pool already is FlashInfer's NHD paged layout (`kv[layer]` is `[pages, 2, page_size,
Hkv, D]`, K at index 0 of dim 1), and `PageTables` already holds its CSR page tables, so
nothing is copied or converted. Once per step `prepare` splits the step's calls as the
torch backend does (`PageTables.by_phase`): calls of one new token go to the batch
decode wrapper, longer chunks to the batch prefill wrapper with `causal=True`, which for
paged prefill aligns a call's queries to the end of its entries (query j of n new tokens
over L entries sees entries 0..L-n+j: a chunk sees its whole past). Each wrapper is
planned once a step from its share of the tables and run for every layer. New K/V go
into their reserved slots first (`predd.attention.slots.slot_writer`). RoPE is applied before K is
written, so the kernels run with `pos_encoding_mode="NONE"`.

Written against flashinfer 0.6.18's Python API; the arguments used (the positional
table arguments of `plan`, then `causal`, `pos_encoding_mode`, `q_data_type`,
`kv_data_type`; `run(q, paged_kv_cache)`; the wrappers' `(workspace, "NHD")` and
decode's `use_tensor_cores`) have these names from 0.2.0 on. flashinfer is imported
only when this backend is built, never on CPU. tests/gpu checks it against the torch
backend (docs/kernels.md, "GPU runs": the devices and versions it passed on, and what
was not covered).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from predd.worker.paged_kv import PagedKVCache
from predd.attention.page_table import PageTables
from predd.attention.slots import slot_writer

WORKSPACE_BYTES = 128 * 2**20     # FlashInfer's recommended split-k scratch, shared by both
TENSOR_CORE_GROUP = 4             # decode on tensor cores from this many q heads per kv head
FLASHINFER_DTYPES = ("bfloat16", "float16")      # its kernels have no float32 variant


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


@dataclass(frozen=True)
class PhasePlan:
    """One wrapper's share of a step: its calls' tables (numbered from 0) and the rows
    of their new tokens in the step's flat batch (`all_rows`: every row, in order)."""
    tables: PageTables
    rows: np.ndarray              # [n] int64
    all_rows: bool

    def plan_args(self) -> tuple[torch.Tensor, ...]:
        """(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len) as
        int32 CPU tensors: `plan` reads the indptrs on the host and copies all four."""
        t = self.tables
        return tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
                     for a in (t.qo_indptr, t.indptr, t.indices, t.last_page_len))


def split_step(tables: PageTables) -> tuple[PhasePlan | None, PhasePlan | None]:
    """(decode share, prefill share) of a step; None for a phase with no calls."""
    total = int(tables.qo_indptr[-1]) if len(tables) else 0

    def share(calls: list[int]) -> PhasePlan | None:
        if not calls:
            return None
        rows = tables.query_rows(calls)
        return PhasePlan(tables.select(calls), rows,
                         len(rows) == total and bool(np.all(rows == np.arange(total))))

    decode, prefill = tables.by_phase()
    return share(decode), share(prefill)


def load_flashinfer():
    return importlib.import_module("flashinfer")


class FlashInferAttention:
    """Batch decode and batch prefill wrappers over one workspace; planned per step."""

    name = "flashinfer"

    def __init__(self, cache: PagedKVCache) -> None:
        dtype = str(cache.dtype).removeprefix("torch.")
        problem = flashinfer_problem(str(cache.device), dtype)
        if problem:
            raise ValueError(f"--attention flashinfer {problem[0]} ({problem[1]})")
        self.fi = fi = load_flashinfer()
        cfg = cache.cfg
        self.cache = cache
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=cache.device)
        self.decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD",
            use_tensor_cores=cfg.num_heads // cfg.num_kv_heads >= TENSOR_CORE_GROUP)
        self.prefill = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def graph_wrapper(self, indptr: torch.Tensor, indices: torch.Tensor,
                      last_page_len: torch.Tensor):
        """A decode wrapper in FlashInfer's CUDA-graph mode over these fixed buffers
        (batch size `len(last_page_len)`), sharing the workspace: predd/worker/cuda_graphs.py.
        On CUDA cores whatever the group size (the kernel verified under a graph on a
        GPU; cuda_graphs.GROUPS lists the group sizes it has)."""
        return self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=False,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len)

    def prepare(self, tables: PageTables) -> Callable:
        cache, dev = self.cache, self.cache.device
        heads, kv_heads, head_dim = self.heads
        store = slot_writer(cache, tables)
        decode, prefill = split_step(tables)
        kinds = dict(pos_encoding_mode="NONE", q_data_type=cache.dtype,
                     kv_data_type=cache.dtype)
        runs = []                        # (wrapper, plan) in the order they run
        if decode:
            _, indptr, indices, last = decode.plan_args()
            self.decode.plan(indptr, indices, last, heads, kv_heads, head_dim,
                             cache.page_size, **kinds)
            runs.append((self.decode, decode))
        if prefill:
            qo, indptr, indices, last = prefill.plan_args()
            self.prefill.plan(qo, indptr, indices, last, heads, kv_heads, head_dim,
                              cache.page_size, causal=True, **kinds)
            runs.append((self.prefill, prefill))
        rows = [torch.from_numpy(share.rows).to(dev) for _, share in runs]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
            store(layer, k, v)
            paged = cache.kv[layer]                        # [P, 2, ps, Hkv, D]: NHD
            if len(runs) == 1 and runs[0][1].all_rows:
                return runs[0][0].run(q.contiguous(), paged)
            out = torch.empty_like(q)                      # [T, H, D]
            for (wrapper, _), r in zip(runs, rows):
                out.index_copy_(0, r, wrapper.run(q.index_select(0, r), paged))
            return out

        return attend
