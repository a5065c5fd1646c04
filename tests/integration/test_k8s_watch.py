"""The informer (`adapters.k8s_watch`) with the real `kubernetes` client against the fake API
server (`k8sfake`): LIST then WATCH, events, bookmarks, 410 Expired, the server going away and
coming back, RBAC, and `close`.

Waits are bounded and on the informer's own condition (`wait_for`, `wait_current`), never sleeps
asserting timing; `until` polls a condition with a deadline where the informer has no wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from k8sfake import FakeCluster
from lowtide.adapters.k8s_services import describe_api_error
from lowtide.adapters.k8s_watch import Informer, compare_resource_versions

NS = "serving"
WAIT = 10.0  # the bound of every wait: far above what any step takes


def pod(name: str, app: str = "vllm") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


def until(check: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(bookmark_interval=0.05) as c:
        yield c


def informer(cluster: FakeCluster, token: str | None = None, **kwargs: Any) -> Informer:
    api = cluster.api_client(token) if token else cluster.api_client()
    return Informer(
        api,
        client.CoreV1Api(api).list_namespaced_pod,
        "V1Pod",
        NS,
        label_selector="app=vllm",
        what=f"pods app=vllm in {NS}",
        backoff_s=(0.05, 0.2),
        describe=describe_api_error,
        **kwargs,
    ).start()


@pytest.fixture
def pods(cluster: FakeCluster) -> Iterator[Informer]:
    cluster.create("pods", NS, pod("a"))
    cluster.create("pods", NS, pod("other", app="web"))
    inf = informer(cluster)
    yield inf
    inf.close()
    assert inf._thread is not None and not inf._thread.is_alive()


def names(inf: Informer) -> list[str]:
    return sorted(inf.snapshot().items)


def seen(inf: Informer, cluster: FakeCluster) -> bool:
    return inf.wait_for(cluster.last_write("pods", NS), WAIT)


def test_lists_then_applies_added_modified_and_deleted_events(pods: Informer, cluster: FakeCluster) -> None:
    assert pods.wait_current(WAIT)
    assert names(pods) == [f"{NS}/a"]  # the selector: "other" is not ours
    cluster.create("pods", NS, pod("b"))
    cluster.modify("pods", NS, "a", lambda p: p["metadata"].setdefault("annotations", {}).update(x="1"))
    assert seen(pods, cluster)
    snap = pods.snapshot()
    assert sorted(snap.items) == [f"{NS}/a", f"{NS}/b"]
    assert isinstance(snap.items[f"{NS}/a"], client.V1Pod)
    assert snap.items[f"{NS}/a"].metadata.annotations == {"x": "1"}
    assert snap.resource_version == str(cluster.last_write("pods", NS))
    cluster.delete("pods", NS, "b")  # unscheduled: gone at once, a DELETED event
    # A pod that stops matching the selector arrives as DELETED too.
    cluster.modify("pods", NS, "a", lambda p: p["metadata"]["labels"].update(app="web"))
    assert seen(pods, cluster)
    assert names(pods) == []
    assert pods.requests == {"list": 1, "watch": 1}  # one LIST, one long watch: no polling
    assert snap.items[f"{NS}/a"].metadata.annotations == {"x": "1"}  # a snapshot never changes


def test_bookmarks_advance_the_version_without_events_for_us(pods: Informer, cluster: FakeCluster) -> None:
    assert pods.wait_current(WAIT)
    before = pods.snapshot()
    written = cluster.create("pods", NS, pod("web-2", app="web"))  # not ours: no event reaches us
    rv = written["metadata"]["resourceVersion"]
    assert compare_resource_versions(before.resource_version, rv) == -1
    assert pods.wait_for(rv, WAIT)  # a BOOKMARK told us the collection is unchanged up to there
    after = pods.snapshot()
    assert after.items == before.items and compare_resource_versions(after.resource_version, rv) >= 0
    assert pods.requests == {"list": 1, "watch": 1}


def test_an_expired_version_relists_and_catches_up(
    pods: Informer, cluster: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The watch ends; before the new one reaches the server (held back 1 s), pods change and
    etcd compacts: the watch from the old version gets ERROR 410 Expired inside an HTTP 200
    stream, and the informer lists again and catches up."""
    assert pods.wait_current(WAIT)
    cluster.create("pods", NS, pod("x"))
    assert seen(pods, cluster)  # an event came: the watch is not "very short" when it ends
    cluster.inject("watch", "pods", latency=1.0)
    cluster.app.streams.close_all()  # the server ends the watch (as its timeout would)
    cluster.create("pods", NS, pod("b"))
    cluster.delete("pods", NS, "a")
    cluster.compact()
    assert seen(pods, cluster)
    assert names(pods) == [f"{NS}/b", f"{NS}/x"]
    assert "HTTP 410 Expired: too old resource version" in caplog.text
    assert pods.requests == {"list": 2, "watch": 3}  # watch, rewatch (410), list, watch


