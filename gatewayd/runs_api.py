"""Programs over HTTP (the paper's remote LIPs).

    GET    /v1/programs                       installed programs
    POST   /v1/programs/{name}/runs           start one: {args, stdin, env, interactive, detach,
                                              near}
    POST   /v1/runs                           start an uploaded one: {filename, source, ...}
    GET    /v1/runs                           the caller's runs
    GET    /v1/runs/{id}                      state, exit status, cost
    GET    /v1/runs/{id}/events               its events (SSE), from the start or Last-Event-ID
    POST   /v1/runs/{id}/input                {"data": "a line"} and/or {"eof": true}
    DELETE /v1/runs/{id}                      kill it; returns once its KV objects are freed

A started run streams back as SSE (`run`, `stdout`, `stderr`, `exit` events; each event's
id is its sequence number) unless `detach` is true, when the answer is 201 with the
run's state. A non-detached run is killed when the client that started it goes away.
"""
from __future__ import annotations

import asyncio
import os
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from gatewayd import sse
from gatewayd.errors import ApiError
from gatewayd.gateway import Gateway, json_body
from gatewayd.programs import Program, save_upload
from gatewayd.runs import Run

router = APIRouter()
START_FIELDS = {"args", "stdin", "env", "interactive", "detach", "near"}
UPLOAD_FIELDS = START_FIELDS | {"filename", "source"}


def _gw(request: Request) -> Gateway:
    return request.app.state.gw


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(400, "EINVAL", f"{name} must be true or false", name)
    return value


def _stream(gw: Gateway, run: Run, after: int = 0, owner: bool = False) -> EventSourceResponse:
    async def events():
        try:
            async for e in run.follow(after):
                yield sse.event(e.data, kind=e.kind, id=str(e.seq))
        finally:
            if owner and not run.detached and run.active:
                asyncio.create_task(gw.runs.kill(run, "client disconnected", wait=False))
    return sse.response(events(), headers={"X-Symphony-Run": run.id})


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, "EINVAL", f"unknown field {unknown[0]!r} (known: "
                       f"{', '.join(sorted(allowed))})", unknown[0])


async def _start(request: Request, program: Program, body: dict,
                 upload_dir: str | None = None, run_id: str | None = None):
    gw = _gw(request)
    caller = gw.caller(request)
    run = await gw.runs.start(program, caller, args=body.get("args", []),
                              stdin=body.get("stdin", ""), env=body.get("env") or {},
                              detached=_flag(body, "detach"),
                              interactive=_flag(body, "interactive"),
                              upload_dir=upload_dir, run_id=run_id, near=body.get("near"))
    if run.detached:
        return JSONResponse(run.public(gw.meter), status_code=201,
                            headers={"X-Symphony-Run": run.id})
    return _stream(gw, run, owner=True)


@router.get("/v1/programs")
async def list_programs(request: Request):
    gw = _gw(request)
    gw.caller(request)
    programs = await asyncio.to_thread(gw.programs.all)
    return {"object": "list", "data": [
        {"name": p.name, "kind": p.kind, "description": p.description}
        for p in programs.values()]}


@router.post("/v1/programs/{name}/runs")
async def run_program(name: str, request: Request):
    gw = _gw(request)
    gw.caller(request)
    body = await json_body(request)
    _check_fields(body, START_FIELDS)
    program = gw.programs.get(name)
    return await _start(request, program, body)


@router.post("/v1/runs")
async def run_upload(request: Request):
    gw = _gw(request)
    caller = gw.caller(request)
    if not gw.allow_uploads:
        raise ApiError(403, "EPERM", "uploaded programs are off on this server "
                       "(symphony serve --allow-uploads)")
    body = await json_body(request)
    _check_fields(body, UPLOAD_FIELDS)
    filename, source = body.get("filename"), body.get("source")
    if not isinstance(source, str):
        raise ApiError(400, "EINVAL", "source (the program's text) is required", "source")
    _flag(body, "detach"), _flag(body, "interactive")   # refuse before writing anything
    run_id = "run_" + secrets.token_hex(8)
    folder = os.path.join(gw.rundir, "uploads", run_id)
    owner = caller.uid if gw.runs.launcher.takes_uid else None
    program = await asyncio.to_thread(save_upload, folder, filename or "", source, owner)
    return await _start(request, program, body, upload_dir=folder, run_id=run_id)


@router.get("/v1/runs")
async def list_runs(request: Request):
    gw = _gw(request)
    caller = gw.caller(request)
    return {"object": "list", "data": [r.public(gw.meter) for r in gw.runs.of(caller)]}


@router.get("/v1/runs/{run_id}")
async def get_run(run_id: str, request: Request):
    gw = _gw(request)
    return gw.runs.get(run_id, gw.caller(request)).public(gw.meter)


@router.get("/v1/runs/{run_id}/events")
async def run_events(run_id: str, request: Request):
    gw = _gw(request)
    run = gw.runs.get(run_id, gw.caller(request))
    after = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not after.isdigit():
        raise ApiError(400, "EINVAL", "Last-Event-ID / after is an event number", "after")
    return _stream(gw, run, int(after))


@router.post("/v1/runs/{run_id}/input")
async def run_input(run_id: str, request: Request):
    gw = _gw(request)
    run = gw.runs.get(run_id, gw.caller(request))
    body = await json_body(request)
    data = body.get("data")
    if data is not None and (not isinstance(data, str) or len(data) > 1 << 20):
        raise ApiError(400, "EINVAL", "data is a string (a line; a newline is added)", "data")
    eof = _flag(body, "eof")
    if data is None and not eof:
        raise ApiError(400, "EINVAL", "send data, eof, or both", "data")
    await gw.runs.write_input(run, data, eof)
    return {"id": run.id, "written": len(data or ""), "eof": eof}


@router.delete("/v1/runs/{run_id}")
async def delete_run(run_id: str, request: Request):
    gw = _gw(request)
    run = gw.runs.get(run_id, gw.caller(request))
    await gw.runs.kill(run, "killed by DELETE")
    return run.public(gw.meter)
