"""The Kubernetes client, configured once for every cluster-mode adapter (the Argo executor, the
Kubernetes service manager, the Lease elector), and reading its raw answers (`response_object`).

Credentials: a given kubeconfig file; else the pod's ServiceAccount when running in a cluster
(`KUBERNETES_SERVICE_HOST` set); else `KUBECONFIG` (or ~/.kube/config). `KUBECONFIG` is read at
call time: the `kubernetes` client reads its default path once, when it is imported
(kubernetes-client/python `config/kube_config.py`, 36.0.3).
Neighbours: `wiring` builds the adapters with it and turns `KubeConfigError` into a start-up error
naming the setting. Must not: decide anything, or be imported outside cluster mode (importing the
client costs ~0.6 s).
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

#: Where a pod finds its own namespace (the ServiceAccount token's volume).
POD_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class KubeConfigError(ValueError):
    """No usable credentials: the message says what was tried and why it failed."""


def kube_api_client(kubeconfig: str | None = None) -> Any:
    """A `kubernetes.client.ApiClient` (see the module docstring for where its credentials come
    from). Raises KubeConfigError."""
    configuration = k8s_client.Configuration()
    try:
        if kubeconfig is not None:
            k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            k8s_config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG") or None, client_configuration=configuration
            )
    except Exception as exc:  # ConfigException, a missing or unreadable file, a malformed one
        where = kubeconfig or (
            "the in-cluster ServiceAccount" if os.environ.get("KUBERNETES_SERVICE_HOST") else "KUBECONFIG"
        )
        raise KubeConfigError(f"no Kubernetes credentials from {where}: {exc}") from exc
    return k8s_client.ApiClient(configuration)


def default_namespace() -> str:
    """The pod's namespace, else the KUBECONFIG context's, else "default"."""
    try:
        with open(POD_NAMESPACE_FILE, encoding="utf-8") as fh:
            ns = fh.read().strip()
        if ns:
            return ns
    except OSError:
        pass
    try:
        _, active = k8s_config.list_kube_config_contexts(os.environ.get("KUBECONFIG") or None)
    except (k8s_config.ConfigException, OSError):
        return "default"
    return str((active or {}).get("context", {}).get("namespace") or "default")


def response_object(response: Any) -> dict[str, Any]:
    """The JSON object of an API answer read with `_preload_content=False` (its `.data` bytes), or
    of an already decoded one. Raises ValueError when the answer is not a JSON object."""
    data = response.data if hasattr(response, "data") else response
    doc = json.loads(data) if isinstance(data, bytes | str) else data
    if not isinstance(doc, dict):
        raise ValueError("the API answered something that is not an object")
    return doc
