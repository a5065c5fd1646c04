"""The CLI prints user-controlled text as written: never as Rich markup, never as terminal
control sequences (issue 10, defect 6). Real `lowtide` commands (Typer's CliRunner) against a
real API served over HTTP (`support.Served`) on a real SQLite store.

Records a hostile step could have left before labels were validated (or that another path
stores) are written straight into the store, so the printing is tested on its own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from lowtide.cli.main import app
from lowtide.cli.output import clean, safe
from lowtide.wiring import Embedded
from support import Served, embedded, running

ESC = "\x1b"
JOB = {
    "name": "sft",
    "params": {"lr": 0.1},
    "steps": [{"name": "train", "command": ["echo", "{{params.lr}}"], "checkpoint": True}],
}


@dataclass
class Cli:
    lt: Embedded
    served: Served
    token: str
    config: Path
    job: str

    def run(self, *args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(
            app,
            ["--config", str(self.config), "--url", self.served.url, "--token", self.token, *args],
            env={"COLUMNS": "250"},
        )
        return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    lt = embedded(tmp_path)
    _, token = lt.store.create_token(name="root", owner="root", role="admin", now=lt.clock.now())
    r = TestClient(lt.app).post(
        "/v1/jobs",
        content=yaml.safe_dump(JOB),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"},
    )
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    lt.store.ensure_gpus(lt.nodes, lt.clock.now())
    launch = running(
        lt.store,
        lt.store.begin_attempt(
            job_id=job,
            step="train",
            node="node-a",
            gpus=(),
            layout=lt.loop.settings.layout,
            now=lt.clock.now(),
            reason="test",
        ),
    )
    now = lt.clock.now()
    for label in ("[/bold]ckpt", f"{ESC}[2Jwiped", "rtl\u202eevil"):
        lt.store.record_checkpoint(launch.attempt_id, label=label, progress="[red]p", source="api", now=now)
    lt.store.add_event(job, "train", launch.attempt_id, at=now, kind="note", message=f"[/red]x {ESC}]0;t\x07")
    log = Path(lt.loop.settings.layout.attempt_log(job, "train", 1))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(f"loss 1.0\n{ESC}[2J[bold]cleared\n\tend\n".encode())
    served = Served(lt.app)
    yield Cli(lt, served, token, Path(tmp_path / "lowtide.yaml"), job)
    served.close()
    lt.close()


def test_safe_and_clean_make_control_characters_visible_and_markup_literal() -> None:
    assert clean(f"a{ESC}[2Jb\n\tc\x7f\x9b\u202e") == "a\\x1b[2Jb\n\tc\\x7f\\x9b\\u202e"
    assert safe("[/bold]ckpt") == "\\[/bold]ckpt"
    assert safe(f"[red]{ESC}") == "\\[red]\\x1b"


def test_show_prints_hostile_labels_and_messages_literally(cli: Cli) -> None:
    code, out, err = cli.run("show", cli.job)
    assert code == 0, err
    assert "[/bold]ckpt" in out and "\\x1b[2Jwiped" in out and "rtl\\u202eevil" in out
    assert "[red]p" in out and "[/red]x \\x1b]0;t\\x07" in out
    assert ESC not in out and "\u202e" not in out and "\x07" not in out
    code, out, _ = cli.run("show", cli.job, "--json")  # JSON is data: escaped by JSON, not altered
    assert code == 0 and json.loads(out)["checkpoints"][1]["label"] == f"{ESC}[2Jwiped"


def test_logs_are_cleaned_unless_raw(cli: Cli) -> None:
    code, out, _ = cli.run("logs", cli.job, "train")
    assert code == 0 and out == "loss 1.0\n\\x1b[2J[bold]cleared\n\tend\n"
    code, out, _ = cli.run("logs", cli.job, "train", "--raw")
    assert code == 0 and out == f"loss 1.0\n{ESC}[2J[bold]cleared\n\tend\n"


def test_errors_from_the_api_and_from_specs_print_literally(cli: Cli, tmp_path: Path) -> None:
    code, _, err = cli.run("show", "[red]x")
    assert code == 2 and "[red]x" in err and "not found" in err and "Traceback" not in err
    spec = tmp_path / "bad.yaml"
    spec.write_text('use: "[/red]x"\n')
    code, _, err = cli.run("validate", str(spec))
    assert code == 2, err
    assert "unknown template '[/red]x'" in err and "Traceback" not in err
    spec.write_text('name: "[/red]x\\e[2J"\nsteps: [{name: a, command: [x]}]\n')  # YAML "\e" is ESC
    code, _, err = cli.run("validate", str(spec))
    assert code == 2 and "'[/red]x\\x1b[2J' is not a valid name" in err and ESC not in err
    code, _, err = cli.run("submit", str(spec))
    assert code == 2 and "[/red]x\\x1b[2J" in err and ESC not in err


def test_help_texts_keep_their_bracketed_examples(cli: Cli) -> None:
    code, out, _ = cli.run("submit", "--help")
    assert code == 0 and "'tags=[a, b]'" in out and "'opt={beta: 0.9}'" in out
