"""The Argo Workflow compiler (`adapters.argo.workflow`) and the retry-expression checker.

Every example job and every job template compiles and validates against the Workflow CRD's
openAPIV3Schema from argo-workflows v4.1.2 (`../shared/data/reference/argo-crd-full-workflows.yaml`,
Draft 7, as the API server would), plus an unknown-key walk: the CRD schema accepts keys it does
not know only where it says so (`additionalProperties`, `x-kubernetes-preserve-unknown-fields`);
anywhere else the API server would prune them silently, which for us is a bug. The schema tests
skip when the shared data folder is absent (`$LOWTIDE_DATA_DIR`, default `<repo>/../shared/data`);
the mechanism tests (gate, grace, retries, labels, names) do not need it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtide.adapters.argo.expr import (
    ExprError,
    check_retry_expression,
    check_template_expression,
    evaluate_retry_expression,
    evaluate_template_expression,
)
from lowtide.adapters.argo.workflow import (
    ADMISSION_GATE,
    ANNOTATION_GENERATION,
    ATTEMPT_VALUE,
    DAG_TEMPLATE,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_STEP,
    ArgoCompileError,
    ArgoSettings,
    CompiledWorkflow,
    NothingLeftToRun,
    attempt_value,
    compile_workflow,
    dns_label,
    job_generation,
    retry_expression,
    workflow_name,
)
from lowtide.adapters.templates import DirectoryTemplates
from lowtide.domain.spec import JobSpec, ResolvedStep, SecretUse, StepSpec
from lowtide.domain.spec_document import parse_document
from lowtide.domain.spec_parse import build_job_spec

REPO = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("LOWTIDE_DATA_DIR") or REPO.parent / "shared" / "data")
CRD = DATA / "reference" / "argo-crd-full-workflows.yaml"
EXAMPLES = sorted((REPO / "examples" / "jobs").glob("*.yaml"))
TEMPLATES = sorted((REPO / "examples" / "templates").glob("*.yaml"))
JOB_ID = "job-0123456789ab"
SETTINGS = ArgoSettings(artifact_root="s3://research/lowtide", default_image="ghcr.io/example/steps:1")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
#: ObjectMeta fields a client may set (k8s.io/apimachinery meta/v1 types.go); the CRD leaves the
#: root `metadata` to the API server, which validates it as ObjectMeta.
OBJECT_META = {"name", "generateName", "namespace", "labels", "annotations", "finalizers", "ownerReferences"}


@cache
def _crd_schema() -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with CRD.open(encoding="utf-8") as f:
        doc = yaml.load(f, Loader=loader)
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    if not CRD.is_file():
        pytest.skip(f"reference data absent: {CRD} (set LOWTIDE_DATA_DIR to ../shared/data)")
    return _crd_schema()


def unknown_keys(obj: Any, schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Paths of keys the schema does not declare where it does not accept unknown ones."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and extra is None:
            allowed = OBJECT_META if path == ".metadata" else set()
            yield from (f"{path}.{k}" for k in obj if k not in allowed)
            return
        for key, value in obj.items():
            if props is not None and key in props:
                yield from unknown_keys(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from unknown_keys(value, extra, f"{path}.{key}")
            elif extra is not True:
                yield f"{path}.{key}"
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            yield from unknown_keys(item, schema["items"], f"{path}[{i}]")


def check_against_crd(manifest: dict[str, Any], schema: dict[str, Any]) -> None:
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(manifest), key=str)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:10])
    assert list(unknown_keys(manifest, schema)) == []


def _spec_from(path: Path) -> JobSpec:
    doc = parse_document(path.read_bytes(), fmt="auto")
    return build_job_spec(doc, templates=DirectoryTemplates(REPO / "examples" / "templates"))


def _spec_from_template(path: Path) -> JobSpec:
    """A template as a job: its required (null) parameters given a value."""
    doc = dict(parse_document(path.read_bytes(), fmt="auto"))
    doc["params"] = {
        k: ("s3://models/base" if v is None else v) for k, v in (doc.get("params") or {}).items()
    }
    return build_job_spec(doc, templates=None)


def _templates(compiled: CompiledWorkflow) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in compiled.manifest["spec"]["templates"]}


def _env(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in template["container"]["env"]}


def _keys(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield key
            yield from _keys(value)
    elif isinstance(obj, list):
        for item in obj:
            yield from _keys(item)


# --- every example and template validates against the CRD ----------------------------------


def test_the_unknown_key_walk_finds_what_the_crd_would_prune(crd_schema: dict[str, Any]) -> None:
    compiled = compile_workflow(
        _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml"), job_id=JOB_ID, settings=SETTINGS
    )
    broken = json.loads(json.dumps(compiled.manifest))
    broken["spec"]["templates"][1]["retryStrategy"]["maxRetries"] = 3  # not an Argo field
    broken["spec"]["templates"][1]["container"]["gpus"] = 1
    broken["metadata"]["owner"] = "x"
    assert sorted(unknown_keys(broken, crd_schema)) == [
        ".metadata.owner",
        ".spec.templates[1].container.gpus",
        ".spec.templates[1].retryStrategy.maxRetries",
    ]
    wrong_type = json.loads(json.dumps(compiled.manifest))
    wrong_type["spec"]["templates"][1]["retryStrategy"]["expression"] = 3
    assert list(jsonschema.Draft7Validator(crd_schema).iter_errors(wrong_type))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_job_compiles_to_a_valid_workflow(path: Path, crd_schema: dict[str, Any]) -> None:
    spec = _spec_from(path)
    compiled = compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS)
    check_against_crd(compiled.manifest, crd_schema)
    assert set(compiled.names) == {s.name for s in spec.steps}


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_every_job_template_compiles_to_a_valid_workflow(path: Path, crd_schema: dict[str, Any]) -> None:
    compiled = compile_workflow(_spec_from_template(path), job_id=JOB_ID, settings=SETTINGS)
    check_against_crd(compiled.manifest, crd_schema)


def test_a_job_with_secrets_and_options_still_validates(crd_schema: dict[str, Any]) -> None:
    spec = JobSpec(
        name="with-secrets",
        steps=(StepSpec(name="a", command=("true",), gpus=8, secrets=(SecretUse("hf-token", "HF_TOKEN"),)),),
        params={"lr": 0.1, "tags": ["a", "b"]},
    )
    settings_ = ArgoSettings(
        artifact_root="s3://b/p",
        default_image="img:1",
        service_account="lowtide-step",
        storage_secret="object-store",
        api_url="http://lowtide.lowtide.svc:8080",
    )
    compiled = compile_workflow(spec, job_id=JOB_ID, settings=settings_)
    check_against_crd(compiled.manifest, crd_schema)
    assert compiled.manifest["spec"]["serviceAccountName"] == "lowtide-step"
    assert compiled.manifest["spec"]["arguments"]["parameters"] == [
        {"name": "lr", "value": "0.1"},
        {"name": "tags", "value": '["a","b"]'},
    ]


# --- the mechanism ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft() -> CompiledWorkflow:
    return compile_workflow(
        _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml"), job_id=JOB_ID, settings=SETTINGS
    )


def test_gpu_steps_are_gated_with_the_grace_and_cpu_steps_are_not(sft: CompiledWorkflow) -> None:
    templates = _templates(sft)
    prep, train, evaluate = templates["prep"], templates["train"], templates["eval"]
    assert "podSpecPatch" not in prep
    assert "resources" not in prep["container"]
    for template, gpus in ((train, 2), (evaluate, 1)):
        patch = json.loads(template["podSpecPatch"])
        assert patch["schedulingGates"] == [{"name": ADMISSION_GATE}]
        assert patch["terminationGracePeriodSeconds"] == math.ceil(20 + SETTINGS.grace_margin_seconds)
        assert template["container"]["resources"] == {"limits": {"nvidia.com/gpu": gpus}}


K8S_VERSION = "1.33.0"  # the Kubernetes API schema kubernetes-validate checks pods against


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_the_pods_argo_would_create_are_valid_kubernetes_pods(path: Path) -> None:
    """Each step template as the pod Argo builds from it (workflowpod.go: the template's container
    as `main`, its volumes, labels and priorityClassName, then the podSpecPatch merged), with
    the first attempt's `{{=asInt(retries) + 1}}` resolved, validates strictly as a v1 Pod."""
    settings_ = ArgoSettings(
        artifact_root="s3://b/p", default_image="img:1", storage_secret="object-store", api_url="http://l:1"
    )
    compiled = compile_workflow(_spec_from(path), job_id=JOB_ID, settings=settings_)
    for template in compiled.manifest["spec"]["templates"]:
        if "container" not in template:
            continue
        resolved = json.loads(json.dumps(template).replace(ATTEMPT_VALUE, "1"))
        pod_spec: dict[str, Any] = {
            "containers": [resolved["container"]],
            "volumes": resolved["volumes"],
            "priorityClassName": resolved["priorityClassName"],
            **json.loads(resolved.get("podSpecPatch", "{}")),
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{JOB_ID}-{template['name']}-1", "labels": resolved["metadata"]["labels"]},
            "spec": pod_spec,
        }
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_grace_plus_margin_is_rounded_up_to_whole_seconds() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("x",), gpus=1),), grace_seconds=20.2)
    settings_ = ArgoSettings(artifact_root="s3://b", default_image="i", grace_margin_seconds=4)
    (template,) = [
        t
        for t in compile_workflow(spec, job_id=JOB_ID, settings=settings_).manifest["spec"]["templates"]
        if t["name"] == "a"
    ]
    assert json.loads(template["podSpecPatch"])["terminationGracePeriodSeconds"] == 25


