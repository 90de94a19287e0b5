"""What every route needs: the `Gateway` (one per server, on `app.state.gw`: the
gateway's parts, and the caller behind a request's `Authorization: Bearer KEY` — or
`anonymous` without API keys, app.py's rules) and the request body as JSON, read up to
MAX_BODY bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request

from gatewayd.errors import ApiError
from gatewayd.keys import ApiKeys, Caller
from gatewayd.meter import Meter
from gatewayd.metrics import Metrics
from gatewayd.openai_bridge import OpenAIBridge, OpenAIBridges
from gatewayd.programs import Programs
from gatewayd.runs import Runs

MAX_BODY = (1 << 20) + (1 << 18)   # 1 MiB of stdin, or an upload, with JSON headroom


@dataclass
class Gateway:
    """Everything a route needs; one per server."""
    mount: str
    rundir: str
    keys: ApiKeys | None
    anonymous: Caller
    programs: Programs
    runs: Runs
    bridge: OpenAIBridge | OpenAIBridges
    meter: Meter
    metrics: Metrics
    allow_uploads: bool
    log: object
    replicas: object = None      # gatewayd.replicas.Replicas; None: the process's predd

    def caller(self, request: Request) -> Caller:
        if self.keys is None:
            return self.anonymous
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        found = self.keys.lookup(key.strip()) if scheme.lower() == "bearer" and key else None
        if found is None:
            raise ApiError(401, "invalid_api_key", "a valid API key is needed: send "
                           "`Authorization: Bearer KEY`")
        return found


async def json_body(request: Request) -> dict:
    """The body as a JSON object, read up to MAX_BODY bytes (413 beyond: a huge body
    is refused before it is all in memory)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise ApiError(413, "EFBIG", f"the request body is over {MAX_BODY} bytes")
    try:
        body = json.loads(bytes(raw) or b"{}")
    except ValueError:
        raise ApiError(400, "EINVAL", "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "EINVAL", "the request body must be a JSON object")
    return body
