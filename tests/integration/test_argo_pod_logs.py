"""`lowtide logs` in cluster mode: a step's log read through lowtide's API from its pod.

The Argo world (`argo_world`: the real loop and `ArgoExecutor` against the fake API server, with
`argo_sim` playing Argo and the kubelet) runs the jobs; lowtide's real API app
(`api.app.create_app`) reads through `adapters.argo.pod_logs.PodLogReader` on the real
`kubernetes` client, as `wiring` sets it up when `executor.kind` is argo. The fake serves pods/log
as the real server does (`k8sfake.server._log`: limitBytes, 204/400/404, the log kept per pod uid).
Must not: read the fake's store for what the API should have answered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import lowtide.cli.main as cli_main
from argo_sim import Script
from argo_world import LAYOUT, NODES, NS, World, argo_world, two_steps
from lowtide.adapters.argo import pods
from lowtide.adapters.argo.executor import parse_ref
from lowtide.adapters.argo.pod_logs import PodLogReader
from lowtide.api.app import ApiContext, create_app
from lowtide.cli.client import Client
from lowtide.control.log_port import AttemptLogRef
from lowtide.domain.states import AttemptState

WAIT_S = 30.0  # a bound, not a duration


@pytest.fixture
def w() -> Iterator[World]:
    yield from argo_world()


def api(w: World, token: str | None = None) -> TestClient:
    reader = PodLogReader(w.cluster.api_client(token) if token else w.cluster.api_client())
    ctx = ApiContext(
        store=w.store,  # type: ignore[arg-type]  # the API's reads of logs need only these
        clock=w.h.clock,
        nodes=NODES,
        layout=LAYOUT,
        auth_enabled=False,
        logs=reader,
        log_poll_s=0.01,
    )
    return TestClient(create_app(ctx))


def one_step(run_s: float = 10_000, max_retries: int = 0) -> dict[str, Any]:
    return {"name": "echo", "max_retries": max_retries, "steps": [{"name": "t", "command": ["t"], "gpus": 1}]}


def attempt(w: World, job: str, number: int = -1, step: str = "t") -> Any:
    attempts = [a for a in w.store.job_detail(job).attempts if a.step_name == step]
    return attempts[number] if number < 0 else next(a for a in attempts if a.number == number)


def pod_name(w: World, job: str, number: int = -1, step: str = "t") -> str:
    handle = attempt(w, job, number, step).handle
    ns, name, _ = parse_ref(handle)
    assert ns == NS and not name.startswith("@"), f"no pod recorded for the attempt: {handle}"
    return name


def delete_pod(w: World, name: str) -> None:
    w.cluster.delete("pods", NS, name)
    if w.cluster.list("pods", NS, field_selector=f"metadata.name={name}"):  # a graceful delete
        w.cluster.finish_pod_deletion(NS, name)


def logs(c: TestClient, job: str, **params: Any) -> Any:
    return c.get(f"/v1/jobs/{job}/steps/t/logs", params=params)


def log_gets(w: World, verb: str, resource: str, name: str) -> list[int]:
    return [r.code for r in w.cluster.requests if (r.verb, r.resource, r.name) == (verb, resource, name)]


def test_a_running_steps_log_is_read_from_its_pod_with_offsets_and_followed(w: World) -> None:
    c = api(w)
    job = w.h.submit(one_step())
    w.sim.script(job, "t", Script(run_s=30))
    w.run(lambda: w.running(job, "t"))
    pod = pod_name(w, job)  # a pod claimed after launch: its handle reached the store with the start
    r = logs(c, job)
    assert (r.status_code, r.text) == (200, "")  # running, nothing written yet
    w.cluster.set_pod_log(NS, pod, "epoch 1 loss 0.9\nepoch 2 loss 0.7\n")
    assert logs(c, job).text == "epoch 1 loss 0.9\nepoch 2 loss 0.7\n"
    assert logs(c, job, offset=8).text == "loss 0.9\nepoch 2 loss 0.7\n"
    assert logs(c, job, offset=10_000).text == ""
    # Larger than one read (1 MiB): each read asks for limitBytes = offset + limit from the start.
    big = "".join(f"{i:07d} {'x' * 56}\n" for i in range(40_000))  # 2.56 MB
    w.cluster.set_pod_log(NS, pod, big)
    assert logs(c, job).text == big
    reader = PodLogReader(w.cluster.api_client())
    ref = AttemptLogRef(job, "t", 1, attempt(w, job).handle)
    assert reader.read(ref, 1_500_000, 100) == big.encode()[1_500_000:1_500_100]

    # Followed: the stream ends when the attempt does, with all of its log.
    w.cluster.set_pod_log(NS, pod, "a\n")
    got: dict[str, Any] = {}
    follower = threading.Thread(target=lambda: got.update(r=logs(c, job, follow=True)))
    follower.start()
    w.cluster.set_pod_log(NS, pod, "a\nb\n")
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    follower.join(WAIT_S)
    assert not follower.is_alive() and got["r"].status_code == 200
    assert got["r"].text == "a\nb\n"
    assert logs(c, job, follow=True, offset=2).text == "b\n"  # a finished attempt's pod still there


def test_a_pod_that_ran_and_ended_between_two_polls_still_shows_its_log(w: World) -> None:
    c = api(w)
    job = w.h.submit(one_step())
    w.sim.script(job, "t", Script(run_s=0))  # it exits as soon as it runs
    w.run(lambda: any(not pods.is_gated(p) for p in w.cluster.list("pods", NS)))  # admitted
    (pod,) = w.cluster.list("pods", NS)
    name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
    assert attempt(w, job).state == AttemptState.PENDING  # no poll saw it Running, nor will
    w.sim.step()  # the kubelet runs it
    w.cluster.set_pod_log(NS, name, "all done\n")
    w.sim.step()  # it ends, and Argo records its node, before the loop polls again
    assert pods.pod_phase(w.cluster.get("pods", NS, name)) == "Succeeded"
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    att = attempt(w, job)
    assert att.handle == f"{NS}/{name}/{uid}"  # the exit brought the pod, not `@<job>/<step>`
    assert att.state == AttemptState.SUCCEEDED and att.running_at is not None
    assert logs(c, job).text == "all done\n"


def test_a_finished_attempt_whose_pod_was_deleted_answers_gone(w: World) -> None:
    c = api(w)
    job = w.h.submit(one_step())
    w.sim.script(job, "t", Script(run_s=5))
    w.run(lambda: w.running(job, "t"))
    pod = pod_name(w, job)
    w.cluster.set_pod_log(NS, pod, "done\n")
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    assert logs(c, job).text == "done\n"
    delete_pod(w, pod)  # Argo's podGC, or a workflow deleted
    for follow in (False, True):
        r = logs(c, job, follow=follow)
        assert r.status_code == 410, r.text
        body = r.json()
        assert body["error"] == "gone"
        assert f"log not available: pod {NS}/{pod} (uid " in body["message"]
        assert "was deleted" in body["message"] and 'docs/cluster.md "Logs"' in body["message"]


def test_a_pod_deleted_while_followed_ends_the_stream_with_a_clear_line(w: World) -> None:
    c = api(w)
    job = w.h.submit(one_step())
    w.run(lambda: w.running(job, "t"))
    pod = pod_name(w, job)
    w.cluster.set_pod_log(NS, pod, "step 1\n")
    got: dict[str, Any] = {}
    follower = threading.Thread(target=lambda: got.update(r=logs(c, job, follow=True)))
    follower.start()
    # The follower read the bytes: only then does the reader GET the pod (the uid check).
    for _ in range(3000):
        if log_gets(w, "get", "pods", pod):
            break
        threading.Event().wait(0.01)
    assert log_gets(w, "get", "pods", pod) == [200]
    delete_pod(w, pod)  # e.g. a node drained: Argo marks the node "pod deleted" and the attempt fails
    w.run(lambda: attempt(w, job).state not in (AttemptState.PENDING, AttemptState.RUNNING))
    follower.join(WAIT_S)
    assert not follower.is_alive()
    text = got["r"].text
    assert text.startswith("step 1\n\n[lowtide] log not available: pod ")
    assert text.rstrip().endswith('(docs/cluster.md "Logs")')


def test_a_recreated_pod_of_the_same_name_is_not_the_old_attempts_log(w: World) -> None:
    job = w.h.submit(one_step())
    w.sim.script(job, "t", Script(run_s=5))
    w.run(lambda: w.running(job, "t"))
    pod = pod_name(w, job)
    old = w.cluster.get("pods", NS, pod)
    w.cluster.set_pod_log(NS, pod, "mine\n")
    w.run(lambda: w.job_state(job) == "SUCCEEDED")
    delete_pod(w, pod)
    again = {"metadata": {"name": pod, "labels": old["metadata"]["labels"]}, "spec": old["spec"]}
    w.cluster.create("pods", NS, again)
    w.cluster.set_pod_log(NS, pod, "someone else's\n")  # the same name, another uid
    c = api(w)  # a reader that never saw the old pod go
    r = logs(c, job)
    assert r.status_code == 410 and "someone else" not in r.text
    assert log_gets(w, "get", "pods/log", pod)[-1] == 200  # it was read, then refused by its uid
    assert "a new pod of that name has uid" in r.json()["message"]


def test_a_second_attempts_log_is_its_own_pods(w: World) -> None:
    c = api(w)
    job = w.h.submit(one_step(max_retries=1))
    w.sim.script(job, "t", Script(run_s=5, exit_code=1), Script(run_s=10_000))
    w.run(lambda: w.running(job, "t"))
    first = pod_name(w, job)
    w.cluster.set_pod_log(NS, first, "attempt one: crashed\n")
    w.run(lambda: attempt(w, job).number == 2 and w.running(job, "t"))
    second = pod_name(w, job)
    assert second != first
    w.cluster.set_pod_log(NS, second, "attempt two\n")
    assert logs(c, job).text == "attempt two\n"
    assert logs(c, job, attempt=2).text == "attempt two\n"
    assert logs(c, job, attempt=1).text == "attempt one: crashed\n"


def test_a_missing_pods_log_rule_is_named_and_server_errors_read_as_nothing_yet(
    w: World, caplog: pytest.LogCaptureFixture
) -> None:
    job = w.h.submit(one_step())
    w.run(lambda: w.running(job, "t"))
    pod = pod_name(w, job)
    w.cluster.set_pod_log(NS, pod, "hello\n")
    w.cluster.add_user("weak-token", "weak")
    w.cluster.grant("weak", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}], NS)
    for follow in (False, True):
        r = logs(api(w, "weak-token"), job, follow=follow)
        assert r.status_code == 503 and r.json()["error"] == "log_unreadable"
        assert f"verbs [get] on pods/log in namespace {NS} (deploy/helm/lowtide RBAC)" in r.json()["message"]

    c = api(w)
    w.cluster.inject("get", "pods/log", status=503, times=2)
    with caplog.at_level(logging.WARNING, logger="lowtide.adapters.argo.pod_logs"):
        assert logs(c, job).text == ""  # nothing yet: a follower asks again
        assert logs(c, job).text == ""
        assert logs(c, job).text == "hello\n"
    warned = [m for m in caplog.messages if "reading a step's log" in m]
    assert len(warned) == 1 and "HTTP 503" in warned[0]  # once per run of failures


def test_a_pending_attempt_has_no_log_yet(w: World) -> None:
    c = api(w)
    job = w.h.submit(one_step())
    w.sim.script(job, "t", Script(image_error="ImagePullBackOff"))
    w.run(lambda: bool(w.store.job_detail(job).attempts) and w.cluster.list("pods", NS) != [])
    r = logs(c, job)
    assert (r.status_code, r.text) == (200, "")  # no pod claimed yet, or a container waiting: b""
    for _ in range(5):
        w.sim.step()
        w.h.tick()
    reader = PodLogReader(w.cluster.api_client())
    (pod,) = w.cluster.list("pods", NS)
    meta = pod["metadata"]
    ref = AttemptLogRef(job, "t", 1, f"{NS}/{meta['name']}/{meta['uid']}")
    assert reader.read(ref, 0) == b""  # 400 "is waiting to start: trying and failing to pull image"
    assert reader.lost(ref) is None
    assert log_gets(w, "get", "pods/log", meta["name"])[-1] == 400


def test_lowtide_logs_says_which_steps_log_went_with_its_pod_and_shows_the_others(
    w: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = api(w)
    job = w.h.submit(two_steps({"checkpoint": False}))
    w.sim.script(job, "prep", Script(run_s=3))
    w.sim.script(job, "train", Script(run_s=10_000))
    w.run(lambda: w.running(job, "prep"))
    prep = pod_name(w, job, step="prep")
    w.cluster.set_pod_log(NS, prep, "prepared\n")
    w.run(lambda: w.running(job, "train"))
    w.cluster.set_pod_log(NS, pod_name(w, job, step="train"), "training\n")
    delete_pod(w, prep)
    client = Client("http://testserver", None)
    client.http = c  # the CLI's HTTP client is the app's test client
    monkeypatch.setattr(cli_main, "_client", lambda: client)
    result = CliRunner().invoke(cli_main.app, ["logs", job], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "[train] training\n"
    assert f"prep: log not available: pod {NS}/{prep} (uid" in " ".join(result.stderr.split())


class _Endless:
    """A log response from a server that ignores limitBytes: as many bytes as are read."""

    status = 200

    def __init__(self) -> None:
        self.served = 0
        self.closed = False

    def read(self, amt: int) -> bytes:
        self.served += amt
        return b"x" * amt

    def close(self) -> None:
        self.closed = True

    def release_conn(self) -> None:
        pass


class _Core:
    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []
        self.response = _Endless()

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> _Endless:
        self.asked.append(kw)
        return self.response

    def read_namespaced_pod(self, name: str, namespace: str, **kw: Any) -> Any:
        self.asked.append({"get": name})
        return _Pod()


class _Pod:
    data = b'{"metadata": {"name": "pod", "uid": "uid-1"}}'

    def release_conn(self) -> None:
        pass


def test_a_read_asks_for_offset_plus_limit_bytes_and_never_takes_more() -> None:
    reader = PodLogReader(None)
    core = _Core()
    reader._core = core  # a server that ignores limitBytes
    ref = AttemptLogRef("j", "t", 1, f"{NS}/pod/uid-1")
    assert reader.read(ref, 100, 0) == b""  # nothing asked for: no request (limitBytes must be > 0)
    assert core.asked == []
    assert reader.read(ref, 300_000, 1000) == b"x" * 1000
    log_call, uid_check = core.asked
    assert log_call["limit_bytes"] == 301_000 and log_call["container"] == "main"
    assert log_call["_preload_content"] is False
    assert uid_check == {"get": "pod"}  # after the read, not before
    assert core.response.served == 301_000 and core.response.closed  # not a byte more was read
