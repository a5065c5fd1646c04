"""The backends of the cluster test tier (docs/cluster.md "The cluster test tier"): one small
interface, `Backend`, under scenarios written once (`test_cluster_scenarios.py`).

- `FakeBackend` (every `make test`): the Argo world of `tests/argo_world.py`, lowtide's real loop
  and `ArgoExecutor` with the unmodified `kubernetes` client against the fake API server, while
  `argo_sim` plays Argo's controller and the kubelet; time is the loop's fake clock (a round is
  one simulated second). What a step does is given to the simulator (`Run` → `argo_sim.Script`).
- `RealBackend` (`make test-cluster`, marker `cluster`): a real cluster with Argo from
  `LOWTIDE_CLUSTER_KUBECONFIG`, in `LOWTIDE_CLUSTER_NAMESPACE`, steps in `LOWTIDE_CLUSTER_IMAGE`
  (an image with `lowtide-step-shim` and `sh`). Thin on purpose: a `lowtide.yaml` with
  `executor.kind: argo` and that kubeconfig goes through `wiring.build_argo_executor`, as
  `lowtide up` does; GPU nodes are read from the cluster (allocatable `nvidia.com/gpu`) unless
  `LOWTIDE_CLUSTER_NODES` names them (`node:gpus,...`). The loop runs on the wall clock (a
  round: sleep `poll_s`, then tick), every wait bounded. What a step does is its command
  (`step_command`: `sh -c` on `LOWTIDE_ATTEMPT` and `LOWTIDE_RESUME_FROM`), so the real
  kubelet, shim and Argo executor produce the exits. The Workflows it made are deleted at the end.
  Never run against a real cluster by its authors (none was available); `test_cluster_scenarios`
  runs it against the fake API server to keep its plumbing alive.

Both backends read back through the Kubernetes API with the same client calls (`workflow`,
`pods`), and both store jobs with fresh random ids (a real namespace keeps old Workflows).
Must not: hold assertions of a scenario (they are in the test module).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from argo_sim import Script
from argo_world import World, argo_world
from lowtide.adapters.argo.pods import argo_node_id
from lowtide.control.clock import FakeClock
from lowtide.control.records import AttemptRecord, NewJob
from lowtide.domain.gpus import Node
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step
from lowtide.policy.outcomes import RetryPolicy
from lowtide.sim.harness import LoopHarness
from lowtide.store.memory import MemoryStore

Obj = dict[str, Any]
GROUP, VERSION, PLURAL = "argoproj.io", "v1alpha1", "workflows"
GPU = "nvidia.com/gpu"

#: The environment of the real backend.
ENV_KUBECONFIG = "LOWTIDE_CLUSTER_KUBECONFIG"
ENV_NAMESPACE = "LOWTIDE_CLUSTER_NAMESPACE"
ENV_IMAGE = "LOWTIDE_CLUSTER_IMAGE"
ENV_NODES = "LOWTIDE_CLUSTER_NODES"
ENV_ARTIFACT_ROOT = "LOWTIDE_CLUSTER_ARTIFACT_ROOT"
#: The scenarios' steps read and write no artifacts; the setting must still be remote.
DEFAULT_ARTIFACT_ROOT = "s3://lowtide-cluster-tier/unused"


@dataclass(frozen=True)
class Run:
    """What one attempt of a step does (the n-th `Run` is attempt n, `LOWTIDE_ATTEMPT`; the last
    one repeats): run `seconds`, then exit `exit_code`; or, with `until_notice`, run until
    SIGTERM (the shim then exits 75). With `resume_suffix`, the attempt checks that
    `LOWTIDE_RESUME_FROM` ends with it (else exits 97): on a real cluster that proves the value
    reached the step; the fake's kubelet runs no command (the scenario reads the pod's annotation)."""

    seconds: float = 2.0
    exit_code: int = 0
    until_notice: bool = False
    resume_suffix: str | None = None


MISSING_RESUME_EXIT = 97


def step_command(runs: Sequence[Run]) -> list[str]:
    """The step's argv on a real cluster: `sh -c` choosing the attempt's `Run`."""

    def body(run: Run) -> str:
        check = ""
        if run.resume_suffix is not None:
            want = "*" + shlex.quote(run.resume_suffix)  # a glob, then the suffix as a literal
            check = (
                f'case "$LOWTIDE_RESUME_FROM" in {want}) ;; '
                f'*) echo "LOWTIDE_RESUME_FROM=$LOWTIDE_RESUME_FROM" >&2; exit {MISSING_RESUME_EXIT};; esac; '
            )
        if run.until_notice:
            return check + "exec sleep 100000"  # SIGTERM ends `sleep`; the shim exits 75
        return check + f"sleep {run.seconds:g}; exit {run.exit_code}"

    cases = [f"{n}) {body(run)};;" for n, run in enumerate(runs[:-1], start=1)]
    cases.append(f"*) {body(runs[-1])};;")
    return ["sh", "-c", f'case "$LOWTIDE_ATTEMPT" in {" ".join(cases)} esac']


def sim_script(run: Run) -> Script:
    """The fake kubelet's script for one `Run` (SIGTERM: the shim exits 75 after 1 s)."""
    if run.until_notice:
        return Script(run_s=10**9, on_term="checkpoint", term_s=1.0)
    return Script(run_s=run.seconds, exit_code=run.exit_code)


