"""The web dashboard's server side: its static files at /ui/, live updates over SSE, the GPU
timeline and the job templates (docs/architecture.md §12).

- `/ui/` serves the built front-end (`web/` → `src/lowtide/web_dist/`, `make web`) through
  Starlette's StaticFiles; while it is not built, `/ui/` answers 503 saying so. `/` redirects to
  `/ui/`. Pages carry a Content-Security-Policy that allows only this origin's scripts.
- `GET /v1/events/stream`: Server-Sent Events (WHATWG HTML Living Standard §9.2). Every
  `STREAM_POLL_S` it reads the caller's visible jobs and the pool and sends `event: jobs`
  (the ids whose state or step counts changed) and `event: pool` when they changed, a comment as
  a heartbeat otherwise; a stream lasts at most `STREAM_MAX_S` (EventSource reconnects by itself)
  and a person may hold at most `MAX_STREAMS_PER_USER` at once (429 beyond).
- `GET /v1/pool/timeline`: the last hours of the GPU ledger in equal buckets (GPU-equivalents
  serving, research, idle), one usage report per bucket (`store.usage_report`); the idle part is
  split into parked (a replica PARKED: asleep or stopped), lent and idle (inside the lending
  envelope, unused by research) and free by `policy.timeline`, from the replicas' state events
  (`store.service_events`, at most `TIMELINE_EVENTS` per service) and the envelope's recorded
  history (`store.lending_points`; 48 h kept, so older buckets count nothing as lent).
- `GET /v1/templates`: the templates' names, parameters and a starter spec for the editor.
- `GET /v1/reports/simulations` and `/v1/reports/simulations/{name}`: the simulator's reports
  in `api.simulation_reports_dir` (read by `api.reports`), for the Reports page.
Must not: read or write anything but through the store's public methods, or show anything the
caller's token may not see (the same `api.auth` rules as every route).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from lowtide.api import reports
from lowtide.api.auth import Principal, authenticate, require_people
from lowtide.api.errors import ApiError
from lowtide.api.schemas import ErrorOut
from lowtide.control.records import StoreUnavailable
from lowtide.policy.timeline import (
    ParkedNow,
    ParkedSpan,
    ReplicaMove,
    lendable_gpus,
    parked_gpus,
    parked_spans,
    split_bucket,
)

#: Where `make web` puts the built front-end (git-ignored).
WEB_DIST = Path(__file__).resolve().parents[1] / "web_dist"
STREAM_POLL_S = 1.0
STREAM_MAX_S = 600.0
HEARTBEAT_S = 15.0
MAX_STREAMS_PER_USER = 4
#: Service events read per service for the timeline's parked share (a day of replica moves).
TIMELINE_EVENTS = 5000
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
_NOT_BUILT = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>lowtide: dashboard not built</title></head><body>
<h1>The dashboard is not built</h1><p>Run <code>make web</code> (npm ci and a Vite build of
<code>web/</code> into <code>src/lowtide/web_dist/</code>), then reload this page. The API itself
works: see <a href="/docs">/docs</a>.</p></body></html>"""


def _who(request: Request) -> Principal:
    ctx = request.app.state.ctx
    return authenticate(request, ctx.store, enabled=ctx.auth_enabled)


Who = Annotated[Principal, Depends(_who)]


