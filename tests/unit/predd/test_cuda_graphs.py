"""CUDA graphs of the decode step, the CPU-checkable half: when they are used
(`--cuda-graphs`), the batch sizes recorded, a step padded into a graph's rows (exact
arrays), and `DecodeGraphs` end to end over a small random model with the fake
flashinfer of test_attention_flashinfer.py in its CUDA-graph mode (fixed buffers that
`plan` fills and `run` reads) and a capture that replays by running the recorded
function again: the same logits and the same pool as the eager flashinfer path, for
steps of several batch sizes. Recording on a real GPU is tests/gpu/test_flashinfer.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from predd.worker import cuda_graphs
from predd.attention.flashinfer_backend import FlashInferAttention
from predd.worker.cuda_graphs import DecodeGraphs, buckets, pad_step, resolve
from predd.model.loader import ModelConfig
from predd.model.llama import LlamaModel
from predd.worker.paged_kv import PagedKVCache
from predd.attention.page_table import PageTables
from tests.unit.helpers import refused_before_loading
from tests.unit.predd.test_attention_flashinfer import (  # noqa: F401
    FakeDecode, fake_flashinfer, paged_reference)

PS = 4
PAGES = 24
CFG = ModelConfig(name="tiny", vocab_size=50, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0,
                  rms_norm_eps=1e-5, max_position=32, tie_word_embeddings=False)


@pytest.mark.parametrize("requested, device, attention, tp, want", [
    ("auto", "cuda", "flashinfer", False, (True, "auto")),
    ("on", "cuda:1", "flashinfer", False, (True, "asked for")),
    ("off", "cuda", "flashinfer", False, (False, "off: asked for")),
    ("auto", "cpu", "cpu", False, (False, "auto: CUDA graphs need a CUDA device, not cpu")),
    ("auto", "cuda", "torch", False,
     (False, "auto: CUDA graphs need --attention flashinfer, not torch")),
    ("auto", "cuda", "flashinfer", True,
     (False, "auto: CUDA graphs are not used under tensor parallelism")),
])
def test_where_graphs_are_used(requested, device, attention, tp, want):
    assert resolve(requested, device, attention, tp) == want


@pytest.mark.parametrize("requested, message", [
    ("on", "--cuda-graphs on: CUDA graphs need --attention flashinfer, not torch (EINVAL)"),
    ("always", "--cuda-graphs must be one of auto, on, off, not 'always' (EINVAL)"),
])
def test_graphs_where_they_cannot_run_are_refused(requested, message):
    with pytest.raises(ValueError) as err:
        resolve(requested, "cuda", "torch", False)
    assert str(err.value) == message


def test_predd_refuses_graphs_on_cpu_before_loading_a_model(tmp_path, capsys):
    assert refused_before_loading(tmp_path, capsys, "--device", "cpu", "--cuda-graphs",
                                  "on") == (
        2, "predd: --cuda-graphs on: CUDA graphs need a CUDA device, not cpu (EINVAL)")


def test_batch_sizes_recorded():
    assert buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert buckets(10) == [1, 2, 4, 8, 10]
    assert buckets(3) == [1, 2, 3]
    assert buckets(1) == [1]
    assert buckets(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256]
    assert buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
    assert buckets(4096) == buckets(256)


def test_a_step_padded_into_a_graph():
    tables = PageTables.build(PS, [np.array([7, 2, 30]), np.array([9])], [9, 1], [1, 1])
    step = pad_step(tables, np.array([11, 12]), np.array([8, 0]), np.array([229, 72]),
                    bucket=4, scratch_page=40, scratch_row=320)
    assert step.inputs.tolist() == [[11, 12, 0, 0], [8, 0, 0, 0], [229, 72, 320, 320]]
    assert step.indptr.tolist() == [0, 3, 4, 5, 6]
    assert step.indices.tolist() == [7, 2, 30, 9, 40, 40]
    assert step.last_page_len.tolist() == [1, 1, 1, 1]
    assert all(a.dtype == np.int32 for a in (step.indptr, step.indices, step.last_page_len))
    with pytest.raises(ValueError):
        pad_step(tables, np.array([11, 12]), np.array([8, 0]), np.array([229, 72]),
                 bucket=1, scratch_page=40, scratch_row=320)


class FakeGraphDecode:
    """FlashInfer's decode wrapper in CUDA-graph mode as its docs describe it: fixed
    buffers, a fixed batch size, `plan` copies the tables into the buffers and `run`
    reads whatever they hold when it runs (as a replayed graph does)."""

    def __init__(self, workspace, kv_layout, use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert use_cuda_graph and kv_layout == "NHD" and not use_tensor_cores
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last = paged_kv_last_page_len_buffer
        self.batch = len(self.last)
        assert len(self.indptr) == self.batch + 1
        self.plans = 0

    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page_size, **kwargs):
        assert len(last) == self.batch, "the batch size is fixed in CUDA-graph mode"
        assert len(indices) <= len(self.indices)
        assert kwargs["pos_encoding_mode"] == "NONE"
        self.indptr.copy_(indptr)
        self.last.copy_(last)
        self.indices[:len(indices)].copy_(indices)
        self.page_size, self.plans = page_size, self.plans + 1

    def run(self, q, paged):
        assert q.shape[0] == self.batch and q.is_contiguous()
        qo = torch.arange(self.batch + 1, dtype=torch.int32)
        return paged_reference(q, paged, qo, self.indptr, self.indices, self.last,
                               self.page_size)


class Recorder:
    """A capture that replays by running the recorded function again into its output."""

    def __init__(self):
        self.recorded = 0

    def __call__(self, fn):
        self.recorded += 1
        out = fn()

        @torch.inference_mode()        # out is the model's (an inference tensor)
        def replay():
            out.copy_(fn())
        return replay, out


@pytest.fixture
def setup(fake_flashinfer):  # noqa: F811
    """(model, eager backend, graphs, graph pool, recorder): two pools with the same
    random pages, one with the graphs' scratch page."""
    fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper = _decode_either
    torch.manual_seed(0)
    model = LlamaModel(CFG).eval()
    eager_pool = PagedKVCache(CFG, PAGES, PS, torch.float32, torch.device("cpu"))
    eager_pool.kv.normal_()
    graph_pool = PagedKVCache(CFG, PAGES, PS, torch.float32, torch.device("cpu"), spare_pages=1)
    graph_pool.kv[:, :PAGES] = eager_pool.kv
    recorder = Recorder()
    graphs = DecodeGraphs(model, graph_pool, FlashInferAttention(graph_pool).graph_wrapper,
                          max_batch=8, capture=recorder)
    return model, FlashInferAttention(eager_pool), graphs, graph_pool, recorder


