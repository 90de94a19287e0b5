"""predd's CPU kernels (predd/csrc): the cpu attention backend against the torch backend
on the same steps, the layer ops against torch's, and how they are built and chosen."""
from __future__ import annotations

import os
import re
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from predd.attention import backends as attention
from predd.kernels import bindings, build, cpu_kernels, library, probes
from predd.attention.backends import CpuAttention, TorchAttention, resolve
from predd.attention.page_table import PageTables
from predd.worker.paged_kv import PagedKVCache


def _step(calls, kv_heads=2, heads=6, head_dim=16, ps=4, pages=64, seed=0,
          dtype=torch.float32):
    """Two pools with the same random entries (ours in `dtype`, the reference in
    float32), the step's tables and its q/k/v (in `dtype`)."""
    rng = np.random.default_rng(seed)
    cfg = SimpleNamespace(name="t", num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim)
    ours = PagedKVCache(cfg, pages, ps, dtype, torch.device("cpu"))
    torch.manual_seed(seed)
    ours.kv.normal_()
    ref = PagedKVCache(cfg, pages, ps, torch.float32, torch.device("cpu"))
    ref.kv.copy_(ours.kv)
    free = list(rng.permutation(pages))
    tables = PageTables.build(ps, [np.array([free.pop() for _ in range(-(-kv // ps))])
                                   for kv, _ in calls],
                              [c[0] for c in calls], [c[1] for c in calls])
    total = sum(n for _, n in calls)
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim).to(dtype)   # q: a strided view, as in the model
    return ours, ref, tables, (qkv[:, :heads], qkv[:, heads:heads + kv_heads],
                               qkv[:, heads + kv_heads:])


@pytest.mark.parametrize("calls", [
    # decode calls (one new token), chunks after a past (kernel up to 64 rows, SDPA
    # beyond), fresh prefills (SDPA): every kind in one step
    [(9, 1), (1, 1), (14, 1), (11, 5), (6, 6), (100, 70), (30, 3), (64, 64)],
    [(37, 1)],                              # one row: a task per (row, kv head)
    [(5 + i, 1) for i in range(12)],        # many rows: a task per row, all heads
])
def test_cpu_backend_matches_torch_on_every_kind_of_call(calls):
    ours, ref, tables, (q, k, v) = _step(calls)
    got = CpuAttention(ours).prepare(tables)(0, q, k, v)
    want = TorchAttention(ref).prepare(tables)(0, q, k, v)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=2e-6), float((got - want).abs().max())
    assert torch.equal(ours.kv, ref.kv)        # the new K/V written where torch writes them


# (kv heads, query heads, head_dim): head_dim 16 takes the scalar loops, 64 and 128 the
# vector ones; 1, 3, 5 and 8 query heads a kv head cover the grouped weighted sums (four
# heads at a time, then the rest)
SHAPES = [(2, 6, 16), (3, 9, 64), (2, 2, 64), (1, 5, 128), (2, 16, 64)]


@pytest.mark.parametrize("kv_heads,heads,head_dim", SHAPES)
def test_cpu_backend_matches_torch_at_every_head_shape(kv_heads, heads, head_dim):
    calls = [(9, 1), (37, 1), (11, 5), (30, 3)] + [(5 + i, 1) for i in range(6)]
    ours, ref, tables, (q, k, v) = _step(calls, kv_heads=kv_heads, heads=heads,
                                         head_dim=head_dim)
    got = CpuAttention(ours).prepare(tables)(0, q, k, v)
    want = TorchAttention(ref).prepare(tables)(0, q, k, v)
    assert torch.allclose(got, want, atol=2e-6), float((got - want).abs().max())


@pytest.mark.parametrize("kv_heads,heads,head_dim", SHAPES)
def test_cpu_backend_in_bfloat16_is_float32_rounded_once(kv_heads, heads, head_dim):
    """bf16 pool and rows, float32 arithmetic: each output is the float32 reference
    (the same bf16 values, computed by the torch backend in float32) rounded to bf16,
    give or take the last bit where the two sums round differently."""
    calls = [(9, 1), (1, 1), (37, 1), (11, 5), (30, 3)] + [(5 + i, 1) for i in range(6)]
    ours, ref, tables, (q, k, v) = _step(calls, kv_heads=kv_heads, heads=heads,
                                         head_dim=head_dim, dtype=torch.bfloat16)
    ref.kv.copy_(ours.kv.float())
    got = CpuAttention(ours).prepare(tables)(0, q, k, v)
    want = TorchAttention(ref).prepare(tables)(0, q.float(), k.float(), v.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -30))) - 7)
    assert ((got.float() - want).abs() <= ulp).all(), float(((got.float() - want).abs() / ulp).max())
    assert (got.float() == want.to(torch.bfloat16).float()).float().mean() > 0.95
    assert torch.equal(ours.kv.float(), ref.kv)


@pytest.mark.parametrize("kv_heads,heads,head_dim", SHAPES)
def test_whole_pages_of_16_in_bfloat16_score_as_the_float32_reference(kv_heads, heads,
                                                                      head_dim):
    """Pages of 16 entries: whole pages are scored 16 entries at once (AVX-512 BF16,
    head_dim a multiple of 64), a page's tail entry by entry. Against the float32
    reference: the last bf16 bit, or float32's own rounding of sums of O(1) terms (1e-6)
    where an output cancels to near zero, below the bf16 ulp of its value. A score put
    on the wrong entry would be off by ~0.1."""
    calls = [(9, 1), (16, 1), (37, 1), (48, 1), (30, 3), (64, 20), (100, 1)]
    ours, ref, tables, (q, k, v) = _step(calls, kv_heads=kv_heads, heads=heads,
                                         head_dim=head_dim, ps=16, dtype=torch.bfloat16)
    ref.kv.copy_(ours.kv.float())
    got = CpuAttention(ours).prepare(tables)(0, q, k, v).float()
    want = TorchAttention(ref).prepare(tables)(0, q.float(), k.float(), v.float())
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -30))) - 7)
    err = (got - want).abs()
    assert (err <= ulp + 1e-6).all(), float((err / (ulp + 1e-6)).max())
    assert (got == want.to(torch.bfloat16).float()).float().mean() > 0.95