class _Ui:
    """StaticFiles over the build output, or a 503 page while there is none; with a CSP."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = StaticFiles(directory=directory, html=True, check_dir=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (self.directory / "index.html").is_file():
            response: Response = HTMLResponse(_NOT_BUILT, status_code=503, headers={"Retry-After": "60"})
            await response(scope, receive, send)
            return

        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"content-security-policy", _CSP.encode()))
                headers.append((b"x-content-type-options", b"nosniff"))
                headers.append((b"referrer-policy", b"same-origin"))
                message = {**message, "headers": headers}
            await send(message)

        await self.files(scope, receive, with_headers)


class TimelineBucket(BaseModel):
    start: float
    end: float
    serving: float = Field(description="GPU-equivalents held by inference replicas")
    research: float = Field(description="GPU-equivalents held by research attempts (lent and used)")
    idle: float = Field(description="GPU-equivalents held by nobody in the ledger: parked + lent_idle + free")
    parked: float = Field(
        description="of idle: GPUs of replicas PARKED (asleep or stopped) and not lent out meanwhile"
    )
    lent_idle: float = Field(
        description="of idle, not parked: inside the lending envelope (lendable) but unused by research"
    )
    free: float = Field(
        description="of idle: neither parked nor lent (the reserve and headroom inference keeps back)"
    )


class TimelineOut(BaseModel):
    start: float
    end: float
    capacity: float
    buckets: list[TimelineBucket]


class TemplateOut(BaseModel):
    name: str
    params: dict[str, Any]
    starter: str = Field(description="a job spec that uses the template, to start editing from")


class _Streams:
    """Open SSE streams per person (bounded)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, int] = {}

    def enter(self, name: str) -> bool:
        with self._lock:
            if self._open.get(name, 0) >= MAX_STREAMS_PER_USER:
                return False
            self._open[name] = self._open.get(name, 0) + 1
            return True

    def leave(self, name: str) -> None:
        with self._lock:
            self._open[name] = self._open.get(name, 1) - 1


def _sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _parked_spans(ctx: Any, now: float) -> list[ParkedSpan]:
    """The replicas' PARKED intervals, from their records and state events (`policy.timeline`)."""
    records = ctx.store.replicas()
    inf = ctx.inference
    per_replica = {name: setup.spec.gpus_per_replica for name, setup in (inf.services.items() if inf else ())}
    gpus_of = {r.id: len(r.gpus) or per_replica.get(r.service, 0) for r in records}
    moves = [
        ReplicaMove(e.replica_id, e.at, e.kind)
        for service in sorted({r.service for r in records})
        for e in ctx.store.service_events(service, limit=TIMELINE_EVENTS)
        if e.replica_id is not None
    ]
    current = [ParkedNow(r.id, r.state, r.since) for r in records]
    return parked_spans(moves, current, gpus_of, now=now)


