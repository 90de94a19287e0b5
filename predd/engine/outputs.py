"""What a call's logits become: a pred's reply, a generate's next token, and whether the
generate stops there.

Stop rules, in order: a stop token (included in the output), a stop string in the
detokenised output, `max_tokens` reached ("length"), the object full to the context
("length"); and, when none of these holds, no room for the next token (its errno).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import symphony_protocol as p
from predd.engine import sampling
from predd.engine.calls import Call

SAMPLE_ROWS = 64   # rows sampled together (`_sampled_rows`)
HOST_COPY_BYTES = 64 << 20   # a device's rows joined for one copy to the host (`to_host`)


def pred_reply(call: Call, cost: p.Cost) -> p.PredReply:
    """The reply to a finished pred: sampled tokens, top-k, or raw logits (one row in
    the session's logits buffer when the call names a slot, else a frame)."""
    if call.picks is not None:    # chosen in a batch with the step's other calls
        return p.PredSample(tokens=[t for t, _ in call.picks],
                            logprobs=[lp for _, lp in call.picks], cost=cost)
    if len(call.logits) == 1:     # one chunk's rows: a view of the step's logits, not a copy
        logits = call.logits[0]
    else:
        logits = (torch.cat(call.logits) if call.logits
                  else torch.empty(0, 0, dtype=torch.float32))
    logits = sampling.apply_mask(logits, call.allowed)
    if call.sample is not None:
        picks = [sampling.sample(row, call.sample, call.generator) for row in logits]
        return p.PredSample(tokens=[t for t, _ in picks], logprobs=[lp for _, lp in picks],
                            cost=cost)
    if call.topk:
        picks = [sampling.topk(row, call.topk) for row in logits]
        return p.PredTopk(topk_ids=[i for i, _ in picks],
                          topk_logprobs=[lp for _, lp in picks], cost=cost)
    data = logits.contiguous().numpy()      # sent from this memory (the view keeps it)
    if (call.buffer is not None and call.into >= 0 and len(data) == 1
            and call.buffer.write(call.into, data[0])):
        return p.PredLogits(shape=list(data.shape), data=b"", slot=call.into, cost=cost)
    return p.PredLogits(shape=list(data.shape), data=memoryview(data.reshape(-1).view(np.uint8)),
                        cost=cost)


def pick_tokens(calls: list[Call], device: torch.device | None = None) -> int:
    """The tokens of every generate (its next) and pred_sample (one at each of its
    outputs) of a step in two batched ops, not 64 small calls: the greedy, unmasked
    ones by predd's argmax kernel (`_greedy_rows`), the rest by `sampling.sample_rows`.
    A call left without (a failure, a NaN row) picks its own in `next_token` or
    `pred_reply`, which fail it as they would alone. `device`: where the step's rows are,
    if not the host. How many of the two batched ops failed (their calls then pick
    alone: the same tokens, at a call's cost each)."""
    def greedy(c: Call) -> bool:
        return c.allowed is None and (c.sample is None
                                      or c.sample.temperature < sampling.MIN_TEMPERATURE)
    generates = [c for c in calls if c.generating and c.logits]
    samples = [c for c in calls if not c.generating and c.sample is not None and c.logits]
    failed = _pick([c for c in generates if greedy(c)], [c for c in samples if greedy(c)],
                   lambda _, blocks: _greedy_rows(blocks), device)
    return failed + _pick([c for c in generates if c.picked is None],
                          [c for c in samples if c.picks is None], _sampled_rows, device)


def _pick(generates: list[Call], samples: list[Call],
          rows_of: Callable[[list[Call], list[torch.Tensor]], tuple[list[int], list[float]]],
          device: torch.device | None = None) -> int:
    """`rows_of`'s tokens for the last row of each of `generates` and every row of
    `samples`, given as the calls' row blocks (2-D views of the step's logits: no tensor
    a row); a call with a row left without (token -1) keeps its logits. Where the step's
    rows are on a `device`, a call's rows from an earlier step (on the host: `to_host`)
    join them there. 1 where `rows_of` failed, else 0."""
    owners = list(generates)
    blocks = []
    for c in generates:
        last = c.logits[-1]
        blocks.append(last if last.shape[0] == 1 else last[-1:])
    counts = []
    for c in samples:
        n = 0
        for block in c.logits:
            blocks.append(block)
            n += block.shape[0]
        owners += [c] * n
        counts.append(n)
    if not blocks:
        return 0
    if device is not None:
        blocks = [_to_device(b, device) if b.is_cpu else b for b in blocks]
    try:
        tokens, picked = rows_of(owners, blocks)
    except Exception:
        return 1
    pairs = list(zip(tokens, picked))
    for call, (token, lp) in zip(generates, pairs):
        if token >= 0:
            call.logits.pop()
            call.picked = (token, lp)
    at = len(generates)
    for call, n in zip(samples, counts):
        mine, at = pairs[at:at + n], at + n
        if all(token >= 0 for token, _ in mine):
            call.picks = mine
    return 0


def _to_device(block: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`block` (on the host) copied to `device`."""
    return block.to(device)


def _sampled_rows(owners: list[Call], blocks: list[torch.Tensor]
                  ) -> tuple[list[int], list[float]]:
    """Each row's token by its call's mask, parameters and generator, and its logprob
    (`sampling.sample_rows`); token -1 for a row that is no distribution. SAMPLE_ROWS rows
    at a time: a call of thousands of outputs costs the step a few copies of 64 rows, not
    of all of them (a row's token is the same either way)."""
    rows = [row for block in blocks for row in block]
    greedy = p.SampleParams(temperature=0.0)
    tokens: list[int] = []
    logprobs: list[float] = []
    for at in range(0, len(rows), SAMPLE_ROWS):
        mine = range(at, min(at + SAMPLE_ROWS, len(rows)))
        masked = [sampling.apply_mask(rows[i], owners[i].allowed) for i in mine]
        picks = sampling.sample_rows(masked, [owners[i].sample or greedy for i in mine],
                                     [owners[i].generator for i in mine])
        tokens += [t for t, _ in picks]
        logprobs += [lp for _, lp in picks]
    return tokens, logprobs


def _greedy_rows(blocks: list[torch.Tensor]) -> tuple[list[int], list[float]]:
    """Each row's argmax and its logprob, over the rows of `blocks` (2-D) in order:
    predd's CPU kernel where it runs (no copy of the rows; measured: docs/kernels.md,
    "Greedy pick without a log-softmax"), else torch where the rows are (on a GPU: only
    the ids and logprobs come to the host, in one copy); token -1 for a row left to the
    caller (a NaN, nothing finite)."""
    kernels = sampling.cpu_kernels()
    if kernels is not None and blocks[0].is_cpu and blocks[0].dtype == torch.float32:
        return kernels.greedy_pick(blocks)
    stacked = torch.cat(blocks) if len(blocks) > 1 else blocks[0]     # [k, V]
    tokens = torch.argmax(stacked, dim=-1)
    logprobs = torch.log_softmax(stacked, dim=-1).gather(1, tokens[:, None])[:, 0]
    tokens = torch.where(torch.isfinite(logprobs), tokens, -1)
    both = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))).cpu()
    return both[0].long().tolist(), both[1].tolist()


