"""Leader election on a coordination.k8s.io/v1 Lease (`adapters.k8s_lease`, docs/architecture.md §4.4)
with the real `kubernetes` client against the fake API server (`tests/k8sfake`), on fake time.

One of two candidates wins and the other stands by, even with its wall clock an hour ahead (expiry
is judged on the local observation time, as client-go does); the leader renews; after the leader's
silence the other takes over once the Lease's duration has passed since it last saw a change; a
409 on renew (someone else wrote) makes the leader lose at once, never overwrite; an AlreadyExists
race on create re-reads; a released Lease is taken at once. Behind `KubeGatedLeases`, two control
planes (`control.leadership.Leadership`) on one store never both act, also while the API server is
away or only the leader is cut off (sampled timeline); the one that lost the Lease calls its
`on_lost` and never leads again, and its loop launches nothing, also when the Lease is lost
between the booking and the launch of one tick. RBAC: the chart's rendered rules are enough;
without `update` on leases a renew fails with a clear error, and `serve` refuses to start when
the Lease cannot even be read. A real `lowtide up` that loses its Lease exits with code 1.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client

from k8sfake import ADMIN_TOKEN, FakeCluster
from lowtide.adapters.k8s_lease import KubeGatedLeases, KubeLeaseElector, KubeLeaseError
from lowtide.control.clock import FakeClock
from lowtide.control.leadership import Leadership
from lowtide.control.lease import LeaseCandidate, LeaseTiming, holder_name, seat_of
from lowtide.control.records import FencedOut
from lowtide.deploy.chart import load_chart, render
from lowtide.deploy.manifests import Release
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.sim.harness import LoopHarness
from lowtide.sim.scripted import FakeExecutor
from lowtide.store.memory import MemoryStore
from support import settings_for, wait_until

NS, NAME = "lowtide-system", "lowtide-control"
T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)  # microsecond 0: the MicroTime must still have 6 digits
MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster() as c:
        yield c


@dataclass
class Candidate:
    """One elector on its own fake wall clock (`skew_s` ahead of the others); `lost`: its on_lost calls."""

    cluster: FakeCluster
    identity: str
    token: str = ADMIN_TOKEN
    skew_s: float = 0.0
    api: Any = None
    lost: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.elector = KubeLeaseElector(
            self.api or client.CoordinationV1Api(self.cluster.api_client(self.token)),
            namespace=NS,
            name=NAME,
            identity=self.identity,
            duration_s=10,
            renew_deadline_s=8.0,
            request_timeout_s=5.0,
            on_lost=self.lost.append,
        )

    def wall(self, t: float) -> datetime:
        return T0 + timedelta(seconds=t + self.skew_s)

    def tries(self, t: float) -> bool:
        return self.elector.try_acquire_or_renew(t, self.wall(t))


def spec(cluster: FakeCluster) -> dict[str, Any]:
    return dict(cluster.get("leases", NS, NAME)["spec"])


def test_one_candidate_wins_the_other_stands_by_and_the_leader_renews(cluster: FakeCluster) -> None:
    a, b = Candidate(cluster, "pod-a:1#11.aa"), Candidate(cluster, "pod-b:2#22.bb", skew_s=3600)
    assert a.tries(0.0)
    first = spec(cluster)
    assert first["holderIdentity"] == a.identity and first["leaseTransitions"] == 0
    assert first["leaseDurationSeconds"] == 10
    assert MICRO_TIME.fullmatch(first["renewTime"]) and first["acquireTime"] == first["renewTime"]
    # b's clock is an hour ahead: a's renewTime looks long past, but b judges by what it saw change.
    for t in (0.5, 4.0, 9.0, 10.4):
        assert not b.tries(t)
    for t in (3.0, 6.0, 9.0, 12.0, 15.0, 18.0):  # the leader renews; b keeps seeing changes
        assert a.tries(t) and a.elector.is_leader(t)
        assert not b.tries(t + 0.5)
    last = spec(cluster)
    assert last["holderIdentity"] == a.identity and last["leaseTransitions"] == 0
    assert last["acquireTime"] == first["acquireTime"] and last["renewTime"] > first["renewTime"]
    assert not a.lost and not b.lost and not b.elector.is_leader(20.0)
    puts = [r for r in cluster.requests if r.verb == "update" and r.resource == "leases"]
    assert puts and all(r.code == 200 for r in puts)


def test_after_the_leaders_silence_the_other_takes_over_once_the_duration_passed(
    cluster: FakeCluster,
) -> None:
    a, b = Candidate(cluster, "pod-a:1#11.aa"), Candidate(cluster, "pod-b:2#22.bb", skew_s=-7200)
    assert a.tries(0.0)
    assert not b.tries(1.0)  # b observes a's record at 1.0: valid until 11.0 by b's own time
    assert not b.tries(10.9)
    assert b.tries(11.1)
    taken = spec(cluster)
    assert taken["holderIdentity"] == b.identity and taken["leaseTransitions"] == 1
    assert taken["acquireTime"] == taken["renewTime"]  # a takeover starts a new acquireTime
    # a wakes up past its renew deadline (8 s): it has lost the Lease and never leads again.
    assert not a.tries(11.2) and not a.elector.is_leader(11.2)
    assert len(a.lost) == 1 and "could not be renewed within 8s" in a.lost[0]
    assert b.elector.release(b.wall(12.0))
    assert not a.tries(12.1) and len(a.lost) == 1
    assert spec(cluster)["holderIdentity"] == ""


def test_a_conflict_on_renew_means_someone_else_won_and_is_never_overwritten(cluster: FakeCluster) -> None:
    a = Candidate(cluster, "pod-a:1#11.aa")
    assert a.tries(0.0)
    # An injected 409 without a real write: re-read, the record is still ours, renew.
    cluster.inject("update", "leases", status=409)
    assert a.tries(2.0) and spec(cluster)["holderIdentity"] == a.identity and not a.lost

    def steal(lease: dict[str, Any]) -> None:
        lease["spec"]["holderIdentity"] = "intruder"
        lease["spec"]["renewTime"] = "2026-01-01T12:00:03.000000Z"
        lease["spec"]["leaseTransitions"] = 1

    cluster.modify("leases", NS, NAME, steal)
    assert not a.tries(4.0)
    assert not a.elector.is_leader(4.0)
    assert len(a.lost) == 1 and "held by intruder" in a.lost[0]
    assert spec(cluster)["holderIdentity"] == "intruder"  # read again, not overwritten
    codes = [r.code for r in cluster.requests if r.verb == "update" and r.resource == "leases"]
    assert codes[-1] == 409
    assert not a.tries(30.0)  # even once the intruder's Lease expired: a lost elector stays out


def test_an_already_exists_race_on_create_re_reads(cluster: FakeCluster) -> None:
    real = client.CoordinationV1Api(cluster.api_client())

    class Racing:
        """The API as b sees it: someone creates the Lease just before b's create lands."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def create_namespaced_lease(self, namespace: str, body: Any, **kw: Any) -> Any:
            rival = {
                "metadata": {"name": NAME},
                "spec": {"holderIdentity": "rival", "leaseDurationSeconds": 10},
            }
            cluster.create("leases", namespace, rival)
            return real.create_namespaced_lease(namespace, body, **kw)

    b = Candidate(cluster, "pod-b:2#22.bb", api=Racing())
    assert not b.tries(0.0)
    observed = b.elector.observation
    assert observed is not None and observed.record.holder == "rival"
    assert [r.code for r in cluster.requests if r.verb == "create"] == [409]
    assert spec(cluster)["holderIdentity"] == "rival"


