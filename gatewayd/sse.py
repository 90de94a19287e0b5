"""Server-sent events as OpenAI's API writes them: `data: ...` lines ended by LF, each
event followed by an empty line (`\\n\\n`).

sse_starlette writes a `ServerSentEvent` with its own separator (CRLF unless given),
whatever the response's `sep`; clients written against OpenAI's API split events on
`\\n\\n` (vLLM's benchmark client does), so every event here is made by `event`.

A stream of `data:` events only (the OpenAI API's) is written without sse_starlette:
`data(text)` is the event's bytes and `data_response` a plain streaming response of
them, one send an event (sse_starlette's event objects, encoding and send timeout cost
as much again a token: docs/kernels.md, "The gateway's CPU a token"), and with no
keep-alive comments: OpenAI's API sends none, and clients written against it (vLLM's
benchmark client) lose the whole rest of a stream when a `: ping` comment arrives in
the same read as an event.
"""
from __future__ import annotations

from starlette.responses import StreamingResponse
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

SEP = "\n"


def event(data: str, *, kind: str | None = None, id: str | None = None) -> ServerSentEvent:
    return ServerSentEvent(data=data, event=kind, id=id, sep=SEP)


def response(events, **kwargs) -> EventSourceResponse:
    """`events` (an async iterator of `event`s) as a text/event-stream response."""
    return EventSourceResponse(events, sep=SEP, **kwargs)


HEADERS = {"Cache-Control": "no-store", "Connection": "keep-alive",
           "X-Accel-Buffering": "no"}     # what sse_starlette sends with its events


def data(text: str) -> bytes:
    """One `data:` event of `text` (one line: JSON has no raw newline)."""
    return b"data: " + text.encode() + b"\n\n"


def data_response(events) -> StreamingResponse:
    """`events` (an async iterator of `data` bytes) as a text/event-stream response."""
    return StreamingResponse(events, media_type="text/event-stream", headers=HEADERS)
