"""A pred or generate call, one record from submit to reply, and what it does to its
object: admit (reserve), commit, extend, undo.

The scheduler reads only the scheduling fields (`session`, `uid`, `oid`, `total`,
`computed`, `generating`, `admitted`) and sets `cid` and `arrival`; the rest are the
engine's (the request, the results so far, the cost).

Commit rule: a call's computed tokens become entries of its object only when they are
all computed (`commit`; `committed` counts those that are), so a chunked prefill is never
seen or left half-done. Admission (`admit`) makes every check first, then the one
change: it reserves slots for the new tokens, or reopens the last entry for a re-predict
(`tokens=[]`). `base` (the length at admission) and `reopened` say how `undo` puts the
object back exactly as it was if the call fails or is dropped: the reservation released,
nothing the call computed kept, a reopened entry restored.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from symphony_protocol import Cost, ProtocolError, SampleParams
from predd.server.request_limits import MAX_POSITION

if TYPE_CHECKING:
    import torch

    from predd.memory.kvstore import KVStore
    from predd.server.request_limits import Limits
    from predd.server.logits_buffer import LogitsBuffer
    from predd.memory.policy import Memory
    from predd.server.quotas import Quotas


@dataclass(eq=False)
class Call:
    # scheduling
    session: int
    oid: int
    total: int                 # tokens to compute so far (a generate grows it by one a step)
    computed: int = 0
    generating: bool = False   # a generate: stays queued after catching up, until it stops
    uid: int = 0
    cid: int = 0               # Scheduler.submit sets cid and arrival
    arrival: float = 0.0
    admitted: bool = False
    waited: bool = False       # admission found no room at least once
    # the request
    identity: bytes = b""      # the client to reply to
    rid: int = 0
    tokens: list[int] = field(default_factory=list)   # a generate appends what it feeds back
    positions: list[int] | None = None                 # resolved at admission when None
    outputs: list[int] = field(default_factory=list)   # pred: indices whose logits are wanted
    sample: SampleParams | None = None
    sample_wire: dict | None = None     # the request's own sample map (Speculation.taken_by)
    allowed: torch.Tensor | None = None                # the mask
    topk: int = 0
    into: int = -1             # pred: the logits buffer slot for its one row (-1: a frame)
    buffer: LogitsBuffer | None = None   # ... of the buffer the session had at submit
    max_tokens: int = 0
    stop: frozenset[int] = frozenset()
    stop_text: tuple[str, ...] = ()
    stream: bool = True
    generator: torch.Generator | None = None
    # results so far
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    picked: tuple[int, float] | None = None   # the next token, chosen with the step's others
    picks: list[tuple[int, float]] | None = None   # a greedy pred_sample's, likewise
    # cost
    admitted_at: float = 0.0
    reused: int = 0
    step_s: float = 0.0
    swapped_in: int = 0        # entries brought back to the device at admission
    swap_s: float = 0.0
    promised: int = 0          # device pages still held back for a generate's growth
    # commit and undo
    committed: int = 0         # leading tokens that are entries of the object
    base: int = 0              # the object's length when the call was admitted
    reopened: tuple[int, int, np.ndarray] | None = None   # re-predict: the entry, to undo
    # speculation (predd/engine/speculation.py): no client; computed (`parked`), it keeps
    # its outputs (picks, or its logits copied) for the call that takes it
    speculative: bool = False
    parked: bool = False
    stop_window: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # A stop string of m characters spans at most 4m tokens (a byte-level token is at
        # least one byte, a character at most four), plus a few for a cut character at
        # the window's start: matching in that tail of the output finds every new match.
        if self.stop_text:
            self.stop_window = 4 * max(len(t) for t in self.stop_text) + 8

    @property
    def remaining(self) -> int:
        return self.total - self.computed

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
        if self.generating:
            wanted = [count - 1] if start + count == len(self.tokens) else []
        else:
            wanted = [o - start for o in self.outputs if start <= o < start + count]
        return tokens, positions, np.asarray(wanted, dtype=np.int64)

    def cost(self, pages: int) -> Cost:
        return Cost(computed=self.total, reused=self.reused, pages=pages,
                    queue_ms=_ms(self.admitted_at - self.arrival), step_ms=_ms(self.step_s),
                    swapped_in=self.swapped_in, swap_ms=_ms(self.swap_s))


def _ms(seconds: float) -> float:
    """Milliseconds to the microsecond (round(x, 3) costs a few microseconds a call)."""
    return int(seconds * 1e6 + 0.5) / 1e3


def admit(call: Call, store: KVStore, quotas: Quotas, limits: Limits,
          memory: Memory) -> None:
    """Every check first (positions fit int32, the object stays within the context,
    quota), then room on the device (its pages brought in, and the pages it takes now
    and, for a generate, every page it may still write: promised to it), then the one
    change: reserve the new tokens' slots, or reopen the last entry for a re-predict
    (recomputed in place). Raises with the object unchanged (its pages may have moved
    up); ENOSPC means there is no room now."""
    obj = store.get(call.oid)
    # what the call will compute, set on it only with the change (a call refused for
    # room or quota is asked again: a re-predict must stay one)
    tokens, positions = call.tokens, call.positions
    if tokens:
        if positions is None:
            first = store.last_position(obj) + 1
            positions = list(range(first, first + len(tokens)))
        grow = len(tokens)
    else:
        if obj.length == 0:
            raise ProtocolError("EINVAL", "no tokens and an empty cache: nothing to "
                                "predict from")
        last_token, last_position = store.entries(call.oid, obj.length - 1)
        tokens, positions = last_token.tolist(), last_position.tolist()
        grow = 0
    # A generate appends max_tokens - 1 more entries after its prompt.
    last = positions[-1] + max(call.max_tokens - 1, 0)
    if last >= MAX_POSITION:
        raise ProtocolError("EOVERFLOW", f"positions would reach {last}: past the "
                            f"largest position {MAX_POSITION - 1}")
    if obj.length + grow > limits.context:
        raise ProtocolError("E2BIG", f"the object would hold {obj.length + grow} entries, "
                            f"more than the context of {limits.context}")
    now = store.pages_needed(call.oid, grow) if grow else store.reopen_pages(call.oid)
    quotas.check(call.oid, now)
    end = min(obj.length + grow + max(call.max_tokens - 1, 0), limits.context)
    future = max(store.pages_for(end) - store.pages_for(obj.length + grow), 0) \
        if call.generating else 0
    started = time.monotonic()
    with memory.protecting(call.oid):
        call.swapped_in = memory.bring_in(obj)
        memory.ensure(now + future)
        call.base = obj.length
        call.tokens, call.positions = tokens, positions
        if grow:
            store.reserve(call.oid, grow)
        else:
            call.reopened = store.reopen_last(call.oid)
    call.swap_s = time.monotonic() - started if call.swapped_in else 0.0
    memory.promise(future)
    call.promised = future
    memory.touch(obj)
    call.reused = obj.length
    call.admitted_at = time.monotonic()


def commit(call: Call, store: KVStore, done: int) -> None:
    """The call's first `done` tokens are computed: make those not yet committed entries."""
    store.commit(call.oid, call.tokens[call.committed:done],
                 call.positions[call.committed:done])
    call.committed = done


def extend(call: Call, token: int, store: KVStore, quotas: Quotas,
           memory: Memory) -> str | None:
    """Feed a generate's new token back as its next one to compute: reserve its slot
    first, from the pages promised to it. The errno (EDQUOT, ENOSPC) when there is no
    room, the call unchanged."""
    try:
        need = store.pages_needed(call.oid, 1)
        quotas.check(call.oid, need)
        drawn = min(need, call.promised)
        memory.draw(drawn)
        call.promised -= drawn
        store.reserve(call.oid, 1)
    except ProtocolError as exc:
        return exc.code
    call.tokens.append(token)
    call.positions.append(call.positions[-1] + 1)
    call.total += 1
    return None


def undo(call: Call, store: KVStore) -> None:
    """Put the object of a call that will not complete back exactly as it was before the
    call: reservation released, nothing the call computed kept. A call never admitted
    changed nothing; a freed object has nothing to put back."""
    obj = store.objects.get(call.oid)
    if obj is None or not call.admitted:
        return
    if call.reopened is not None and obj.length < call.base:
        store.restore_last(call.oid, *call.reopened)
    store.release_reservation(call.oid)
    if obj.length > call.base:
        store.truncate(call.oid, call.base)
