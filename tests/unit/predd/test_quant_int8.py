"""predd/kernels/csrc/quant_int8.c: projections from Q4_1 / Q8_0 blocks by int8 dot products over
rows quantised per block of 32 (`--linear int8`). They give the int8 arithmetic's own
result (x quantised by `int8_rows`, each block's integer sum exact, scaled once) to
float32 rounding, exactly the float32 product where x's blocks are already int8 multiples
of their scale, a row's bits whatever rows share its call; QuantLinear takes them up to
its limit; and the calibration of the limits is measured once per machine and model."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from predd.model import calibration
from predd.kernels import cpu_kernels
from predd.model import quant_linear
from predd.model.loader import QuantBlocks
from predd.kernels.probes import int8_reference, int8_rows, random_blocks


def _int8(blocks, bias=None):
    return cpu_kernels.kernels().bind(blocks, bias, int8=True)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
# one pass of up to 8 rows, several passes, a short last pass
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 30])
@pytest.mark.parametrize("out", [70, 71])
@pytest.mark.parametrize("width", [96, 576])    # blocks a row: 3 (under one 8-lane load), 18
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernels_give_the_int8_arithmetics_result(kind, rows, out, width, bias):
    blocks, _ = random_blocks(kind, out, width, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    got = _int8(blocks, b)(x)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    want = int8_reference(x.numpy(), blocks, None if b is None else b.numpy())
    assert np.abs(got.numpy() - want).max() <= 2e-6 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_rows_already_int8_give_the_exact_product(kind):
    """Each block of x a multiple of its scale with 127 at its largest: quantising changes
    nothing, so the result is the float32 product of x and the dequantised weight."""
    blocks, weight = random_blocks(kind, 33, 128, seed=5)
    rng = np.random.default_rng(5)
    q = rng.integers(-127, 128, (4, 4, 32))
    q[:, :, 0] = 127
    x = torch.from_numpy((q * (rng.random((4, 4, 1)) + 0.1)).reshape(4, 128).astype(np.float32))
    qx, _ = int8_rows(x.numpy())
    assert np.array_equal(qx, q.astype(np.int8))
    want = F.linear(x.double(), torch.from_numpy(weight).double())
    torch.testing.assert_close(_int8(blocks)(x).double(), want, rtol=1e-5, atol=1e-5)


def test_quantised_rows_round_to_nearest_even_and_a_zero_block_is_zero():
    x = np.zeros((1, 64), np.float32)
    x[0, :32] = 0.5
    x[0, 0] = 127.0                 # scale 1: 0.5 rounds to 0
    x[0, 1] = 2.5                   # to 2
    x[0, 2] = -3.5                  # to -4
    q, scale = int8_rows(x)
    assert scale.tolist() == [[1.0, 0.0]]
    assert q[0, 0, :4].tolist() == [127, 2, -4, 0] and not q[0, 1].any()
    blocks, _ = random_blocks("Q8_0", 3, 64)
    got = _int8(blocks)(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, int8_reference(x, blocks), rtol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_bits_do_not_depend_on_the_rest_of_its_call(kind):
    blocks, _ = random_blocks(kind, 200, 576, seed=3)     # threads split the weight rows
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(3))
    run = _int8(blocks, torch.randn(200))
    together = run(x)
    assert all(torch.equal(run(x[i:i + 1])[0], together[i]) for i in range(19))
    assert torch.equal(run(x[5:14]), together[5:14])


def test_int8_is_refused_for_bfloat16_rows_and_a_wrong_width():
    blocks, _ = random_blocks("Q4_1", 4, 64)
    with pytest.raises(ValueError, match="int8 block kernels take float32 rows"):
        cpu_kernels.kernels().bind(blocks, None, torch.bfloat16, int8=True)
    with pytest.raises(ValueError, match="x has 96 columns, the weight 64"):
        _int8(blocks)(torch.randn(2, 96))
    with pytest.raises(ValueError, match="float32 model"):
        quant_linear.QuantLinear(nn.Linear(64, 4).to(torch.bfloat16), blocks,
                                 cpu_kernels.kernels(), torch.bfloat16, int8=True)


# The int8 kernels' bits for fixed rows and blocks, each block's sum scaled into one sum a
# result (weight rows in groups of 8): the same in every build (vnni, avx2, portable) and
# machine (tests/integration/predd/test_kernels_march.py compares the builds, with a bias).
PINNED_DIGEST = "97aeaa8ade0d6a399d30e70d99f9e4028e0144d00a25e54cb89016307625aa36"


def test_int8_kernels_give_the_same_bits_in_every_build():
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((11, 576)).astype(np.float32))
    out = b"".join(_int8(random_blocks(kind, 70, 576)[0])(x).numpy().tobytes()
                   for kind in ("Q4_1", "Q8_0"))
    assert hashlib.sha256(out).hexdigest() == PINNED_DIGEST


def test_int8_layers_hold_the_scales_as_half_floats():
    blocks, _ = random_blocks("Q4_1", 6, 64)
    layer = quant_linear.QuantLinear(nn.Linear(64, 6), blocks, cpu_kernels.kernels(), int8=True)
    # held as the GGUF stores them (20 bytes a Q4_1 block), widened exactly
    assert layer.blocks.d.dtype == layer.blocks.m.dtype == np.float16
    held = layer.blocks.in_rows()
    assert np.array_equal(held.d.astype(np.float32), blocks.d)
    assert np.array_equal(held.m.astype(np.float32), blocks.m)
    assert layer.blocks.with_scales(np.float32).d.dtype == np.float32
    # a scale no half float holds is refused, not rounded
    odd = QuantBlocks("Q4_1", blocks.q, blocks.d + np.float32(1e-7), blocks.m)
    with pytest.raises(ValueError, match="a scale of these Q4_1 blocks is no float16"):
        _int8(odd)


def test_quant_linear_with_int8_takes_the_int8_kernel_up_to_its_limit():
    blocks, weight = random_blocks("Q4_1", 6, 64)
    inner = nn.Linear(64, 6, bias=False)
    with torch.no_grad():
        inner.weight.copy_(torch.from_numpy(weight) * 2)     # tell the two paths apart
    layer = quant_linear.QuantLinear(inner, blocks, cpu_kernels.kernels(), int8=True)
    layer.limit = 4
    with torch.inference_mode():
        for rows in (1, 4):
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(layer(x), _int8(blocks)(x))
        x = torch.randn(5, 64)
        torch.testing.assert_close(layer(x), F.linear(x, torch.from_numpy(weight)) * 2)


def _model():
    """Two QuantLinears of two kinds, as a model's modules."""
    model = nn.Module()
    for name, (kind, n, k) in {"qkv_proj": ("Q4_1", 96, 64), "lm_head": ("Q8_0", 128, 64)}.items():
        blocks, weight = random_blocks(kind, n, k)
        inner = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            inner.weight.copy_(torch.from_numpy(weight))
        setattr(model, name, quant_linear.QuantLinear(inner, blocks, cpu_kernels.kernels(),
                                                      int8=True))
    return model


