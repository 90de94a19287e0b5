"""predd's request handlers, keyed by request record: `HANDLERS[type(request)]`.

A handler is `handler(engine, session, request, extra, now)`: the engine (its declared
parts: store, caps, quotas, sessions, scheduler, limits, runner, tokenizer, counters),
the caller's session, the validated request, its binary frames and the time. It returns
the reply record, or None for a call it queued (pred, generate: the step replies). It
raises ProtocolError for its caller alone; the engine answers any other exception with
EIO. One module per part of docs/protocol.md: session and server, text, KV objects,
pred and generate.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import symphony_protocol as p
from predd.server.handlers import kv, pred, session, text

if TYPE_CHECKING:
    from predd.engine.core import Engine
    from predd.server.sessions import Session

Handler = Callable[["Engine", "Session", p.Request, list[bytes], float], p.Reply | None]

HANDLERS: dict[type[p.Request], Handler] = {
    **session.HANDLERS, **text.HANDLERS, **kv.HANDLERS, **pred.HANDLERS}

assert set(HANDLERS) == set(p.REQUESTS.values()), "every request has one handler"
