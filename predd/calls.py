"""A pred or generate call in flight: its inputs, its results so far and what it cost.

The scheduler sees only counters (`Call.total`, `Call.computed`); this record is the
engine's payload on the call. `pred_reply` builds a pred's reply.

Commit rule: a call's computed tokens become entries of its object only when they are
all computed (`committed` counts those that are), so a chunked prefill is never seen or
left half-done; `base` and `reopened` say how to put the object back exactly as it was
if the call fails.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from liblip.protocol import SampleParams, ok_reply
from predd import sampling


@dataclass
class CallState:
    identity: bytes
    rid: int
    op: str                          # "pred" | "generate"
    tokens: list[int]
    positions: list[int] | None      # resolved at admission when None
    outputs: list[int]               # pred: indices into tokens whose logits are wanted
    sample: SampleParams | None
    allowed: torch.Tensor | None     # mask
    topk: int = 0
    # generate
    max_tokens: int = 0
    stop: frozenset[int] = frozenset()
    stop_text: tuple[str, ...] = ()
    stream: bool = True
    stop_window: int = 0             # tokens of output a stop_text match is looked for in
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # results and cost
    logits: list[torch.Tensor] = field(default_factory=list)
    generator: torch.Generator | None = None
    picked: tuple[int, float] | None = None
    arrival: float = 0.0
    admitted_at: float = 0.0
    reused: int = 0
    step_s: float = 0.0
    # commit and undo
    committed: int = 0               # leading tokens that are entries of the object
    base: int = 0                    # the object's length when the call was admitted
    reopened: tuple[int, int, np.ndarray] | None = None   # re-predict: the entry, to undo

    def __post_init__(self) -> None:
        # A stop string of m characters spans at most 4m tokens (a byte-level token is at
        # least one byte, a character at most four), plus a few for a cut character at
        # the window's start: matching in that tail of the output finds every new match.
        if self.stop_text:
            self.stop_window = 4 * max(len(t) for t in self.stop_text) + 8

    def hits_stop_text(self, decode: Callable[[list[int]], str]) -> bool:
        """Whether the output now contains a stop string. Earlier tokens were checked when
        they came, so only a match ending in the last `stop_window` tokens is new: the
        cost per token is bounded, not the length of the output."""
        tail = decode(self.generated[-self.stop_window:])
        return any(t in tail for t in self.stop_text)

    def chunk(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Token ids, positions and wanted-output indices (chunk-relative) of a chunk."""
        tokens = np.asarray(self.tokens[start:start + count], dtype=np.int32)
        positions = np.asarray(self.positions[start:start + count], dtype=np.int32)
        if self.op == "generate":
            wanted = [count - 1] if start + count == len(self.tokens) else []
        else:
            wanted = [o - start for o in self.outputs if start <= o < start + count]
        return tokens, positions, np.asarray(wanted, dtype=np.int64)

    def cost(self, computed: int, pages: int) -> dict:
        return {"computed": computed, "reused": self.reused, "pages": pages,
                "queue_ms": round((self.admitted_at - self.arrival) * 1e3, 3),
                "step_ms": round(self.step_s * 1e3, 3)}

    def pred_reply(self, cost: dict) -> tuple[dict, list[bytes]]:
        """The reply to a finished pred: raw logits, sampled tokens or top-k."""
        logits = (torch.cat(self.logits) if self.logits
                  else torch.empty(0, 0, dtype=torch.float32))
        logits = sampling.apply_mask(logits, self.allowed)
        if self.sample is not None:
            picks = [sampling.sample(row, self.sample, self.generator) for row in logits]
            tokens = [t for t, _ in picks]
            lps = [lp for _, lp in picks]
            head = ok_reply(self.rid, tokens=tokens, logprobs=lps, cost=cost,
                            token=tokens[-1] if tokens else None,
                            logprob=lps[-1] if lps else None)
            return head, []
        if self.topk:
            picks = [sampling.topk(row, self.topk) for row in logits]
            return ok_reply(self.rid, topk_ids=[i for i, _ in picks],
                            topk_logprobs=[lp for _, lp in picks], cost=cost), []
        data = logits.contiguous().numpy()
        head = ok_reply(self.rid, logits={"shape": list(data.shape), "dtype": "float32"},
                        cost=cost)
        return head, [data.tobytes()]

    def next_token(self) -> tuple[int, float]:
        if self.picked is not None:   # chosen in a batch with the step's other calls
            picked, self.picked = self.picked, None
            return picked
        row = sampling.apply_mask(self.logits.pop()[0], self.allowed)
        params = self.sample or SampleParams(temperature=0.0)
        return sampling.sample(row, params, self.generator)