def test_limits_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path))
    measured = []

    def calibrate(model, dtype):
        measured.append(dtype)
        groups = [n for n, m in model.named_modules() if isinstance(m, quant_linear.QuantLinear)]
        return {g: 8 * len(measured) if g == "qkv_proj" else 2 for g in groups}, "1: 1.0/2.0"

    monkeypatch.setattr(quant_linear, "calibrate", calibrate)
    model = _model()
    limits, how = quant_linear.calibrated(model, torch.float32)
    assert limits == {"qkv_proj": 8, "lm_head": 2} and model.qkv_proj.limit == 8
    [stored] = (tmp_path / "calibration").glob("*.json")
    assert f"measured, {stored}" in how and how.endswith("1: 1.0/2.0")
    record = json.loads(stored.read_text())
    assert record["limits"] == limits
    assert record["others"] is None or 0.0 <= record["others"] <= 1.0   # None: no /proc/stat
    again = _model()
    assert quant_linear.calibrated(again, torch.float32)[0] == limits    # not measured
    assert measured == [torch.float32] and again.qkv_proj.limit == 8
    assert "from " in quant_linear.calibrated(_model(), torch.float32)[1]
    # another dtype, or other shapes, is another measurement
    quant_linear.calibrated(_model(), torch.bfloat16)
    other = _model()
    other.down_proj = other.lm_head
    del other.lm_head
    quant_linear.calibrated(other, torch.float32)
    assert len(measured) == 3 and len(list((tmp_path / "calibration").glob("*.json"))) == 3


def test_a_stored_record_wins_over_a_second_measurement(tmp_path, monkeypatch):
    """Two predds measuring at once: the second to store finds the first's record and
    uses it, so both compute alike."""
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path))
    first = {"limits": {"a": 4}, "timings": "x"}
    assert calibration.store("k", first)[0]["limits"] == {"a": 4}
    record, where = calibration.store("k", {"limits": {"a": 12}, "timings": "y"})
    assert record["limits"] == {"a": 4} and where.endswith("k.json")
    assert calibration.load("k")[0]["limits"] == {"a": 4}
    assert [p.name for p in (tmp_path / "calibration").iterdir()] == ["k.json"]


def test_a_record_measured_beside_others_work_says_so_at_every_start(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path))
    monkeypatch.setattr(quant_linear, "calibrate",
                        lambda model, dtype: ({"qkv_proj": 3, "lm_head": 1}, "t"))
    monkeypatch.setattr(calibration.Contention, "share", lambda self: 0.45)
    how = quant_linear.calibrated(_model(), torch.float32)[1]
    [stored] = (tmp_path / "calibration").glob("*.json")
    assert json.loads(stored.read_text())["others"] == 0.45
    assert "other processes had 45% of the CPUs while it was measured" in how
    monkeypatch.setattr(quant_linear, "calibrate", lambda *a: pytest.fail("measured"))
    limits, how = quant_linear.calibrated(_model(), torch.float32)
    assert limits == {"qkv_proj": 3, "lm_head": 1}
    assert f"from {stored}; other processes had 45%" in how
    record = json.loads(stored.read_text())
    stored.write_text(json.dumps({**record, "others": 0.1}))    # quiet enough: nothing said
    assert "other processes" not in quant_linear.calibrated(_model(), torch.float32)[1]


