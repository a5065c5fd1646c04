"""Job spec parsing, validation, rendering and DAG helpers (domain.spec_parse, docs/architecture.md §6.1).

The table of broken specs lives in tests/fixtures/specs/bad: each file says, in `# expect:`
lines, exactly which located errors it must produce. tests/fixtures/specs/good must all build.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from lowtide.adapters.templates import DirectoryTemplates
from lowtide.domain.layout import ArtifactLayout
from lowtide.domain.spec import DEFAULT_GRACE_SECONDS, JobSpec, StepSpec
from lowtide.domain.spec_document import MAX_SPEC_BYTES, parse_document
from lowtide.domain.spec_issues import SpecInvalid, SpecIssue
from lowtide.domain.spec_parse import build_job_spec
from lowtide.domain.spec_render import parse_param_assignment, render_step, topological_order, upstream_of

SPECS = Path(__file__).resolve().parents[1] / "fixtures" / "specs"
TEMPLATES = DirectoryTemplates(SPECS / "templates")
LAYOUT = ArtifactLayout(artifact_root="/art", work_root="/work")


def issues_of(doc: Any, **kwargs: Any) -> list[str]:
    with pytest.raises(SpecInvalid) as info:
        build_job_spec(doc, **kwargs)
    return [str(issue) for issue in info.value.issues]


def doc_issues(data: bytes | str, **kwargs: Any) -> list[str]:
    with pytest.raises(SpecInvalid) as info:
        parse_document(data, **kwargs)
    return [str(issue) for issue in info.value.issues]


def job(*steps: Mapping[str, Any], **top: Any) -> dict[str, Any]:
    return {"name": "j", **top, "steps": list(steps)}


def step(name: str, *command: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "command": list(command) or ["true"], **extra}


# --------------------------------------------------------------------------- the fixture tables


def expectations(data: bytes) -> list[str]:
    prefix = "# expect: "
    return [line[len(prefix) :] for line in data.decode("latin-1").splitlines() if line.startswith(prefix)]


def unmatched(expected: Sequence[str], issues: Sequence[SpecIssue]) -> tuple[list[str], list[str]]:
    """Pair each `loc: substring` with a distinct issue at exactly that loc whose msg contains it."""
    left = list(issues)
    missing: list[str] = []
    for exp in expected:
        for issue in left:
            head = f"{issue.loc}: "
            if exp.startswith(head) and exp[len(head) :] in issue.msg:
                left.remove(issue)
                break
        else:
            missing.append(exp)
    return missing, [str(issue) for issue in left]


@pytest.mark.parametrize("path", sorted((SPECS / "bad").glob("*.yaml")), ids=lambda p: p.stem)
def test_bad_spec_gives_exactly_the_expected_located_errors(path: Path) -> None:
    data = path.read_bytes()
    expected = expectations(data)
    assert expected, f"{path.name} has no '# expect:' line"
    with pytest.raises(SpecInvalid) as info:
        build_job_spec(parse_document(data), templates=TEMPLATES, max_gpus_per_node=8)
    missing, extra = unmatched(expected, info.value.issues)
    assert (missing, extra) == ([], []), str(info.value)


@pytest.mark.parametrize("path", sorted((SPECS / "good").glob("*")), ids=lambda p: p.name)
def test_good_spec_builds_and_round_trips(path: Path) -> None:
    spec = build_job_spec(parse_document(path.read_bytes()), templates=TEMPLATES, max_gpus_per_node=8)
    assert spec.steps
    again = build_job_spec(spec.to_document())
    assert again == JobSpec(**{**_fields(spec), "template": None})


def _fields(spec: JobSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in JobSpec.__dataclass_fields__}


# --------------------------------------------------------------------------- parse_document


def test_over_size_input_says_size_and_limit() -> None:
    data = b"name: x\n" + b"#" * MAX_SPEC_BYTES
    assert doc_issues(data) == [
        f"(document): the document is {len(data)} bytes, over the limit of 1048576 bytes"
    ]


def test_exactly_the_limit_is_accepted() -> None:
    head = b"name: x\n#"
    data = head + b"x" * (MAX_SPEC_BYTES - len(head))
    assert parse_document(data) == {"name": "x"}


def test_non_utf8_says_byte_offset() -> None:
    assert doc_issues(b"name: ok\nteam: \xc3\x28\n") == ["(document): not valid UTF-8: bad byte at offset 15"]


def test_malformed_yaml_says_line_and_column() -> None:
    assert doc_issues("name: x\nsteps: [a\nb: c\n") == [
        "(document): invalid YAML at line 3, column 2: did not find expected ',' or ']'"
        " (while parsing a flow sequence)"
    ]


def test_malformed_json_says_line_and_column() -> None:
    assert doc_issues('{"name": "x",\n "steps": }', fmt="json") == [
        "(document): invalid JSON at line 2, column 11: Expecting value"
    ]


def test_duplicate_keys_are_rejected_with_lines() -> None:
    text = "name: a\nsteps:\n  - name: s\n    command: [x]\nname: b\n"
    assert doc_issues(text) == ["(document): duplicate key 'name' at line 5 (first at line 1)"]
    assert doc_issues(text, fmt="yaml") == ["(document): duplicate key 'name' at line 5 (first at line 1)"]


def test_duplicate_keys_in_json() -> None:
    assert doc_issues('{"a": 1, "a": 2}', fmt="json") == ["(document): duplicate key 'a'"]
    # auto mode falls back to YAML, which can say where
    assert doc_issues('{"a": 1,\n "a": 2}') == ["(document): duplicate key 'a' at line 2 (first at line 1)"]


@pytest.mark.parametrize(
    ("text", "got"),
    [("- a\n- b\n", "a list"), ("just text\n", "a string"), ("", "an empty document"), ("3", "an integer")],
)
def test_top_level_must_be_a_mapping(text: str, got: str) -> None:
    assert doc_issues(text) == [f"(document): the top level must be a mapping, got {got}"]


def test_auto_reads_json_and_yaml() -> None:
    assert parse_document('{"name": "x", "params": {"lr": 2e-5}}') == {"name": "x", "params": {"lr": 2e-5}}
    assert parse_document("{name: x}") == {"name": "x"}  # not JSON, but YAML flow
    assert parse_document("\ufeffname: x\n") == {"name": "x"}  # a BOM is tolerated


def test_yaml_scalars_follow_json_like_rules() -> None:
    doc = parse_document(
        "a: 2e-5\nb: 2.0e-5\nc: yes\nd: on\ne: 2024-01-01\nf: 1:30\ng: 007\nh: 0x1f\ni: true\nj: ~\nk: 3\n"
    )
    assert doc == {
        "a": 2e-5,
        "b": 2e-5,
        "c": "yes",
        "d": "on",
        "e": "2024-01-01",
        "f": "1:30",
        "g": "007",
        "h": "0x1f",
        "i": True,
        "j": None,
        "k": 3,
    }


def test_yaml_merge_keys_still_work() -> None:
    doc = parse_document("base: &b {gpus: 1, image: x}\nstep: {<<: *b, gpus: 2}\n")
    assert doc["step"] == {"gpus": 2, "image": "x"}


def test_alias_bombs_and_recursive_aliases_are_rejected() -> None:
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [{', '.join(['*' + prev] * 10)}]")
    assert doc_issues("\n".join(lines)) == [
        "(document): the document expands to more than 1048576 values (YAML aliases)"
    ]
    assert doc_issues("a: &a [*a]\n") == [
        "(document): a YAML alias refers to the mapping or list that contains it"
    ]


def test_unsafe_tags_are_rejected() -> None:
    [issue] = doc_issues("a: !!python/object/apply:os.system [echo hi]\n")
    assert issue.startswith("(document): invalid YAML at line 1, column 4: could not determine a constructor")


# --------------------------------------------------------------------------- SpecInvalid


def test_spec_invalid_str_and_pickle() -> None:
    exc = SpecInvalid(
        [SpecIssue("name", "required"), SpecIssue("steps[0].gpus", "must be 0 or more, got -1")]
    )
    assert str(exc) == "name: required\nsteps[0].gpus: must be 0 or more, got -1"
    assert isinstance(exc, ValueError)
    again = pickle.loads(pickle.dumps(exc))
    assert again.issues == exc.issues


# --------------------------------------------------------------------------- build_job_spec


def test_defaults() -> None:
    spec = build_job_spec(job(step("a", "echo", "hi")))
    assert spec == JobSpec(
        name="j",
        steps=(StepSpec(name="a", command=("echo", "hi")),),
        team="default",
        priority=50,
        grace_seconds=DEFAULT_GRACE_SECONDS,
        max_retries=0,
        params={},
        template=None,
    )


@pytest.mark.parametrize(("given", "value"), [("low", 10), ("normal", 50), ("high", 90), (0, 0), (100, 100)])
def test_priority_names_and_integers(given: object, value: int) -> None:
    assert build_job_spec(job(step("a"), priority=given)).priority == value


@pytest.mark.parametrize(
    ("given", "msg"),
    [
        (True, "priority: must be low, normal, high or an integer from 0 to 100, got a boolean"),
        (False, "priority: must be low, normal, high or an integer from 0 to 100, got a boolean"),
        (-1, "priority: must be between 0 and 100, got -1"),
        (50.0, "priority: must be low, normal, high or an integer from 0 to 100, got a number"),
        ("urgent", "priority: unknown priority 'urgent': use low, normal, high or an integer from 0 to 100"),
    ],
)
def test_bad_priorities(given: object, msg: str) -> None:
    assert issues_of(job(step("a"), priority=given)) == [msg]


def test_grace_and_retries() -> None:
    spec = build_job_spec(job(step("a", max_retries=3), step("b"), grace_seconds=5, max_retries=1))
    assert spec.grace_seconds == 5.0 and isinstance(spec.grace_seconds, float)
    assert [spec.retries_for(s) for s in spec.steps] == [3, 1]
    assert issues_of(job(step("a"), grace_seconds=True, max_retries=True)) == [
        "grace_seconds: must be a number of seconds, got a boolean",
        "max_retries: must be an integer, got a boolean",
    ]
    assert issues_of(job(step("a"), grace_seconds=float("inf"))) == [
        "grace_seconds: must be a finite number, got inf"
    ]


def test_all_problems_are_collected() -> None:
    doc = {
        "name": "Bad",
        "priority": True,
        "steps": [step("a", gpus=-1), {"name": "b", "command": "run it", "depends": ["a", "zz"]}],
    }
    assert issues_of(doc) == [
        "name: 'Bad' is not a valid name: use 1 to 63 lowercase letters, digits or '-',"
        " starting and ending with a letter or digit",
        "priority: must be low, normal, high or an integer from 0 to 100, got a boolean",
        "steps[0].gpus: must be 0 or more, got -1",
        "steps[1].command: a plain string is not accepted: give a list of arguments, e.g. [python, train.py]",
        "steps[1].depends[1]: unknown step 'zz' (steps: a, b)",
    ]


def test_non_mapping_document_and_step() -> None:
    assert issues_of(["a"]) == ["(document): the top level must be a mapping, got a list"]
    not_a_step: Any = "prep"
    assert issues_of(job(not_a_step)) == ["steps[0]: must be a mapping with name and command, got a string"]


def test_gpus_limit_only_when_known() -> None:
    assert build_job_spec(job(step("a", gpus=64))).steps[0].gpus == 64
    assert issues_of(job(step("a", gpus=5)), max_gpus_per_node=4) == [
        "steps[0].gpus: 5 GPUs requested but the largest node has 4"
    ]
    assert build_job_spec(job(step("a", gpus=4)), max_gpus_per_node=4).steps[0].gpus == 4


def test_command_integers_become_strings() -> None:
    spec = build_job_spec(job(step("a", "sleep", 30)))  # type: ignore[arg-type]
    assert spec.steps[0].command == ("sleep", "30")


def test_env_accepts_valid_names_and_integer_values() -> None:
    spec = build_job_spec(job(step("a", env={"PORT": 8080, "HF_HOME": "/cache", "_X": ""})))
    assert spec.steps[0].env == {"PORT": "8080", "HF_HOME": "/cache", "_X": ""}
    assert issues_of(job(step("a", env={"lowtide_x": "1"}))) == [
        "steps[0].env.lowtide_x: 'lowtide_x' is reserved: CUDA_VISIBLE_DEVICES and names starting with"
        " LOWTIDE_ are set by lowtide (the step contract)"
    ]


def test_cycles_are_named_once_each_in_spec_order() -> None:
    doc = job(
        step("x", depends=["y"]),
        step("prep", depends=["eval"]),
        step("y", depends=["x"]),
        step("train", depends=["prep"]),
        step("eval", depends=["train"]),
        step("after", depends=["eval"]),
    )
    assert issues_of(doc) == [
        "steps[0].depends: dependency cycle x -> y -> x",
        "steps[1].depends: dependency cycle prep -> train -> eval -> prep",
    ]


def test_cycle_names_the_shortest_way_back() -> None:
    # a -> b -> c -> a and a -> c -> a: both cycles are one component; the shortest is named
    doc = job(step("a", depends=["c"]), step("b", depends=["a"]), step("c", depends=["a", "b"]))
    assert issues_of(doc) == ["steps[0].depends: dependency cycle a -> c -> a"]


def test_placeholders_whitespace_and_transitive_inputs() -> None:
    spec = build_job_spec(
        job(
            step("a"),
            step("b", depends=["a"]),
            step("c", "run", "{{ inputs.a }}", "{{inputs.b}}", "{{  params.lr  }}", depends=["b"]),
            params={"lr": 0.1},
        )
    )
    assert spec.steps[2].command == ("run", "{{ inputs.a }}", "{{inputs.b}}", "{{  params.lr  }}")


def test_unknown_parameter_when_no_params() -> None:
    assert issues_of(job(step("a", "run", "{{params.lr}}"))) == [
        "steps[0].command[1]: unknown parameter 'lr' in {{params.lr}} (no parameters are defined)"
    ]


def test_params_must_be_json_compatible() -> None:
    spec = build_job_spec(job(step("a"), params={"n": 1, "xs": (1, 2), "m": {"k": [None, True]}}))
    assert spec.params == {"n": 1, "xs": [1, 2], "m": {"k": [None, True]}}
    assert issues_of(job(step("a"), params={"m": {"k": {1: 2}}, "o": object()})) == [
        "params.m.k: keys must be strings, got 1",
        "params.o: must be a JSON value (string, number, boolean, null, list or mapping), got an object",
    ]
    assert issues_of(job(step("a"), params=["lr"])) == [
        "params: must be a mapping of parameter names to values, got a list"
    ]


def test_param_overrides_on_a_plain_job() -> None:
    spec = build_job_spec(
        job(step("a", "run", "{{params.lr}}"), params={"lr": 0.1}), param_overrides={"lr": 0.5}
    )
    assert spec.params == {"lr": 0.5}
    # An override of a parameter the job does not declare is a typo, refused (not silently added).
    assert issues_of(
        job(step("a", "run", "{{params.lr}}"), params={"lr": 0.1}),
        param_overrides={"lr": 0.5, "unknown": 1},
        override_locs={"lr": "query.param[0]", "unknown": "query.param[1]"},
    ) == [
        "query.param[1]: 'unknown' is not a parameter of this job (it has: lr);"
        " declare it under 'params' to set it"
    ]
    assert issues_of(job(step("a")), param_overrides={"unknown": 1}) == [
        "params.unknown: 'unknown' is not a parameter of this job (it has none);"
        " declare it under 'params' to set it"
    ]
    assert issues_of(job(step("a"), params={"n": 1}), param_overrides={"bad-name": 1, "n": None}) == [
        "params.bad-name: 'bad-name' is not a valid parameter name: use letters, digits and '_',"
        " not starting with a digit (it becomes LOWTIDE_PARAM_<NAME>)",
        "params.n: has no value (null): give one (a null parameter means 'required' only in a template)",
    ]


def test_round_trip_of_a_plain_spec() -> None:
    spec = build_job_spec(parse_document((SPECS / "good" / "diamond.yaml").read_bytes()))
    assert build_job_spec(spec.to_document()) == spec
    assert build_job_spec(json.loads(json.dumps(spec.to_document()))) == spec


# --------------------------------------------------------------------------- templates


def sft(**top: Any) -> dict[str, Any]:
    return {"use": "sft", **top}


def test_template_expansion_and_overrides() -> None:
    spec = build_job_spec(sft(name="run-1", priority="high", params={"base": "s3://m"}), templates=TEMPLATES)
    assert spec.template == "sft"
    assert spec.name == "run-1"
    assert spec.team == "research"  # from the template
    assert spec.priority == 90  # the job's own
    assert spec.grace_seconds == 60.0  # from the template
    assert spec.params == {"base": "s3://m", "lr": 2e-5}
    assert [s.name for s in spec.steps] == ["prep", "train", "eval"]
    assert [s.gpus for s in spec.steps] == [0, 2, 1]


def test_template_name_used_when_job_gives_none() -> None:
    assert build_job_spec(sft(params={"base": "m"}), templates=TEMPLATES).name == "sft"


def test_template_param_overrides() -> None:
    spec = build_job_spec(sft(params={"base": "m"}), templates=TEMPLATES, param_overrides={"lr": 0.3})
    assert spec.params == {"base": "m", "lr": 0.3}
    spec = build_job_spec(sft(), templates=TEMPLATES, param_overrides={"base": "from-cli"})
    assert spec.params["base"] == "from-cli"
    assert issues_of(sft(params={"base": "m"}), templates=TEMPLATES, param_overrides={"seed": 1}) == [
        "params.seed: 'seed' is not a parameter of template 'sft' (it has: base, lr)"
    ]
    assert issues_of(
        sft(params={"base": "m"}),
        templates=TEMPLATES,
        param_overrides={"seed": 1},
        override_locs={"seed": "query.param[0]"},
    ) == ["query.param[0]: 'seed' is not a parameter of template 'sft' (it has: base, lr)"]
    assert issues_of(sft(params={"base": "m"}), templates=TEMPLATES, param_overrides={"base": None}) == [
        "params.base: required by template 'sft'"
    ]


def test_templates_not_configured() -> None:
    assert issues_of(sft(params={"base": "m"})) == ["use: templates are not configured"]
    assert issues_of({"use": 3}, templates=TEMPLATES) == ["use: must be a template name, got an integer"]


class MemoryTemplates:
    def __init__(self, docs: Mapping[str, Any]) -> None:
        self.docs = docs
        self.asked: list[str] = []

    def load(self, name: str) -> Mapping[str, Any] | None:
        self.asked.append(name)
        return self.docs.get(name)

    def names(self) -> Sequence[str]:
        return sorted(self.docs)


def test_path_like_names_never_reach_the_lookup() -> None:
    lookup = MemoryTemplates({})
    assert issues_of({"use": "../../etc/passwd"}, templates=lookup) == [
        "use: unknown template '../../etc/passwd' (no templates are available)"
    ]
    assert lookup.asked == []


def test_template_without_params_and_job_params() -> None:
    lookup = MemoryTemplates({"t": {"steps": [step("a")]}})
    assert issues_of({"use": "t", "name": "x", "params": {"p": 1}}, templates=lookup) == [
        "params.p: not a parameter of template 't' (it has none)"
    ]
    assert issues_of({"use": "t"}, templates=lookup) == ["name: required (the template 't' gives none)"]


def test_round_trip_of_a_templated_spec_drops_the_template() -> None:
    spec = build_job_spec(sft(name="r", params={"base": "m"}), templates=TEMPLATES)
    again = build_job_spec(spec.to_document())
    assert "use" not in spec.to_document()
    assert again.template is None
    assert again == JobSpec(**{**_fields(spec), "template": None})


# --------------------------------------------------------------------------- render_step


def design_spec() -> JobSpec:
    return build_job_spec(parse_document((SPECS / "good" / "design_example.yaml").read_bytes()))


def test_render_design_example() -> None:
    spec = design_spec()
    prep, train, ev = (render_step(spec, s, job_id="42", layout=LAYOUT) for s in spec.steps)
    assert prep.command == ("python", "prep.py", "--out", "/art/jobs/42/prep/outputs/shards")
    assert prep.inputs == {}
    assert prep.outputs == "/art/jobs/42/prep/outputs"
    assert prep.checkpoint_dir is None
    assert prep.image == "registry/prep:1.2"
    assert prep.gpus == 0
    assert train.command == ("python", "train.py", "--lr", "2e-05")
    assert train.inputs == {"prep": "/art/jobs/42/prep/outputs"}
    assert train.checkpoint_dir == "/art/jobs/42/train/checkpoints"
    assert train.gpus == 4
    assert ev.command == ("python", "eval.py", "--model", "/art/jobs/42/train/outputs")
    assert ev.inputs == {"train": "/art/jobs/42/train/outputs"}
    assert ev.outputs == "/art/jobs/42/eval/outputs"


def test_render_every_placeholder_kind() -> None:
    spec = build_job_spec(parse_document((SPECS / "good" / "diamond.yaml").read_bytes()))
    a, b, c, d = (render_step(spec, s, job_id="j-7", layout=LAYOUT) for s in spec.steps)
    assert a.command == ("sh", "-c", "echo j-7 diamond a > /art/jobs/j-7/a/outputs/id")
    assert b.command == ("run", "--seed", "7", "--in", "/art/jobs/j-7/a/outputs")
    assert b.env == {"FLAGS": '["--fast","--quiet"]', "CFG": '{"depth":3}'}
    assert c.image == "registry/c:7"
    assert c.command == ("run", "42", "--debug=false")
    # {{inputs.a}} is reached through b and c: it is listed with the direct inputs
    assert d.inputs == {
        "b": "/art/jobs/j-7/b/outputs",
        "c": "/art/jobs/j-7/c/outputs",
        "a": "/art/jobs/j-7/a/outputs",
    }
    assert d.command[1:] == ("/art/jobs/j-7/a/outputs", "/art/jobs/j-7/b/outputs", "/art/jobs/j-7/c/outputs")


def test_render_param_types() -> None:
    params = {"s": "text", "t": True, "i": 3, "f": 0.5, "l": [1, "a"], "n": None}
    spec = JobSpec(
        name="j",
        steps=(StepSpec(name="a", command=tuple(f"{{{{params.{k}}}}}" for k in params)),),
        params=params,
    )
    assert render_step(spec, spec.steps[0], job_id="1", layout=LAYOUT).command == (
        "text",
        "true",
        "3",
        "0.5",
        '[1,"a"]',
        "null",
    )


def test_render_rejects_what_validation_would_have() -> None:
    spec = JobSpec(name="j", steps=(StepSpec(name="a", command=("{{params.nope}}",)),))
    with pytest.raises(ValueError, match=r"step 'a': cannot fill \{\{params.nope\}\}"):
        render_step(spec, spec.steps[0], job_id="1", layout=LAYOUT)


# --------------------------------------------------------------------------- parse_param_assignment


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("lr=2e-5", ("lr", 2e-5)),
        ("lr=2.0e-5", ("lr", 2e-5)),
        ("lr=0.1", ("lr", 0.1)),
        ("n=3", ("n", 3)),
        ("n=-3", ("n", -3)),
        ("name=abc", ("name", "abc")),
        ("flag=true", ("flag", True)),
        ("flag=False", ("flag", False)),
        ("answer=yes", ("answer", "yes")),
        ("base=s3://models/base-8b", ("base", "s3://models/base-8b")),
        ("expr=a=b", ("expr", "a=b")),
        ("code=007", ("code", "007")),
        ("when=2024-01-01", ("when", "2024-01-01")),
        ("msg=hello # world", ("msg", "hello # world")),
        ("empty=", ("empty", "")),
        ("gone=null", ("gone", None)),
        ("xs=[1, 2]", ("xs", [1, 2])),
        ("cfg={depth: 3}", ("cfg", {"depth": 3})),
    ],
)
def test_parse_param_assignment(text: str, expected: tuple[str, Any]) -> None:
    got = parse_param_assignment(text)
    assert got == expected
    assert type(got[1]) is type(expected[1])


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        ("lr", "expected NAME=VALUE, got 'lr' (no '=')"),
        ("=3", "expected NAME=VALUE, got '=3' (no name before '=')"),
        (
            "my-lr=3",
            "'my-lr' is not a valid parameter name: use letters, digits and '_', not starting with a digit",
        ),
        ("xs=[1, 2", "xs: cannot read '[1, 2' as a list or mapping"),
    ],
)
def test_parse_param_assignment_errors(text: str, msg: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_param_assignment(text)
    assert str(info.value).startswith(msg)


# --------------------------------------------------------------------------- DAG helpers


def test_topological_order_is_stable() -> None:
    spec = build_job_spec(
        job(
            step("eval", depends=["train"]),
            step("report"),
            step("train", depends=["prep"]),
            step("prep"),
            step("lint"),
        )
    )
    # whenever a step becomes ready, the earliest ready step in spec order goes next
    assert topological_order(spec) == ("report", "prep", "train", "eval", "lint")
    assert topological_order(design_spec()) == ("prep", "train", "eval")


def test_upstream_of() -> None:
    spec = build_job_spec(parse_document((SPECS / "good" / "diamond.yaml").read_bytes()))
    assert upstream_of(spec, "a") == frozenset()
    assert upstream_of(spec, "b") == {"a"}
    assert upstream_of(spec, "d") == {"a", "b", "c"}
    with pytest.raises(KeyError):
        upstream_of(spec, "zz")


def test_topological_order_refuses_a_cycle_built_by_hand() -> None:
    spec = JobSpec(
        name="j",
        steps=(
            StepSpec(name="a", command=("x",), depends=("b",)),
            StepSpec(name="b", command=("x",), depends=("a",)),
        ),
    )
    with pytest.raises(ValueError, match="dependency cycle among a, b"):
        topological_order(spec)


# --------------------------------------------------------------------------- bounded numbers, excerpts


HUGE = "9" * 5000  # past Python's 4,300-digit limit for int <-> str


def test_integers_beyond_64_bits_are_located_and_never_converted() -> None:
    text = (
        f'{{"name": "x", "max_retries": {HUGE}, "params": {{"a": [1, -{HUGE}]}}, '
        '"steps": [{"gpus": 9223372036854775808}]}'
    )
    issues = doc_issues(text)
    assert [i.split(": ", 1)[0] for i in issues] == ["max_retries", "params.a[1]", "steps[0].gpus"]
    assert all("integer out of range" in i for i in issues)
    assert "(5000 digits)" in issues[0] and "…" in issues[0] and len(issues[0]) < 300
    assert "9223372036854775808;" in issues[2]  # short ones are shown whole
    yaml_issues = doc_issues(f"name: x\nsteps:\n  - name: a\n    command: [x, {HUGE}]\n")
    assert (
        yaml_issues[0].startswith("steps[0].command[1]: integer out of range") and len(yaml_issues[0]) < 300
    )
    assert parse_document('{"a": 9223372036854775807, "b": -9223372036854775808}') == {
        "a": 2**63 - 1,
        "b": -(2**63),
    }


def test_param_assignments_are_bounded_and_excerpted() -> None:
    with pytest.raises(ValueError, match=r"^n: integer out of range: 9{64}… \(5000 digits\)"):
        parse_param_assignment(f"n={HUGE}")
    with pytest.raises(ValueError, match=r"^n\[1\]: integer out of range"):
        parse_param_assignment(f"n=[1, {HUGE}]")
    with pytest.raises(ValueError) as info:
        parse_param_assignment("x" * 100_000)
    assert len(str(info.value)) < 200
    assert parse_param_assignment("n=-9223372036854775808") == ("n", -(2**63))


def test_non_finite_numbers_stay_located_by_their_field() -> None:
    doc = parse_document('{"name": "x", "grace_seconds": Infinity, "params": {"lr": NaN}, "steps": []}')
    issues = issues_of({**doc, "steps": [step("a")]})
    assert issues == [
        "grace_seconds: must be a finite number, got inf",
        "params.lr: must be a finite number, got nan",
    ]


def test_long_values_are_echoed_as_excerpts() -> None:
    long = "y" * 100_000
    issues = issues_of({"name": long, "priority": long, long: 1, "steps": [step("a", depends=[long])]})
    assert issues and all(len(i) < 400 for i in issues), issues
    assert any(i.startswith("name: 'yyyy") and "…' is not a valid name" in i for i in issues)
