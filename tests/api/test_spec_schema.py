"""The published JSON Schema of a job spec (domain.spec_schema) stays in step with the parser:
the same keys, every document `JobSpec.to_document()` writes is valid against it, and it is the
`application/json` body of the spec endpoints in the OpenAPI description."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
from fastapi.testclient import TestClient

from lowtide.adapters.templates import DirectoryTemplates
from lowtide.domain.spec_document import MAX_INT, parse_document
from lowtide.domain.spec_parse import _TOP_KEYS, build_job_spec
from lowtide.domain.spec_schema import job_spec_schema
from lowtide.domain.spec_steps import _STEP_KEYS
from support import embedded

SPECS = Path(__file__).resolve().parents[1] / "fixtures" / "specs"
REPO = Path(__file__).resolve().parents[2]
GOOD = sorted((SPECS / "good").glob("*.yaml")) + sorted((REPO / "examples" / "jobs").glob("*.yaml"))


def validator() -> jsonschema.protocols.Validator:
    schema = job_spec_schema()
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    return cls(schema)


def test_the_schema_has_exactly_the_keys_the_parser_reads() -> None:
    schema = job_spec_schema()
    # `timeout` is the walltime another change adds to the parser; the schema lists it already.
    assert set(schema["properties"]) == {*_TOP_KEYS, "timeout"}
    assert set(schema["properties"]["steps"]["items"]["properties"]) == {*_STEP_KEYS, "timeout"}
    assert schema["additionalProperties"] is False
    assert schema["properties"]["steps"]["items"]["additionalProperties"] is False


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.stem)
def test_every_document_the_parser_writes_is_valid_against_the_schema(path: Path) -> None:
    root = SPECS if path.is_relative_to(SPECS) else REPO / "examples"
    spec = build_job_spec(parse_document(path.read_bytes()), templates=DirectoryTemplates(root / "templates"))
    validator().validate(spec.to_document())


def test_the_schema_refuses_what_the_parser_refuses() -> None:
    v = validator()
    step = {"name": "a", "command": ["x"]}
    for bad in (
        {"name": "x", "steps": [{**step, "gpus": MAX_INT + 1}]},
        {"name": "x", "steps": [{**step, "colour": "red"}]},
        {"name": "Bad_Name", "steps": [step]},
        {"name": "x", "steps": []},
        {"name": "x", "priority": 101, "steps": [step]},
        {"name": "x", "steps": [{**step, "env": {"LOWTIDE_X": "1"}}]},
        {"steps": [step]},
    ):
        assert not v.is_valid(bad), bad
    assert v.is_valid({"use": "sft"})
    assert v.is_valid({"name": "x", "secrets": ["wandb"], "steps": [{**step, "timeout": "2h"}]})


def test_the_openapi_description_publishes_it(tmp_path: Path) -> None:
    lt = embedded(tmp_path)
    try:
        doc = TestClient(lt.app).get("/openapi.json").json()
        for path in ("/v1/jobs", "/v1/jobs/validate"):
            content = doc["paths"][path]["post"]["requestBody"]["content"]
            assert content["application/json"]["schema"] == job_spec_schema()
    finally:
        lt.close()