def test_a_released_lease_is_taken_at_once_and_5xx_is_retried(cluster: FakeCluster) -> None:
    a, b = Candidate(cluster, "pod-a:1#11.aa"), Candidate(cluster, "pod-b:2#22.bb")
    assert a.tries(0.0) and not b.tries(0.5)
    cluster.inject("update", "leases", status=500)
    with pytest.raises(KubeLeaseError) as exc:
        a.tries(2.0)
    assert exc.value.status == 500 and not exc.value.permanent
    assert a.elector.is_leader(2.0) and not a.lost  # still within its renew deadline
    assert a.tries(2.5)
    assert not b.elector.release(b.wall(3.0))  # not the holder: nothing to release
    assert a.elector.release(a.wall(3.0))
    released = spec(cluster)
    assert released["holderIdentity"] == "" and released["leaseDurationSeconds"] == 1
    assert b.tries(3.1) and spec(cluster)["leaseTransitions"] == 1
    assert not a.lost  # released on purpose, not lost


# -- two control planes behind the Lease ------------------------------------------------------


class Plane:
    """One control plane's `Leadership` behind the Lease, on the simulation's time `now[0]`."""

    def __init__(self, cluster: FakeCluster, store: MemoryStore, host: str, now: list[float]) -> None:
        seat = seat_of(host, host + "-state")
        self.candidate = LeaseCandidate(holder_name(seat, 7, "ab"), seat, host, 7)
        self.lost: list[str] = []
        self.elector = KubeLeaseElector(
            client.CoordinationV1Api(cluster.api_client()),
            namespace=NS,
            name=NAME,
            identity=self.candidate.holder,
            duration_s=10,
            renew_deadline_s=8.0,
            request_timeout_s=2.0,
            on_lost=self.lost.append,
        )
        self.gate = KubeGatedLeases(
            store, self.elector, monotonic=lambda: now[0], wall=lambda: T0 + timedelta(seconds=now[0])
        )
        self.leadership = Leadership(
            self.gate, self.candidate, LeaseTiming(10.0, 2.0), wall=lambda: now[0], monotonic=lambda: now[0]
        )
        self.next_claim = 0.0

    def step(self, t: float) -> None:
        if t >= self.next_claim:
            self.leadership.claim_once()
            self.next_claim = t + self.leadership.next_claim_in()


