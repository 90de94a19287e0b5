"""Admission: what a call reserves before its first step, and gives back when it leaves.

`Admission` is the part of `Engine` (predd/engine/core.py) the scheduler asks, step by
step, whether a call may join the batch (`_admit`, passed to `Scheduler.schedule`). A
call reserves what it needs all or nothing (`calls.admit`: checks, quota, pages). With
no room on the device yet it waits, up to `admit_wait_s` from its arrival, for calls to
finish or caches to be freed; any other refusal is its errno reply alone. Speculations
give way: one takes only room that is free now, and a call refused room or quota while
speculations hold pages has them dropped before the next step and waits that step
(predd/engine/speculation.py, the invisibility rule). A call that leaves the queue gives
back its unused promise of pages (`_left`, the scheduler's `on_leave`).
"""
from __future__ import annotations

import time

from symphony_protocol import ErrorReply, ProtocolError
from predd.engine import calls
from predd.engine.calls import Call
from predd.engine.config import EngineConfig
from predd.engine.metrics import Counters
from predd.engine.speculation import ROOM_ERRORS, Speculation
from predd.memory.kvstore import KVStore
from predd.memory.policy import Memory, NoRoom
from predd.memory.pool import Pool
from predd.server.quotas import Quotas
from predd.server.request_limits import Limits
from predd.server.sessions import Sessions


class Admission:
    """Admitting calls to a step. The engine's parts it uses are declared here; it
    replies through `Intake` (`_reply`, `_errno`), and `Engine` makes the parts."""

    config: EngineConfig
    counters: Counters
    sessions: Sessions
    speculation: Speculation
    store: KVStore
    pool: Pool
    quotas: Quotas
    memory: Memory
    limits: Limits

    def _admit(self, call: Call) -> bool | None:
        """Reserve what the call needs, all or nothing. With no room on the device yet
        it waits (None: asked again next step) up to `admit_wait_s` from its arrival;
        then, or on any other error, reply it to this call alone (the object is as it
        was) and refuse it. While speculations hold pages, a call that finds no room or
        no quota has them dropped and waits a step."""
        if call.speculative:
            return self._admit_speculation(call)
        try:
            calls.admit(call, self.store, self.quotas, self.limits, self.memory)
        except ProtocolError as exc:    # NoRoom among them
            if exc.code in ROOM_ERRORS and len(self.speculation):
                self.speculation.drop_all = True     # dropped before the next step
                return None
            if not isinstance(exc, NoRoom):
                self._reply(call.identity, call.rid, ErrorReply.of(exc))
                return False
            waited = time.monotonic() - call.arrival
            if not exc.permanent and waited < self.config.memory.admit_wait_s:
                if not call.waited:
                    call.waited = True
                    self.counters.admission_waits += 1
                return None
            self._reply(call.identity, call.rid, ErrorReply.of(exc))
            return False
        except Exception as exc:
            self._reply(call.identity, call.rid, self._errno(exc, f"call {call.rid}"))
            return False
        self.counters.tokens_reused += call.reused
        session = self.sessions.of_sid(call.session)
        if session is not None:
            session.tokens_reused += call.reused
        waited = call.admitted_at - call.arrival
        self.counters.queue_wait_s += waited
        self.counters.queue_hist.observe(waited * 1e3)
        return True

    def _admit_speculation(self, call: Call) -> bool:
        """A speculation takes only room that is free now (it never moves another
        object's pages) and gives way to calls waiting for room; refused, it is gone."""
        obj = self.store.objects.get(call.oid)
        ok = (self.speculation.by_oid.get(call.oid) is call and not self.speculation.hold_off
              and obj is not None and not self.memory.off_device(obj)
              and self.store.pages_needed(call.oid, 1) <= self.pool.available)
        if ok:
            try:
                calls.admit(call, self.store, self.quotas, self.limits, self.memory)
                return True
            except Exception:
                pass
        self.speculation.gone(call)
        return False

    def _left(self, call: Call) -> None:
        """A call left the queue (done, failed, dropped): its unused promise is free."""
        self.memory.draw(call.promised)
        call.promised = 0
