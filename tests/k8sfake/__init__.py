"""k8sfake: a fake Kubernetes API server the unmodified `kubernetes` client talks to over HTTP.

Use: `with FakeCluster() as cluster: api = client.CoreV1Api(cluster.api_client())`.
Semantics checked against kubernetes commit 000f2605 (v1.35 development line) — file-level
citations are in each module's docstring.

Reproduced
- Resources: core/v1 pods (+ status, log), nodes (cluster-scoped, + status), events, secrets;
  apps/v1 deployments (+ status, autoscaling/v1 `scale`); autoscaling/v2
  horizontalpodautoscalers; discovery.k8s.io/v1 endpointslices; coordination.k8s.io/v1
  leases; events.k8s.io/v1 events (eventTime, reportingController/Instance, action, reason,
  type Normal|Warning, note <= 1 KiB, series count >= 2, all but series immutable:
  validation.py); custom resources argoproj.io/v1alpha1 workflows and keda.sh/v1alpha1 scaledobjects
  (through CustomObjectsApi); discovery /version, /api, /apis, /api/v1, /apis/<g>/<v>.
- One global, string, monotonically increasing resourceVersion; uid, creationTimestamp,
  generation (spec changes; any non-metadata change for CRDs without a status subresource),
  generateName; 409 AlreadyExists, 409 Conflict on a stale PUT/patch resourceVersion, 404
  NotFound, 422 Invalid, 400 BadRequest, 401, 403, 405, 410, 415, 504 — all as `Status` bodies
  (objects.py, errors.py).
- Delete: uid/resourceVersion preconditions; graceful pod deletion (deletionTimestamp,
  deletionGracePeriodSeconds, kept until `finish_pod_deletion`, immediate when grace 0 or the
  pod is unscheduled or finished); finalizers; DeleteOptions from the body else the query.
- Patches: merge, strategic merge (merge keys for the pod/deployment/node fields lowtide uses,
  `$patch: delete|replace`, `$deleteFromPrimitiveList`, `$retainKeys`), JSON patch; 415 for a
  strategic merge patch on a custom resource (patch.py).
- Pod update rules: scheduling gates only removed, nodeSelector/nodeAffinity only extended while
  gated, other spec fields immutable; nodeName + gates refused on create (validation.py).
- List: labelSelector (=, ==, !=, in, notin, exists, !exists), fieldSelector (metadata.*, and
  pods' spec.nodeName, status.phase, ...), limit/continue (consistent snapshot, 410 once
  compacted), resourceVersionMatch=Exact (410 when compacted) and a future resourceVersion
  (504) (selectors.py, server.py).
- Watch: ADDED/MODIFIED/DELETED from a resourceVersion, selector transitions as ADDED/DELETED,
  BOOKMARKs, timeoutSeconds, ERROR 410 Expired when the version left the window (watch.py).
- RBAC from rendered Role/ClusterRole/RoleBinding/ClusterRoleBinding manifests and the exact
  403 message (rbac.py).
- Faults: the next N requests matching (verb, resource[/sub]) answer 409/410/429/500/503/504
  and/or wait; the server can stop listening and come back on the same port with its state.
- Hooks for simulated controllers (no HTTP, no RBAC): get/list/create/modify/delete,
  bind_pod, finish_pod_deletion, set_pod_log, compact, last_write (the resourceVersion of the
  last write to a collection: what a caught-up watch cache has seen); each write bumps
  resourceVersion and emits watch events like an API write.

Facts about the real client and server a user of this fake must know (each pinned by a test)
- kubernetes client 36.0.3 (pinned) reads the bearer token and its "Bearer" prefix under the
  api_key name "BearerToken"; a prefix stored under the old "authorization" key is ignored and
  the server sees a bare token (configuration.py `auth_settings`). `FakeCluster.configuration`
  sets both correctly.
- client 36 returns text bodies (pods/log) as the repr of bytes ("b'...'"),
  kubernetes-client/python#2596: read logs with `_preload_content=False` and decode.
- A DELETE with a body takes its options only from the body (handlers/delete.go): passing
  `grace_period_seconds=` together with `body=V1DeleteOptions(...)` silently loses the grace
  period; put it in the body.
- The client's `patch_*` for built-in kinds sends a dict body as strategic merge patch (a list
  as JSON patch); CustomObjectsApi sends merge patch (rest.py, api_client.py).
- `watch.Watch().stream(...)` is lazy: its request (and so its starting point) is made on the
  first iteration; pass `resource_version=` from a list to avoid missing or re-listing events.
  With `timeout_seconds` it raises ApiException(410) on Expired; without, it retries once.
- A fresh fake starts at resourceVersion 100 ("0" means "any version" to the API).

Deliberately NOT reproduced (do not trust the fake for these)
- Admission (webhooks, PodSecurity, LimitRange, ResourceQuota, PriorityClass resolution),
  defaulting beyond a few pod/deployment fields, and full OpenAPI schema validation: unknown
  fields are stored, not rejected. Use `kubernetes-validate` for manifests.
- Controllers: no scheduler, kubelet, Deployment/ReplicaSet controller, garbage collector
  (ownerReferences and propagationPolicy are stored only), HPA, KEDA or Argo controller; the
  behaviour tier's simulators drive those through the hooks.
- Namespaces are not objects (any namespace name is accepted); no deletecollection; no
  server-side apply (415); no protobuf/CBOR, only JSON; no pods/exec, attach, portforward,
  eviction or binding subresources; no field managers (managedFields is absent).
- dryRun requests are refused with 400 (the fake cannot validate without persisting).
- Timestamps (creation, deletion deadlines) come from the injected clock; watch timeouts,
  bookmark intervals and injected latency are wall-clock.
- Watch bookmarks come every `bookmark_interval` seconds (real: about a minute, and before
  the timeout); the real server also randomises watch timeouts when timeoutSeconds is unset.
- The pod "may not change fields" message lists changed fields, not Go's cmp.Diff.
- Only the client-visible Status shape of errors is faithful; timing (latency, rate limits,
  priority and fairness) is whatever a test injects.
- A missing or unknown token is 401; real clusters with anonymous auth answer a request with
  no token as user system:anonymous (usually 403). List/watch with a metadata.name field
  selector is not matched against resourceNames rules. core/v1 and events.k8s.io/v1 events
  are stored apart (the real server serves one storage through both APIs), and events have no
  TTL (the real server keeps them an hour by default). sendInitialEvents / streaming lists are
  not supported. argo-server's REST API
  (Hera's WorkflowsService) is not served: this fake is the Kubernetes API only.
"""

from .server import ADMIN_TOKEN, FakeCluster

__all__ = ["ADMIN_TOKEN", "FakeCluster"]
