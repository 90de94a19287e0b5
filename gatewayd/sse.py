"""Server-sent events as OpenAI's API writes them: `data: ...` lines ended by LF, each
event followed by an empty line (`\\n\\n`).

sse_starlette writes a `ServerSentEvent` with its own separator (CRLF unless given),
whatever the response's `sep`; clients written against OpenAI's API split events on
`\\n\\n` (vLLM's benchmark client does), so every event here is made by `event`.
"""
from __future__ import annotations

from sse_starlette.sse import EventSourceResponse, ServerSentEvent

SEP = "\n"


def event(data: str, *, kind: str | None = None, id: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(data=data, event=kind, id=id, sep=SEP)


def response(events, **kwargs) -> EventSourceResponse:
    """`events` (an async iterator of `event`s) as a text/event-stream response."""
    return EventSourceResponse(events, sep=SEP, **kwargs)