def test_a_broken_or_foreign_record_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMPHONY_CACHE", str(tmp_path))
    monkeypatch.setattr(quant_linear, "calibrate",
                        lambda model, dtype: ({"qkv_proj": 3, "lm_head": 1}, "t"))
    quant_linear.calibrated(_model(), torch.float32)
    [stored] = (tmp_path / "calibration").glob("*.json")
    stored.write_text('{"limits": {"qkv_proj": -1, "lm_head": 1}, "timings": "t"}')
    model = _model()
    limits, how = quant_linear.calibrated(model, torch.float32)
    assert limits == {"qkv_proj": 3, "lm_head": 1} and model.qkv_proj.limit == 3
    assert "not stored" in how
    (tmp_path / "calibration").chmod(0o777)          # others could write it: not read
    stored.write_text('{"limits": {"qkv_proj": 50, "lm_head": 50}, "timings": "t"}')
    limits, how = quant_linear.calibrated(_model(), torch.float32)
    assert limits == {"qkv_proj": 3, "lm_head": 1} and "not this user's alone" in how


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_bits_are_its_own_at_every_row_count(kind):
    """Rows of x go over a group of weight rows four at a time, the last pass shorter:
    each row's result is the same bits in calls of 1 to 12 rows."""
    blocks, _ = random_blocks(kind, 45, 576, seed=11)
    x = torch.randn(12, 576, generator=torch.Generator().manual_seed(11))
    run = _int8(blocks)
    whole = run(x)
    for rows in range(1, 12):
        assert torch.equal(run(x[:rows]), whole[:rows]), rows
        assert torch.equal(run(x[rows:]), whole[rows:]), rows


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 8, 13])
def test_blocks_in_groups_of_eight_rows_are_the_same_blocks(kind, rows):
    """QuantBlocks.in_groups: block b of row 8g + j at group g, four bytes of row j after
    four of row j - 1; the last group padded with zero rows; back by rows exactly."""
    blocks, weight = random_blocks(kind, rows, 64, seed=rows)
    grouped = blocks.in_groups()
    width = 16 if kind == "Q4_1" else 32
    groups = -(-rows // 8)
    assert grouped.grouped and not grouped.tiled and grouped.rows() == rows
    assert grouped.q.shape == (groups, 2, 8 * width) and grouped.d.shape == (groups, 2, 8)
    assert grouped.columns() == 64
    for n in range(rows):
        g, j = divmod(n, 8)
        for b in range(2):
            for h in range(width // 4):
                assert grouped.q[g, b, h * 32 + j * 4:h * 32 + j * 4 + 4].tolist() == \
                    blocks.q[n, b, 4 * h:4 * h + 4].tolist()
            assert grouped.d[g, b, j] == blocks.d[n, b]
    lanes = grouped.q[-1].reshape(2, width // 4, 8, 4)
    last = rows - 8 * (groups - 1)          # the last group's rows; the rest are zeros
    assert not lanes[:, :, last:].any() and not grouped.d[-1, :, last:].any()
    back = grouped.in_rows()
    assert np.array_equal(back.q, blocks.q) and np.array_equal(back.d, blocks.d)
    assert (back.m is None) == (blocks.m is None)
    assert np.array_equal(grouped.dequantised(), weight)
    assert np.array_equal(grouped.in_tiles().in_rows().q, blocks.q)
    half = grouped.with_scales(np.float16).on_huge_pages()
    assert half.grouped and half.rows() == rows


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_block_sums_are_exact(sign):
    """Every Q4_1 weight 15 and every Q8_0 weight -128 times x all 127 (or -127) after
    quantisation: the largest sums the int16 and int32 steps meet (a block's eight
    Q4_1 pair sums reach 30,480; a Q8_0 pair 32,512) come out as the exact arithmetic's."""
    rows, width = 13, 96
    x = torch.full((5, width), sign)
    q4 = QuantBlocks("Q4_1", np.full((rows, 3, 16), 0xFF, np.uint8),
                     np.full((rows, 3), 0.5, np.float32), np.full((rows, 3), -1.0, np.float32))
    q8 = QuantBlocks("Q8_0", np.full((rows, 3, 32), -128, np.int8),
                     np.full((rows, 3), 0.25, np.float32), None)
    for blocks in (q4, q8):
        got = _int8(blocks)(x).numpy()
        want = int8_reference(x.numpy(), blocks)
        assert np.array_equal(got, want.astype(np.float32)), blocks.kind
