"""A step's layers in one C call (predd/kernels/layer_loop.py): the same logits and the same pool,
to the bit, as the Python loop, for decodes, chunks by tiles and by rows in one step, in
float32 (by the blocks' exact weights and by int8 dot products) and (where the CPU has
bf16 blocks) bfloat16; steps it does not take fall back to
the Python loop; and where it cannot run, the runner says why."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from predd.kernels import cpu_kernels, library
from predd.attention.page_table import PageTables
from predd.engine.chunk import Chunk
from predd.worker.runner import Runner, RunnerConfig

PAGE = 16


def _runner(gguf_path: str, dtype: str, linear: str = "quantized", **kw) -> Runner:
    return Runner(RunnerConfig(gguf_path, "cpu", dtype, kv_pages=64, page_size=PAGE,
                               attention="cpu", linear=linear,
                               quant_rows=None if linear == "int8" else 48, **kw))


def _step(shapes: list[tuple[int, int]], seed: int = 0) -> list[Chunk]:
    """Calls of (new tokens, entries before them), each on pages of its own."""
    rng, chunks, first = np.random.default_rng(seed), [], 0
    for n, past in shapes:
        length = past + n
        pages = np.arange(first, first + -(-length // PAGE), dtype=np.int32)
        first += len(pages)
        chunks.append(Chunk(rng.integers(0, 49152, n).astype(np.int32),
                            np.arange(past, length, dtype=np.int32), pages, length,
                            np.arange(n)))
    return chunks


def _both(runner: Runner, chunks: list[Chunk]) -> tuple[list, torch.Tensor, list, torch.Tensor]:
    """The step by the C loop, then from the same pool by the Python loop: (logits, pool
    after) of each."""
    loop, before = runner.layer_loop, runner.cache.kv.clone()
    fast = runner.execute(chunks)
    fast_pool = runner.cache.kv.clone()
    runner.cache.kv.copy_(before)
    runner.layer_loop = None
    try:
        slow = runner.execute(chunks)
    finally:
        runner.layer_loop = loop
    return fast, fast_pool, slow, runner.cache.kv.clone()


@pytest.mark.parametrize("dtype, linear, kv", [
    ("float32", "quantized", "float32"), ("float32", "int8", "float32"),
    ("bfloat16", "quantized", "bfloat16"),
    ("float32", "int8", "bfloat16"), ("float32", "quantized", "bfloat16")])
def test_the_loop_in_c_gives_the_python_loops_bits(gguf_path, dtype, linear, kv):
    """(`kv`: the pool's dtype; bfloat16 under a float32 model is --kv-dtype's)"""
    if dtype == "bfloat16" and not cpu_kernels.kernels().bf16_blocks:
        pytest.skip("no bf16 block kernels here: a bf16 model's layers stay in Python")
    runner = _runner(gguf_path, dtype, linear, kv_dtype=kv)
    assert runner.layer_loop is not None and runner.layer_loop_reason is None
    assert runner.cache.kv.dtype == getattr(torch, kv)
    assert runner.linear == linear
    if dtype == "bfloat16":     # AVX2 without bf16 dot products: the same products by FMAs
        assert ("(bf16 rows by float32 FMAs)" in runner.linear_reason) is \
            (cpu_kernels.kernels().bf16_dots == "fma")
    torch.manual_seed(0)                              # a pool with something in it
    runner.cache.kv.copy_(torch.randn(runner.cache.kv.shape).to(runner.cache.kv.dtype))
    # decodes, chunks the tiles take (>= 4 rows: in bf16 where AMX runs), a 2-row
    # chunk for the row kernel: 44 rows, under the 48 of the blocks and the kernels' 64
    shapes = [(1, 40), (5, 17), (30, 0), (1, 100), (2, 33), (4, 60), (1, 1)]
    tables = PageTables.build(PAGE, [c.pages for c in _step(shapes)],
                              [c.kv_len for c in _step(shapes)], [n for n, _ in shapes])
    assert runner.layer_loop.takes(tables)
    fast, fast_pool, slow, slow_pool = _both(runner, _step(shapes))
    assert [f.shape for f in fast] == [(n, 49152) for n, _ in shapes]
    assert all(torch.equal(f, s) for f, s in zip(fast, slow))
    assert torch.equal(fast_pool, slow_pool)
    assert not torch.equal(fast_pool, torch.zeros_like(fast_pool))


def test_some_rows_wanted_or_none_give_the_python_loops_bits(gguf_path):
    """The C loop puts every row through the final norm; the head takes the wanted rows
    of it: a call's last row, a call with none (a prefill), or no row at all."""
    dtype = "bfloat16" if cpu_kernels.kernels().bf16_blocks else "float32"
    runner = _runner(gguf_path, dtype)
    torch.manual_seed(1)
    runner.cache.kv.copy_(torch.randn(runner.cache.kv.shape).to(runner.cache.kv.dtype))
    shapes = [(1, 40), (5, 17), (3, 0), (1, 100)]
    for wanted in ([[0], [4], [], [0]], [[], [], [], []]):
        chunks = _step(shapes)
        for chunk, rows in zip(chunks, wanted):
            chunk.outputs = np.array(rows, dtype=np.int64)
        fast, fast_pool, slow, slow_pool = _both(runner, chunks)
        assert [f.shape for f in fast] == [(len(rows), 49152) for rows in wanted]
        assert all(torch.equal(f, s) for f, s in zip(fast, slow))
        assert torch.equal(fast_pool, slow_pool)


