"""Compile a job into one Argo Workflow: a pure function from a `JobSpec` to the Workflow object.

Role: `compile_workflow(spec, job_id=..., settings=ArgoSettings(...))` returns the
`argoproj.io/v1alpha1` Workflow a job becomes in cluster mode (docs/cluster.md "Jobs as Argo
Workflows"), plus the mapping from step names to the DAG task/template names it chose.
Neighbours: `domain.spec_render.render_step` fills the placeholders (as `lowtide submit` does),
`control.contract.step_environment` computes the step contract (docs/architecture.md §6.2), `expr`
checks the retry expression, `cli.argo_cmd` prints the result; the runtime executor submits it.
Must not: read configuration, files or the clock, talk to Kubernetes, or decide admission.

The mechanism, and the Argo facts it rests on (argo-workflows v4.1.2, commit f016ad89):

- **One Workflow per job generation**: generation 0 is named after the job id (so a repeated
  create is a 409, never a second job); an entry DAG template `lowtide-job` whose tasks are the
  steps in topological order, each with `dependencies` on its upstream steps; one container
  template per step. A job reopened by `lowtide retry` (`policy.retry`) cannot go on in its
  stopped Workflow (Argo runs no more pods in a Workflow with `spec.shutdown`), so each retry is a
  new generation: a Workflow named `<job id>-r<N>` (`workflow_name`; N from the retry's time as
  the store keeps it, `job_generation`), annotated `lowtide.io/generation: N`, holding only the
  steps lowtide has not SUCCEEDED, their dependencies on succeeded steps dropped (inputs and
  outputs are object-storage URIs the step reads itself, not Argo artifacts: the DAG only orders).
  The name is deterministic, so a restart or a create whose answer was lost gets the same 409.
- **Names** are DNS-1123 labels (a-z, 0-9, '-', at most 63), stricter than Argo's template/task
  rule `[a-zA-Z0-9][-a-zA-Z0-9]*` up to 128 (workflow/validate/validate.go) and its 63-character
  workflow name. A name that is not one already, or that collides, gets a hash suffix; the
  step → name mapping is returned and kept in the annotation `lowtide.io/steps`.
- **The step contract as env**: what `step_environment` gives, with three cluster changes:
  `LOWTIDE_NODE` comes from the downward API (`spec.nodeName`), `CUDA_VISIBLE_DEVICES` is left to
  the device plugin (the container sees only its GPUs), and `LOWTIDE_ATTEMPT` is the expression
  template `{{=asInt(retries) + 1}}` (1-based, like the local executor); in a retried generation
  it is `{{=asInt(retries) + 1 + K}}`, K the attempts the step had before the retry
  (`attempts_before`, from the store), so the numbers go on across generations instead of
  starting at 1 again (Argo counts a new Workflow's retries from 0); both are checked with
  `expr.check_template_expression`. Argo substitutes the whole
  template JSON, labels and env included, for each retry child with `retries` = the child's index
  (operator.go `executeTemplate` → `common.SubstituteParams`, workflow/common/util.go), and
  `retries` is one of the late-bound names an expression template waits for
  (util/template/expression_template.go `variablesToCheck`); Argo's submit-time validation
  skips expression templates (util/template/validate.go). The same value is the pod label
  `lowtide.io/attempt`. Per-attempt values the Workflow cannot carry arrive as pod annotations set
  at admission (`LOWTIDE_RESUME_FROM`), read through a downward-API file (`PODINFO_VOLUME`) by the
  step shim. The step token (a secret) is not an annotation: each GPU template mounts the key of
  its step label from the Workflow's Secret `<workflow name>-step-tokens` (`TOKEN_VOLUME`, `optional`, mode
  0444) and names the file in `LOWTIDE_STEP_TOKEN_FILE`; the executor writes the attempt's token
  there before it removes the gate (`step_tokens`). CPU-only templates have no token volume (their
  pod may start before the token is written). Parameters are also listed in
  `spec.arguments.parameters` (shown by the Argo UI); commands already have their values filled.
- **Inputs, outputs and checkpoints** are URIs under the artifact root, which must be remote
  (`s3://...`): a pod has no access to lowtide's local disk. Object storage credentials come from a
  Kubernetes Secret (`storage_secret`, `envFrom`), never inlined; so do the job's secrets
  (`secretKeyRef`, key `secret_key` of the Secret named like the lowtide secret).
- **GPU steps** get `resources.limits["nvidia.com/gpu"]` and a `podSpecPatch` (a strategic merge
  patch Argo applies to the pod spec, workflowpod.go `processPodSpecPatch`) adding the scheduling
  gate `lowtide.io/admission` and `terminationGracePeriodSeconds` = job grace + margin. lowtide
  admits an attempt by patching the pod (node pin, gate removed); CPU-only steps are not gated.
  Every template sets `priorityClassName` to the research class.
- **Retries**: `retryStrategy: {retryPolicy: Always, expression: E}` with
  E = `lastRetry.exitCode == "<interrupted>" || lastRetry.message contains "pod deleted" ||
  asInt(retries) < <max_retries>`. No `limit` (Argo stops at `limit` whatever the expression:
  operator.go `processNodeRetries`), no `backoff` (its `maxDuration` is a deadline), no template
  `timeout`/`pendingTimeout` and no workflow `activeDeadlineSeconds`: they all count time spent
  gated (waiting for lowtide's admission) as running time. "pod deleted" is the message Argo
  writes on a node whose pod vanished (operator.go `podReconciliation`). `retries` counts every
  earlier child, preemptions included, so the third clause is coarser than the local executor's
  rule (preemptions use no retry): lowtide's store stays the judge and can stop a job. In a
  retried generation `retries` counts that Workflow's children only, so the clause means
  "retries left in this generation" and N stays `max_retries`: `lowtide retry` gives the step a
  fresh budget (`policy.retry`: `retries_used` = 0); only the attempt number carries an offset.
- **The shim**: the container's command is the shim (`shim_command`, default
  `["lowtide-step-shim", "--"]`), the step's argv its `args`. The in-image shim must do what
  `adapters.step_shim` does locally and more: run the step as a child; on SIGTERM write the
  notice file (`LOWTIDE_NOTICE_FILE`, on the `emptyDir` mounted at `run_dir`) with the deadline,
  forward SIGTERM to the step, give it `LOWTIDE_GRACE_SECONDS`, then SIGKILL it (the pod's grace
  is larger by the margin, so the shim finishes first); exit with `LOWTIDE_INTERRUPTED_EXIT_CODE`
  when it was given notice and the step did not complete, and otherwise with the step's own code
  (a step's own use of the interrupted code is turned into 1). It writes `completed` to
  `LOWTIDE_RESULT_FILE` exactly when it exits 0; Argo reports that file as the output parameter
  `lowtide-result`, so a Succeeded node without it is the "Succeeded after SIGTERM" hazard
  (`node_status`).
- **The interrupted exit code** defaults to 75 (EX_TEMPFAIL in sysexits.h: "temporary failure;
  the user is invited to retry"). Not 143: a process killed by SIGTERM without a shim exits 143
  too, and so may a step's own `timeout` wrapper; with no `limit`, a code that a real failure can
  produce would retry forever. 75 is no signal's code (those are 128 + n) and only the shim,
  after a SIGTERM it received, exits with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from lowtide.adapters.argo.expr import ExprError, check_retry_expression, check_template_expression
from lowtide.control.contract import step_environment
from lowtide.domain.layout import ArtifactLayout, is_remote, join_uri
from lowtide.domain.spec import JobSpec, ResolvedStep, StepSpec
from lowtide.domain.spec_render import param_text, render_step, topological_order

__all__ = [
    "ADMISSION_GATE",
    "ANNOTATION_GENERATION",
    "API_VERSION",
    "ATTEMPT_VALUE",
    "DAG_TEMPLATE",
    "LABEL_ATTEMPT",
    "LABEL_JOB",
    "LABEL_STEP",
    "RESULT_COMPLETED",
    "RESULT_PARAMETER",
    "TOKEN_DIR",
    "ArgoCompileError",
    "ArgoSettings",
    "CompiledWorkflow",
    "NothingLeftToRun",
    "attempt_value",
    "compile_workflow",
    "dns_label",
    "job_generation",
    "retry_expression",
    "settings_problems",
    "token_secret_name",
    "workflow_name",
]

API_VERSION = "argoproj.io/v1alpha1"
ADMISSION_GATE = "lowtide.io/admission"
LABEL_JOB = "lowtide.io/job"
LABEL_STEP = "lowtide.io/step"
LABEL_ATTEMPT = "lowtide.io/attempt"
ANNOTATION_STEPS = "lowtide.io/steps"
ANNOTATION_JOB_NAME = "lowtide.io/job-name"
#: On a retried job's Workflow: its generation N (the name's `-r<N>`); generation 0 has none.
ANNOTATION_GENERATION = "lowtide.io/generation"
#: The entry DAG template's name (a step of that name gets a suffixed one).
DAG_TEMPLATE = "lowtide-job"
#: The attempt number (1-based) as an Argo expression template, resolved per retry child.
ATTEMPT_VALUE = "{{=asInt(retries) + 1}}"


def attempt_value(before: int = 0) -> str:
    """The attempt number as an expression template: `ATTEMPT_VALUE` for a step with no earlier
    attempts, else `{{=asInt(retries) + 1 + <before>}}` (a retried generation; module docstring)."""
    if before < 0:
        raise ArgoCompileError(f"a step cannot have had {before} attempts")
    text = ATTEMPT_VALUE if before == 0 else f"{{{{=asInt(retries) + 1 + {before}}}}}"
    try:
        check_template_expression(text)
    except ExprError as exc:  # pragma: no cover - the text above is fixed
        raise ArgoCompileError(f"attempt expression {text!r}: {exc}") from None
    return text


RESULT_PARAMETER = "lowtide-result"
RESULT_COMPLETED = "completed"
RUN_VOLUME = "lowtide-run"
#: A downward-API volume with the pod's annotations (the attempt's resume point, set at admission).
PODINFO_VOLUME = "lowtide-podinfo"
GPU_RESOURCE = "nvidia.com/gpu"
#: The job's token Secret mounted read-only (GPU templates only): the attempt's step token.
TOKEN_VOLUME = "lowtide-step-token"  # noqa: S105 - a volume name, not a token
TOKEN_DIR = "/var/run/lowtide-token"  # noqa: S105 - a mount path, not a token
#: Files of a secret volume are owned by root; the compiler sets no securityContext, so the
#: step may run as any user: 0444 lets a non-root step read it (only this pod mounts it).
TOKEN_FILE_MODE = 0o444
TOKEN_SECRET_SUFFIX = "-step-tokens"  # noqa: S105 - a name suffix, not a token
_MAX_LABEL = 63
_LABEL_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
_ENV_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class ArgoCompileError(ValueError):
    """A job or setting that cannot become a Workflow; the message names where and why."""


class NothingLeftToRun(ArgoCompileError):
    """A retried generation whose steps all SUCCEEDED: no Workflow to build, but its name is known
    (`workflow`: the one the job ran in, which `end_job` stops)."""

    def __init__(self, workflow: str) -> None:
        super().__init__(f"every step of {workflow} SUCCEEDED: nothing is left to run")
        self.workflow = workflow


@dataclass(frozen=True, slots=True)
class ArgoSettings:
    """What the compiler needs from the installation (`config.ArgoConfig` converted by the CLI)."""

    #: Inputs, outputs and checkpoints: a remote fsspec URL (`s3://bucket/prefix`).
    artifact_root: str
    namespace: str = "lowtide"
    service_account: str | None = None
    research_priority_class: str = "lowtide-research"
    #: Added to the job's grace for the pod's terminationGracePeriodSeconds.
    grace_margin_seconds: float = 15.0
    interrupted_exit_code: int = 75
    shim_command: tuple[str, ...] = ("lowtide-step-shim", "--")
    #: The image of steps that name none (None: every step must name one).
    default_image: str | None = None
    #: Where the shim's emptyDir is mounted (notice file, result file).
    run_dir: str = "/var/run/lowtide"
    api_url: str | None = None
    #: A Kubernetes Secret whose keys become env of every step (object storage credentials).
    storage_secret: str | None = None
    #: The key of a job secret's value inside the Kubernetes Secret named like it.
    secret_key: str = "value"  # noqa: S105 - the name of a key in a Secret, not a value
    #: lowtide secret name -> the variable it fills, for uses that name no variable.
    secret_env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = settings_problems(self)
        if problems:
            raise ArgoCompileError("argo settings: " + "; ".join(problems))


def settings_problems(s: ArgoSettings) -> list[str]:
    """Every reason `s` cannot be used, each naming its field."""
    problems: list[str] = []
    if not s.artifact_root:
        problems.append(
            "artifact_root is not set: cluster mode needs remote object storage (s3://bucket/prefix)"
        )
    elif not is_remote(s.artifact_root) or s.artifact_root.startswith(("memory://", "file://")):
        problems.append(
            f"artifact_root {s.artifact_root!r} must be remote object storage (e.g. s3://bucket/prefix): "
            "pods cannot reach lowtide's local disk"
        )
    for name, value in (("namespace", s.namespace), ("research_priority_class", s.research_priority_class)):
        if not _LABEL_RE.fullmatch(value):
            problems.append(f"{name} {value!r} is not a DNS-1123 label")
    if s.service_account is not None and not _LABEL_RE.fullmatch(s.service_account):
        problems.append(f"service_account {s.service_account!r} is not a DNS-1123 label")
    if s.storage_secret is not None and not _LABEL_RE.fullmatch(s.storage_secret):
        problems.append(f"storage_secret {s.storage_secret!r} is not a DNS-1123 label")
    if not (math.isfinite(s.grace_margin_seconds) and 0 <= s.grace_margin_seconds <= 3600):
        problems.append("grace_margin_seconds must be between 0 and 3600")
    if not 1 <= s.interrupted_exit_code <= 125:
        problems.append(
            f"interrupted_exit_code {s.interrupted_exit_code} must be 1..125 "
            "(0 is success, 126/127 mean 'cannot run', 128+n is death by signal n)"
        )
    if not s.shim_command or any(not part for part in s.shim_command):
        problems.append("shim_command must be a non-empty list of non-empty strings")
    if not s.run_dir.startswith("/") or s.run_dir.rstrip("/") in ("", "/var/run/argo", TOKEN_DIR):
        problems.append(f"run_dir {s.run_dir!r} must be an absolute path of its own")
    if not re.fullmatch(r"[-._a-zA-Z0-9]{1,253}", s.secret_key):
        problems.append(f"secret_key {s.secret_key!r} is not a valid Secret key")
    for name, env in s.secret_env.items():
        if not _ENV_RE.fullmatch(env):
            problems.append(f"secret_env[{name!r}]: {env!r} is not a variable name")
    return problems


@dataclass(frozen=True, slots=True)
class CompiledWorkflow:
    """The Workflow object and the names it gave: step name -> DAG task (= template) name."""

    manifest: dict[str, Any]
    names: Mapping[str, str]

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


def token_secret_name(workflow: str) -> str:
    """The step-token Secret of the Workflow named `workflow` (a job id, or `<job id>-r<N>`):
    a DNS-1123 subdomain, as a Workflow name is a label of at most 63."""
    return f"{workflow}{TOKEN_SECRET_SUFFIX}"


def workflow_name(job_id: str, generation: int = 0) -> str:
    """The name of the job's Workflow of `generation`: the job id for 0, else `<job id>-r<N>`."""
    if generation < 0:
        raise ArgoCompileError(f"generation {generation} is negative")
    return job_id if generation == 0 else f"{job_id}-r{generation}"


