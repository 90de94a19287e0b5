"""Server-side post-processing of logits: masks, sampling, top-k.

Logprobs reported are those of the model's distribution after the mask, at
temperature 1, whatever temperature the token was sampled at (as vLLM reports them).
A temperature below MIN_TEMPERATURE samples greedily.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from predd.kernels import cpu_kernels as cpu_kernels_mod
from predd.kernels import library
from symphony_protocol import ProtocolError, SampleParams

MIN_TEMPERATURE = 1e-4   # below this, sampling is greedy (logits / T would overflow)


def mask_tensor(mask: list[int] | bytes | None, vocab: int) -> torch.Tensor | None:
    """Allowed-token boolean [vocab] from a list of ids or a little-endian bitmask."""
    if mask is None:
        return None
    if isinstance(mask, bytes):
        # ceil(vocab/8) bytes; padding to whole 32-bit words (as grammar engines emit
        # them) is accepted and ignored.
        if not (vocab + 7) // 8 <= len(mask) <= (vocab + 31) // 32 * 4:
            raise ProtocolError("EINVAL", f"mask: bitmask must be {(vocab + 7) // 8} bytes "
                                "(or padded to whole 32-bit words)")
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab]
        allowed = torch.from_numpy(bits.astype(bool))
    else:
        if any(not 0 <= i < vocab for i in mask):
            raise ProtocolError("EINVAL", f"mask: token ids must be in [0, {vocab})")
        ids = np.asarray(mask, dtype=np.int64)
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[torch.from_numpy(ids)] = True
    if not allowed.any():
        raise ProtocolError("EINVAL", "mask allows no token")
    return allowed


def apply_mask(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [R, V] with the tokens `allowed` [V] does not allow at -inf; a call that
    asked for no rows (`outputs: []`) has none to mask."""
    if allowed is None or logits.shape[0] == 0:
        return logits
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def make_generator(params: SampleParams | None) -> torch.Generator | None:
    if params is None or params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: SampleParams, gen: torch.Generator | None
           ) -> tuple[int, float]:
    """One token from `logits` [V] (already masked) and its logprob."""
    [(token, logprob)] = sample_rows(logits[None], [params], [gen])
    if token < 0:
        raise ValueError("the logits are no distribution to sample from (NaN or -inf)")
    return token, logprob


def sample_rows(rows: torch.Tensor | Sequence[torch.Tensor], params: Sequence[SampleParams],
                gens: Sequence[torch.Generator | None]) -> list[tuple[int, float]]:
    """One token from each row of `rows` ([k, V], or k rows of [V]; already masked) with
    that row's parameters and generator, and its logprob; token -1 for a row that is no
    distribution at its temperature (a NaN, nothing finite).

    Sampling is by the inverse of the row's cumulative distribution at one uniform draw
    from the row's generator: a row's token depends on its own logits, parameters and
    draw, never on the rows beside it. (torch.multinomial draws a random number for
    every token of the vocabulary; measured: docs/kernels.md, "Sampling by one draw".)
    A row without top-k or top-p goes to predd's CPU kernel where its rows are float32
    on the CPU (csrc/greedy.c: no copy, nothing allocated; docs/kernels.md, "Sampled
    picks in place"), the others to torch."""
    out: list[tuple[int, float]] = [(-1, float("nan"))] * len(params)
    plain = [i for i, p in enumerate(params)
             if p.temperature >= MIN_TEMPERATURE and not p.top_k and p.top_p >= 1.0]
    kernels = cpu_kernels() if plain and rows[0].is_cpu and \
        rows[0].dtype == torch.float32 else None
    if kernels is not None:
        draws = [float(torch.rand((), generator=gens[i], dtype=torch.float64)) for i in plain]
        tokens, logprobs = kernels.sample_pick([rows[i] for i in plain],
                                               [params[i].temperature for i in plain], draws)
        for i, token, lp in zip(plain, tokens, logprobs):
            out[i] = (token, lp if token >= 0 else float("nan"))
        done = set(plain)
        rest = [i for i in range(len(params)) if i not in done]
    else:
        rest = list(range(len(params)))
    if rest:
        picked = _sample_by_torch(
            rows[rest] if isinstance(rows, torch.Tensor) else torch.stack([rows[i] for i in rest]),
            [params[i] for i in rest], [gens[i] for i in rest])
        for i, pair in zip(rest, picked):
            out[i] = pair
    return out


def _sample_by_torch(rows: torch.Tensor, params: Sequence[SampleParams],
                     gens: Sequence[torch.Generator | None]) -> list[tuple[int, float]]:
    """`sample_rows` in torch ops over the rows [k, V] at once, where the rows are (on a
    GPU the draws, made on the host by the calls' generators, go there; the ids and
    logprobs come back, not the rows)."""
    logprobs = torch.log_softmax(rows, dim=-1)
    tokens = [-1] * len(params)
    cold = [i for i, p in enumerate(params) if p.temperature < MIN_TEMPERATURE]
    hot = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
    if cold:
        for i, token in zip(cold, torch.argmax(rows[cold], dim=-1).tolist()):
            tokens[i] = token
    if hot:
        temps = [params[i].temperature for i in hot]
        scaled = rows[hot] / torch.tensor(temps, dtype=rows.dtype, device=rows.device)[:, None]
        for j, i in enumerate(hot):
            if params[i].top_k:
                kth = torch.topk(scaled[j], min(params[i].top_k, scaled.shape[1])).values[-1]
                scaled[j].masked_fill_(scaled[j] < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        for j, i in enumerate(hot):
            if params[i].top_p < 1.0:
                _nucleus(probs[j], params[i].top_p)
        cdf = torch.cumsum(probs, dim=-1)
        total = cdf[:, -1]
        draws = torch.stack([torch.rand((), generator=gens[i], dtype=torch.float64)
                             for i in hot]).to(cdf.device)
        at = (draws * total.double()).to(cdf.dtype)
        picked = torch.searchsorted(cdf, at[:, None], right=True)[:, 0].tolist()
        fine = (torch.isfinite(total) & (total > 0)).tolist()
        for j, i in enumerate(hot):
            if not fine[j]:
                continue
            if picked[j] >= cdf.shape[1]:   # the draw rounded up to the total: the last
                picked[j] = int(torch.nonzero(probs[j]).max())   # token that can be drawn
            tokens[i] = picked[j]
    chosen = torch.tensor([max(t, 0) for t in tokens], dtype=torch.long,
                          device=logprobs.device)
    picked_logprobs = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    return [(t, lp if t >= 0 else float("nan")) for t, lp in zip(tokens, picked_logprobs)]


@functools.cache
def cpu_kernels() -> library.Kernels | None:
    """predd's CPU kernels where they build and pass their probe here, else None (asked
    once: a failed build is not retried every step)."""
    return None if cpu_kernels_mod.problem() else cpu_kernels_mod.kernels()


def _nucleus(probs: torch.Tensor, top_p: float) -> None:
    """`probs` [V] with the tokens outside the smallest set whose mass reaches `top_p`
    at zero (in place); the most likely token always stays."""
    sorted_p, order = torch.sort(probs, descending=True)
    drop = sorted_p.cumsum(0) - sorted_p >= top_p
    drop[0] = False
    probs[order[drop]] = 0.0


def topk(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return ids.tolist(), values.tolist()
