"""The inference side of the REST API: services, their replicas and load, and the lending envelope.

`GET /v1/services` and `GET /v1/services/{name}` read the replica rows from the store and the
latest decisions from the control loop's `InferenceController` (embedded mode: same process).
Must not: start, park or scale anything (the loop does).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from lowtide.control.inference import InferenceController, ServiceStatus
from lowtide.control.records import ReclaimRecord, ReplicaRecord, ServiceEventRecord
from lowtide.domain.metrics import ReplicaSignals
from lowtide.policy.lending import Envelope


class ReplicaOut(BaseModel):
    id: str
    slot: int
    state: str
    node: str | None
    gpus: list[int]
    port: int
    parked_as: str | None
    since: float
    failures: int
    retry_at: float
    message: str


class SignalsOut(BaseModel):
    replica: str
    running: float | None
    waiting: float | None
    kv_usage: float | None
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    ttft_p90_s: float | None
    e2e_p90_s: float | None
    waiting_capacity: float | None = Field(
        default=None,
        description="waiting for KV cache or a batch slot (vllm:num_requests_waiting_by_reason; newer vLLM)",
    )
    waiting_deferred: float | None = Field(
        default=None, description="waiting deferred by LoRA budget, KV transfer, ..."
    )
    preemptions_per_s: float | None = Field(
        default=None, description="vllm:num_preemptions_total, rate over the window"
    )
    kv_pressure: bool | None = Field(
        default=None, description="preempting while requests wait: the KV cache is short"
    )
    sleep_state: str | None = Field(
        default=None,
        description="vllm:engine_sleep_state: awake | weights_offloaded | discard_all | asleep | mixed",
    )
    stale: bool
    stale_reason: str


class LoadSampleOut(BaseModel):
    at: float
    running: float = Field(description="requests running on the fresh replicas")
    waiting: float = Field(description="requests waiting on the fresh replicas")
    desired: int | None = Field(description="replicas the autoscaler wanted then")


class ServiceOut(BaseModel):
    name: str
    model: str
    gpus_per_replica: int
    min_replicas: int
    max_replicas: int
    park: str
    desired: int | None = Field(description="replicas the autoscaler wants (needed + headroom)")
    needed: int | None
    target: int = Field(description="desired, raised to what the lending fail safe claims")
    recommendation: int | None
    per_signal: dict[str, int | None]
    reason: str
    guard: str | None
    unknown: bool
    blocked: str = Field(description="why wanted replicas could not start this tick")
    alert: str = Field(description="something an operator must look at; empty when all is well")
    fresh_at: float | None
    source_error: str | None
    signals: list[SignalsOut]
    replicas: list[ReplicaOut]
    load_history: list[LoadSampleOut] = Field(
        default_factory=list,
        description="the last hour of load, a sample every 5 s at most (in memory since lowtide started)",
    )


class LendingOut(BaseModel):
    mode: str
    lendable_gpus: int
    inference_claim_gpus: int
    reserve_gpus: int
    lending_open: bool
    return_by: float | None
    fail_safe: str | None
    reasons: list[str]


class ServicesOut(BaseModel):
    services: list[ServiceOut]
    lending: LendingOut | None


class ServiceEventOut(BaseModel):
    at: float
    replica_id: str | None
    kind: str
    message: str


class ServiceDetailOut(ServiceOut):
    events: list[ServiceEventOut]


def replica_out(r: ReplicaRecord) -> ReplicaOut:
    return ReplicaOut(
        id=r.id,
        slot=r.slot,
        state=r.state.value,
        node=r.node,
        gpus=list(r.gpus),
        port=r.port,
        parked_as=r.parked_as,
        since=r.since,
        failures=r.failures,
        retry_at=r.retry_at,
        message=r.message,
    )


def signals_out(s: ReplicaSignals) -> SignalsOut:
    return SignalsOut(
        replica=s.replica,
        running=s.running,
        waiting=s.waiting,
        kv_usage=s.kv_usage,
        generation_tokens_per_s=s.generation_tokens_per_s,
        prompt_tokens_per_s=s.prompt_tokens_per_s,
        ttft_p90_s=s.ttft_p90_s,
        e2e_p90_s=s.e2e_p90_s,
        waiting_capacity=s.waiting_capacity,
        waiting_deferred=s.waiting_deferred,
        preemptions_per_s=s.preemptions_per_s,
        kv_pressure=s.kv_pressure,
        sleep_state=s.sleep_state,
        stale=s.stale,
        stale_reason=s.stale_reason,
    )


def service_out(inference: InferenceController, name: str, replicas: list[ReplicaRecord]) -> dict[str, Any]:
    setup = inference.services[name]
    spec = setup.spec
    status: ServiceStatus = inference.status[name]
    d = status.decision
    return {
        "name": name,
        "model": spec.model,
        "gpus_per_replica": spec.gpus_per_replica,
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "park": spec.park,
        "desired": d.desired if d else None,
        "needed": d.needed if d else None,
        "target": status.target,
        "recommendation": d.recommendation if d else None,
        "per_signal": dict(d.per_signal) if d else {},
        "reason": d.reason if d else "no decision yet",
        "guard": d.guard if d else None,
        "unknown": d.unknown if d else True,
        "blocked": status.blocked,
        "alert": status.alert,
        "fresh_at": status.fresh_at,
        "source_error": status.signals.source_error if status.signals else None,
        "signals": [signals_out(s) for s in status.signals.replicas] if status.signals else [],
        "replicas": [replica_out(r) for r in replicas if r.service == name],
        # The last hour of load, one sample every 5 s at most (control.load_history; in memory).
        "load_history": [
            {"at": x.at, "running": x.running, "waiting": x.waiting, "desired": x.desired}
            for x in status.history.samples()
        ],
    }


def lending_out(mode: str, env: Envelope | None) -> LendingOut | None:
    if env is None:
        return None
    return LendingOut(
        mode=mode,
        lendable_gpus=env.lendable_gpus,
        inference_claim_gpus=env.inference_claim_gpus,
        reserve_gpus=env.reserve_gpus,
        lending_open=env.lending_open,
        return_by=env.return_by,
        fail_safe=env.fail_safe,
        reasons=list(env.reasons),
    )


def event_out(e: ServiceEventRecord) -> ServiceEventOut:
    return ServiceEventOut(at=e.at, replica_id=e.replica_id, kind=e.kind, message=e.message)


class ReclaimOut(BaseModel):
    id: int
    service: str | None
    replica_id: str | None
    reason: str
    gpus: int
    victims: list[int] = Field(description="attempt ids of the preempted steps")
    state: str = Field(description="OPEN | DONE | ABANDONED")
    detected_at: float = Field(description="when the service first lacked GPUs (surge detected)")
    decided_at: float = Field(description="when the victims were chosen")
    notice_at: float | None = Field(description="when the last victim got notice")
    freed_at: float | None = Field(description="when the last victim's GPUs were free")
    healthy_at: float | None = Field(description="when the replica served")
    total_s: float | None = Field(description="healthy_at − detected_at")


def reclaim_out(r: ReclaimRecord) -> ReclaimOut:
    return ReclaimOut(
        id=r.id,
        service=r.service,
        replica_id=r.replica_id,
        reason=r.reason,
        gpus=r.gpus,
        victims=list(r.victims),
        state=r.state,
        detected_at=r.detected_at,
        decided_at=r.decided_at,
        notice_at=r.notice_at,
        freed_at=r.freed_at,
        healthy_at=r.healthy_at,
        total_s=None if r.healthy_at is None else r.healthy_at - r.detected_at,
    )