def job_generation(retried_at: Mapping[str, float | None], succeeded: Collection[str]) -> int:
    """The generation of a job's current Workflow, from what the store keeps of its steps:
    `retried_at` (step name -> when `lowtide retry` last reopened it, None if never) and the
    steps that SUCCEEDED. 0 for a job never retried; else the time of the latest retry in whole
    milliseconds (at least 1), so two retries of one job within one second still differ.

    A retry reopens every step that has not SUCCEEDED and stamps them all with its time
    (`store.jobs_repo.retry_job`); a SUCCEEDED step is never reopened later. So every step not
    SUCCEEDED carries the latest retry's time, whatever the clock did between retries: they are
    read first. Only when all steps SUCCEEDED (nothing left to launch; `end_job` of a SUCCEEDED
    job) is it the newest stamp of all."""
    unfinished = [t for name, t in retried_at.items() if name not in succeeded]
    stamps = [t for t in (unfinished or retried_at.values()) if t is not None]
    if not stamps:
        return 0
    return max(1, math.floor(max(stamps) * 1000))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def dns_label(text: str, *, taken: frozenset[str] = frozenset()) -> str:
    """`text` as a DNS-1123 label (a-z, 0-9, '-', 1..63, alphanumeric at both ends), unchanged
    when it is one already and not in `taken`; otherwise sanitized with an 8-hex-digit suffix of
    its hash, so two different texts never end up with one name by sanitizing."""
    if _LABEL_RE.fullmatch(text) and text not in taken:
        return text
    base = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    base = re.sub(r"-{2,}", "-", base)[: _MAX_LABEL - 9].strip("-") or "x"
    for salt in range(100):
        candidate = f"{base}-{_digest(text if salt == 0 else f'{text}#{salt}')}"
        if candidate not in taken:
            return candidate
    raise ArgoCompileError(f"cannot find a free name for {text!r}")  # pragma: no cover - 100 hash collisions