def install(app: FastAPI) -> None:
    """Mount the UI, the redirect and the dashboard's API routes on `app`."""
    streams = _Streams()
    r = APIRouter(prefix="/v1", tags=["dashboard"])

    @r.get(
        "/events/stream",
        summary="Server-Sent Events: which visible jobs changed, and when the pool changed",
        response_class=StreamingResponse,
        # Left out of the OpenAPI document: an endless stream is not a request/response operation
        # (OpenAPI 3.1 cannot describe SSE), and generated clients and fuzzers would hang on it.
        include_in_schema=False,
    )
    async def event_stream(
        request: Request,
        who: Who,
        max_events: Annotated[int | None, Query(ge=1, le=10000, description="end after N events")] = None,
    ) -> StreamingResponse:
        require_people(who)
        ctx = request.app.state.ctx
        if not streams.enter(who.name):
            raise ApiError(
                429,
                "too_many_requests",
                f"at most {MAX_STREAMS_PER_USER} live streams per person",
                [("path", "close another dashboard tab")],
                {"Retry-After": "5"},
            )

        def read() -> tuple[dict[str, Any], list[Any]]:
            jobs = ctx.store.list_jobs(limit=200, visible_to=who.scope)
            seen = {j.id: [j.state.value, sorted(j.step_states.items())] for j in jobs}
            pool = sorted((h.node, h.index, h.holder_kind, h.holder_id or "") for h in ctx.store.holdings())
            return seen, pool

        async def body() -> AsyncIterator[bytes]:
            sent = 0
            try:
                loop = asyncio.get_running_loop()
                began = last_beat = loop.time()
                yield b"retry: 2000\n\n"
                try:
                    jobs, pool = await run_in_threadpool(read)
                except StoreUnavailable:
                    jobs, pool = {}, []  # everything visible reads as changed once the store is back
                yield _sse("hello", {"jobs": len(jobs)})
                sent += 1
                while (max_events is None or sent < max_events) and loop.time() - began < STREAM_MAX_S:
                    await asyncio.sleep(STREAM_POLL_S)
                    if await request.is_disconnected():
                        return
                    try:
                        new_jobs, new_pool = await run_in_threadpool(read)
                    except StoreUnavailable:  # an outage (docs/architecture.md §4.4): try next second
                        continue
                    changed = [k for k, v in new_jobs.items() if jobs.get(k) != v]
                    if changed:
                        yield _sse("jobs", {"changed": changed})
                        sent += 1
                    if new_pool != pool and (max_events is None or sent < max_events):
                        yield _sse("pool", {})
                        sent += 1
                    if not changed and new_pool == pool and loop.time() - last_beat > HEARTBEAT_S:
                        last_beat = loop.time()
                        yield b": keep-alive\n\n"
                    jobs, pool = new_jobs, new_pool
            finally:
                streams.leave(who.name)

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @r.get("/pool/timeline", response_model=TimelineOut, summary="The GPU ledger of the last hours, bucketed")
    def timeline(
        request: Request,
        who: Who,
        hours: Annotated[float, Query(ge=0.1, le=24 * 7, allow_inf_nan=False)] = 24.0,
        buckets: Annotated[int, Query(ge=1, le=288)] = 48,
    ) -> TimelineOut:
        require_people(who)
        ctx = request.app.state.ctx
        end = ctx.clock.now()
        start = end - hours * 3600.0
        width = (end - start) / buckets
        spans = _parked_spans(ctx, end)
        points = ctx.store.lending_points(start, end)
        out: list[TimelineBucket] = []
        for i in range(buckets):
            lo, hi = start + i * width, start + (i + 1) * width
            totals = ctx.store.usage_report(lo, hi, group_by="day").totals
            span = hi - lo
            idle = totals.idle_gpu_seconds / span
            research = totals.research_gpu_seconds / span
            split = split_bucket(idle, parked_gpus(spans, lo, hi), lendable_gpus(points, lo, hi), research)
            out.append(
                TimelineBucket(
                    start=lo,
                    end=hi,
                    serving=round(totals.inference_gpu_seconds / span, 3),
                    research=round(research, 3),
                    idle=round(idle, 3),
                    parked=round(split.parked, 3),
                    lent_idle=round(split.lent_idle, 3),
                    free=round(split.free, 3),
                )
            )
        capacity = float(sum(n.gpu_count for n in ctx.nodes))
        return TimelineOut(start=start, end=end, capacity=capacity, buckets=out)

    @r.get("/templates", response_model=list[TemplateOut], summary="Job templates, to start a spec from")
    def templates(request: Request, who: Who) -> list[TemplateOut]:
        require_people(who)
        ctx = request.app.state.ctx
        lookup = ctx.templates
        if lookup is None:
            return []
        out: list[TemplateOut] = []
        for name in lookup.names():
            try:
                doc = lookup.load(name) or {}
            except ValueError:  # SpecInvalid: a broken template is listed without parameters
                doc = {}
            params = doc.get("params") if isinstance(doc.get("params"), dict) else {}
            starter: dict[str, Any] = {"use": name, "name": f"{name}-job", "team": who.default_team}
            if params:
                starter["params"] = dict(params)
            out.append(
                TemplateOut(
                    name=name, params=dict(params or {}), starter=yaml.safe_dump(starter, sort_keys=False)
                )
            )
        return out

    def sim_dir(request: Request) -> Path | None:
        where = request.app.state.ctx.extra.get("simulation_reports_dir")
        return Path(where) if where else None

    @r.get(
        "/reports/simulations",
        response_model=reports.SimulationListOut,
        summary="The simulator's reports (lowtide simulate --out), newest first",
    )
    def simulations(request: Request, who: Who) -> reports.SimulationListOut:
        require_people(who)
        root = sim_dir(request)
        if root is None:
            return reports.SimulationListOut(reports=[])
        return reports.simulation_reports(root)

    @r.get(
        "/reports/simulations/{name}",
        response_model=reports.SimulationDetailOut,
        responses={404: {"model": ErrorOut}, 422: {"model": ErrorOut}},
        summary="One simulator report: each policy's whole summary",
    )
    def simulation(request: Request, who: Who, name: str) -> reports.SimulationDetailOut:
        require_people(who)
        root = sim_dir(request)
        if root is None:
            raise ApiError(
                404, "not_found", "no simulation reports directory", [("path.name", "not configured")]
            )
        return reports.simulation_report(root, name)

    app.include_router(r)
    app.mount("/ui", _Ui(WEB_DIST), name="ui")

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("/ui/", status_code=307)
