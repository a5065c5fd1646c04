"""A write refused because this control plane just lost its lease answers 503 ``not_leader`` with
``Retry-After`` (never 500), and goes through once the control plane stands by (unfenced); a
standby's /healthz is 200 and says who leads (docs/architecture.md §4.4)."""

from __future__ import annotations

import time
from pathlib import Path

import yaml
from fastapi.testclient import TestClient

from lowtide.control.lease import Fence, LeaseCandidate
from lowtide.wiring import leadership_for
from support import embedded

SPEC = {"name": "j", "team": "nlp", "steps": [{"name": "s", "command": ["true"], "gpus": 0}]}


def test_a_fenced_out_submit_is_a_503_to_retry_and_a_standby_is_healthy(tmp_path: Path) -> None:
    lt = embedded(tmp_path, auth={"enabled": False})
    try:
        client = TestClient(lt.app)
        other = LeaseCandidate("elsewhere:x#1.a", "elsewhere:x", "elsewhere", 1)
        assert lt.store.claim_lease(other, ttl_s=60, now=time.time()).granted  # token 1, not ours
        lt.store.fence_writes(Fence("control", 7))  # as a leader whose lease was taken over
        body = yaml.safe_dump(SPEC)
        r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 503 and r.json()["error"] == "not_leader" and r.headers["Retry-After"]
        lt.store.fence_writes(None)  # standing by: its writes are plain records again
        r = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/yaml"})
        assert r.status_code == 201, r.text

        lt.leadership = leadership_for(lt.settings, lt.store, lt.clock)
        assert lt.leadership.claim_once() is None  # the other holds an unexpired lease
        health = client.get("/healthz")
        assert health.status_code == 200
        control = health.json()["control"]
        assert control["role"] == "standby" and control["holder"] == other.holder
        assert "lowtide_leader 0.0" in client.get("/metrics").text
    finally:
        lt.close()