def _decode_either(workspace, kv_layout, **kwargs):
    """The fake module's decode wrapper: graph mode where asked for, else the eager fake."""
    if kwargs.get("use_cuda_graph"):
        return FakeGraphDecode(workspace, kv_layout, **kwargs)
    return FakeDecode(workspace, kv_layout, **kwargs)


def decode_step(calls: list[tuple[int, list[int]]], seed: int):
    """A pure decode step: per call (entries after it, its pages); tokens and rows."""
    tables = PageTables.build(PS, [np.array(p) for _, p in calls], [k for k, _ in calls],
                              [1] * len(calls))
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, len(calls))
    positions = np.array([k - 1 for k, _ in calls])
    return tables, tokens, positions


def eager(model, backend, tables, tokens, positions, rows):
    return model(torch.from_numpy(tokens), torch.from_numpy(positions),
                 backend.prepare(tables), torch.from_numpy(np.asarray(rows)))


def test_graphs_replay_what_the_eager_step_computes(setup):
    model, backend, graphs, graph_pool, recorder = setup
    assert graphs.sizes == [1, 2, 4, 8] and recorder.recorded == 4
    assert graphs.scratch_page == PAGES
    steps = [
        [(9, [7, 2, 23]), (1, [9]), (16, [19, 21, 8, 4])],        # 3 calls: the graph of 4
        [(5, [3, 1])],                                             # 1 call
        [(k, [p]) for k, p in zip((1, 2, 3, 4, 2), (10, 11, 12, 13, 14))],   # 5: of 8
        [(k, [0, 15 + i]) for i, k in enumerate((5, 6, 7, 8, 8, 6, 5, 7))],  # 8: a shared page
    ]
    for seed, calls in enumerate(steps):
        tables, tokens, positions = decode_step(calls, seed)
        rows = np.arange(len(calls))
        graph_before, eager_before = graph_pool.kv[:, :PAGES].clone(), backend.cache.kv.clone()
        got = graphs.run(tables, tokens, positions, rows)
        want = eager(model, backend, tables, tokens, positions, rows)
        assert got.shape == (len(calls), CFG.vocab_size) and got.dtype == torch.float32
        assert torch.allclose(got, want, atol=1e-5), f"step {seed}"
        # the calls' new entries where the eager step put them (a float32 GEMM may round
        # the padded batch's K and V apart in the last place: 2.4e-7 on a Zen 5 CPU, 0
        # on Sapphire Rapids); padding only on scratch: nothing else written
        graph_after, eager_after = graph_pool.kv[:, :PAGES], backend.cache.kv
        assert torch.allclose(graph_after, eager_after, atol=1e-6, rtol=1e-6), f"step {seed}"
        wrote = eager_after != eager_before
        assert wrote.any() and torch.equal(graph_after[~wrote], graph_before[~wrote])
    assert graphs.replays == 4
    assert [graphs.graphs[b].wrapper.plans for b in (1, 2, 4, 8)] == [2, 1, 2, 3]