def test_an_injected_410_on_a_rewatch_relists(pods: Informer, cluster: FakeCluster) -> None:
    assert pods.wait_current(WAIT)
    cluster.create("pods", NS, pod("b"))
    assert seen(pods, cluster)  # an event came: the watch is not "very short" when it ends
    cluster.inject("watch", "pods", status=410)
    cluster.app.streams.close_all()  # the server ends the watch (as its timeout would)
    assert until(lambda: pods.requests["list"] == 2)
    cluster.create("pods", NS, pod("c"))
    assert seen(pods, cluster)
    assert names(pods) == [f"{NS}/a", f"{NS}/b", f"{NS}/c"]
    assert pods.requests == {"list": 2, "watch": 3}  # watch, rewatch (410), list, watch


def test_an_http_410_answer_to_a_watch_relists_too(cluster: FakeCluster) -> None:
    """Older servers (and the etcd path without the watch cache) answer a too-old version with
    HTTP 410 instead of an ERROR event: the same relist."""
    api = cluster.api_client()
    real = client.CoreV1Api(api).list_namespaced_pod
    watches = []

    def list_call(namespace: str, **kwargs: Any) -> Any:
        if kwargs.get("watch"):
            watches.append(kwargs["resource_version"])
            if len(watches) == 2:
                raise ApiException(status=410, reason="Gone")
        return real(namespace, **kwargs)

    inf = Informer(api, list_call, "V1Pod", NS, label_selector="app=vllm", backoff_s=(60.0, 60.0)).start()
    try:
        assert inf.wait_current(WAIT)
        cluster.create("pods", NS, pod("a"))
        assert seen(inf, cluster)
        cluster.app.streams.close_all()
        assert until(lambda: len(watches) == 3)  # no 60 s backoff after a 410
        assert inf.requests == {"list": 2, "watch": 3}
        cluster.create("pods", NS, pod("b"))
        assert seen(inf, cluster) and names(inf) == [f"{NS}/a", f"{NS}/b"]
    finally:
        inf.close()


def test_a_server_that_goes_away_keeps_the_cache_not_current_then_resumes_without_a_list(
    pods: Informer, cluster: FakeCluster
) -> None:
    assert pods.wait_current(WAIT)
    cluster.stop_listening()
    try:
        assert until(lambda: "unreachable" in pods.snapshot().problem)
        snap = pods.snapshot()
        assert not snap.current and snap.synced and sorted(snap.items) == [f"{NS}/a"]  # kept
        assert not pods.wait_for(snap.resource_version, 0.05)  # not current: not "seen"
        cluster.create("pods", NS, pod("b"))  # missed while away
    finally:
        cluster.resume_listening()
    assert seen(pods, cluster)
    assert names(pods) == [f"{NS}/a", f"{NS}/b"]
    assert pods.snapshot().problem == ""