@pytest.mark.parametrize("fault", ["api-server-away", "leader-partitioned"])
def test_two_control_planes_never_both_act(cluster: FakeCluster, fault: str) -> None:
    """From 20 s to 35 s either the API server is away for both, or only the leader cannot reach
    it (its client points at a closed port) while the standby can; sampled every 0.1 s."""
    store, now = MemoryStore(), [0.0]
    a, b = Plane(cluster, store, "pod-a", now), Plane(cluster, store, "pod-b", now)
    b.next_claim = 0.05
    reachable = a.elector.api
    nowhere = client.Configuration()
    nowhere.host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    timeline: list[tuple[float, bool, bool]] = []
    last_renew_a = 0.0
    for i in range(0, 601):  # 60 s in steps of 0.1 s
        t = now[0] = i / 10
        if i == 200:
            if fault == "api-server-away":
                cluster.stop_listening()
            else:
                a.elector.api = client.CoordinationV1Api(client.ApiClient(nowhere))
        if i == 350:
            cluster.resume_listening()
            a.elector.api = reachable
        for plane in (a, b):
            plane.step(t)
        seen = a.elector.observation
        if seen is not None and seen.at == t and seen.record.holder == a.candidate.holder:
            last_renew_a = t  # a wrote its record at t (its own write is its observation)
        timeline.append((t, a.leadership.may_act(), b.leadership.may_act()))
    assert not [s for s in timeline if s[1] and s[2]], "both acted"
    assert all(acting_a for t, acting_a, _ in timeline if 0.0 <= t < 20.0)  # a led until the fault
    assert 18.0 <= last_renew_a < 20.0
    assert not [s for s in timeline if s[1] and s[0] >= last_renew_a + 8.0]  # stopped before it could expire
    assert len(a.lost) == 1 and "could not be renewed" in a.lost[0]
    took_over = next(t for t, _, acting_b in timeline if acting_b)
    if fault == "api-server-away":
        assert 35.0 <= took_over <= 36.0  # the first claim after the API server came back
    else:  # b saw a's last renew within a claim interval (2 s) and waited the duration (10 s)
        assert last_renew_a + 10.0 <= took_over <= last_renew_a + 12.5
    assert all(acting_b for t, _, acting_b in timeline if t >= took_over)
    lease = spec(cluster)
    assert lease["holderIdentity"] == b.candidate.holder and lease["leaseTransitions"] == 1
    assert a.leadership.status()["role"] == "standby" and b.leadership.status()["role"] == "leader"
    # A graceful stop releases both leases: a fresh control plane leads at its first claim.
    assert b.leadership.release() and spec(cluster)["holderIdentity"] == ""
    c = Plane(cluster, store, "pod-c", now)
    assert c.leadership.claim_once() is not None and spec(cluster)["holderIdentity"] == c.candidate.holder
    assert not a.leadership.claim_once() and not a.leadership.may_act()  # a lost it: it never leads again


