"""Decode steps replayed as CUDA graphs (`predd --cuda-graphs`; CUDA with flashinfer).

On a GPU a small model's decode step is bound by the host, not the device: every layer
launches a dozen small kernels from Python, so a step costs about the same whether it
carries 1 call or 64 (measured: docs/kernels.md, "Decode steps as CUDA graphs"). A
CUDA graph records a step's kernels once and replays them all with one launch.

A graph has fixed shapes and fixed addresses. So for each batch size of a ladder
(`buckets`: 1, 2, 4, 8, every 8th to 64, every 32nd to 256, up to `--max-batch`; larger
steps gain little from a graph, and each costs its wrapper's 16 MB of plan workspace)
`DecodeGraphs` keeps static inputs (token ids, positions, the K rows the new entries go
to) and a flashinfer decode wrapper in its CUDA-graph mode (its page tables in fixed
buffers, planned on the host before every replay, as FlashInfer's docs prescribe), and
records the model's forward once at start-up. It serves a step whose calls each compute one token (a pure decode
step) with at most the largest bucket's calls: they fill the first rows of the smallest
bucket that holds them (`pad_step`); the rest are padding rows that write and read one
scratch page of the pool that no object owns (`PagedKVCache(spare_pages=1)`). Any other
step (a chunk of several tokens, more calls) runs eagerly, as without graphs.

The graphs decode on CUDA cores (FlashInfer's CUDA-core decode, which it builds for 1, 2,
3, 4, 6 and 8 query heads per KV head: `GROUPS`; a model with another group runs every
step eagerly, saying why). Below 4 heads a KV head (SmolLM2) that is the eager path's
kernel too, and the graphs' logits were identical to the eager steps' (validated on an
H200: docs/kernels.md, "Decode steps as CUDA graphs"); from 4 on the eager path decodes
on tensor cores, whose recording under a graph is not verified on a GPU here, so the
graphs keep to the kernel that is. All graphs write their logits into one shared
`[largest, vocab]` float32 buffer (one graph's output each would add up to ~0.7 GB at a
128K vocabulary and 256 calls).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from predd.attention.slots import row_writer
from predd.attention.page_table import PageTables
from predd.worker.paged_kv import PagedKVCache

CHOICES = ("auto", "on", "off")
GROUPS = (1, 2, 3, 4, 6, 8)   # query heads per KV head FlashInfer's CUDA-core decode has
LARGEST = 256            # no graph above this many calls: those steps run eagerly
WARMUP_RUNS = 2          # eager runs before a capture (lazy inits, JIT loads, autotune)

# capture(fn) -> (replay, out): record fn's kernels, return the replay and fn's output
# tensor (which every replay rewrites)
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]


def resolve(requested: str, device: str, attention: str, tensor_parallel: bool
            ) -> tuple[bool, str]:
    """(use graphs, why) for `--cuda-graphs requested`. `auto` uses them where they run:
    a CUDA device, the flashinfer backend, one rank. ValueError (EINVAL) when `on` is
    asked for where they cannot run."""
    if requested not in CHOICES:
        raise ValueError(f"--cuda-graphs must be one of {', '.join(CHOICES)}, "
                         f"not {requested!r} (EINVAL)")
    if requested == "off":
        return False, "off: asked for"
    problem = None
    if not device.startswith("cuda"):
        problem = f"need a CUDA device, not {device}"
    elif attention != "flashinfer":
        problem = f"need --attention flashinfer, not {attention}"
    elif tensor_parallel:
        problem = "are not used under tensor parallelism"
    if problem and requested == "on":
        raise ValueError(f"--cuda-graphs on: CUDA graphs {problem} (EINVAL)")
    if problem:
        return False, f"auto: CUDA graphs {problem}"
    return True, "asked for" if requested == "on" else "auto"


def model_problem(num_heads: int, num_kv_heads: int) -> str | None:
    """Why the graphs cannot decode this model's attention, or None."""
    group = num_heads // num_kv_heads
    if group not in GROUPS:
        return (f"decode on CUDA cores, which FlashInfer has for {', '.join(map(str, GROUPS))} "
                f"query heads per KV head, not {group}")
    return None


def buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are recorded for: 1, 2, 4, 8, every 8th to 64, every 32nd
    to LARGEST, and the largest step (max_batch, at most LARGEST)."""
    top = min(max_batch, LARGEST)
    ladder = [1, 2, 4, *range(8, 64, 8), *range(64, LARGEST, 32)]
    return sorted({b for b in ladder if b < top} | {top})


@dataclass(frozen=True)
class PaddedStep:
    """A pure decode step laid out for a graph of `bucket` rows: rows n.. are padding."""
    inputs: np.ndarray          # [3, bucket] int64: token ids, positions, K rows
    indptr: np.ndarray          # [bucket + 1] int32
    indices: np.ndarray         # [indptr[-1]] int32
    last_page_len: np.ndarray   # [bucket] int32


def pad_step(tables: PageTables, tokens: np.ndarray, positions: np.ndarray,
             k_rows: np.ndarray, bucket: int, scratch_page: int, scratch_row: int
             ) -> PaddedStep:
    """The step's n calls (one new token each) in the first n rows of a `bucket`-row
    graph; each padding row has token 0 at position 0, one entry on `scratch_page` (its
    first slot, whose K row is `scratch_row`), and writes its K/V there."""
    n = len(tables)
    pad = bucket - n
    if pad < 0:
        raise ValueError(f"{n} calls do not fit a graph of {bucket}")
    inputs = np.zeros((3, bucket), dtype=np.int64)
    inputs[0, :n], inputs[1, :n], inputs[2, :n] = tokens, positions, k_rows
    inputs[2, n:] = scratch_row
    indptr = np.concatenate([tables.indptr,
                             tables.indptr[-1] + np.arange(1, pad + 1)]).astype(np.int32)
    indices = np.concatenate([tables.indices,
                              np.full(pad, scratch_page)]).astype(np.int32)
    last = np.concatenate([tables.last_page_len, np.ones(pad)]).astype(np.int32)
    return PaddedStep(inputs, indptr, indices, last)


@dataclass
class Graph:
    """One bucket's recording: its static inputs, wrapper and output. Every tensor the
    recording reads that it did not allocate itself lives here: a replay holds no
    Python references, so a tensor only its recorded function held would be freed and
    its memory reused under the graph (the first GPU run read its output rows so)."""
    bucket: int
    inputs: torch.Tensor        # [3, bucket] int64 on the device
    staging: torch.Tensor       # the same on the host (pinned on CUDA)
    rows: torch.Tensor          # [bucket] int64 on the device: 0..bucket-1, logits wanted
    wrapper: object             # a flashinfer decode wrapper in CUDA-graph mode
    replay: Callable[[], None] = lambda: None
    out: torch.Tensor | None = None   # [bucket, vocab] float32 (of the shared buffer)


class DecodeGraphs:
    """The recorded decode steps of one model over one pool; `run` serves a step or
    declines it (None)."""

    def __init__(self, model, cache: PagedKVCache, make_wrapper: Callable[..., object],
                 max_batch: int, capture: Capture,
                 progress: Callable[[str], None] = lambda msg: None) -> None:
        """`make_wrapper(indptr_buf, indices_buf, last_page_len_buf)`: a flashinfer
        decode wrapper in CUDA-graph mode over those buffers; `cache` must have a spare
        page (the scratch page); `capture` records (cuda_capture on a GPU)."""
        if cache.spare_pages < 1:
            raise ValueError("CUDA graphs need a scratch page: PagedKVCache(spare_pages=1)")
        cfg = model.cfg
        problem = model_problem(cfg.num_heads, cfg.num_kv_heads)
        if problem:
            raise ValueError(f"CUDA graphs {problem}")
        self.model, self.cache = model, cache
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.scratch_page = cache.num_pages
        self.scratch_row = int(cache.rows(np.array([self.scratch_page * cache.page_size]))[0])
        # a call's table: its object's pages, all distinct and within the model's context
        self.pages_per_call = min(-(-cfg.max_position // cache.page_size), cache.num_pages)
        self.replays = 0
        dev = cache.device
        started = time.monotonic()
        self.graphs: dict[int, Graph] = {}
        sizes = buckets(max_batch)
        # every graph's logits, read after each replay before the next: one buffer serves
        self.logits = torch.empty(sizes[-1], cfg.vocab_size, dtype=torch.float32, device=dev)
        for bucket in sorted(sizes, reverse=True):   # the largest first:
            # the smaller graphs reuse its memory
            buffers = (torch.zeros(bucket + 1, dtype=torch.int32, device=dev),
                       torch.zeros(bucket * self.pages_per_call, dtype=torch.int32, device=dev),
                       torch.zeros(bucket, dtype=torch.int32, device=dev))
            staging = torch.zeros(3, bucket, dtype=torch.int64)
            if dev.type == "cuda":
                staging = staging.pin_memory()
            graph = Graph(bucket, torch.zeros(3, bucket, dtype=torch.int64, device=dev),
                          staging, torch.arange(bucket, device=dev), make_wrapper(*buffers))
            self._plan(graph, pad_step(PageTables.build(cache.page_size, [], [], []),
                                       np.zeros(0), np.zeros(0), np.zeros(0), bucket,
                                       self.scratch_page, self.scratch_row))
            graph.replay, graph.out = capture(self._forward(graph))
            self.graphs[bucket] = graph
        self.sizes = sorted(self.graphs)
        self.seconds = time.monotonic() - started
        progress(f"CUDA graphs of the decode step recorded for batches of "
                 f"{', '.join(map(str, self.sizes))} in {self.seconds:.1f}s")

    def _forward(self, graph: Graph) -> Callable[[], torch.Tensor]:
        """The model's forward over the graph's static inputs: what is recorded."""
        cache, wrapper = self.cache, graph.wrapper

        out = self.logits[:graph.bucket]

        @torch.inference_mode()
        def forward() -> torch.Tensor:
            ids, positions, k_rows = graph.inputs
            store = row_writer(cache, k_rows)

            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> torch.Tensor:
                store(layer, k, v)
                return wrapper.run(q.contiguous(), cache.kv[layer])
            return out.copy_(self.model(ids, positions, attend, graph.rows))
        return forward

    def _plan(self, graph: Graph, step: PaddedStep) -> None:
        """The step's inputs into the graph's static ones, its tables into the wrapper."""
        graph.staging.numpy()[:] = step.inputs
        graph.inputs.copy_(graph.staging, non_blocking=True)
        heads, kv_heads, head_dim = self.heads
        dtype = self.cache.dtype
        graph.wrapper.plan(*(torch.from_numpy(a) for a in
                             (step.indptr, step.indices, step.last_page_len)),
                           heads, kv_heads, head_dim, self.cache.page_size,
                           pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)

    def bucket_for(self, calls: int) -> int | None:
        """The smallest recorded batch that holds `calls`, or None."""
        for size in self.sizes:
            if size >= calls:
                return size
        return None

    def run(self, tables: PageTables, tokens: np.ndarray, positions: np.ndarray,
            rows: np.ndarray) -> torch.Tensor | None:
        """The logits [len(rows), vocab] (float32, a copy on the device: the graph's output
        is rewritten by its next replay) of a pure decode step by replaying a graph, or
        None where no graph serves it (then run it eagerly)."""
        n = len(tables)
        bucket = self.bucket_for(n)
        if (bucket is None or n == 0 or np.any(tables.q_len != 1)
                or np.any(np.diff(tables.indptr) > self.pages_per_call)):
            return None
        graph = self.graphs[bucket]
        k_rows = self.cache.rows(tables.new_slots())
        self._plan(graph, pad_step(tables, tokens, positions, k_rows, bucket,
                                   self.scratch_page, self.scratch_row))
        graph.replay()
        self.replays += 1
        out = graph.out[:n]
        if len(rows) == n and np.array_equal(rows, np.arange(n)):
            return out.clone()
        return out[torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(out.device)]


def cuda_capture(device: torch.device) -> Capture:
    """Records on `device`: WARMUP_RUNS eager runs on a side stream, then one capture
    into a memory pool the graphs share."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        torch.cuda.synchronize(device)
        return graph.replay, out
    return capture