def to_host(calls: list[Call]) -> None:
    """After a step whose logits stayed on the device (`Runner.execute(host=False)`) and
    its tokens were picked there: every logits block the calls still hold, brought to the
    host in as few copies as HOST_COPY_BYTES allows (a raw pred's rows, top-k, rows left
    without a pick, a chunk's rows kept for its call's later step); a pred_sample answered
    by its picks keeps none. Afterwards every call's logits are on the host, as the
    replies, speculation and the logits buffer read them."""
    moving: list[tuple[Call, int]] = []
    for c in calls:
        there = [i for i, t in enumerate(c.logits) if not t.is_cpu]
        if there and c.picks is not None:     # answered by its picks: no row is read again
            c.logits = []
        else:
            moving += [(c, i) for i in there]
    while moving:     # blocks joined on the device up to HOST_COPY_BYTES, one copy each
        size = take = 0
        while take < len(moving):
            c, i = moving[take]
            size += c.logits[i].numel() * c.logits[i].element_size()
            if take and size > HOST_COPY_BYTES:
                break
            take += 1
        part, moving = moving[:take], moving[take:]
        blocks = [c.logits[i] for c, i in part]
        host = (torch.cat(blocks) if len(blocks) > 1 else blocks[0]).cpu()
        at = 0
        for (c, i), block in zip(part, blocks):
            c.logits[i] = host[at:at + block.shape[0]]
            at += block.shape[0]


def next_token(call: Call) -> tuple[int, float]:
    """A generate's next token and its logprob, from its last logits row."""
    if call.picked is not None:   # chosen in a batch with the step's other calls
        picked, call.picked = call.picked, None
        return picked
    row = sampling.apply_mask(call.logits.pop()[0], call.allowed)
    params = call.sample or p.SampleParams(temperature=0.0)
    return sampling.sample(row, params, call.generator)


def stop_reason(call: Call, token: int, decode: Callable[[list[int]], str],
                full: bool) -> str | None:
    """Why a generate stops after `token` (already in `call.generated`), or None.
    `full`: its object has no room for another entry within the context."""
    if token in call.stop:
        return "stop"
    if call.stop_text and call.hits_stop_text(decode):
        return "stop"
    if len(call.generated) >= call.max_tokens or full:
        return "length"
    return None