def test_retries_use_the_expression_and_nothing_that_counts_gated_time(sft: CompiledWorkflow) -> None:
    steps = [t for t in sft.manifest["spec"]["templates"] if "container" in t]
    assert len(steps) == 3
    for template in steps:
        assert template["retryStrategy"] == {
            "retryPolicy": "Always",
            "expression": 'lastRetry.exitCode == "75" || lastRetry.message contains "pod deleted" '
            "|| asInt(retries) < 1",
        }
    keys = set(_keys(sft.manifest))
    assert not keys & {
        "limit",
        "backoff",
        "maxDuration",
        "timeout",
        "pendingTimeout",
        "activeDeadlineSeconds",
    }


def test_the_retry_budget_is_per_step_and_the_interrupted_code_is_a_setting() -> None:
    spec = JobSpec(
        name="j",
        steps=(StepSpec(name="a", command=("x",)), StepSpec(name="b", command=("x",), max_retries=4)),
        max_retries=2,
    )
    settings_ = ArgoSettings(artifact_root="s3://b", default_image="i", interrupted_exit_code=99)
    templates = _templates(compile_workflow(spec, job_id=JOB_ID, settings=settings_))
    assert templates["a"]["retryStrategy"]["expression"].endswith("asInt(retries) < 2")
    assert templates["b"]["retryStrategy"]["expression"].endswith("asInt(retries) < 4")
    assert templates["a"]["retryStrategy"]["expression"].startswith('lastRetry.exitCode == "99" ||')