BLOCKS = cpu_kernels.problem() is None and cpu_kernels.kernels().attention_blocks is not None


@pytest.mark.skipif(not BLOCKS, reason="no attention blocks here (AMX tiles or bf16 dot "
                    "products), or predd's kernels do not build")
@pytest.mark.parametrize("kv_heads,heads,head_dim", [(3, 9, 64), (2, 2, 64), (1, 5, 128),
                                                    (2, 16, 64)])
def test_chunks_attend_in_blocks_as_the_float32_reference_rounded_once(kv_heads, heads,
                                                                      head_dim, monkeypatch):
    """Calls of 4 new tokens or more (ATTENTION_BLOCK_ROWS; the dot products' limit is the same) take
    the block kernel, on AMX tiles or by bf16 dot products (chunks after a past
    and fresh prefills; blocks of 16 query vectors that end inside a row's heads; pasts
    that end inside a page), the rest the row kernel, in one step; both held to the
    bound of the bf16 tests above. NaN in the unused entries of a call's last page (an
    earlier owner's garbage) must not reach any output."""
    calls = [(9, 1), (8, 8), (30, 9), (64, 41), (100, 64), (47, 3), (17, 17), (29, 12)]
    ours, ref, tables, (q, k, v) = _step(calls, kv_heads=kv_heads, heads=heads,
                                         head_dim=head_dim, ps=16, pages=96, seed=3,
                                         dtype=torch.bfloat16)
    ref.kv.copy_(ours.kv.float())
    for i, (kv_len, _) in enumerate(calls):      # (the torch reference reads whole pages)
        last = tables.indices[tables.indptr[i + 1] - 1]
        ours.kv[0, last, :, kv_len % 16 or 16:] = float("nan")
    kernels = cpu_kernels.kernels()
    tiles, used = kernels._lib.paged_attention_tiles_bf16, []
    monkeypatch.setattr(kernels._lib, "paged_attention_tiles_bf16",
                        lambda *a: used.append(a[14]) or tiles(*a))
    got = CpuAttention(ours).prepare(tables)(0, q, k, v).float()
    assert used == [6]                       # the six calls of ATTENTION_BLOCK_ROWS (4) or more, a layer
    want = TorchAttention(ref).prepare(tables)(0, q.float(), k.float(), v.float())
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -30))) - 7)
    err = (got - want).abs()
    assert (err <= ulp + 1e-6).all(), float((err / (ulp + 1e-6)).max())
    assert (got == want.to(torch.bfloat16).float()).float().mean() > 0.95
    kernels.use_bf16_tiles(False)            # the row kernel alone: the same bound
    try:
        rows = CpuAttention(ours).prepare(tables)(0, q, k, v).float()
    finally:
        kernels.use_bf16_tiles(True)
    assert used == [6] and ((rows - want).abs() <= ulp + 1e-6).all()


@pytest.mark.skipif(not BLOCKS, reason="no attention blocks here (AMX tiles or bf16 dot "
                    "products), or predd's kernels do not build")
def test_forks_attend_to_their_shared_pages_together_as_the_reference_rounded_once(
        monkeypatch):
    """Decode rows whose tables begin with the same pages (forks of a cached document)
    attend to those pages in blocks first (SharedPrefixes), grouped by their first page,
    the prefix being what all of a group share; fewer than SHARED_ROWS (6, set here for
    either kind of blocks) rows, or chunks in blocks, are not grouped. Outputs held to
    the bf16 bound of the tests above."""
    ps, kv_heads, heads, head_dim = 16, 3, 9, 64
    kernels = cpu_kernels.kernels()          # these limits, whatever this CPU's kind
    monkeypatch.setitem(library.BLOCK_LIMITS, kernels.attention_blocks,
                        library.BlockLimits(4, 6, 16))
    rng = np.random.default_rng(5)
    free = [int(x) for x in rng.permutation(128)]
    take = lambda n: [free.pop() for _ in range(n)]      # noqa: E731
    d1, d2, d3 = take(20), take(16), take(21)
    tables, kv_lens, q_lens = [], [], []
    for k in range(7):                       # 7 forks of d1, 1..16 entries of their own
        tables.append(d1 + take(1)); kv_lens.append(320 + 1 + 2 * k); q_lens.append(1)
    tables.append(d1[:18] + take(3)); kv_lens.append(18 * 16 + 40); q_lens.append(1)
    for _ in range(6):                       # 6 forks of d2, each one entry past it
        tables.append(d2 + take(1)); kv_lens.append(257); q_lens.append(1)
    for _ in range(2):                       # 2 forks of d3: too few to group
        tables.append(d3 + take(1)); kv_lens.append(340); q_lens.append(1)
    tables.append(d1 + take(1)); kv_lens.append(325); q_lens.append(5)   # a chunk: tiles
    tables.append(take(3)); kv_lens.append(40); q_lens.append(1)
    cfg = SimpleNamespace(name="t", num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim)
    ours = PagedKVCache(cfg, 128, ps, torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(5)
    ours.kv.normal_()
    ref = PagedKVCache(cfg, 128, ps, torch.float32, torch.device("cpu"))
    ref.kv.copy_(ours.kv.float())
    step = PageTables.build(ps, [np.array(t) for t in tables], kv_lens, q_lens)
    qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, head_dim).to(torch.bfloat16)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    calls = list(range(len(tables)))
    n, row_token, row_pages, row_visible = CpuAttention.rows(step, calls)
    rest = kernels.tile_calls(n, row_token, row_pages, row_visible)[2]
    plan = kernels.shared_prefixes(step.indices, rest[1], rest[2], ps)
    # the row kernel's rows: calls 0-15 and 17 (the chunk, call 16, is on tiles)
    assert plan.index.tolist() == list(range(8)) + list(range(8, 14))
    assert (plan.row.tolist(), plan.rows.tolist(), plan.pages.tolist()) == (
        [0, 8], [8, 6], [18, 16])
    assert plan.start.tolist() == [18 * 16] * 8 + [16 * 16] * 6 + [0, 0, 0]
    shared, used = kernels._lib.shared_prefix_tiles_bf16, []
    monkeypatch.setattr(kernels._lib, "shared_prefix_tiles_bf16",
                        lambda *a: used.append(a[14]) or shared(*a))
    got = CpuAttention(ours).prepare(step)(0, q, k, v).float()
    assert used == [2]                       # both groups, in one call a layer
    want = TorchAttention(ref).prepare(step)(0, q.float(), k.float(), v.float())
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -30))) - 7)
    err = (got - want).abs()
    assert (err <= ulp + 1e-6).all(), float((err / (ulp + 1e-6)).max())
    assert (got == want.to(torch.bfloat16).float()).float().mean() > 0.95
    kernels.shared_prefix = False            # off (predd --cascade off): no groups
    try:
        assert kernels.shared_prefixes(step.indices, rest[1], rest[2], ps) is None
        alone = CpuAttention(ours).prepare(step)(0, q, k, v).float()
    finally:
        kernels.shared_prefix = True
    assert used == [2] and ((alone - want).abs() <= ulp + 1e-6).all()


