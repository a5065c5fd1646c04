"""The FastAPI application: routes over the store, shaped errors, OpenAPI at /docs.

Neighbours: `wiring` builds an `ApiContext` (store, clock, nodes, layout, templates) and calls
`create_app`; the control loop runs beside it and is woken through `on_change` after a submit,
cancel or retry. Job specs are read only from application/yaml, application/json (whose body schema is
`domain.spec_schema`) or application/octet-stream: never from the types a browser sends cross-site
without a CORS preflight (text/plain, forms), nor without a Content-Type (415). CORS is closed
unless `api.cors_origins` names origins. Must not: start, stop or signal processes (the loop does,
through its executor).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from lowtide import __version__
from lowtide.adapters.local_logs import LocalLogReader
from lowtide.api import dashboard, idempotency, schemas
from lowtide.api import reports as reports_api
from lowtide.api import services as services_api
from lowtide.api import session as session_api
from lowtide.api.auth import (
    Principal,
    authenticate,
    require_admin,
    require_may_submit,
    require_owner_or_admin,
    require_people,
    require_submitter,
    require_visible,
)
from lowtide.api.errors import STORE_RETRY_AFTER_S, ApiError, install_error_handlers
from lowtide.api.metrics import LoopStatus, metrics_text
from lowtide.control.clock import Clock
from lowtide.control.contract import parse_checkpoint_label
from lowtide.control.inference import InferenceController
from lowtide.control.log_port import AttemptLogRef, LogLoss, LogReader, LogUnreadable
from lowtide.control.records import (
    AttemptRecord,
    IdempotencyConflict,
    JobRecord,
    LastAdminToken,
    NewJob,
    NotFound,
    NotRetriable,
    StaleState,
    StoreUnavailable,
)
from lowtide.control.secrets_port import SecretRule, secret_issues
from lowtide.domain.gpus import Node
from lowtide.domain.ids import new_job_id
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec import JobSpec
from lowtide.domain.spec_document import MAX_SPEC_BYTES, parse_document
from lowtide.domain.spec_issues import SpecInvalid, excerpt
from lowtide.domain.spec_parse import TemplateLookup, build_job_spec, image_warnings, require_images
from lowtide.domain.spec_render import parse_param_assignment, render_step
from lowtide.domain.spec_schema import job_spec_schema
from lowtide.domain.states import JobState
from lowtide.policy.accounting import AccountingPolicy, GroupBy
from lowtide.policy.attempt_rules import ACTIVE_ATTEMPT_STATES
from lowtide.store.repo import Store

_T = TypeVar("_T")

SPEC_TYPES = {
    "application/json": "json",
    "application/yaml": "yaml",
    "application/x-yaml": "yaml",
    "text/yaml": "yaml",
    "text/x-yaml": "yaml",
    "application/octet-stream": "auto",
}
#: Types a browser may send cross-site without asking first (a CORS "simple request", no
#: preflight; WHATWG Fetch standard, "CORS-safelisted request-header": Content-Type
#: application/x-www-form-urlencoded, multipart/form-data or text/plain, or none at all): a job
#: spec is never read from them, so no web page can submit a job to a lowtide running with auth
#: off on the viewer's machine.
SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
#: Ids are positive INTEGER columns (32-bit in PostgreSQL): any other id names nothing, and is refused (422).
MAX_ID = 2**31 - 1
_SPEC_BODY = {
    "requestBody": {
        "required": True,
        "description": "A job spec (docs/architecture.md §6.1) as YAML or JSON, at most 1 MiB.",
        "content": {
            "application/yaml": {"schema": {"type": "string"}},
            "application/json": {"schema": job_spec_schema()},
        },
    }
}


@dataclass
class ApiContext:
    store: Store
    clock: Clock
    nodes: tuple[Node, ...]
    layout: ArtifactLayout
    templates: TemplateLookup | None = None
    auth_enabled: bool = True
    #: Web origins allowed to call the API from a browser (config `api.cors_origins`); none: no CORS.
    cors_origins: tuple[str, ...] = ()
    #: "docker" or "podman" when steps run in containers (every step then needs an image).
    container_runtime: str | None = None
    max_body_bytes: int = MAX_SPEC_BYTES
    on_change: Callable[[], None] = lambda: None
    loop_status: Callable[[], LoopStatus | None] = lambda: None
    inference: InferenceController | None = None
    log_poll_s: float = 0.25
    #: Price per GPU-hour, currency and time zone of usage reports (config `accounting:`).
    accounting: AccountingPolicy = field(default_factory=AccountingPolicy)
    #: Secrets jobs may name (config `secrets:`): the variable and teams of each, never a value.
    secret_rules: dict[str, SecretRule] = field(default_factory=dict)
    #: Steps a job may have (config `scheduler.max_steps_per_job`; None: no limit).
    max_steps_per_job: int | None = None
    #: Seconds the store may fail before /healthz answers 503 (config `api.store_unhealthy_after`).
    store_unhealthy_after_s: float = 30.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: Where attempt logs are read (the executor's log port); None: the local executor's files.
    logs: LogReader | None = None

    def log_reader(self) -> LogReader:
        return self.logs if self.logs is not None else LocalLogReader(self.layout)

    @property
    def max_gpus_per_node(self) -> int:
        return max((n.gpu_count for n in self.nodes), default=0)

    @property
    def max_gpu_memory_gib(self) -> float | None:
        """The largest GPU memory of the nodes, when every node's is known (bounds a step's
        `gpu_memory_gib` at submission); None otherwise."""
        sizes = [n.gpu_memory_gib for n in self.nodes]
        if not sizes or any(m is None for m in sizes):
            return None
        return max(m for m in sizes if m is not None)


def _ctx(request: Request) -> ApiContext:
    ctx: ApiContext = request.app.state.ctx
    return ctx


def _principal(request: Request) -> Principal:
    ctx = _ctx(request)
    return authenticate(request, ctx.store, enabled=ctx.auth_enabled)


async def _spec_body(request: Request) -> tuple[bytes, str]:
    """The raw spec, refused early when its type is unknown or it is larger than the limit."""
    ctx = _ctx(request)
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fmt = SPEC_TYPES.get(ctype)
    if fmt is None:
        use = "use application/yaml or application/json"
        if not ctype:
            why, msg = "a job spec needs a Content-Type", f"missing; {use}"
        elif ctype in SIMPLE_TYPES:
            why = f"a job spec is never read from '{ctype}': browsers send it cross-site without asking"
            msg = f"refused (a cross-site request type); {use}"
        else:
            why, msg = f"cannot read a job spec sent as {excerpt(ctype)}", use
        raise ApiError(415, "unsupported_media_type", why, [("header.Content-Type", msg)])
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > ctx.max_body_bytes:
        raise _too_large(int(declared), ctx.max_body_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > ctx.max_body_bytes:
            raise _too_large(size, ctx.max_body_bytes)
        chunks.append(chunk)
    return b"".join(chunks), fmt


async def _no_nul(request: Request) -> None:
    """Path and query values never hold NUL (PostgreSQL text cannot): a located 422, not a 500."""
    where = [f"path.{k}" for k, v in request.path_params.items() if "\x00" in str(v)]
    where += [f"query.{k}" for k, v in request.query_params.multi_items() if "\x00" in v]
    if where:
        raise ApiError(
            422,
            "invalid_request",
            "the request is not valid",
            [(loc, "contains a NUL character") for loc in where],
        )


Who = Annotated[Principal, Depends(_principal)]
Params = Annotated[list[str] | None, Query(description="parameter override, k=v (repeatable)")]
Body = Annotated[tuple[bytes, str], Depends(_spec_body)]
IdemKey = Annotated[str | None, Depends(idempotency.idempotency_key)]


def create_app(ctx: ApiContext) -> FastAPI:
    app = FastAPI(
        title="lowtide",
        version=__version__,
        description="Run research jobs on the GPUs your inference fleet is not using.",
        responses={
            401: {"model": schemas.ErrorOut, "description": "missing or unknown token"},
            403: {"model": schemas.ErrorOut, "description": "not allowed for this token"},
            422: {"model": schemas.ErrorOut, "description": "invalid request; `errors` names each field"},
        },
    )
    install_error_handlers(app)
    if ctx.cors_origins:  # closed by default: without it no CORS header is ever sent
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(ctx.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", idempotency.HEADER],
        )
    app.state.ctx = ctx
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_no_nul)])

    # -- jobs ----------------------------------------------------------------------------------

    def _overrides(param: list[str] | None) -> tuple[dict[str, Any], dict[str, str]]:
        """`?param=k=v` overrides and where each one's problems are reported; 422 if unreadable."""
        overrides: dict[str, Any] = {}
        locs: dict[str, str] = {}
        issues: list[tuple[str, str]] = []
        for i, text in enumerate(param or []):
            try:
                key, value = parse_param_assignment(text)
                overrides[key], locs[key] = value, f"query.param[{i}]"
            except ValueError as exc:
                issues.append((f"query.param[{i}]", str(exc)))
        if issues:
            raise ApiError(422, "invalid_spec", "invalid parameter override", issues)
        return overrides, locs

    def _parse(data: bytes, fmt: str, param: list[str] | None, who: Principal) -> JobSpec:
        overrides, locs = _overrides(param)
        try:
            doc = parse_document(data, fmt=fmt)  # type: ignore[arg-type]
            spec = build_job_spec(
                doc,
                templates=ctx.templates,
                param_overrides=overrides,
                max_gpus_per_node=ctx.max_gpus_per_node,
                max_gpu_memory_gib=ctx.max_gpu_memory_gib,
                max_steps_per_job=ctx.max_steps_per_job,
                default_team=who.default_team,
                override_locs=locs,
            )
            if ctx.container_runtime:
                require_images(spec, ctx.container_runtime)
        except SpecInvalid as exc:
            raise _spec_error(exc) from exc
        _govern(spec, who)
        return spec

    def _govern(spec: JobSpec, who: Principal) -> None:
        """The token may submit this job (team, priority), and its secrets exist and are the
        team's (docs/architecture.md §11): 403/422 located, else nothing."""
        require_may_submit(who, spec)
        issues = secret_issues(spec, ctx.secret_rules)
        if issues:
            status = 422 if any(i.status == 422 for i in issues) else 403
            code = "invalid_spec" if status == 422 else "forbidden"
            raise ApiError(
                status,
                code,
                f"the job's secrets have {len(issues)} problem(s)",
                [(i.loc, i.msg) for i in issues],
            )

    @v1.post(
        "/jobs",
        status_code=201,
        response_model=schemas.JobOut,
        responses={413: {"model": schemas.ErrorOut}, 415: {"model": schemas.ErrorOut}},
        openapi_extra=_SPEC_BODY,
        summary="Submit a job (YAML or JSON spec)",
    )
    def submit_job(
        who: Who, body: Body, response: Response, key: IdemKey, param: Params = None
    ) -> schemas.JobOut:
        require_submitter(who)
        data, fmt = body
        spec = _parse(data, fmt, param, who)
        digest = idempotency.request_digest("submit", [fmt, data, *(param or [])])
        source = data.decode("utf-8")
        job = _create(spec, source, who.name, rerun_of=None, key=key, digest=digest, response=response)
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return schemas.job_out(job).model_copy(update={"warnings": _warnings(spec)})

    def _warnings(spec: JobSpec) -> list[schemas.ErrorItem]:
        """What of `spec` this lowtide ignores (an `image` with the process runtime)."""
        found = image_warnings(spec, ctx.container_runtime or "process")
        return [schemas.ErrorItem(loc=w.loc, msg=w.msg) for w in found]

    @v1.post(
        "/jobs/validate",
        response_model=schemas.DryRunOut,
        responses={413: {"model": schemas.ErrorOut}, 415: {"model": schemas.ErrorOut}},
        openapi_extra=_SPEC_BODY,
        summary="Validate a job spec and show it expanded (templates, parameters); stores nothing",
    )
    def validate_job(who: Who, body: Body, param: Params = None) -> schemas.DryRunOut:
        require_submitter(who)
        data, fmt = body
        spec = _parse(data, fmt, param, who)
        return schemas.DryRunOut(valid=True, spec=spec.to_document(), warnings=_warnings(spec))

    def _create(
        spec: JobSpec,
        source: str,
        owner: str,
        rerun_of: str | None,
        *,
        key: str | None = None,
        digest: str | None = None,
        response: Response | None = None,
    ) -> JobRecord:
        """Store the job; with an idempotency `key`, the owner's job made by the same request
        (same `digest`) comes back instead (marked `Idempotent-Replayed` on `response`)."""
        job_id = new_job_id()
        resolved = tuple(render_step(spec, s, job_id=job_id, layout=ctx.layout) for s in spec.steps)
        try:
            job = ctx.store.create_job(
                NewJob(
                    id=job_id,
                    spec=spec,
                    resolved=resolved,
                    source_text=source,
                    owner=owner,
                    submitted_at=ctx.clock.now(),
                    rerun_of=rerun_of,
                    idempotency_key=key,
                    request_digest=digest if key is not None else None,
                )
            )
        except IdempotencyConflict as exc:
            raise idempotency.conflict(exc.key, exc.job_id) from exc
        if job.id != job_id:  # an earlier request with this key made it
            if response is not None:
                response.headers[idempotency.REPLAYED_HEADER] = "true"
            return job
        ctx.on_change()
        return job

    @v1.get("/jobs", response_model=schemas.JobListOut, summary="List jobs, newest first")
    def list_jobs(
        who: Who,
        state: Annotated[list[JobState] | None, Query()] = None,
        team: Annotated[str | None, Query(max_length=63)] = None,
        owner: Annotated[str | None, Query(max_length=128)] = None,
        name: Annotated[str | None, Query(max_length=63)] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
        before: Annotated[
            float | None, Query(description="submitted_at of the last job of the previous page")
        ] = None,
    ) -> schemas.JobListOut:
        require_people(who)
        jobs = ctx.store.list_jobs(
            states=state or (),
            team=team,
            owner=owner,
            name=name,
            limit=limit,
            before=before,
            visible_to=who.scope,
        )
        next_before = jobs[-1].submitted_at if len(jobs) == limit else None
        return schemas.JobListOut(jobs=[schemas.job_out(j) for j in jobs], next_before=next_before)

    @v1.get(
        "/jobs/{job_id}", response_model=schemas.JobDetailOut, responses={404: {"model": schemas.ErrorOut}}
    )
    def get_job(who: Who, job_id: str) -> schemas.JobDetailOut:
        require_people(who)
        detail = _found(lambda: ctx.store.job_detail(job_id))
        require_visible(who, detail.job)
        return schemas.job_detail_out(detail)

    @v1.post(
        "/jobs/{job_id}/cancel", response_model=schemas.JobOut, responses={404: {"model": schemas.ErrorOut}}
    )
    def cancel_job(who: Who, job_id: str) -> schemas.JobOut:
        job = _found(lambda: ctx.store.job(job_id))
        require_owner_or_admin(who, job, "cancel")
        if job.state in (JobState.SUCCEEDED, JobState.FAILED):
            raise ApiError(
                409, "conflict", f"job {job_id} already {job.state.value}", [("path.job_id", job.state.value)]
            )
        record = ctx.store.request_cancel(job_id, by=who.name, now=ctx.clock.now())
        ctx.on_change()
        return schemas.job_out(record)

    @v1.post(
        "/jobs/{job_id}/rerun",
        status_code=201,
        response_model=schemas.JobOut,
        responses={404: {"model": schemas.ErrorOut}},
        summary="Submit a new job from a job's recorded spec and parameters (?param=k=v changes some)",
    )
    def rerun_job(
        who: Who, job_id: str, response: Response, key: IdemKey, param: Params = None
    ) -> schemas.JobOut:
        require_people(who)
        job = _found(lambda: ctx.store.job(job_id))
        require_visible(who, job)
        require_submitter(who)
        overrides, locs = _overrides(param)
        try:
            spec = build_job_spec(
                dict(job.spec),
                max_gpus_per_node=ctx.max_gpus_per_node,
                max_gpu_memory_gib=ctx.max_gpu_memory_gib,
                max_steps_per_job=ctx.max_steps_per_job,
                param_overrides=overrides,
                override_locs=locs,
            )
        except SpecInvalid as exc:  # the pool shrank since, or a bad ?param=: say so, located
            raise _spec_error(exc) from exc
        _govern(spec, who)  # the rerun is the caller's job: their token must allow it
        digest = idempotency.request_digest("rerun", [job_id, *(param or [])])
        new_job = _create(
            spec, job.source_text, who.name, rerun_of=job_id, key=key, digest=digest, response=response
        )
        response.headers["Location"] = f"/v1/jobs/{new_job.id}"
        return schemas.job_out(new_job)

    @v1.post(
        "/jobs/{job_id}/retry",
        response_model=schemas.RetryOut,
        responses={404: {"model": schemas.ErrorOut}, 409: {"model": schemas.ErrorOut}},
        summary="Retry a FAILED or CANCELLED job in place from its failed steps (succeeded steps kept)",
    )
    def retry_job(who: Who, job_id: str) -> schemas.RetryOut:
        job = _found(lambda: ctx.store.job(job_id))
        require_owner_or_admin(who, job, "retry")
        try:
            record = _found(lambda: ctx.store.retry_job(job_id, by=who.name, now=ctx.clock.now()))
        except NotRetriable as exc:
            raise ApiError(409, "conflict", str(exc), [("path.job_id", exc.reason)]) from exc
        except StaleState as exc:  # another writer moved the job first (a racing retry or cancel)
            now = ctx.store.job(job_id).state.value
            raise ApiError(
                409, "conflict", f"job {job_id} is {now}: it moved meanwhile", [("path.job_id", now)]
            ) from exc
        ctx.on_change()
        return schemas.RetryOut(
            job=schemas.job_out(record.job),
            queued=list(record.queued),
            waiting=list(record.waiting),
            kept=list(record.kept),
        )

    @v1.get(
        "/jobs/{job_id}/steps/{step}/logs",
        response_class=PlainTextResponse,
        responses={
            404: {"model": schemas.ErrorOut},
            410: {"model": schemas.ErrorOut},
            503: {"model": schemas.ErrorOut},
            200: {"content": {"text/plain": {}}},
        },
        summary="A step attempt's output (the latest attempt unless ?attempt=N); ?follow=true streams",
    )
    def step_logs(
        who: Who,
        job_id: str,
        step: str,
        attempt: Annotated[int | None, Query(ge=1)] = None,
        follow: bool = False,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> Response:
        require_people(who)
        require_visible(who, _found(lambda: ctx.store.job(job_id)))
        attempts = _found(lambda: ctx.store.step_attempts(job_id, step))
        if not attempts:
            raise ApiError(
                404,
                "not_found",
                f"step '{step}' of job '{job_id}' has not started yet",
                [("path.step", "no attempts yet")],
            )
        chosen = attempts[-1] if attempt is None else next((a for a in attempts if a.number == attempt), None)
        if chosen is None:
            raise ApiError(
                404,
                "not_found",
                f"step '{step}' has no attempt {attempt}",
                [("query.attempt", f"attempts: 1..{attempts[-1].number}")],
            )
        ref = AttemptLogRef(job_id, step, chosen.number, chosen.handle)
        logs = ctx.log_reader()
        first = _read_log(logs, ref, offset)
        if not first and (why := _log_lost(logs, ref)) is not None:
            # A cluster log lives as long as its pod (control.log_port): say so, not "".
            raise ApiError(410, "gone", why, [("path.step", "log deleted with its pod")])
        if not follow:
            return PlainTextResponse(_read_from(logs, ref, offset, first))
        return StreamingResponse(
            _follow(ref, offset, first, chosen.id), media_type="text/plain; charset=utf-8"
        )

    def _follow(ref: AttemptLogRef, offset: int, first: bytes, attempt_id: int) -> Iterator[bytes]:
        logs = ctx.log_reader()
        pos = offset + len(first)
        if first:
            yield first
        try:
            while True:
                chunk = _read_log(logs, ref, pos)
                if chunk:
                    pos += len(chunk)
                    yield chunk
                    continue
                state = ctx.store.attempt(attempt_id).state
                if state not in ACTIVE_ATTEMPT_STATES:
                    tail = _read_log(logs, ref, pos)
                    if tail:
                        yield tail
                    elif (why := _log_lost(logs, ref)) is not None:
                        yield f"\n[lowtide] {why}\n".encode()  # the pod went while it was followed
                    return
                time.sleep(ctx.log_poll_s)
        except ApiError as exc:  # the answer has begun: the reason is the stream's last line
            yield f"\n[lowtide] {exc.message}\n".encode()

    def own_running_attempt(who: Principal, job_id: str, step: str, people_refused: str) -> AttemptRecord:
        """The step's running attempt, asked for by its own step token or an admin: 403 for
        another attempt's token or a person (`people_refused` says why), 409 when none runs."""
        attempts = _found(lambda: ctx.store.step_attempts(job_id, step))
        running = [a for a in attempts if a.state in ACTIVE_ATTEMPT_STATES]
        if who.role == "step":
            if not running or running[-1].id != who.attempt_id:
                raise ApiError(
                    403,
                    "forbidden",
                    "this step token belongs to another attempt",
                    [("header.Authorization", "token of another attempt")],
                )
        elif not who.is_admin:
            raise ApiError(403, "forbidden", people_refused, [("header.Authorization", "role")])
        if not running:
            raise ApiError(
                409, "conflict", f"step '{step}' has no running attempt", [("path.step", "not running")]
            )
        return running[-1]

    @v1.post(
        "/jobs/{job_id}/steps/{step}/checkpoints",
        status_code=201,
        response_model=schemas.CheckpointOut,
        responses={404: {"model": schemas.ErrorOut}, 409: {"model": schemas.ErrorOut}},
        summary="A running step reports a checkpoint (its LOWTIDE_STEP_TOKEN, or an admin)",
    )
    def report_checkpoint(
        who: Who, job_id: str, step: str, body: schemas.CheckpointIn
    ) -> schemas.CheckpointOut:
        current = own_running_attempt(
            who, job_id, step, "checkpoints are reported by the step itself (LOWTIDE_STEP_TOKEN)"
        )
        try:  # the same rule as LATEST (docs/architecture.md §6.2)
            label = parse_checkpoint_label(body.label, checkpoint_dir=current.record.get("checkpoint_dir"))
        except ValueError as exc:
            problem = [("body.label", str(exc))]
            raise ApiError(422, "invalid_request", "the request is not valid", problem) from exc
        now = ctx.clock.now()
        ctx.store.record_checkpoint(current.id, label=label, progress=body.progress, source="api", now=now)
        return schemas.CheckpointOut(
            attempt_id=current.id,
            step=step,
            label=label,
            progress=body.progress,
            source="api",
            reported_at=now,
        )

    @v1.get(
        "/jobs/{job_id}/steps/{step}/notice",
        response_model=schemas.NoticeOut,
        responses={
            403: {"model": schemas.ErrorOut},
            404: {"model": schemas.ErrorOut},
            409: {"model": schemas.ErrorOut},
        },
        summary="A running step asks for its notice's deadline (its LOWTIDE_STEP_TOKEN, or an admin)",
    )
    def step_notice(who: Who, job_id: str, step: str) -> schemas.NoticeOut:
        """Cluster mode's shim asks this on SIGTERM: Kubernetes does not tell a container the
        grace of the delete that stopped it (docs/cluster.md "The step shim in the image")."""
        current = own_running_attempt(
            who, job_id, step, "a notice is read by the step itself (LOWTIDE_STEP_TOKEN)"
        )
        deadline = current.stop_deadline
        if deadline is None:
            return schemas.NoticeOut(attempt_id=current.id, noticed=False, seconds_left=None, reason=None)
        left = max(0.0, deadline - ctx.clock.now())
        return schemas.NoticeOut(
            attempt_id=current.id, noticed=True, seconds_left=left, reason=current.stop_reason
        )

    # -- inference services --------------------------------------------------------------------

    @v1.get("/services", response_model=services_api.ServicesOut, summary="Inference services and lending")
    def list_services(who: Who) -> services_api.ServicesOut:
        require_people(who)
        inf = ctx.inference
        if inf is None:
            return services_api.ServicesOut(services=[], lending=None)
        replicas = ctx.store.replicas()
        env = inf.last.envelope if inf.last else None
        return services_api.ServicesOut(
            services=[
                services_api.ServiceOut(**services_api.service_out(inf, n, replicas)) for n in inf.services
            ],
            lending=services_api.lending_out(inf.lending.mode, env),
        )

    @v1.get(
        "/services/{name}",
        response_model=services_api.ServiceDetailOut,
        responses={404: {"model": schemas.ErrorOut}},
        summary="One service: replicas, load, the last scaling decision and its event log",
    )
    def get_service(who: Who, name: str) -> services_api.ServiceDetailOut:
        require_people(who)
        inf = ctx.inference
        if inf is None or name not in inf.services:
            raise ApiError(
                404, "not_found", f"service '{name}' not found", [("path.name", "unknown service")]
            )
        body = services_api.service_out(inf, name, ctx.store.replicas(name))
        events = [services_api.event_out(e) for e in ctx.store.service_events(name, limit=200)]
        return services_api.ServiceDetailOut(**body, events=events)

    @v1.get(
        "/reclaims",
        response_model=list[services_api.ReclaimOut],
        summary="GPUs taken back from research, phase by phase (newest last)",
    )
    def list_reclaims(
        who: Who,
        state: Annotated[str | None, Query(pattern="^(OPEN|DONE|ABANDONED)$")] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 200,
    ) -> list[services_api.ReclaimOut]:
        require_people(who)
        return [services_api.reclaim_out(r) for r in ctx.store.reclaims(state=state, limit=limit)]

    # -- reports (accounting; api/reports.py) ---------------------------------------------------

    @v1.get(
        "/reports/usage",
        response_model=reports_api.UsageReportOut,
        summary="GPU-hours per holder, job, team or day; work lost to preemption; savings",
    )
    def usage_report(
        who: Who,
        start: Annotated[str | None, Query(max_length=64, description=reports_api.TIME_HELP)] = None,
        end: Annotated[str | None, Query(max_length=64, description=reports_api.TIME_HELP)] = None,
        group_by: Annotated[GroupBy, Query()] = "job",
        tz: Annotated[str | None, Query(max_length=64, description="IANA time zone of days")] = None,
    ) -> reports_api.UsageReportOut:
        require_people(who)
        return reports_api.usage_report(
            ctx.store,
            ctx.accounting,
            now=ctx.clock.now(),
            start=start,
            end=end,
            group_by=group_by,
            tz=tz,
            visible_team=who.sees_team,
        )

    @v1.get(
        "/reports/monthly",
        response_model=reports_api.MonthlyReportOut,
        summary="A month of research on lent GPUs against the month before, in total and per team",
    )
    def monthly_report(
        who: Who,
        month: Annotated[str, Query(max_length=16, description="YYYY-MM")],
        tz: Annotated[
            str | None, Query(max_length=64, description="IANA time zone of the month's midnights")
        ] = None,
        price: Annotated[
            float | None,
            Query(
                ge=0,
                le=reports_api.MAX_PRICE,
                allow_inf_nan=False,
                description="price per GPU-hour (default: configured)",
            ),
        ] = None,
        currency: Annotated[
            str | None,
            Query(pattern=reports_api.CURRENCY_PATTERN, description="ISO 4217 code (default: configured)"),
        ] = None,
    ) -> reports_api.MonthlyReportOut:
        require_people(who)
        return reports_api.monthly_report(
            ctx.store,
            ctx.accounting,
            now=ctx.clock.now(),
            month=month,
            tz=tz,
            price=price,
            currency=currency,
            visible_team=who.sees_team,
        )

    # -- end of reports ------------------------------------------------------------------------

    # -- pool, tokens, identity ----------------------------------------------------------------

    @v1.get("/pool", response_model=schemas.PoolOut, summary="Every GPU and who holds it")
    def pool(who: Who) -> schemas.PoolOut:
        require_people(who)
        return schemas.pool_out(ctx.nodes, ctx.store.holdings(), visible_team=who.sees_team)

    @v1.get("/whoami", response_model=schemas.WhoAmIOut)
    def whoami(who: Who) -> schemas.WhoAmIOut:
        return schemas.WhoAmIOut(
            name=who.name, role=who.role, teams=list(who.teams), max_priority=who.max_priority
        )

    @v1.get("/tokens", response_model=list[schemas.TokenOut])
    def list_tokens(who: Who) -> list[schemas.TokenOut]:
        require_admin(who)
        return [schemas.token_out(t) for t in ctx.store.list_tokens()]

    @v1.post("/tokens", status_code=201, response_model=schemas.TokenOut)
    def create_token(who: Who, body: schemas.TokenIn) -> schemas.TokenOut:
        require_admin(who)
        record, raw = ctx.store.create_token(
            name=body.name,
            owner=body.owner or body.name,
            role=body.role,
            now=ctx.clock.now(),
            teams=body.teams,
            max_priority=body.max_priority,
        )
        return schemas.token_out(record, raw)

    @v1.delete(
        "/tokens/{token_id}",
        status_code=204,
        responses={404: {"model": schemas.ErrorOut}, 409: {"model": schemas.ErrorOut}},
        summary="Revoke a token (never the last active admin token: 409)",
    )
    def revoke_token(who: Who, token_id: Annotated[int, PathParam(ge=1, le=MAX_ID)]) -> Response:
        require_admin(who)
        try:
            _found(lambda: ctx.store.revoke_token(token_id, ctx.clock.now()))
        except LastAdminToken as exc:  # nobody could mint another: docs/architecture.md §11
            raise ApiError(
                409, "conflict", str(exc), [("path.token_id", "the last active admin token")]
            ) from exc
        return Response(status_code=204)

    app.include_router(v1)
    app.include_router(session_api.router())  # the dashboard: browser sessions, /ui/, SSE
    dashboard.install(app)

    # -- unauthenticated -----------------------------------------------------------------------

    @app.get(
        "/healthz",
        summary="Liveness of the API, the store and the control loop",
        responses={503: {"description": "the store has failed for longer than api.store_unhealthy_after"}},
    )
    def healthz() -> JSONResponse:
        """200 while the store works or has failed for less than the bound; 503 with the reason
        and since when after that (docs/architecture.md §4.4). Infrastructure alerts (launches
        failing because of lowtide's storage, runtime, secrets or store) are listed, not fatal."""
        status = ctx.loop_status()
        now = ctx.clock.now()
        with contextlib.suppress(StoreUnavailable):  # recorded in `store.health`
            ctx.store.counts()
        loop = None
        if status is not None:
            loop = {
                "last_tick_at": status.last_tick_at,
                "age_s": (now - status.last_tick_at) if status.last_tick_at else None,
            }
        health = ctx.store.health
        outage = health.outage()
        store: dict[str, Any] = {"ok": outage is None}
        if outage is not None:
            store.update(
                failing_since=outage.since_wall,
                failing_for_s=round(outage.age(health.clock.now()), 3),
                failing=outage.access,
                reason=outage.reason,
            )
        alerts = [
            {"kind": kind, "message": message}
            for kind, message in (status.infrastructure_alerts if status is not None else {}).items()
        ]
        unhealthy = health.unhealthy(ctx.store_unhealthy_after_s)
        body: dict[str, Any] = {
            "status": "ok" if unhealthy is None else "unhealthy",
            "version": __version__,
            "loop": loop,
            "store": store,
            "alerts": alerts,
            # leader or standby (a standby is healthy: it serves the API and waits for the lease)
            "control": dict(status.control) if status is not None and status.control is not None else None,
        }
        if unhealthy is not None:
            body["reason"] = (
                f"the store has failed {unhealthy.access}s for {unhealthy.age(health.clock.now()):.0f}s "
                f"(more than {ctx.store_unhealthy_after_s:g}s): {unhealthy.reason}"
            )
            return JSONResponse(body, status_code=503, headers={"Retry-After": str(STORE_RETRY_AFTER_S)})
        return JSONResponse(body)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (lowtide_*)")
    def metrics() -> Response:
        body, content_type = metrics_text(ctx.store, ctx.nodes, ctx.loop_status(), ctx.inference)
        return Response(content=body, media_type=content_type)

    return app


# -- helpers ---------------------------------------------------------------------------------


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        "too_large",
        f"the spec is {size} bytes; the limit is {limit} bytes",
        [("body", f"larger than {limit} bytes")],
    )