def test_labels_priority_class_and_the_dag(sft: CompiledWorkflow) -> None:
    manifest = sft.manifest
    assert manifest["apiVersion"] == "argoproj.io/v1alpha1" and manifest["kind"] == "Workflow"
    assert manifest["metadata"]["name"] == JOB_ID
    assert manifest["metadata"]["labels"] == {LABEL_JOB: JOB_ID}
    assert manifest["spec"]["podMetadata"]["labels"] == {LABEL_JOB: JOB_ID}
    templates = _templates(sft)
    for step in ("prep", "train", "eval"):
        assert templates[step]["metadata"]["labels"] == {
            LABEL_JOB: JOB_ID,
            LABEL_STEP: step,
            LABEL_ATTEMPT: ATTEMPT_VALUE,
        }
        assert templates[step]["priorityClassName"] == SETTINGS.research_priority_class
    assert manifest["spec"]["entrypoint"] == DAG_TEMPLATE
    tasks = {t["name"]: t for t in templates[DAG_TEMPLATE]["dag"]["tasks"]}
    assert tasks == {
        "prep": {"name": "prep", "template": "prep"},
        "train": {"name": "train", "template": "train", "dependencies": ["prep"]},
        "eval": {"name": "eval", "template": "eval", "dependencies": ["train"]},
    }