NODES = (Node("n1", (0, 1)),)
JOB = {"name": "j", "max_retries": 1, "steps": [{"name": "train", "command": ["sleep", "inf"], "gpus": 1}]}


def test_a_leader_whose_lease_was_taken_stops_its_loop_at_once(cluster: FakeCluster) -> None:
    now = [0.0]
    store = MemoryStore()
    h = LoopHarness(
        nodes=NODES, layout=ArtifactLayout("/art", "/work"), clock=FakeClock(1_800_000_000.0), store=store
    )
    try:
        h.recover()
        plane = Plane(cluster, store, "pod-a", now)
        h.loop.lease = plane.leadership
        assert plane.leadership.claim_once() is not None
        job = h.submit(JOB)
        h.tick()
        assert isinstance(h.executor, FakeExecutor) and len(h.executor.launched) == 1

        def steal(lease: dict[str, Any]) -> None:
            lease["spec"]["holderIdentity"] = "pod-b:x#9.zz"

        cluster.modify("leases", NS, NAME, steal)
        now[0] = 2.0
        assert plane.leadership.claim_once() is None  # 409 on renew, re-read: someone else won
        assert plane.lost and not plane.leadership.may_act()
        with pytest.raises(FencedOut, match="not the leader"):
            plane.leadership.check()
        second = h.submit(JOB)
        h.tick(3)
        assert len(h.executor.launched) == 1  # a deposed leader launches nothing
        assert not h.store.job_detail(second).attempts and h.step(job, "train").state.value == "RUNNING"
    finally:
        h.close()


class LosesMidTick:
    """The loop's guard: the real `Leadership` behind the Lease, with the lease thread's claim
    interleaved between the check before the booking and the one before the launch, after
    someone else took the Lease."""

    def __init__(self, plane: Plane, cluster: FakeCluster, now: list[float]) -> None:
        self.plane, self.cluster, self.now, self.checks = plane, cluster, now, 0

    def may_act(self) -> bool:
        return self.plane.leadership.may_act()

    def check(self) -> None:
        self.checks += 1
        if self.checks == 2:

            def steal(lease: dict[str, Any]) -> None:
                lease["spec"]["holderIdentity"] = "pod-b:x#9.zz"

            self.cluster.modify("leases", NS, NAME, steal)
            self.now[0] += 0.5
            self.plane.leadership.claim_once()
        self.plane.leadership.check()


def test_a_lease_lost_mid_tick_launches_nothing_and_costs_no_retry(cluster: FakeCluster) -> None:
    now = [0.0]
    store = MemoryStore()
    h = LoopHarness(nodes=NODES, layout=ArtifactLayout("/art", "/work"), clock=FakeClock(1.8e9), store=store)
    try:
        h.recover()
        plane = Plane(cluster, store, "pod-a", now)
        assert plane.leadership.claim_once() is not None
        guard = LosesMidTick(plane, cluster, now)
        h.loop.lease = guard
        job = h.submit(JOB)
        report = h.tick(check=False)
        assert guard.checks >= 2 and plane.lost and not plane.leadership.may_act()
        assert isinstance(h.executor, FakeExecutor) and not h.executor.launched and report.started == 0
        booked = h.last_attempt(job)
        h.loop.lease = None
        h.restart()  # the next leader: the booking's process is not found, so it is requeued
        assert h.store.attempt(booked.id).state.value == "LOST"
        assert h.step(job, "train").retries_used == 0
    finally:
        h.close()