def test_only_the_wanted_rows_come_back(setup):
    model, backend, graphs, _, _ = setup
    tables, tokens, positions = decode_step([(9, [7, 2, 23]), (1, [9]), (5, [3, 1])], 7)
    got = graphs.run(tables, tokens, positions, np.array([0, 2]))
    want = eager(model, backend, tables, tokens, positions, [0, 2])
    assert got.shape == (2, CFG.vocab_size) and torch.allclose(got, want, atol=1e-5)


def test_steps_no_graph_serves_run_eagerly(setup):
    _, _, graphs, graph_pool, _ = setup
    before = graph_pool.kv.clone()
    mixed = PageTables.build(PS, [np.array([7, 2]), np.array([9])], [6, 1], [2, 1])
    assert graphs.run(mixed, np.array([1, 2, 3]), np.array([4, 5, 0]), np.arange(3)) is None
    tables, tokens, positions = decode_step([(1, [i]) for i in range(9)], 0)   # 9 > 8
    assert graphs.run(tables, tokens, positions, np.arange(9)) is None
    # more pages than the model's context (8 here): the table buffers are not sized for it
    tables, tokens, positions = decode_step([(36, list(range(9)))], 0)
    assert graphs.pages_per_call == 8
    assert graphs.run(tables, tokens, positions, np.arange(1)) is None
    assert graphs.replays == 0 and torch.equal(graph_pool.kv, before)


def test_graphs_share_one_logits_buffer(setup):
    _, _, graphs, _, _ = setup
    assert graphs.logits.shape == (8, CFG.vocab_size)
    for bucket, graph in graphs.graphs.items():
        assert graph.out.shape == (bucket, CFG.vocab_size)
        assert graph.out.data_ptr() == graphs.logits.data_ptr()


@pytest.mark.parametrize("heads, kv_heads, problem", [
    (9, 3, None), (32, 32, None), (32, 8, None), (48, 8, None), (64, 8, None),
    (28, 4, "decode on CUDA cores, which FlashInfer has for 1, 2, 3, 4, 6, 8 query heads "
            "per KV head, not 7"),
    (40, 8, "decode on CUDA cores, which FlashInfer has for 1, 2, 3, 4, 6, 8 query heads "
            "per KV head, not 5"),
])
def test_graphs_decode_the_group_sizes_flashinfer_has(heads, kv_heads, problem):
    assert cuda_graphs.model_problem(heads, kv_heads) == problem


def test_a_model_of_another_group_is_not_recorded(fake_flashinfer):  # noqa: F811
    from dataclasses import replace
    cfg = replace(CFG, num_heads=10, num_kv_heads=2)
    pool = PagedKVCache(cfg, PAGES, PS, torch.float32, torch.device("cpu"), spare_pages=1)
    with pytest.raises(ValueError, match=r"^CUDA graphs decode on CUDA cores, .* not 5$"):
        DecodeGraphs(LlamaModel(cfg), pool, lambda *a: None, 8, Recorder())


def test_graphs_need_a_scratch_page(fake_flashinfer):  # noqa: F811
    pool = PagedKVCache(CFG, PAGES, PS, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="scratch page"):
        DecodeGraphs(LlamaModel(CFG), pool, lambda *a: None, 8, Recorder())