def test_the_step_contract_is_the_env_with_remote_uris(sft: CompiledWorkflow) -> None:
    env = _env(_templates(sft)["train"])
    root = f"s3://research/lowtide/jobs/{JOB_ID}"
    assert env["LOWTIDE_JOB_ID"]["value"] == JOB_ID
    assert env["LOWTIDE_STEP"]["value"] == "train"
    assert env["LOWTIDE_ATTEMPT"]["value"] == ATTEMPT_VALUE == "{{=asInt(retries) + 1}}"
    assert env["LOWTIDE_NODE"] == {
        "name": "LOWTIDE_NODE",
        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
    }
    assert env["LOWTIDE_GPUS"]["value"] == "2"
    assert env["LOWTIDE_OUTPUTS"]["value"] == f"{root}/train/outputs"
    assert json.loads(env["LOWTIDE_INPUTS"]["value"]) == {"prep": f"{root}/prep/outputs"}
    assert env["LOWTIDE_CHECKPOINT_DIR"]["value"] == f"{root}/train/checkpoints"
    assert env["LOWTIDE_PARAM_LR"]["value"] == "0.05"
    assert json.loads(env["LOWTIDE_PARAMS"]["value"]) == {"lr": 0.05, "shards": 4, "steps": 300}
    assert env["LOWTIDE_NOTICE_FILE"]["value"] == "/var/run/lowtide/NOTICE"
    assert env["LOWTIDE_GRACE_SECONDS"]["value"] == "20"
    assert env["LOWTIDE_INTERRUPTED_EXIT_CODE"]["value"] == "75"
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin decides
    container = _templates(sft)["train"]["container"]
    assert container["command"] == ["lowtide-step-shim", "--"]
    assert container["args"][:3] == ["python", "-m", "lowtide.examples.train"]
    assert f"{root}/prep/outputs" in container["args"]
    assert container["volumeMounts"] == [
        {"name": "lowtide-run", "mountPath": "/var/run/lowtide"},
        {"name": "lowtide-podinfo", "mountPath": "/var/run/lowtide/podinfo", "readOnly": True},
        {"name": "lowtide-step-token", "mountPath": "/var/run/lowtide-token", "readOnly": True},
    ]
    # The attempt's resume point comes as a pod annotation set at admission, read from this file.
    assert env["LOWTIDE_PODINFO_ANNOTATIONS"]["value"] == "/var/run/lowtide/podinfo/annotations"
    assert {
        "name": "lowtide-podinfo",
        "downwardAPI": {
            "items": [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]
        },
    } in _templates(sft)["train"]["volumes"]


def test_gpu_steps_mount_their_key_of_the_jobs_token_secret_and_cpu_steps_do_not(
    sft: CompiledWorkflow,
) -> None:
    """The step token is never in the Workflow: a GPU template mounts its step's key of the job's
    Secret (written by the executor before admission) and names the file for the shim."""
    templates = _templates(sft)
    for step in ("train", "eval"):
        volumes = {v["name"]: v for v in templates[step]["volumes"]}
        assert volumes["lowtide-step-token"] == {
            "name": "lowtide-step-token",
            "secret": {
                "secretName": f"{JOB_ID}-step-tokens",
                "items": [{"key": step, "path": "token"}],
                "defaultMode": 0o444,
                "optional": True,
            },
        }
        assert _env(templates[step])["LOWTIDE_STEP_TOKEN_FILE"]["value"] == "/var/run/lowtide-token/token"
    prep = templates["prep"]  # CPU-only: not gated, so it may start before a token is written
    assert "lowtide-step-token" not in {v["name"] for v in prep["volumes"]}
    assert "LOWTIDE_STEP_TOKEN_FILE" not in _env(prep)
    assert "LOWTIDE_STEP_TOKEN" not in json.dumps(sft.manifest).replace("LOWTIDE_STEP_TOKEN_FILE", "")


def test_the_token_key_is_the_steps_pod_label_even_for_a_name_that_is_no_label() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="Train_Big", command=("x",), gpus=1),))
    compiled = compile_workflow(
        spec, job_id=JOB_ID, settings=ArgoSettings(artifact_root="s3://b", default_image="i")
    )
    (template,) = [t for t in compiled.manifest["spec"]["templates"] if "container" in t]
    (volume,) = [v for v in template["volumes"] if v["name"] == "lowtide-step-token"]
    assert volume["secret"]["items"] == [{"key": template["metadata"]["labels"][LABEL_STEP], "path": "token"}]
    assert template["metadata"]["labels"][LABEL_STEP] != "Train_Big"


# --- retried generations (docs/cluster.md "Retrying a job") -----------------------------------

RETRIED_AT = 1_800_000_123.4567  # when `lowtide retry` reopened the steps (store: steps.retried_at)
GENERATION = 1_800_000_123_456