def test_cpu_backend_sends_calls_of_up_to_kernel_rows_to_the_kernel(monkeypatch):
    """The kernel sees decode rows and the rows of short chunks, after a past or fresh,
    each with the entries it may see (causal within its chunk); a chunk of more than
    KERNEL_ROWS tokens goes to SDPA."""
    calls = [(9, 1), (11, 5), (6, 6), (100, 70)]
    ours, _, tables, (q, k, v) = _step(calls)
    backend = CpuAttention(ours)
    seen = []
    monkeypatch.setattr(backend.kernel, "bind_attention", lambda indices, token, pages,
                        visible, most, call_rows, page_size: seen.append((
                            token.tolist(), pages.tolist(), visible.tolist(), most,
                            call_rows.tolist())) or (lambda *a: None))
    backend.prepare(tables)(0, q, k, v)
    assert seen == [([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
                     [0, 3, 3, 3, 3, 3, 6, 6, 6, 6, 6, 6],
                     [9, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6], 11, [1, 5, 6])]


def test_probe_and_cache(tmp_path, monkeypatch):
    """A build lands in $SYMPHONY_CACHE under a name keyed by source, flags, compiler
    and CPU; the next one finds it; the probe agrees with torch."""
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path))
    built = build.build()
    assert built.parent == tmp_path / "kernels" and built.name.startswith("predd-cpu-")
    stamp = built.stat().st_mtime_ns
    assert build.build() == built
    assert built.stat().st_mtime_ns == stamp
    assert probes.probe(library.Kernels(built), cpu_kernels.CpuOps) < probes.PROBE_TOLERANCE


def test_a_cache_others_can_write_is_never_loaded(tmp_path, monkeypatch):
    """A group- or world-writable cache directory could hold someone else's library:
    the build goes to the per-user directory under /tmp instead."""
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    os.chmod(shared / "kernels", 0o777)
    monkeypatch.setenv("SYMPHONY_CACHE", str(shared))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(build.tempfile, "tempdir", None)    # re-read TMPDIR
    built = build.build()
    assert built.parent == tmp_path / "tmp" / f"symphony-kernels-{os.geteuid()}"
    assert list((shared / "kernels").iterdir()) == []


def test_no_compiler_is_enopkg_and_auto_keeps_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    cpu_kernels.kernels.cache_clear()
    try:
        with pytest.raises(ValueError) as err:
            resolve("cpu", "cpu", "float32")
        assert str(err.value) == ("--attention cpu kernel unavailable: no C compiler "
                                  "(no-such-cc) on PATH (ENOPKG)")
        assert resolve("auto", "cpu", "float32") == (
            "torch", "auto: cpu kernel unavailable: no C compiler (no-such-cc) on PATH")
    finally:
        cpu_kernels.kernels.cache_clear()


def test_choosing_the_cpu_backend():
    assert resolve("auto", "cpu", "float32") == (
        "cpu", "auto: predd's CPU kernel builds and agrees with torch here")
    assert resolve("cpu", "cpu", "float32") == ("cpu", "asked for")
    assert resolve("torch", "cpu", "float32") == ("torch", "asked for")
    with pytest.raises(ValueError) as err:
        resolve("cpu", "cuda:0", "float32")
    assert str(err.value) == "--attention cpu is for the CPU, not cuda:0 (EINVAL)"
    assert resolve("cpu", "cpu", "bfloat16") == ("cpu", "asked for")
    with pytest.raises(ValueError) as err:
        resolve("cpu", "cpu", "float16")
    assert str(err.value) == ("--attention cpu computes only in float32 or bfloat16, "
                              "not float16 (EINVAL)")
    assert "cpu" in attention.CHOICES


# ----------------------------------------------------------------- a layer's small ops

