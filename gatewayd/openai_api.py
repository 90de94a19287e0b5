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

from gatewayd import sse
from gatewayd.errors import ApiError
from gatewayd.gateway import Gateway, json_body

_encode = json.JSONEncoder(separators=(",", ":")).encode
router = APIRouter()
_keys = itertools.count(1)


class _Replies:
    """The LIP's reply lines for one request, read while watching the client: `next()`
    is None once the client has gone. `close()` cancels the request in the LIP if it
    has not finished."""

    def __init__(self, lines, request: Request) -> None:
        self.lines = lines
        self.step: asyncio.Future | None = None
        self.watcher = asyncio.create_task(self._until_disconnected(request))

    @staticmethod
    async def _until_disconnected(request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    async def next(self) -> dict | None:
        self.step = asyncio.ensure_future(self.lines.__anext__())
        done, _ = await asyncio.wait({self.step, self.watcher},
                                     return_when=asyncio.FIRST_COMPLETED)
        if self.step not in done:
            return None
        step, self.step = self.step, None
        return step.result()

    async def rest(self):
        """The lines after the first, as they come (a stream: the client's going away
        reaches it as the response's cancellation, not through the watcher)."""
        self.watcher.cancel()
        async for msg in self.lines:
            yield msg

    async def close(self) -> None:
        self.watcher.cancel()
        if self.step is not None:
            self.step.cancel()
            with contextlib.suppress(BaseException):
                await self.step
        await self.lines.aclose()


async def _answer(request: Request, op: str, body) -> Response:
    gw: Gateway = request.app.state.gw
    caller = gw.caller(request)
    started = time.monotonic()
    key = f"openai:{next(_keys)}"
    gw.meter.begin_request(key)
    replies = _Replies(gw.bridge.request(op, body, scope=caller.name), request)
    last: dict | None = None

    async def finish() -> None:
        await replies.close()
        gw.meter.end_request(key)
        if last and last.get("usage"):
            gw.metrics.openai_done(last["usage"], last.get("cost") or {},
                                   time.monotonic() - started)

    try:
        first = await replies.next()
        if first is None:                   # the client left before the answer began
            await finish()
            return Response(status_code=499)
        if not first.get("stream"):
            while (msg := await replies.next()) is not None:   # up to `done`
                last = msg
                if msg.get("done"):
                    break
            await finish()
            status = first.get("status", 500)
            if status >= 400:
                code = ((first.get("body") or {}).get("error") or {}).get("code") or "EIO"
                gw.metrics.errors.labels(str(code)).inc()
            return JSONResponse(first.get("body"), status_code=status)
    except BaseException:
        await finish()
        raise

    async def chunks():
        nonlocal last
        try:
            async for msg in replies.rest():
                if msg.get("done"):
                    last = msg
                    yield sse.data("[DONE]")
                    return
                if "chunk" in msg:
                    yield sse.data(_encode(msg["chunk"]))
                elif msg.get("status", 200) >= 400:      # failed after it started
                    yield sse.data(json.dumps(msg.get("body")))
        finally:
            await finish()

    return sse.data_response(chunks())


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