def test_a_retried_generation_holds_only_the_unfinished_steps_and_still_validates(
    sft: CompiledWorkflow, crd_schema: dict[str, Any]
) -> None:
    """prep SUCCEEDED before the retry: the new Workflow has train (its dependency on prep dropped:
    train reads prep's output from object storage, not from Argo) and eval, unchanged otherwise."""
    retried = compile_workflow(
        _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml"),
        job_id=JOB_ID,
        settings=SETTINGS,
        generation=GENERATION,
        succeeded={"prep"},
    )
    check_against_crd(retried.manifest, crd_schema)
    name = f"{JOB_ID}-r{GENERATION}"
    meta = retried.manifest["metadata"]
    assert retried.name == name == workflow_name(JOB_ID, GENERATION)
    assert meta["labels"] == {LABEL_JOB: JOB_ID}  # found by the job's label, like generation 0
    assert meta["annotations"][ANNOTATION_GENERATION] == str(GENERATION)
    assert ANNOTATION_GENERATION not in sft.manifest["metadata"]["annotations"]
    assert json.loads(meta["annotations"]["lowtide.io/steps"]) == {"train": "train", "eval": "eval"}
    assert retried.names == {"train": "train", "eval": "eval"}
    templates = _templates(retried)
    assert set(templates) == {DAG_TEMPLATE, "train", "eval"}
    assert templates[DAG_TEMPLATE]["dag"]["tasks"] == [
        {"name": "train", "template": "train"},
        {"name": "eval", "template": "eval", "dependencies": ["train"]},
    ]
    # Each step's template is generation 0's but for the token Secret, which is the Workflow's.
    for step in ("train", "eval"):
        before = json.dumps(_templates(sft)[step]).replace(f'"{JOB_ID}-step-tokens"', f'"{name}-step-tokens"')
        assert json.dumps(templates[step]) == before
    assert _env(templates["train"])["LOWTIDE_JOB_ID"]["value"] == JOB_ID
    # train's input is where prep wrote, on object storage: nothing passes through Argo.
    prep_out = f"s3://research/lowtide/jobs/{JOB_ID}/prep/outputs"
    assert json.loads(_env(templates["train"])["LOWTIDE_INPUTS"]["value"]) == {"prep": prep_out}
    assert "inputs" not in templates["train"] and prep_out in templates["train"]["container"]["args"]


def test_a_retried_generation_numbers_attempts_on_from_those_before_it(
    sft: CompiledWorkflow, crd_schema: dict[str, Any]
) -> None:
    """train had 3 attempts, eval none: train's pods are numbered 4, 5, ... (Argo's `retries` is
    0, 1, ... again in the new Workflow), eval's 1, 2, ...; the retry budget is unchanged."""
    retried = compile_workflow(
        _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml"),
        job_id=JOB_ID,
        settings=SETTINGS,
        generation=GENERATION,
        succeeded={"prep"},
        attempts_before={"prep": 1, "train": 3},
    )
    check_against_crd(retried.manifest, crd_schema)
    templates = _templates(retried)
    train, eval_ = templates["train"], templates["eval"]
    assert train["metadata"]["labels"][LABEL_ATTEMPT] == "{{=asInt(retries) + 1 + 3}}"
    assert _env(train)["LOWTIDE_ATTEMPT"]["value"] == "{{=asInt(retries) + 1 + 3}}"
    assert eval_["metadata"]["labels"][LABEL_ATTEMPT] == ATTEMPT_VALUE
    assert _env(eval_)["LOWTIDE_ATTEMPT"]["value"] == ATTEMPT_VALUE
    assert train["retryStrategy"] == _templates(sft)["train"]["retryStrategy"]
    # What Argo puts in its place for the first and the third child of the new Workflow.
    label = train["metadata"]["labels"][LABEL_ATTEMPT]
    assert [evaluate_template_expression(label, {"retries": r}) for r in ("0", "2")] == ["4", "6"]
    assert evaluate_template_expression(ATTEMPT_VALUE, {"retries": "0"}) == "1"


@pytest.mark.parametrize(
    ("generation", "before", "why"),
    [
        (0, {"train": 1}, "generation 0 is the job's first Workflow"),
        (GENERATION, {"nope": 1}, "attempts_before names ['nope']"),
        (GENERATION, {"train": -1}, "a step cannot have had -1 attempts"),
    ],
)
def test_attempt_offsets_that_cannot_be_are_refused(
    generation: int, before: dict[str, int], why: str
) -> None:
    spec = _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml")
    with pytest.raises(ArgoCompileError, match=re.escape(why)):
        compile_workflow(
            spec, job_id=JOB_ID, settings=SETTINGS, generation=generation, attempts_before=before
        )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{{=retries + 1}}", "cannot add a string and a int"),  # retries is a string for Argo too
        ("{{=asInt(retries) + 1 < 2}}", "it must be a int, this one is a bool"),
        ("{{=asInt(attempt) + 1}}", "unknown name 'attempt'"),
        ("asInt(retries) + 1", "is not one expression template"),
        ("{{=}}", "is not one expression template"),
    ],
)
def test_the_attempt_template_checker_refuses_what_argo_would_fail_on(text: str, why: str) -> None:
    with pytest.raises(ExprError, match=re.escape(why)):
        check_template_expression(text)
    assert attempt_value(0) == ATTEMPT_VALUE


