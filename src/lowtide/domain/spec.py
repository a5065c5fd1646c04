"""Job and step specifications as immutable values (docs/architecture.md §6.1).

These are what a validated job spec becomes; `spec_parse` builds them from YAML/JSON
documents and `spec_render.render_step` resolves a step's templates for one job id.
Must not: read files, parse text, or know about the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Named priorities; an integer in PRIORITY_RANGE may be given instead.
PRIORITY_NAMES: Mapping[str, int] = {"low": 10, "normal": 50, "high": 90}
PRIORITY_RANGE = (0, 100)
DEFAULT_GRACE_SECONDS = 30.0
#: What restarting a step costs, in seconds per GPU, when the spec does not say (loading, warm-up).
DEFAULT_RESTART_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class SecretUse:
    """A secret named by reference (`secrets:` of a job or step): the operator's secret `name`,
    put in the step's environment as `env` (None: the variable the operator configured for it).
    Only the name is ever stored; the value is read at launch (docs/architecture.md §11)."""

    name: str
    env: str | None = None


def secrets_document(uses: tuple[SecretUse, ...]) -> list[Any]:
    """`secrets:` as written in a spec: a name, or a one-key mapping {ENV_VAR: name}, per use."""
    return [u.name if u.env is None else {u.env: u.name} for u in uses]


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One step of a job: a command (or container image), its GPUs and its upstream steps."""

    name: str
    command: tuple[str, ...]
    gpus: int = 0
    image: str | None = None
    depends: tuple[str, ...] = ()
    checkpoint: bool = False
    max_retries: int | None = None  # None: the job's max_retries
    env: Mapping[str, str] = field(default_factory=dict)
    #: Not preempted during its first `min_runtime` seconds (unless a service is below min_replicas).
    min_runtime: float = 0.0
    #: Preempted more often than this, the step fails (None: no limit). Preemptions never use retries.
    max_preemptions: int | None = None
    #: Seconds a restart costs (reload, warm-up): part of the cost of choosing it as a victim.
    restart_seconds: float = DEFAULT_RESTART_SECONDS
    #: Walltime: seconds of running time over all its attempts (`policy.walltime`); None: the
    #: job's `timeout`, else the configured default.
    timeout: float | None = None
    #: Secrets by reference, on top of the job's `secrets` (names only; values at launch).
    secrets: tuple[SecretUse, ...] = ()
    #: GiB each of its GPUs must have free for it (None: any GPU lent to research will do). A GPU
    #: under a sleeping replica has its memory minus the replica's residual (`policy.placement`).
    gpu_memory_gib: float | None = None


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A validated job: a DAG of steps plus its scheduling attributes and parameters."""

    name: str
    steps: tuple[StepSpec, ...]
    team: str = "default"
    priority: int = PRIORITY_NAMES["normal"]
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    max_retries: int = 0
    params: Mapping[str, Any] = field(default_factory=dict)
    template: str | None = None  # the template it was expanded from, for the record
    #: The walltime of steps that set no `timeout` (None: the configured default).
    timeout: float | None = None
    #: Secrets every step gets (by reference; a step's own `secrets` add to them).
    secrets: tuple[SecretUse, ...] = ()

    def step(self, name: str) -> StepSpec:
        for step in self.steps:
            if step.name == name:
                return step
        raise KeyError(name)

    def retries_for(self, step: StepSpec) -> int:
        return self.max_retries if step.max_retries is None else step.max_retries

    def to_document(self) -> dict[str, Any]:
        """A plain document that `spec_parse.build_job_spec` accepts and turns back into this spec."""
        doc: dict[str, Any] = {
            "name": self.name,
            "team": self.team,
            "priority": self.priority,
            "grace_seconds": self.grace_seconds,
            "max_retries": self.max_retries,
            "params": dict(self.params),
            "steps": [],
        }
        if self.timeout is not None:
            doc["timeout"] = self.timeout
        if self.secrets:
            doc["secrets"] = secrets_document(self.secrets)
        for step in self.steps:
            s: dict[str, Any] = {"name": step.name, "command": list(step.command), "gpus": step.gpus}
            if step.gpu_memory_gib is not None:
                s["gpu_memory_gib"] = step.gpu_memory_gib
            if step.image is not None:
                s["image"] = step.image
            if step.depends:
                s["depends"] = list(step.depends)
            if step.checkpoint:
                s["checkpoint"] = True
            if step.max_retries is not None:
                s["max_retries"] = step.max_retries
            if step.env:
                s["env"] = dict(step.env)
            if step.min_runtime:
                s["min_runtime"] = step.min_runtime
            if step.max_preemptions is not None:
                s["max_preemptions"] = step.max_preemptions
            if step.restart_seconds != DEFAULT_RESTART_SECONDS:
                s["restart_seconds"] = step.restart_seconds
            if step.timeout is not None:
                s["timeout"] = step.timeout
            if step.secrets:
                s["secrets"] = secrets_document(step.secrets)
            doc["steps"].append(s)
        return doc


@dataclass(frozen=True, slots=True)
class ResolvedStep:
    """A step with every template filled in for one job: what an attempt actually runs."""

    name: str
    command: tuple[str, ...]
    gpus: int
    image: str | None
    env: Mapping[str, str]
    inputs: Mapping[str, str]  # upstream step name -> its outputs URI
    outputs: str  # this step's outputs URI (stable across attempts)
    checkpoint_dir: str | None  # stable across attempts; None unless `checkpoint: true`
    #: The job's and the step's secrets, by reference: the loop resolves them at launch.
    secrets: tuple[SecretUse, ...] = ()
    #: GiB each of its GPUs must have free (`StepSpec.gpu_memory_gib`; None: no need declared).
    gpu_memory_gib: float | None = None
