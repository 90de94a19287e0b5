"""The calls that run the model, one call per kind of answer, and the records they return.

    pred(kv, tokens)                    -> Distribution   the last token's raw logits
                                           (docs/design.md §2's keywords outputs=/sample=/topk=
                                           are shorthands for the three calls below)
    pred_outputs(kv, tokens, outputs)   -> list[Distribution], one per index in outputs
    pred_sample(kv, tokens, sample)     -> Sampled        predd samples; one int back
    pred_topk(kv, tokens, k)            -> TopK           predd's k best ids and logprobs
    prefill(kv, tokens)                 -> dict           only appends; the cost
    generate / generate_stream                            predd's own decode loop

Every pred call appends `tokens` to `kv` (at `positions`, default: after its last entry)
and all are the one `pred` op on the wire; they differ only in what comes back. `tokens`
may be empty: then predd computes the cache's last entry again and predicts after it.
`mask` (allowed token ids, or a bitmask as bytes) constrains what is predicted.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from liblip.api import KV, client_of
from liblip.client import LipError

Mask = Sequence[int] | bytes


@dataclass
class Distribution:
    """The next-token distribution at one position: raw float32 logits."""
    logits: np.ndarray
    cost: dict = field(default_factory=dict)

    def logprobs(self) -> np.ndarray:
        x = self.logits.astype(np.float64)
        m = x.max()
        return (x - m - np.log(np.exp(x - m).sum())).astype(np.float32)

    def probs(self) -> np.ndarray:
        return np.exp(self.logprobs())

    def argmax(self) -> int:
        return int(np.argmax(self.logits))

    def topk(self, k: int) -> tuple[list[int], list[float]]:
        lp = self.logprobs()
        ids = np.argsort(-lp, kind="stable")[:k]
        return ids.tolist(), lp[ids].tolist()

    def sample(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               rng: np.random.Generator | int | None = None) -> int:
        if temperature == 0:
            return self.argmax()
        rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        x = self.logits.astype(np.float64) / temperature
        if top_k:
            x[x < np.sort(x)[-min(top_k, x.size)]] = -np.inf
        p = np.exp(x - x.max())
        p /= p.sum()
        if top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            sp = p[order]
            sp[np.cumsum(sp) - sp >= top_p] = 0
            p = np.zeros_like(p)
            p[order] = sp
            p /= p.sum()
        return int(rng.choice(p.size, p=p))


@dataclass
class Sampled:
    """What `pred_sample` drew: `token`/`logprob` at the last requested output, and
    `tokens`/`logprobs` at every one (in `outputs` order). Logprobs are at temperature 1."""
    token: int
    logprob: float
    tokens: list[int]
    logprobs: list[float]
    cost: dict


@dataclass
class TopK:
    """What `pred_topk` found: the k most likely ids at the last requested output with
    their logprobs (most likely first), and the same pair for every output."""
    ids: list[int]
    logprobs: list[float]
    per_output: list[tuple[list[int], list[float]]]
    cost: dict

    def __iter__(self):
        """`ids, logprobs = lip.pred_topk(...)` unpacks the last output's pair."""
        return iter((self.ids, self.logprobs))


class Generated(list):
    """The ids `generate` produced (a plain list of ints), plus what predd said of the
    run: each id's `logprobs`, `finish_reason` ("stop", "length" or an errno name) and
    `cost`."""

    def __init__(self, ids=()) -> None:
        super().__init__(ids)
        self.logprobs: list[float] = []
        self.finish_reason = ""
        self.cost: dict = {}


# ---------------------------------------------------------------- pred

def _pred(kv: KV, tokens: Sequence[int], positions: Sequence[int] | None,
          outputs: Sequence[int] | None, mask: Mask | None, **answer) -> tuple[dict, list]:
    """One `pred` request; `answer` is what predd should return (sample=, topk=)."""
    fields = {"cap": kv.cap, "tokens": [int(t) for t in tokens], **answer}
    if positions is not None:
        fields["positions"] = [int(p) for p in positions]
    if outputs is not None:
        fields["outputs"] = [int(o) for o in outputs]
    if mask is not None:
        fields["mask"] = mask if isinstance(mask, bytes) else [int(m) for m in mask]
    return client_of(kv).request("pred", **fields)


