"""Server-side post-processing of logits: masks, sampling, top-k.

Logprobs reported are those of the model's distribution after the mask, at
temperature 1, whatever temperature the token was sampled at (as vLLM reports them).
A temperature below MIN_TEMPERATURE samples greedily.
"""
from __future__ import annotations

import numpy as np
import torch

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
    return logits.masked_fill(~allowed, float("-inf"))


def make_generator(params: SampleParams | None) -> torch.Generator | None:
    if params is None or params.seed is None:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed)
    return gen


def sample(logits: torch.Tensor, params: SampleParams, gen: torch.Generator | None
           ) -> tuple[int, float]:
    """One token from `logits` [V] (already masked) and its logprob."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if params.temperature < MIN_TEMPERATURE:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = sorted_p.cumsum(0) - sorted_p >= params.top_p
        drop[0] = False   # the most likely token always stays
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logprobs[token])


def topk(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    logprobs = torch.log_softmax(logits, dim=-1)
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return ids.tolist(), values.tolist()
