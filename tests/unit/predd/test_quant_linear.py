"""predd/model/quant_linear.py and its kernels (predd/kernels/csrc/quant_linear.c): projections computed
from Q4_1 / Q8_0 blocks give F.linear's result on the dequantised weights, are used for
up to QUANT_ROWS rows only, and find their blocks under the model's fused names."""
from __future__ import annotations

import contextlib
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from predd.kernels import cpu_kernels
from predd.model import quant_linear
from predd.kernels.probes import random_blocks
from predd.model.loader import ModelConfig
from predd.model.llama import LlamaModel


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
# up to 8 rows: one pass, blocks unpacked into registers; more: weight rows unpacked two
# at a time and run over x four rows at a time (a tail of 1-3 rows; an odd last row)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 30, 64])
@pytest.mark.parametrize("out", [70, 71])
@pytest.mark.parametrize("bias", [False, True])
def test_block_kernels_match_f_linear_on_the_dequantised_weight(kind, rows, out, bias):
    blocks, weight = random_blocks(kind, out, 128, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 128, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    want = F.linear(x, torch.from_numpy(weight), b)
    got = cpu_kernels.kernels().quant_linear(x, blocks, b)
    assert got.shape == (rows, out)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_call_rows_split_a_step_by_each_call_s_own_length():
    limit = quant_linear.INT8_CALL_ROWS
    calls = quant_linear.CallRows()
    calls.plan(np.array([0, 1, 1 + limit, 2 + limit, 3 + 2 * limit + 100]))
    assert calls.rows == 3 + 2 * limit + 100
    assert calls.long == [(2 + limit, 3 + 2 * limit + 100)]
    assert calls.short == [(0, 2 + limit)]
    calls.plan(np.array([0, limit + 1]))             # one long call and nothing else
    assert (calls.rows, calls.long, calls.short) == (limit + 1, [(0, limit + 1)], [])
    calls.plan(np.array([0, 1, 1 + limit]))          # none longer than the limit
    assert calls.rows == 0
    calls.plan(np.array([0, limit + 1]))
    calls.clear()
    assert (calls.rows, calls.long, calls.short) == (0, [], [])


def test_rows_go_by_runs_of_adjacent_calls():
    assert quant_linear.runs([(0, 1), (1, 5), (7, 9), (9, 10), (12, 13)]) == \
        [(0, 5), (7, 10), (12, 13)]
    assert quant_linear.runs([]) == []
    x = torch.arange(40.0).reshape(10, 4)
    one = quant_linear.rows_of(x, [(2, 5)])
    assert one.data_ptr() == x[2].data_ptr() and torch.equal(one, x[2:5])     # a view
    two = quant_linear.rows_of(x, [(0, 1), (7, 10)])
    assert torch.equal(two, x[[0, 7, 8, 9]])
    y = torch.zeros(10, 4)
    quant_linear.put_rows(y, [(0, 1), (7, 10)], two + 1)
    assert torch.equal(y[[0, 7, 8, 9]], x[[0, 7, 8, 9]] + 1)
    assert not y[1:7].any()


def test_int8_layers_take_long_calls_by_the_dense_weight_and_the_rest_from_blocks():
    """Under int8 a decoder layer's rows go by `CallRows`: a long call's by the inner
    weight alone, every other row from the blocks; the head (which takes a step's out
    rows) and a step with no long call are not split."""
    model = _tiny(tied=False)
    blocks = {f"model.layers.{layer}.{part}.weight": random_blocks("Q4_1", rows, cols)[0]
              for layer in range(2) for part, (rows, cols) in TINY_SIZES.items()}
    blocks["lm_head.weight"] = random_blocks("Q8_0", 50, 64)[0]
    assert quant_linear.attach(model, blocks, cpu_kernels.kernels(), False,
                               int8=True) == 2 * 4 + 1
    quant_linear.set_limit(model, quant_linear.EVERY_ROW)      # as the runner sets int8
    calls = quant_linear.call_rows(model)
    assert calls is not None and model.lm_head.calls is None
    layer = model.model.layers[0].mlp.down_proj
    assert layer.calls is calls
    with torch.no_grad():
        layer.inner.weight.mul_(2)                   # the two paths tell apart
    rows = 1 + quant_linear.INT8_CALL_ROWS + 1 + 3
    x = torch.randn(rows, layer.inner.in_features, generator=torch.Generator().manual_seed(0))
    calls.plan(np.array([0, 1, 2 + quant_linear.INT8_CALL_ROWS, rows]))
    with torch.inference_mode():
        got = layer(x)
        blocks_rows, dense_rows = layer.from_blocks(x), layer.inner(x[1:-3])
        calls.clear()
        unsplit = layer(x)
    assert torch.equal(got[:1], blocks_rows[:1]) and torch.equal(got[-3:], blocks_rows[-3:])
    assert torch.equal(got[1:-3], dense_rows)
    assert torch.equal(unsplit, blocks_rows)


class _ByCount(nn.Module):
    """A dense weight whose rows' values depend on how many come at once."""
    in_features, out_features = 8, 3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :3] + x.shape[0]


