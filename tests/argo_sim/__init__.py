"""argo_sim: a simulated Argo Workflows controller and kubelet over `k8sfake.FakeCluster`.

The behaviour tier of cluster mode (docs/cluster.md "The Argo executor at runtime"): lowtide's
real loop and `ArgoExecutor` talk HTTP to the fake API server with the real `kubernetes`
client, while `ArgoSim.step()` plays the controllers that a cluster would run, on the test's
fake clock, through the fake's hooks (no HTTP, no RBAC). See `controller` for what it models
and what it leaves out.
"""

from .controller import ArgoSim, Script

__all__ = ["ArgoSim", "Script"]
