"""Image references are checked at submission with the grammar runtimes and the kubelet use
(github.com/distribution/reference v0.6.0), so a step never fails attempt after attempt on a
name no runtime can parse (cluster mode: the kubelet's InvalidImageName)."""

from __future__ import annotations

import pytest

from lowtide.domain.image_ref import image_problem
from lowtide.domain.spec_issues import SpecInvalid
from lowtide.domain.spec_parse import build_job_spec

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    "image",
    [
        "ubuntu",
        "ubuntu:22.04",
        "library/ubuntu",
        "docker.io/library/ubuntu:latest",
        "ghcr.io/team/trainer:1.4",
        "nvcr.io/nvidia/pytorch:24.01-py3",
        "localhost/trainer",
        "localhost:5000/trainer:dev",
        "registry.example.com:5000/a/b/c",
        "MyRegistry.example.com/team/x",  # a registry host may have capitals
        "[::1]:5000/x:y",
        "x:TAG_with.dots-1",
        f"trainer@{DIGEST}",
        f"ghcr.io/team/trainer:1.4@{DIGEST}",
        "a__b/c.d/e---f",
    ],
)
def test_references_runtimes_pull_are_accepted(image: str) -> None:
    assert image_problem(image) is None


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("Ubuntu", "lowercase"),
        ("ghcr.io/Team/trainer", "lowercase"),
        ("Team/trainer", "lowercase"),
        ("trainer:", "not an image reference"),
        ("trainer::1", "not an image reference"),
        ("-trainer", "not an image reference"),
        ("trainer_", "not an image reference"),
        ("a___b", "not an image reference"),
        ("trainer@sha256:abc", "not an image reference"),  # a digest has at least 32 hex digits
        ("trainer:" + "t" * 129, "not an image reference"),  # a tag has at most 128 characters
        ("ghcr.io/team/trainer 1.4", "no spaces"),
        (" trainer", "no spaces"),
        ("tráiner", "ASCII"),
        ("a/" * 127 + "abc", "longer than 255"),
        ("https://ghcr.io/team/trainer", "not an image reference"),
    ],
)
def test_references_no_runtime_can_parse_are_refused_saying_why(image: str, why: str) -> None:
    problem = image_problem(image)
    assert problem is not None and why in problem


def _job(image: str, **params: str) -> dict[str, object]:
    doc: dict[str, object] = {"name": "j", "steps": [{"name": "train", "command": ["t"], "image": image}]}
    if params:
        doc["params"] = params
    return doc


def test_a_bad_image_is_refused_at_submission_naming_the_step() -> None:
    with pytest.raises(SpecInvalid) as err:
        build_job_spec(_job("ghcr.io/Team/trainer:1.4"))
    assert [i.loc for i in err.value.issues] == ["steps[0].image"]
    assert "lowercase" in err.value.issues[0].msg and "ghcr.io/Team/trainer:1.4" in err.value.issues[0].msg


def test_an_image_built_from_parameters_is_checked_with_their_values() -> None:
    assert build_job_spec(_job("ghcr.io/team/trainer:{{params.tag}}", tag="1.4")).steps[0].image == (
        "ghcr.io/team/trainer:{{params.tag}}"
    )
    with pytest.raises(SpecInvalid) as err:
        build_job_spec(_job("ghcr.io/team/trainer:{{params.tag}}", tag="not a tag"))
    assert [i.loc for i in err.value.issues] == ["steps[0].image"]
    with pytest.raises(SpecInvalid) as err:  # the same through a -p override
        build_job_spec(_job("ghcr.io/team/trainer:{{params.tag}}", tag="1.4"), param_overrides={"tag": "v 2"})
    assert [i.loc for i in err.value.issues] == ["steps[0].image"]