def _distributions(kv: KV, tokens: Sequence[int], positions: Sequence[int] | None,
                   outputs: Sequence[int] | None, mask: Mask | None) -> list[Distribution]:
    """A raw pred's rows: one row comes through a slot of the client's logits buffer
    when it has a free one (liblip/logits_buffer.py), else (and several rows) as a frame."""
    one_row = outputs is None or len(outputs) == 1
    buffer = client_of(kv).logits_buffer() if one_row else None
    if buffer is None:
        header, frames = _pred(kv, tokens, positions, outputs, mask)
        return _rows(header, frames)
    with buffer.slot() as slot:
        if slot < 0:                  # every slot taken: a bigger buffer for later calls
            client_of(kv).logits_buffer(grow=True)
        into = {"into": slot} if slot >= 0 else {}
        header, frames = _pred(kv, tokens, positions, outputs, mask, **into)
        logits = header["logits"]
        if logits.get("slot", -1) < 0:
            return _rows(header, frames)
        return [Distribution(buffer.row(slot, logits["shape"][1]), header.get("cost", {}))]


def _rows(header: dict, frames: list) -> list[Distribution]:
    shape = header["logits"]["shape"]
    logits = np.frombuffer(frames[0], dtype=np.float32).reshape(shape)
    cost = header.get("cost", {})
    return [Distribution(row, cost) for row in logits]


def _need_outputs(outputs: Sequence[int] | None) -> None:
    if outputs is not None and len(outputs) == 0:
        raise LipError("EINVAL", "outputs: name at least one index "
                       "(prefill appends without a prediction)")


def pred(kv: KV, tokens: Sequence[int], positions: Sequence[int] | None = None,
         outputs: Sequence[int] | None = None, sample: dict | None = None,
         mask: Mask | None = None, topk: int = 0):
    """Append `tokens` to `kv`; the next-token distribution after the last of them.

    The system call's other keywords (docs/design.md §2: `outputs`, `sample`, `topk`) are
    shorthands for the call that has that answer, and return exactly what it returns:
    `outputs=` → `pred_outputs` (list[Distribution]), `sample=` → `pred_sample`
    (Sampled), `topk=k` → `pred_topk` (TopK). Programs should name the call they mean.
    """
    if sample is not None and topk:
        raise LipError("EINVAL", "pred: sample and topk are two answers; ask for one")
    if sample is not None:
        return pred_sample(kv, tokens, sample, positions, outputs, mask)
    if topk:
        return pred_topk(kv, tokens, topk, positions, outputs, mask)
    if outputs is not None:
        return pred_outputs(kv, tokens, outputs, positions, mask)
    return _distributions(kv, tokens, positions, None, mask)[-1]


def pred_outputs(kv: KV, tokens: Sequence[int], outputs: Sequence[int],
                 positions: Sequence[int] | None = None,
                 mask: Mask | None = None) -> list[Distribution]:
    """Append `tokens` to `kv`; the next-token distribution after each token named in
    `outputs` (indices into `tokens`, negative from the end), in that order; [] only
    appends, as `prefill` does."""
    return _distributions(kv, tokens, positions, outputs, mask)


def pred_sample(kv: KV, tokens: Sequence[int], sample: dict,
                positions: Sequence[int] | None = None, outputs: Sequence[int] | None = None,
                mask: Mask | None = None) -> Sampled:
    """Append `tokens` to `kv`; predd samples the next token (at the last token, or at
    each of `outputs`) with `sample={temperature, top_p, top_k, seed}` (temperature 0:
    argmax) and returns only the ids and their logprobs, not the logits."""
    _need_outputs(outputs)
    if not isinstance(sample, dict):
        raise LipError("EINVAL", "sample: a dict such as {'temperature': 0.0}")
    header, _ = _pred(kv, tokens, positions, outputs, mask, sample=sample)
    return Sampled(header["token"], header["logprob"], header["tokens"],
                   header["logprobs"], header.get("cost", {}))


def pred_topk(kv: KV, tokens: Sequence[int], k: int, positions: Sequence[int] | None = None,
              outputs: Sequence[int] | None = None, mask: Mask | None = None) -> TopK:
    """Append `tokens` to `kv`; predd's k most likely next tokens (at the last token, or
    at each of `outputs`) with their logprobs, most likely first."""
    _need_outputs(outputs)
    if k < 1:
        raise LipError("EINVAL", f"k must be at least 1, not {k}")
    header, _ = _pred(kv, tokens, positions, outputs, mask, topk=k)
    rows = [(list(ids), list(lps))
            for ids, lps in zip(header["topk_ids"], header["topk_logprobs"])]
    return TopK(rows[-1][0], rows[-1][1], rows, header.get("cost", {}))