def retry_expression(interrupted_exit_code: int, max_retries: int) -> str:
    """The retry expression of a step (see the module docstring), checked against Argo's scope."""
    text = (
        f'lastRetry.exitCode == "{interrupted_exit_code}" || lastRetry.message contains "pod deleted"'
        f" || asInt(retries) < {max_retries}"
    )
    try:
        check_retry_expression(text)
    except ExprError as exc:  # pragma: no cover - the text above is fixed
        raise ArgoCompileError(f"retry expression {text!r}: {exc}") from None
    return text


def _no_argo_braces(value: str, where: str) -> None:
    """Argo substitutes `{{...}}` anywhere in a template (common.SubstituteParams): a rendered
    value that still holds `{{` would be read as Argo's, not passed through."""
    if "{{" in value:
        raise ArgoCompileError(f"{where}: contains '{{{{', which Argo would read as its own template")


def _env_list(
    env: Mapping[str, str], resolved: ResolvedStep, settings: ArgoSettings, where: str, attempt: str
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for key, value in env.items():
        if key == "LOWTIDE_NODE":
            items.append({"name": key, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
        elif key == "LOWTIDE_ATTEMPT":
            items.append({"name": key, "value": attempt})
        else:
            _no_argo_braces(value, f"{where}.env.{key}")
            items.append({"name": key, "value": value})
    names = {item["name"] for item in items}
    for use in resolved.secrets:
        var = use.env or settings.secret_env.get(use.name)
        if var is None:
            raise ArgoCompileError(
                f"{where}.secrets: secret {use.name!r} names no variable and argo.secret_env has none for it"
            )
        if var in names:
            raise ArgoCompileError(f"{where}.secrets: {use.name!r} would set {var}, which is already set")
        names.add(var)
        ref = {"name": dns_label(use.name), "key": settings.secret_key}
        items.append({"name": var, "valueFrom": {"secretKeyRef": ref}})
    return items


def _contract_env(
    spec: JobSpec, resolved: ResolvedStep, job_id: str, settings: ArgoSettings
) -> dict[str, str]:
    env = step_environment(
        job_id=job_id,
        attempt=1,  # replaced by attempt_value(...)
        node="",  # replaced by the downward API
        gpus=tuple(range(resolved.gpus)),
        resolved=resolved,
        params=spec.params,
        grace_seconds=spec.grace_seconds,
        notice_path=join_uri(settings.run_dir, "NOTICE"),
        last_checkpoint=None,
        api_url=settings.api_url,
        step_token=None,
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)  # the device plugin decides what the container sees
    env["LOWTIDE_INTERRUPTED_EXIT_CODE"] = str(settings.interrupted_exit_code)
    env["LOWTIDE_RESULT_FILE"] = join_uri(settings.run_dir, "result")
    return env


def _step_template(
    spec: JobSpec,
    step: StepSpec,
    resolved: ResolvedStep,
    *,
    name: str,
    job_label: str,
    job_id: str,
    workflow: str,
    settings: ArgoSettings,
    attempts_before: int,
) -> dict[str, Any]:
    where = f"steps.{step.name}"
    attempt = attempt_value(attempts_before)
    image = resolved.image or settings.default_image
    if not image:
        raise ArgoCompileError(f"{where}.image: cluster mode runs images; give one or set argo.default_image")
    _no_argo_braces(image, f"{where}.image")
    for i, arg in enumerate(resolved.command):
        _no_argo_braces(arg, f"{where}.command[{i}]")
    env = _env_list(_contract_env(spec, resolved, job_id, settings), resolved, settings, where, attempt)
    container: dict[str, Any] = {
        "name": "main",
        "image": image,
        "command": list(settings.shim_command),
        "args": list(resolved.command),
        "env": env,
        "volumeMounts": [
            {"name": RUN_VOLUME, "mountPath": settings.run_dir},
            {"name": PODINFO_VOLUME, "mountPath": join_uri(settings.run_dir, "podinfo"), "readOnly": True},
        ],
    }
    # The attempt's own values (where it resumes from) arrive as annotations set at admission,
    # which the kubelet writes to this file before the container starts (`lowtide-step-shim`).
    env.append(
        {"name": "LOWTIDE_PODINFO_ANNOTATIONS", "value": join_uri(settings.run_dir, "podinfo/annotations")}
    )
    if settings.storage_secret:
        container["envFrom"] = [{"secretRef": {"name": settings.storage_secret}}]
    if resolved.gpus > 0:
        container["resources"] = {"limits": {GPU_RESOURCE: resolved.gpus}}
        # Gated: the kubelet mounts the Secret after admission, which wrote the attempt's token.
        container["volumeMounts"].append({"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True})
        env.append({"name": "LOWTIDE_STEP_TOKEN_FILE", "value": join_uri(TOKEN_DIR, "token")})
    template: dict[str, Any] = {
        "name": name,
        "metadata": {
            "labels": {LABEL_JOB: job_label, LABEL_STEP: dns_label(step.name), LABEL_ATTEMPT: attempt}
        },
        "priorityClassName": settings.research_priority_class,
        "retryStrategy": {
            "retryPolicy": "Always",
            "expression": retry_expression(settings.interrupted_exit_code, spec.retries_for(step)),
        },
        "container": container,
        "volumes": [
            {"name": RUN_VOLUME, "emptyDir": {}},
            {
                "name": PODINFO_VOLUME,
                "downwardAPI": {
                    "items": [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]
                },
            },
        ],
        "outputs": {
            "parameters": [
                {
                    "name": RESULT_PARAMETER,
                    "valueFrom": {"path": join_uri(settings.run_dir, "result"), "default": ""},
                }
            ]
        },
    }
    if resolved.gpus > 0:
        template["volumes"].append(
            {
                "name": TOKEN_VOLUME,
                "secret": {
                    "secretName": token_secret_name(workflow),
                    "items": [{"key": dns_label(step.name), "path": "token"}],
                    "defaultMode": TOKEN_FILE_MODE,
                    "optional": True,
                },
            }
        )
        grace = math.ceil(spec.grace_seconds + settings.grace_margin_seconds)
        patch = {"schedulingGates": [{"name": ADMISSION_GATE}], "terminationGracePeriodSeconds": grace}
        template["podSpecPatch"] = json.dumps(patch, sort_keys=True, separators=(",", ":"))
    return template


def compile_workflow(
    spec: JobSpec,
    *,
    job_id: str,
    settings: ArgoSettings,
    resolved: Mapping[str, ResolvedStep] | None = None,
    generation: int = 0,
    succeeded: Collection[str] = frozenset(),
    attempts_before: Mapping[str, int] | None = None,
) -> CompiledWorkflow:
    """The Workflow job `job_id` of `spec` becomes (module docstring). `resolved` are the steps as
    stored for the job (default: rendered here under `settings.artifact_root`, as `lowtide submit`
    does). `generation` > 0: the Workflow of a retried job (`job_generation`), without the steps
    in `succeeded` (which generation 0, the whole job, must not name), and `attempts_before`:
    step name -> the attempts it had before the retry (its attempt numbers go on from there;
    absent: none; generation 0 has none). Raises ArgoCompileError
    naming the step and field when something cannot be expressed."""
    if not _LABEL_RE.fullmatch(job_id):
        raise ArgoCompileError(f"job id {job_id!r} is not a DNS-1123 label (a-z, 0-9, '-', at most 63)")
    name = workflow_name(job_id, generation)
    if not _LABEL_RE.fullmatch(name):
        raise ArgoCompileError(f"workflow name {name!r} is not a DNS-1123 label (at most 63)")
    unknown = sorted(set(succeeded) - {s.name for s in spec.steps})
    if unknown:
        raise ArgoCompileError(f"succeeded steps {unknown} are not steps of the job")
    if succeeded and generation == 0:
        raise ArgoCompileError("generation 0 is the whole job: only a retried generation leaves steps out")
    before = dict(attempts_before or {})
    unknown = sorted(set(before) - {s.name for s in spec.steps})
    if unknown:
        raise ArgoCompileError(f"attempts_before names {unknown}, which are not steps of the job")
    if generation == 0 and any(before.values()):
        raise ArgoCompileError("generation 0 is the job's first Workflow: no step had attempts before it")
    if succeeded and all(s.name in succeeded for s in spec.steps):
        raise NothingLeftToRun(name)
    layout = ArtifactLayout(settings.artifact_root, work_root=settings.run_dir)
    if resolved is None:
        try:
            resolved = {s.name: render_step(spec, s, job_id=job_id, layout=layout) for s in spec.steps}
        except ValueError as exc:
            raise ArgoCompileError(str(exc)) from None
    for step in spec.steps:
        out = resolved.get(step.name)
        if out is None:
            raise ArgoCompileError(f"steps.{step.name}: no resolved step given")
        for uri in (out.outputs, out.checkpoint_dir, *out.inputs.values()):
            if uri is not None and not is_remote(uri):
                raise ArgoCompileError(f"steps.{step.name}: {uri!r} is not on remote object storage")
    try:
        order = topological_order(spec)
    except ValueError as exc:
        raise ArgoCompileError(str(exc)) from None
    for key, value in spec.params.items():
        _no_argo_braces(param_text(value), f"params.{key}")

    names: dict[str, str] = {}
    taken = {DAG_TEMPLATE}
    for step_name in order:
        names[step_name] = dns_label(step_name, taken=frozenset(taken))
        taken.add(names[step_name])
    # Names are chosen over all the steps, so a step keeps its names in every generation.
    names = {step_name: names[step_name] for step_name in order if step_name not in succeeded}
    job_label = job_id
    tasks: list[dict[str, Any]] = []
    templates: list[dict[str, Any]] = []
    for step_name in names:
        step = spec.step(step_name)
        task: dict[str, Any] = {"name": names[step_name], "template": names[step_name]}
        depends = [names[d] for d in step.depends if d not in succeeded]
        if depends:
            task["dependencies"] = depends
        tasks.append(task)
        templates.append(
            _step_template(
                spec,
                step,
                resolved[step_name],
                name=names[step_name],
                job_label=job_label,
                job_id=job_id,
                workflow=name,
                settings=settings,
                attempts_before=before.get(step_name, 0),
            )
        )
    wf_spec: dict[str, Any] = {
        "entrypoint": DAG_TEMPLATE,
        "podMetadata": {"labels": {LABEL_JOB: job_label}},
        "templates": [{"name": DAG_TEMPLATE, "dag": {"tasks": tasks}}, *templates],
    }
    if spec.params:
        wf_spec["arguments"] = {
            "parameters": [{"name": k, "value": param_text(v)} for k, v in sorted(spec.params.items())]
        }
    if settings.service_account:
        wf_spec["serviceAccountName"] = settings.service_account
    annotations = {
        ANNOTATION_JOB_NAME: spec.name,
        ANNOTATION_STEPS: json.dumps(names, sort_keys=True, separators=(",", ":")),
    }
    if generation:
        annotations[ANNOTATION_GENERATION] = str(generation)
    manifest: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "Workflow",
        "metadata": {
            "name": name,
            "namespace": settings.namespace,
            "labels": {LABEL_JOB: job_label},
            "annotations": annotations,
        },
        "spec": wf_spec,
    }
    return CompiledWorkflow(manifest=manifest, names=dict(names))