def test_go_away_and_come_back_on_its_own(pods: Informer, cluster: FakeCluster) -> None:
    assert pods.wait_current(WAIT)
    cluster.go_away(0.3)
    assert until(lambda: not pods.current)
    assert pods.wait_current(WAIT)
    cluster.create("pods", NS, pod("b"))
    assert seen(pods, cluster) and names(pods) == [f"{NS}/a", f"{NS}/b"]


def test_rbac_403_on_watch_is_named_and_never_current(cluster: FakeCluster) -> None:
    cluster.add_user("lister", "system:serviceaccount:x:lister")
    cluster.grant(
        "system:serviceaccount:x:lister", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}], NS
    )
    cluster.create("pods", NS, pod("a"))
    inf = informer(cluster, token="lister")
    try:
        assert until(lambda: "403" in inf.snapshot().problem)
        snap = inf.snapshot()
        assert snap.synced and not snap.current and sorted(snap.items) == [f"{NS}/a"]
        assert "watching pods app=vllm in serving" in snap.problem
        assert "RBAC" in snap.problem and 'cannot watch resource "pods"' in snap.problem
        # The failure itself, for a reader that classifies API errors (the Argo executor).
        assert isinstance(snap.error, ApiException) and snap.error.status == 403
        assert snap.error_verb == "watch"
        assert not inf.wait_current(0.1)
    finally:
        inf.close()


def test_close_cuts_an_open_watch_at_once(cluster: FakeCluster) -> None:
    inf = informer(cluster, watch_timeout_s=600, idle_timeout_s=600)
    assert inf.wait_current(WAIT)
    thread = inf._thread
    assert thread is not None and thread.is_alive()
    started = time.monotonic()
    inf.close()
    assert not thread.is_alive() and time.monotonic() - started < 5  # not the 600 s timeouts
    assert not inf.current and inf.snapshot().problem == "closed"
    assert not any(t.name.startswith("informer ") and t.is_alive() for t in threading.enumerate())


def test_a_watch_that_the_server_ends_is_opened_again_from_its_version(
    cluster: FakeCluster,
) -> None:
    inf = informer(cluster, watch_timeout_s=1)  # timeoutSeconds 1: the server ends it every 1-2 s
    try:
        assert inf.wait_current(WAIT)
        assert until(lambda: inf.requests["watch"] >= 2)
        cluster.create("pods", NS, pod("b"))
        assert seen(inf, cluster) and names(inf) == [f"{NS}/b"]
        assert inf.requests["list"] == 1
    finally:
        inf.close()


def test_raw_items_are_the_json_the_server_sent(cluster: FakeCluster) -> None:
    """`item_type=None` keeps dicts (what the Argo executor reads), from the LIST and the WATCH."""
    cluster.create("pods", NS, pod("a"))
    api = cluster.api_client()
    inf = Informer(
        api,
        client.CoreV1Api(api).list_namespaced_pod,
        None,
        NS,
        label_selector="app=vllm",
        backoff_s=(0.05, 0.2),
    ).start()
    try:
        assert inf.wait_current(WAIT)
        cluster.create("pods", NS, pod("b"))
        assert seen(inf, cluster)
        items = inf.snapshot().items
        assert sorted(items) == [f"{NS}/a", f"{NS}/b"]
        assert all(isinstance(i, dict) for i in items.values())
        assert items[f"{NS}/b"]["metadata"]["labels"] == {"app": "vllm"}
        assert items[f"{NS}/a"]["spec"]["containers"][0]["image"] == "busybox"
        cluster.delete("pods", NS, "a")
        assert seen(inf, cluster) and sorted(inf.snapshot().items) == [f"{NS}/b"]
    finally:
        inf.close()


def test_compare_resource_versions_like_apimachinery() -> None:
    assert compare_resource_versions("9", "10") == -1
    assert compare_resource_versions("10", "10") == 0
    assert compare_resource_versions("123", "99") == 1
    for bad in ("", "0", "007", "12a", "-1", "١٢"):
        assert compare_resource_versions(bad, "5") is None
