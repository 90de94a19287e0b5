"""The flashinfer backend's CPU-checkable half: the plan arguments it builds from a step's
PageTables (exact CSR arrays per phase), its wiring (plan once per step and phase, reused
by every layer; K/V written first; rows scattered back) against a fake `flashinfer`
module that computes what FlashInfer's docs say its paged wrappers compute, and the
choice of backend at start-up (`--attention`), with its errors. The real kernels are
tested in tests/gpu/test_flashinfer.py (CUDA only)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from predd.attention import backends as attention
from predd.attention import flashinfer_backend as attention_flashinfer
from predd.attention.backends import TorchAttention, make_backend, resolve
from predd.attention.flashinfer_backend import FlashInferAttention, split_step
from predd.worker.paged_kv import PagedKVCache
from predd.attention.page_table import PageTables
from tests.unit.helpers import refused_before_loading

PS = 4
# (kv_len, q_len, pages) in step order: decodes (one on a fresh page, one ending a
# page), a chunk with a past, a one-entry call, a fresh prefill
STEP = [(9, 1, [7, 2, 30]), (11, 5, [5, 1, 12]), (1, 1, [9]), (6, 6, [0, 3]),
        (16, 1, [20, 21, 8, 4])]


def step_tables(step=STEP) -> PageTables:
    return PageTables.build(PS, [np.array(p) for _, _, p in step], [s[0] for s in step],
                            [s[1] for s in step])


def test_plan_arguments_of_a_mixed_step():
    decode, prefill = split_step(step_tables())
    qo, indptr, indices, last = decode.plan_args()
    assert all(a.dtype == torch.int32 and a.device.type == "cpu" for a in (qo, indptr, indices, last))
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 2, 30, 9, 20, 21, 8, 4]
    assert last.tolist() == [1, 1, 4]
    assert qo.tolist() == [0, 1, 2, 3]
    assert decode.rows.tolist() == [0, 6, 13] and not decode.all_rows

    qo, indptr, indices, last = prefill.plan_args()
    assert indptr.tolist() == [0, 3, 5]
    assert indices.tolist() == [5, 1, 12, 0, 3]
    assert last.tolist() == [3, 2]
    assert qo.tolist() == [0, 5, 11]
    assert prefill.rows.tolist() == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    assert not prefill.all_rows


def test_a_one_phase_step_runs_on_the_whole_batch():
    decode, prefill = split_step(step_tables([STEP[0], STEP[2], STEP[4]]))
    assert prefill is None and decode.all_rows and decode.rows.tolist() == [0, 1, 2]
    decode, prefill = split_step(step_tables([STEP[3], STEP[1]]))
    assert decode is None and prefill.all_rows
    assert prefill.plan_args()[0].tolist() == [0, 6, 11]


# ----------------------------------------------------------------- fake flashinfer

def paged_reference(q, paged, qo_indptr, indptr, indices, last, page_size):
    """What FlashInfer documents for its NHD paged wrappers with causal=True: call i's
    entries are its pages in order, all full but the last (`last[i]` entries), and
    query j of its n rows sees entries 0..kv_len-n+j; q head h reads kv head h//G."""
    out = torch.empty_like(q)
    heads, kv_heads = q.shape[1], paged.shape[3]
    for i in range(len(indptr) - 1):
        pages = indices[indptr[i]:indptr[i + 1]].long()
        kv_len = (len(pages) - 1) * page_size + int(last[i])
        k = paged[pages, 0].flatten(0, 1)[:kv_len].repeat_interleave(heads // kv_heads, 1)
        v = paged[pages, 1].flatten(0, 1)[:kv_len].repeat_interleave(heads // kv_heads, 1)
        rows = slice(int(qo_indptr[i]), int(qo_indptr[i + 1]))
        n = rows.stop - rows.start
        scores = torch.einsum("nhd,lhd->hnl", q[rows].double(), k.double()) * q.shape[2] ** -0.5
        seen = torch.arange(kv_len)[None, :] <= kv_len - n + torch.arange(n)[:, None]
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("hnl,lhd->nhd", probs, v.double()).to(q.dtype)
    return out


class FakeWrapper:
    def __init__(self, workspace, kv_layout, use_tensor_cores=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.workspace, self.use_tensor_cores = workspace, use_tensor_cores
        self.plans, self.runs, self.kwargs = 0, 0, None

    def _plan(self, qo, indptr, indices, last, heads, kv_heads, head_dim, page_size, kwargs):
        for a in (qo, indptr, indices, last):
            assert a.dtype == torch.int32 and a.device.type == "cpu"
        self.plans += 1
        self.kwargs = kwargs
        self.table = (qo, indptr, indices, last, page_size, (heads, kv_heads, head_dim))

    def run(self, q, paged):
        qo, indptr, indices, last, page_size, shape = self.table
        assert q.is_contiguous() and q.shape == (int(qo[-1]), shape[0], shape[2])
        assert paged.shape[1:] == (2, page_size, shape[1], shape[2])
        self.runs += 1
        return paged_reference(q, paged, qo, indptr, indices, last, page_size)


class FakeDecode(FakeWrapper):
    def plan(self, indptr, indices, last, heads, kv_heads, head_dim, page_size, **kwargs):
        qo = torch.arange(len(last) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last, heads, kv_heads, head_dim, page_size, kwargs)


class FakePrefill(FakeWrapper):
    def plan(self, qo, indptr, indices, last, heads, kv_heads, head_dim, page_size, **kwargs):
        self._plan(qo, indptr, indices, last, heads, kv_heads, head_dim, page_size, kwargs)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """The backend built on CPU over a fake module (device and dtype checks bypassed)."""
    module = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
                             BatchPrefillWithPagedKVCacheWrapper=FakePrefill)
    monkeypatch.setattr(attention_flashinfer, "flashinfer_problem", lambda device, dtype: None)
    monkeypatch.setattr(attention_flashinfer, "load_flashinfer", lambda: module)
    monkeypatch.setattr(attention_flashinfer, "WORKSPACE_BYTES", 1024)
    return module


def random_pool(layers=3, pages=32, heads=6, kv_heads=2, seed=0):
    cfg = SimpleNamespace(name="t", num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                          head_dim=8)
    cache = PagedKVCache(cfg, pages, PS, torch.float32, torch.device("cpu"))
    torch.manual_seed(seed)
    cache.kv.normal_()
    return cache


def test_backend_plans_once_a_step_and_matches_the_torch_backend(fake_flashinfer):
    """Three layers of a mixed step: each wrapper planned once (decode without causal,
    prefill with causal=True; no RoPE in the kernel), run once per layer, outputs equal
    to the torch backend's, and the pool left exactly as the torch backend leaves it."""
    tables = step_tables()
    ours, ref = random_pool(), random_pool()
    backend = FlashInferAttention(ours)
    assert backend.name == "flashinfer" and not backend.decode.use_tensor_cores
    attend, attend_ref = backend.prepare(tables), TorchAttention(ref).prepare(tables)
    rows = int(tables.qo_indptr[-1])
    for layer in range(3):
        q, k, v = torch.randn(rows, 6, 8), torch.randn(rows, 2, 8), torch.randn(rows, 2, 8)
        out = attend(layer, q, k, v)
        assert torch.allclose(out, attend_ref(layer, q, k, v), atol=1e-5), f"layer {layer}"
    assert torch.equal(ours.kv, ref.kv)
    assert (backend.decode.plans, backend.decode.runs) == (1, 3)
    assert (backend.prefill.plans, backend.prefill.runs) == (1, 3)
    assert backend.prefill.kwargs == dict(causal=True, pos_encoding_mode="NONE",
                                          q_data_type=torch.float32, kv_data_type=torch.float32)
    assert backend.decode.kwargs == dict(pos_encoding_mode="NONE", q_data_type=torch.float32,
                                         kv_data_type=torch.float32)
    backend.prepare(tables)
    assert (backend.decode.plans, backend.prefill.plans) == (2, 2)


def test_decode_only_step_skips_the_prefill_wrapper(fake_flashinfer):
    """A step of decodes alone runs the decode wrapper on the whole batch, each layer
    over its own pages; 4 q heads per kv head put decode on tensor cores."""
    tables = step_tables([STEP[4], STEP[0]])
    ours, ref = random_pool(layers=2, heads=8), random_pool(layers=2, heads=8)
    backend = FlashInferAttention(ours)
    assert backend.decode.use_tensor_cores
    attend, attend_ref = backend.prepare(tables), TorchAttention(ref).prepare(tables)
    for layer in range(2):
        q, k, v = torch.randn(2, 8, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8)
        assert torch.allclose(attend(layer, q, k, v), attend_ref(layer, q, k, v), atol=1e-5)
    assert torch.equal(ours.kv, ref.kv)
    assert (backend.decode.plans, backend.decode.runs) == (1, 2)
    assert (backend.prefill.plans, backend.prefill.runs) == (0, 0)


# ----------------------------------------------------------------- choosing a backend

def test_torch_is_taken_when_asked_and_auto_keeps_cpu_off_flashinfer(monkeypatch):
    def no_import(name):
        raise AssertionError(f"imported {name} on CPU")
    monkeypatch.setattr(attention_flashinfer.importlib, "import_module", no_import)
    assert resolve("torch", "cuda", "float32") == ("torch", "asked for")
    assert resolve("auto", "cpu", "float16") == (
        "torch", "auto: cpu computes only in float32 or bfloat16, not float16")
    assert resolve("auto", "cuda", "float32") == (
        "torch", "auto: flashinfer computes only in bfloat16 or float16, not float32 "
        "(pass --dtype bfloat16)")


@pytest.mark.parametrize("device, dtype, message", [
    ("cpu", "bfloat16", "--attention flashinfer needs a CUDA device, not cpu (EINVAL)"),
    ("cuda:1", "float32", "--attention flashinfer computes only in bfloat16 or float16, "
     "not float32 (pass --dtype bfloat16) (EINVAL)"),
])
def test_flashinfer_where_it_cannot_run_is_refused(device, dtype, message):
    with pytest.raises(ValueError) as err:
        resolve("flashinfer", device, dtype)
    assert str(err.value) == message


def test_flashinfer_missing_is_enopkg_and_auto_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)     # import raises ImportError
    with pytest.raises(ValueError) as err:
        resolve("flashinfer", "cuda", "float16")
    assert str(err.value) == ("--attention flashinfer is not importable (ModuleNotFoundError: "
                              "import of flashinfer halted; None in sys.modules) (ENOPKG)")
    assert resolve("auto", "cuda", "bfloat16") == (
        "torch", "auto: flashinfer is not importable (ModuleNotFoundError: import of "
        "flashinfer halted; None in sys.modules)")


def test_auto_takes_flashinfer_on_cuda_when_it_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace())
    assert resolve("auto", "cuda", "bfloat16") == ("flashinfer", "auto: CUDA and flashinfer are here")
    assert resolve("flashinfer", "cuda:0", "float16") == ("flashinfer", "asked for")


def test_unknown_backend_is_einval():
    with pytest.raises(ValueError) as err:
        resolve("triton", "cuda", "float16")
    assert str(err.value) == "--attention must be one of auto, torch, cpu, flashinfer, not 'triton' (EINVAL)"


def test_make_backend_on_cpu():
    cache = random_pool(layers=1)
    assert make_backend("auto", cache).name == "cpu"      # float32 on a CPU with a compiler
    assert make_backend("torch", cache).name == "torch"
    assert isinstance(make_backend("torch", cache), TorchAttention)
    with pytest.raises(ValueError, match=r"needs a CUDA device, not cpu \(EINVAL\)$"):
        make_backend("flashinfer", cache)
    with pytest.raises(ValueError, match=r"needs a CUDA device, not cpu \(EINVAL\)$"):
        FlashInferAttention(cache)


def test_predd_refuses_flashinfer_on_cpu_before_loading_a_model(tmp_path, capsys):
    assert refused_before_loading(tmp_path, capsys, "--device", "cpu", "--attention",
                                  "flashinfer") == (
        2, "predd: --attention flashinfer needs a CUDA device, not cpu (EINVAL)")
