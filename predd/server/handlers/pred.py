"""pred and generate: check the request, make its Call and queue it. The reply comes
from the engine's step when the call is done (predd/engine/outputs.py builds it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import symphony_protocol as p
from symphony_protocol import ProtocolError
from predd.engine import sampling
from predd.engine.calls import Call

if TYPE_CHECKING:
    from predd.engine.core import Engine
    from predd.server.sessions import Session


def pred(e: Engine, s: Session, r: p.Pred, extra: list[bytes],
         now: float) -> p.PredReply | None:
    cap = e.caps.lookup(r.cap, write=True)
    e.limits.check_pred(r, e.vocab)
    n = len(r.tokens)
    if n == 0:   # re-predict from the last entry: it becomes the one token
        if r.outputs not in (None, [0], [-1]):
            raise ProtocolError("EINVAL", "with no tokens only output 0 exists")
        outputs = [0]
    else:
        outputs = [n - 1] if r.outputs is None else r.outputs
        if any(not -n <= o < n for o in outputs):
            raise ProtocolError("EINVAL", f"outputs must index the {n} tokens")
        outputs = [o % n for o in outputs]
    if r.into != -1 and s.logits is not None:   # none (a restarted predd's session): a frame
        s.logits.check_slot(r.into)
    sample = p.SampleParams.from_wire(r.sample)
    return _submit(e, Call(s.sid, cap.oid, total=max(n, 1), uid=s.uid, identity=s.identity,
                           rid=r.rid, tokens=list(r.tokens), positions=r.positions,
                           outputs=outputs, sample=sample, sample_wire=r.sample,
                           allowed=sampling.mask_tensor(r.mask, e.vocab), topk=r.topk,
                           into=r.into if s.logits is not None else -1, buffer=s.logits,
                           generator=sampling.make_generator(sample)), now)


def generate(e: Engine, s: Session, r: p.Generate, extra: list[bytes], now: float) -> None:
    cap = e.caps.lookup(r.cap, write=True)
    e.limits.check_generate(r, e.vocab)
    sample = p.SampleParams.from_wire(r.sample)
    stop = e.tokenizer.eos_ids if r.stop is None else r.stop
    _submit(e, Call(s.sid, cap.oid, total=max(len(r.tokens), 1), generating=True,
                    uid=s.uid, identity=s.identity, rid=r.rid, tokens=list(r.tokens),
                    sample=sample, max_tokens=r.max_tokens, stop=frozenset(stop),
                    stop_text=tuple(r.stop_text), stream=r.stream,
                    generator=sampling.make_generator(sample)), now)


def _submit(e: Engine, call: Call, now: float) -> p.PredReply | None:
    """Queue the call; or, where its object's speculation matches it, take that: the
    reply at once when it was computed (the next speculation queued), else the queued
    speculation becomes this call (predd/engine/speculation.py)."""
    if not call.tokens and e.store.get(call.oid).length == 0:
        raise ProtocolError("EINVAL", "no tokens and an empty cache: nothing to predict from")
    spec = e.speculation.claim(call) if e.speculation.by_oid else None
    if spec is not None:         # its step ran (or is queued) already
        return e.claimed(spec) if spec.parked else None
    e.scheduler.submit(call, now)
    return None


def cancel(e: Engine, s: Session, r: p.Cancel, extra: list[bytes],
           now: float) -> p.EmptyReply:
    """End the caller's own call `r.target` (Engine.cancel); ESRCH when this session has
    no such call in flight (it may have just finished)."""
    if not e.cancel(s, r.target):
        raise ProtocolError("ESRCH", f"no call {r.target} of this session in flight")
    return p.EmptyReply()


HANDLERS = {p.Pred: pred, p.Generate: generate, p.Cancel: cancel}
