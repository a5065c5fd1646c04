"""The log port over the Kubernetes API: an Argo attempt's log is its pod's `main` container's.

Role: `PodLogReader` implements `control.log_port.LogReader` (and `LogLoss`) for attempts of the
Argo executor, with the real `kubernetes` client (36.x): `CoreV1Api.read_namespaced_pod_log`
(`GET /api/v1/namespaces/{ns}/pods/{name}/log`, RBAC `pods/log` get) and `read_namespaced_pod`
(`pods` get) for the uid check. `wiring` hands it to the API when `executor.kind` is argo.
Neighbours: `executor.parse_ref` reads the handle (`<namespace>/<pod>/<uid>`, or
`<namespace>/@<job>/<step>` before a pod was claimed: no log yet, b""); `k8s_errors` words a 403.
Must not: write anything, hold more than `offset + limit` bytes of a log, or cache anything but
which pod uids are gone (a uid is never reused, so "gone" stays true).

The API (Kubernetes v1.35 API reference, "Pod v1 / read log of the specified Pod", PodLogOptions;
kubernetes commit 000f2605, pkg/registry/core/pod/strategy.go `LogLocation`,
pkg/kubelet/kubelet_pods.go `GetContainerLogs`/`validateContainerLogStatus`,
pkg/apis/core/validation `ValidatePodLogOptions`):
- There is no byte offset. `limitBytes` (> 0, else 422) stops the output after that many bytes
  (the kubelet's LimitWriter; it may cut a line), so a read asks for `limitBytes = offset +
  limit` from the start and keeps `[offset, offset + limit)`, dropping the prefix as it streams.
  `sinceSeconds`/`sinceTime`/`tailLines` are not used: they start the output at a time or line,
  and byte offsets counted over such output would not be offsets into the log. `timestamps` is
  false (it would change the bytes) and `previous` false (Argo's pods never restart a container:
  restartPolicy Never). The client returns a text body as the repr of bytes
  (kubernetes-client/python#2596), so the body is read raw (`_preload_content=False`).
- A pod not bound to a node yet answers 204 with no body; a container waiting to start
  (`container "main" in pod "X" is waiting to start: <reason>`), one with no status yet (`is not
  available`) or terminated without a container id answer 400: all "no log yet", b"".
  A missing pod answers 404 (so does a kubelet that does not know the pod yet: pkg/kubelet/server
  `getContainerLogs`): b"", and a GET of the pod decides whether it is gone (then `lost` says why).
- The kubelet keeps a container's log in `/var/log/pods/<ns>_<pod>_<uid>/` and deletes it with
  the pod; it rotates it at `containerLogMaxSize` (default 10 MiB, `containerLogMaxFiles` 5) and
  the API serves only the current file. So once Argo garbage-collects the pod (podGC) the log is
  gone unless a cluster log system or Argo's `archiveLogs` kept it (docs/cluster.md "Logs").

Same name, another pod: Argo may make a pod of the same name again (a pending node whose pod was
deleted). The log call cannot name a uid, so the read is checked **after** it: a GET of the pod
then shows our uid, and since our pod existed before the read (its uid is in the handle) and two
pods of one name never exist at once, the log read was our pod's. Another uid or a 404 at that
GET: the bytes are dropped and the uid remembered as gone. A read that found no new bytes makes
no GET. A GET before the read would not do: the pod could be replaced between the two.

Errors: 403 (or another status an operator must fix) raises `LogUnreadable` naming the RBAC
rule; no answer, 408/409/410/429/5xx give b"" (a follower asks again) and are logged once per
run of failures; anything that is not an API error propagates.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

from kubernetes import client

from lowtide.adapters.argo import k8s_errors
from lowtide.adapters.argo.executor import parse_ref
from lowtide.control.log_port import READ_LIMIT, AttemptLogRef, LogUnreadable

__all__ = ["CONTAINER", "PodLogReader"]

log = logging.getLogger(__name__)

#: The container of an Argo pod that runs the step (argo-workflows `common.MainContainerName`).
CONTAINER = "main"
#: `limitBytes` is an int64 (PodLogOptions).
_INT64_MAX = (1 << 63) - 1
#: How many gone pod uids are remembered (each a few dozen bytes).
_GONE_KEPT = 4096
_CHUNK = 64 * 1024


class PodLogReader:
    """`LogReader` and `LogLoss` over pods/log (module docstring)."""

    def __init__(
        self, api_client: Any, *, request_timeout_s: float = 10.0, container: str = CONTAINER
    ) -> None:
        self._core = client.CoreV1Api(api_client)
        self._timeout = request_timeout_s
        self._container = container
        self._gone: OrderedDict[str, str] = OrderedDict()  # uid -> why
        self._failing = False  # a temporary failure was logged; quiet until a success

    def read(self, ref: AttemptLogRef, offset: int, limit: int = READ_LIMIT) -> bytes:
        pod = _pod_of(ref)
        if pod is None or limit <= 0 or offset >= _INT64_MAX:
            return b""
        ns, name, uid = pod
        if uid in self._gone:
            return b""
        try:
            data = self._read_log(ns, name, offset, limit)
        except Exception as exc:
            status = k8s_errors.status_of(exc)
            if status == 404:  # the pod is gone, or its kubelet does not know it yet: a GET says
                self._ok()
                self._why_gone(ns, name, uid)
                return b""
            if status == 400:  # no container log yet (waiting, no status yet)
                self._ok()
                return b""
            self._fail(exc, verb="get", resource="pods/log", namespace=ns)
            return b""
        self._ok()
        if data and self._why_gone(ns, name, uid) is not None:
            return b""  # another pod of that name answered: not this attempt's log
        return data

    def lost(self, ref: AttemptLogRef) -> str | None:
        pod = _pod_of(ref)
        if pod is None:
            return None  # no pod claimed yet: its log may still come
        ns, name, uid = pod
        why = self._gone.get(uid) or self._why_gone(ns, name, uid)
        if why is None:
            return None
        return (
            f"log not available: {why}, and Kubernetes deletes a container's log with its pod; "
            'a cluster log system or Argo\'s archiveLogs keeps it (docs/cluster.md "Logs")'
        )

    # ---------------------------------------------------------------------------------------

    def _read_log(self, ns: str, name: str, offset: int, limit: int) -> bytes:
        """Bytes [offset, offset+limit) of the pod's current log, streamed: at most `limit`
        bytes (plus one chunk) held."""
        want = min(offset + limit, _INT64_MAX)
        response = self._core.read_namespaced_pod_log(
            name,
            ns,
            container=self._container,
            limit_bytes=want,
            _preload_content=False,
            _request_timeout=self._timeout,
        )
        kept: list[bytes] = []
        seen = 0
        try:
            if response.status == 204:
                return b""
            while seen < want:
                chunk = response.read(min(_CHUNK, want - seen))
                if not chunk:
                    break
                start, seen = seen, seen + len(chunk)
                if seen > offset:
                    kept.append(chunk[max(0, offset - start) :])
        finally:
            response.close()
            response.release_conn()
        return b"".join(kept)

    def _why_gone(self, ns: str, name: str, uid: str) -> str | None:
        """Why the pod of `uid` is no more (remembered), or None while it is there. A failure to
        ask is not an answer: None (the temporary kinds logged once), LogUnreadable for a 403."""
        if uid in self._gone:
            return self._gone[uid]
        try:
            # Raw: only metadata.uid is read (no model built, no client-side validation of the rest).
            response = self._core.read_namespaced_pod(
                name, ns, _preload_content=False, _request_timeout=self._timeout
            )
            try:
                pod = json.loads(response.data)
            finally:
                response.release_conn()
        except Exception as exc:
            if k8s_errors.status_of(exc) == 404:
                return self._forget(uid, f"pod {ns}/{name} (uid {uid}) was deleted")
            self._fail(exc, verb="get", resource="pods", namespace=ns)
            return None
        now = str(((pod.get("metadata") if isinstance(pod, dict) else None) or {}).get("uid") or "")
        if now != uid:
            return self._forget(
                uid, f"pod {ns}/{name} (uid {uid}) was deleted (a new pod of that name has uid {now})"
            )
        return None

    def _forget(self, uid: str, why: str) -> str:
        self._gone[uid] = why
        while len(self._gone) > _GONE_KEPT:
            self._gone.popitem(last=False)
        return why

    def _ok(self) -> None:
        self._failing = False

    def _fail(self, exc: BaseException, *, verb: str, resource: str, namespace: str) -> None:
        status = k8s_errors.status_of(exc)
        if status is None:
            raise exc
        error = k8s_errors.classify(exc, verb=verb, resource=resource, namespace=namespace)
        if not error.temporary:
            raise LogUnreadable(str(error)) from exc
        if not self._failing:
            log.warning("reading a step's log: %s", error)
        self._failing = True


def _pod_of(ref: AttemptLogRef) -> tuple[str, str, str] | None:
    """(namespace, pod name, uid) of an Argo attempt's handle; None before a pod was claimed, or
    for a handle that is not the Argo executor's (an attempt of another executor has no pod)."""
    if ref.handle is None:
        return None
    try:
        ns, name, uid = parse_ref(ref.handle)
    except ValueError:
        return None
    return None if name.startswith("@") else (ns, name, uid)
