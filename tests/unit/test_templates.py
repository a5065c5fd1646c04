"""Template files (adapters.templates.DirectoryTemplates) and the shipped examples/templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtide.adapters.templates import DirectoryTemplates
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec_document import MAX_SPEC_BYTES, parse_document
from lowtide.domain.spec_issues import SpecInvalid
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import render_step, topological_order

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = DirectoryTemplates(REPO / "examples" / "templates")
LAYOUT = ArtifactLayout(artifact_root="/art", work_root="/work")

STEPS = "steps:\n  - name: a\n    command: [echo]\n"


@pytest.fixture
def tdir(tmp_path: Path) -> Path:
    root = tmp_path / "templates"
    root.mkdir()
    return root


def load_issues(lookup: DirectoryTemplates, name: str) -> list[str]:
    with pytest.raises(SpecInvalid) as info:
        lookup.load(name)
    return [str(issue) for issue in info.value.issues]


def test_loads_yaml_yml_and_json(tdir: Path) -> None:
    (tdir / "a.yaml").write_text(STEPS)
    (tdir / "b.yml").write_text("params: {x: 1}\n" + STEPS)
    (tdir / "c.json").write_text('{"steps": [{"name": "a", "command": ["echo"]}]}')
    lookup = DirectoryTemplates(str(tdir))
    assert lookup.load("a") == {"steps": [{"name": "a", "command": ["echo"]}]}
    assert lookup.load("b") == {"params": {"x": 1}, "steps": [{"name": "a", "command": ["echo"]}]}
    assert lookup.load("c") == {"steps": [{"name": "a", "command": ["echo"]}]}
    assert lookup.load("d") is None


def test_names_are_sorted_and_only_valid_template_files(tdir: Path) -> None:
    for name in ("sft.yaml", "eval.yml", "prep.json", "Bad_Name.yaml", "notes.txt", "README.md"):
        (tdir / name).write_text(STEPS)
    (tdir / "dir.yaml").mkdir()
    assert DirectoryTemplates(tdir).names() == ["eval", "prep", "sft"]


def test_missing_directory_has_no_templates(tmp_path: Path) -> None:
    lookup = DirectoryTemplates(tmp_path / "nope")
    assert lookup.names() == []
    assert lookup.load("sft") is None


@pytest.mark.parametrize("name", ["../secret", "sub/x", "/etc/passwd", "..", "", "X", "a.yaml"])
def test_path_like_or_invalid_names_are_unknown(tdir: Path, name: str) -> None:
    (tdir.parent / "secret.yaml").write_text(STEPS)
    (tdir / "sub").mkdir()
    (tdir / "sub" / "x.yaml").write_text(STEPS)
    assert DirectoryTemplates(tdir).load(name) is None


def test_unparsable_template_is_located(tdir: Path) -> None:
    (tdir / "bad.yaml").write_text("steps:\n  - name: a\n    command: [echo\n")
    assert load_issues(DirectoryTemplates(tdir), "bad") == [
        "template 'bad': (document): invalid YAML at line 4, column 1: did not find expected ',' or ']'"
        " (while parsing a flow sequence)"
    ]
    (tdir / "list.json").write_text("[1, 2]")
    assert load_issues(DirectoryTemplates(tdir), "list") == [
        "template 'list': (document): the top level must be a mapping, got a list"
    ]


def test_json_template_is_read_as_json(tdir: Path) -> None:
    (tdir / "j.json").write_text("{steps: []}")  # valid YAML, not JSON
    assert load_issues(DirectoryTemplates(tdir), "j") == [
        "template 'j': (document): invalid JSON at line 1, column 2:"
        " Expecting property name enclosed in double quotes"
    ]


def test_oversize_and_non_utf8_templates(tdir: Path) -> None:
    (tdir / "big.yaml").write_bytes(b"#" * (MAX_SPEC_BYTES + 10))
    assert load_issues(DirectoryTemplates(tdir), "big") == [
        f"template 'big': (document): the document is {MAX_SPEC_BYTES + 1} bytes,"
        f" over the limit of {MAX_SPEC_BYTES} bytes"
    ]
    (tdir / "latin.yaml").write_bytes(b"name: caf\xe9\n")
    assert load_issues(DirectoryTemplates(tdir), "latin") == [
        "template 'latin': (document): not valid UTF-8: bad byte at offset 9"
    ]


def test_two_files_for_one_name_is_an_error(tdir: Path) -> None:
    (tdir / "sft.yaml").write_text(STEPS)
    (tdir / "sft.json").write_text('{"steps": []}')
    assert load_issues(DirectoryTemplates(tdir), "sft") == [
        "template 'sft': (document): more than one file: sft.yaml, sft.json"
    ]


def test_build_reports_template_file_errors_with_prefix(tdir: Path) -> None:
    (tdir / "t.yaml").write_text("name: t\nname: u\n" + STEPS)
    with pytest.raises(SpecInvalid) as info:
        build_job_spec({"use": "t"}, templates=DirectoryTemplates(tdir))
    assert str(info.value) == "template 't': (document): duplicate key 'name' at line 2 (first at line 1)"


def test_a_new_file_is_picked_up_without_restart(tdir: Path) -> None:
    lookup = DirectoryTemplates(tdir)
    assert lookup.names() == []
    (tdir / "new.yaml").write_text(STEPS)
    assert lookup.names() == ["new"]
    assert build_job_spec({"use": "new", "name": "job-1"}, templates=lookup).template == "new"


# --------------------------------------------------------------------------- examples/templates


def test_example_templates_are_listed() -> None:
    assert EXAMPLES.names() == ["eval", "prep", "sft"]


def test_example_sft_template_shape() -> None:
    doc = EXAMPLES.load("sft")
    assert doc is not None
    assert doc["params"] == {"base": None, "lr": 2e-5, "steps": 200, "shards": 4}
    spec = build_job_spec({"use": "sft", "params": {"base": "s3://models/base-8b"}}, templates=EXAMPLES)
    assert topological_order(spec) == ("prep", "train", "eval")
    assert [(s.name, s.gpus, s.checkpoint, s.depends) for s in spec.steps] == [
        ("prep", 0, False, ()),
        ("train", 2, True, ("prep",)),
        ("eval", 1, False, ("train",)),
    ]
    prep, train, ev = (render_step(spec, s, job_id="9", layout=LAYOUT) for s in spec.steps)
    assert prep.command == (
        "python",
        "-m",
        "lowtide.examples.prep",
        "--out",
        "/art/jobs/9/prep/outputs",
        "--shards",
        "4",
    )
    assert train.command == (
        "python",
        "-m",
        "lowtide.examples.train",
        "--data",
        "/art/jobs/9/prep/outputs",
        "--out",
        "/art/jobs/9/train/outputs",
        "--steps",
        "200",
        "--lr",
        "2e-05",
    )
    assert train.env == {"BASE_MODEL": "s3://models/base-8b"}
    assert train.checkpoint_dir == "/art/jobs/9/train/checkpoints"
    assert ev.command == (
        "python",
        "-m",
        "lowtide.examples.eval",
        "--model",
        "/art/jobs/9/train/outputs",
        "--out",
        "/art/jobs/9/eval/outputs",
    )


def test_example_sft_requires_base() -> None:
    with pytest.raises(SpecInvalid) as info:
        build_job_spec({"use": "sft"}, templates=EXAMPLES)
    assert str(info.value) == "params.base: required by template 'sft'"


@pytest.mark.parametrize(
    ("name", "params"),
    [("prep", {}), ("eval", {"model": "/art/jobs/1/train/outputs"}), ("sft", {"base": "m"})],
)
def test_example_templates_build_within_four_gpus(name: str, params: dict[str, str]) -> None:
    spec = build_job_spec({"use": name, "params": params}, templates=EXAMPLES, max_gpus_per_node=4)
    assert spec.template == name
    for step in spec.steps:
        assert step.command[:3] == ("python", "-m", f"lowtide.examples.{step.name}")


def test_example_eval_renders_model_param() -> None:
    spec = build_job_spec({"use": "eval", "params": {"model": "s3://runs/7/train"}}, templates=EXAMPLES)
    [step] = spec.steps
    assert render_step(spec, step, job_id="3", layout=LAYOUT).command == (
        "python",
        "-m",
        "lowtide.examples.eval",
        "--model",
        "s3://runs/7/train",
        "--out",
        "/art/jobs/3/eval/outputs",
    )


def test_example_job_files_build_with_example_templates() -> None:
    for path in sorted((REPO / "examples" / "jobs").glob("*.yaml")):
        spec = build_job_spec(parse_document(path.read_bytes()), templates=EXAMPLES, max_gpus_per_node=4)
        assert spec.steps, path