@pytest.mark.parametrize("rows", [1, 7, 300])       # 300 x 576 floats: split over threads
def test_cpu_ops_match_torch_ops(rows):
    from predd.model.llama import RMSNorm, TorchOps
    gen = torch.Generator().manual_seed(rows)
    ours, ref = cpu_kernels.CpuOps(cpu_kernels.kernels()), TorchOps()
    norm = RMSNorm(576, 1e-5)
    with torch.inference_mode():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
        x, delta = torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen)
        x_ref, h_ref = ref.add_norm(x, delta, norm)
        mine = x.clone()
        x_got, h_got = ours.add_norm(mine, delta, norm)
        assert x_got is mine and torch.allclose(mine, x_ref, atol=1e-6)   # added in place
        assert torch.allclose(h_got, h_ref, atol=1e-5)
        _, h_alone = ours.add_norm(x.clone(), None, norm)
        assert torch.allclose(h_alone, norm(x), atol=1e-5)
        # RoPE on q and k (9 + 3 heads) of a qkv buffer whose v (3 heads) stays put
        qkv = torch.randn(rows, 15, 64, generator=gen)
        freqs = torch.arange(rows, dtype=torch.float32)[:, None] * (
            10000.0 ** (-torch.arange(0, 64, 2).float() / 64))[None, :]
        want = ref.rope(qkv, 12, ref.rotary(freqs, torch.float32))
        turned = qkv.clone()
        assert ours.rope(turned, 12, ours.rotary(freqs, torch.float32)) is turned
        assert torch.allclose(turned[:, :12], want, atol=1e-5)
        assert torch.equal(turned[:, 12:], qkv[:, 12:])
        gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 6
        assert torch.allclose(ours.silu_mul(gate_up), ref.silu_mul(gate_up), rtol=1e-5,
                              atol=1e-5)



def test_rotary_at_and_embed_look_up_what_the_torch_ops_compute():
    """CpuOps.rotary_at: the cos and sin of the positions' angles from a table made once,
    bit for bit what rotary computes from the same angles, and computed outside the
    table (positions are the programs' own: up to 2^31 - 1, never a table that large;
    a negative one, refused before it gets here, would not wrap around to the end).
    CpuOps.embed: the embedding's rows by a numpy lookup, a new tensor each call; ids
    out of range raise as torch's embedding does."""
    from predd.model.llama import TorchOps
    ours, ref = cpu_kernels.CpuOps(cpu_kernels.kernels()), TorchOps()
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2).float() / 64)
    last = cpu_kernels.ROTARY_ROWS - 1
    for positions in ([0, 1, 439, 440, last], [7], list(range(300)), [last + 1, 5],
                      [2**31 - 2], [3, -1]):
        at = torch.tensor(positions, dtype=torch.int64)
        cos, sin = ours.rotary_at(at, inv_freq, torch.float32)
        want_cos, want_sin = ours.rotary(at.float()[:, None] * inv_freq[None, :],
                                         torch.float32)
        assert cos.shape == (len(positions), 32) and cos.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert len(ours._table[1]) == cpu_kernels.ROTARY_ROWS       # made once
    at = torch.tensor([5, 0, 300])
    got = ref.rotary_at(at, inv_freq, torch.bfloat16)
    want = ref.rotary(at.float()[:, None] * inv_freq[None, :], torch.bfloat16)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(100, 24, generator=torch.Generator().manual_seed(1)).to(dtype)
        ids = torch.tensor([3, 99, 0, 3])
        x = ours.embed(weight, ids)
        assert x.dtype == dtype and torch.equal(x, ref.embed(weight, ids))
        x += 1                                        # a new tensor: the weight is as it was
        assert torch.equal(ours.embed(weight, ids), weight[ids])
        for bad in ([100], [-1]):
            with pytest.raises(IndexError):
                ours.embed(weight, torch.tensor(bad))


def test_the_head_copies_rows_unless_it_wants_every_row_in_order():
    """LlamaModel.head takes x and delta as they are only for rows 0 .. T - 1 in order (a
    step of decodes); any other set (a subset, a repeat, another order) is gathered."""
    from predd.model.llama import every_row
    rows = lambda *r: torch.tensor(r, dtype=torch.int64)   # noqa: E731
    assert every_row(rows(0), 1) and every_row(rows(0, 1), 2)
    assert every_row(torch.arange(64), 64) and every_row(rows(), 0)
    for r, count in (((1,), 1), ((0,), 2), ((0, 0), 2), ((1, 0), 2), ((0, 2, 1, 3), 4),
                     ((0, 0, 3, 3), 4), ((0, 1, 1, 3), 4), ((), 1), ((0, 1, 2), 4)):
        assert not every_row(rows(*r), count), r

@pytest.mark.parametrize("rows", [1, 300])
def test_cpu_ops_in_bfloat16(rows):
    """bf16 in and out, float32 inside: the residual sum and the norm exactly as torch's
    bf16 ops round them (one rounding each where torch rounds); RoPE and SwiGLU's
    product rounded once where torch rounds every step, so within two units in the last
    place of the tensor's largest value, and most often equal."""
    from predd.model.llama import RMSNorm, TorchOps
    gen = torch.Generator().manual_seed(rows)
    bf = torch.bfloat16
    ours, ref = cpu_kernels.CpuOps(cpu_kernels.kernels()), TorchOps()
    norm = RMSNorm(576, 1e-5)
    with torch.inference_mode():
        norm.weight.copy_(torch.rand(576, generator=gen) + 0.5)
        norm.to(bf)
        x = torch.randn(rows, 576, generator=gen).to(bf)
        delta = torch.randn(rows, 576, generator=gen).to(bf)
        x_ref, h_ref = ref.add_norm(x, delta, norm)
        mine = x.clone()
        x_got, h_got = ours.add_norm(mine, delta, norm)
        assert x_got is mine and mine.dtype == bf and torch.equal(mine, x_ref)
        assert h_got.dtype == bf
        assert (h_got != h_ref).float().mean() < 0.01       # rsqrt vs 1 / sqrt: rare ties
        assert torch.allclose(h_got.float(), h_ref.float(), rtol=2 ** -7, atol=0)
        qkv = torch.randn(rows, 15, 64, generator=gen).to(bf)
        freqs = torch.arange(rows, dtype=torch.float32)[:, None] * (
            10000.0 ** (-torch.arange(0, 64, 2).float() / 64))[None, :]
        want = ref.rope(qkv, 12, ref.rotary(freqs, bf))
        turned = qkv.clone()
        ours.rope(turned, 12, ours.rotary(freqs, bf))
        assert turned.dtype == bf and torch.equal(turned[:, 12:], qkv[:, 12:])
        gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 6).to(bf)
        for got, ref_out in ((turned[:, :12], want), (ours.silu_mul(gate_up), ref.silu_mul(gate_up))):
            diff = (got.float() - ref_out.float()).abs()
            assert diff.max() <= ref_out.float().abs().max() * 2 ** -6
            assert (diff == 0).float().mean() > 0.5      # 66-76% here


