"""The OpenAI API routes: HTTP in front of the OpenAI LIP (openai_bridge.py).

    GET  /v1/models
    POST /v1/chat/completions
    POST /v1/completions

The LIP checks and answers every request; this module only turns its reply lines into
HTTP: a status and JSON body, or (stream: true) SSE `data:` chunks ending with
`data: [DONE]`. A client that goes away cancels its request in the LIP (which frees its
caches, ending its predd calls).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from gatewayd.app import Gateway, json_body
from gatewayd.errors import ApiError

router = APIRouter()
_keys = itertools.count(1)


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


async def _answer(request: Request, op: str, body) -> Response:
    gw: Gateway = request.app.state.gw
    caller = gw.caller(request)
    started = time.monotonic()
    key = f"openai:{next(_keys)}"
    gw.meter.begin_request(key)
    replies = gw.bridge.request(op, body, scope=caller.name)
    watcher = asyncio.create_task(_until_disconnected(request))

    async def next_reply() -> dict | None:
        """The next line, or None once the client has gone (which cancels it)."""
        step = asyncio.ensure_future(replies.__anext__())
        done, _ = await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if step in done:
            return step.result()
        step.cancel()
        with contextlib.suppress(BaseException):
            await step
        return None

    def finish(msg: dict | None) -> None:
        gw.meter.end_request(key)
        if msg and msg.get("usage"):
            gw.metrics.openai_done(msg["usage"], msg.get("cost") or {},
                                   time.monotonic() - started)

    try:
        first = await next_reply()
    except BaseException:
        watcher.cancel()
        finish(None)
        await replies.aclose()
        raise
    if first is None:
        watcher.cancel()
        finish(None)
        await replies.aclose()
        return Response(status_code=499)
    if not first.get("stream"):
        watcher.cancel()
        last = None
        async for msg in replies:       # the `done` line, with usage and cost
            last = msg
        finish(last)
        status = first.get("status", 500)
        if status >= 400:
            code = ((first.get("body") or {}).get("error") or {}).get("code") or "EIO"
            gw.metrics.errors.labels(str(code)).inc()
        return JSONResponse(first.get("body"), status_code=status)

    async def chunks():
        last = None
        try:
            while True:
                msg = await next_reply()
                if msg is None:
                    return
                if msg.get("done"):
                    last = msg
                    break
                if "chunk" in msg:
                    yield ServerSentEvent(data=json.dumps(msg["chunk"], separators=(",", ":")))
                elif msg.get("status", 200) >= 400:      # failed after it started
                    yield ServerSentEvent(data=json.dumps(msg.get("body")))
            yield ServerSentEvent(data="[DONE]")
        finally:
            watcher.cancel()
            finish(last)
            await replies.aclose()

    return EventSourceResponse(chunks(), sep="\n")


@router.get("/v1/models")
async def models(request: Request):
    return await _answer(request, "models", None)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    request.app.state.gw.caller(request)
    return await _answer(request, "chat", await json_body(request))


@router.post("/v1/completions")
async def completions(request: Request):
    request.app.state.gw.caller(request)
    return await _answer(request, "completion", await json_body(request))


__all__ = ["router", "ApiError"]