class Backend:
    """A cluster under lowtide's real loop: submit, say what steps do, wait, read back."""

    name: str
    h: LoopHarness
    api: Any  # a kubernetes ApiClient, for reads
    namespace: str

    # -- what a backend provides -----------------------------------------------------------

    def script(self, job: str, step: str, runs: Sequence[Run]) -> None:
        """Tell the cluster what the step's attempts do (the fake's kubelet; a real one runs the
        command `step_command` already put in the job)."""
        raise NotImplementedError

    def round(self) -> None:
        """Let the cluster and the loop move on: one tick after the cluster's time passed."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------

    def submit(self, doc: Mapping[str, Any], runs: Mapping[str, Sequence[Run]]) -> str:
        """Store a job as the API does (a fresh random id), each step's command from `runs`."""
        steps = [{**s, "command": step_command(runs[s["name"]])} for s in doc["steps"]]
        h = self.h
        job_id = f"job-{secrets.token_hex(6)}"
        spec = build_job_spec({**doc, "steps": steps}, max_gpus_per_node=max(n.gpu_count for n in h.nodes))
        resolved = tuple(render_step(spec, s, job_id=job_id, layout=h.layout) for s in spec.steps)
        h.store.create_job(NewJob(job_id, spec, resolved, "", "cluster-tier", h.clock.now()))
        for step, step_runs in runs.items():
            self.script(job_id, step, step_runs)
        return job_id

    def wait(self, what: str, until: Callable[[], bool], timeout_s: float) -> None:
        """Rounds until `until()`, at most `timeout_s` of the backend's time."""
        deadline = self.h.clock.now() + timeout_s
        while not until():
            if self.h.clock.now() > deadline:
                raise AssertionError(f"{self.name}: not reached within {timeout_s:g}s: {what}")
            self.round()

    def workflow(self, job: str) -> Obj:
        api = client.CustomObjectsApi(self.api)
        obj: Obj = api.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, job)
        return obj

    def pods(self, job: str, step: str | None = None) -> list[Obj]:
        selector = f"lowtide.io/job={job}" + (f",lowtide.io/step={step}" if step else "")
        response = client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=selector, _preload_content=False
        )
        items: list[Obj] = json.loads(response.data)["items"]
        return items

    def retry_children(self, job: str, task: str) -> list[Obj]:
        """The Pod children of the task's Retry node, in order."""
        nodes = (self.workflow(job).get("status") or {}).get("nodes") or {}
        retry = nodes.get(argo_node_id(job, f"{job}.{task}"))
        return [nodes[c] for c in retry["children"]] if retry else []

    def job_state(self, job: str) -> str:
        return self.h.store.job(job).state.value

    def attempts(self, job: str, step: str | None = None) -> list[AttemptRecord]:
        return [a for a in self.h.store.job_detail(job).attempts if step is None or a.step_name == step]

    def running(self, job: str, step: str) -> bool:
        """The step's latest attempt runs (its pod is Running), not merely booked."""
        atts = self.attempts(job, step)
        return bool(atts) and atts[-1].state.value == "RUNNING"


class FakeBackend(Backend):
    """The fake API server and the simulated Argo controller and kubelet (module docstring)."""

    name = "fake"

    def __init__(self, world: World) -> None:
        self.world = world
        self.h = world.h
        self.api = world.cluster.api_client()
        self.namespace = world.sim.namespace

    def script(self, job: str, step: str, runs: Sequence[Run]) -> None:
        self.world.sim.script(job, step, *(sim_script(r) for r in runs))

    def round(self) -> None:
        self.world.sim.step()
        self.h.tick()

    def close(self) -> None:
        self.api.close()


def fake_backend() -> Iterator[FakeBackend]:
    for world in argo_world():
        backend = FakeBackend(world)
        yield backend
        backend.close()