def test_bfloat16_ops_keep_denormals_as_torch_rounds_them():
    """The AVX-512 rows round with VCVTNEPS2BF16, which reads a float32 denormal as 0:
    a vector holding one is rounded value by value, so a residual sum (or a rotated
    value, or SwiGLU's product) that lands among the denormals is still the one torch's
    bf16 ops give (not 0)."""
    from predd.model.llama import RMSNorm, TorchOps
    bf = torch.bfloat16
    ours, ref = cpu_kernels.CpuOps(cpu_kernels.kernels()), TorchOps()
    norm = RMSNorm(576, 1e-5).to(bf)
    with torch.inference_mode():
        x = torch.full((3, 576), 3e-39).to(bf)
        x[1] = torch.randn(576)
        delta = torch.full((3, 576), 1e-39).to(bf)
        x_ref, h_ref = ref.add_norm(x, delta, norm)
        mine = x.clone()
        _, h_got = ours.add_norm(mine, delta, norm)
        assert x_ref[0, 0] != 0 and x_ref[0, 0].float().abs() < torch.finfo(torch.float32).tiny
        assert torch.equal(mine, x_ref)
        assert torch.equal(h_got[0], h_ref[0]) and torch.equal(h_got[2], h_ref[2])
        qkv = torch.full((1, 15, 64), 3e-39).to(bf)   # at position 0: turned by angle 0
        freqs = torch.zeros(1, 32)
        want = ref.rope(qkv, 12, ref.rotary(freqs, bf))
        ours.rope(qkv, 12, ours.rotary(freqs, bf))
        assert want[0, 0, 0] != 0 and torch.equal(qkv[:, :12], want)
        gate_up = torch.full((1, 2 * 1536), 1e-38).to(bf)       # silu(g) * u ~ 5e-77: 0
        gate_up[0, 1536:] = 1.0                               # ... and 5e-39: a denormal
        want = ref.silu_mul(gate_up)
        assert want[0, 0] != 0 and torch.equal(ours.silu_mul(gate_up), want)


def test_model_with_cpu_ops_gives_torch_ops_logits():
    """A tiny seeded Llama: the same logits (within float32 reordering) whichever ops run."""
    from predd.attention.backends import TorchAttention
    from predd.model.loader import ModelConfig
    from predd.model.llama import LlamaModel
    cfg = ModelConfig(name="tiny", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaModel(cfg).eval()
    for param in model.parameters():
        param.data.normal_(0, 0.2)
    pool = PagedKVCache(cfg, 8, 4, torch.float32, torch.device("cpu"))
    tables = PageTables.build(4, [np.array([3, 0, 5])], [11], [11])
    ids, pos, rows = torch.arange(11) * 7 % 97, torch.arange(11), torch.arange(11)
    want = model(ids, pos, TorchAttention(pool).prepare(tables), rows)
    model.ops = cpu_kernels.CpuOps(cpu_kernels.kernels())
    got = model(ids, pos, CpuAttention(pool).prepare(tables), rows)
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())


def test_greedy_pick_is_the_first_argmax_and_its_exact_logprob():
    """64 rows of a real vocabulary's width: the argmax torch gives (the first of a tie)
    and a logprob within 5e-7 of float64's log_softmax; a row with a NaN and a row of
    -inf are left to the caller (token -1)."""
    lib = cpu_kernels.kernels()
    rows = torch.randn(66, 49152, generator=torch.Generator().manual_seed(3)) * 5
    rows[1, 40000] = rows[1, 7] = rows[1].max() + 2          # a tie: 7 wins
    rows[64, 123] = float("nan")
    rows[65] = float("-inf")
    tokens, logprobs = lib.greedy_pick(list(rows))
    assert tokens[1] == 7
    assert tokens[:64] == torch.argmax(rows[:64], -1).tolist()
    exact = torch.log_softmax(rows[:64].double(), -1).gather(
        1, torch.tensor(tokens[:64])[:, None])[:, 0]
    assert float((torch.tensor(logprobs[:64]).double() - exact).abs().max()) < 5e-7
    assert tokens[64:] == [-1, -1]


def test_greedy_pick_reads_a_row_whose_width_is_no_multiple_of_the_lanes():
    """The vector loops take 8 or 16 lanes; the last 3 of 1,003 go one at a time: a max
    there is found and a NaN there is seen."""
    lib = cpu_kernels.kernels()
    rows = torch.randn(3, 1003, generator=torch.Generator().manual_seed(5))
    rows[0, 1001] = 9.0
    rows[2, 1002] = float("nan")
    tokens, logprobs = lib.greedy_pick(list(rows))
    assert tokens == [1001, int(torch.argmax(rows[1])), -1]
    exact = torch.log_softmax(rows[:2].double(), -1)
    assert abs(logprobs[0] - float(exact[0, 1001])) < 5e-7
    assert abs(logprobs[1] - float(exact[1, tokens[1]])) < 5e-7