def test_independent_rows_tells_a_weight_whose_rows_depend_on_their_count():
    assert not quant_linear.independent_rows(_ByCount())
    exact = nn.Linear(8, 3, bias=False)
    with torch.no_grad():           # a row's values exact whatever the GEMM's order
        exact.weight.copy_(torch.eye(3, 8))
    assert quant_linear.independent_rows(exact)


def test_long_calls_share_one_gemm_only_where_rows_are_independent():
    limit = quant_linear.INT8_CALL_ROWS
    qo = np.array([0, limit + 1, limit + 2, 2 * limit + 12])
    calls = quant_linear.CallRows()
    calls.plan(qo)
    assert calls.long_runs is None and calls.long == [(0, limit + 1), (limit + 2, 2 * limit + 12)]
    calls.together = True
    calls.plan(qo)
    assert calls.long_runs == [(0, limit + 1), (limit + 2, 2 * limit + 12)]
    assert calls.short == [(limit + 1, limit + 2)]
    layer = QuantLinearOf(_ByCount())
    x = torch.zeros(2 * limit + 12, 8)
    with torch.inference_mode():
        got = layer.by_call(x, calls)
    assert (got[:limit + 1] == 2 * limit + 11).all() and (got[limit + 2:] == 2 * limit + 11).all()
    calls.together = False
    calls.plan(qo)
    with torch.inference_mode():
        got = layer.by_call(x, calls)
    assert (got[:limit + 1] == limit + 1).all() and (got[limit + 2:] == limit + 10).all()


class QuantLinearOf(quant_linear.QuantLinear):
    """A QuantLinear over `inner` whose blocks' rows are -1 (no kernels)."""

    def __init__(self, inner: nn.Module) -> None:
        nn.Module.__init__(self)
        self.inner, self.out_features = inner, inner.out_features

    def from_blocks(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], self.out_features), -1.0)


def test_block_kernel_refuses_a_wrong_width():
    blocks, _ = random_blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="x has 96 columns, the weight 64"):
        cpu_kernels.kernels().quant_linear(torch.randn(2, 96), blocks, None)


def test_quant_linear_takes_the_blocks_up_to_quant_rows_and_the_inner_beyond(monkeypatch):
    blocks, weight = random_blocks("Q8_0", 6, 32)
    inner = nn.Linear(32, 6, bias=False)
    with torch.no_grad():
        inner.weight.copy_(torch.from_numpy(weight) * 2)     # tell the two paths apart
    layer = quant_linear.QuantLinear(inner, blocks, cpu_kernels.kernels())
    limit = quant_linear.QUANT_ROWS[torch.float32]
    with torch.inference_mode():
        for rows, scale in ((1, 1), (limit, 1), (limit + 1, 2)):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(layer(x), F.linear(x, torch.from_numpy(weight)) * scale,
                                       rtol=1e-5, atol=1e-5)


