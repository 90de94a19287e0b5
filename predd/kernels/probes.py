"""The kernels checked against torch at load (`probe`): every kernel on small random
cases, in each dtype it takes; the largest relative difference beyond the rounding each
is allowed. Also the random quantised blocks those cases use, and the int8 arithmetic
computed exactly (`int8_reference`) that the int8 kernels are held to.
"""
from __future__ import annotations

import numpy as np
import torch

from predd.model.llama import RMSNorm, TorchOps
from predd.kernels.library import Kernels
from predd.model.loader import QuantBlocks

PROBE_TOLERANCE = 1e-4      # float32, another summation order


def probe(lib: Kernels, ops: type) -> float:
    """The largest difference from torch over every kernel on small random cases; `ops`
    is the kernels' ops class (cpu_kernels.CpuOps), held to the model's TorchOps."""
    with torch.inference_mode():
        return max(_probe_attention(lib), _probe_layer_ops(lib, ops), _probe_quant_linear(lib),
                   _probe_greedy(lib))


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0):
    """Random QuantBlocks of `kind` for a [rows, cols] weight, and that weight dequantised
    as the loader does it (numpy, float32)."""
    rng = np.random.default_rng(seed)
    shape = (rows, cols // 32)
    d = (rng.random(shape) * 0.02).astype(np.float16).astype(np.float32)
    if kind == "Q4_1":
        q = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
        m = (-rng.random(shape) * 0.1).astype(np.float16).astype(np.float32)
        blocks = QuantBlocks(kind, q, d, m)
    else:
        blocks = QuantBlocks(kind, rng.integers(-128, 128, (*shape, 32), dtype=np.int8), d, None)
    return blocks, blocks.dequantised()


def int8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [M, K] quantised per block of 32 as predd/kernels/csrc/quant_int8.c does:
    (q [M, K/32, 32] int8, scale [M, K/32] float32), x ~ q * scale."""
    v = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(v).max(axis=2)
    scale = amax / np.float32(127)
    inverse = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    return np.rint(v * inverse[..., None]).astype(np.int8), scale.astype(np.float32)


def int8_reference(x: np.ndarray, blocks, bias: np.ndarray | None = None) -> np.ndarray:
    """x [M, K] times `blocks` (QuantBlocks, Q4_1 or Q8_0) as the int8 kernels compute it:
    x quantised by `int8_rows`, each block's integer sum exact, then scaled in float64."""
    qx, dx = int8_rows(x)
    b = blocks.in_rows()
    if b.kind == "Q4_1":
        qw = np.concatenate([b.q & 15, b.q >> 4], axis=2).astype(np.int64)
    else:
        qw = b.q.astype(np.int64)
    dots = np.einsum("mbj,nbj->mnb", qx.astype(np.int64), qw).astype(np.float64)
    y = (dots * (b.d.astype(np.float64)[None] * dx.astype(np.float64)[:, None])).sum(2)
    if b.kind == "Q4_1":
        sums = qx.astype(np.int64).sum(2) * dx.astype(np.float64)       # [M, B]
        y += sums @ b.m.astype(np.float64).T
    return y + (0.0 if bias is None else bias.astype(np.float64))


def _probe_quant_linear(lib: Kernels) -> float:
    """Both block kinds against F.linear on their dequantised weights (relative); with
    bf16 dot products also the bf16 kernels against the same sum of bf16 values (Q4_1 in
    lanes: of bf16 rows and the exact weights), beyond one bf16 rounding of the result
    (2^-8 relative)."""
    worst = 0.0
    for kind in ("Q4_1", "Q8_0"):
        blocks, weight = random_blocks(kind, 19, 96)
        x = torch.randn(11, 96, generator=torch.Generator().manual_seed(1))
        bias = torch.randn(19, generator=torch.Generator().manual_seed(2))
        want = torch.nn.functional.linear(x, torch.from_numpy(weight), bias)
        got = lib.quant_linear(x, blocks, bias)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        want = int8_reference(x.numpy(), blocks, bias.numpy())
        got = lib.bind(blocks, bias, int8=True)(x).numpy()
        worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
        if lib.bf16_blocks:
            x16, w16 = x.to(torch.bfloat16), torch.from_numpy(weight).to(torch.bfloat16)
            want = torch.nn.functional.linear(x16.float(), w16.float(), bias)
            got = lib.quant_linear(x16, blocks, bias).float()
            error = float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())
            worst = max(worst, max(0.0, error - 2.0 ** -8))
        if lib.bf16_blocks and kind == "Q4_1":       # in lanes: the weights exactly
            want = torch.nn.functional.linear(x16.float(), torch.from_numpy(weight), bias)
            got = lib.quant_linear(x16, blocks.in_lanes(), bias).float()
            error = float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())
            worst = max(worst, max(0.0, error - 2.0 ** -8))
    return worst