def test_a_step_keeps_its_names_in_a_retried_generation() -> None:
    """Names are chosen over the whole job: a step renamed for a collision keeps its name."""
    spec = JobSpec(
        name="j",
        steps=(
            StepSpec(name="Prep", command=("p",)),
            StepSpec(name="prep", command=("p",), depends=("Prep",)),
            StepSpec(name="train", command=("t",), gpus=1, depends=("prep", "Prep")),
        ),
    )
    whole = compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS)
    retried = compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS, generation=7, succeeded={"Prep"})
    assert retried.names == {k: v for k, v in whole.names.items() if k != "Prep"}
    tasks = {t["name"]: t for t in _templates(retried)[DAG_TEMPLATE]["dag"]["tasks"]}
    assert tasks["train"]["dependencies"] == ["prep"]
    assert "dependencies" not in tasks["prep"]


@pytest.mark.parametrize(
    ("generation", "succeeded", "why"),
    [
        (0, {"prep"}, "generation 0 is the whole job"),
        (5, {"nope"}, "succeeded steps ['nope'] are not steps of the job"),
        (-1, set(), "generation -1 is negative"),
    ],
)
def test_what_a_generation_cannot_be_is_refused(generation: int, succeeded: set[str], why: str) -> None:
    spec = _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml")
    with pytest.raises(ArgoCompileError, match=re.escape(why)):
        compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS, generation=generation, succeeded=succeeded)


def test_a_generation_with_every_step_succeeded_has_no_workflow_but_its_name() -> None:
    spec = _spec_from(REPO / "examples" / "jobs" / "sft-dag.yaml")
    with pytest.raises(NothingLeftToRun) as err:
        compile_workflow(
            spec, job_id=JOB_ID, settings=SETTINGS, generation=9, succeeded={"prep", "train", "eval"}
        )
    assert err.value.workflow == f"{JOB_ID}-r9"


def test_a_generation_name_past_63_characters_is_refused() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("x",)),))
    job_id = "j" * 50
    compile_workflow(spec, job_id=job_id, settings=SETTINGS)  # generation 0 fits
    with pytest.raises(ArgoCompileError, match="is not a DNS-1123 label"):
        compile_workflow(spec, job_id=job_id, settings=SETTINGS, generation=GENERATION)


def test_the_generation_is_the_latest_retry_in_milliseconds() -> None:
    assert job_generation({"prep": None, "train": None}, set()) == 0  # never retried
    assert job_generation({"prep": None, "train": None}, {"prep"}) == 0
    assert job_generation({"prep": None, "train": RETRIED_AT}, {"prep"}) == GENERATION
    # Two retries half a second apart are two generations.
    assert job_generation({"train": RETRIED_AT + 0.5}, set()) == GENERATION + 500


def test_the_generation_follows_the_unfinished_steps_whatever_the_clock_did() -> None:
    """A retry stamps every step it reopens, which is every step not SUCCEEDED: their stamp is the
    latest retry's even when the clock went back (an earlier retry's stamp on a step that SUCCEEDED
    since is larger)."""
    stamps = {"prep": RETRIED_AT + 3600, "train": RETRIED_AT, "eval": RETRIED_AT}
    assert job_generation(stamps, {"prep"}) == GENERATION
    assert job_generation(stamps, {"prep", "train"}) == GENERATION
    # Everything SUCCEEDED (end_job of a finished job): the newest stamp.
    assert job_generation(stamps, {"prep", "train", "eval"}) == GENERATION + 3_600_000


def test_secrets_are_referenced_never_inlined() -> None:
    spec = JobSpec(
        name="j",
        steps=(StepSpec(name="a", command=("x",), secrets=(SecretUse("db-pass"),)),),
        secrets=(SecretUse("hf-token", "HF_TOKEN"),),
    )
    settings_ = ArgoSettings(artifact_root="s3://b", default_image="i", secret_env={"db-pass": "DB_PASSWORD"})
    env = _env(_templates(compile_workflow(spec, job_id=JOB_ID, settings=settings_))["a"])
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "value"}},
    }
    assert env["DB_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "db-pass", "key": "value"}}
    with pytest.raises(ArgoCompileError, match=r"steps\.a\.secrets: secret 'db-pass' names no variable"):
        compile_workflow(
            spec, job_id=JOB_ID, settings=ArgoSettings(artifact_root="s3://b", default_image="i")
        )


@pytest.mark.parametrize(
    ("root", "why"),
    [
        ("/var/lowtide/artifacts", "must be remote object storage"),
        ("file:///var/lowtide", "must be remote object storage"),
        ("memory://x", "must be remote object storage"),
        ("", "artifact_root is not set"),
    ],
)
def test_a_local_artifact_root_is_refused(root: str, why: str) -> None:
    with pytest.raises(ArgoCompileError, match=why):
        ArgoSettings(artifact_root=root)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("interrupted_exit_code", 0, "interrupted_exit_code 0 must be 1..125"),
        ("interrupted_exit_code", 143, "128\\+n is death by signal"),
        ("shim_command", (), "shim_command must be"),
        ("namespace", "Lowtide", "namespace 'Lowtide' is not a DNS-1123 label"),
        ("grace_margin_seconds", float("nan"), "grace_margin_seconds"),
        ("run_dir", "/var/run/lowtide-token", "must be an absolute path of its own"),
    ],
)
def test_bad_settings_name_the_field(field: str, value: Any, why: str) -> None:
    with pytest.raises(ArgoCompileError, match=why):
        ArgoSettings(artifact_root="s3://b", **{field: value})