def test_greedy_pick_rejects_rows_it_cannot_read():
    lib = cpu_kernels.kernels()
    with pytest.raises(ValueError, match="one length"):
        lib.greedy_pick([torch.zeros(4), torch.zeros(5)])
    with pytest.raises(ValueError, match="contiguous float32"):
        lib.greedy_pick([torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="contiguous float32"):
        lib.greedy_pick([torch.zeros(8, 4).t()])            # rows strided within
    with pytest.raises(ValueError, match="contiguous float32"):
        lib.greedy_pick([torch.zeros(2, 2, 4)])


def _inverse_cdf(row: torch.Tensor, temperature: float, u: float) -> int:
    """float64 reference: the first token whose cumulative weight passes u * total."""
    x = row.double().numpy()
    w = np.exp((x - x.max()) / temperature)
    cdf = np.cumsum(w)
    return int(np.searchsorted(cdf, u * cdf[-1], side="right"))


def test_sample_pick_draws_by_the_inverse_cdf_with_logprobs_at_temperature_one():
    """64 rows of a real vocabulary's width and one of 1,003 (no multiple of the lanes),
    at three temperatures: the token float64's inverse CDF gives at each draw, and a
    logprob within float32's rounding (and 2e-7) of float64's log_softmax at temperature 1."""
    lib = cpu_kernels.kernels()
    gen = torch.Generator().manual_seed(7)
    for width, temperature in ((49152, 1.0), (49152, 0.7), (1003, 1.6)):
        rows = torch.randn(64, width, generator=gen) * 4
        draws = torch.rand(64, generator=gen, dtype=torch.float64).tolist()
        tokens, logprobs = lib.sample_pick([rows], [temperature] * 64, draws)
        assert tokens == [_inverse_cdf(r, temperature, u) for r, u in zip(rows, draws)]
        exact = torch.log_softmax(rows.double(), -1).gather(
            1, torch.tensor(tokens)[:, None])[:, 0].numpy()
        ulps = np.abs(np.spacing(exact.astype(np.float32)))     # float32's own rounding
        assert np.all(np.abs(np.array(logprobs) - exact) <= 1.5 * ulps + 2e-7)


def test_sample_pick_follows_the_distribution_and_never_draws_a_masked_token():
    """Draws spread evenly over [0, 1) land on each token as often as its probability
    (to the grid's step); -inf tokens never, at the ends of the range too: a draw of 0
    takes the first token that can be drawn, one just under 1 the last."""
    lib = cpu_kernels.kernels()
    row = torch.full((40,), float("-inf"))
    row[[3, 17, 18, 31]] = torch.tensor([0.0, 1.0, 2.0, 0.5])
    grid = [(k + 0.5) / 4000 for k in range(4000)]
    tokens, _ = lib.sample_pick([row] * len(grid), [1.0] * len(grid), grid)
    counts = np.bincount(tokens, minlength=40) / len(grid)
    assert set(np.nonzero(counts)[0]) == {3, 17, 18, 31}
    assert np.allclose(counts, torch.softmax(row, 0).numpy(), atol=1 / 4000)
    assert lib.sample_pick([row, row], [1.0, 1.0], [0.0, 1 - 2 ** -53])[0] == [3, 31]


def test_sample_pick_leaves_a_row_that_is_no_distribution_and_checks_its_arguments():
    lib = cpu_kernels.kernels()
    rows = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    rows[1, 50] = float("nan")
    rows[2] = float("-inf")
    tokens, logprobs = lib.sample_pick([rows], [1.0] * 3, [0.5] * 3)
    assert tokens[1:] == [-1, -1] and 0 <= tokens[0] < 100
    assert logprobs[1] != logprobs[1] and logprobs[2] != logprobs[2]
    with pytest.raises(ValueError, match="temperatures > 0"):
        lib.sample_pick([rows[0]], [0.0], [0.5])
    with pytest.raises(ValueError, match="draws in"):
        lib.sample_pick([rows[0]], [1.0], [1.0])
    with pytest.raises(ValueError, match="1 rows, 2 temperatures"):
        lib.sample_pick([rows[0]], [1.0, 1.0], [0.5])


def test_the_kernel_store_writes_where_index_copy_does_and_declines_other_layouts():
    """K/V rows as views of qkv go through store_entries; a contiguous copy of another
    row stride too; a layout it cannot take (heads not contiguous) is left to the
    caller (False), and the pool is untouched."""
    lib = cpu_kernels.kernels()
    ours, ref, tables, (q, k, v) = _step([(9, 1), (11, 5), (30, 3)], dtype=torch.bfloat16)
    slots = ours.rows(tables.new_slots())
    store = lib.bind_store(slots, ours.page_size)
    assert store(ours.kv[0], k, v)
    want = ours.kv.clone().zero_()
    flat = want[0].view(-1, *k.shape[1:])
    rows = torch.from_numpy(slots)
    flat.index_copy_(0, rows, k)
    flat.index_copy_(0, rows + ours.page_size, v)
    touched = torch.zeros(flat.shape[0], dtype=torch.bool)
    touched[rows] = touched[rows + ours.page_size] = True
    assert torch.equal(ours.kv[0].view(flat.shape)[touched], flat[touched])
    before = ours.kv.clone()
    assert not store(ours.kv[0], k.transpose(1, 2), v.transpose(1, 2))
    wide = ours.kv[0].float()                 # bf16 rows into a float32 pool: declined
    assert not store(wide, k, v)
    assert torch.equal(ours.kv, before) and torch.equal(wide, before[0].float())


@pytest.mark.parametrize("kv_heads,heads,head_dim", SHAPES)
def test_float32_rows_over_a_bfloat16_pool_are_float32_over_its_values(kv_heads, heads,
                                                                       head_dim):
    """A float32 model's `--kv-dtype bfloat16`: the new K/V are stored rounded as torch
    rounds them, and every kind of call (decodes, chunks by the row kernel, by SDPA
    after a past and fresh) attends as the float32 pool of the same values would: the
    row kernel to the bit (each value widened as it is read, the same sums in the same
    order), and the torch backend over the bf16 pool to the bit of its float32 run."""
    calls = [(9, 1), (37, 1), (11, 5), (30, 3), (100, 70), (80, 80), (64, 64)] + [
        (5 + i, 1) for i in range(6)]
    ours, ref, tables, _ = _step(calls, kv_heads=kv_heads, heads=heads, head_dim=head_dim,
                                 pages=128, dtype=torch.bfloat16)
    ref.kv.copy_(ours.kv.float())
    qkv = torch.randn(sum(n for _, n in calls), heads + 2 * kv_heads, head_dim)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    rounded = [x.to(torch.bfloat16).float() for x in (k, v)]
    mixed = PagedKVCache(ref.cfg, ref.num_pages, ref.page_size, torch.bfloat16, ref.device)
    mixed.kv.copy_(ours.kv)
    got = CpuAttention(mixed).prepare(tables)(0, q, k, v)
    want = CpuAttention(ref).prepare(tables)(0, q, *rounded)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(mixed.kv.float(), ref.kv)
    torch_pool = PagedKVCache(ref.cfg, ref.num_pages, ref.page_size, torch.bfloat16,
                              ref.device)
    torch_pool.kv.copy_(ours.kv)
    by_torch = TorchAttention(torch_pool).prepare(tables)(0, q, k, v)
    assert torch.equal(by_torch, TorchAttention(ref).prepare(tables)(0, q, *rounded))
    assert torch.equal(torch_pool.kv, mixed.kv)
    assert torch.allclose(got, by_torch, atol=2e-6), float((got - by_torch).abs().max())


def test_greedy_rows_take_the_kernel_here_and_torch_without_it(monkeypatch):
    """Blocks of one row, of several, and a view whose rows are strided (every other
    row of the step's logits): the rows in order, the same by the kernel and by torch."""
    from predd.engine import outputs
    step = torch.randn(9, 1000, generator=torch.Generator().manual_seed(4)) * 3
    blocks = [step[0:1], step[1:4], step[4:9:2], step[5:6]]
    rows = torch.cat(blocks)
    assert outputs.sampling.cpu_kernels() is not None
    tokens, logprobs = outputs._greedy_rows(blocks)
    monkeypatch.setattr(outputs.sampling, "cpu_kernels", lambda: None)
    want_tokens, want_logprobs = outputs._greedy_rows(blocks)
    assert tokens == want_tokens == torch.argmax(rows, -1).tolist()
    assert len(tokens) == 8
    assert np.allclose(logprobs, want_logprobs, atol=2e-6)


def test_the_cpu_backend_stores_a_layout_the_kernel_declines_with_index_copy():
    """k a view of qkv, v its own contiguous copy (strides differ): the kernel store
    declines, slot_writer stores them, and the step still matches the torch backend."""
    calls = [(9, 1), (11, 5), (30, 3)]
    ours, ref, tables, (q, k, v) = _step(calls)
    got = CpuAttention(ours).prepare(tables)(0, q, k, v.contiguous())
    want = TorchAttention(ref).prepare(tables)(0, q, k, v)
    assert torch.allclose(got, want, atol=2e-6)
    assert torch.equal(ours.kv, ref.kv)


# ------------------------------------------------------------------ the step's plan in C

def _numpy_rows(tables: PageTables, calls: list[int]):
    """CpuAttention.rows as numpy computed it before predd/kernels/csrc/step_plan.c."""
    n = tables.q_len[calls].astype(np.int64)
    row_token = tables.query_rows(calls)
    row_visible = (np.repeat(tables.kv_len[calls].astype(np.int64) - n, n)
                   + np.arange(len(row_token)) - np.repeat(np.cumsum(n) - n, n) + 1)
    return n, row_token, np.repeat(tables.indptr[calls].astype(np.int64), n), row_visible


def _numpy_tiles(call_rows, limit, row_token, row_pages, row_visible):
    big = call_rows >= limit
    if not big.any():
        return None
    rest = np.repeat(~big, call_rows)
    return ((np.cumsum(call_rows) - call_rows)[big], call_rows[big],
            tuple(a[rest] for a in (row_token, row_pages, row_visible)))


def _numpy_prefixes(indices, row_pages, row_visible, page_size, min_pages, min_rows):
    """Kernels.shared_prefixes as numpy computed it: (index, row, rows, pages, start)."""
    whole = (row_visible - 1) // page_size
    rows = np.flatnonzero(whole >= min_pages)
    first = indices[row_pages[rows]]
    order = np.argsort(first, kind="stable")
    groups = []
    for members in np.split(rows[order], np.flatnonzero(np.diff(first[order])) + 1):
        if len(members) < min_rows:
            continue
        most = int(whole[members].min())
        table = indices[row_pages[members][:, None] + np.arange(most)]
        same = (table == table[0]).all(axis=0)
        pages = most if same.all() else int(np.argmin(same))
        if pages >= min_pages:
            groups.append((members, pages))
    if not groups:
        return None
    counts = np.array([len(m) for m, _ in groups])
    start = np.zeros(len(row_pages), dtype=np.int64)
    for members, pages in groups:
        start[members] = pages * page_size
    return (np.concatenate([m for m, _ in groups]).tolist(), (np.cumsum(counts) - counts).tolist(),
            counts.tolist(), [p for _, p in groups], start.tolist())


SEEDS = 24


def _forks_step(seed: int, ps: int = 4) -> PageTables:
    """Decodes and chunks over forks of three documents (one fork cut short, so that its
    group's prefix ends early; one diverging after the first document's first page, so
    that a group's prefix may be too short), and calls of their own."""
    rng = np.random.default_rng(seed)
    free = [int(x) for x in rng.permutation(400)]
    take = lambda n: [free.pop() for _ in range(n)]      # noqa: E731
    docs = [take(int(rng.integers(3, 9))) for _ in range(3)]
    tables, kv_lens, q_lens = [], [], []
    for _ in range(int(rng.integers(6, 20))):
        kind = int(rng.integers(0, 6))
        q = 1 if rng.random() < 0.7 else int(rng.integers(2, 9))
        if kind == 5 and rng.random() < 0.5:
            kv = len(docs[0]) * ps + 1
            pages = docs[0][:1] + take(len(docs[0]))
        elif kind < 3:
            doc = docs[kind][:len(docs[kind]) - int(rng.integers(0, 2))]
            own = int(rng.integers(1, 3 * ps))
            kv = len(doc) * ps + own
            pages = doc + take(-(-own // ps))
        else:
            kv = int(rng.integers(q, 12 * ps))
            pages = take(-(-kv // ps))
        tables.append(np.array(pages)); kv_lens.append(kv); q_lens.append(min(q, kv))
    return PageTables.build(ps, tables, kv_lens, q_lens)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_the_plan_in_c_is_the_numpy_plan(seed):
    """plan_rows, plan_tiles and plan_prefixes (through CpuAttention.rows and Kernels)
    and plan_step at once: the rows, the blocks' calls, the shared prefix groups and the
    new entries' pool rows numpy made, value for value."""
    kernels = cpu_kernels.kernels()
    ps, tile_rows, min_pages, min_rows = 4, 4, 2, 3
    step = _forks_step(seed, ps)
    calls = list(range(len(step)))
    some = calls[::2]
    for got, want in zip(CpuAttention.rows(step, some), _numpy_rows(step, some)):
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    n, token, pages, visible = _numpy_rows(step, calls)
    tiles = _numpy_tiles(n, tile_rows, token, pages, visible)
    rest = (token, pages, visible) if tiles is None else tiles[2]
    prefixes = _numpy_prefixes(step.indices, rest[1], rest[2], ps, min_pages, min_rows)
    cap = len(token) + 3
    work, out = np.full((16, cap), -7, np.int64), np.zeros(4, np.int64)
    kernels._lib.plan_step(len(step), step.qo_indptr.ctypes.data, step.kv_len.ctypes.data,
                           step.indptr.ctypes.data, step.indices.ctypes.data, ps, tile_rows,
                           min_pages, min_rows, work.ctypes.data, cap, out.ctypes.data)
    T = len(token)
    assert out[0] == int(visible.max())
    assert [work[k, :T].tolist() for k in range(3)] == [token.tolist(), pages.tolist(),
                                                        visible.tolist()]
    cache = PagedKVCache(SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=4), 400, ps,
                         torch.float32, torch.device("cpu"))
    assert work[3, :T].tolist() == cache.rows(step.new_slots()).tolist()
    if tiles is None:
        assert out[1] == 0
    else:
        assert out[1] == len(tiles[0]) and out[2] == len(rest[0])
        assert work[5, :out[1]].tolist() == tiles[0].tolist()
        assert work[6, :out[1]].tolist() == tiles[1].tolist()
        assert [work[k, :out[2]].tolist() for k in (7, 8, 9)] == [a.tolist() for a in rest]
    if prefixes is None:
        assert out[3] == 0
        return
    groups, members = int(out[3]), len(prefixes[0])
    assert (work[10, :members].tolist(), work[11, :groups].tolist(), work[12, :groups].tolist(),
            work[13, :groups].tolist(), work[14, :len(rest[0])].tolist()) == prefixes


def test_some_forks_steps_have_blocks_and_prefix_groups_to_plan():
    """The cases above are not all trivial: some steps send calls to the blocks, and
    some group forks by their prefix (the rest's, or every row's)."""
    kinds = set()
    for seed in range(SEEDS):
        step = _forks_step(seed)
        n, token, pages, visible = _numpy_rows(step, list(range(len(step))))
        tiles = _numpy_tiles(n, 4, token, pages, visible)
        rest = (token, pages, visible) if tiles is None else tiles[2]
        grouped = _numpy_prefixes(step.indices, rest[1], rest[2], 4, 2, 3) is not None
        kinds.add((tiles is not None, grouped))
    assert {(True, True), (False, True), (True, False)} <= kinds


def _declared() -> dict[str, int]:
    """csrc/kernels.h's functions, preprocessed by the C compiler: name -> argument count."""
    text = subprocess.run([os.environ.get("CC") or "cc", "-E", "-P", "-"], text=True,
                          input=(build.CSRC / "kernels.h").read_text(), capture_output=True,
                          check=True).stdout
    text = re.sub(r"struct \w+ \{.*?\};", "", " ".join(text.split()))
    found = {}
    for name, args in re.findall(r"\b(\w+)\(([^()]*)\);", text):
        found[name] = 0 if args.strip() in ("", "void") else args.count(",") + 1
    return found


def test_the_bindings_table_is_the_headers_functions():
    """One declaration per function (csrc/kernels.h, included by every .c file) and one
    table on the Python side: the same names, the same argument counts."""
    assert _declared() == {name: len(args) for name, (_, args) in bindings.SIGNATURES.items()}
    for source in build.SOURCES:
        assert '#include "kernels.h"' in source.read_text(), source.name


def test_a_struct_laid_out_otherwise_refuses_the_kernels(monkeypatch):
    path = cpu_kernels.kernels().path
    assert bindings.layout()[0] == 56             # struct prefixes: 7 fields of 8 bytes
    moved = bindings.layout()
    moved[3] += 8
    monkeypatch.setattr(bindings, "layout", lambda: moved)
    with pytest.raises(build.KernelUnavailable, match="lays its structs out otherwise than "
                       r"predd/kernels/bindings.py \(value 3 of \d+: 16 against 24\)"):
        bindings.load(path)