def _spec_error(exc: SpecInvalid) -> ApiError:
    return ApiError(
        422,
        "invalid_spec",
        f"the job spec has {len(exc.issues)} problem(s)",
        [(i.loc, i.msg) for i in exc.issues],
    )


def _found(fn: Callable[[], _T]) -> _T:
    try:
        return fn()
    except NotFound as exc:
        raise ApiError(404, "not_found", str(exc)) from exc


def _read_log(logs: LogReader, ref: AttemptLogRef, offset: int) -> bytes:
    """`logs.read`, a reader's `LogUnreadable` (e.g. a missing RBAC rule) as a 503 naming it."""
    try:
        return logs.read(ref, offset)
    except LogUnreadable as exc:
        raise ApiError(503, "log_unreadable", str(exc)) from exc


def _log_lost(logs: LogReader, ref: AttemptLogRef) -> str | None:
    """Why the log is gone for good, for a reader that can tell (`LogLoss`); else None."""
    if not isinstance(logs, LogLoss):
        return None
    try:
        return logs.lost(ref)
    except LogUnreadable as exc:
        raise ApiError(503, "log_unreadable", str(exc)) from exc


def _read_from(logs: LogReader, ref: AttemptLogRef, offset: int, first: bytes) -> str:
    """The log from `offset`, whose first read gave `first` (empty: that is all there is now)."""
    chunks = [first]
    pos = offset + len(first)
    while first and (chunk := _read_log(logs, ref, pos)):
        chunks.append(chunk)
        pos += len(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")