def test_a_step_without_an_image_is_refused_by_name() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="train", command=("x",)),))
    with pytest.raises(ArgoCompileError, match=r"steps\.train\.image: cluster mode runs images"):
        compile_workflow(spec, job_id=JOB_ID, settings=ArgoSettings(artifact_root="s3://b"))


def test_argo_braces_in_rendered_values_are_refused() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("echo", "{{")),))  # no placeholder of ours
    with pytest.raises(ArgoCompileError, match=r"steps\.a\.command\[1\]: contains '\{\{'"):
        compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS)
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("x",), env={"X": "a {{ b"}),))
    with pytest.raises(ArgoCompileError, match=r"steps\.a\.env\.X: contains"):
        compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS)
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("x",)),), params={"p": "{{=1}}"})
    with pytest.raises(ArgoCompileError, match=r"params\.p"):
        compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS)


def test_resolved_steps_given_by_the_caller_must_be_on_object_storage() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("x",)),))
    local = ResolvedStep(
        name="a",
        command=("x",),
        gpus=0,
        image=None,
        env={},
        inputs={},
        outputs="/var/lt/a/outputs",
        checkpoint_dir=None,
    )
    with pytest.raises(
        ArgoCompileError, match=r"steps\.a: '/var/lt/a/outputs' is not on remote object storage"
    ):
        compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS, resolved={"a": local})
    with pytest.raises(ArgoCompileError, match=r"steps\.a: no resolved step given"):
        compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS, resolved={})
    remote = ResolvedStep(
        name="a",
        command=("run", "s3://x/in"),
        gpus=0,
        image=None,
        env={},
        inputs={},
        outputs="s3://x/a",
        checkpoint_dir=None,
    )
    compiled = compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS, resolved={"a": remote})
    assert _templates(compiled)["a"]["container"]["args"] == [
        "run",
        "s3://x/in",
    ]  # as stored, not re-rendered


def test_a_job_id_that_is_no_dns_label_is_refused() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("x",)),))
    with pytest.raises(ArgoCompileError, match="job id 'Job_1' is not a DNS-1123 label"):
        compile_workflow(spec, job_id="Job_1", settings=SETTINGS)


def test_a_step_named_like_the_dag_template_gets_a_name_of_its_own() -> None:
    spec = JobSpec(
        name="j",
        steps=(
            StepSpec(name=DAG_TEMPLATE, command=("x",)),
            StepSpec(name="b", command=("x",), depends=(DAG_TEMPLATE,)),
        ),
    )
    compiled = compile_workflow(spec, job_id=JOB_ID, settings=SETTINGS)
    renamed = compiled.names[DAG_TEMPLATE]
    assert renamed != DAG_TEMPLATE and DNS_LABEL.fullmatch(renamed)
    templates = _templates(compiled)
    assert templates[renamed]["metadata"]["labels"][LABEL_STEP] == DAG_TEMPLATE
    tasks = {t["name"]: t for t in templates[DAG_TEMPLATE]["dag"]["tasks"]}
    assert tasks["b"]["dependencies"] == [renamed]
    assert json.loads(compiled.manifest["metadata"]["annotations"]["lowtide.io/steps"]) == dict(
        compiled.names
    )


# --- names (property-based) -------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=120))
def test_dns_label_always_gives_a_dns_label(text: str) -> None:
    label = dns_label(text)
    assert DNS_LABEL.fullmatch(label)
    assert dns_label(label) == label  # stable once valid


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=80), min_size=2, max_size=2, unique=True))
def test_different_names_never_sanitize_to_one(texts: list[str]) -> None:
    a, b = texts
    assert dns_label(a) != dns_label(b)