def test_a_bfloat16_model_takes_the_blocks_at_its_own_limit_in_float32(monkeypatch):
    """Without bf16 dot products: bf16 rows up to QUANT_ROWS[bfloat16] widened, computed
    from the blocks in float32, rounded to bf16 once; beyond it (and in float16, which
    has no limit) the inner."""
    blocks, weight = random_blocks("Q4_1", 6, 64)
    inner = nn.Linear(64, 6, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        inner.weight.copy_(torch.from_numpy(weight) * 2)
    monkeypatch.setattr(cpu_kernels.kernels(), "bf16_blocks", False)
    layer = quant_linear.QuantLinear(inner, blocks, cpu_kernels.kernels())
    assert layer.run_bf16 is None
    limit = quant_linear.QUANT_ROWS[torch.bfloat16]
    with torch.inference_mode():
        for rows, scale in ((1, 1), (limit, 1), (limit + 1, 2)):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            want = F.linear(x.float(), torch.from_numpy(weight)) * scale
            got = layer(x)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)
            if scale == 1:      # one rounding of the float32 result (seeded: no value
                assert torch.equal(got, want.to(torch.bfloat16))   # sits on a tie)


BF16_DOTS = pytest.mark.skipif(not cpu_kernels.kernels().bf16_blocks,
                               reason="this CPU has neither bf16 dot products (avx512_bf16) "
                               "nor AVX2 and FMA")
# the bf16 block kernels to test: AMX tiles where the CPU has them (and the kernel grants
# them), and dot products (VDPBF16PS, or float32 FMAs) at every row count everywhere
AMX = cpu_kernels.kernels().bf16_tiles
BF16_KERNELS = pytest.mark.parametrize(
    "tiles", [pytest.param(True, id="amx")] * AMX + [pytest.param(False, id="dots")])


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX-BF16 tiles (or the kernel does not "
                    "grant them): the bf16 block kernels' tests run on dot products only")
def test_the_bf16_block_kernels_are_tested_on_amx_tiles_where_the_cpu_has_them():
    assert cpu_kernels.kernels().bf16_dots == "vdpbf16ps"


@BF16_DOTS
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
# AMX tiles (where the CPU has them): 1 row by dot products; 2 or more 96 rows a pass in
# groups of 16 (a short group padded: 5, 17, 40, 50, 70; two passes: 100), one to four
# groups by the pipelined kernel (5: 1, 16: 1, 17: 2, 40: 3, 50: 4), five and six by the
# other (70, 100). Dot products: 48 rows a pass (49, 50, 70, 100: a second pass, of 1
# row for 49; a third for 100); up to 6 rows each block multiplied as unpacked into 4
# weight rows (1, 5), 7-12 into 2 (7, 12); more from the tile's blocks unpacked, 6 rows
# of x by 4 weight rows (13, 16, 17, ...; a tail group of 1-5)
@pytest.mark.parametrize("rows", [1, 5, 7, 12, 13, 16, 17, 33, 40, 49, 50, 70, 100])
# weight rows in tiles of 16: a tail of 6, none; blocks of 32 columns: an odd number
# (the pipelined kernel alternates them between two tiles), an even one, more than the
# 32 the dot products unpack at a time (33: 32 and a tail of 1)
@pytest.mark.parametrize("out, cols", [(70, 160), (96, 128), (21, 1056)])
@pytest.mark.parametrize("bias", [False, True])
@BF16_KERNELS
def test_bf16_block_kernel_is_the_bf16_weight_times_bf16_rows_rounded_once(
        kind, rows, out, cols, bias, tiles):
    """bf16 rows and the blocks' weights rounded to bf16 (what a bf16 model holds),
    products summed in float32, the result rounded to bf16 once: the float32 sum of the
    same bf16 values rounded, give or take the last bit (another order of the sum). Both
    kernels: AMX tiles (where the CPU has them) and dot products at every row count."""
    with _bf16_kernel(tiles):
        _check_bf16_block_kernel(kind, rows, out, bias, cols)