def test_forks_shared_pages_give_the_python_loops_bits(gguf_path, monkeypatch):
    """Forks of one document (the first 17 pages of their tables the same) attend to
    them together in blocks (predd --cascade, on by default; groups of 6 rows or more
    here, whatever this CPU's kind of blocks), in the C loop as in the Python loop: the
    same bits."""
    kernels = cpu_kernels.kernels()
    if kernels.attention_blocks is None:
        pytest.skip("no attention blocks here (AMX tiles or bf16 dot products)")
    monkeypatch.setitem(library.BLOCK_LIMITS, kernels.attention_blocks,
                        library.BlockLimits(4, 6, 16))
    runner = _runner(gguf_path, "bfloat16")
    assert runner.cascade_reason is None and kernels.shared_prefix
    torch.manual_seed(1)
    runner.cache.kv.copy_(torch.randn(runner.cache.kv.shape).to(runner.cache.kv.dtype))
    rng = np.random.default_rng(1)
    doc = np.arange(17, dtype=np.int32)
    chunks = [Chunk(rng.integers(0, 49152, 1).astype(np.int32),
                    np.array([17 * PAGE + i], dtype=np.int32),
                    np.append(doc, 17 + i).astype(np.int32), 17 * PAGE + i + 1, np.arange(1))
              for i in range(7)]
    chunks.append(Chunk(rng.integers(0, 49152, 6).astype(np.int32),      # a chunk: tiles
                        np.arange(17 * PAGE, 17 * PAGE + 6, dtype=np.int32),
                        np.append(doc, 30).astype(np.int32), 17 * PAGE + 6, np.arange(6)))
    tables = PageTables.build(PAGE, [c.pages for c in chunks], [c.kv_len for c in chunks],
                              [len(c.tokens) for c in chunks])
    assert runner.layer_loop.takes(tables)
    fast, fast_pool, slow, slow_pool = _both(runner, chunks)
    assert all(torch.equal(f, s) for f, s in zip(fast, slow))
    assert torch.equal(fast_pool, slow_pool)
    off = _runner(gguf_path, "bfloat16", cascade=False)
    try:
        assert off.cascade_reason == "off (asked for)" and not kernels.shared_prefix
    finally:
        kernels.shared_prefix = True


def test_steps_it_does_not_take_run_the_python_loop(gguf_path):
    runner = _runner(gguf_path, "float32")
    for shapes in ([(65, 0)],                       # a chunk past the kernels' 64 rows: SDPA
                   [(1, 10)] * 49):                 # 49 rows: past the blocks' 48
        chunks = _step(shapes)
        tables = PageTables.build(PAGE, [c.pages for c in chunks], [c.kv_len for c in chunks],
                                  [n for n, _ in shapes])
        assert not runner.layer_loop.takes(tables)
        assert runner.layer_loop.run(tables, None, None, None) is None     # nothing done
        fast, _, slow, _ = _both(runner, chunks)
        assert all(torch.equal(f, s) for f, s in zip(fast, slow))


def test_where_it_cannot_run_the_runner_says_why(gguf_path):
    off = _runner(gguf_path, "float32", layer_loop=False)
    assert off.layer_loop is None and off.layer_loop_reason == "off (asked for)"
    torch_attention = Runner(RunnerConfig(gguf_path, "cpu", "float32", kv_pages=8,
                                          attention="torch", quant_rows=8))
    assert torch_attention.layer_loop is None
    assert torch_attention.layer_loop_reason == "the attention backend is torch, not cpu"
    packed = Runner(RunnerConfig(gguf_path, "cpu", "float32", kv_pages=8, attention="cpu",
                                 linear="packed"))
    assert packed.layer_loop is None
    assert packed.layer_loop_reason == ("layer 0's qkv_proj is not computed from Q4_1 or "
                                        "Q8_0 blocks (--linear quantized)")