STEP_NAMES = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(STEP_NAMES, min_size=1, max_size=8, unique=True))
def test_any_valid_step_names_give_unique_valid_template_and_label_names(names: list[str]) -> None:
    steps = tuple(
        StepSpec(name=n, command=("x",), gpus=i % 2, depends=(names[i - 1],) if i else ())
        for i, n in enumerate(names)
    )
    compiled = compile_workflow(JobSpec(name="j", steps=steps), job_id=JOB_ID, settings=SETTINGS)
    template_names = [t["name"] for t in compiled.manifest["spec"]["templates"]]
    assert len(set(template_names)) == len(template_names) == len(names) + 1
    for template in compiled.manifest["spec"]["templates"]:
        assert DNS_LABEL.fullmatch(template["name"])
        for key, value in template.get("metadata", {}).get("labels", {}).items():
            assert value == ATTEMPT_VALUE if key == LABEL_ATTEMPT else LABEL_VALUE.fullmatch(value)
    assert sorted(compiled.names) == sorted(names)


# --- the retry expression is what Argo's expr-lang accepts ---------------------------------


def test_our_retry_expression_passes_the_checker() -> None:
    check_retry_expression(retry_expression(75, 3))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("retries < 2", "cannot order a string and a int"),  # retries is a string in Argo's scope
        ("lastRetry.exitCode == 75", "compares a string with a int"),
        ("lastRetry.exitCodes == '1'", "unknown name 'lastRetry.exitCodes'"),
        ("asInt(retries) < 2 ||", "unexpected 'end of expression'"),
        ("asInt(retries)", "must be a boolean"),
        ("lastRetry.message contains 1", "needs strings"),
        ("int(retries) < 2", "unknown function 'int'"),
        ("asInt(retries) < 2 ; true", "unexpected character ';'"),
        ("", "empty"),
    ],
)
def test_the_checker_refuses_what_argo_would_fail_on(text: str, why: str) -> None:
    with pytest.raises(ExprError, match=re.escape(why)):
        check_retry_expression(text)


@pytest.mark.parametrize(
    "text",
    [
        'lastRetry.status != "Error"',
        "asInt(lastRetry.exitCode) > 1",
        "lastRetry.message matches 'imminent node shutdown|pod deleted'",
        "!(asInt(retries) >= 3) and lastRetry.status == 'Failed'",
        "asInt(lastRetry.duration) < 60 or false",
    ],
)
def test_the_checker_accepts_the_forms_of_argos_retry_docs(text: str) -> None:
    check_retry_expression(text)  # docs/retries.md, argo-workflows v4.1.2


def _last(retries: int, exit_code: str, message: str, status: str = "Failed") -> dict[str, str]:
    """The scope Argo binds for a retry expression (operator.go buildRetryStrategyLocalScope)."""
    return {
        "retries": str(retries),
        "lastRetry.exitCode": exit_code,
        "lastRetry.status": status,
        "lastRetry.duration": "12.5",
        "lastRetry.message": message,
    }


@pytest.mark.parametrize(
    ("last", "retried"),
    [
        (_last(0, "1", "main: Error (exit code 1)"), True),  # a real failure, budget left (max 1)
        (_last(1, "1", "main: Error (exit code 1)"), False),  # budget used up
        (_last(7, "75", "main: Error (exit code 75)"), True),  # interrupted: always
        (_last(7, "-1", "pod deleted", "Error"), True),  # the pod vanished under the step: always
        (_last(7, "137", "main: OOMKilled (exit code 137)"), False),  # OOM counts as a failure
        (_last(7, "143", "main: Error (exit code 143)"), False),  # 143 is not the shim's code
    ],
)
def test_the_compiled_expression_retries_what_it_should(last: dict[str, str], retried: bool) -> None:
    assert evaluate_retry_expression(retry_expression(75, 1), last) is retried


def test_evaluation_fails_where_argo_would() -> None:
    with pytest.raises(ExprError, match="asInt\\('x'\\): not a number"):
        evaluate_retry_expression("asInt(retries) < 1", {**_last(0, "1", ""), "retries": "x"})
    with pytest.raises(ExprError, match=r"no value for lastRetry\.message"):
        evaluate_retry_expression(
            "asInt(retries) < 1",
            {"retries": "0", "lastRetry.exitCode": "1", "lastRetry.status": "", "lastRetry.duration": "0"},
        )
    assert evaluate_retry_expression(
        "lastRetry.message matches 'imminent node shutdown|pod deleted'", _last(0, "-1", "pod deleted")
    )
    assert not evaluate_retry_expression("!(lastRetry.status == 'Failed') && true", _last(0, "1", ""))