def _probe_greedy(lib: Kernels) -> float:
    """greedy_pick against argmax and log_softmax on random rows, one of them with its
    largest value twice (the first must win); a wrong token counts as infinite."""
    rows = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 4
    rows[1, 700] = rows[1, 300] = rows[1].max() + 1
    tokens, logprobs = lib.greedy_pick(list(rows))
    if tokens != torch.argmax(rows, -1).tolist():
        return float("inf")
    want = torch.log_softmax(rows, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return float((torch.tensor(logprobs) - want).abs().max())


def _probe_layer_ops(lib: Kernels, ops: type) -> float:
    """CpuOps against TorchOps on a random layer's worth of rows (relative to scale), in
    float32, and in bfloat16 beyond two units in the last place of each tensor's
    largest value (the two round at different steps, RoPE's terms before they cancel)."""
    return max(_layer_ops_error(lib, ops, torch.float32),
               _layer_ops_error(lib, ops, torch.bfloat16))


def _layer_ops_error(lib: Kernels, ops: type, dtype: torch.dtype) -> float:
    gen = torch.Generator().manual_seed(0)
    ours, ref = ops(lib), TorchOps()
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    norm.to(dtype)
    x = torch.randn(5, 48, generator=gen).to(dtype)
    delta = torch.randn(5, 48, generator=gen).to(dtype)
    freqs = torch.rand(5, 8, generator=gen) * 50
    qkv = torch.randn(5, 4, 16, generator=gen).to(dtype)
    gate_up = (torch.randn(5, 64, generator=gen) * 8).to(dtype)
    x_ref, h_ref = ref.add_norm(x, delta, norm)
    x_got, h_got = ours.add_norm(x.clone(), delta, norm)
    turned = ref.rope(qkv, 3, ref.rotary(freqs, dtype))
    got = ours.rope(qkv.clone(), 3, ours.rotary(freqs, dtype))
    ulps = 0.0 if dtype == torch.float32 else 2.0 ** -6

    def error(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> float:
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() - b.abs().max() * ulps) / scale

    return max(error(x_got, x_ref), error(h_got, h_ref), error(got[:, :3], turned),
               error(ours.silu_mul(gate_up), ref.silu_mul(gate_up), 8))


def _probe_attention(lib: Kernels) -> float:
    """The largest difference from plain softmax attention on a small random case: three
    rows over 1, 19 and 40 entries of scattered pages, two query heads per kv head; in
    float32, in float32 over a bfloat16 pool (predd --kv-dtype), and in bfloat16 beyond what
    rounding the output to bf16 explains (half a unit in its last place, 2^-8 relative)."""
    errors = [_attention_error(lib, torch.float32),
              _attention_error(lib, torch.float32, pool=torch.bfloat16),
              _attention_error(lib, torch.bfloat16, 2.0 ** -8)]
    if lib.attention_blocks:   # a chunk of 6 rows after 34 entries: the block kernel
        errors.append(_attention_error(lib, torch.bfloat16, 2.0 ** -8, chunk=6))
    return max(errors)


def _attention_error(lib: Kernels, dtype: torch.dtype, rounding: float = 0.0,
                     chunk: int = 0, pool: torch.dtype | None = None) -> float:
    """Three rows over 1, 19 and 40 entries (pages of 4, head_dim 16); or, with `chunk`,
    one call's `chunk` rows seeing 35.. entries (pages of 16, head_dim 64: the tiles).
    `pool`: the pool's dtype where it is not `dtype`."""
    gen = torch.Generator().manual_seed(0)
    ps, kv_heads, heads, d = (16, 2, 4, 64) if chunk else (4, 2, 4, 16)
    paged = torch.randn(16, 2, ps, kv_heads, d, generator=gen).to(pool or dtype)
    rows = chunk or 3
    q = torch.randn(rows, heads, d, generator=gen).to(dtype)
    out = torch.zeros(rows, heads, d, dtype=dtype)
    indices = np.random.default_rng(0).permutation(16).astype(np.int32)
    if chunk:
        visible = np.arange(35, 35 + chunk, dtype=np.int64)
        starts = np.zeros(chunk, np.int64)
    else:
        visible = np.array([1, 19, 40], np.int64)
        starts = np.array([0, 1, 6], np.int64)
    lib.bind_attention(indices, np.arange(rows, dtype=np.int64), starts, visible,
                       int(visible.max()), np.array([chunk], np.int64) if chunk else None)(
                           q, out, paged)
    paged, q, out = paged.float(), q.float(), out.float()
    worst = 0.0
    for r in range(rows):
        pages = torch.from_numpy(indices[starts[r]:].astype(np.int64))[:-(-visible[r] // ps)]
        k = paged[pages, 0].flatten(0, 1)[:visible[r]].repeat_interleave(heads // kv_heads, 1)
        v = paged[pages, 1].flatten(0, 1)[:visible[r]].repeat_interleave(heads // kv_heads, 1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[r], k) * d ** -0.5, dim=-1)
        want = torch.einsum("hl,lhd->hd", probs, v)
        worst = max(worst, float(((want - out[r]).abs() - want.abs() * rounding).max()))
    return worst
