"""The engine's side of speculative continuation: the next step offered after a pred is
answered, and the reply to the call that takes a computed one.

`Continuation` is the part of `Engine` (predd/engine/core.py) between the step loop and
the speculations (predd/engine/speculation.py, which keeps them and says when a call
matches one). After a step answers a pred, or a call takes a computed speculation, the
object's next step is offered with the token answered (a sampled one) or its logits'
argmax (a raw row, where that object's calls follow it), never past an end-of-sequence
token. A call that takes a computed speculation, through the pred handler or at the door
(`Intake._take_speculation`), gets the reply built from its outputs, and its token is
committed; the reply failing, the call's error is the caller's and its object is as it
was.
"""
from __future__ import annotations

import time

import symphony_protocol as p
from predd.engine import calls
from predd.engine.calls import Call
from predd.engine.deferred import Deferred
from predd.engine.scheduler import Scheduler
from predd.engine.speculation import Speculation
from predd.memory.kvstore import KVStore
from predd.model.tokenizer import Tokenizer
from predd.server.request_limits import Limits


class Continuation:
    """Offering and answering speculations. The engine's parts it uses are declared
    here; it builds a pred's reply as the step loop does (`Engine._pred_reply`), and
    `Engine` makes the parts."""

    store: KVStore
    scheduler: Scheduler
    speculation: Speculation
    deferred: Deferred
    tokenizer: Tokenizer
    limits: Limits

    def claimed(self, spec: Call) -> p.PredReply:
        """The reply to the call that took the computed speculation `spec` (its client's
        now; its token committed); the next speculation queued."""
        try:
            reply = self._pred_reply(spec, len(self.store.get(spec.oid).pages))
        except Exception:
            self.scheduler.remove(spec)     # the caller's error; its object as it was
            calls.undo(spec, self.store)
            raise
        calls.commit(spec, self.store, 1)
        self.scheduler.remove(spec)
        self.speculate(spec, reply)
        return reply

    def speculate(self, done: Call, reply: p.PredReply) -> None:
        """Queue the next step of `done`'s object with the token it was answered, or the
        argmax of its logits where that object's calls follow it (speculation.py)."""
        if isinstance(reply, p.PredSample):
            token = reply.tokens[0] if len(reply.tokens) == 1 else None
        elif isinstance(reply, p.PredLogits) and reply.shape[0] == 1 and done.logits:
            token = self.speculation.guess(done.oid, done.logits[-1][-1])
        else:
            return
        if token is not None and token not in self.tokenizer.eos_ids:   # not past an end
            self.speculation.offer(done, token, time.monotonic(),
                                   holds=self.deferred.holds(done.oid),
                                   context=self.limits.context)
