"""predd's request handlers, keyed by request record: `HANDLERS[type(request)]`.

A handler is `handler(engine, session, request, extra, now)`: the engine (its declared
parts: store, caps, quotas, sessions, scheduler, limits, runner, tokenizer, counters),
the caller's session, the validated request, its binary frames and the time. It returns
the reply record, or None for a call it queued (pred, generate: the step replies). It
raises ProtocolError for its caller alone; the engine answers any other exception with
EIO. One module per part of docs/protocol.md: session and server, text, KV objects,
pred and generate.

May import: the protocol records; predd.engine (calls, sampling, intake's `Handler`; the
`Engine` they are given, for types) and predd.server's capabilities, identity, quotas,
sessions and logits buffer.
"""
from __future__ import annotations

import symphony_protocol as p
from predd.engine.intake import Handler
from predd.server.handlers import kv, pred, session, text

HANDLERS: dict[type[p.Request], Handler] = {
    **session.HANDLERS, **text.HANDLERS, **kv.HANDLERS, **pred.HANDLERS}

assert set(HANDLERS) == set(p.REQUESTS.values()), "every request has one handler"
