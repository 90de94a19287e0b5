"""Cancellation: a caller ends its own call in flight (the `cancel` request).

`Cancellation` is the part of `Engine` (predd/engine/core.py) that ends a call between
steps. A generate that has generated tokens finishes as at `length`, with finish_reason
`cancelled`: the token it was to feed back is not computed, so its reserved slot goes
and its object keeps the prompt and every generated token but the last. Any other call,
or a request held behind a busy object (predd/engine/deferred.py), gets ECANCELED and
its object is as it was (`calls.undo`). Speculations have no caller and are never
cancelled this way.
"""
from __future__ import annotations

import time

import symphony_protocol as p
from symphony_protocol import ErrorReply, ProtocolError
from predd.engine.calls import Call
from predd.engine.deferred import Deferred
from predd.engine.scheduler import Scheduler
from predd.memory.kvstore import KVStore
from predd.server.sessions import Session


class Cancellation:
    """Cancelling calls. The engine's parts it uses are declared here; it replies and
    fails calls through `Intake` (`_reply`, `_fail`, `replay_deferred`), and `Engine`
    makes the parts."""

    scheduler: Scheduler
    deferred: Deferred
    store: KVStore

    def cancel(self, session: Session, rid: int) -> bool:
        """End `session`'s call `rid` at its word, between steps; whether it had one in
        flight. A generate that has generated tokens finishes as at `length`
        (`cancelled`): the token it was to feed back is not computed, so its reserved
        slot goes and the object keeps the prompt and every generated token but the
        last. Any other call, or a request held behind a busy object, gets ECANCELED,
        its object as it was (`calls.undo`)."""
        for call in self.scheduler.all_calls():
            if call.session == session.sid and call.rid == rid and not call.speculative:
                self._cancel(call)
                self.replay_deferred(time.monotonic())   # what waited behind it goes on
                return True
        held = self.deferred.remove(session, rid, kinds=(p.Pred, p.Generate))
        if held is not None:
            self._reply(held.identity, rid, ErrorReply(code="ECANCELED",
                                                       message="cancelled by its caller"))
        return held is not None

    def _cancel(self, call: Call) -> None:
        if not (call.generating and call.generated and call.committed == len(call.tokens) - 1):
            self._fail(call, ProtocolError("ECANCELED", "cancelled by its caller"))
            return
        self.store.release_reservation(call.oid)
        call.tokens.pop()
        call.positions.pop()
        call.total -= 1
        self.scheduler.remove(call)
        obj = self.store.get(call.oid)
        every = slice(0, 0) if call.stream else slice(None)   # a stream has had them all
        self._reply(call.identity, call.rid, p.GenerateReply(
            tokens=call.generated[every], logprobs=call.logprobs[every],
            generated=len(call.generated), finish_reason="cancelled",
            cost=call.cost(len(obj.pages))))