@contextlib.contextmanager
def _bf16_kernel(tiles: bool):
    """The bf16 block kernels by AMX tiles (skipped where the CPU has none) or, with the
    tiles turned off for the block, by dot products at every row count."""
    kernels = cpu_kernels.kernels()
    if tiles and not kernels.bf16_tiles:
        pytest.skip("this CPU has no AMX-BF16 tiles (or the kernel does not grant them)")
    if not tiles:
        kernels.use_bf16_tiles(False)
    try:
        yield kernels
    finally:
        kernels.use_bf16_tiles(True)


def _check_bf16_block_kernel(kind, rows, out, bias, cols=128):
    blocks, weight = random_blocks(kind, out, cols, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    b = torch.randn(out, generator=gen) if bias else None
    w16 = torch.from_numpy(weight).to(torch.bfloat16)
    want = F.linear(x.double(), w16.double(), None if b is None else b.double())
    got = cpu_kernels.kernels().quant_linear(x, blocks, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -30))) - 7)
    # ... and one float32 rounding at the scale of the terms, which shows where they
    # cancel (a result of 3.7e-6, off by 3.7e-8, where their magnitudes summed to ~6;
    # elsewhere this is far below the bf16 bound)
    terms = F.linear(x.double().abs(), w16.double().abs(),
                     None if b is None else b.double().abs())
    assert ((got.double() - want).abs() <= ulp + terms * 2.0 ** -24).all()
    assert (got == want.to(torch.bfloat16)).double().mean() > 0.95


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [5, 16, 70])        # one short tile, one whole, 4 + a tail
def test_blocks_in_tiles_are_the_same_blocks_as_the_bf16_kernels_index_them(kind, rows):
    """QuantBlocks.in_tiles: block b of weight row n at ((n // 16) * blocks + b) * 16 +
    n % 16 (tile_block in predd/kernels/csrc/quant_blocks.h), the last tile padded with zero
    rows; in_rows gives the blocks back, and both dequantise to the same weight."""
    blocks, weight = random_blocks(kind, rows, 160)
    tiles = blocks.in_tiles()
    assert tiles.tiled and tiles.rows() == rows and tiles.columns() == 160
    count = -(-rows // 16)
    assert tiles.q.shape[:3] == (count, 5, 16) and tiles.d.shape == (count, 5, 16)
    flat_q, flat_d = tiles.q.reshape(-1, tiles.q.shape[-1]), tiles.d.reshape(-1)
    for n in range(rows):
        for b in range(5):
            at = ((n // 16) * 5 + b) * 16 + n % 16
            assert (flat_q[at] == blocks.q[n, b]).all() and flat_d[at] == blocks.d[n, b]
            if kind == "Q4_1":
                assert tiles.m.reshape(-1)[at] == blocks.m[n, b]
    padding = [((n // 16) * 5 + b) * 16 + n % 16 for n in range(rows, count * 16)
               for b in range(5)]
    assert not flat_q[padding].any() and not flat_d[padding].any()
    again = tiles.in_rows()
    assert not again.tiled and again.rows() == rows
    assert (again.q == blocks.q).all() and (again.d == blocks.d).all()
    assert (tiles.dequantised() == weight).all() and tiles.in_tiles() is tiles


@pytest.mark.parametrize("rows", [5, 16, 70])
def test_blocks_in_lanes_hold_each_weight_where_the_lanes_kernel_reads_it(rows):
    """QuantBlocks.in_lanes: tiles of 16 rows as in_tiles, each block's 32 weights of a
    row as 4 uint32 (group g: weight 8g + 2s in bits 4s.., 8g + 2s + 1 in bits 16 + 4s..),
    group g of the tile's 16 rows side by side; in_rows and in_tiles give the blocks back,
    Q8_0 blocks are refused."""
    blocks, weight = random_blocks("Q4_1", rows, 160)
    lanes = blocks.in_lanes()
    count = -(-rows // 16)
    assert lanes.lanes and lanes.tiled and lanes.rows() == rows and lanes.columns() == 160
    assert lanes.q.shape == (count, 5, 4, 16) and lanes.q.dtype == np.uint32
    tiles = blocks.in_tiles()
    assert (lanes.d == tiles.d).all() and (lanes.m == tiles.m).all()
    nibbles = np.concatenate([blocks.q & 0x0F, blocks.q >> 4], axis=-1)   # [rows, 5, 32]
    for n in range(count * 16):
        for b in range(5):
            for g in range(4):
                word = int(lanes.q[n // 16, b, g, n % 16])
                for s in range(4):
                    for t in range(2):
                        want = int(nibbles[n, b, 8 * g + 2 * s + t]) if n < rows else 0
                        assert (word >> (4 * s + 16 * t)) & 0x0F == want
    assert (lanes.in_rows().q == blocks.q).all() and (lanes.in_rows().m == blocks.m).all()
    assert (lanes.in_tiles().q == tiles.q).all() and not lanes.in_tiles().lanes
    assert (lanes.dequantised() == weight).all() and lanes.in_lanes() is lanes
    with pytest.raises(ValueError, match="only Q4_1 blocks go in lanes, not Q8_0"):
        random_blocks("Q8_0", rows, 64)[0].in_lanes()


@BF16_DOTS
# passes of up to 8 rows of nearly equal size (9: 4 + 5; 17: 5 + 6 + 6; 30: 4 x 7-8);
# weight rows in tiles of 16 (a tail of 6, none, 5); 33 blocks of columns; 1024 blocks
# (32768 columns): x's rows in chunks of 8 whose blocks' sums fit the kernel's stack
# (17: 8 + 8 + 1)
@pytest.mark.parametrize("rows, out, cols", [
    *[(r, o, c) for r in (1, 2, 3, 8, 9, 17, 30, 64) for o, c in ((70, 160), (96, 128),
                                                                   (21, 1056))],
    (17, 21, 32768)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_lanes_kernel_is_bf16_rows_times_the_exact_weights_rounded_once(
        rows, out, cols, bias):
    """predd/kernels/csrc/quant_lanes.c: the checkpoint's weights exactly (d q + m, not rounded to
    bf16) times bf16 rows, summed in float32, rounded once: the exact result's bf16
    rounding, give or take float32 rounding at the scale of the terms summed (q + 128
    and the m term apart), and nearly always that rounding to the bit; each row's bits
    the same whatever rows come with it."""
    blocks, weight = random_blocks("Q4_1", out, cols, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    b = torch.randn(out, generator=gen) if bias else None
    kernels = cpu_kernels.kernels()
    got = kernels.quant_linear(x, blocks.in_lanes(), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    want = F.linear(x.double(), torch.from_numpy(weight).double(),
                    None if b is None else b.double())
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -30))) - 7)
    d = np.repeat(np.abs(blocks.d), 32, axis=1)
    m = np.repeat(np.abs(blocks.m - 128 * blocks.d), 32, axis=1)
    nibbles = np.concatenate([blocks.q & 0x0F, blocks.q >> 4], axis=-1).reshape(out, cols)
    scale = torch.from_numpy(d * (nibbles + 128.0) + m)
    terms = F.linear(x.double().abs(), scale, None if b is None else b.double().abs())
    assert ((got.double() - want).abs() <= ulp / 2 + terms * 2.0 ** -17).all()
    assert (got == want.to(torch.bfloat16)).double().mean() > 0.95
    for r in {0, rows // 2, rows - 1}:
        alone = kernels.quant_linear(x[r:r + 1].contiguous(), blocks.in_lanes(), b)
        assert torch.equal(alone[0], got[r])


@BF16_DOTS
def test_a_bfloat16_model_holds_q4_1_in_lanes_without_amx_tiles_and_q8_0_in_tiles():
    kernels = cpu_kernels.kernels()
    for kind in ("Q4_1", "Q8_0"):
        blocks, _ = random_blocks(kind, 20, 64)
        inner = nn.Linear(64, 20, bias=False).to(torch.bfloat16)
        layer = quant_linear.QuantLinear(inner, blocks, kernels, torch.bfloat16)
        assert layer.blocks.tiled
        assert layer.blocks.lanes is (kind == "Q4_1" and not kernels.bf16_tiles)


@BF16_DOTS
def test_a_bfloat16_model_holds_its_blocks_in_tiles_and_a_float32_one_by_rows():
    """One copy of the blocks, in the layout the model's kernels read; rows of the other
    dtype still get the right product (their kernel converts the blocks)."""
    blocks, weight = random_blocks("Q8_0", 20, 64)
    for dtype, tiled in ((torch.bfloat16, True), (torch.float32, False)):
        inner = nn.Linear(64, 20, bias=False).to(dtype)
        layer = quant_linear.QuantLinear(inner, blocks, cpu_kernels.kernels(), dtype)
        assert layer.blocks.tiled is tiled and layer.out_features == 20
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
        want = F.linear(x.double(), torch.from_numpy(weight).double())
        assert torch.allclose(layer.from_blocks(x).double(), want, rtol=1e-5, atol=1e-5)


@BF16_DOTS
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 50])   # few rows, many rows, two passes
@pytest.mark.parametrize("bias", [False, True])
@BF16_KERNELS
def test_the_widened_head_kernel_stores_the_bf16_kernel_s_values_as_float32(rows, bias, tiles):
    """A head's logits (bind(widen=True)) are the bf16 kernel's result widened, bit for
    bit, at every row count and by either kernel."""
    with _bf16_kernel(tiles) as kernels:
        blocks, _ = random_blocks("Q8_0", 70, 160, seed=rows)
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, 160, generator=gen).to(torch.bfloat16)
        b = torch.randn(70, generator=gen) if bias else None
        got = kernels.bind(blocks, b, torch.bfloat16, widen=True)(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 70)
        assert torch.equal(got, kernels.bind(blocks, b, torch.bfloat16)(x).float())


def test_the_widened_result_is_refused_for_other_rows_or_blocks():
    kernels = cpu_kernels.kernels()
    blocks, _ = random_blocks("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="bfloat16 rows and Q8_0 blocks"):
        kernels.bind(blocks, None, torch.bfloat16, widen=True)
    blocks, _ = random_blocks("Q8_0", 16, 64)
    with pytest.raises(ValueError, match="bfloat16 rows and Q8_0 blocks"):
        kernels.bind(blocks, None, torch.float32, widen=True)


def _q8_0_layer(dtype: torch.dtype = torch.float32):
    """(a QuantLinear of 6 x 64 Q8_0 blocks in a model of `dtype`, its bf16 inner
    Linear holding twice the weight, so that the two paths tell apart; the weight)."""
    blocks, weight = random_blocks("Q8_0", 6, 64)
    inner = nn.Linear(64, 6, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        inner.weight.copy_(torch.from_numpy(weight) * 2)
    return quant_linear.QuantLinear(inner, blocks, cpu_kernels.kernels(), dtype), inner, weight


@BF16_DOTS
def test_a_head_s_logits_are_its_forward_in_float32_from_blocks_up_to_its_limit():
    layer, inner, _ = _q8_0_layer(torch.bfloat16)
    limit = quant_linear.BF16_NATIVE_ROWS
    with torch.inference_mode():
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            x = x.to(torch.bfloat16)
            got = layer.logits(x)
            assert got.dtype == torch.float32
            assert torch.equal(got, layer(x).float())
        assert torch.equal(layer.logits(x), inner(x).float())     # limit + 1: the inner


@BF16_DOTS
def test_a_bfloat16_model_with_bf16_dots_takes_them_up_to_its_limit():
    layer, _, weight = _q8_0_layer()
    limit = quant_linear.BF16_NATIVE_ROWS
    w16 = torch.from_numpy(weight).to(torch.bfloat16).float()
    with torch.inference_mode():
        for rows, scale in ((1, 1), (limit, 1), (limit + 1, 2)):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            got = layer(x.to(torch.bfloat16))
            want = F.linear(x.to(torch.bfloat16).float(), w16) * scale
            torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-2)


def test_bf16_block_kernel_refuses_where_the_cpu_has_no_bf16_dots(monkeypatch):
    blocks, _ = random_blocks("Q4_1", 4, 64)
    monkeypatch.setattr(cpu_kernels.kernels(), "bf16_blocks", False)
    with pytest.raises(ValueError, match="only where the CPU has bf16 dot products"):
        cpu_kernels.kernels().quant_linear(torch.zeros(2, 64, dtype=torch.bfloat16), blocks, None)


def _tiny(tied: bool) -> LlamaModel:
    cfg = ModelConfig(name="tiny", vocab_size=50, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, max_position=64,
                      tie_word_embeddings=tied)
    return LlamaModel(cfg).eval()


# _tiny's projections by Hugging Face name: (rows, columns)
TINY_SIZES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64),
              "self_attn.v_proj": (32, 64), "self_attn.o_proj": (64, 64),
              "mlp.gate_proj": (96, 64), "mlp.up_proj": (96, 64), "mlp.down_proj": (64, 96)}


@pytest.mark.parametrize("tied", [True, False])
def test_attach_finds_blocks_under_fused_names_and_a_tied_head(tied):
    """q/k/v stacked into qkv_proj and gate/up into gate_up_proj by rows, in the order
    predd.model.llama.fuse concatenates the weights; a tied lm_head reads the embedding's."""
    model = _tiny(tied)
    blocks, weights, seed = {}, {}, 0
    for layer in range(2):
        for part, (rows, cols) in TINY_SIZES.items():
            name = f"model.layers.{layer}.{part}.weight"
            seed += 1
            blocks[name], weights[name] = random_blocks("Q4_1", rows, cols, seed)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    blocks[head], weights[head] = random_blocks("Q8_0", 50, 64, 99)
    assert quant_linear.attach(model, blocks, cpu_kernels.kernels(), tied) == 2 * 4 + 1
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, quant_linear.QuantLinear) and qkv.blocks.rows() == 128
    x = torch.randn(3, 64)
    with torch.inference_mode():
        want = F.linear(x, torch.from_numpy(np.concatenate(
            [weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])))
        torch.testing.assert_close(qkv(x), want, rtol=1e-5, atol=1e-5)
        gate_up = model.model.layers[0].mlp.gate_up_proj
        want = F.linear(x, torch.from_numpy(np.concatenate(
            [weights[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up")])))
        torch.testing.assert_close(gate_up(x), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.lm_head(x), F.linear(x, torch.from_numpy(weights[head])),
                                   rtol=1e-5, atol=1e-5)


def test_attach_skips_a_group_with_a_part_missing_or_of_another_kind():
    model = _tiny(False)
    blocks = {}
    for part, rows in (("q_proj", 64), ("k_proj", 32)):      # v_proj missing
        blocks[f"model.layers.0.self_attn.{part}.weight"], _ = random_blocks("Q4_1", rows, 64)
    blocks["model.layers.0.mlp.gate_proj.weight"], _ = random_blocks("Q4_1", 96, 64)
    blocks["model.layers.0.mlp.up_proj.weight"], _ = random_blocks("Q8_0", 96, 64)
    blocks["model.layers.0.self_attn.o_proj.weight"], _ = random_blocks("Q4_1", 64, 32)  # wrong width
    assert quant_linear.attach(model, blocks, cpu_kernels.kernels(), False) == 0


def test_choose_limits_takes_rows_per_kind_until_its_blocks_first_lose():
    asked = []

    def measure(rows):      # qkv's blocks win at 1, 2 and 4 rows; the head's at 1 only
        asked.append(rows)
        return {"qkv_proj": (1.0, 2.0) if rows <= 4 else (3.0, 2.0),
                "lm_head": (1.0, 2.0) if rows == 1 else (2.0, 2.0)}    # a tie: dense
    limits, seen = quant_linear.choose_limits(measure)
    assert limits == {"qkv_proj": 4, "lm_head": 1} and asked == [1, 2, 4, 8]
    assert [rows for rows, _ in seen] == [1, 2, 4, 8]
    assert seen[3][1] == {"qkv_proj": (3.0, 2.0), "lm_head": (2.0, 2.0)}
    # a kind that lost is not brought back by a later win
    flaky = {1: (1.0, 2.0), 2: (3.0, 2.0), 4: (1.0, 2.0)}
    assert quant_linear.choose_limits(lambda rows: {"o_proj": flaky[rows]}, (1, 2, 4))[0] \
        == {"o_proj": 1}
    assert quant_linear.choose_limits(lambda rows: {"o_proj": (2.0, 2.0)})[0] == {"o_proj": 0}
    assert quant_linear.choose_limits(lambda rows: {"o_proj": (1.0, 2.0)}, (1, 3))[0] \
        == {"o_proj": 3}


def test_choose_limits_takes_the_layers_kinds_together_where_their_sum_wins():
    """gate_up loses alone from 16 rows, but the layers' kinds summed win up to 32: both
    take their blocks to 32 (one C call a step needs all of them); the head is apart."""
    table = {8: {"gate_up_proj": (4.0, 5.0), "down_proj": (1.0, 2.0), "lm_head": (1.0, 2.0)},
             16: {"gate_up_proj": (5.5, 5.0), "down_proj": (1.0, 2.0), "lm_head": (3.0, 2.0)},
             32: {"gate_up_proj": (6.0, 5.0), "down_proj": (1.5, 3.0), "lm_head": (3.0, 2.0)},
             48: {"gate_up_proj": (9.0, 5.0), "down_proj": (2.0, 3.0), "lm_head": (3.0, 2.0)},
             64: {"gate_up_proj": (9.0, 5.0), "down_proj": (3.0, 3.0), "lm_head": (3.0, 2.0)}}
    asked = []
    limits, _ = quant_linear.choose_limits(lambda rows: asked.append(rows) or table[rows],
                                           (8, 16, 32, 48, 64),
                                           frozenset({"gate_up_proj", "down_proj"}))
    assert limits == {"gate_up_proj": 32, "down_proj": 48, "lm_head": 8}
    assert asked == [8, 16, 32, 48, 64]     # down still won at 48; all lost at 64
    # without `together`, each kind alone (measuring stops once all have lost)
    asked.clear()
    limits, _ = quant_linear.choose_limits(lambda rows: asked.append(rows) or table[rows],
                                           (8, 16, 32, 48, 64))
    assert limits == {"gate_up_proj": 8, "down_proj": 48, "lm_head": 8}
    assert asked == [8, 16, 32, 48, 64]


def test_describe_limits_names_kinds_only_where_they_differ():
    assert quant_linear.describe_limits({"qkv_proj": 8, "lm_head": 8}) == "<= 8 rows"
    assert quant_linear.describe_limits({"qkv_proj": 8, "lm_head": 4}) == \
        "<= 8 rows (qkv_proj), 4 rows (lm_head)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calibrate_sets_every_projection_s_limit_and_forward_keeps_it(dtype):
    model = _tiny(False).to(dtype)
    blocks = {}
    for layer in range(2):
        for part, (rows, cols) in TINY_SIZES.items():
            blocks[f"model.layers.{layer}.{part}.weight"], _ = random_blocks(
                "Q8_0", rows, cols, len(blocks))
    assert quant_linear.attach(model, blocks, cpu_kernels.kernels(), False) == 2 * 4
    limits, timings = quant_linear.calibrate(model, dtype, reps=1)
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, quant_linear.QuantLinear)}
    assert set(limits) == {quant_linear.group_of(name) for name in layers}
    assert all(m.limit == limits[quant_linear.group_of(name)] for name, m in layers.items())
    assert timings.startswith("1: ")
    assert all(0 <= n <= max(quant_linear.CALIBRATION_ROWS) for n in limits.values())
    layers = list(layers.values())
    layer = layers[0]
    with torch.inference_mode():
        for rows in (1, 3):
            x = torch.randn(rows, layer.blocks.q.shape[1] * 32).to(dtype)
            for limit_, path in ((rows, layer.from_blocks), (rows - 1, layer.inner)):
                layer.limit = limit_
                assert torch.equal(layer(x), path(x))
