"""PageTables (the step layout every attention backend reads) and the torch backend
against dense attention: exact tables, and the same outputs for any page placement."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from predd.attention.backends import TorchAttention
from predd.worker.paged_kv import PagedKVCache
from predd.attention.page_table import PageTables


def test_tables_are_flashinfer_csr():
    t = PageTables.build(4, [np.array([7, 2]), np.array([5]), np.array([1, 0, 3])],
                         kv_len=[5, 4, 9], q_len=[1, 4, 2])
    assert t.indptr.tolist() == [0, 2, 3, 6]
    assert t.indices.tolist() == [7, 2, 5, 1, 0, 3]
    assert t.last_page_len.tolist() == [1, 4, 1]
    assert t.qo_indptr.tolist() == [0, 1, 5, 7]
    assert t.q_len.tolist() == [1, 4, 2]
    # new tokens: entry 4 of call 0 (page 2 slot 0), all 4 of call 1, entries 7..8 of call 2
    assert t.new_slots().tolist() == [2 * 4 + 0, 20, 21, 22, 23, 0 * 4 + 3, 3 * 4 + 0]
    assert t.slots(2, 0, 9).tolist() == [4, 5, 6, 7, 0, 1, 2, 3, 12]
    assert t.padded([0, 2]).tolist() == [[7, 2, 7], [1, 0, 3]]


def test_new_slots_and_query_rows_are_the_per_call_definitions():
    """new_slots and query_rows work on all calls at once: over random layouts (calls of
    one token, chunks, a past ending inside a page, any page order) they are slots() of
    each call's last q_len entries and the calls' own rows, in the order asked."""
    rng = np.random.default_rng(7)
    for _ in range(50):
        ps = int(rng.choice([1, 4, 16]))
        kv = rng.integers(1, 60, size=int(rng.integers(1, 9)))
        q = np.array([int(rng.integers(1, k + 1)) for k in kv])
        counts = -(-kv // ps)
        pool = rng.permutation(int(counts.sum()) + 5)
        at = np.concatenate([[0], np.cumsum(counts)])
        t = PageTables.build(ps, [pool[at[i]:at[i + 1]] for i in range(len(kv))], kv, q)
        want = np.concatenate([t.slots(i, int(k - n), int(k)) for i, (k, n) in
                               enumerate(zip(kv, q))])
        assert t.new_slots().dtype == np.int64 and t.new_slots().tolist() == want.tolist()
        calls = list(rng.permutation(len(kv))[:int(rng.integers(0, len(kv) + 1))])
        rows = t.query_rows(calls)
        assert rows.dtype == np.int64
        assert rows.tolist() == [r for i in calls
                                 for r in range(t.qo_indptr[i], t.qo_indptr[i + 1])]


@pytest.mark.parametrize("pages, kv_len, q_len", [
    ([np.array([1])], [5], [1]),            # a table short of its entries
    ([np.array([1, 2])], [4], [1]),         # a page too many
    ([np.array([1])], [3], [4]),            # more new tokens than entries
    ([np.array([1])], [3], [0]),            # nothing to compute
    ([np.array([1])], [3, 2], [1]),         # lengths that disagree
])
def test_tables_refuse_a_layout_that_does_not_add_up(pages, kv_len, q_len):
    with pytest.raises(ValueError):
        PageTables.build(4, pages, kv_len, q_len)


def dense_reference(q, k_all, v_all, past):
    """Causal attention of q's n rows over all L entries, the last n being q's own."""
    n, L = q.shape[0], k_all.shape[0]
    mask = torch.arange(L)[None, :] <= past + torch.arange(n)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all.transpose(0, 1)[None],
                                       v_all.transpose(0, 1)[None], attn_mask=mask,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


def test_torch_backend_matches_dense_attention_for_any_page_placement():
    """Calls of one token (batched, padded), a chunk with a past and a fresh prefill in
    one step, their pages scattered over the pool: the outputs are dense attention's,
    and the new K/V land in the reserved slots."""
    rng = np.random.default_rng(0)
    cfg = SimpleNamespace(name="t", num_layers=1, num_kv_heads=2, head_dim=8)
    ps, heads = 4, 4
    cache = PagedKVCache(cfg, 32, ps, torch.float32, torch.device("cpu"))
    cache.kv.normal_()
    free = list(rng.permutation(32))
    calls = [(9, 1), (1, 1), (14, 1), (11, 5), (6, 6)]        # (kv_len, q_len)
    pages = [np.array([free.pop() for _ in range(-(-kv // ps))]) for kv, _ in calls]
    tables = PageTables.build(ps, pages, [c[0] for c in calls], [c[1] for c in calls])
    total = sum(n for _, n in calls)
    q = torch.randn(total, heads, 8)
    k = torch.randn(total, 2, 8)
    v = torch.randn(total, 2, 8)
    out = TorchAttention(cache).prepare(tables)(0, q, k, v)
    for i, (kv_len, n) in enumerate(calls):
        rows = slice(int(tables.qo_indptr[i]), int(tables.qo_indptr[i + 1]))
        flat = cache.flat(0)
        k_rows = torch.from_numpy(cache.rows(tables.slots(i, 0, kv_len)))
        assert torch.equal(flat[k_rows[-n:]], k[rows])          # written in place
        assert torch.equal(flat[k_rows[-n:] + ps], v[rows])
        want = dense_reference(q[rows], flat[k_rows], flat[k_rows + ps], kv_len - n)
        assert torch.allclose(out[rows], want, atol=1e-5), f"call {i}"
