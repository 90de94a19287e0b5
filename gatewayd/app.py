"""The ASGI app: FastAPI routes over the gateway's parts (gateway.py), auth, errors,
health, metrics; the /v1 routes are runs_api.py's and openai_api.py's routers.

Every route answers errors in one shape (errors.py) and counts itself in
`symphony_http_requests_total{route,method,status}` — the route template
(`/v1/runs/{run_id}`), never the raw path. Auth: with API keys, every /v1 route needs
`Authorization: Bearer KEY`; without keys the server is loopback-only and every caller
is `anonymous` (one unprivileged uid). /health and /metrics need no key.
"""
from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import liblip as lip
from gatewayd.errors import ApiError, error_body
from gatewayd.gateway import Gateway
from gatewayd.metrics import Metrics
from gatewayd.openai_api import router as openai_router
from gatewayd.runs_api import router as runs_router


class HttpMetrics:
    """Pure ASGI middleware (streams pass through untouched): counts every response by
    route template, method and status when its headers go out."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                route = scope.get("route")
                path = getattr(route, "path", None) or "unmatched"
                self.metrics.http.labels(path, scope["method"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def create_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="Symphony gateway", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.gw = gw

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        gw.metrics.errors.labels(exc.code).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        gw.metrics.errors.labels("ENOENT").inc()
        return JSONResponse(error_body(404, "ENOENT", f"no route {request.url.path}"), 404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        gw.metrics.errors.labels("EINVAL").inc()
        return JSONResponse(error_body(405, "EINVAL", f"{request.method} is not allowed on "
                                       f"{request.url.path}"), 405)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        code = exc.code if isinstance(exc, lip.LipError) else "EIO"
        gw.metrics.errors.labels(code).inc()
        gw.log(f"{request.method} {request.url.path}: {exc!r}")
        return JSONResponse(error_body(500, code, f"internal error: {exc}"), 500)

    @app.get("/health")
    async def health():
        async def predd_ok(replica=None) -> bool:
            if replica is not None and replica.local and not replica.up:
                return False
            try:
                if replica is None:
                    await asyncio.to_thread(lip.client().call, "ping", timeout=2.0)
                else:
                    await asyncio.to_thread(replica.call, "ping", 2.0)
                return True
            except lip.LipError:
                return False
        # ok: every part; degraded (still 200): some replicas down while another
        # serves, with its OpenAI program; down (503): no predd serves, the mount is
        # gone, or no OpenAI program is ready
        if gw.replicas is None:
            up = {}
        else:       # pinged at once: a hung replica costs its timeout once, not each
            answers = await asyncio.gather(*(predd_ok(r) for r in gw.replicas.all))
            up = {r.addr: ok for r, ok in zip(gw.replicas.all, answers)}
        serving = any(up.values()) if up else await predd_ok()
        parts = {"predd": all(up.values()) if up else serving,
                 "kvfs": await asyncio.to_thread(os.path.ismount, gw.mount),
                 "openai": gw.bridge.is_ready()}
        if all(parts.values()):
            status = "ok"
        elif serving and parts["kvfs"] and gw.bridge.any_ready(
                {addr for addr, ok in up.items() if ok} if up else None):
            status = "degraded"
        else:
            status = "down"
        if len(up) > 1:
            parts["replicas"] = up
        return JSONResponse({"status": status, **parts},
                            status_code=503 if status == "down" else 200)

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(gw.metrics.render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.include_router(runs_router)
    app.include_router(openai_router)
    app.add_middleware(HttpMetrics, metrics=gw.metrics)
    return app