@dataclass(frozen=True)
class RealSettings:
    kubeconfig: str
    namespace: str
    image: str
    nodes: str | None = None
    artifact_root: str = DEFAULT_ARTIFACT_ROOT

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RealSettings | None:
        """None when `LOWTIDE_CLUSTER_KUBECONFIG` is unset; ValueError naming what else is missing."""
        kubeconfig = env.get(ENV_KUBECONFIG)
        if not kubeconfig:
            return None
        missing = [name for name in (ENV_NAMESPACE, ENV_IMAGE) if not env.get(name)]
        if missing:
            raise ValueError(f"the cluster tier needs {', '.join(missing)} with {ENV_KUBECONFIG}")
        return cls(
            kubeconfig=kubeconfig,
            namespace=env[ENV_NAMESPACE],
            image=env[ENV_IMAGE],
            nodes=env.get(ENV_NODES) or None,
            artifact_root=env.get(ENV_ARTIFACT_ROOT) or DEFAULT_ARTIFACT_ROOT,
        )


def parse_nodes(text: str) -> tuple[Node, ...]:
    """`node:gpus,...` (e.g. `gpu-a:2,gpu-b:1`)."""
    nodes = []
    for item in text.split(","):
        name, _, count = item.strip().partition(":")
        nodes.append(Node(name, tuple(range(int(count)))))
    return tuple(nodes)


def gpu_nodes(api: Any) -> tuple[Node, ...]:
    """The cluster's nodes with allocatable GPUs (the device plugin's `nvidia.com/gpu`), by name."""
    response = client.CoreV1Api(api).list_node(_preload_content=False)
    nodes = []
    for item in json.loads(response.data)["items"]:
        count = int(((item.get("status") or {}).get("allocatable") or {}).get(GPU, "0"))
        if count > 0:
            nodes.append(Node(item["metadata"]["name"], tuple(range(count))))
    return tuple(sorted(nodes, key=lambda n: n.name))


class RealBackend(Backend):
    """A real cluster with Argo, on the wall clock (module docstring)."""

    name = "real"

    def __init__(self, settings: RealSettings, *, poll_s: float = 1.0) -> None:
        from lowtide.adapters.kube_client import kube_api_client  # noqa: PLC0415 - cluster mode only
        from lowtide.config import load_settings  # noqa: PLC0415
        from lowtide.wiring import build_argo_executor  # noqa: PLC0415

        self.settings = settings
        self.poll_s = poll_s
        self.namespace = settings.namespace
        self.api = kube_api_client(settings.kubeconfig)
        nodes = parse_nodes(settings.nodes) if settings.nodes else gpu_nodes(self.api)
        if not nodes:
            raise RuntimeError(f"no node with allocatable {GPU}: set {ENV_NODES}=node:gpus,...")
        self._dir = tempfile.TemporaryDirectory(prefix="lowtide-cluster-tier-")
        config = Path(self._dir.name) / "lowtide.yaml"
        argo = {
            "namespace": settings.namespace,
            "kubeconfig": settings.kubeconfig,
            "default_image": settings.image,
        }
        config.write_text(
            json.dumps(
                {
                    "executor": {"kind": "argo"},
                    "artifact_root": settings.artifact_root,
                    "argo": argo,
                    "nodes": [{"name": n.name, "gpus": n.gpu_count} for n in nodes],
                }
            )
        )
        self.store = store = MemoryStore()
        executor = build_argo_executor(load_settings(config), store, nodes)  # type: ignore[arg-type]
        self.h = LoopHarness(
            nodes=nodes,
            layout=ArtifactLayout(settings.artifact_root, str(Path(self._dir.name) / "work")),
            clock=FakeClock(time.time()),  # moved with the wall clock at every round
            store=store,
            executor=executor,
            retry=RetryPolicy(5.0, 5.0),
        )
        self.h.recover()

    def script(self, job: str, step: str, runs: Sequence[Run]) -> None:
        """Nothing: on a real cluster the step's command does what `runs` say."""

    def round(self) -> None:
        time.sleep(self.poll_s)
        self.h.tick(dt=max(0.0, time.time() - self.h.clock.now()), check=False)

    def close(self) -> None:
        api = client.CustomObjectsApi(self.api)
        for job in self.store.list_jobs(limit=-1):
            try:
                api.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, job.id)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        self.h.executor.close()
        self.api.close()
        self._dir.cleanup()


def real_backend(settings: RealSettings, **kw: Any) -> Iterator[RealBackend]:
    backend = RealBackend(settings, **kw)
    try:
        yield backend
    finally:
        backend.close()