def prefill(kv: KV, tokens: Sequence[int], positions: Sequence[int] | None = None) -> dict:
    """Append `tokens` to `kv` without a prediction; the cost (`computed` counts the
    tokens this call ran through the model, `reused` those it found cached)."""
    header, _ = _pred(kv, tokens, positions, [], None)
    return header.get("cost", {})


# ---------------------------------------------------------------- generate

def _generate_fields(kv: KV, tokens, max_tokens, stop, sample, ignore_eos) -> dict:
    """One meaning for `stop`, here and on the wire: None = the model's EOS ids (none
    with ignore_eos); a list = exactly its token ids and strings, so [] = never stop early."""
    fields = {"cap": kv.cap, "tokens": [int(t) for t in tokens], "max_tokens": max_tokens}
    if stop is not None:
        fields["stop"] = [s for s in stop if isinstance(s, int)]
        fields["stop_text"] = [s for s in stop if isinstance(s, str)]
    elif ignore_eos:
        fields["stop"] = []
    if sample is not None:
        fields["sample"] = sample
    return fields


def generate_stream(kv: KV, tokens: Sequence[int], max_tokens: int = 16,
                    stop: Sequence[int | str] | None = None, sample: dict | None = None,
                    ignore_eos: bool = False, out: Generated | None = None) -> Iterator[int]:
    """Tokens as predd's loop produces them. The cache ends as a pred loop leaves it:
    every generated token but the last is appended. `out`, when given, collects the
    ids, their logprobs and, once the stream ends, finish_reason and cost."""
    fields = _generate_fields(kv, tokens, max_tokens, stop, sample, ignore_eos)
    for reply in client_of(kv).stream("generate", stream=True, **fields):
        ids = reply.get("tokens", [])
        if out is not None:
            out.extend(ids)
            out.logprobs.extend(reply.get("logprobs", []))
            if not reply.get("more"):
                out.finish_reason = reply.get("finish_reason", "")
                out.cost = reply.get("cost", {})
        yield from ids


def generate_into(kv: KV, tokens: Sequence[int], on_tokens: Callable[[list, list], Any],
                  max_tokens: int = 16, stop: Sequence[int | str] | None = None,
                  sample: dict | None = None, ignore_eos: bool = False,
                  out: Generated | None = None) -> Generated:
    """`generate_stream` with no hand-off between threads a token: `on_tokens(ids,
    logprobs)` gets each chunk's tokens on the thread that reads the client's socket,
    the moment they come (`Client.stream_into`: it must be quick and call no liblip,
    for every reply of the client waits behind it), the last chunk's on this thread.
    Returning False stops the generation: predd cancels it after its current step, and
    tokens after that are neither given nor kept. Returns what `generate` returns for
    the tokens given (finish_reason only where it was not stopped)."""
    fields = _generate_fields(kv, tokens, max_tokens, stop, sample, ignore_eos)
    got = Generated() if out is None else out
    stopped = False

    def chunk(header: dict) -> bool:
        nonlocal stopped
        ids, lps = header.get("tokens", []), header.get("logprobs", [])
        got.extend(ids)
        got.logprobs.extend(lps)
        stopped = on_tokens(ids, lps) is False
        return not stopped

    try:
        last = client_of(kv).stream_into("generate", chunk, stream=True, **fields)
    except LipError as exc:
        if stopped and exc.code == "ECANCELED":    # the end of the stop asked for
            return got
        raise
    got.cost = last.get("cost", {})
    if not stopped:
        got.finish_reason = last.get("finish_reason", "")
        if last.get("tokens"):
            chunk(last)
    return got


def generate(kv: KV, tokens: Sequence[int], max_tokens: int = 16,
             stop: Sequence[int | str] | None = None, sample: dict | None = None,
             ignore_eos: bool = False) -> Generated:
    """Greedy (or `sample`d) completion inside predd; stops at max_tokens or at `stop`
    (None: the model's EOS ids; a list: exactly those token ids and strings). Returns
    the generated ids (a stop token included) as a list that also carries `.logprobs`,
    `.finish_reason` and `.cost`."""
    fields = _generate_fields(kv, tokens, max_tokens, stop, sample, ignore_eos)
    reply = client_of(kv).call("generate", stream=False, **fields)
    out = Generated(reply["tokens"])
    out.logprobs = list(reply.get("logprobs", []))
    out.finish_reason, out.cost = reply.get("finish_reason", ""), reply.get("cost", {})
    return out