# -- RBAC: the chart's own rules -------------------------------------------------------------

RELEASE = Release("lowtide", NS)
SA = f"system:serviceaccount:{NS}:lowtide"


def chart_objects(lease_verbs: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    required = {"artifactRoot": "s3://bucket/lowtide", "store": {"url": "postgresql://db/lowtide"}}
    objects = render(load_chart(), [required], RELEASE)
    if lease_verbs is not None:
        for o in objects:
            for rule in o.get("rules") or []:
                if "leases" in rule.get("resources", []):
                    rule["verbs"] = list(lease_verbs)
    return objects


def test_the_charts_rbac_is_enough_for_the_lease(cluster: FakeCluster) -> None:
    cluster.load_rbac(chart_objects())
    cluster.add_user("sa-token", SA)
    a, b = (
        Candidate(cluster, "pod-a:1#11.aa", token="sa-token"),
        Candidate(cluster, "pod-b:2#22.bb", token="sa-token"),
    )
    assert a.tries(0.0) and a.tries(2.0) and not b.tries(2.5)
    assert a.elector.release(a.wall(3.0)) and b.tries(3.5)
    assert {r.code for r in cluster.requests} <= {200, 201, 404}


def test_without_leases_update_the_lease_fails_with_a_clear_error(cluster: FakeCluster) -> None:
    cluster.load_rbac(chart_objects(("get", "create")))
    cluster.add_user("sa-token", SA)
    a = Candidate(cluster, "pod-a:1#11.aa", token="sa-token")
    assert a.tries(0.0)  # create is allowed
    with pytest.raises(KubeLeaseError) as exc:
        a.tries(2.0)  # the renew is an update
    message = str(exc.value)
    assert exc.value.status == 403 and exc.value.permanent
    assert (
        f'cannot update the Lease {NS}/{NAME}: HTTP 403: leases.coordination.k8s.io "{NAME}" is forbidden'
        in message
    )
    assert 'cannot update resource "leases" in API group "coordination.k8s.io"' in message
    assert "needs get, create and update on leases.coordination.k8s.io" in message
    # Behind the gate a refused first claim is a standby with the reason kept for `lowtide up`.
    released = {"metadata": {"name": "released"}, "spec": {"holderIdentity": "", "leaseDurationSeconds": 1}}
    cluster.create("leases", NS, released)  # taking it needs an update
    plane = Plane(cluster, MemoryStore(), "pod-c", [0.0])
    plane.elector = KubeLeaseElector(
        client.CoordinationV1Api(cluster.api_client("sa-token")),
        namespace=NS,
        name="released",
        identity=plane.candidate.holder,
        duration_s=10,
        renew_deadline_s=8.0,
    )
    plane.gate.elector = plane.elector
    assert plane.leadership.claim_once() is None and not plane.leadership.may_act()
    assert plane.gate.last_error is not None and plane.gate.last_error.permanent


# -- a real `lowtide up` exits when it loses the Lease ---------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_up(cluster: FakeCluster, tmp_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`lowtide up` with `control.lease_backend: kubernetes`, KUBECONFIG naming the fake cluster."""
    kubeconfig = cluster.write_kubeconfig(tmp_path, ADMIN_TOKEN, namespace=NS)
    port = free_port()
    config = tmp_path / "lowtide.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(tmp_path / "state"),
                "artifact_root": str(tmp_path / "artifacts"),
                "executor": {"work_root": str(tmp_path / "work")},
                "tick_seconds": 0.2,
                "nodes": [{"name": "node-a", "gpus": 1}],
                "api": {"port": port},
                "auth": {"enabled": False},
                "control": {"lease_ttl": 2, "lease_renew": 0.5, "lease_backend": "kubernetes"},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "LOWTIDE_"))}
    env["KUBECONFIG"] = str(kubeconfig)
    with (tmp_path / "up.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lowtide", "--config", str(config), "up"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
    return proc, port


def test_lowtide_up_exits_with_code_1_when_it_loses_the_lease(cluster: FakeCluster, tmp_path: Path) -> None:
    proc, port = start_up(cluster, tmp_path)
    log_path = tmp_path / "up.log"
    try:

        def role() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(f"lowtide up exited early:\n{log_path.read_text()}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            except httpx.HTTPError:
                return None
            return str(r.json()["control"]["role"])

        wait_until(lambda: role() == "leader", timeout=60, what="lowtide up to lead")
        held = spec(cluster)
        assert held["holderIdentity"].startswith(socket.gethostname()[:64] + ":")
        assert held["leaseDurationSeconds"] == 2

        def steal(lease: dict[str, Any]) -> None:
            lease["spec"]["holderIdentity"] = "other-pod:x#1.ab"

        cluster.modify("leases", NS, NAME, steal)
        assert proc.wait(timeout=30) == 1
        out = log_path.read_text()
        assert "lost the Kubernetes Lease" in out and "held by other-pod:x#1.ab" in out, out
        assert spec(cluster)["holderIdentity"] == "other-pod:x#1.ab"  # the exit did not overwrite it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_lowtide_up_refuses_to_start_when_rbac_denies_the_lease(
    cluster: FakeCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process `serve` (the CLI turns its ServeError into exit code 1, cli/main.py `up`)."""
    from lowtide.wiring import ServeError, serve  # noqa: PLC0415

    cluster.add_user("no-rights", "system:serviceaccount:lowtide-system:someone-else")
    monkeypatch.setenv("KUBECONFIG", str(cluster.write_kubeconfig(tmp_path, "no-rights", namespace=NS)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = settings_for(
        tmp_path,
        auth={"enabled": False},
        control={"lease_ttl": 2, "lease_renew": 0.5, "lease_backend": "kubernetes"},
    )
    with pytest.raises(ServeError) as exc:
        serve(settings, announce=False)
    message = str(exc.value)
    assert f"control.lease_backend is kubernetes, but cannot read the Lease {NS}/{NAME}: HTTP 403" in message
    assert "needs get, create and update on leases.coordination.k8s.io" in message
    assert not cluster.list("leases", NS)


def test_with_the_argo_executor_another_hosts_lease_is_taken_over_without_the_grace(tmp_path: Path) -> None:
    """`control.foreign_takeover_grace` exists because the local executor cannot adopt another
    host's processes; Argo's workflows are cluster-wide, so a new leader recovers at once."""
    from lowtide.wiring import leadership_for  # noqa: PLC0415

    (tmp_path / "state").mkdir()
    argo = settings_for(tmp_path, executor={"kind": "argo"}, artifact_root="s3://bucket/lowtide")
    assert leadership_for(argo, MemoryStore(), FakeClock(1.0)).foreign_grace_s == 0.0  # type: ignore[arg-type]
    local = settings_for(tmp_path)
    assert leadership_for(local, MemoryStore(), FakeClock(1.0)).foreign_grace_s == 300.0  # type: ignore[arg-type]


def test_config_rejects_bad_lease_names() -> None:
    from lowtide.config import ControlConfig  # noqa: PLC0415

    with pytest.raises(ValueError, match="not a valid Lease name"):
        ControlConfig(lease_backend="kubernetes", kubernetes_lease={"name": "Bad_Name"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lease_backend"):
        ControlConfig(lease_backend="etcd")  # type: ignore[arg-type]
    assert json.loads(ControlConfig().model_dump_json())["lease_backend"] == "store"
